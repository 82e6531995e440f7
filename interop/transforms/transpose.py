"""Transpose: stored [in, out] where the canonical tensor is torch Linear's [out, in]."""
from __future__ import annotations

from .base import Transform, concat_pieces


class Transpose(Transform):
    """The parts joined on the output axis, stored transposed (HF GPT2's Conv1D, MindFormers GPT2's
    projection / mapping linears).

        canonical q [o1, in], k [o2, in], v [o3, in]   ->  stored [in, o1 + o2 + o3] = [q; k; v]^T
        one part:  canonical o [out, in]                ->  stored o^T [in, out]
        TP rank t of tp: [q_t; k_t; v_t]^T, each part cut on its canonical axis, so the stored tensor
        is cut on the other axis: native_axis swaps 0 and 1 (a row-parallel [h, ffn] weight stored
        [ffn, h] is cut on stored axis 0).
    """

    keeps_rows = False  # transposed: a stored row gathers a column of each part
    @property
    def native_axis(self):
        return None if self.axis is None else 1 - self.axis

    def rank_shape(self, t=0, tp=1):
        return tuple(reversed(super().rank_shape(t, tp)))

    def view(self, full, t=0, tp=1):
        return self.shards(full, t, tp)[0].t() if len(full) == 1 else None

    def pieces(self, full, stored, t=0, tp=1):
        return concat_pieces(self.shards(full, t, tp), stored.t())

    def runs(self, full, t=0, tp=1):
        return None  # every stored row gathers one column of each part

    def row_order(self):
        raise NotImplementedError("a transposed tensor's rows are the parts' columns")
