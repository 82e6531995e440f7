"""GroupedQKV: q, k and v fused per KV (query) group."""
from __future__ import annotations

from .base import Transform


class GroupedQKV(Transform):
    """q, k, v fused per KV group: Megatron linear_qkv / query_key_value, MindSpeed qkv_proj,
    MindFormers r1.5+ w_qkv (weights [rows, h] and biases [rows] alike).

        heads 4, groups 2, head_dim d:  q = [q0 q1 q2 q3], k = [k0 k1], v = [v0 v1] (blocks of d rows)
        stored = [q0 q1 k0 v0 | q2 q3 k1 v1]   per group g: its heads/groups q heads, then k_g, then v_g
        TP rank t of tp holds whole groups [t*G/tp, (t+1)*G/tp): at tp 2 rank 0 [q0 q1 k0 v0],
        rank 1 [q2 q3 k1 v1] -- an even cut of the stored tensor, and the fusion of the rank's own q, k, v.

    (megatron/core/transformer/attention.py SelfAttention.get_query_key_value_tensors views the
    output as [groups, (heads/groups + 2) * head_dim]; MindFormers convert_utils.qkv_concat_hf2mg.)
    """

    def __init__(self, shapes, axis, groups: int):
        if len(shapes) != 3:
            raise ValueError(f"GroupedQKV stores q, k and v, got {len(shapes)} parts")
        super().__init__(shapes, axis)
        self.groups = groups
        for s in self.shapes:
            if s[0] % groups:
                raise ValueError(f"{s[0]} rows do not split into {groups} groups")

    @classmethod
    def bind(cls, spec, params):
        return cls([p.shape for p in params], params[0].axis, spec.kv_groups)

    def __repr__(self):
        return f"GroupedQKV({self.shapes}, axis={self.axis}, groups={self.groups})"

    def pieces(self, full, stored, t=0, tp=1):
        per_rank = self.groups // tp
        q_rows, kv_rows = self.shapes[0][0] // self.groups, self.shapes[1][0] // self.groups
        rest = tuple(stored.shape[1:])
        mine = slice(t * per_rank, (t + 1) * per_rank)
        grouped = stored.view(per_rank, q_rows + 2 * kv_rows, *rest)
        q, k, v = (x.view(self.groups, -1, *rest)[mine] for x in full)
        return [(q, grouped[:, :q_rows]), (k, grouped[:, q_rows:q_rows + kv_rows]),
                (v, grouped[:, q_rows + kv_rows:])]

    def runs(self, full, t=0, tp=1):
        per_rank = self.groups // tp
        sizes = [x.numel() // self.groups for x in full]  # elements per group in q, k, v
        return [(x, g * n, (g + 1) * n) for g in range(t * per_rank, (t + 1) * per_rank) for x, n in zip(full, sizes)]
