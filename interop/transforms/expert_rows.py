"""ExpertRows: every routed expert's transposed matrix stacked as rows (MindFormers' FFNGroupedGEMM)."""
from __future__ import annotations

from .experts import GroupedExperts


class ExpertRows(GroupedExperts):
    """MindFormers' mcore-style grouped experts (parallel_core/training_graph/transformer/moe/ffn.py
    FFNGroupedGEMM): the same bytes as megatron-core's GroupedMLP, shaped by rows of experts.

        fc1: parts gate_0, up_0, gate_1, up_1, ... [f, h]  ->  weight1 [E * h, 2f]
             weight1.view(E, h, 2f)[j] = [gate_j; up_j].T   (its forward: reshape (-1, h, 2f), swiglu on the last axis)
        fc2: parts down_0, down_1, ... [h, f]              ->  weight2 [E * f, h]
             weight2.view(E, f, h)[j] = down_j.T

    The experts are not cut by tensor parallelism there, only placed by expert parallelism (ffn.py shard: w1 / w2
    laid out ("ep", None); sharded_state_dict: axis_fragmentations (ep, 1)), so every TP rank stores the whole
    tensor (at ep 1); `every_expert`: the row lists every expert's parts, expert by expert.
    """

    @property
    def replicated(self) -> bool:
        return True

    @property
    def native_axis(self) -> None:
        return None

    def part_shapes(self, t=0, tp=1):
        return super().part_shapes(0, 1)

    def shards(self, full, t, tp):
        return super().shards(full, 0, 1)

    def rank_shape(self, t=0, tp=1):
        if self.axis == 1:
            return super().rank_shape(t, tp)
        h, columns = super().rank_shape(t, tp)
        return (self.experts * h, columns // self.experts)

    def pieces(self, full, stored, t=0, tp=1):
        if self.axis == 0:  # GroupedMLP's [h, E * 2f] view of the same memory
            stored = stored.view(stored.shape[0] // self.experts, -1)
        return super().pieces(full, stored, t, tp)

    def ep_rows(self, e: int, ep: int) -> tuple[int, int]:
        """The rows [start, stop) of the whole stored tensor that expert-parallel rank e of ep holds: its experts
        e*E/ep .. (e+1)*E/ep - 1, contiguous (MindFormers' ffn.py lays weight1 / weight2 out ("ep", None))."""
        if self.experts % ep:
            raise ValueError(f"ExpertRows: {self.experts} experts do not split over ep={ep}")
        per = self.rank_shape()[0] // ep
        return e * per, (e + 1) * per
