"""Megatron's name tables expanded over a layout, and a row's TP ranks read into canonical tensors.

A row (`interop.rows.Row`) is one Megatron tensor (of one pipeline stage's virtual chunk), the canonical tensors
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

from ...layout import ParallelLayout
from ...memory import BufferPool
from ...mappings.megatron_names import (EXPERT_LAYOUTS, IGNORED_SUFFIXES, LEGACY_ALIASES, TABLES, TE_FUSED_MLP_NORM,
                                        TE_MOE_NORM, TIED_HEAD, decoder_key, is_mtp_key)
from ...params import param_index
from ...rows import Row, check_placed, expand
from ...spec import ModelSpec
from ...transforms import Tied

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


def expand_rows(scheme: str, spec: ModelSpec, layout: ParallelLayout, experts: str = "sequential",
                moe_norm_apart: bool = False) -> list[Row]:
    """Every Megatron tensor of the model, per (stage, chunk), in Megatron's module order (`interop.rows.expand`
    per chunk, layers numbered from the chunk's first).

    `experts`: how routed experts are stored (`EXPERT_LAYOUTS`); `moe_norm_apart`: the TE spec's MoE layers
    keep `pre_mlp_layernorm` (else a MoE layer's norm has the dense layers' name)."""
    present = param_index(spec)
    last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
    table = _table(scheme, experts)
    rows = []
    for p, chunks in enumerate(layout.stages):
        for v, (start, stop) in enumerate(chunks):
            def keep(key, i, here=(p, v)):
                if is_mtp_key(key):  # an MTP module: on the last chunk, its layer built like the last layer
                    if here != (last_stage, last_chunk):
                        return False
                    key, moe = decoder_key(key), spec.is_mtp_moe()
                elif i is None:  # the embedding on the first chunk, the final norm and head on the last
                    first = key.startswith(("embedding.", "language_model.embedding."))
                    return here == (0, 0) if first else here == (last_stage, last_chunk)
                else:
                    moe = spec.is_moe_layer(i)
                if scheme == "mcore_te" and key in TE_MOE_NORM:
                    return moe_norm_apart and moe
                return not (scheme == "mcore_te" and key in TE_FUSED_MLP_NORM and moe_norm_apart and moe)
            rows += expand(table, spec, layers=range(start, stop), first=start, ep=layout.ep, keep=keep,
                           stage=p, chunk=v, present=present)
            if spec.tied_embeddings and (p, v) == (last_stage, last_chunk) != (0, 0):
                embedding = present["embed.word.weight"]
                rows.append(Row(TIED_HEAD[scheme], Tied.bind(spec, [embedding]), [embedding.name], p, v))
    why = ("multi-latent attention has no Megatron names in interop yet: --to hf or --to interop hold it"
           if spec.is_mla else "MTP modules and q/k norms need megatron-core, not the legacy model")
    check_placed(rows, spec, f"Megatron's {scheme}", why)
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

