"""SharedInput: one stored tensor that several canonical parts equal (a fused projection's LoRA A)."""
from __future__ import annotations

from ..errors import InteropError
from .base import Transform


class SharedInput(Transform):
    """The LoRA A of a fused projection: q, k and v (or gate and up) read the same input x, so a framework that
    fuses them keeps ONE A [r, in] for the fused weight (Megatron-Bridge's `linear_qkv.adapter.linear_in`, PEFT
    on Phi-3's `qkv_proj` or GPT2's `c_attn`).  The common format keeps an A per projection.

        canonical q.lora_a = k.lora_a = v.lora_a = A [r, in]   ->  stored A [r, in]
        stored A -> every part a copy of it; parts that differ have no such store: refused, never averaged.
        TP: as each part (A of a column-parallel weight is replicated; one part split on columns is a Copy).
    """

    keeps_rows = False  # the parts are not rows of the stored tensor: no fused row moves whole

    def __init__(self, shapes, axis):
        if len({tuple(s) for s in shapes}) != 1:
            raise ValueError(f"SharedInput parts must have one shape, got {shapes}")
        super().__init__(shapes, axis)

    def rank_shape(self, t=0, tp=1):
        return self.part_shapes(t, tp)[0]

    def pieces(self, full, stored, t=0, tp=1):
        return [(x, stored) for x in self.shards(full, t, tp)]

    def runs(self, full, t=0, tp=1):
        return None

    def to_rank(self, parts, t=0, tp=1, out=None):
        shards = self.shards(parts, t, tp)
        for i, x in enumerate(shards[1:], 1):
            if not x.equal(shards[0]):
                raise InteropError(f"the LoRA A of part {i} differs from part 0's, and this target stores one A "
                                   f"for the fused projection ({len(shards)} parts)")
        out = parts[0].new_empty(self.rank_shape(t, tp)) if out is None else out
        return out.copy_(shards[0])
