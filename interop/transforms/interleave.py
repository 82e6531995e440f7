"""Interleave: two parts' rows alternating."""
from __future__ import annotations

from .base import Transform


class Interleave(Transform):
    """Gate and up rows interleaved, MindFormers r1.5+ w_gate_hidden (convert_utils.ffn_concat_hf2mg;
    the model reshapes it to (ffn, 2, h) and takes [:, 0] as gate, [:, 1] as up).

        canonical gate [g0 g1 g2 g3], up [u0 u1 u2 u3]  ->  stored [g0 u0 g1 u1 g2 u2 g3 u3]
        TP rank t of tp: interleave(gate_t, up_t), which is rows [t*2f/tp, (t+1)*2f/tp) of the whole:
        at tp 2 rank 0 [g0 u0 g1 u1], rank 1 [g2 u2 g3 u3]
    """

    def __init__(self, shapes, axis):
        if len(shapes) != 2 or shapes[0] != shapes[1] or axis not in (0, None):
            raise ValueError(f"Interleave pairs two equal parts split on axis 0, got {shapes}, axis {axis}")
        super().__init__(shapes, axis)

    def pieces(self, full, stored, t=0, tp=1):
        pairs = stored.view(-1, 2, *stored.shape[1:])
        a, b = self.shards(full, t, tp)
        return [(a, pairs[:, 0]), (b, pairs[:, 1])]

    def runs(self, full, t=0, tp=1):
        return None  # one row per run
