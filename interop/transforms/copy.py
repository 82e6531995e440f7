"""Copy and Tied: one canonical tensor stored as it is."""
from __future__ import annotations

from .base import Transform


class Copy(Transform):
    """One canonical tensor, stored unchanged.

        canonical x [rows, cols]          ->  stored x [rows, cols]
        TP rank t of tp: x cut on its canonical split axis
            column / vocab (axis 0): rows [t*rows/tp, (t+1)*rows/tp)
            row (axis 1):            columns [t*cols/tp, (t+1)*cols/tp)
            replicated (None):       all of x on every rank
    """

    unchanged = True

    def __init__(self, shapes, axis):
        if len(shapes) != 1:
            raise ValueError(f"{type(self).__name__} stores one tensor, got {len(shapes)}")
        super().__init__(shapes, axis)

    def rank_shape(self, t=0, tp=1):
        return self.part_shapes(t, tp)[0]

    def view(self, full, t=0, tp=1):
        return self.shards(full, t, tp)[0]

    def from_ranks(self, shards, out=None):
        if len(shards) == 1 and out is None:
            return [shards[0]]  # stored as it is: nothing to copy
        return super().from_ranks(shards, out)


class Tied(Copy):
    """The last pipeline stage's copy of the tied input embedding (Megatron `output_layer.weight` /
    `word_embeddings_for_head.weight` at pp > 1): laid out like `Copy` of `embed.word.weight`.
    Megatron keeps it equal to the embedding by an all-reduce, so it is written, never read back."""

    reads_back = False


class RowsSplit(Copy):
    """One canonical tensor, stored unchanged, that TP cuts on its rows (axis 0) whatever its canonical split:
    a projection every rank computes whole but a framework stores as a column-parallel linear.

        canonical x [rows, cols] (replicated) -> TP rank t stores rows [t*rows/tp, (t+1)*rows/tp)

    megatron-core's local layer spec builds multi-latent attention's down projections (`linear_q_down_proj`
    [q_lora_rank, h], `linear_kv_down_proj` [kv_lora_rank + qk_rope_head_dim, h]) as ColumnParallelLinear with
    gather_output=False and gathers their output itself (transformer/multi_latent_attention.py MLASelfAttention:
    "if linear_q_down_proj is ColumnParallelLinear: q_compressed: [s, b, q_lora_rank / TP]"); the Transformer
    Engine spec's TELinear (parallel_mode 'duplicated') holds them whole on every rank (`Copy`)."""

    @classmethod
    def bind(cls, spec, params) -> "RowsSplit":
        return cls([p.shape for p in params], 0)
