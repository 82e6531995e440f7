"""A Megatron `torch` checkpoint's model description and layout: the args (its own, or `--model-config`),
the ModelSpec they make with the padded vocabulary the embedding holds, and the pipeline layout the rank files'
layers give."""
from __future__ import annotations

import re

import torch

from ...errors import InteropError
from ...layout import ParallelLayout
from ...mappings import megatron_args as M
from ...mappings.megatron_names import MINDSPEED_LLM_CONVERTER_ARGS, MINDSPEED_LLM_UNREAD_ARGS, TABLES
from ...mappings.megatron_spec import spec_from_args
from ...model_config import megatron_args_from_file
from ...spec import ModelSpec, vocab_from_rows
from ...tensors import NAME_OF_DTYPE
from .args import check_model_config, explicit_args
from .model_state import ModelState
from .rank_files import RankFiles

LAYER_KEY = re.compile(r"(?:^|\.)(?<!mtp\.)layers\.(\d+)\.")  # decoder layers (legacy: encoder.layers), not MTP modules


def model_args(stored: dict | None, model_config, ranks: RankFiles, notes: list[str]) -> dict:
    """The model's complete Megatron args: from `--model-config`, else from the args the files carry."""
    for key, why in MINDSPEED_LLM_UNREAD_ARGS.items():
        if stored and stored.get(key):
            raise InteropError(f"{ranks.files[(0, 0)].path}: {why} ({key} {stored[key]!r} in its args)")
    if stored and all(k in stored for k in MINDSPEED_LLM_CONVERTER_ARGS):
        if model_config is None:
            raise InteropError(f"{ranks.files[(0, 0)].path}: its args are MindSpeed-LLM's converter's (an HF config's "
                               "fields without its rope scaling, not Megatron's arguments): pass --model-config "
                               "(the HF config.json it was converted from)")
        stored = None  # nothing in Megatron's terms to compare the description with
    if model_config is not None:
        notes.append(f"model description taken from {model_config}")
        full = megatron_args_from_file(model_config)
        check_model_config(stored, full, model_config, ranks.files[(0, 0)].path)
        # the layout and the padded vocab are facts of the files, not of the model description
        full.update(tensor_model_parallel_size=ranks.tp, pipeline_model_parallel_size=ranks.pp)
        return full
    where = ranks.files[(0, 0)].path
    if not stored or not stored.get("num_layers"):
        raise InteropError(f"{where}: the checkpoint carries no model description (no args); "
                           "pass --model-config (a HF config.json, a Megatron args file or a MindSpeed YAML)")
    explicit = explicit_args(stored)
    if not stored.get("swiglu") and "bias_gelu_fusion" not in stored:
        explicit["bias_gelu_fusion"] = False
        if stored.get("add_bias_linear", True) and not stored.get("openai_gelu"):
            notes.append("args do not say bias_gelu_fusion: assumed Megatron's exact (erf) GeLU")
    return M.complete(explicit)


def without_noop(full: dict, notes: list[str]) -> dict:
    """MindSpeed-LLM's args count its --noop-layers (identity layers without weights) in num_layers: the model's
    are the rest, and the per-layer moe_layer_freq list interop writes with them loses the noop positions alike
    (MindSpeed-LLM's layout; the others' noop_layers are read by mappings/megatron_spec.py noop_positions, which
    refuses a per-layer pattern beside them)."""
    text = full.get("noop_layers")
    if not text:
        return full
    noop = {int(x) for x in str(text).split(",")}
    freq = full.get("moe_layer_freq")
    out = dict(full, num_layers=full["num_layers"] - len(noop), noop_layers=None)  # resolved here, in its numbering
    if isinstance(freq, list) and len(freq) == full["num_layers"]:
        out["moe_layer_freq"] = [f for i, f in enumerate(freq) if i not in noop]
    notes.append(f"noop layers at positions {text} (MindSpeed-LLM's identity layers without weights): "
                 f"the {out['num_layers']} real layers of num_layers {full['num_layers']} read")
    return out


def spec_of(full: dict, model: ModelState, ranks: RankFiles, notes: list[str], stated: int | None = None) -> ModelSpec:
    """The ModelSpec: the args, with the padded vocabulary the embedding's rows say (`stated`: the padded size
    the checkpoint's own args state, checked against them)."""
    emb_key = TABLES[model.scheme][0][0]
    rows = 0
    for t in range(ranks.tp):
        emb = model.state_dicts[(t, 0, 0)].get(emb_key)
        if not isinstance(emb, torch.Tensor):
            raise InteropError(f"{ranks.files[(t, 0)].path}: {emb_key} is missing")
        rows += emb.shape[0]
    vocab, rows, vocab_notes = vocab_from_rows(rows, full.get("vocab_size"), stated,
                                               f"{ranks.files[(0, 0)].path}: {emb_key} over tp={ranks.tp}")
    notes += vocab_notes
    full = dict(full, padded_vocab_size=rows, vocab_size=vocab)
    if model.scheme.startswith("mindspeed_llm"):
        full = without_noop(full, notes)
    dtype = NAME_OF_DTYPE.get(emb.dtype, "float32")
    if full.get("untie_embeddings_and_output_weights") is None:
        full["untie_embeddings_and_output_weights"] = False
    return spec_from_args(full, str(ranks.files[(0, 0)].path), dtype)


def local_numbers(model: ModelState, ranks: RankFiles, notes: list[str] | None = None) -> dict:
    """{(stage, chunk): the local layer numbers its files hold, in order}.  Megatron numbers 0..n-1; MindSpeed-LLM's
    --noop-layers leave the noop layers' numbers out (its convert.py generate_pp_local_layer_idx removes them; the
    model builds them as identity layers without weights): a gap is read so in its layout only."""
    out, skipped = {}, 0
    for p in range(ranks.pp):
        for v in range(len(model.chunks[0])):
            layers = sorted({int(m.group(1)) for k in model.state_dicts[(0, p, v)] if (m := LAYER_KEY.search(k))})
            if layers != list(range(len(layers))):
                if not model.scheme.startswith("mindspeed_llm"):
                    raise InteropError(f"{ranks.files[(0, p)].path}: layer numbers {layers} are not 0..n-1 "
                                       "(Megatron numbers layers locally per stage; only MindSpeed-LLM's layout "
                                       "skips numbers, for its --noop-layers)")
                skipped += (layers[-1] + 1 if layers else 0) - len(layers)
            out[(p, v)] = layers
    if skipped and notes is not None:
        notes.append(f"{skipped} local layer numbers skipped by MindSpeed-LLM's noop layers (identity layers "
                     "without weights): the layers read in their order")
    return out


def layout_of(spec: ModelSpec, model: ModelState, ranks: RankFiles, numbers: dict) -> ParallelLayout:
    """The layout: the layers each stage's chunks hold (`numbers`: their local numbers), the parallel sizes."""
    vpp = len(model.chunks[0])
    counts = {}
    for p in range(ranks.pp):
        for v in range(vpp):
            counts[(p, v)] = len(numbers[(p, v)])
    total = sum(counts.values())
    if total != spec.num_layers:
        raise InteropError(f"{ranks.dir}: the rank files hold {total} layers, args say num_layers={spec.num_layers}")
    stages, start = [[None] * vpp for _ in range(ranks.pp)], 0
    for v in range(vpp):
        for p in range(ranks.pp):
            stages[p][v] = (start, start + counts[(p, v)])
            start += counts[(p, v)]
    layout = ParallelLayout(ranks.tp, ranks.pp, tuple(tuple(c) for c in stages), ranks.ep, ranks.etp)
    spec.check_tp(ranks.tp)
    if ranks.ep > 1:
        spec.check_ep(ranks.ep)
    return layout
