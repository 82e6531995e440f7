"""Megatron-DeepSpeed / DeepSpeed pipeline checkpoints -> canonical tensors (a source only).

On disk (DeepSpeed `engine.save_checkpoint` of a PipelineModule, deepspeed/runtime/pipe/module.py
`ckpt_layer_path`, deepspeed/runtime/engine.py `_get_ckpt_name` / `_get_zero_ckpt_name`):

    save/latest                                      the tag, e.g. `global_step1000`
    save/latest_checkpointed_iteration.txt           Megatron-DeepSpeed's tracker (the iteration)
    save/global_step1000/layer_XX-model_YY-model_states.pt   spec XX's state dict on TP rank YY
                                                     (no `-model_YY` without a model-parallel axis)
    save/global_step1000/mp_rank_MM_model_states.pt  engine state of model rank MM = stage * tp + YY:
                                                     args, iteration, ds_config, param_shapes, `module`
                                                     None (the layer files hold the weights)
    save/global_step1000/zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO 1/2: fp32 masters and Adam
                                                     moments, flat per param group, of data-parallel rank D

Layer files name parameters as GPTModelPipe's modules do (`interop.mappings.deepspeed_names`), described by
Megatron-DeepSpeed's args in the engine state; or, in a PipelineModule of a Hugging Face model's own modules
(`nn.Embedding`, `LlamaDecoderLayer`, ..., `LlamaRMSNorm`, `nn.Linear`), as those modules do: a decoder layer
its HF names after `layers.{i}.`, the embedding, final norm and head just `weight`, told apart by place and
shape; the model described by config.json beside `latest` or --model-config.  ATorch's DS 3D is such a
PipelineModule (atorch/utils/ds_pipe_utils.py PipeModuleFromRecordedMeta) split over tensor-parallel ranks: each
key is cut as `ATORCH_TP_SPLITS` says (else refused), its embedding padded to a multiple of tp and tied to the
logits (no head file; the last stage's param_shapes hold it as a `tied_modules.` module), and a module without
tensors (transformers' model-level rotary_emb) leaves an empty layer file, skipped.
Every `.pt` is unpickled safely with tensors left on disk (`interop.io.torch_file.LazyTorchFile`).
"""
from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch

from ...contract import BaseReader
from ...distinct_ranks import RankPrint, check_distinct, record_sums
from ...errors import InteropError
from ...hf_named import hf_table
from ...io.safe_pickle import to_plain
from ...io.small_files import read_json_object, read_small_text
from ...io.torch_file import LazyTorchFile
from ...layout import ParallelLayout
from ...mappings.deepspeed_names import ATORCH_TP_SPLITS, IGNORED_SUFFIXES, TABLES, hf_module_tables, kind_of
from ...mappings.hf_config import spec_from_hf_config
from ...mappings.hf_names import TABLES as HF_TABLES
from ...model_config import spec_from_file
from ...params import TensorKey, base_param_name, param_index, param_table
from ...spec import ModelSpec, vocab_from_rows
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from .zero import GRADIENT_CLIPPING_DEFAULT, update_rule

LATEST = "latest"
LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
MP_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
ZERO_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# ZeRO's names for what the canonical optimizer state calls exp_avg, exp_avg_sq, fp32_param
MOMENTS = ("exp_avg", "exp_avg_sq")


def _tag_dir(root: Path) -> Path | None:
    """The folder holding the rank files: `root` itself, or the one `latest` names."""
    if any(LAYER_FILE.fullmatch(p.name) or MP_FILE.fullmatch(p.name) for p in root.iterdir()):
        return root
    latest = root / LATEST
    if latest.is_file():
        tag = read_small_text(latest, "DeepSpeed 'latest' file", 4096).strip()  # a tag name: bounded
        if tag and "/" not in tag and tag not in (".", ".."):
            return root / tag
    return None


def detect(path) -> bool:
    root = Path(path)
    if not root.is_dir():
        return False
    folder = _tag_dir(root)
    return folder is not None and folder.is_dir() and any(LAYER_FILE.fullmatch(p.name) for p in folder.iterdir())


def _args(obj, where) -> dict:
    args = obj.get("args") if isinstance(obj, dict) else None
    if args is None:
        raise InteropError(f"{where}: no Megatron-DeepSpeed args in the engine state (the model's heads, norm and "
                           "vocabulary are described there only)")
    args = to_plain(args)
    if not isinstance(args, dict) and hasattr(obj.get("args"), "state"):  # a placeholder Namespace subclass
        args = to_plain(obj["args"].state)
    if not isinstance(args, dict):
        raise InteropError(f"{where}: args is {type(obj.get('args')).__name__}, not a namespace")
    return args


def _int(args: dict, key: str, where, default=None) -> int:
    value = args.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InteropError(f"{where}: args.{key} is {value!r}, not a positive integer")
    return value


def spec_from_args(args: dict, where, dtype: str, has_bias: bool, has_position: bool) -> ModelSpec:
    """A ModelSpec from Megatron-DeepSpeed's args (megatron/arguments.py spellings: num_key_value_heads,
    normalization layernorm|rmsnorm, use_rotary_position_embeddings, rope_theta, swiglu)."""
    heads, hidden = _int(args, "num_attention_heads", where), _int(args, "hidden_size", where)
    groups = _int(args, "num_key_value_heads", where, heads) if args.get("num_key_value_heads") else heads
    norm = str(args.get("normalization") or "layernorm").lower()
    if norm not in ("layernorm", "rmsnorm"):
        raise InteropError(f"{where}: args.normalization={norm!r} is not supported (layernorm, rmsnorm are)")
    rope = bool(args.get("use_rotary_position_embeddings")) or args.get("position_embedding_type") == "rope"
    if rope == has_position:
        raise InteropError(f"{where}: args say {'rotary' if rope else 'learned'} positions, the embedding file "
                           f"{'has' if has_position else 'has no'} position_embeddings")
    # megatron/model/transformer.py ParallelMLP: bias_gelu_fusion (with biases) is the tanh GeLU, else F.gelu (erf)
    tanh = args.get("openai_gelu") or (args.get("bias_gelu_fusion") and has_bias)
    activation = "swiglu" if args.get("swiglu") else ("gelu_tanh" if tanh else "gelu")
    padded = _int(args, "padded_vocab_size", where)
    vocab = args.get("vocab_size")  # not a Megatron arg; some launchers record it
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and 0 < vocab <= padded else padded
    arch = "gpt2" if (norm == "layernorm" and not rope and activation != "swiglu") else "llama"
    return ModelSpec(
        arch=arch, num_layers=_int(args, "num_layers", where), hidden=hidden,
        ffn_hidden=_int(args, "ffn_hidden_size", where, 4 * hidden), heads=heads, kv_groups=groups,
        head_dim=_int(args, "kv_channels", where, hidden // heads), vocab=vocab, padded_vocab=padded,
        max_positions=_int(args, "max_position_embeddings", where, 2048), norm=norm,
        norm_eps=float(args.get("layernorm_epsilon") or 1e-5), activation=activation,
        position="rope" if rope else "learned", rope_base=float(args.get("rope_theta") or 10000),
        tied_embeddings=not args.get("untie_embeddings_and_output_weights"), qkv_bias=has_bias,
        linear_bias=has_bias, dtype=dtype)


class Reader(BaseReader):
    """A DeepSpeed pipeline checkpoint: Megatron-DeepSpeed's GPTModelPipe layers (described by its args), or
    a PipelineModule of a Hugging Face model's own modules (described by config.json beside or --model-config:
    `_hf_modules`)."""

    options = ("model_config", "allow_identical_ranks")

    def __init__(self, path, model_config=None, allow_identical_ranks: bool = False):
        """`allow_identical_ranks`: read a layer file whose split tensors are all byte-identical to another tp
        rank's (refused by default: a copied file)."""
        root = Path(path)
        if root.is_dir() and _tag_dir(root) is None and (root / LATEST).is_file():
            raise InteropError(f"{root / LATEST}: does not name a tag folder of this checkpoint (e.g. global_step1000)")
        if not root.is_dir() or _tag_dir(root) is None:
            raise InteropError(f"{root}: not a DeepSpeed checkpoint (no `latest` tag file and no "
                               "layer_*-model_states.pt files)")
        self.dir = _tag_dir(root)
        if not self.dir.is_dir():
            raise InteropError(f"{root / LATEST} names {self.dir.name}, which is not a folder here")
        notes: list[str] = []
        self._open_layer_files()
        mp_files = {int(m.group(1)): self.dir / p for p in sorted(q.name for q in self.dir.iterdir())
                    if (m := MP_FILE.fullmatch(p))}
        if 0 not in mp_files:
            raise InteropError(f"{self.dir}: mp_rank_00_model_states.pt is missing (it holds the engine state)")
        engine = LazyTorchFile(mp_files[0]).obj
        if len(mp_files) % self.tp or sorted(mp_files) != list(range(len(mp_files))):
            raise InteropError(f"{self.dir}: mp_rank_* files {sorted(mp_files)} do not make whole pipeline stages "
                               f"of tp {self.tp} (mp rank = stage * tp + tp rank)")
        gpt = {i: kind_of(k for k in self.files[(i, 0)].obj if not self._ignored(k)) for i in self.indices}
        if all(gpt.values()):
            if model_config is not None:
                raise InteropError("--model-config does not apply to a Megatron-DeepSpeed checkpoint (its args "
                                   "describe the model)")
            self.tables, self.tp_splits = TABLES, None  # GPTModelPipe: Megatron's TP layers, cut as canonical
            self._classified(gpt)
            args = self._describe_by_args(engine, mp_files[0], notes)
            what = "args say"
        else:
            self._hf_modules(model_config, gpt, notes)
            args, what = None, "the config says"
        if len(self.layer_indices) != self.spec.num_layers:
            raise InteropError(f"{self.dir}: {len(self.layer_indices)} transformer layer files, {what} "
                               f"num_layers={self.spec.num_layers}")
        has_head = "lm_head" in self.kinds.values()
        if args is None and not has_head and not self.spec.tied_embeddings and self._ties_logits(mp_files):
            self.spec = self.spec.replace(tied_embeddings=True)
            notes.append("the config says tie_word_embeddings=false, but no layer file holds a head and the last "
                         "stage holds the embedding as a tied module: read as tied (the pipeline computes the "
                         "logits from the embedding, as ATorch's DS 3D does)")
        if self.spec.tied_embeddings == has_head:
            said = (f"untie_embeddings_and_output_weights={not self.spec.tied_embeddings}" if args is not None else
                    f"tie_word_embeddings={self.spec.tied_embeddings}")
            raise InteropError(f"{self.dir}: {what} {said}, but the layer files {'do' if has_head else 'do not'} "
                               "hold an lm_head")
        self.spec.check_tp(self.tp)
        self.index = param_index(self.spec)
        self._rows(notes)
        self._check_distinct(notes, allow_identical_ranks)
        self.layout = self._layout(mp_files)
        self.moments: dict[str, dict] = {}
        notes.append(self._load_optimizer(mp_files, engine))
        iteration = engine.get("iteration") if isinstance(engine.get("iteration"), int) else engine.get("global_steps")
        opt = (engine.get("ds_config") or {}).get("optimizer") or {}
        params = opt.get("params") or {}
        state = {"iteration": iteration, "consumed_samples": to_plain(engine.get("global_samples")),
                 "deepspeed": {"tag": self.dir.name, "ds_version": to_plain(engine.get("ds_version")),
                               "ds_config": to_plain(engine.get("ds_config"))}}
        if args is not None:
            state["deepspeed"]["args"] = args
        if self.moments:
            state["optimizer"] = {"type": update_rule(opt), "step": self.step,
                                  "betas": list(params["betas"]) if "betas" in params else None,
                                  "eps": params.get("eps"), "weight_decay": params.get("weight_decay"),
                                  "clip_grad": (engine.get("ds_config") or {}).get("gradient_clipping",
                                                                                     GRADIENT_CLIPPING_DEFAULT)}
        if args is not None and self.spec.vocab == self.spec.padded_vocab:
            notes.append(f"the true vocabulary size is not recorded (Megatron-DeepSpeed's args keep padded_vocab_size): "
                         f"keeping all {self.spec.padded_vocab} rows")
        if engine.get("rng_state") is not None:
            notes.append("dropped the rng state (per-rank random generator states do not survive resharding)")
        if engine.get("lr_scheduler") is not None:
            notes.append("DeepSpeed's lr_scheduler state is not converted")
        self.source = Source(self.spec, self.layout, state, notes)
        self._cache: OrderedDict = OrderedDict()

    # -- opening -------------------------------------------------------------------------------
    def _open_layer_files(self) -> None:
        found: dict[tuple[int, int], Path] = {}
        for p in self.dir.iterdir():
            if m := LAYER_FILE.fullmatch(p.name):
                found[(int(m.group(1)), int(m.group(2) or 0))] = p
        if not found:
            raise InteropError(f"{self.dir}: no layer_*-model_states.pt files (a pipeline checkpoint stores its "
                               "weights there; a non-pipelined engine's `module` is not read)")
        self.indices = sorted({i for i, _ in found})
        self.tp = max(t for _, t in found) + 1
        for i in self.indices:
            for t in range(self.tp):
                if (i, t) not in found:
                    raise InteropError(f"{self.dir}: layer_{i:02d}-model_{t:02d}-model_states.pt is missing "
                                       f"(the checkpoint has {self.tp} model-parallel ranks)")
        self.files = {k: LazyTorchFile(p) for k, p in found.items()}
        for i in self.indices:
            sd = self.files[(i, 0)].obj
            if not isinstance(sd, dict):
                raise InteropError(f"{self.files[(i, 0)].path}: expected a state dict, found {type(sd).__name__}")

    def _classified(self, kinds: dict[int, str]) -> None:
        """Record each layer file's kind; one embedding, one final norm and some transformer layers."""
        self.kinds, self.keys = kinds, {"embedding": [], "layer": [], "final_norm": [], "lm_head": []}
        for i in self.indices:
            self.keys[kinds[i]].append(list(self.files[(i, 0)].obj))
        for kind in ("embedding", "final_norm"):
            if len(self.keys[kind]) != 1:
                raise InteropError(f"{self.dir}: {len(self.keys[kind])} {kind.replace('_', ' ')} layer files "
                                   "(one expected)")
        if not self.keys["layer"]:
            raise InteropError(f"{self.dir}: no transformer layer files")
        self.layer_indices = [i for i in self.indices if kinds[i] == "layer"]

    def _describe_by_args(self, engine: dict, where: Path, notes: list[str]) -> dict:
        """GPTModelPipe: the model from Megatron-DeepSpeed's args in the engine state (returned)."""
        args = _args(engine, where)
        dtype = self._dtype(next(i for i, k in self.kinds.items() if k == "embedding"))
        has_bias = any(k.endswith("dense.bias") for k in self.keys["layer"][0])
        has_position = "position_embeddings.weight" in self.keys["embedding"][0]
        self.spec = spec_from_args(args, where, dtype, has_bias, has_position)
        if self.spec.activation == "gelu" and "bias_gelu_fusion" not in args and not args.get("openai_gelu"):
            notes.append("args do not say bias_gelu_fusion: assumed the exact (erf) GeLU")
        return args

    def _hf_modules(self, model_config, gpt: dict, notes: list[str]) -> None:
        """A PipelineModule of an HF model's own modules (no Megatron-DeepSpeed): the model from config.json
        beside the tag folder or --model-config; the layer files by position: the files holding a decoder
        layer's keys (its HF names after `layers.{i}.`) are the layers, in index order; the one before them the
        embedding; after them a 1-D `weight` is the final norm, a [vocab, hidden] one the head."""
        config = next((c for c in (self.dir.parent / "config.json", self.dir / "config.json") if c.is_file()), None)
        if model_config is None and config is None:
            bad = next(i for i, k in gpt.items() if k is None)
            raise InteropError(f"{self.files[(bad, 0)].path}: not a Megatron-DeepSpeed GPTModelPipe module (keys "
                               f"{sorted(self.files[(bad, 0)].obj)[:4]}); a PipelineModule of HF modules is read "
                               "with its config.json beside `latest` or --model-config")
        empty = [i for i in self.indices if not self.files[(i, 0)].obj]
        if empty:  # a module without parameters or persistent buffers (transformers 5's model-level rotary_emb)
            self.indices = [i for i in self.indices if i not in empty]
            notes.append(f"skipped {', '.join(f'layer_{i:02d}' for i in empty)}: no tensors (a module without "
                         "parameters, e.g. the model's rotary embedding)")
        dtype = self._dtype(self.indices[0])
        if model_config is not None:
            self.spec = spec_from_file(model_config, dtype)
            notes.append(f"model description taken from {model_config}")
        else:
            self.spec = spec_from_hf_config(read_json_object(config, "HF config"), dtype, where=str(config))
        self.tables = hf_module_tables(HF_TABLES[hf_table(self.spec)])
        self.tp_splits = ATORCH_TP_SPLITS  # HF modules over tp ranks: only as ATorch's DS 3D splits them
        if self.tables is None:
            raise InteropError(f"{self.dir}: a {self.spec.arch} model's learned position table has no module of "
                               "its own in a PipelineModule of HF modules: not read")
        layer_keys = {key for key, _, _ in self.tables["layer"]}
        kinds = {}
        for i in self.indices:
            keys = {k for k in self.files[(i, 0)].obj if not self._ignored(k)}
            if keys and keys <= layer_keys:
                kinds[i] = "layer"
        if not kinds:
            raise InteropError(f"{self.dir}: no layer file holds a {self.spec.arch} decoder layer's keys "
                               f"(e.g. {sorted(layer_keys)[:2]})")
        first, last = min(kinds), max(kinds)
        for i in self.indices:
            if i in kinds:
                continue
            sd = self.files[(i, 0)].obj
            weight = sd.get("weight")
            if not isinstance(weight, torch.Tensor) or not set(sd) <= {"weight", "bias"} or first < i < last:
                raise InteropError(f"{self.files[(i, 0)].path}: not a module of an HF {self.spec.arch} model "
                                   f"(keys {sorted(sd)[:4]})")
            kinds[i] = ("embedding" if i < first else "final_norm" if len(weight.shape) == 1 else "lm_head")
        self._classified(kinds)
        notes.append("a PipelineModule of HF modules: the embedding, final norm and head told apart by their "
                     "place and shape")
        embed = next(i for i, k in kinds.items() if k == "embedding")
        vocab, rows, vocab_notes = vocab_from_rows(self.files[(embed, 0)].obj["weight"].shape[0] * self.tp,
                                                   self.spec.vocab, None, f"{self.files[(embed, 0)].path}: weight "
                                                   f"over tp={self.tp}", stated_by="the config")
        notes += vocab_notes
        if (vocab, rows) != (self.spec.vocab, self.spec.padded_vocab):
            self.spec = self.spec.replace(vocab=vocab, padded_vocab=rows)
        if self.tp > 1:
            notes.append(f"HF modules split over {self.tp} tensor-parallel ranks as ATorch's DS 3D splits Llama "
                         "(q/k/v/gate/up by rows, o/down by columns, a vocab-parallel embedding)")

    def _ties_logits(self, mp_files: dict) -> bool:
        """The last stage holds a tied module (`tied_modules.<key>.` in its param_shapes) and no layer file a head:
        the logits are computed from the tied embedding (a TiedLayerSpec's forward_fn, ATorch's tie_first)."""
        last = LazyTorchFile(mp_files[(len(mp_files) // self.tp - 1) * self.tp]).obj
        shapes = last.get("param_shapes") if isinstance(last, dict) else None
        return isinstance(shapes, list) and any(str(k).startswith("tied_modules.") for g in shapes for k in g)

    @staticmethod
    def _ignored(key: str) -> str | None:
        return next((why for suffix, why in IGNORED_SUFFIXES.items() if key.endswith(suffix)), None)

    def _dtype(self, index: int) -> str:
        """The weights' dtype, from layer file `index`'s first tensor (the embedding's)."""
        stored = next(iter(self.files[(index, 0)].obj.values())).dtype
        if stored not in NAME_OF_DTYPE:
            raise InteropError(f"{self.dir}: weights stored as {stored} (fp32, bf16, fp16 are read)")
        return NAME_OF_DTYPE[stored]

    def _rows(self, notes: list[str]) -> None:
        """{canonical name: (layer index, key, transform, parts, part number)} from the name tables."""
        self.row_of, dropped = {}, set()
        for idx, kind in self.kinds.items():
            i = self.layer_indices.index(idx) if kind == "layer" else None
            stored = self.files[(idx, 0)].obj
            used = set()
            for key, transform, parts in self.tables[kind]:
                names = [p.format(i=i) for p in parts]
                if key in used or key not in stored or not all(n in self.index for n in names):
                    continue
                used.add(key)
                bound = transform.bind(self.spec, [self.index[n] for n in names])
                if self.tp > 1 and self.tp_splits is not None and bound.axis != self.tp_splits.get((kind, key)):
                    raise InteropError(f"{self.files[(idx, 0)].path}: {key} over {self.tp} tensor-parallel ranks: "
                                       "HF modules are read split as ATorch's DS 3D splits Llama's (q/k/v/gate/up "
                                       "by rows, o/down by columns, the embedding by rows); this one is not")
                for j, n in enumerate(names):
                    self.row_of[n] = (idx, key, bound, names, j)
            for key in stored:
                if key not in used:
                    why = self._ignored(key)
                    if why is None:
                        raise InteropError(f"{self.files[(idx, 0)].path}: {key} does not belong to the model the "
                                           f"args describe ({self.spec.arch}, bias {self.spec.linear_bias})")
                    dropped.add(why)
        missing = [p.name for p in param_table(self.spec) if p.name not in self.row_of]
        if missing:
            raise InteropError(f"{self.dir}: {missing[0]} is in no layer file")
        for name, (idx, key, transform, names, j) in self.row_of.items():
            if j == 0:
                got = tuple(self.files[(idx, 0)].obj[key].shape)
                want = transform.rank_shape(0, self.tp)
                if got != want:
                    raise InteropError(f"{self.files[(idx, 0)].path}: {key} has shape {list(got)}, the args imply "
                                       f"{list(want)} per tp rank")
        if dropped:
            notes.append(f"dropped buffers that are not parameters ({'; '.join(sorted(dropped))})")

    def _check_distinct(self, notes: list[str], allow: bool) -> None:
        """No layer file is a copy of another tp rank's (`interop.distinct_ranks`: by its split tensors'
        records' CRC-32s, nothing read)."""
        if self.tp < 2:
            return
        split: dict[int, set] = {}
        for idx, key, transform, _, _ in self.row_of.values():
            if not transform.replicated:
                split.setdefault(idx, set()).add(key)
        for idx, keys in sorted(split.items()):
            group = []
            for t in range(self.tp):
                f = self.files[(idx, t)]
                sums = record_sums(f, ((k, x) for k, x in f.obj.items() if k in keys)) if isinstance(f.obj, dict) \
                    else None
                group.append(RankPrint(str(f.path), f"tensor-parallel rank {t}", sums,
                                       f"every split tensor ({len(sums or ())})"))
            check_distinct(group, notes, allow)

    def _layout(self, mp_files: dict) -> ParallelLayout:
        """The pipeline stages: which transformer layers each stage's engine file lists (param_shapes)."""
        pp = len(mp_files) // self.tp
        stages, start = [], 0
        for p in range(pp):
            engine = LazyTorchFile(mp_files[p * self.tp]).obj
            shapes = engine.get("param_shapes") if isinstance(engine, dict) else None
            if not isinstance(shapes, list):
                raise InteropError(f"{mp_files[p * self.tp]}: no param_shapes (which layers stage {p} holds)")
            heads = [k.split(".", 1)[0] for group in shapes for k in group]
            indices = {int(h) for h in heads if h.isascii() and h.isdigit()}
            count = len(indices & set(self.layer_indices))
            stages.append(((start, start + count),))
            start += count
        if start != len(self.layer_indices):
            raise InteropError(f"{self.dir}: the stages' param_shapes list {start} transformer layers, the files "
                               f"{len(self.layer_indices)}")
        return ParallelLayout(self.tp, pp, tuple(stages))

    # -- optimizer -----------------------------------------------------------------------------
    def _load_optimizer(self, mp_files: dict, engine: dict) -> str:
        """ZeRO 1/2 masters and Adam moments per parameter, or why not (the note for the summary).

        Each parameter group's flat buffer (parameters in `param_shapes` order, padded at the end)
        is cut in equal partitions, one per data-parallel rank (deepspeed/runtime/zero/stage_1_and_2.py);
        `param_slice_mappings` says where each parameter's fragment lies in a rank's partition."""
        zero = {}
        for p in self.dir.iterdir():
            if m := ZERO_FILE.fullmatch(p.name):
                zero[(int(m.group(1)), int(m.group(2)))] = p
        if not zero:
            if any(p.name.startswith("bf16_zero_pp_rank_") for p in self.dir.iterdir()):
                return ("optimizer state not converted (DeepSpeed's bf16 optimizer files bf16_zero_pp_rank_* are not "
                        "read); weights converted")
            if engine.get("optimizer") is not None:
                return "optimizer state not converted (DeepSpeed's non-ZeRO optimizer in mp_rank files); weights converted"
            return "optimizer state not converted (no zero_pp_rank_*_optim_states.pt files); weights converted"
        dp = max(d for d, _ in zero) + 1
        where: dict[str, tuple] = {}  # "{mp}/{ds name}" -> (partitions, partition size, offset, numel)
        for mp in sorted(mp_files):
            shapes = LazyTorchFile(mp_files[mp]).obj.get("param_shapes")
            parts = []
            for d in range(dp):
                path = zero.get((d, mp))
                if path is None:
                    return (f"optimizer state not converted (zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt is "
                            "missing); weights converted")
                f = LazyTorchFile(path)
                osd = f.obj.get("optimizer_state_dict") if isinstance(f.obj, dict) else None
                if not isinstance(osd, dict) or "param_slice_mappings" not in osd:
                    return f"optimizer state not converted ({path.name} is not ZeRO stage 1/2's state); weights converted"
                parts.append((f, osd))
            if not isinstance(shapes, list) or len(shapes) != len(parts[0][1]["param_slice_mappings"]):
                return f"optimizer state not converted ({mp_files[mp].name}: param_shapes do not match its ZeRO groups)"
            for g, group in enumerate(shapes):
                partitions = []
                for f, osd in parts:
                    state = ((osd.get("base_optimizer_state") or {}).get("state") or {}).get(g) or {}
                    if not all(k in state for k in MOMENTS):
                        return "optimizer state not converted (the optimizer holds no Adam state yet); weights converted"
                    partitions.append((f, {"fp32_param": osd["single_partition_of_fp32_groups"][g],
                                           **{k: state[k] for k in MOMENTS}}))
                    step = state.get("step")
                    self.step = int(f.read(step).item() if isinstance(step, torch.Tensor) else step or 0)
                size = partitions[0][1]["fp32_param"].numel()
                offset = 0
                for name, shape in group.items():
                    numel = torch.Size(shape).numel()
                    where[f"{mp}/{name}"] = (partitions, size, offset, numel)
                    offset += numel
                if offset > size * dp:
                    return f"optimizer state not converted (ZeRO group {g} of mp rank {mp} is smaller than its parameters)"
                for d, (f, osd) in enumerate(parts):  # DeepSpeed's own fragment map must agree with the offsets
                    for name, frag in osd["param_slice_mappings"][g].items():
                        fields = frag.state if isinstance(getattr(frag, "state", None), dict) else vars(frag)
                        _, _, at, numel = where.get(f"{mp}/{name}", (None, None, -1, 0))
                        if max(at - d * size, 0) != int(fields["start"]) or int(fields["numel"]) > numel:
                            return (f"optimizer state not converted ({f.path.name}: {name}'s fragment is not where "
                                    "the parameter order puts it); weights converted")
        self.zero_where = where
        self.moments = {k: {} for k in ("exp_avg", "exp_avg_sq", "fp32_param")}
        how = f" over {dp} data-parallel partitions" if dp > 1 else ""
        return f"converted the ZeRO optimizer state (exp_avg, exp_avg_sq, fp32 masters){how}, step {self.step}"

    def _zero_tensor(self, kind: str, idx: int, key: str, t: int) -> torch.Tensor:
        """Layer file (idx, t)'s `key` in the ZeRO state, gathered from the partitions, shaped like the weight."""
        mp = self._stage_of_index(idx) * self.tp + t
        names = [f"{idx}.{key}"]
        if self.kinds[idx] == "embedding":  # a tied embedding is a tied module: `tied_modules.embed.` in GPTModelPipe,
            tied = f"{mp}/tied_modules."    # `tied_modules.embed_tokens.` (its HF module's name) in ATorch's DS 3D
            names += [n.split("/", 1)[1] for n in self.zero_where if n.startswith(tied) and n.endswith(f".{key}")]
        for n in names:
            if f"{mp}/{n}" in self.zero_where:
                partitions, size, offset, numel = self.zero_where[f"{mp}/{n}"]
                shape = self.files[(idx, t)].obj[key].shape
                if numel != shape.numel():
                    raise InteropError(f"{self.dir}: ZeRO state of {n} holds {numel} elements, its weight {shape.numel()}")
                pieces = []
                for d, (f, flats) in enumerate(partitions):
                    lo, hi = max(offset, d * size), min(offset + numel, (d + 1) * size)
                    if lo < hi:
                        pieces.append(f.read(flats[kind][lo - d * size:hi - d * size]))
                return torch.cat(pieces).view(shape)
        raise InteropError(f"{self.dir}: no ZeRO optimizer state for {names[0]} (mp rank {mp})")

    def _stage_of_index(self, idx: int) -> int:
        kind = self.kinds[idx]
        if kind == "embedding":
            return 0
        if kind in ("final_norm", "lm_head"):
            return self.layout.pp - 1
        return self.layout.stage_of_layer(self.layer_indices.index(idx))

    # -- the Reader contract -------------------------------------------------------------------
    def metas(self) -> list[TensorMeta]:
        out = []
        for p in param_table(self.spec):
            idx, key, _, _, _ = self.row_of[p.name]
            out.append(TensorMeta(p.name, self.files[(idx, 0)].obj[key].dtype, p.shape))
        for kind in self.moments:
            out += [TensorMeta(str(TensorKey(p.name, kind)), torch.float32, p.shape) for p in param_table(self.spec)]
        return out

    def _stored(self, kind: str, idx: int, key: str, t: int) -> torch.Tensor:
        if not kind:
            return self.files[(idx, t)].read(self.files[(idx, t)].obj[key])
        return self._zero_tensor(kind, idx, key, t)

    def _assemble(self, kind: str, idx: int, key: str, transform) -> list[torch.Tensor]:
        """The canonical tensors of one stored key, from every TP rank's file."""
        if transform.replicated:
            return [self._stored(kind, idx, key, 0)]
        return transform.from_ranks([self._stored(kind, idx, key, t) for t in range(self.tp)])

    def read(self, name: str) -> torch.Tensor:
        base = base_param_name(name)
        kind = name.split(".")[1] if base != name else ""
        idx, key, transform, names, j = self.row_of[base]
        ident = (kind, idx, key)
        if ident not in self._cache:
            self._cache[ident] = self._assemble(kind, idx, key, transform)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[ident][j].contiguous()

    def native_name(self, name: str) -> str:
        idx, key, _, names, j = self.row_of[base_param_name(name)]
        tp = f"-model_00..{self.tp - 1:02d}" if self.tp > 1 else ""
        part = f" [part {j + 1}/{len(names)}]" if len(names) > 1 else ""
        return f"layer_{idx:02d}{tp}: {key}{part}"

    def close(self) -> None:
        self._cache.clear()
