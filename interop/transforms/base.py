"""What every transform shares: the parts' shapes and split axis, and both directions built on `pieces`.

A transform is bound to one stored tensor's canonical parts (`Transform.bind(spec, params)`:
their shapes, the axis tensor parallelism cuts them on, and what the spec says about heads).
Name tables name the class; converters bind it per row and call its methods:

    rank_shape(t, tp)            the shape TP rank t of tp stores
    pieces(full, stored, t, tp)  (view of a canonical part, view of rank t's stored tensor) pairs
                                 that hold the same values: both directions copy through them
    runs(full, t, tp)            element ranges of the (contiguous) parts in the order rank t stores
                                 them, so a file can be read straight into the parts; None if too fine
    to_rank / from_ranks         rank t's stored tensor from the parts, the parts from every rank's
    fuse / split                 the same at tp 1: the whole stored tensor
    native_axis                  the stored tensor's axis TP cuts (for MindSpore strategy files)
    fused_rows(t, tp)            the whole stored tensor's row ranges that rank t stores, in its order
    rank_from_fused / fused_from_ranks   rank t's stored tensor from the whole stored one and back,
                                 without the canonical parts: how a fused row moves between two
                                 formats that store it alike (`==`: same class, shapes, axis, groups...)

The framework rule every subclass keeps: rank t stores the fusion of each part's rank-t shard
(`shard_box` on the canonical split axis).  `tests/core/test_transforms.py` checks it for each.
Importing this package does not import torch (name tables import it; `interop inspect` stays torch-free).
"""
from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

from ..shards import shard_box

if TYPE_CHECKING:
    import torch


class Transform:
    """Canonical parts (torch Linear orientation, [out, in] or 1-D) <-> one stored tensor."""

    reads_back = True  # False for a stored copy that is written but never read (a tied head's copy)
    keeps_rows = True  # False when a rank's stored rows are not whole rows of the whole stored tensor (Transpose...)
    every_expert = False  # True when one stored tensor holds a tensor of every expert (of its EP rank): Stack
    unchanged = False  # True when the stored tensor IS the one canonical tensor at tp 1 (its bytes copy as they are)
    # False when the stored tensor holds a band of its one canonical tensor and other rows the rest (HeadRows): a
    # reader fills the canonical tensor from each of them, a writer stores it into each
    covers_part = True

    def __init__(self, shapes, axis: int | None):
        self.shapes = [tuple(s) for s in shapes]
        self.axis = axis

    @classmethod
    def bind(cls, spec, params) -> "Transform":
        """This transform for one row: `params` are the canonical `Param`s it stores, in table order."""
        return cls([p.shape for p in params], params[0].axis)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shapes}, axis={self.axis})"

    def _key(self) -> tuple:
        return (type(self),) + tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in vars(self).items()))

    def __eq__(self, other) -> bool:
        """Two formats store a row alike: same class and the same parameters (shapes, axis, groups, ...)."""
        return isinstance(other, Transform) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    # -- what a rank holds -------------------------------------------------------------------------
    @property
    def replicated(self) -> bool:
        """Every TP rank stores the whole tensor (norms, row-parallel biases)."""
        return self.axis is None

    @property
    def native_axis(self) -> int | None:
        """The stored tensor's axis that TP cuts (None: replicated)."""
        return self.axis

    def part_shapes(self, t: int = 0, tp: int = 1) -> list[tuple[int, ...]]:
        """Each part's rank-t shard shape."""
        return [shard_box(s, self.axis, t, tp).shape for s in self.shapes]

    def rank_shape(self, t: int = 0, tp: int = 1) -> tuple[int, ...]:
        """The parts' shards joined on axis 0 (every fused layout here keeps that shape)."""
        shapes = self.part_shapes(t, tp)
        return (sum(s[0] for s in shapes),) + shapes[0][1:]

    def shards(self, full, t: int, tp: int) -> list[torch.Tensor]:
        """Views of rank t's shard of each full canonical part."""
        return [x[shard_box(s, self.axis, t, tp).slices()] for x, s in zip(full, self.shapes)]

    # -- the primitives, by default for parts whose shards are joined one after another on axis 0 --
    def pieces(self, full, stored, t: int = 0, tp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return concat_pieces(self.shards(full, t, tp), stored)

    def runs(self, full, t: int = 0, tp: int = 1) -> list[tuple[torch.Tensor, int, int]] | None:
        """One run per part (its rank-t rows); None when TP cuts columns (a short run per row)."""
        out = []
        for x, shape in zip(full, self.shapes):
            box = shard_box(shape, self.axis, t, tp)
            if box.shape[1:] != shape[1:]:
                return None
            n = x[0].numel()
            out.append((x, box.offset[0] * n, (box.offset[0] + box.shape[0]) * n))
        return out

    def expert_slice(self) -> "Transform | None":
        """When the stored tensor's first axis counts experts, each expert's parts alike (Stack, InterleavedExperts),
        the transform of one expert's slice `stored[e:e + 1]`, whose parts are that expert's: a reader can then
        read and split one expert at a time.  None otherwise."""
        return None

    def view(self, full, t: int = 0, tp: int = 1) -> torch.Tensor | None:
        """Rank t's stored tensor as a view of one part (maybe strided), when it is one; else None."""
        return None

    # -- both directions ---------------------------------------------------------------------------
    def to_rank(self, parts, t: int = 0, tp: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank t's stored tensor (contiguous): a view when it is one contiguous slice of a part, else
        built in `out` (of the rank's shape; a caller that writes it at once can reuse it)."""
        piece = self.view(parts, t, tp)
        if piece is not None and piece.is_contiguous():
            return piece
        if out is None:
            out = parts[0].new_empty(self.rank_shape(t, tp))
        if piece is not None:
            return out.copy_(piece)
        for full, stored in self.pieces(parts, out, t, tp):
            stored.copy_(full)
        return out

    def from_ranks(self, shards, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The full canonical parts from every TP rank's stored tensor, each copied straight into place."""
        tp = len(shards)
        if out is None:
            out = [shards[0].new_empty(s) for s in self.shapes]
        for t, shard in enumerate(shards):
            for full, stored in self.pieces(out, shard, t, tp):
                full.copy_(stored)
        return out

    def fuse(self, parts, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole stored tensor (tp 1) from the canonical parts."""
        return self.to_rank(parts, 0, 1, out)

    def split(self, stored) -> list[torch.Tensor]:
        """The canonical parts from the whole stored tensor (tp 1)."""
        return self.from_ranks([stored])

    # -- the whole stored tensor, re-sliced without the canonical parts ---------------------------------
    def fused_rows(self, t: int = 0, tp: int = 1) -> tuple[tuple[int, int], ...] | None:
        """The row ranges [start, stop) of the whole stored tensor (tp 1) that TP rank t stores, in the
        order it stores them; None when a rank's tensor is not made of whole rows of it (transposed,
        stacked, or cut on columns).  GroupedQKV: one range (a rank holds whole groups); GatedMLP: two
        ([gate_t; up_t])."""
        if not self.keeps_rows or self.axis not in (0, None):
            return None
        return _fused_rows(self, t, tp)

    def rank_from_fused(self, fused, t: int = 0, tp: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank t's stored tensor from the whole stored tensor: a view when it is one range of rows, else
        its ranges copied into `out` (of the rank's shape) or a new tensor."""
        ranges = self.fused_rows(t, tp)
        if len(ranges) == 1:
            return fused[ranges[0][0]:ranges[0][1]]
        if out is None:
            out = fused.new_empty(self.rank_shape(t, tp))
        at = 0
        for start, stop in ranges:
            out[at:at + stop - start].copy_(fused[start:stop])
            at += stop - start
        return out

    def fused_from_ranks(self, shards, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole stored tensor from every TP rank's stored tensor, each range copied into place."""
        tp = len(shards)
        if out is None:
            out = shards[0].new_empty(self.rank_shape())
        for t, shard in enumerate(shards):
            at = 0
            for start, stop in self.fused_rows(t, tp):
                out[start:stop].copy_(shard[at:at + stop - start])
                at += stop - start
        return out

    def row_order(self) -> list[list[int]]:
        """For each part, the whole stored tensor's rows that hold its rows, in order: the layout as row
        indices, for another tensor library to apply by gathering rows (the trainer's MindSpore model does,
        so that its autodiff reaches the stored tensor).  For transforms that keep rows whole (not Transpose, Stack)."""
        import torch
        shape = self.rank_shape()
        rows = torch.arange(shape[0]).view(-1, *[1] * (len(shape) - 1)).expand(shape).contiguous()
        return [part.reshape(part.shape[0], -1)[:, 0].tolist() for part in self.split(rows)]


@functools.lru_cache(maxsize=512)
def _fused_rows(transform: Transform, t: int, tp: int) -> tuple[tuple[int, int], ...]:
    """`Transform.fused_rows`, found by running the transform on row numbers: the parts of the numbered
    whole (1-D, one number per row) re-fused for rank t say which rows it stores.  Equal transforms share it."""
    import torch
    probe = copy.copy(transform)
    probe.shapes = [s[:1] for s in transform.shapes]
    numbers = torch.arange(probe.rank_shape()[0])
    mine = probe.to_rank(probe.split(numbers), t, tp).tolist()
    ranges: list[list[int]] = []
    for row in mine:
        if ranges and ranges[-1][1] == row:
            ranges[-1][1] += 1
        else:
            ranges.append([row, row + 1])
    return tuple((a, b) for a, b in ranges)


def first_expert(transform: Transform, per: int) -> Transform:
    """`transform` bound to its first `per` parts only: one expert's slice of a tensor whose first axis counts
    experts (every expert's parts have the same shapes, so it serves every expert)."""
    one = copy.copy(transform)
    one.shapes = transform.shapes[:per]
    return one


def concat_pieces(shards, stored) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(shard, its rows of `stored`) for shards joined one after another on axis 0."""
    out, at = [], 0
    for x in shards:
        out.append((x, stored[at:at + x.shape[0]]))
        at += x.shape[0]
    return out
