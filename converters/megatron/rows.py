"""Megatron's name tables expanded over a layout, and fusing/unfusing a row's tensors per TP rank.

A Row is one Megatron tensor (of one pipeline stage's virtual chunk) and the canonical
tensors it holds: fused QKV, swiglu fc1 ([gate_r; up_r] per rank), or a plain copy.
Optimizer moments go through the same functions as the weights they belong to.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ...fused import fuse_concat, fuse_qkv_grouped, split_concat, split_qkv_grouped
from ...layout import ParallelLayout
from ...mappings.megatron_names import IGNORED_SUFFIXES, LEGACY_ALIASES, TABLES, TIED_HEAD
from ...params import param_index
from ...shards import shard_box
from ...spec import ModelSpec


class Row:
    """One Megatron tensor of one pipeline stage's virtual chunk, and the canonical tensors it holds."""
    __slots__ = ("stage", "chunk", "key", "kind", "parts")

    def __init__(self, stage, chunk, key, kind, parts):
        self.stage, self.chunk, self.key, self.kind, self.parts = stage, chunk, key, kind, tuple(parts)


def expand_rows(scheme: str, spec: ModelSpec, layout: ParallelLayout) -> list[Row]:
    """Every Megatron tensor of the model, per (stage, chunk), in Megatron's module order."""
    present = param_index(spec)
    last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
    rows = []
    for p, chunks in enumerate(layout.stages):
        for v, (start, stop) in enumerate(chunks):
            seen = set()
            for key, kind, parts in TABLES[scheme]:
                if key in seen:
                    continue
                is_layer = "{i}" in key
                if not is_layer:
                    first = key.startswith(("embedding.", "language_model.embedding."))
                    if first and (p, v) != (0, 0) or not first and (p, v) != (last_stage, last_chunk):
                        continue
                for i in (range(start, stop) if is_layer else [None]):
                    names = [n.format(i=i) for n in parts]
                    if all(n in present for n in names):
                        rows.append(Row(p, v, key.format(i=None if i is None else i - start), kind, names))
                        seen.add(key)
            if spec.tied_embeddings and (p, v) == (last_stage, last_chunk) != (0, 0):
                rows.append(Row(p, v, TIED_HEAD[scheme], "tied", ["embed.word.weight"]))
    return rows


def rank_shapes(row: Row, index, tp: int, t: int) -> tuple[int, ...]:
    """The shape TP rank `t` holds of `row`'s Megatron tensor."""
    first = index[row.parts[0]]
    if row.kind in ("qkv", "fc1"):
        return (sum(index[n].shape[0] for n in row.parts) // tp,) + first.shape[1:]
    return shard_box(first.shape, first.axis, t, tp).shape


def to_rank(row: Row, tensors: list[torch.Tensor], index, tp: int, t: int, spec: ModelSpec) -> torch.Tensor:
    """Rank `t`'s Megatron tensor from the row's full canonical tensors."""
    shards = [x[shard_box(x.shape, index[n].axis, t, tp).slices()] for n, x in zip(row.parts, tensors)]
    if row.kind == "qkv":
        return fuse_qkv_grouped(*shards, spec.kv_groups // tp)
    if row.kind == "fc1":
        return fuse_concat(*shards)
    return shards[0]


def from_ranks(row: Row, shards: list[torch.Tensor], index, spec: ModelSpec) -> list[torch.Tensor]:
    """The row's full canonical tensors from every TP rank's Megatron tensor."""
    tp = len(shards)
    if row.kind == "qkv":
        per = [split_qkv_grouped(s, spec.kv_groups // tp, spec.heads // tp, spec.head_dim) for s in shards]
    elif row.kind == "fc1":
        per = [split_concat(s, [s.shape[0] // 2, s.shape[0] // 2]) for s in shards]
    else:
        per = [[s] for s in shards]
    out = []
    for j, name in enumerate(row.parts):
        axis = index[name].axis
        out.append(per[0][j].contiguous() if axis is None else torch.cat([p[j] for p in per], dim=axis))
    return out


def flatten(state, prefix: str = "") -> "OrderedDict[str, object]":
    """Nested module dicts (legacy `model`) as one dict of dotted keys, in their stored order."""
    out = OrderedDict()
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def legacy_key(key: str) -> str:
    return ".".join(LEGACY_ALIASES.get(c, c) for c in key.split("."))


def ignored_why(key: str) -> str | None:
    return next((why for suffix, why in IGNORED_SUFFIXES.items() if key.endswith(suffix)), None)

