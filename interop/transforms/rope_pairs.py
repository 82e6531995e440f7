"""RopePairs: a q or k projection stored for interleaved (complex) rotary embeddings.

The canonical q / k rows of each head are in the rotate-half order HF and Megatron use (the first
half of a head's rows rotate with the second half).  Meta's original Llama code and torchtitan apply
rope to adjacent pairs instead, so they store each head's rows interleaved:

    canonical head rows  [r0, r1, ..., r(d/2-1) | r(d/2), ..., r(d-1)]
    stored head rows     [r0, r(d/2), r1, r(d/2+1), ..., r(d/2-1), r(d-1)]

(torchtitan models/llama3/state_dict_adapter.py: `_reverse_permute` on the way in, `_permute` out.)
Tensor parallelism cuts whole heads (rows), so each rank holds its heads, each permuted alike.
"""
from __future__ import annotations

from .base import Transform


class RopePairs(Transform):
    def __init__(self, shapes, axis, head_dim: int):
        if len(shapes) != 1:
            raise ValueError(f"RopePairs stores one tensor, got {len(shapes)}")
        super().__init__(shapes, axis)
        if head_dim % 2 or self.shapes[0][0] % head_dim:
            raise ValueError(f"RopePairs: {self.shapes[0][0]} rows are not whole heads of an even {head_dim}")
        self.head_dim = head_dim

    @classmethod
    def bind(cls, spec, params):
        return cls([p.shape for p in params], params[0].axis, spec.head_dim)

    def rank_shape(self, t=0, tp=1):
        return self.part_shapes(t, tp)[0]

    def runs(self, full, t=0, tp=1):
        return None  # rows move: no run of a file is a run of the part

    def pieces(self, full, stored, t=0, tp=1):
        x = self.shards(full, t, tp)[0]
        heads, half = x.shape[0] // self.head_dim, self.head_dim // 2
        rest = x.shape[1:]
        canonical = x.view(heads, 2, half, *rest).transpose(1, 2)
        return [(canonical, stored.view(heads, half, 2, *rest))]
