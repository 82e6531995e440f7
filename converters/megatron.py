"""Megatron-LM checkpoints <-> canonical tensors.

On disk (the `torch` format):

    save/latest_checkpointed_iteration.txt        an iteration number or `release`
    save/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt

Each rank file is a pickle of one (tp, pp) rank's state: `args`, `iteration`,
`checkpoint_version`, `model` (or `model0..N-1`, one per virtual pipeline chunk,
layer numbers local to the chunk), `optimizer`, `opt_param_scheduler`, `rng_state`.
Names follow megatron-core (with or without Transformer Engine's fused norms) or the
legacy model (older spellings included): `interop.mappings.megatron_names`.  A
`torch_dist` iteration directory (PyTorch DCP) goes through `interop.io.megatron_dist`.

Rank files are unpickled safely (`interop.io.safe_pickle`) with tensors left on
disk (`interop.io.torch_file`): a read costs the tensor's bytes, not the file's.
The writer streams each rank file the same way, tensor by tensor.
"""
from __future__ import annotations

import argparse
import re
import types
from collections import OrderedDict
from pathlib import Path

import torch

from ..errors import InteropError
from ..fused import fuse_concat, fuse_qkv_grouped, split_concat, split_qkv_grouped
from ..io.safe_pickle import to_plain
from ..io.torch_file import LazyTorchFile, TorchFileWriter
from ..layout import ParallelLayout
from ..mappings import megatron_args as M
from ..mappings.megatron_names import (EXTRA_STATE_MODULES, IGNORED_SUFFIXES, LEGACY_ALIASES, TABLES, TIED_HEAD,
                                       scheme_of)
from ..params import OPTIM_PREFIXES, base_param_name, param_index, param_table
from ..shards import shard_box
from ..spec import ModelSpec, padded_vocab_size
from ..tensors import DTYPE_NAMES, NAME_OF_DTYPE, Source, TensorMeta

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
CHECKPOINT_VERSION = 3.0


def rank_dir_name(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def _dist():
    """The torch_dist (DCP) file layer, imported only when a torch_dist checkpoint is met."""
    try:
        from ..io import megatron_dist
    except ImportError as exc:
        raise InteropError(f"torch_dist checkpoints need interop.io.megatron_dist ({exc})") from None
    return megatron_dist


def _is_dist_dir(path: Path) -> bool:
    return (path / "metadata.json").is_file() and (path / ".metadata").is_file()


def _has_rank_dirs(path: Path) -> bool:
    return path.is_dir() and any(RANK_DIR.match(c.name) and c.is_dir() for c in path.iterdir())


def detect(path) -> bool:
    root = Path(path)
    return root.is_dir() and ((root / TRACKER).is_file() or _has_rank_dirs(root) or _is_dist_dir(root))


def iteration_dir(path, iteration: int | None = None) -> tuple[Path, int | str | None]:
    """The iteration directory to read: the tracker's (or `iteration`'s) under a save root, or `path` itself."""
    root = Path(path)
    if iteration is not None:
        sub = root / f"iter_{int(iteration):07d}"
        if not sub.is_dir():
            found = sorted(c.name for c in root.iterdir() if c.name.startswith("iter_")) if root.is_dir() else []
            raise InteropError(f"{sub}: no such iteration directory (found: {', '.join(found) or 'none'})")
        return sub, int(iteration)
    if _has_rank_dirs(root) or _is_dist_dir(root):
        name = root.name
        it = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else ("release" if name == "release" else None)
        return root, it
    tracker = root / TRACKER
    if not tracker.is_file():
        raise InteropError(f"{root}: not a Megatron checkpoint (no {TRACKER}, no mp_rank_* folders)")
    text = tracker.read_text().strip()
    if text == "release":
        sub, it = root / "release", "release"
    elif text.isdigit():
        sub, it = root / f"iter_{int(text):07d}", int(text)
    else:
        raise InteropError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    if not sub.is_dir():
        raise InteropError(f"{tracker}: names {sub.name}, which does not exist")
    return sub, it


# ------------------------------------------------------------------------------------------------
# Megatron args <-> ModelSpec.  TO MERGE: mappings/megatron_spec.py (spec_from_megatron_args /
# megatron_args_from_spec) was planned elsewhere; until it exists these live here, on top of the
# shared argument table `interop.mappings.megatron_args`.

UNSUPPORTED_ARGS = {  # dest: the value our ModelSpec can describe
    "num_experts": None, "qk_layernorm": False, "rotary_interleaved": False, "multi_latent_attention": False,
    "apply_residual_connection_post_layernorm": False, "squared_relu": False,
}
NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
NORMS_OUT = {v: k for k, v in NORMS.items()}


def explicit_args(stored: dict) -> dict:
    """Stored checkpoint args in the shared table's terms (plain values, known dests only)."""
    out = {}
    for key, value in stored.items():
        dest = M.CHECKPOINT_ALIASES.get(key, key)
        if dest in M.ARGS and value is not None:
            out[dest] = _plain_arg(value)
    return out


def _plain_arg(value):
    if isinstance(value, torch.dtype):
        return NAME_OF_DTYPE.get(value, str(value))
    return to_plain(value)


def spec_from_args(full: dict, where: str, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec from completed Megatron args (`megatron_args.complete`)."""
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not full.get(k)]
    if missing:
        raise InteropError(f"{where}: the model description lacks {', '.join(missing)}")
    for dest, ok in UNSUPPORTED_ARGS.items():
        if full.get(dest, ok) not in (ok, None) and full.get(dest) != ok:
            raise InteropError(f"{where}: {dest}={full[dest]!r} is not supported")
    if full.get("rotary_percent", 1.0) not in (None, 1.0):
        raise InteropError(f"{where}: rotary_percent={full['rotary_percent']} is not supported (1.0 is)")
    norm = NORMS.get(full.get("normalization") or "LayerNorm")
    if norm is None:
        raise InteropError(f"{where}: normalization={full['normalization']!r} is not supported")
    pos_type = full.get("position_embedding_type") or "learned_absolute"
    if full.get("use_rotary_position_embeddings"):
        pos_type = "rope"
    if pos_type not in ("learned_absolute", "rope"):
        raise InteropError(f"{where}: position_embedding_type={pos_type!r} is not supported")
    position = "rope" if pos_type == "rope" else "learned"
    heads, hidden = int(full["num_attention_heads"]), int(full["hidden_size"])
    groups = int(full.get("num_query_groups") or heads) if full.get("group_query_attention") else heads
    activation = full.get("activation") or ("swiglu" if full.get("swiglu") else "gelu")
    padded = full.get("padded_vocab_size") or full.get("vocab_size")
    vocab = full.get("vocab_size") or padded
    if not padded:
        raise InteropError(f"{where}: the vocabulary size is unknown (no padded_vocab_size or vocab_size)")
    linear_bias = bool(full.get("add_bias_linear", True))
    arch = "gpt2" if (norm == "layernorm" and position == "learned" and activation != "swiglu") else "llama"
    return ModelSpec(
        arch=arch, num_layers=int(full["num_layers"]), hidden=hidden,
        ffn_hidden=int(full.get("ffn_hidden_size") or 4 * hidden), heads=heads, kv_groups=groups,
        head_dim=int(full.get("kv_channels") or hidden // heads), vocab=int(vocab), padded_vocab=int(padded),
        max_positions=int(full.get("max_position_embeddings") or full.get("seq_length") or 0) or 2048,
        norm=norm, norm_eps=float(full.get("norm_epsilon") or 1e-5), activation=activation, position=position,
        rope_base=float(full.get("rotary_base") or 10000), tied_embeddings=not full.get("untie_embeddings_and_output_weights"),
        qkv_bias=bool(linear_bias or full.get("add_qkv_bias")), linear_bias=linear_bias,
        dtype=dtype or full.get("params_dtype") or "float32")


def args_from_spec(spec: ModelSpec, layout: ParallelLayout, base: dict | None = None,
                   divisible_by: int = 128) -> dict:
    """Megatron args for `spec` at `layout`, on top of `base` (a source's args) or Megatron's defaults."""
    if spec.qkv_bias and not spec.linear_bias:
        add_qkv_bias = True
    else:
        add_qkv_bias = spec.qkv_bias
    if spec.qkv_bias != spec.linear_bias and not (spec.qkv_bias and not spec.linear_bias):
        raise InteropError("Megatron cannot describe biases on the output/MLP linears without q/k/v biases")
    first = layout.stages[0][0]
    per_stage = [sum(b - a for a, b in chunks) for chunks in layout.stages]
    uneven = layout.vpp == 1 and layout.stages != _even_stages(spec.num_layers, layout)
    model = {
        "num_layers": spec.num_layers, "hidden_size": spec.hidden, "ffn_hidden_size": spec.ffn_hidden,
        "num_attention_heads": spec.heads, "group_query_attention": spec.kv_groups != spec.heads,
        "num_query_groups": spec.kv_groups, "kv_channels": spec.head_dim,
        "max_position_embeddings": spec.max_positions, "normalization": NORMS_OUT[spec.norm],
        "norm_epsilon": spec.norm_eps, "swiglu": spec.activation == "swiglu",
        "openai_gelu": spec.activation == "gelu_tanh",
        # the fused bias-GeLU is the tanh form: on only when that is the model's GeLU
        "bias_gelu_fusion": spec.activation == "gelu_tanh" and spec.linear_bias,
        "bias_swiglu_fusion": spec.activation == "swiglu",
        "position_embedding_type": "rope" if spec.position == "rope" else "learned_absolute",
        "add_position_embedding": spec.position == "learned", "use_rotary_position_embeddings": spec.position == "rope",
        "rotary_base": int(spec.rope_base) if float(spec.rope_base).is_integer() else spec.rope_base,
        "rotary_percent": 1.0, "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "add_bias_linear": spec.linear_bias, "add_qkv_bias": add_qkv_bias,
        "vocab_size": spec.vocab, "padded_vocab_size": spec.padded_vocab,
        "make_vocab_size_divisible_by": divisible_by,
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "num_layers_per_virtual_pipeline_stage": (first[1] - first[0]) if layout.vpp > 1 else None,
        "decoder_first_pipeline_num_layers": per_stage[0] if uneven else None,
        "decoder_last_pipeline_num_layers": per_stage[-1] if uneven else None,
        "bf16": spec.dtype == "bfloat16", "fp16": spec.dtype == "float16",
        "transformer_impl": "local", "use_legacy_models": False, "use_mcore_models": True,
    }
    args = M.complete({}) if base is None else dict(base)
    args.update(model)
    args.pop("activation", None)  # derived by interop's table, not a Megatron argument
    args.pop("hidden_act", None)
    args.pop("compute_dtype", None)
    args["params_dtype"] = DTYPE_NAMES[spec.dtype]
    return args


def _even_stages(num_layers: int, layout: ParallelLayout):
    try:
        return ParallelLayout.build(num_layers, layout.tp, layout.pp, layout.vpp).stages
    except InteropError:
        return None


def vocab_divisor(vocab: int, padded: int, tp: int, default: int = 128) -> int | None:
    """A make_vocab_size_divisible_by that makes Megatron pad `vocab` to exactly `padded` at `tp`."""
    if padded_vocab_size(vocab, tp, default) == padded:
        return default
    d = default
    while d * tp <= padded:
        if padded % (d * tp) == 0 and padded_vocab_size(vocab, tp, d) == padded:
            return d
        d += default
    return None


# ------------------------------------------------------------------------------------------------
# Name tables expanded over a layout

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


def _ignored(key: str) -> str | None:
    return next((why for suffix, why in IGNORED_SUFFIXES.items() if key.endswith(suffix)), None)


def _args_dict(args) -> dict | None:
    if args is None:
        return None
    if isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    if hasattr(args, "state") and isinstance(getattr(args, "state"), dict):  # a placeholder Namespace subclass
        return dict(args.state)
    return None


def model_config_args(path) -> dict:
    """Completed Megatron args from --model-config: HF config.json, Megatron args file or MindSpeed YAML."""
    from .. import mapargs
    source = mapargs.load(path)
    return M.complete(source.explicit)


# ------------------------------------------------------------------------------------------------
# Reading

class Reader:
    """A Megatron checkpoint (`torch` format, or `torch_dist` through `interop.io.megatron_dist`)."""

    def __init__(self, path, iteration: int | None = None, model_config=None):
        self.root = Path(path)
        self.dir, it = iteration_dir(self.root, iteration)
        if _is_dist_dir(self.dir):
            raise InteropError(f"{self.dir}: torch_dist checkpoints are not wired in yet")
        self._open_ranks()
        first = self.files[(0, 0)].obj
        if not isinstance(first, dict):
            raise InteropError(f"{self.files[(0, 0)].path}: expected a dict, found {type(first).__name__}")
        notes: list[str] = []
        stored = _args_dict(first.get("args"))
        full = self._model_args(stored, model_config, notes)
        self.chunks = self._model_chunks()
        self.scheme = self._scheme()
        spec = self._spec(full, stored, notes)
        self.layout = self._layout(spec, full)
        self.spec = spec
        self.index = param_index(spec)
        self.rows = expand_rows(self.scheme, spec, self.layout)
        self._check_tensors(notes)
        self.row_of = {n: (r, j) for r in self.rows if r.kind != "tied" for j, n in enumerate(r.parts)}
        if "optimizer" in first or (self.dir / self.rank_dirs[(0, 0)] / DISTRIB_OPTIM_FILE).is_file():
            notes.append(self._optimizer_note(first))
        if "rng_state" in first:
            notes.append("dropped the rng state (per-rank random generator states do not survive resharding)")
        state = {
            "iteration": first.get("iteration") if isinstance(first.get("iteration"), int) else it,
            "megatron": {"checkpoint_version": to_plain(first.get("checkpoint_version")), "scheme": self.scheme,
                         "args": {k: _plain_arg(v) for k, v in (stored or {}).items()},
                         "opt_param_scheduler": to_plain(first.get("opt_param_scheduler")),
                         "num_floating_point_operations_so_far": to_plain(
                             first.get("num_floating_point_operations_so_far"))},
        }
        self.source = Source(spec, self.layout, state, notes)
        self._cache: OrderedDict = OrderedDict()

    # -- opening -------------------------------------------------------------------------------
    def _open_ranks(self) -> None:
        found = {}
        for c in self.dir.iterdir():
            m = RANK_DIR.match(c.name)
            if m and c.is_dir():
                found[(int(m.group(1)), int(m.group(2) or 0))] = c.name
        if not found:
            raise InteropError(f"{self.dir}: no mp_rank_* folders")
        with_pp = {k for k, name in found.items() if len(name) > len("mp_rank_00")}
        first = LazyTorchFile(self._rank_path(found, (0, 0)))
        stored = _args_dict(first.obj.get("args")) if isinstance(first.obj, dict) else None
        tp = int((stored or {}).get("tensor_model_parallel_size") or max(t for t, _ in found) + 1)
        pp = int((stored or {}).get("pipeline_model_parallel_size") or max(p for _, p in found) + 1)
        if (pp > 1) != bool(with_pp):
            raise InteropError(f"{self.dir}: rank folder names ({sorted(found.values())[0]}, ...) do not match "
                               f"pipeline size {pp}")
        for t in range(tp):
            for p in range(pp):
                if (t, p) not in found:
                    raise InteropError(f"{self.dir}: rank folder {rank_dir_name(t, p, pp)} is missing "
                                       f"(the checkpoint is tp={tp} pp={pp})")
        extra = sorted(name for (t, p), name in found.items() if t >= tp or p >= pp)
        if extra:
            raise InteropError(f"{self.dir}: rank folder {extra[0]} is beyond the checkpoint's tp={tp} pp={pp}")
        self.tp, self.pp = tp, pp
        self.rank_dirs = {k: found[k] for k in found}
        self.files = {(0, 0): first}
        for t in range(tp):
            for p in range(pp):
                if (t, p) != (0, 0):
                    self.files[(t, p)] = LazyTorchFile(self._rank_path(found, (t, p)))

    def _rank_path(self, found, key) -> Path:
        path = self.dir / found[key] / RANK_FILE
        if not path.is_file():
            raise InteropError(f"{path.parent}: {RANK_FILE} is missing")
        return path

    def _model_args(self, stored: dict | None, model_config, notes: list[str]) -> dict:
        if model_config is not None:
            notes.append(f"model description taken from {model_config}")
            full = model_config_args(model_config)
            # the layout and the padded vocab are facts of the files, not of the model description
            # (a HF config's vocab_size, which the args table calls padded_vocab_size, is the true vocab)
            full.update(vocab_size=full.get("vocab_size") or full.get("padded_vocab_size"),
                        tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                        padded_vocab_size=(stored or {}).get("padded_vocab_size"))
            return full
        where = self.files[(0, 0)].path
        if not stored or not stored.get("num_layers"):
            raise InteropError(f"{where}: the checkpoint carries no model description (no args); "
                               "pass --model-config (a HF config.json, a Megatron args file or a MindSpeed YAML)")
        explicit = explicit_args(stored)
        if not stored.get("swiglu") and "bias_gelu_fusion" not in stored:
            explicit["bias_gelu_fusion"] = False
            if stored.get("add_bias_linear", True) and not stored.get("openai_gelu"):
                notes.append("args do not say bias_gelu_fusion: assumed Megatron's exact (erf) GeLU")
        return M.complete(explicit)

    def _model_chunks(self) -> dict[int, list[str]]:
        """{stage: [model key per virtual chunk]}: `model`, or `model0`..`modelN-1`."""
        out = {}
        for p in range(self.pp):
            obj = self.files[(0, p)].obj
            keys = ["model"] if "model" in obj else sorted((k for k in obj if re.fullmatch(r"model\d+", k)),
                                                         key=lambda k: int(k[5:]))
            if not keys:
                raise InteropError(f"{self.files[(0, p)].path}: no model state (no 'model' or 'model0' entry)")
            out[p] = keys
        if len({len(v) for v in out.values()}) != 1:
            raise InteropError(f"{self.dir}: pipeline stages hold different numbers of virtual chunks")
        self.state_dicts = {}
        for (t, p), f in self.files.items():
            for v, key in enumerate(out[p]):
                sd = f.obj.get(key)
                if not isinstance(sd, dict):
                    raise InteropError(f"{f.path}: entry {key!r} is not a state dict")
                self.state_dicts[(t, p, v)] = flatten(sd)
        return out

    def _scheme(self) -> str:
        keys = [k for sd in self.state_dicts.values() for k in sd]
        scheme = scheme_of(keys)
        if scheme is None:
            raise InteropError(f"{self.dir}: neither megatron-core nor legacy parameter names "
                               f"(e.g. {keys[0] if keys else 'no keys at all'})")
        if scheme == "legacy":
            for k, sd in self.state_dicts.items():
                self.state_dicts[k] = OrderedDict((legacy_key(n), x) for n, x in sd.items())
        return scheme

    def _spec(self, full: dict, stored: dict | None, notes: list[str]) -> ModelSpec:
        emb_key = TABLES[self.scheme][0][0]
        rows = 0
        for t in range(self.tp):
            emb = self.state_dicts[(t, 0, 0)].get(emb_key)
            if not isinstance(emb, torch.Tensor):
                raise InteropError(f"{self.files[(t, 0)].path}: {emb_key} is missing")
            rows += emb.shape[0]
        padded = full.get("padded_vocab_size")
        if padded and int(padded) != rows:
            raise InteropError(f"{self.files[(0, 0)].path}: {emb_key} holds {rows} vocab rows over tp={self.tp}, "
                               f"args say padded_vocab_size={padded}")
        full = dict(full, padded_vocab_size=rows)
        if not full.get("vocab_size"):
            full["vocab_size"] = rows
            notes.append(f"the true vocabulary size is not recorded (no vocab_size in args): keeping all {rows} rows")
        dtype = NAME_OF_DTYPE.get(emb.dtype, "float32")
        if full.get("untie_embeddings_and_output_weights") is None:
            full["untie_embeddings_and_output_weights"] = False
        return spec_from_args(full, str(self.files[(0, 0)].path), dtype)

    def _layout(self, spec: ModelSpec, full: dict) -> ParallelLayout:
        vpp = len(self.chunks[0])
        counts = {}
        for p in range(self.pp):
            for v in range(vpp):
                layers = {int(m.group(1)) for k in self.state_dicts[(0, p, v)] if (m := LAYER_KEY.search(k))}
                if layers and layers != set(range(len(layers))):
                    raise InteropError(f"{self.files[(0, p)].path}: layer numbers {sorted(layers)} are not 0..n-1 "
                                       "(Megatron numbers layers locally per stage)")
                counts[(p, v)] = len(layers)
        total = sum(counts.values())
        if total != spec.num_layers:
            raise InteropError(f"{self.dir}: the rank files hold {total} layers, args say num_layers={spec.num_layers}")
        stages, start = [[None] * vpp for _ in range(self.pp)], 0
        for v in range(vpp):
            for p in range(self.pp):
                stages[p][v] = (start, start + counts[(p, v)])
                start += counts[(p, v)]
        layout = ParallelLayout(self.tp, self.pp, tuple(tuple(c) for c in stages))
        spec.check_tp(self.tp)
        return layout

    def _check_tensors(self, notes: list[str]) -> None:
        """Every stored tensor is mapped, a tied copy, or reported; shapes agree with the args."""
        expected = {}
        for r in self.rows:
            expected[(r.stage, r.chunk, r.key)] = r
        ignored: dict[str, int] = {}
        tied = 0
        for (t, p, v), sd in self.state_dicts.items():
            where = self.files[(t, p)].path
            for key, value in sd.items():
                row = expected.get((p, v, key))
                if row is None:
                    why = _ignored(key)
                    if why is not None and key.endswith("_extra_state") and value is None:
                        why = "empty _extra_state slots (no Transformer Engine / fp8 metadata in them)"
                    if why is None:
                        raise InteropError(f"{where}: tensor {key} does not belong to this {self.spec.arch} model "
                                           "(args describe a different model?)")
                    ignored[why] = ignored.get(why, 0) + 1
                    continue
                if not isinstance(value, torch.Tensor):
                    raise InteropError(f"{where}: {key} is not a tensor")
                want = rank_shapes(row, self.index, self.tp, t)
                if tuple(value.shape) != tuple(want):
                    raise InteropError(f"{where}: {key} has shape {list(value.shape)}, args imply {list(want)}")
                tied += row.kind == "tied"
            for (p2, v2, key), row in expected.items():
                if (p2, v2) == (p, v) and key not in sd:
                    raise InteropError(f"{where}: tensor {key} is missing")
        for why, n in sorted(ignored.items()):
            notes.append(f"ignored {n} entries: {why}")
        if tied:
            notes.append("dropped the last stage's copy of the tied embedding (it equals the input embedding)")

    def _optimizer_note(self, first: dict) -> str:
        if (self.dir / self.rank_dirs[(0, 0)] / DISTRIB_OPTIM_FILE).is_file():
            return (f"optimizer state not converted: {DISTRIB_OPTIM_FILE} (distributed optimizer) stores it in "
                    "gradient-bucket order, which cannot be mapped back to parameters; weights converted")
        return "optimizer state not converted (weights only)"

    # -- the Reader contract -------------------------------------------------------------------
    def metas(self) -> list[TensorMeta]:
        out = []
        for p in param_table(self.spec):
            row, _ = self.row_of[p.name]
            dtype = self.state_dicts[(0, row.stage, row.chunk)][row.key].dtype
            out.append(TensorMeta(p.name, dtype, p.shape))
        return out

    def read(self, name: str) -> torch.Tensor:
        row, j = self.row_of[name]
        ident = (row.stage, row.chunk, row.key)
        if ident not in self._cache:
            replicated = row.kind == "copy" and self.index[row.parts[0]].axis is None
            ranks = [0] if replicated else range(self.tp)
            shards = [self.files[(t, row.stage)].read(self.state_dicts[(t, row.stage, row.chunk)][row.key])
                      for t in ranks]
            self._cache[ident] = from_ranks(row, shards, self.index, self.spec) if not replicated else [shards[0]]
            while len(self._cache) > 2:  # a fused weight and its bias alternate in canonical order
                self._cache.popitem(last=False)
        return self._cache[ident][j]

    def close(self) -> None:
        self._cache.clear()


# ------------------------------------------------------------------------------------------------
# Writing

class Writer:
    """Writes a Megatron-LM `torch` checkpoint (megatron-core names) that Megatron can load."""

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        """Megatron's padding of the true vocab at `tp`; the source's rows kept when they still divide."""
        if spec.padded_vocab % (128 * tp) == 0 and vocab_divisor(spec.vocab, spec.padded_vocab, tp) is not None:
            return spec.padded_vocab
        return padded_vocab_size(spec.vocab, tp)

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta],
                 format: str | None = None, iteration: int | None = None):
        self.format = format or "torch"
        if self.format != "torch":
            raise InteropError(f"--format {self.format} is not supported for writing yet (torch is)")
        spec.check_tp(layout.tp)
        if layout.num_layers != spec.num_layers:
            raise InteropError(f"layout has {layout.num_layers} layers, the model {spec.num_layers}")
        self.root, self.spec, self.layout, self.iteration = Path(root), spec, layout, iteration
        self.index = param_index(spec)
        self.rows = expand_rows("mcore", spec, layout)
        self.row_of = {n: r for r in self.rows if r.kind != "tied" for n in r.parts}
        self.tied_rows = [r for r in self.rows if r.kind == "tied"]
        self.names = {m.name for m in metas}
        unknown = sorted(n for n in self.names if n.startswith(OPTIM_PREFIXES))
        self.optim_names = unknown
        self.pending: dict[tuple, dict] = {}
        self.refs: dict[tuple, object] = {}  # (t, stage, chunk, parts) -> TensorRef
        self.dir = self.root / "iter_pending"
        self.files = {}
        for t, p in layout.ranks():
            path = self.dir / rank_dir_name(t, p, layout.pp) / RANK_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            self.files[(t, p)] = TorchFileWriter(path)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(OPTIM_PREFIXES):
            return  # handled by the optimizer mapping (see finish)
        row = self.row_of[name]
        got = self.pending.setdefault(row.parts, {})
        got[name] = tensor
        if len(got) < len(row.parts):
            return
        del self.pending[row.parts]
        parts = [got[n] for n in row.parts]
        for r in [row] + ([t for t in self.tied_rows] if name == "embed.word.weight" else []):
            for t in range(self.layout.tp):
                piece = to_rank(row, parts, self.index, self.layout.tp, t, self.spec)
                self.refs[(t, r.stage, r.chunk, r.key)] = self.files[(t, r.stage)].add(piece)

    def _model_dict(self, t: int, p: int, v: int) -> OrderedDict:
        out = OrderedDict()
        last = (p, v) == (self.layout.pp - 1, self.layout.vpp - 1)
        start = self.layout.stages[p][v][0]
        extra = set()
        for i in range(self.layout.stages[p][v][1] - start):
            extra.update(m.format(i=i) for m in EXTRA_STATE_MODULES if "{i}" in m)
        if last:
            extra.add("output_layer")
        pending_extra = None
        for r in self.rows:
            if (r.stage, r.chunk) != (p, v):
                continue
            module = r.key.rsplit(".", 1)[0]
            if pending_extra is not None and module != pending_extra:
                out[pending_extra + "._extra_state"] = None
                extra.discard(pending_extra)
                pending_extra = None
            out[r.key] = self.refs[(t, p, v, r.key)]
            if module in extra:
                pending_extra = module
        if pending_extra is not None:
            out[pending_extra + "._extra_state"] = None
            extra.discard(pending_extra)
        if last and "output_layer" in extra:
            out["output_layer._extra_state"] = None
        return out

    def finish(self, state: dict | None = None) -> None:
        if self.pending:
            raise InteropError(f"incomplete input: {sorted(self.pending)[0]} never got all its parts")
        state = state or {}
        meg = state.get("megatron") or {}
        base = meg.get("args") or None
        if base is not None:
            base = M.complete(explicit_args(base)) | {k: v for k, v in base.items() if k not in M.ARGS}
        divisor = vocab_divisor(self.spec.vocab, self.spec.padded_vocab, self.layout.tp) or 128
        args = argparse.Namespace(**args_from_spec(self.spec, self.layout, base, divisor))
        iteration = self.iteration if self.iteration is not None else state.get("iteration")
        if not isinstance(iteration, int):
            iteration = "release"
        args.iteration = 0 if iteration == "release" else iteration
        for (t, p), f in self.files.items():
            obj = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                   "iteration": 0 if iteration == "release" else iteration}
            chunks = [self._model_dict(t, p, v) for v in range(self.layout.vpp)]
            if self.layout.vpp == 1:
                obj["model"] = chunks[0]
            else:
                for v, sd in enumerate(chunks):
                    obj[f"model{v}"] = sd
            if meg.get("opt_param_scheduler"):
                obj["opt_param_scheduler"] = meg["opt_param_scheduler"]
            if meg.get("num_floating_point_operations_so_far") is not None:
                obj["num_floating_point_operations_so_far"] = meg["num_floating_point_operations_so_far"]
            f.finish(obj)
        final = self.root / ("release" if iteration == "release" else f"iter_{iteration:07d}")
        self.dir.rename(final)
        (self.root / TRACKER).write_text(f"{iteration}\n" if iteration != "release" else "release\n")

    def abort(self) -> None:
        for f in self.files.values():
            f.abort()
