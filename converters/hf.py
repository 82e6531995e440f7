"""Hugging Face GPT2 / Llama checkpoints <-> canonical tensors.

Reads `model.safetensors` (single or sharded with `model.safetensors.index.json`)
and `pytorch_model.bin` (single or sharded); writes safetensors + config.json that
`AutoModelForCausalLM.from_pretrained` loads.  Fused and transposed tensors are
described by the tables in `interop.mappings.hf_names`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import InteropError
from ..fused import split_concat
from ..io.paths import inside
from ..io.safetensors import SafetensorsFile, SafetensorsWriter
from ..io.small_files import read_json_object
from ..memory import BufferPool
from ..mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from ..mappings.hf_names import IGNORED_SUFFIXES, TABLES
from ..params import OPTIM_PREFIXES, param_index, param_table
from ..spec import ModelSpec
from ..tensors import NAME_OF_DTYPE, Source, TensorMeta

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
DEFAULT_SHARD_BYTES = 5 << 30


def detect(path) -> bool:
    root = Path(path)
    return (root / "config.json").is_file() and any((root / f).is_file() for f in WEIGHT_FILES)


def hf_rows(spec: ModelSpec) -> list[tuple[str, str, list[str]]]:
    """The architecture's name table expanded for this model, keeping rows whose tensors exist."""
    present = param_index(spec)
    rows = []
    for hf_name, kind, parts in TABLES[spec.arch]:
        layers = range(spec.num_layers) if "{i}" in hf_name else [None]
        for i in layers:
            names = [p.format(i=i) for p in parts]
            if all(n in present for n in names):
                rows.append((hf_name.format(i=i), kind, names))
    return rows


def _to_hf(kind: str, parts: list[torch.Tensor], empty) -> torch.Tensor:
    """The HF tensor; a Conv1D transpose stays a view (the safetensors writer gathers it in a reused
    buffer), and `empty(shape, dtype)` provides reusable memory for a concatenation."""
    if len(parts) == 1:
        fused = parts[0]
    else:
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        fused = torch.cat(parts, out=empty(shape, parts[0].dtype))
    return fused.t() if kind == "conv1d" else fused


def _from_hf(kind: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    canonical = tensor.t() if kind == "conv1d" else tensor
    return split_concat(canonical, sizes) if len(sizes) > 1 else [canonical.contiguous()]


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


class Reader:
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
        self.rows = hf_rows(spec)
        index = param_index(spec)
        self.part_of = {}
        for hf_key, kind, parts in self.rows:
            if hf_key not in keys:
                raise InteropError(f"{root}: tensor {hf_key} is missing (config.json describes a {spec.arch} "
                                   f"model with {spec.num_layers} layers)")
            want = (sum(index[p].shape[0] for p in parts),) + index[parts[0]].shape[1:]
            if kind == "conv1d":
                want = tuple(reversed(want))
            got = self.files.meta(hf_key)[1]
            if got != want:
                raise InteropError(f"{root}: {hf_key} has shape {list(got)}, config.json implies {list(want)}")
            keys.discard(hf_key)
            for i, p in enumerate(parts):
                self.part_of[p] = (hf_key, kind, parts, i)
        if spec.tied_embeddings and "lm_head.weight" in keys:
            keys.discard("lm_head.weight")
            notes.append("dropped lm_head.weight: the model ties it to the input embedding")
        if keys:
            raise InteropError(f"{root}: {len(keys)} tensors do not belong to a {spec.arch} model, e.g. {sorted(keys)[0]}")
        self.spec = spec
        self.source = Source(spec, None, notes=notes)
        self._cached = (None, None)

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, self.files.meta(self.part_of[p.name][0])[0], p.shape) for p in param_table(self.spec)]

    def read(self, name: str) -> torch.Tensor:
        hf_key, kind, parts, i = self.part_of[name]
        if self._cached[0] != hf_key:  # q, k and v come from one fused tensor: read it once
            index = param_index(self.spec)
            sizes = [index[p].shape[0] for p in parts]
            self._cached = (hf_key, _from_hf(kind, self.files.read(hf_key), sizes))
        return self._cached[1][i]

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` with `name` when HF stores it as it is (not fused, not transposed); else False."""
        hf_key, kind, parts, _ = self.part_of[name]
        if kind != "copy" or len(parts) != 1:
            return False
        self.files.read_into(hf_key, out)
        return True

    def close(self) -> None:
        self._cached = (None, None)


class Writer:
    """Writes HF safetensors (sharded past `max_shard_bytes`) and config.json."""

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        return spec.vocab  # HF holds the true vocabulary only

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        if layout.tp != 1 or layout.pp != 1:
            raise InteropError("a Hugging Face checkpoint is not sharded: use --tp 1 --pp 1")
        self.root, self.spec = Path(root), spec
        meta_of = {m.name: m for m in metas}
        position = {m.name: i for i, m in enumerate(metas)}
        rows = sorted(hf_rows(spec), key=lambda row: max(position[p] for p in row[2]))
        self.row_of, self.pending, self.dropped_optim = {}, {}, set()
        self.memory = BufferPool()  # reused memory for fused (c_attn) tensors
        shards, size = [[]], 0
        for hf_key, kind, parts in rows:
            first = meta_of[parts[0]]
            shape = (sum(meta_of[p].shape[0] for p in parts),) + first.shape[1:]
            if kind == "conv1d":
                shape = tuple(reversed(shape))
            nbytes = TensorMeta(hf_key, first.dtype, shape).nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((hf_key, first.dtype, shape))
            size += nbytes
            for p in parts:
                self.row_of[p] = (hf_key, kind, parts)
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.shard_files = list(zip(names, shards))
        self.writers, self.file_of = {}, {}
        for name, entries in self.shard_files:
            self.writers[name] = SafetensorsWriter(self.root / name, entries, {"format": "pt"}, checksum=False)
            for key, _, _ in entries:
                self.file_of[key] = name

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(OPTIM_PREFIXES):  # HF checkpoints hold weights only
            self.dropped_optim.add(name.split(".")[1])
            return
        hf_key, kind, parts = self.row_of[name]
        got = self.pending.setdefault(hf_key, {})
        got[name] = tensor
        if len(got) == len(parts):
            del self.pending[hf_key]
            self.writers[self.file_of[hf_key]].write(hf_key, _to_hf(kind, [got[p] for p in parts], self.memory.empty))

    def write_ranges(self, name: str, ranges) -> bool:
        """Write `name` straight from byte ranges of the source's files when HF stores it unchanged
        (a single-tensor row, not transposed); False when it must come through `write`."""
        if name.startswith(OPTIM_PREFIXES):
            self.write(name, None)  # not kept: no need to read it
            return True
        hf_key, kind, parts = self.row_of[name]
        if kind != "copy" or len(parts) != 1:
            return False
        self.writers[self.file_of[hf_key]].copy_ranges(hf_key, ranges)
        return True

    def finish(self, state: dict | None = None) -> None:
        total = 0
        for writer in self.writers.values():
            total += writer.close()[0]
        (self.root / "config.json").write_text(json.dumps(hf_config_from_spec(self.spec), indent=2) + "\n")
        if len(self.shard_files) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, entries in self.shard_files for key, _, _ in entries}}
            (self.root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    @property
    def notes(self) -> list[str]:
        if not self.dropped_optim:
            return []
        return [f"optimizer state not written ({', '.join(sorted(self.dropped_optim))}): "
                "a Hugging Face checkpoint holds weights only"]

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
