"""GroupedExperts: all of one expert-parallel rank's routed experts in one tensor, each transposed."""
from __future__ import annotations

from .base import Transform


class GroupedExperts(Transform):
    """megatron-core's legacy GroupedMLP (transformer/moe/experts.py): one grouped-GEMM weight per fc for the
    E_l experts of an expert-parallel rank, each expert's matrix transposed ([in, out]), expert after expert
    (its forward reads `weight1.view(E_l, h, -1)` and `weight2.view(E_l, -1, h)`).

        fc1: parts gate_0, up_0, gate_1, up_1, ... [f, h]  ->  weight1 [h, E_l * 2f]
             weight1.view(E_l, h, 2f)[j] = [gate_j; up_j].T
        fc2: parts down_0, down_1, ... [h, f]              ->  weight2 [E_l * f, h]
             weight2.view(E_l, f, h)[j] = down_j.T
        TP rank t of tp (expert tensor parallelism): each part's rank-t shard, so fc1 holds
        [gate_j,t; up_j,t].T (f/tp columns each) and fc2 down_j's columns t*f/tp .. (t+1)*f/tp, transposed.

    A non-gated expert has one fc1 part (up) per expert.  Which experts a rank holds is the row's
    (`interop.rows.expand`: one row per expert-parallel rank): experts r*E_l .. (r+1)*E_l - 1 on EP rank r.
    """

    keeps_rows = False  # transposed: a stored row gathers a column of each part
    every_expert = True  # a row lists the parts of each of its expert-parallel rank's experts, expert by expert
    def __init__(self, shapes, axis, experts: int):
        if axis not in (0, 1) or len(shapes) % experts:
            raise ValueError(f"GroupedExperts: {len(shapes)} parts split on axis {axis} for {experts} experts")
        super().__init__(shapes, axis)
        self.experts = experts

    @classmethod
    def bind(cls, spec, params) -> "GroupedExperts":
        return cls([p.shape for p in params], params[0].axis, len({p.expert for p in params}))

    @property
    def native_axis(self) -> int:
        return 1 - self.axis  # the stored matrices are transposed

    def rank_shape(self, t=0, tp=1):
        shapes = self.part_shapes(t, tp)
        if self.axis == 0:  # fc1: parts [f/tp, h] side by side as columns
            return (shapes[0][1], sum(s[0] for s in shapes))
        return (sum(s[1] for s in shapes), shapes[0][0])  # fc2: parts [h, f/tp] stacked as rows

    def pieces(self, full, stored, t=0, tp=1):
        shards = self.shards(full, t, tp)
        per = len(shards) // self.experts
        if self.axis == 1:
            blocks = stored.view(self.experts, -1, stored.shape[1])
            return [(x, blocks[k].t()) for k, x in enumerate(shards)]
        blocks = stored.view(self.experts, stored.shape[0], -1)
        out = []
        for k, x in enumerate(shards):
            at = sum(s.shape[0] for s in shards[k - k % per:k])  # this part's columns within its expert's block
            out.append((x, blocks[k // per, :, at:at + x.shape[0]].t()))
        return out

    def runs(self, full, t=0, tp=1):
        return None  # transposed: no run of the stored tensor is a run of a part
