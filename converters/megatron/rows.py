"""Megatron's name tables expanded over a layout, and a row's TP ranks read into canonical tensors.

A Row is one Megatron tensor (of one pipeline stage's virtual chunk), the canonical tensors
it holds and its transform (`interop.transforms`, bound to the row's shapes): fused QKV,
swiglu fc1 ([gate_r; up_r] per rank), a plain copy, the tied head's copy, or the legacy GroupedMLP's
one tensor for all of an expert-parallel rank's experts.  The transform says what each TP rank stores;
optimizer moments go through the same one as their weight.  A routed expert's row belongs to one
expert-parallel rank (`Row.ep`: expert e is on rank e // (E / ep), local number e % (E / ep)); every
other row is on every EP rank (`ep` None).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ...errors import InteropError
from ...layout import ParallelLayout
from ...memory import BufferPool
from ...mappings.facts import no_place
from ...mappings.megatron_names import (EXPERT_LAYOUTS, IGNORED_SUFFIXES, LEGACY_ALIASES, TABLES, TE_FUSED_MLP_NORM,
                                        TE_MOE_NORM, TIED_HEAD)
from ...params import param_index
from ...spec import ModelSpec
from ...transforms import GroupedExperts, Tied, Transform


class Row:
    """One Megatron tensor of one pipeline stage's virtual chunk, the canonical tensors it holds, and how."""
    __slots__ = ("stage", "chunk", "key", "transform", "parts", "ep")

    def __init__(self, stage, chunk, key, transform: Transform, parts, ep: int | None = None):
        self.stage, self.chunk, self.key, self.transform, self.parts = stage, chunk, key, transform, tuple(parts)
        self.ep = ep


EXPERT_ROWS = {key for table in EXPERT_LAYOUTS.values() for key, _, _ in table}


def _table(scheme: str, experts: str) -> list:
    """The scheme's rows with the routed experts as `experts` (sequential, te_grouped, grouped) lays them out."""
    if experts == "sequential":
        return TABLES[scheme]
    out, placed = [], False
    for row in TABLES[scheme]:
        if row[0] in EXPERT_ROWS:
            if not placed:
                out += EXPERT_LAYOUTS[experts]
                placed = True
            continue
        out.append(row)
    return out


def _layer_rows(key, transform, parts, i, local, spec: ModelSpec, ep: int):
    """(Megatron key, canonical names, ep rank) of template row `key` at global layer `i` (local number `local`):
    one per routed expert for per-expert keys (`{j}` local, `{e}` global), one per EP rank for the
    legacy GroupedMLP (all its experts), one otherwise."""
    if "{e}" not in " ".join(parts):
        yield key.format(i=local), [n.format(i=i) for n in parts], None
        return
    if not spec.is_moe_layer(i):
        return
    per_rank = spec.num_experts // ep
    if transform is GroupedExperts:
        for r in range(ep):
            names = [n.format(i=i, e=e) for e in range(r * per_rank, (r + 1) * per_rank) for n in parts]
            yield key.format(i=local), names, r
        return
    for e in range(spec.num_experts):
        yield key.format(i=local, j=e % per_rank), [n.format(i=i, e=e) for n in parts], e // per_rank


def expand_rows(scheme: str, spec: ModelSpec, layout: ParallelLayout, experts: str = "sequential",
                moe_norm_apart: bool = False) -> list[Row]:
    """Every Megatron tensor of the model, per (stage, chunk), in Megatron's module order.

    `experts`: how routed experts are stored (`EXPERT_LAYOUTS`); `moe_norm_apart`: the TE spec's MoE layers
    keep `pre_mlp_layernorm` (else a MoE layer's norm has the dense layers' name)."""
    present = param_index(spec)
    last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
    rows = []
    for p, chunks in enumerate(layout.stages):
        for v, (start, stop) in enumerate(chunks):
            seen = set()
            for key, transform, parts in _table(scheme, experts):
                if key in seen:
                    continue
                is_layer = "{i}" in key
                if not is_layer:
                    first = key.startswith(("embedding.", "language_model.embedding."))
                    if first and (p, v) != (0, 0) or not first and (p, v) != (last_stage, last_chunk):
                        continue
                for i in (range(start, stop) if is_layer else [None]):
                    if scheme == "mcore_te" and key in TE_MOE_NORM and not (moe_norm_apart and spec.is_moe_layer(i)):
                        continue
                    if scheme == "mcore_te" and key in TE_FUSED_MLP_NORM and moe_norm_apart and spec.is_moe_layer(i):
                        continue
                    if i is None:
                        expanded = [(key, list(parts), None)]
                    else:
                        expanded = _layer_rows(key, transform, parts, i, i - start, spec, layout.ep)
                    for name, names, r in expanded:
                        if all(n in present for n in names):
                            bound = transform.bind(spec, [present[n] for n in names])
                            rows.append(Row(p, v, name, bound, names, r))
                            seen.add(key)
            if spec.tied_embeddings and (p, v) == (last_stage, last_chunk) != (0, 0):
                embedding = present["embed.word.weight"]
                rows.append(Row(p, v, TIED_HEAD[scheme], Tied.bind(spec, [embedding]), [embedding.name]))
    held = {name for row in rows for name in row.parts}
    homeless = [name for name in present if name not in held]
    if homeless:
        raise InteropError(no_place(f"Megatron's {scheme} names", homeless[0]))
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

