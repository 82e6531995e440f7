"""WholeCopy and WholeInterleave: a tensor every TP rank stores whole, whatever its canonical split."""
from __future__ import annotations

from .copy import Copy
from .interleave import Interleave


class WholeCopy(Copy):
    """One canonical tensor stored unchanged and whole on every TP rank, though the canonical model cuts it
    (a framework that computes that projection on every rank).

        canonical eh_proj [h, 2h] (column)  ->  every TP rank of tp: all of it

    MindFormers 2.1.0's mcore-style models build these as SequenceParallelLinear (parallel_core/training_graph/
    tensor_parallel/layers.py: axis_fragmentations (1, 1)): the shared experts' linear_fc2 (moe_module_specs.py)
    and the MTP module's eh_proj (multi_token_prediction.py)."""

    @classmethod
    def bind(cls, spec, params) -> "WholeCopy":
        return cls([p.shape for p in params], None)


class WholeInterleave(Interleave):
    """Gate and up rows interleaved (`Interleave`), whole on every TP rank: MindFormers' shared experts'
    linear_fc1 (a SequenceParallelLinear in parallel_core/training_graph/base_models/gpt/moe_module_specs.py).

        canonical gate [f, h], up [f, h] (column)  ->  every TP rank: [g0, u0, g1, u1, ...] [2f, h]"""

    @classmethod
    def bind(cls, spec, params) -> "WholeInterleave":
        return cls([p.shape for p in params], None)
