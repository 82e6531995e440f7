"""The DCP format's own options (torch-free): --model-config as for every HF-named source, and the
layout the writer writes (converters/dcp.py LAYOUTS)."""
from __future__ import annotations

from ..formats import FormatOption
from .hf_named_options import OPTIONS as HF_NAMED

OPTIONS = HF_NAMED + (
    FormatOption("dcp_layout", {"convert": "DCP output: accelerate (FSDP's SHARDED_STATE_DICT, model.<HF name> in "
                                           "pytorch_model_fsdp_0/) or torchtitan (its step-N names, q/k for "
                                           "interleaved rope). [accelerate]"}, choices=("accelerate", "torchtitan")),
)
