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
