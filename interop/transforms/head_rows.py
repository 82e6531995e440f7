"""HeadRows: one stored tensor holding a band of every head's rows of one canonical tensor.

A canonical projection whose rows are laid out head by head (`heads` blocks of `per_head` rows) may be stored as
several tensors, each keeping rows [lo, hi) of every head: MindSpeed-LLM's `--mla-mm-split` stores multi-latent
attention's `attn.q_up` as `linear_qk_nope` (each head's qk_nope rows) and `linear_qk_rope` (its rope rows), and
`attn.kv_up` as `linear_kv_nope` and `linear_v` (convert_hf2mg.py set_model_layer_attn: reshape to
[heads, per_head, in], torch.split on dim 1, reshape to [heads * band, in], torch.chunk over tp on dim 0).  Each
band is one row of a name table; together the bands cover the canonical tensor, every row read into the same one.

    canonical x [heads * per_head, cols] viewed [heads, per_head, cols]
    stored  x[:, lo:hi, :] as [heads * (hi - lo), cols]
    TP rank t of tp: heads [t*heads/tp, (t+1)*heads/tp), its band of each
"""
from __future__ import annotations

from .base import Transform


class HeadRows(Transform):
    """Rows [lo, hi) of each of `heads` blocks of `per_head` rows of one canonical tensor; TP cuts by heads.
    Subclasses name the band a spec gives (`band(spec)` -> (per_head, lo, hi))."""

    covers_part = False  # the stored tensor holds only a band of the canonical tensor: other rows hold the rest

    def __init__(self, shapes, axis, heads: int, per_head: int, lo: int, hi: int):
        if len(shapes) != 1 or axis != 0 or shapes[0][0] != heads * per_head or not 0 <= lo < hi <= per_head:
            raise ValueError(f"{type(self).__name__}: rows [{lo}, {hi}) of {heads} heads of {per_head} rows do not fit "
                             f"{shapes} split on axis {axis}")
        super().__init__(shapes, axis)
        self.heads, self.per_head, self.lo, self.hi = heads, per_head, lo, hi

    @staticmethod
    def band(spec) -> tuple[int, int, int]:
        raise NotImplementedError

    @classmethod
    def bind(cls, spec, params) -> "HeadRows":
        per_head, lo, hi = cls.band(spec)
        return cls([p.shape for p in params], params[0].axis, spec.heads, per_head, lo, hi)

    def _heads(self, t: int, tp: int) -> tuple[int, int]:
        if self.heads % tp:
            raise ValueError(f"{self.heads} heads do not split over tp {tp}")
        n = self.heads // tp
        return t * n, (t + 1) * n

    def rank_shape(self, t=0, tp=1):
        first, last = self._heads(t, tp)
        return ((last - first) * (self.hi - self.lo),) + self.shapes[0][1:]

    def pieces(self, full, stored, t=0, tp=1):
        first, last = self._heads(t, tp)
        x = full[0]
        heads = x.view(self.heads, self.per_head, *x.shape[1:])[first:last, self.lo:self.hi]
        return [(heads, stored.view(last - first, self.hi - self.lo, *x.shape[1:]))]

    def runs(self, full, t=0, tp=1):
        return None  # a band of each head: strided

    def fused_rows(self, t=0, tp=1):
        return None  # not rows of one whole stored tensor of the canonical parts


class QNopeRows(HeadRows):
    """`attn.q_up`'s qk_nope rows of each head (MindSpeed-LLM `linear_qk_nope`)."""

    @staticmethod
    def band(spec):
        return spec.head_dim, 0, spec.qk_nope_head_dim


class QRopeRows(HeadRows):
    """`attn.q_up`'s rope rows of each head (MindSpeed-LLM `linear_qk_rope`)."""

    @staticmethod
    def band(spec):
        return spec.head_dim, spec.qk_nope_head_dim, spec.head_dim


class KVNopeRows(HeadRows):
    """`attn.kv_up`'s k_nope rows of each head (MindSpeed-LLM `linear_kv_nope`)."""

    @staticmethod
    def band(spec):
        return spec.qk_nope_head_dim + spec.v_head_dim, 0, spec.qk_nope_head_dim


class VRows(HeadRows):
    """`attn.kv_up`'s value rows of each head (MindSpeed-LLM `linear_v`)."""

    @staticmethod
    def band(spec):
        return spec.qk_nope_head_dim + spec.v_head_dim, spec.qk_nope_head_dim, spec.qk_nope_head_dim + spec.v_head_dim
