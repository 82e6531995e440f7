"""Megatron's name tables expanded over a layout, and fusing/unfusing a row's tensors per TP rank.

A Row is one Megatron tensor (of one pipeline stage's virtual chunk) and the canonical
tensors it holds: fused QKV, swiglu fc1 ([gate_r; up_r] per rank), a plain copy, or the legacy
GroupedMLP's one tensor for all of an expert-parallel rank's experts.  A routed expert's row
belongs to one expert-parallel rank (`Row.ep`); every other row is on every EP rank (`ep` None).
Optimizer moments go through the same functions as the weights they belong to.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ...errors import InteropError
from ...layout import ParallelLayout
from ...memory import BufferPool
from ...mappings.megatron_names import (EXPERT_LAYOUTS, IGNORED_SUFFIXES, LEGACY_ALIASES, TABLES, TE_FUSED_MLP_NORM,
                                        TE_MOE_NORM, TIED_HEAD)
from ...params import param_index
from ...shards import shard_box
from ...spec import ModelSpec


class Row:
    """One Megatron tensor of one pipeline stage's virtual chunk, and the canonical tensors it holds."""
    __slots__ = ("stage", "chunk", "key", "kind", "parts", "ep")

    def __init__(self, stage, chunk, key, kind, parts, ep=None):
        self.stage, self.chunk, self.key, self.kind, self.parts, self.ep = stage, chunk, key, kind, tuple(parts), ep


GROUPED = ("grouped_fc1", "grouped_fc2")
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


def _layer_rows(key, kind, parts, i, local, spec: ModelSpec, ep: int):
    """(Megatron key, canonical names, ep rank) of template row `key` at global layer `i` (local number `local`):
    one per routed expert for per-expert keys (`{j}` local, `{e}` global), one per EP rank for the
    legacy GroupedMLP, one otherwise."""
    if "{e}" not in " ".join(parts):
        yield key.format(i=local), [n.format(i=i) for n in parts], None
        return
    if not spec.is_moe_layer(i):
        return
    per_rank = spec.num_experts // ep
    if kind in GROUPED:
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
            for key, kind, parts in _table(scheme, experts):
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
                        expanded = _layer_rows(key, kind, parts, i, i - start, spec, layout.ep)
                    for name, names, r in expanded:
                        if all(n in present for n in names):
                            rows.append(Row(p, v, name, kind, names, r))
                            seen.add(key)
            if spec.tied_embeddings and (p, v) == (last_stage, last_chunk) != (0, 0):
                rows.append(Row(p, v, TIED_HEAD[scheme], "tied", ["embed.word.weight"]))
    held = {name for row in rows for name in row.parts}
    homeless = [name for name in present if name not in held]
    if homeless:
        raise InteropError(f"Megatron's {scheme} names have no place for {homeless[0]} "
                           f"(e.g. q/k norms need megatron-core, not the legacy model)")
    return rows


def rank_shapes(row: Row, index, tp: int, t: int) -> tuple[int, ...]:
    """The shape TP rank `t` holds of `row`'s Megatron tensor."""
    first = index[row.parts[0]]
    if row.kind in ("qkv", "fc1"):
        return (sum(index[n].shape[0] for n in row.parts) // tp,) + first.shape[1:]
    if row.kind == "grouped_fc1":  # [h, E_local * 2F/tp]
        return (first.shape[1], sum(index[n].shape[0] for n in row.parts) // tp)
    if row.kind == "grouped_fc2":  # [E_local * F/tp, h]
        return (sum(index[n].shape[1] for n in row.parts) // tp, first.shape[0])
    return shard_box(first.shape, first.axis, t, tp).shape


def rank_pieces(row: Row, full: list[torch.Tensor], shard: torch.Tensor, index, tp: int, t: int, spec: ModelSpec):
    """(view of a full canonical tensor, view of rank `t`'s Megatron tensor) pairs holding the same values.

    Both directions copy through these views, once per byte: no per-part splits, no concatenation.
    QKV: per query group the rank holds [its q heads; k_g; v_g]; swiglu fc1: [gate_r; up_r].
    """
    if row.kind == "qkv":
        groups, d = spec.kv_groups, spec.head_dim
        per_rank, q_rows = groups // tp, spec.heads // groups * d
        rest = tuple(shard.shape[1:])
        mine = slice(t * per_rank, (t + 1) * per_rank)
        stored = shard.view(per_rank, q_rows + 2 * d, *rest)
        q, k, v = (x.view(groups, -1, *rest)[mine] for x in full)
        return [(q, stored[:, :q_rows]), (k, stored[:, q_rows:q_rows + d]), (v, stored[:, q_rows + d:])]
    if row.kind == "fc1":
        half = shard.shape[0] // 2
        return [(x[t * half:(t + 1) * half], shard[j * half:(j + 1) * half]) for j, x in enumerate(full)]
    if row.kind == "grouped_fc1":  # per local expert a [h, 2F/tp] block: (its [gate_r; up_r]).T
        per_expert = len(full) // _local_experts(row, spec)  # 2 gated, 1 not
        h = shard.shape[0]
        blocks = shard.view(_local_experts(row, spec), h, -1)
        n = blocks.shape[2] // per_expert
        return [(x[t * n:(t + 1) * n], blocks[k // per_expert, :, (k % per_expert) * n:(k % per_expert + 1) * n].t())
                for k, x in enumerate(full)]
    if row.kind == "grouped_fc2":  # per local expert a [F/tp, h] block: its linear_fc2.T
        blocks = shard.view(len(full), -1, shard.shape[1])
        n = blocks.shape[1]
        return [(x[:, t * n:(t + 1) * n], blocks[k].t()) for k, x in enumerate(full)]
    return [(full[0][shard_box(full[0].shape, index[row.parts[0]].axis, t, tp).slices()], shard)]


def _local_experts(row: Row, spec: ModelSpec) -> int:
    return len({n.split(".experts.")[1].split(".")[0] for n in row.parts})


def rank_runs(row: Row, full: list[torch.Tensor], index, tp: int, t: int, spec: ModelSpec) -> list[tuple] | None:
    """(full tensor, start, stop) element ranges of the (contiguous) full canonical tensors, in the order rank
    `t`'s Megatron tensor stores the same elements: a rank file can be read straight into them
    (`LazyTorchFile.read_into`).  None for a split on dim 1, whose runs are single rows."""
    if row.kind in GROUPED:
        return None  # transposed blocks
    if row.kind == "qkv":
        per_rank = spec.kv_groups // tp
        sizes = [x.numel() // spec.kv_groups for x in full]  # elements per query group in q, k, v
        return [(x, g * n, (g + 1) * n) for g in range(t * per_rank, (t + 1) * per_rank) for x, n in zip(full, sizes)]
    if row.kind == "fc1":
        n = full[0].numel() // tp
        return [(x, t * n, (t + 1) * n) for x in full]
    x = full[0]
    box = shard_box(x.shape, index[row.parts[0]].axis, t, tp)
    if box.shape[1:] != x.shape[1:]:
        return None  # split on dim 1: a short run per row
    n = x[0].numel()
    return [(x, box.offset[0] * n, (box.offset[0] + box.shape[0]) * n)]


def read_ranks(row: Row, read_into, tp: int, dtype: torch.dtype, index, spec: ModelSpec,
               memory: BufferPool, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The row's full canonical tensors, every TP rank's stored tensor read straight into its place.

    `read_into(t, runs)` fills `runs` (see `rank_runs`) from rank `t`'s file; `out`, when given,
    are the (contiguous) tensors to fill.
    """
    out = out or [memory.empty(index[n].shape, dtype) for n in row.parts]
    for t in range(tp):
        runs = rank_runs(row, out, index, tp, t, spec)
        if runs is None:  # one read into a reused buffer and one strided copy beat a read per row
            shard = memory.empty(rank_shapes(row, index, tp, t), dtype)
            read_into(t, [(shard, 0, shard.numel())])
            for full, stored in rank_pieces(row, out, shard, index, tp, t, spec):
                full.copy_(stored)
        else:
            read_into(t, runs)
    return out


def to_rank(row: Row, tensors: list[torch.Tensor], index, tp: int, t: int, spec: ModelSpec,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Rank `t`'s Megatron tensor from the row's full canonical tensors: a view when it is one contiguous
    slice, else built in `out` (of the rank's shape; a caller that writes it at once can reuse it)."""
    if row.kind not in ("qkv", "fc1", *GROUPED):
        x = tensors[0]
        piece = x[shard_box(x.shape, index[row.parts[0]].axis, t, tp).slices()]
        return piece if piece.is_contiguous() else (piece.contiguous() if out is None else out.copy_(piece))
    shard = torch.empty(rank_shapes(row, index, tp, t), dtype=tensors[0].dtype) if out is None else out
    for full, stored in rank_pieces(row, tensors, shard, index, tp, t, spec):
        stored.copy_(full)
    return shard


def from_ranks(row: Row, shards: list[torch.Tensor], index, spec: ModelSpec) -> list[torch.Tensor]:
    """The row's full canonical tensors from every TP rank's Megatron tensor, each rank copied straight into place."""
    tp = len(shards)
    if tp == 1 and row.kind not in ("qkv", "fc1", *GROUPED):
        return [shards[0]]
    out = [torch.empty(index[n].shape, dtype=shards[0].dtype) for n in row.parts]
    for t, shard in enumerate(shards):
        for full, stored in rank_pieces(row, out, shard, index, tp, t, spec):
            full.copy_(stored)
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

