"""Slice arithmetic: where a rank's shard sits in a global tensor, and what two boxes share.

A Box is a rectangle of a global tensor: an offset and a shape per axis, the way
torch.distributed.checkpoint and Megatron's dist_checkpointing record shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InteropError

if TYPE_CHECKING:  # torch is imported where tensors are touched (assemble), not at start-up
    import torch


@dataclass(frozen=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape) -> "Box":
        return cls(tuple(0 for _ in shape), tuple(shape))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))

    def relative_to(self, outer: "Box") -> "Box":
        return Box(tuple(a - b for a, b in zip(self.offset, outer.offset)), self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def shard_box(shape: tuple[int, ...], axis: int | None, rank: int, world: int) -> Box:
    """The box TP rank `rank` of `world` holds of a tensor split evenly on `axis` (None: all of it)."""
    if axis is None or world == 1:
        return Box.whole(shape)
    if shape[axis] % world:
        raise InteropError(f"dimension {axis} of shape {tuple(shape)} does not split into {world} equal parts")
    part = shape[axis] // world
    offset = [0] * len(shape)
    offset[axis] = rank * part
    sizes = list(shape)
    sizes[axis] = part
    return Box(tuple(offset), tuple(sizes))


def intersect(a: Box, b: Box) -> Box | None:
    """The part two boxes share, or None."""
    offset, shape = [], []
    for ao, an, bo, bn in zip(a.offset, a.shape, b.offset, b.shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return Box(tuple(offset), tuple(shape))


def assemble(box: Box, pieces, dtype: torch.dtype, empty=None) -> torch.Tensor:
    """Fill `box` from (piece_box, read_piece) pairs; each piece is read only where it overlaps.

    `read_piece(common)` returns the part `common` of its piece; `read_piece(common, out)`
    writes it into `out` instead (so a reader can fill the result without a staging copy).
    `empty(shape, dtype)` allocates the result (a `memory.BufferPool` reuses memory; default
    `memory.empty`, imported here: the box arithmetic above is torch-free, for `interop inspect`).
    """
    if empty is None:
        from . import memory
        empty = memory.empty
    for piece_box, read in pieces:
        if intersect(box, piece_box) == box:  # one piece holds all of it: no copy
            return read(box)
    out = empty(box.shape, dtype)
    covered = 0
    for piece_box, read in pieces:
        common = intersect(box, piece_box)
        if common is None:
            continue
        read(common, out[common.relative_to(box).slices()])
        covered += common.numel()
    if covered != box.numel():
        raise InteropError(f"the shards on disk cover {covered} of the {box.numel()} elements asked for")
    return out


def tiling_error(shape, boxes) -> str | None:
    """Why `boxes` do not cover a tensor of `shape` exactly once (every element in one box), or None.

    Boxes must lie inside the shape, hold as many elements as the tensor, and not overlap
    (checked by a sweep along axis 0, so stacked per-layer chunks are compared only with
    their neighbours)."""
    shape = tuple(shape)
    total = 1
    for n in shape:
        total *= n
    held = 0
    for b in boxes:
        if len(b.offset) != len(shape) or len(b.shape) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(b.offset, b.shape, shape)):
            return f"a shard at {list(b.offset)} of shape {list(b.shape)} lies outside the tensor's {list(shape)}"
        held += b.numel()
    if held != total:
        return f"its shards hold {held} elements, the tensor {total} (missing, repeated or overlapping shards)"
    if not shape:
        return None if len(boxes) == 1 else f"a scalar stored in {len(boxes)} shards"
    active: list[Box] = []
    for b in sorted((b for b in boxes if b.numel()), key=lambda b: b.offset):
        active = [a for a in active if a.offset[0] + a.shape[0] > b.offset[0]]
        for a in active:
            if intersect(a, b) is not None:
                return f"shards at {list(a.offset)} and {list(b.offset)} overlap"
        active.append(b)
    return None
