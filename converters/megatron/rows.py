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
from ...errors import InteropError
from ...mappings.megatron_names import (EXPERT_LAYOUTS, IGNORED_SUFFIXES, LEGACY_ALIASES, MLA_TABLES, TABLES,
                                        TE_FUSED_MLP_NORM, TE_MOE_NORM, TIED_HEAD, with_mtp)
from ...params import param_index
from ...rows import Row, check_placed, expand
from ...spec import ModelSpec
from ...transforms import Tied

EXPERT_ROWS = {key for table in EXPERT_LAYOUTS.values() for key, _, _ in table}


def _table(scheme: str, experts: str, spec: ModelSpec) -> list:
    """The scheme's rows for the model (multi-latent attention's, the MTP modules' where it has them) with the
    routed experts as `experts` (sequential, te_grouped, grouped) lays them out."""
    if (spec.is_mla or spec.mtp_layers) and scheme not in MLA_TABLES:
        raise InteropError(f"Megatron's {scheme} model has no multi-latent attention or MTP modules: megatron-core "
                           "names hold them")
    table = MLA_TABLES[scheme] if spec.is_mla else TABLES[scheme]
    if experts != "sequential":
        out, placed = [], False
        for row in table:
            if row[0] in EXPERT_ROWS:
                if not placed:
                    out += EXPERT_LAYOUTS[experts]
                    placed = True
                continue
            out.append(row)
        table = out
    return with_mtp(table, scheme) if spec.mtp_layers else table


_DECODER = "decoder.layers.{i}."


def _layer_template(key: str) -> str:
    """An MTP module's layer key (`mtp.layers.0.transformer_layer.X`, or its template) as a decoder layer's
    template (`decoder.layers.{i}.X`): the rules for a layer's rows apply to it alike."""
    if key.startswith("mtp.layers."):
        return _DECODER + key.split(".transformer_layer.", 1)[1] if ".transformer_layer." in key else key
    return key


def expand_rows(scheme: str, spec: ModelSpec, layout: ParallelLayout, experts: str = "sequential",
                moe_norm_apart: bool = False, numbers: dict | None = None) -> list[Row]:
    """Every Megatron tensor of the model, per (stage, chunk), in Megatron's module order (`interop.rows.expand`
    per chunk, layers numbered from the chunk's first).

    `experts`: how routed experts are stored (`EXPERT_LAYOUTS`); `moe_norm_apart`: the TE spec's MoE layers
    keep `pre_mlp_layernorm` (else a MoE layer's norm has the dense layers' name); `numbers`: {(stage, chunk):
    its layers' local numbers} where they skip some (MindSpeed-LLM's noop layers), else 0, 1, ..."""
    present = param_index(spec)
    last_stage, last_chunk = layout.pp - 1, layout.vpp - 1
    table = _table(scheme, experts, spec)
    rows = []
    for p, chunks in enumerate(layout.stages):
        for v, (start, stop) in enumerate(chunks):
            first_row = len(rows)

            def keep(key, i, here=(p, v)):
                mtp = key.startswith("mtp.")  # MTP modules: on the last chunk, their layer as a decoder layer
                if i is None and not mtp:  # the embedding on the first chunk, the final norm and head on the last
                    first = key.startswith(("embedding.", "language_model.embedding."))
                    return here == (0, 0) if first else here == (last_stage, last_chunk)
                if mtp and here != (last_stage, last_chunk):
                    return False
                moe, key = spec.is_mtp_moe() if mtp else spec.is_moe_layer(i), _layer_template(key)
                if scheme == "mcore_te" and key in TE_MOE_NORM:
                    return moe_norm_apart and moe
                return not (scheme == "mcore_te" and key in TE_FUSED_MLP_NORM and moe_norm_apart and moe)
            rows += expand(table, spec, layers=range(start, stop), first=start, ep=layout.ep, keep=keep,
                           stage=p, chunk=v, present=present, numbers=(numbers or {}).get((p, v)))
            if spec.tied_embeddings and (p, v) == (last_stage, last_chunk) != (0, 0):
                embedding = present["embed.word.weight"]
                rows.append(Row(TIED_HEAD[scheme], Tied.bind(spec, [embedding]), [embedding.name], p, v))
            if spec.mtp_layers and (p, v) == (last_stage, last_chunk) != (0, 0):
                # the MTP modules' own embedding copy (models/gpt/gpt_model.py: built where pre_process or
                # mtp_process; tied to the first stage's by tie_word_embeddings_state_dict)
                embedding = present["embed.word.weight"]
                rows.insert(first_row, Row(TABLES[scheme][0][0], Tied.bind(spec, [embedding]), [embedding.name], p, v))
    check_placed(rows, spec, f"Megatron's {scheme}", "e.g. q/k norms need megatron-core, not the legacy model")
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

