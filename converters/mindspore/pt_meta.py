"""`pt_meta/`: the Megatron side of a MindSpeed-Core-MS checkpoint, for its reverse converter.

MindSpeed-Core-MS r0.1.0's `tools/converter/convert_pt2ckpt.py` writes, beside `rank_N/network.ckpt`, one
`pt_meta/args_tp{TT}_pp{PPP}.pt` per Megatron rank file (save_args) and copies Megatron's param maps there;
`convert_ckpt2pt.py` reads them back (`--param-map-path <ckpt>/pt_meta`): add_args() takes `args` (sets
`consumed_train_samples`, multiplies the iteration by `global_batch_size`), `checkpoint_version`, `optimizer`
(when the key is present: `['optimizer']['param_groups']`), `opt_param_scheduler` (a dict: it sets `num_steps`),
`rng_state` and `num_floating_point_operations_so_far`; with `--convert-param-only`, get_param_keys_from_pt_meta()
takes `param_name_list[vpp]`, the Megatron keys it looks up (renamed) in the rank files.

Written here from what the conversion knows; the param maps (`param_map_buffer*.json`, Megatron DDP's bucket
layout, which only its patched training writes) are not, so the reverse tool runs with `--convert-param-only`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...errors import InteropError
from ...io.safe_pickle import safe_torch_load, to_plain
from ...layout import ParallelLayout
from ...mappings import megatron_args as M
from ...mappings.megatron_spec import check_args, explicit_args, model_args, spec_from_args
from ...mappings.mindspore_names import MEGATRON_TIED_HEAD, MINDSPEED_PARAM_KEY_MAP, PT_META, PT_META_ARGS
from ...params import param_index
from ...spec import ModelSpec
from ...tensors import DTYPE_NAMES

_MEGATRON_PART = {v: k for k, v in MINDSPEED_PARAM_KEY_MAP.items()}
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


def megatron_name(plain: str, local_layer: int | None) -> str:
    """convert_pt2ckpt.py's _convert_param_name() undone: Megatron's legacy components, the chunk's layer number."""
    parts = [_MEGATRON_PART.get(part, part) for part in plain.split(".")]
    if local_layer is not None:
        parts[parts.index("layers") + 1] = str(local_layer)
    return ".".join(parts)


def param_name_list(spec: ModelSpec, layout: ParallelLayout, rows, plain_of: dict[str, str], p: int) -> list[list[str]]:
    """Stage p's `param_name_list`: per virtual chunk, `model[v].<Megatron legacy key>` in the order Megatron's
    legacy model holds them (embedding, layers, final norm, head, then `word_embeddings_for_head`), reversed
    as convert_pt2ckpt.py convert_pt2ms_param_only() stores them."""
    index = param_index(spec)
    keyed: list[list[tuple]] = [[] for _ in range(layout.vpp)]
    for pos, row in enumerate(rows):
        name, parts = row.key, row.parts
        param = index[parts[0]]
        if layout.stage_of(param) != p:
            continue
        if param.layer is None:
            first = param.name.startswith("embed.")
            v, local, order = (0 if first else layout.vpp - 1), None, ((0 if first else 2), 0, pos)
        else:
            _, v, local = layout.chunk_of_layer(param.layer)
            order = (1, local, pos)
        keyed[v].append((order, megatron_name(plain_of.get(name, name), local)))
    if spec.tied_embeddings and layout.pp > 1 and p == layout.pp - 1:
        keyed[-1].append(((3, 0, 0), MEGATRON_TIED_HEAD))  # the legacy model's head copy on the last stage
    out = []
    for v, entries in enumerate(keyed):
        prefix = "model" if layout.vpp == 1 else f"model{v}"
        out.append([f"{prefix}.{key}" for _, key in sorted(entries)][::-1])
    return out


def megatron_args(spec: ModelSpec, layout: ParallelLayout, state: dict,
                  noop=None) -> tuple[argparse.Namespace, list[str]]:
    """The args Namespace: Megatron's defaults, the source's own Megatron args when it had them, this model and
    layout over them (a legacy model: convert_ckpt2pt.py rebuilds `language_model` names)."""
    meg = state.get("megatron") or {}
    source = meg.get("args") if isinstance(meg.get("args"), dict) else {}
    notes = []
    if not source:
        notes.append("its args are Megatron's defaults with this model's shape and layout (the source carried "
                     "no Megatron args)")
    args = {**M.defaults(), **source}
    # every fact of the model in Megatron's words (rope base, q/k norms, window, ...), so that the args describe it
    args.update({k: v for k, v in model_args(spec).items() if k not in ("activation", "hidden_act", "compute_dtype")})
    # the source's dropouts, not Megatron's default 0.1 (issue 27 item 10)
    args.update({f: getattr(spec, f) for f in ("attention_dropout", "hidden_dropout") if getattr(spec, f) is not None})
    args.update({
        "num_layers": spec.num_layers, "hidden_size": spec.hidden, "ffn_hidden_size": spec.ffn_hidden,
        "num_attention_heads": spec.heads, "num_query_groups": spec.kv_groups,
        "group_query_attention": spec.kv_groups != spec.heads, "kv_channels": spec.head_dim,
        "max_position_embeddings": spec.max_positions, "padded_vocab_size": spec.padded_vocab,
        "normalization": "RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm", "norm_epsilon": spec.norm_eps,
        "swiglu": spec.activation == "swiglu", "add_bias_linear": spec.linear_bias, "add_qkv_bias": spec.qkv_bias,
        "position_embedding_type": "rope" if spec.position == "rope" else "learned_absolute",
        "add_position_embedding": spec.position == "learned",
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "num_layers_per_virtual_pipeline_stage": (layout.stages[0][0][1] - layout.stages[0][0][0])
        if layout.vpp > 1 else None,
        "use_legacy_models": True, "use_mcore_models": False,
        # the legacy model builds attn_post_norm / ffn_post_norm with MindSpeed's use_sandwich_norm (PanGu's patch,
        # MindSpeed-Core-MS tools/rules/line_rules.py); the scales are their initial weights (1.0 unless said)
        "use_sandwich_norm": spec.pre_norm and spec.post_norm,
        "attn_post_norm_scale": 1.0 if spec.attn_post_norm_scale is None else spec.attn_post_norm_scale,
        "ffn_post_norm_scale": 1.0 if spec.mlp_post_norm_scale is None else spec.mlp_post_norm_scale,
        "params_dtype": DTYPE_NAMES[spec.dtype], "bf16": spec.dtype == "bfloat16", "fp16": spec.dtype == "float16",
    })
    args.update(stage_args(layout, args) if noop is None else noop_args(noop))
    if not isinstance(args.get("global_batch_size"), int):
        gbs = (state.get("data") or {}).get("global_batch_size")
        args["global_batch_size"] = gbs if isinstance(gbs, int) and not isinstance(gbs, bool) else None
        if args["global_batch_size"] is None:
            notes.append("they hold no global_batch_size (the source names none), which that tool multiplies the "
                         "iteration by: set args.global_batch_size in pt_meta/args_*.pt before running it")
    if isinstance(state.get("iteration"), int):
        args["iteration"] = state["iteration"]
    return argparse.Namespace(**args), notes


def stage_args(layout: ParallelLayout, args: dict) -> dict:
    """The Megatron args that say the written split: MindSpeed's `num_layer_list` (the guide's PanGu flag, "16,16,16,14")
    and megatron-core's first / last stage sizes where stages differ; a source's `noop_layers` cleared (the files
    hold the real layers, numbered 0..n-1 per stage).  Keys a source did not have stay absent on an even split."""
    counts = [sum(b - a for a, b in chunks) for chunks in layout.stages]
    uneven = layout.vpp == 1 and len(set(counts)) > 1
    out = {"decoder_first_pipeline_num_layers": counts[0] if uneven else None,
           "decoder_last_pipeline_num_layers": counts[-1] if uneven else None}
    if uneven or args.get("num_layer_list") is not None:
        out["num_layer_list"] = ",".join(map(str, counts)) if uneven else None
    if args.get("noop_layers"):
        out["noop_layers"] = None
    return out


def noop_args(noop) -> dict:
    """A run with noop layers: num_layers counts them, `noop_layers` names them ("62,63", MindSpeed's string), the
    split is even (MindSpeed requires it with noop layers)."""
    return {"num_layers": noop.total, "noop_layers": ",".join(map(str, noop.noop)), "num_layer_list": None,
            "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None}


def reverse_flags(layout: ParallelLayout) -> str | None:
    """convert_ckpt2pt.py's flags for an uneven split it can map back, else None.  It takes no split from pt_meta:
    cal_corr_vpp_layers (r0.1.0, lines 212-219) gives stage p positions p*M .. p*M+M-1 of
    np.split(arange(--num-layers)) less --noop's, and reads them as the Megatron layers 0..n-1.  These files name
    stage p's layers from sum(counts[:p]) (convert_pt2ckpt.py's --stage-list offsets, line 282; the model's
    num_layer_list offsets): the same positions exactly when only the last stage is shorter, its missing
    positions then the noop ones (the guide's 16,16,16,14: --num-layers 64 --noop 62 63)."""
    counts = [sum(b - a for a, b in chunks) for chunks in layout.stages]
    if layout.vpp > 1 or len(set(counts)) == 1 or any(c != counts[0] for c in counts[:-1]) or counts[-1] > counts[0]:
        return None
    total = layout.pp * counts[0]
    return f"--num-layers {total} --noop {' '.join(map(str, range(sum(counts), total)))}"


def write(root: Path, spec: ModelSpec, layout: ParallelLayout, rows, plain_of: dict[str, str],
          state: dict, noop=None) -> list[str]:
    """Write pt_meta/args_tp{TT}_pp{PPP}.pt for every (tp rank, stage); returns the summary notes.  `noop`: the
    writer's NoopLayout, where the files number layers by position."""
    args, notes = megatron_args(spec, layout, state, noop)
    meg = state.get("megatron") or {}
    iteration = state.get("iteration") if isinstance(state.get("iteration"), int) else 0
    common = {"args": args, "checkpoint_version": meg.get("checkpoint_version") or CHECKPOINT_VERSION,
              "iteration": iteration,
              "opt_param_scheduler": dict(meg.get("opt_param_scheduler") or {}),
              "rng_state": None,  # per-rank generator states do not survive resharding
              "num_floating_point_operations_so_far": meg.get("num_floating_point_operations_so_far") or 0}
    groups = ((meg.get("optimizer") or {}).get("param_groups")) or []
    if groups:  # the tool's add_args() reads ['optimizer']['param_groups'] whenever the key is there
        common["optimizer"] = {"optimizer": {"param_groups": [dict(g) for g in groups]}}
    folder = root / PT_META
    folder.mkdir()
    for p in range(layout.pp):
        names = param_name_list(spec, layout, rows, plain_of, p)
        for t in range(layout.tp):
            torch.save({**common, "param_name_list": names}, folder / PT_META_ARGS.format(t=t, p=p))
    if not groups:
        notes.append("no optimizer (the source has no optimizer param groups), so that tool writes none")
    counts = [sum(b - a for a, b in chunks) for chunks in layout.stages]
    flags = reverse_flags(layout)
    if noop is not None:
        notes.append(f"noop layers at {','.join(map(str, noop.noop))} (noop_layers in the args): run that tool with "
                     f"--num-layers {noop.total} --noop {' '.join(map(str, noop.noop))}")
    elif flags is not None:
        notes.append(f"uneven pipeline stages {','.join(map(str, counts))} (num_layer_list in the args): run that "
                     f"tool with {flags} (it splits --num-layers evenly; the last stage's missing positions as noop "
                     "layers)")
    elif not all(len({b - a for a, b in chunks}) == 1 for chunks in layout.stages) or len(set(counts)) != 1:
        notes.append(f"uneven pipeline stages {','.join(map(str, counts))}, which that tool cannot map back (its "
                     "cal_corr_vpp_layers splits --num-layers evenly, its --noop only drops positions: only a "
                     "shorter last stage matches these files' layer numbers)")
    # One short line; the detail (after the newline) with -v
    return [f"{PT_META}/ written for MindSpeed's convert_ckpt2pt.py --convert-param-only"
            + (f", with {len(notes)} caveat{'s' if len(notes) > 1 else ''}" if notes else "") + "\n"
            + f"Megatron args and parameter names per (tp rank, stage), for convert_ckpt2pt.py --convert-param-only "
            f"--param-map-path <this>/{PT_META}; Megatron's param_map_buffer*.json (its DDP bucket layout) are not "
            "written, so that tool's optimizer mode cannot run" + "".join("\n" + n for n in notes)]


def read(root: Path) -> tuple[dict[tuple[int, int], dict], int, int, int] | None:
    """{(tp rank, stage): args file contents}, tp, pp and vpp of a `pt_meta/` folder, or None without one."""
    folder = root / PT_META
    if not folder.is_dir():
        return None
    found = {}
    for path in folder.glob("args_tp*_pp*.pt"):
        stem = path.stem[len("args_tp"):]
        t, _, p = stem.partition("_pp")
        if not ((t.isascii() and t.isdigit()) and (p.isascii() and p.isdigit())):
            continue
        obj = safe_torch_load(path, mmap=False)
        if not isinstance(obj, dict):
            raise InteropError(f"{path}: expected a dict (convert_pt2ckpt.py save_args), found {type(obj).__name__}")
        found[(int(t), int(p))] = obj
    if not found:
        return None
    tp, pp = max(t for t, _ in found) + 1, max(p for _, p in found) + 1
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in found]
    if missing:
        t, p = missing[0]
        raise InteropError(f"{folder}: {PT_META_ARGS.format(t=t, p=p)} is missing ({len(missing)} of {tp * pp})")
    names = found[(0, 0)].get("param_name_list")
    args = to_plain(found[(0, 0)].get("args")) or {}
    vpp = len(names) if isinstance(names, list) and names else (args.get("virtual_pipeline_model_parallel_size") or 1)
    return found, tp, pp, int(vpp)


def state_from(found: dict[tuple[int, int], dict]) -> dict:
    """What pt_meta adds to the training state: the Megatron run's args and counters (plain values)."""
    first = found[(0, 0)]
    meg = {}
    if isinstance(to_plain(first.get("args")), dict):
        meg["args"] = to_plain(first["args"])
    for key in ("checkpoint_version", "num_floating_point_operations_so_far"):
        if first.get(key) is not None:
            meg[key] = to_plain(first[key])
    return {"megatron": meg} if meg else {}


def spec_from(found: dict[tuple[int, int], dict], dtype: str, where: str) -> tuple[ModelSpec, int | None] | None:
    """The model the Megatron run's args describe (convert_pt2ckpt.py saves them whole) and the padded
    vocabulary they state; None when the args name no whole model (Megatron-LM's and interop's always do)."""
    args = to_plain(found[(0, 0)].get("args"))
    if not isinstance(args, dict) or not all(args.get(k) for k in ("num_layers", "hidden_size", "num_attention_heads")):
        return None  # args that name no whole model (a hand-made Namespace of a few counters)
    check_args(args, where)
    explicit = explicit_args(args)
    if not args.get("swiglu") and "bias_gelu_fusion" not in args:
        explicit["bias_gelu_fusion"] = False  # as the Megatron reader: Megatron's exact (erf) GeLU
    full = M.complete(explicit)
    if full.get("untie_embeddings_and_output_weights") is None:
        full["untie_embeddings_and_output_weights"] = False
    stated = args.get("padded_vocab_size")
    return spec_from_args(full, where, dtype), stated
