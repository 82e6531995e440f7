"""Stack: one tensor per expert, stacked on a new first axis."""
from __future__ import annotations

from .base import Transform, first_expert, concat_pieces


class Stack(Transform):
    """Experts' tensors stacked on a new first axis: MindFormers MoE ffn.w1 / w2 / w3 [E, out, in]
    (one part per expert), transformers 5's in-memory experts.gate_up_proj [E, 2f, h] (two parts per
    expert, joined on the output axis).  Parts are listed expert by expert.

        per 1:  e0 [f, h], e1 [f, h]                      ->  stored [[e0], [e1]]           [2, f, h]
        per 2:  e0.gate, e0.up, e1.gate, e1.up [f, h]      ->  stored [[e0.gate; e0.up], ...] [2, 2f, h]
        TP rank t of tp: each part cut on its canonical axis, so the stored tensor is cut on
        that axis + 1 (native_axis); with per 2 a rank's slice e is [gate_t; up_t].
    """

    keeps_rows = False  # its first axis counts experts
    every_expert = True  # a name table's row lists its parts for every expert, expert by expert

    def __init__(self, shapes, axis, per: int = 1):
        if per < 1 or len(shapes) % per:
            raise ValueError(f"{len(shapes)} parts do not stack {per} per slice")
        super().__init__(shapes, axis)
        self.per = per

    @classmethod
    def bind(cls, spec, params):
        """Parts per slice: how many of the parts belong to the first part's expert (`Param.expert`)."""
        per = sum(1 for p in params if p.expert == params[0].expert) if params[0].expert is not None else 1
        return cls([p.shape for p in params], params[0].axis, per)

    @property
    def native_axis(self):
        return None if self.axis is None else self.axis + 1

    def expert_slice(self):
        return first_expert(self, self.per)

    def rank_shape(self, t=0, tp=1):
        shapes = self.part_shapes(t, tp)[:self.per]
        return (len(self.shapes) // self.per, sum(s[0] for s in shapes)) + shapes[0][1:]

    def pieces(self, full, stored, t=0, tp=1):
        shards = self.shards(full, t, tp)
        return [piece for e in range(len(shards) // self.per)
                for piece in concat_pieces(shards[e * self.per:(e + 1) * self.per], stored[e])]

    def row_order(self):
        raise NotImplementedError("a stacked tensor's first axis counts experts, not rows")
