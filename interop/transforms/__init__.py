"""Transforms: how a format stores canonical tensors (fused, transposed, interleaved), as objects.

Each class owns both directions (canonical parts -> stored tensor -> parts), what tensor-parallel
rank t stores, and how the split axis maps; its docstring draws the layout.  Name tables in
`mappings/` name the classes; converters bind one per row (`cls.bind(spec, params)`) and call it.
"""
from .base import Transform
from .concat import GatedMLP, PlainConcat, WholeConcat
from .copy import Copy, RowsSplit, Tied
from .experts import GroupedExperts
from .fp8 import BlockScaledFP8
from .grouped_qkv import GroupedQKV
from .head_rows import HeadRows, KVNopeRows, QNopeRows, QRopeRows, VRows
from .interleave import Interleave
from .interleaved_experts import InterleavedExperts
from .mxfp4 import MXFP4
from .rope_pairs import RopePairs
from .shared import SharedInput
from .stack import Stack
from .transpose import Transpose

__all__ = ["Transform", "Copy", "RowsSplit", "Tied", "Transpose", "PlainConcat", "GatedMLP", "GroupedQKV", "Interleave",
           "RopePairs", "Stack", "GroupedExperts", "InterleavedExperts", "BlockScaledFP8", "MXFP4", "SharedInput", "WholeConcat",
           "HeadRows", "QNopeRows", "QRopeRows", "KVNopeRows", "VRows"]
