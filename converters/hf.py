"""Hugging Face GPT2 / Llama-style (and Mixtral / Qwen2-MoE) checkpoints <-> canonical tensors.

Reads `model.safetensors` (single or sharded with `model.safetensors.index.json`)
and `pytorch_model.bin` (single or sharded); writes safetensors + config.json that
`AutoModelForCausalLM.from_pretrained` loads.  Fused and transposed tensors are
described by the tables in `interop.mappings.hf_names`.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from ..errors import InteropError
from ..io.paths import inside
from ..io.safetensors import SafetensorsFile, SafetensorsWriter
from ..contract import BaseReader, BaseWriter
from ..io.small_files import read_json_object
from ..memory import BufferPool
from ..mappings.hf_config import MOE_TRAINING_KEYS, hf_config_from_spec, hf_family, spec_from_hf_config
from ..hf_named import hf_rows, hf_table
from ..mappings.hf_names import IGNORED_SUFFIXES, STACKED_EXPERT_SUFFIXES
from ..params import TensorKey, param_table
from ..rows import RowCollector
from ..spec import ModelSpec
from ..state import TrainingState
from ..tensors import NAME_OF_DTYPE, Source, TensorMeta
from ..transforms import Transform

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
DEFAULT_SHARD_BYTES = 5 << 30
# What makes an HF directory a complete model besides weights and config.json: carried from an HF
# source as they are; from `--tokenizer DIR` the tokenizer ones.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
MODEL_FILES = TOKENIZER_FILES + ("generation_config.json",)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20,
         "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(size) -> int:
    """Bytes from an int or a transformers-style size: "5GB" (10^9), "500MiB" (2^20), "300KB"."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
        if not match:
            raise InteropError(f"--max-shard-size {size!r}: expected a size such as 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * UNITS[match.group(2) or "B"])
    if value <= 0:
        raise InteropError(f"--max-shard-size must be positive, got {size!r}")
    return value


def detect(path) -> bool:
    root = Path(path)
    return (root / "config.json").is_file() and any((root / f).is_file() for f in WEIGHT_FILES)


def _to_hf(transform: Transform, parts: list[torch.Tensor], empty) -> torch.Tensor:
    """The HF tensor; a view where it is one (a Conv1D transpose stays a view: the safetensors writer
    gathers it in a reused buffer), else built in `empty(shape, dtype)`'s reusable memory."""
    view = transform.view(parts)
    if view is not None:
        return view
    return transform.fuse(parts, out=empty(transform.rank_shape(), parts[0].dtype))


class _WeightFiles:
    """Every tensor of an HF checkpoint by name, whatever the file layout; data read on demand."""

    def __init__(self, root: Path):
        self.root = root
        self.where: dict[str, object] = {}
        for index_name, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
            if (root / index_name).is_file():
                weight_map = read_json_object(root / index_name, "weight index", limit=256 << 20).get("weight_map")
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise InteropError(f"{root / index_name}: 'weight_map' must map tensor names to file names")
                files = sorted(set(weight_map.values()))
                for name in files:
                    inside(root, name, root / index_name)  # never read outside the checkpoint
                break
        else:
            files = ["model.safetensors"] if (root / "model.safetensors").is_file() else ["pytorch_model.bin"]
        for name in files:
            handle = self._open(root / name)
            for key in handle.keys():
                self.where[key] = handle

    @staticmethod
    def _open(path: Path):
        if not path.is_file():
            raise InteropError(f"{path}: weight file named by the index is missing")
        if path.suffix == ".safetensors":
            return SafetensorsFile(path)
        return _BinFile(path)

    def meta(self, key):
        return self.where[key].meta(key)

    def read(self, key) -> torch.Tensor:
        return self.where[key].read(key)

    def read_into(self, key, out: torch.Tensor) -> None:
        handle = self.where[key]
        if isinstance(handle, SafetensorsFile):
            handle.read(key, out=out)  # straight from the file, no mapping
        else:
            out.copy_(handle.tensors[key])


class _BinFile:
    """A `pytorch_model.bin`, memory-mapped and loaded without running code (weights_only)."""

    def __init__(self, path: Path):
        try:
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many types for a bad pickle/zip
            raise InteropError(f"{path}: cannot load ({str(exc).splitlines()[0]})") from None
        if not isinstance(self.tensors, dict):
            raise InteropError(f"{path}: expected a state dict, found {type(self.tensors).__name__}")

    def keys(self):
        return list(self.tensors)

    def meta(self, key):
        t = self.tensors[key]
        return t.dtype, tuple(t.shape)

    def read(self, key):
        return self.tensors[key].clone()


class Reader(BaseReader):
    def __init__(self, path):
        root = Path(path)
        if not detect(root):
            raise InteropError(f"{root}: not a Hugging Face checkpoint (needs config.json and model weights)")
        config = read_json_object(root / "config.json", "HF config")
        self.files = _WeightFiles(root)
        notes, keys = [], set(self.files.where)
        ignored = {key: why for key in keys for suffix, why in IGNORED_SUFFIXES.items() if key.endswith(suffix)}
        keys -= set(ignored)
        if ignored:
            notes.append(f"dropped {len(ignored)} buffers that are not parameters "
                         f"({'; '.join(sorted(set(ignored.values())))})")
        float_dtypes = [self.files.meta(k)[0] for k in keys if self.files.meta(k)[0].is_floating_point]
        dtype = NAME_OF_DTYPE.get(float_dtypes[0], "float32") if float_dtypes else "float32"
        spec = spec_from_hf_config(config, dtype, where=str(root / "config.json"))
        stacked = spec.is_moe and any(k.endswith(STACKED_EXPERT_SUFFIXES) for k in keys)
        self.model_type = config.get("model_type")  # its family's names (phi3's fused qkv_proj, ...)
        self.rows = hf_rows(spec, stacked, self.model_type)
        self.part_of = {}
        for row in self.rows:
            hf_key, transform, parts = row.key, row.transform, row.parts
            if hf_key not in keys:
                raise InteropError(f"{root}: tensor {hf_key} is missing (config.json describes a {self.model_type} "
                                   f"model with {spec.num_layers} layers)")
            want = transform.rank_shape()
            got = self.files.meta(hf_key)[1]
            if got != want:
                raise InteropError(f"{root}: {hf_key} has shape {list(got)}, config.json implies {list(want)}")
            keys.discard(hf_key)
            for i, p in enumerate(parts):
                self.part_of[p] = (hf_key, transform, parts, i)
        if spec.tied_embeddings and "lm_head.weight" in keys:
            keys.discard("lm_head.weight")
            notes.append("dropped lm_head.weight: the model ties it to the input embedding")
        if keys:
            raise InteropError(f"{root}: {len(keys)} tensors do not belong to a {self.model_type} model, e.g. {sorted(keys)[0]}")
        self.spec = spec
        self.source = Source(spec, None, notes=notes)
        self._cached: dict[str, list[torch.Tensor]] = {}  # hf key -> its canonical parts
        # carried to an HF target as they are (`Writer.carry`): tokenizer, generation config, special token ids
        self.carried = {"files": {name: root / name for name in MODEL_FILES if (root / name).is_file()},
                        "config": {k: config[k] for k in TOKEN_ID_KEYS if config.get(k) is not None}}
        if spec.is_moe:  # router training settings: not part of the model, kept for HF output and named
            training = {k: config[k] for k, default in MOE_TRAINING_KEYS[hf_family(spec)].items()
                        if config.get(k, default) != default}
            self.carried["config"].update(training)
            if training:
                notes.append(f"{', '.join(f'{k}={v}' for k, v in training.items())}: router training settings "
                             "outside the model description, kept for HF output only")

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, self.files.meta(self.part_of[p.name][0])[0], p.shape) for p in param_table(self.spec)]

    def read(self, name: str) -> torch.Tensor:
        hf_key, transform, parts, i = self.part_of[name]
        if len(parts) == 1:  # a tensor of its own: nothing to keep for the next read
            return transform.split(self.files.read(hf_key))[0]
        if hf_key not in self._cached:  # q, k and v come from one fused tensor: read it once
            # two held: a layer's stacked experts are read gate_up, down, gate_up, ... in canonical order
            while len(self._cached) >= 2:
                del self._cached[next(iter(self._cached))]
            self._cached[hf_key] = transform.split(self.files.read(hf_key))
        return self._cached[hf_key][i]

    def native_name(self, name: str) -> str:
        """The HF tensor that holds canonical `name` (with its part when fused, e.g. GPT2's c_attn)."""
        hf_key, _, parts, i = self.part_of[name]
        return hf_key if len(parts) == 1 else f"{hf_key} [part {i + 1}/{len(parts)}]"

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` with `name` when HF stores it as it is (not fused, not transposed); else False."""
        hf_key, transform, _, _ = self.part_of[name]
        if not transform.unchanged:
            return False
        self.files.read_into(hf_key, out)
        return True

    def close(self) -> None:
        self._cached.clear()


class Writer(BaseWriter):
    """Writes HF safetensors (sharded past `max_shard_bytes`) and config.json."""
    options = ("max_shard_size", "max_shard_bytes", "tokenizer", "renormalize_topk", "family")
    splits = True
    holds_moe = True  # Mixtral and Qwen2-MoE (mappings.hf_config.MOE_KEYS)

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        return spec.vocab  # HF holds the true vocabulary only

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], max_shard_size=None,
                 max_shard_bytes: int | None = None, tokenizer=None, renormalize_topk: bool = False, only=None,
                 family: str | None = None):
        """`max_shard_size`: bytes per weight file ("5GB" style or an int; `max_shard_bytes` is the older name).
        `tokenizer`: a tokenizer directory (its tokenizer files are copied), or one tokenizer file
        (`tokenizer.model` of sentencepiece, as Megatron's --tokenizer-model names, or a `tokenizer.json`).
        `renormalize_topk`: write a MoE model whose top-k probabilities are not renormalised (megatron-core's
        moe_router_pre_softmax, as mbridge builds Mixtral) as HF Mixtral anyway, whose router renormalises them."""
        if layout.tp != 1 or layout.pp != 1 or layout.ep != 1:
            raise InteropError("a Hugging Face checkpoint is not sharded: use --tp 1 --pp 1 --ep 1")
        max_shard_bytes = parse_size(max_shard_size if max_shard_size is not None else
                                     max_shard_bytes if max_shard_bytes is not None else DEFAULT_SHARD_BYTES)
        self.tokenizer = Path(tokenizer) if tokenizer else None
        if self.tokenizer and not self.tokenizer.exists():
            raise InteropError(f"--tokenizer {tokenizer}: no such file or directory")
        if self.tokenizer and self.tokenizer.is_dir() and not any((self.tokenizer / f).is_file() for f in TOKENIZER_FILES):
            raise InteropError(f"--tokenizer {tokenizer}: no tokenizer files in it (looked for {', '.join(TOKENIZER_FILES[:4])}, ...)")
        self.carried = {"files": {}, "config": {}}
        self.written_notes: list[str] = []
        if renormalize_topk and spec.is_moe and not spec.moe_norm_topk:
            spec = spec.replace(moe_norm_topk=True)
            self.written_notes.append(
                "--renormalize-topk: the HF router renormalises each token's top-k expert probabilities to sum to "
                "1, the source's did not (moe_router_pre_softmax): the same weights compute other outputs "
                "(interop verify runs both and shows the logit difference)")
        self.root, self.spec = Path(root), spec
        self.family = family  # `--family`: the HF model_type to write (None: the one the facts pick)
        config = hf_config_from_spec(spec, model_type=family)  # a model HF cannot hold is refused before writing
        if config["model_type"] == "mixtral" and spec.ffn_hidden != spec.moe_ffn_hidden:
            self.written_notes.append(f"ffn_hidden {spec.ffn_hidden} not written (no layer is dense): HF Mixtral's "
                                      f"intermediate_size is the experts' {spec.moe_ffn_hidden}")
        meta_of = {m.name: m for m in metas}
        position = {m.name: i for i, m in enumerate(metas)}
        rows = sorted(hf_rows(spec, model_type=family), key=lambda row: max(position[p] for p in row.parts))
        self.row_of, self.pending = {}, RowCollector()
        self.dropped_optim = {key.kind for key in (TensorKey.parse(m.name) for m in metas) if key.is_optim}
        self.memory = BufferPool()  # reused memory for fused (c_attn) tensors
        shards, size = [[]], 0
        for row in rows:
            hf_key, transform, parts = row.key, row.transform, row.parts
            first = meta_of[parts[0]]
            shape = transform.rank_shape()
            nbytes = TensorMeta(hf_key, first.dtype, shape).nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((hf_key, first.dtype, shape))
            size += nbytes
            for p in parts:
                self.row_of[p] = (hf_key, transform, parts)
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.shard_files = list(zip(names, shards))
        self.units = names  # `only`: the shard files to write, for a conversion split over processes (`interop.workers`)
        self.writers, self.file_of = {}, {}
        for name, entries in self.shard_files:
            if only is None or name in only:
                self.writers[name] = SafetensorsWriter(self.root / name, entries, {"format": "pt"}, checksum=False)
            for key, _, _ in entries:
                self.file_of[key] = name

    def wants(self, name: str) -> bool:
        return not TensorKey.parse(name).is_optim and self.file_of[self.row_of[name][0]] in self.writers

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if TensorKey.parse(name).is_optim:  # HF checkpoints hold weights only (a note says so)
            return
        hf_key, transform, parts = self.row_of[name]
        tensors = self.pending.add(hf_key, parts, name, tensor)
        if tensors is not None:
            self.writers[self.file_of[hf_key]].write(hf_key, _to_hf(transform, tensors, self.memory.empty))

    def write_ranges(self, name: str, ranges) -> bool:
        """Write `name` straight from byte ranges of the source's files when HF stores it unchanged
        (a single-tensor row, not transposed); False when it must come through `write`."""
        if TensorKey.parse(name).is_optim:
            return True  # not kept: no need to read it
        hf_key, transform, _ = self.row_of[name]
        if not transform.unchanged:
            return False
        self.writers[self.file_of[hf_key]].copy_ranges(hf_key, ranges)
        return True

    def carry(self, carried) -> bool:
        """What an HF source holds besides weights (`Reader.carried`): files to copy, config.json token ids."""
        self.carried = carried
        return True

    def _model_files(self) -> dict:
        """{name in the output: file to copy} for the tokenizer and generation config."""
        files = dict(self.carried.get("files", {}))
        tok = self.tokenizer
        if tok is None:
            return files
        files = {k: v for k, v in files.items() if k not in TOKENIZER_FILES}  # --tokenizer replaces the source's
        if tok.is_dir():
            files.update({name: tok / name for name in TOKENIZER_FILES if (tok / name).is_file()})
        elif tok.name.endswith(".json"):
            files["tokenizer.json"] = tok
        else:  # a sentencepiece model, as Megatron's --tokenizer-model names it
            files["tokenizer.model"] = tok
        return files

    def _write_tokenizer_config(self, files: dict) -> None:
        """A single tokenizer file needs a tokenizer_config.json naming its class for AutoTokenizer."""
        if "tokenizer_config.json" in files or not ({"tokenizer.json", "tokenizer.model"} & set(files)):
            return
        cls = "PreTrainedTokenizerFast" if "tokenizer.json" in files else "LlamaTokenizer"
        config = {"tokenizer_class": cls}
        if cls == "LlamaTokenizer":
            config.update({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True})
            self.written_notes.append("wrote tokenizer_config.json for the sentencepiece tokenizer.model "
                                      "(LlamaTokenizer, <s> </s> <unk>): check its special tokens")
        (self.root / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def _tokenizer_from_args(self, state: dict | None) -> None:
        """No --tokenizer and none carried: the source's own tokenizer file (`TrainingState.tokenizer_model`, a
        Megatron `--tokenizer-model`), when that file exists here, is what it was trained with; taken, and said so."""
        if self.tokenizer is not None or set(self.carried.get("files", {})) & set(TOKENIZER_FILES):
            return
        named = TrainingState.of(state).tokenizer_model
        if named is not None and Path(named).is_file():
            self.tokenizer = Path(named)
            self.written_notes.append(f"tokenizer: {named}, the checkpoint's --tokenizer-model "
                                      "(--tokenizer overrides)")

    def finish_units(self, state: dict | None = None) -> dict:
        """Close this writer's shard files: {file: bytes}."""
        return {name: writer.close()[0] for name, writer in self.writers.items()}

    def finish_global(self, state: dict | None, results: dict) -> None:
        """config.json, the shard index, tokenizer and generation config: the files beside the weights
        (`results`: {shard file: bytes})."""
        total = sum(results[name] for name in self.units)
        self._tokenizer_from_args(state)
        files = self._model_files()
        for name, path in files.items():
            shutil.copyfile(path, self.root / name)
        self._write_tokenizer_config(files)
        if not ({"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"} & set(files)):
            self.written_notes.append("output has no tokenizer: pass --tokenizer DIR_OR_FILE (an HF tokenizer "
                                      "directory, or the tokenizer.model Megatron's --tokenizer-model names)")
        config = {**hf_config_from_spec(self.spec, model_type=self.family), **self.carried.get("config", {})}
        (self.root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if len(self.shard_files) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, entries in self.shard_files for key, _, _ in entries}}
            (self.root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    @property
    def notes(self) -> list[str]:
        notes = list(self.written_notes)
        if self.dropped_optim:
            notes.append(f"optimizer state not written ({', '.join(sorted(self.dropped_optim))}): "
                         "a Hugging Face checkpoint holds weights only")
        return notes

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
