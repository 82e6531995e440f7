"""InterleavedExperts: every expert's tensors in one, each expert's parts interleaved on its output axis, matrices
transposed (transformers' GptOssExperts)."""
from __future__ import annotations

from .base import Transform, first_expert


class InterleavedExperts(Transform):
    """HF gpt-oss's fused experts (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py GptOssExperts: `gate_up_proj`
    [E, h, 2f] used as `x @ gate_up_proj[e]`, `_apply_gate` taking gate = `[..., ::2]`, up = `[..., 1::2]`; its bias
    `gate_up_proj_bias` [E, 2f] alike; `down_proj` [E, f, h], `down_proj_bias` [E, h]).  Parts listed expert by
    expert, `per` of them each (gate, up: 2; down: 1):

        2-D, per 2:  e.gate [f, h], e.up [f, h]  ->  stored[e] [h, 2f], stored[e][:, 0::2] = gate.T, [:, 1::2] = up.T
        1-D, per 2:  e.gate [f], e.up [f]        ->  stored[e] [2f],    stored[e][0::2] = gate, [1::2] = up
        2-D, per 1:  e.down [h, f]               ->  stored[e] [f, h] = down.T
        1-D, per 1:  e.down_bias [h]             ->  stored[e] [h]
        TP rank t of tp: each part's rank-t shard in the same places, so a column-split gate/up cuts the stored
        tensor's last axis (rank t holds [g_t0 u_t0 g_t1 u_t1 ...]) and the row-split down its axis 1 (f).
    """

    keeps_rows = False  # its first axis counts experts, and the matrices are transposed
    every_expert = True  # a name table's row lists its parts for every expert, expert by expert

    def __init__(self, shapes, axis, per: int = 1):
        if per < 1 or len(shapes) % per or len({len(s) for s in shapes}) != 1 or len(shapes[0]) not in (1, 2):
            raise ValueError(f"InterleavedExperts: {len(shapes)} parts of shapes {shapes} do not make experts of {per}")
        super().__init__(shapes, axis)
        self.per = per

    @classmethod
    def bind(cls, spec, params):
        """Parts per expert: how many of the parts belong to the first part's expert (`Param.expert`)."""
        per = sum(1 for p in params if p.expert == params[0].expert)
        return cls([p.shape for p in params], params[0].axis, per)

    @property
    def native_axis(self):
        if self.axis is None:
            return None
        if len(self.shapes[0]) == 1:
            return 1
        return 2 if self.axis == 0 else 1  # stored [E, in, out]: out is canonical axis 0, in axis 1

    def expert_slice(self):
        return first_expert(self, self.per)

    def rank_shape(self, t=0, tp=1):
        shapes = self.part_shapes(t, tp)
        experts = len(self.shapes) // self.per
        if len(shapes[0]) == 1:
            return (experts, self.per * shapes[0][0])
        return (experts, shapes[0][1], self.per * shapes[0][0])

    def pieces(self, full, stored, t=0, tp=1):
        shards = self.shards(full, t, tp)
        out = []
        for k, x in enumerate(shards):
            e, p = divmod(k, self.per)
            block = stored[e] if x.dim() == 1 else stored[e].t()  # [per * out, in] or [per * out]
            out.append((x, block[p::self.per]))
        return out

    def to_rank(self, parts, t=0, tp=1, out=None):
        """Expert by expert: its parts stacked row by row ([gate_0; up_0; gate_1; ...], contiguous), then one
        transposed copy into its slice; the same values `pieces` places, without a column-strided scatter per part
        (3x slower at gpt-oss's widths)."""
        import torch
        shards = self.shards(parts, t, tp)
        if out is None:
            out = shards[0].new_empty(self.rank_shape(t, tp))
        for e in range(len(shards) // self.per):
            mine = shards[e * self.per:(e + 1) * self.per]
            rows = mine[0] if self.per == 1 else torch.stack(mine, dim=1).view(-1, *mine[0].shape[1:])
            out[e].copy_(rows if rows.dim() == 1 else rows.t())
        return out

    def runs(self, full, t=0, tp=1):
        return None  # interleaved and transposed: no run of the stored tensor is a run of a part

    def row_order(self):
        raise NotImplementedError("an interleaved experts tensor's first axis counts experts, not rows")
