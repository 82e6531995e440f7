"""The process grid: which tensor-, pipeline- and data-parallel rank this process is.

Ranks are numbered the way Megatron numbers them (tp fastest, then dp, then pp):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the tp ranks of one stage sit next to each other (on one node, where their
frequent all-reduces are cheapest) and the pipeline stages are furthest apart.

Expert parallelism is carved out of data parallelism, as in Megatron (expert tensor
parallel size = tp): dp_rank = ep_rank + ep * edp_rank.  The `ep` consecutive dp replicas
of one block split the experts between them and exchange tokens (the ep group); the
replicas holding the same experts average the experts' gradients (the edp group), while
dense gradients are averaged over all dp replicas.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass
class Grid:
    tp: int
    pp: int
    dp: int
    rank: int
    ep: int = 1
    groups: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank holding my tp/dp position on pipeline stage `pp_rank` (the p2p partner)."""
        return self.rank_of(self.tp_rank, self.dp_rank, pp_rank)

    # Process groups; None when the group has a single member (no communication needed).
    @property
    def tp_group(self):
        return self.groups.get("tp")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    @property
    def ep_group(self):
        """Same tp rank and stage, the ep replicas of one block: they exchange tokens for the experts."""
        return self.groups.get("ep")

    @property
    def edp_group(self):
        """Same tp rank, stage and ep rank: the replicas of the same experts (their gradients are averaged)."""
        return self.groups.get("edp")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    @property
    def embed_group(self):
        """First and last stage, same tp/dp position: they share the tied word embedding."""
        return self.groups.get("embed")


def build_grid(tp: int, pp: int, dp: int, ep: int = 1) -> Grid:
    """Create every process group once; all ranks must call this in the same order (gloo/NCCL rule)."""
    grid = Grid(tp, pp, dp, dist.get_rank(), ep)
    families = {"tp": [], "dp": [], "pp": [], "embed": [], "ep": [], "edp": []}
    for p in range(pp):
        for d in range(dp):
            families["tp"].append([grid.rank_of(t, d, p) for t in range(tp)])
    for p in range(pp):
        for t in range(tp):
            families["dp"].append([grid.rank_of(t, d, p) for d in range(dp)])
            for block in range(dp // ep):
                families["ep"].append([grid.rank_of(t, block * ep + e, p) for e in range(ep)])
            for e in range(ep):
                families["edp"].append([grid.rank_of(t, b * ep + e, p) for b in range(dp // ep)])
    for d in range(dp):
        for t in range(tp):
            stages = [grid.rank_of(t, d, p) for p in range(pp)]
            families["pp"].append(stages)
            families["embed"].append(sorted({stages[0], stages[-1]}))
    for name, members_list in families.items():
        for members in members_list:
            if len(members) == 1:
                continue
            group = dist.new_group(members)
            if grid.rank in members:
                grid.groups[name] = group
    return grid
