"""Megatron's name tables expanded over a layout, and a row's TP ranks read into canonical tensors.

A Row is one Megatron tensor (of one pipeline stage's virtual chunk), the canonical tensors
it holds and its transform (`interop.transforms`, bound to the row's shapes): fused QKV,
swiglu fc1 ([gate_r; up_r] per rank), a plain copy, or the tied head's copy.  The transform
says what each TP rank stores; optimizer moments go through the same one as their weight.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ...errors import InteropError
from ...layout import ParallelLayout
from ...memory import BufferPool
from ...mappings.megatron_names import IGNORED_SUFFIXES, LEGACY_ALIASES, TABLES, TIED_HEAD
from ...params import param_index
from ...spec import ModelSpec
from ...transforms import Tied, Transform


class Row:
    """One Megatron tensor of one pipeline stage's virtual chunk, the canonical tensors it holds, and how."""
    __slots__ = ("stage", "chunk", "key", "transform", "parts")

    def __init__(self, stage, chunk, key, transform: Transform, parts):
        self.stage, self.chunk, self.key, self.transform, self.parts = stage, chunk, key, transform, tuple(parts)


def expand_rows(scheme: str, spec: ModelSpec, layout: ParallelLayout) -> list[Row]:
    """Every Megatron tensor of the model, per (stage, chunk), in Megatron's module order."""
    present = param_index(spec)
    last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
    rows = []
    for p, chunks in enumerate(layout.stages):
        for v, (start, stop) in enumerate(chunks):
            seen = set()
            for key, transform, parts in TABLES[scheme]:
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
                        bound = transform.bind(spec, [present[n] for n in names])
                        rows.append(Row(p, v, key.format(i=None if i is None else i - start), bound, names))
                        seen.add(key)
            if spec.tied_embeddings and (p, v) == (last_stage, last_chunk) != (0, 0):
                embedding = present["embed.word.weight"]
                rows.append(Row(p, v, TIED_HEAD[scheme], Tied.bind(spec, [embedding]), [embedding.name]))
    held = {name for row in rows for name in row.parts}
    homeless = [name for name in present if name not in held]
    if homeless:
        raise InteropError(f"Megatron's {scheme} names have no place for {homeless[0]} "
                           f"(e.g. q/k norms need megatron-core, not the legacy model)")
    return rows


def read_ranks(row: Row, read_into, tp: int, dtype: torch.dtype, memory: BufferPool,
               out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The row's full canonical tensors, every TP rank's stored tensor read straight into its place.

    `read_into(t, runs)` fills `runs` (see `Transform.runs`) from rank `t`'s file; `out`, when given,
    are the (contiguous) tensors to fill.
    """
    fused = row.transform
    out = out or [memory.empty(shape, dtype) for shape in fused.shapes]
    for t in range(tp):
        runs = fused.runs(out, t, tp)
        if runs is None:  # one read into a reused buffer and one strided copy beat a read per row
            shard = memory.empty(fused.rank_shape(t, tp), dtype)
            read_into(t, [(shard, 0, shard.numel())])
            for full, stored in fused.pieces(out, shard, t, tp):
                full.copy_(stored)
        else:
            read_into(t, runs)
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

