"""Hugging Face GPT2 / Llama-style (and Mixtral / Qwen2-MoE) checkpoints <-> canonical tensors.

Reads `model.safetensors` (single or sharded with `model.safetensors.index.json`)
and `pytorch_model.bin` (single or sharded); writes safetensors + config.json that
`AutoModelForCausalLM.from_pretrained` loads.  Fused and transposed tensors are
described by the tables in `interop.mappings.hf_names`.
"""
from __future__ import annotations

import json
import re
from collections import Counter
import shutil
from pathlib import Path

import torch

from ..errors import InteropError
from ..io.paths import inside, within
from ..io.torch_file import LazyTorchFile
from ..io.safetensors import SafetensorsFile, SafetensorsWriter
from ..contract import BaseReader, BaseWriter
from ..io.small_files import read_json_object, require_small_file
from ..memory import BufferPool
from ..mappings.hf_config import MOE_TRAINING_KEYS, hf_config_from_spec, hf_family, spec_from_hf_config
from ..hf_named import hf_rows, hf_table
from ..mappings.hf_names import FP8_KEEP, IGNORED_SUFFIXES, MIRRORS, STACKED_EXPERT_SUFFIXES
from ..params import TensorKey, param_index, param_table
from ..rows import Row, RowCollector
from ..shards import Box
from ..spec import ModelSpec
from ..tensors import DTYPE_NAMES as DTYPE_OF_NAME
from ..tensors import NAME_OF_DTYPE, Source, TensorMeta
from ..transforms import MXFP4, BlockScaledFP8, Transform

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
DEFAULT_SHARD_BYTES = 5 << 30
# What makes an HF directory a complete model besides weights and config.json: carried from an HF
# source as they are; from `--tokenizer DIR` the tokenizer ones.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
TOKENIZER_LIMIT = 1 << 30  # bytes of a --tokenizer file: a 256k-vocabulary tokenizer.json is ~30 MB
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


def hf_mirrors(spec: ModelSpec) -> list[tuple[str, str]]:
    """(HF name, canonical name) of the tensors HF stores twice: DeepSeek-V3's MTP modules' copies of the
    embedding and head (`hf_names.MIRRORS`)."""
    present = param_index(spec)
    return [(hf.format(m=spec.num_layers + k), name) for hf, name in MIRRORS.get(hf_table(spec), [])
            for k in range(spec.mtp_layers) if name in present]


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
                if key in self.where:  # which copy is the model's would be a guess
                    raise InteropError(f"{root}: tensor {key!r} is in two weight files ({name} and another); "
                                       "refused")
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

    @property
    def unchecked(self) -> str | None:
        """safetensors has no checksum (a `.bin`'s zip records have their CRC-32s)."""
        return "HF safetensors files" if any(isinstance(h, SafetensorsFile) for h in self.where.values()) else None

    def read(self, key, expert: int | None = None) -> torch.Tensor:
        """The tensor, or its slice [expert:expert + 1] on the first axis (`reads_slices`: read alone)."""
        if expert is None:
            return self.where[key].read(key)
        shape = self.meta(key)[1]
        return self.where[key].read(key, Box((expert,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:])))

    def reads_slices(self, key) -> bool:
        """Whether a slice of `key` is read without the rest (safetensors: its rows' bytes; a .bin: the record)."""
        return isinstance(self.where[key], SafetensorsFile)

    def read_into(self, key, out: torch.Tensor) -> None:
        handle = self.where[key]
        if isinstance(handle, SafetensorsFile):
            handle.read(key, out=out)  # straight from the file, no mapping
        else:
            out.copy_(handle.read(key))


class _BinFile:
    """A `pytorch_model.bin` through the one torch.save reader (`LazyTorchFile`): no code runs, reads stay
    inside their zip record, DEFLATE records are decompressed and CRC-32s checked, as for every `.pt`."""

    def __init__(self, path: Path):
        self.file = LazyTorchFile(path)
        self.tensors = self.file.obj
        if not isinstance(self.tensors, dict):
            raise InteropError(f"{path}: expected a state dict, found {type(self.tensors).__name__}")
        others = [k for k, v in self.tensors.items() if not isinstance(v, torch.Tensor)]
        if others:
            raise InteropError(f"{path}: {others[0]!r} is not a tensor; a pytorch_model.bin holds tensors only")

    def keys(self):
        return list(self.tensors)

    def meta(self, key):
        t = self.tensors[key]
        return t.dtype, tuple(t.shape)

    def read(self, key):
        return self.file.read(self.tensors[key])


SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` scales block-scaled FP8 `X.weight`


def fp8_stored(hf_key: str, shape) -> bool:
    """Which tensors --dtype fp8 stores block-scaled: the projections, as DeepSeek-V3's release (`hf_names.FP8_KEEP`
    stay bf16: embeddings, heads, the router)."""
    return len(shape) == 2 and hf_key.endswith(".weight") and not any(k in hf_key for k in FP8_KEEP)
FP8_FORMATS = {"e4m3": "float8_e4m3fn"}


def fp8_layout(config: dict, where: str) -> BlockScaledFP8 | None:
    """The block-scaled FP8 layout config.json's quantization_config states (None: not quantised)."""
    quant = config.get("quantization_config")
    if quant is None or is_mxfp4(config):
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise InteropError(f"{where}: quantization_config quant_method {method!r} is not supported (fp8, block-scaled "
                           "as DeepSeek-V3 and transformers' fine-grained FP8, and mxfp4, as gpt-oss's release, are)")
    if quant.get("fmt", "e4m3") not in FP8_FORMATS:
        raise InteropError(f"{where}: fp8 fmt {quant['fmt']!r} is not supported (e4m3 is)")
    if quant.get("scale_fmt") not in (None, "float32"):
        raise InteropError(f"{where}: fp8 scale_fmt {quant['scale_fmt']!r} is not supported (float32 scales are)")
    try:
        return BlockScaledFP8(quant.get("weight_block_size", [128, 128]))  # FineGrainedFP8Config's default
    except InteropError as exc:
        raise InteropError(f"{where}: {exc}") from None


def is_mxfp4(config: dict) -> bool:
    """config.json states MXFP4 weights (gpt-oss's release: quantization_config quant_method mxfp4)."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


MXFP4_SUFFIXES = ("_blocks", "_scales")  # `X_blocks` + `X_scales` hold MXFP4 tensor `X`


class Reader(BaseReader):
    options = ("dequantize_to",)  # convert's --dtype, for block-scaled FP8 sources

    def __init__(self, path, dequantize_to: str | None = None):
        """`dequantize_to`: the dtype block-scaled FP8 weights are dequantised to (bfloat16 by default; convert's
        --dtype)."""
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
        self.mxfp4 = self._mxfp4_pairs(root, config, keys, notes, dequantize_to or "bfloat16")
        self.fp8 = self._fp8_scales(root, config, keys, notes, dequantize_to or "bfloat16")
        counts = Counter(self._meta(k)[0] for k in sorted(keys) if self._meta(k)[0].is_floating_point)
        dtype = NAME_OF_DTYPE.get(counts.most_common(1)[0][0], "float32") if counts else "float32"
        if self.fp8:
            dtype = self.fp8_dtype
        elif len(counts) > 1:  # e.g. an f16 embedding among f32 weights: kept as stored, said so
            held = ", ".join(f"{n} {NAME_OF_DTYPE.get(d, d)}" for d, n in counts.most_common())
            notes.append(f"weights in {len(counts)} dtypes ({held}): each kept as stored (--dtype casts them all)")
        spec = spec_from_hf_config(config, dtype, where=str(root / "config.json"))
        carried_config = {}
        if spec.mtp_layers and not any(k.startswith(f"model.layers.{spec.num_layers + j}.")
                                       for k in keys for j in range(spec.mtp_layers)):
            # transformers' DeepseekV3ForCausalLM has no MTP module: a checkpoint it saved states
            # num_nextn_predict_layers and holds no MTP weights.  Kept for HF output, said so.
            key = "num_nextn_predict_layers"
            carried_config[key] = spec.mtp_layers
            notes.append(f"config.json's {key}={spec.mtp_layers} but the checkpoint holds no MTP module weights "
                         f"(model.layers.{spec.num_layers}.*, as transformers saves it): read as a model without "
                         f"MTP; {key} kept for HF output")
            spec = spec.replace(mtp_layers=0)
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
            got = self._meta(hf_key)[1]
            if got != want:
                raise InteropError(f"{root}: {hf_key} has shape {list(got)}, config.json implies {list(want)}")
            keys.discard(hf_key)
            for i, p in enumerate(parts):
                self.part_of[p] = (hf_key, transform, parts, i)
        self.mirrors: dict[str, list[str]] = {}  # canonical -> HF copies checked equal to it on read
        for hf_key, name in hf_mirrors(spec):
            if hf_key not in keys:
                raise InteropError(f"{root}: tensor {hf_key} is missing (the MTP module's copy of {name})")
            if self.files.meta(hf_key)[1] != param_index(spec)[name].shape:
                raise InteropError(f"{root}: {hf_key} has shape {list(self.files.meta(hf_key)[1])}, "
                                   f"config.json implies {list(param_index(spec)[name].shape)}")
            keys.discard(hf_key)
            self.mirrors.setdefault(name, []).append(hf_key)
        if self.mirrors:
            notes.append(f"{sum(map(len, self.mirrors.values()))} MTP copies of the embedding / head "
                         f"({', '.join(sorted(k for v in self.mirrors.values() for k in v))}) checked equal to "
                         "the model's on read and written from them")
        if spec.tied_embeddings and "lm_head.weight" in keys:
            keys.discard("lm_head.weight")
            notes.append("dropped lm_head.weight: the model ties it to the input embedding")
        if keys:
            raise InteropError(f"{root}: {len(keys)} tensors do not belong to a {self.model_type} model, e.g. {sorted(keys)[0]}")
        self.spec = spec
        self.source = Source(spec, None, notes=notes, unchecked=self.files.unchecked)
        self.memory = BufferPool(keep=4)  # an expert's slice and parts (`read`): a few in use, few idle
        self._cached: dict = {}  # hf key (or (hf key, expert)) -> its canonical parts (that expert's)
        # carried to an HF target as they are (`Writer.carry`): tokenizer, generation config, special token ids
        files = {name: root / name for name in MODEL_FILES if (root / name).is_file()}
        escaping = sorted(name for name, path in files.items() if not within(root, path))
        if escaping:  # a symlink out of the checkpoint: never copy a file of this machine into the output
            notes.append(f"not carried: {', '.join(escaping)} (a symlink out of the checkpoint; give --tokenizer "
                         "to name a tokenizer)")
        self.carried = {"files": {name: path for name, path in files.items() if name not in escaping},
                        "config": {k: config[k] for k in TOKEN_ID_KEYS if config.get(k) is not None}}
        self.carried["config"].update(carried_config)
        if self.fp8:
            self.carried["raw_fp8"] = self.stored_fp8
        if spec.is_moe:  # router training settings: not part of the model, kept for HF output and named
            training = {k: config[k] for k, default in MOE_TRAINING_KEYS[hf_family(spec)].items()
                        if config.get(k, default) != default}
            self.carried["config"].update(training)
            if training:
                notes.append(f"{', '.join(f'{k}={v}' for k, v in training.items())}: router training settings "
                             "outside the model description, kept for HF output only")

    def _fp8_scales(self, root: Path, config: dict, keys: set, notes: list, dequantize_to: str) -> dict:
        """{fp8 weight key: its scale key}; the scales leave `keys`.  Every float8 weight has its scale of the
        right grid and every scale its float8 weight, or the checkpoint is refused (never read unscaled)."""
        layout = fp8_layout(config, str(root / "config.json"))
        fp8_keys = sorted(k for k in keys if self._meta(k)[0] == torch.float8_e4m3fn)
        scales = {k for k in keys if k.endswith(SCALE_SUFFIX)}
        if layout is None:
            if fp8_keys or scales:
                raise InteropError(f"{root}: {(fp8_keys or sorted(scales))[0]} is block-scaled FP8 but config.json has "
                                   "no quantization_config (quant_method fp8, weight_block_size)")
            return {}
        out = {}
        for key in fp8_keys:
            scale = key + SCALE_SUFFIX
            layout.check(key, self.files.meta(key)[1], scale, self.files.meta(scale)[1] if scale in scales else None)
            out[key] = scale
        stray = sorted(scales - set(out.values()))
        if stray:
            raise InteropError(f"{root}: {stray[0]} scales no float8_e4m3fn weight "
                               f"({stray[0][:-len(SCALE_SUFFIX)]} is missing or not FP8)")
        if dequantize_to not in DTYPE_OF_NAME:
            raise InteropError(f"dequantize_to must be one of {', '.join(DTYPE_OF_NAME)}, got {dequantize_to!r}")
        keys -= scales
        self.fp8_layout, self.fp8_dtype = layout, dequantize_to
        if out:
            notes.append(f"dequantised {len(out)} block-scaled FP8 weights (float8_e4m3fn x weight_scale_inv per "
                         f"{layout.block[0]}x{layout.block[1]} block, in float32) to {dequantize_to}, as transformers' "
                         "fine-grained FP8 and DeepSeek's weight_dequant do"
                         + ("" if dequantize_to == "float32" else "; --dtype fp32 keeps more of each product"))
        return out

    def _mxfp4_pairs(self, root: Path, config: dict, keys: set, notes: list, dequantize_to: str) -> dict:
        """{HF tensor: (its blocks key, its scales key)} of an MXFP4 checkpoint; `keys` then names the tensors, not
        their blocks and scales.  Blocks without their scales (or of another grid) are refused in one line."""
        blocks = sorted(k for k in keys if k.endswith("_blocks"))
        if not is_mxfp4(config):
            if blocks:
                raise InteropError(f"{root}: {blocks[0]} is MXFP4 but config.json has no quantization_config "
                                   "(quant_method mxfp4)")
            return {}
        if dequantize_to not in DTYPE_OF_NAME:
            raise InteropError(f"dequantize_to must be one of {', '.join(DTYPE_OF_NAME)}, got {dequantize_to!r}")
        out = {}
        for key in blocks:
            name, scales = key[:-len("_blocks")], key[:-len("_blocks")] + "_scales"
            if self.files.meta(key)[0] != torch.uint8:
                raise InteropError(f"{root}: {key} is {self.files.meta(key)[0]}, MXFP4 blocks are uint8")
            MXFP4.check(key, self.files.meta(key)[1], scales, self.files.meta(scales)[1] if scales in keys else None)
            out[name] = (key, scales)
            keys -= {key, scales}
            keys.add(name)
        self.mxfp4_dtype = dequantize_to
        if out:
            notes.append(f"dequantised {len(out)} MXFP4 expert tensors (FP4 E2M1 x 2^(scale - 127) per 32 values, "
                         f"exact) to {dequantize_to}, as transformers' Mxfp4 integration does; interop writes them "
                         "unquantised")
        return out

    def _meta(self, hf_key: str):
        """(dtype, shape) of an HF tensor as the model holds it: an MXFP4 one's dequantised."""
        if hf_key in self.mxfp4:
            return DTYPE_OF_NAME[self.mxfp4_dtype], MXFP4.shape(self.files.meta(self.mxfp4[hf_key][0])[1])
        return self.files.meta(hf_key)

    def stored_fp8(self, hf_key: str, layout: BlockScaledFP8):
        """(fp8 weight, scale) as stored, for an FP8 target in the same block layout; None otherwise."""
        if hf_key not in self.fp8 or layout != self.fp8_layout:
            return None
        return self.files.read(hf_key), self.files.read(self.fp8[hf_key])

    def _read_hf(self, hf_key: str, expert: int | None = None) -> torch.Tensor:
        """An HF tensor as the model uses it (a block-scaled FP8 or MXFP4 one dequantised), or its slice
        [expert:expert + 1] on the first axis (`_slices`)."""
        if hf_key in self.fp8:
            return self.fp8_layout.dequantize(self.files.read(hf_key), self.files.read(self.fp8[hf_key]),
                                              DTYPE_OF_NAME[self.fp8_dtype])
        if hf_key in self.mxfp4:
            blocks, scales = self.mxfp4[hf_key]
            return MXFP4.dequantize(self.files.read(blocks, expert), self.files.read(scales, expert),
                                    DTYPE_OF_NAME[self.mxfp4_dtype], empty=None if expert is None else self.memory.empty)
        return self.files.read(hf_key, expert)

    def _slices(self, hf_key: str) -> bool:
        """Whether `hf_key`'s expert slices can be read one at a time (stored in safetensors, not FP8)."""
        return hf_key not in self.fp8 and all(self.files.reads_slices(k) for k in self.mxfp4.get(hf_key, (hf_key,)))

    def metas(self) -> list[TensorMeta]:
        def dtype(hf_key):
            return DTYPE_OF_NAME[self.fp8_dtype] if hf_key in self.fp8 else self._meta(hf_key)[0]
        return [TensorMeta(p.name, dtype(self.part_of[p.name][0]), p.shape) for p in param_table(self.spec)]

    def read(self, name: str) -> torch.Tensor:
        hf_key, transform, parts, i = self.part_of[name]
        if name in self.mirrors:
            value = transform.split(self._read_hf(hf_key))[0]
            for copy in self.mirrors[name]:
                if not torch.equal(self._read_hf(copy), value):
                    raise InteropError(f"{self.files.root}: {copy} differs from {hf_key}: the MTP module has its own "
                                       f"{'embedding' if 'embed' in copy else 'head'}, which interop holds once "
                                       "(as DeepSeek-V3 and megatron-core share it); refused")
            return value
        if len(parts) == 1:  # a tensor of its own: nothing to keep for the next read
            return transform.split(self._read_hf(hf_key))[0]
        # four held: a layer's stacked experts are read expert by expert in canonical order, gate_up, down (with
        # their biases (gpt-oss) gate_up, gate_up_bias, down, down_bias), then the next expert's: each tensor (or
        # each expert's slice of it) read and dequantised once
        one = transform.expert_slice()
        if one is not None and self._slices(hf_key):  # one expert's slice at a time: memory of an expert, and
            expert, i = divmod(i, len(one.shapes))    # a reader that wants some experts reads only theirs
            key = (hf_key, expert)
            if key not in self._cached:  # in mappings of their own: tens of MB freed one after another would
                stored = self._read_hf(hf_key, expert)  # fragment the C heap (`memory.BufferPool`)
                self._hold(key, lambda: one.from_ranks([stored], [self.memory.empty(s, stored.dtype) for s in one.shapes]))
            return self._cached[key][i]
        if hf_key not in self._cached:  # q, k and v come from one fused tensor: read it once
            self._hold(hf_key, lambda: transform.split(self._read_hf(hf_key)))
        return self._cached[hf_key][i]

    def _hold(self, key, parts) -> None:
        """Keep `parts()` for the reads of the rest of its parts, dropping the oldest beyond four first."""
        while len(self._cached) >= 4:
            del self._cached[next(iter(self._cached))]
        self._cached[key] = parts()

    def native_name(self, name: str) -> str:
        """The HF tensor that holds canonical `name` (with its part when fused, e.g. GPT2's c_attn)."""
        hf_key, _, parts, i = self.part_of[name]
        return hf_key if len(parts) == 1 else f"{hf_key} [part {i + 1}/{len(parts)}]"

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` with `name` when HF stores it as it is (not fused, not transposed); else False."""
        hf_key, transform, _, _ = self.part_of[name]
        if not transform.unchanged or name in self.mirrors or hf_key in self.fp8 or hf_key in self.mxfp4:  # checked / decoded in read()
            return False
        self.files.read_into(hf_key, out)
        return True

    def close(self) -> None:
        self._cached.clear()


class Writer(BaseWriter):
    """Writes HF safetensors (sharded past `max_shard_bytes`) and config.json."""
    options = ("max_shard_size", "max_shard_bytes", "tokenizer", "renormalize_topk", "family",
               "quantize_to")  # quantize_to: convert's --dtype fp8
    splits = True
    holds_moe = True  # Mixtral and Qwen2-MoE (mappings.hf_config.MOE_KEYS)

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        return spec.vocab  # HF holds the true vocabulary only

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], max_shard_size=None,
                 max_shard_bytes: int | None = None, tokenizer=None, renormalize_topk: bool = False, only=None,
                 family: str | None = None, quantize_to: str | None = None):
        """`max_shard_size`: bytes per weight file ("5GB" style or an int; `max_shard_bytes` is the older name).
        `quantize_to="fp8"` (convert's --dtype fp8): the projections as block-scaled FP8 (128x128 blocks, as
        DeepSeek-V3's release); an FP8 HF source's weights and scales are kept byte-identical (`carry`).
        `tokenizer`: a tokenizer directory (its tokenizer files are copied), or one tokenizer file
        (`tokenizer.model` of sentencepiece, as Megatron's --tokenizer-model names, or a `tokenizer.json`).
        `renormalize_topk`: write a MoE model whose top-k probabilities are not renormalised (megatron-core's
        moe_router_pre_softmax, as mbridge builds Mixtral) as HF Mixtral anyway, whose router renormalises them."""
        if layout.tp != 1 or layout.pp != 1 or layout.ep != 1:
            raise InteropError("a Hugging Face checkpoint is not sharded: use --tp 1 --pp 1 --ep 1")
        max_shard_bytes = parse_size(max_shard_size if max_shard_size is not None else
                                     max_shard_bytes if max_shard_bytes is not None else DEFAULT_SHARD_BYTES)
        self.tokenizer = Path(tokenizer) if tokenizer else None
        if self.tokenizer is not None and self.tokenizer.exists() and not self.tokenizer.is_dir():  # /dev/zero, a FIFO
            require_small_file(self.tokenizer, "--tokenizer file", TOKENIZER_LIMIT)
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
        rows = hf_rows(spec, model_type=family)
        bound = {row.parts[0]: row.transform for row in rows if len(row.parts) == 1}
        rows += [Row(hf_key, bound[name], [name]) for hf_key, name in hf_mirrors(spec)]  # right after their source
        rows = sorted(rows, key=lambda row: max(position[p] for p in row.parts))
        if quantize_to not in (None, "fp8"):
            raise InteropError(f"quantize_to must be fp8, got {quantize_to!r}")
        self.fp8 = BlockScaledFP8() if quantize_to else None
        self.quantized = {row.key for row in rows
                          if self.fp8 and row.transform.unchanged and fp8_stored(row.key, row.transform.rank_shape())}
        self.fp8_counts = {"kept": 0, "quantised": 0}
        self.row_of, self.pending = {}, RowCollector()
        self.expert_slices: dict[str, dict] = {}  # stacked experts tensor -> {expert: its slice, not yet written}
        self.expert_written: dict[str, int] = {}  # stacked experts tensor -> experts written to its file
        self.dropped_optim = {key.kind for key in (TensorKey.parse(m.name) for m in metas) if key.is_optim}
        self.memory = BufferPool()  # reused memory for fused (c_attn) tensors
        shards, size = [[]], 0
        for row in rows:
            hf_key, transform, parts = row.key, row.transform, row.parts
            first = meta_of[parts[0]]
            shape = transform.rank_shape()
            if hf_key in self.quantized:  # the fp8 weight, then its scale
                entries = [(hf_key, torch.float8_e4m3fn, shape),
                           (hf_key + SCALE_SUFFIX, torch.float32, self.fp8.scale_shape(shape))]
            else:
                entries = [(hf_key, first.dtype, shape)]
            nbytes = sum(TensorMeta(*entry).nbytes for entry in entries)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1] += entries
            size += nbytes
            for p in parts:
                self.row_of.setdefault(p, []).append((hf_key, transform, parts))
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
        self.raw_fp8 = None  # an FP8 HF source's stored (weight, scale) by HF key (`carry`)

    def wants(self, name: str) -> bool:
        return not TensorKey.parse(name).is_optim and any(self.file_of[row[0]] in self.writers
                                                           for row in self.row_of[name])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if TensorKey.parse(name).is_optim:  # HF checkpoints hold weights only (a note says so)
            return
        for hf_key, transform, parts in self.row_of[name]:  # more than one: DeepSeek-V3's MTP copies
            if self.file_of[hf_key] not in self.writers:
                continue
            one = transform.expert_slice()
            if one is not None and hf_key not in self.quantized:
                self._write_expert(hf_key, one, parts, name, tensor)
                continue
            tensors = self.pending.add(hf_key, parts, name, tensor)
            if tensors is None:
                continue
            if hf_key in self.quantized:
                self._write_fp8(hf_key, tensors[0])
            else:
                self.writers[self.file_of[hf_key]].write(hf_key, _to_hf(transform, tensors, self.memory.empty))
            self._flush_experts(self.writers[self.file_of[hf_key]])  # slices queued behind this tensor

    def _write_expert(self, hf_key: str, one: Transform, parts: list[str], name: str, tensor: torch.Tensor) -> None:
        """A stacked experts tensor (gpt-oss's gate_up_proj, ...) written expert by expert: each expert's slice is
        built once its parts are in and goes to the file as soon as the file has taken what comes before it, so
        the whole stacked tensor is never held (only the slices of a tensor the file takes later: down_proj's
        while gate_up_proj's experts are still arriving)."""
        per = len(one.shapes)
        expert = parts.index(name) // per
        got = self.pending.add((hf_key, expert), parts[expert * per:(expert + 1) * per], name, tensor)
        if got is None:
            return
        self.expert_slices.setdefault(hf_key, {})[expert] = one.fuse(got, self.memory.empty(one.rank_shape(), got[0].dtype))
        self._flush_experts(self.writers[self.file_of[hf_key]])

    def _flush_experts(self, writer: SafetensorsWriter) -> None:
        """Write the expert slices the file can take now: the next experts of its next tensor, and on."""
        while writer.next_key() in self.expert_slices:
            key = writer.next_key()
            ready, at = self.expert_slices[key], self.expert_written.get(key, 0)
            if at not in ready:
                break
            writer.write_rows(key, ready.pop(at))
            self.expert_written[key] = at + 1
            if not ready and writer.next_key() != key:
                del self.expert_slices[key]

    def _write_fp8(self, hf_key: str, tensor: torch.Tensor) -> None:
        """The weight and its scale: the FP8 source's own bytes when it stores this weight so, else quantised."""
        raw = self.raw_fp8(hf_key, self.fp8) if self.raw_fp8 is not None else None
        q, scale = raw if raw is not None else self.fp8.quantize(tensor)
        self.fp8_counts["kept" if raw is not None else "quantised"] += 1
        writer = self.writers[self.file_of[hf_key]]
        writer.write(hf_key, q)
        writer.write(hf_key + SCALE_SUFFIX, scale)

    def write_ranges(self, name: str, ranges) -> bool:
        """Write `name` straight from byte ranges of the source's files when HF stores it unchanged
        (a single-tensor row, not transposed); False when it must come through `write`."""
        if TensorKey.parse(name).is_optim:
            return True  # not kept: no need to read it
        rows = self.row_of[name]
        if not all(transform.unchanged and hf_key not in self.quantized for hf_key, transform, _ in rows):
            return False
        for hf_key, _, _ in rows:
            if self.file_of[hf_key] in self.writers:
                self.writers[self.file_of[hf_key]].copy_ranges(hf_key, ranges)
                self._flush_experts(self.writers[self.file_of[hf_key]])
        return True

    def carry(self, carried) -> bool:
        """What an HF source holds besides weights (`Reader.carried`): files to copy, config.json token ids,
        and its block-scaled FP8 weights as stored (kept as they are under --dtype fp8)."""
        self.carried = carried
        self.raw_fp8 = carried.get("raw_fp8")
        return True

    def _model_files(self) -> dict:
        """{name in the output: file to copy} for the tokenizer and generation config."""
        files = dict(self.carried.get("files", {}))
        tok = self.tokenizer
        if tok is None:
            return files
        files = {k: v for k, v in files.items() if k not in TOKENIZER_FILES}  # --tokenizer replaces the source's
        if tok.is_dir():
            files.update({name: tok / name for name in MODEL_FILES if (tok / name).is_file()
                          and (name in TOKENIZER_FILES or name not in files)})  # its generation config too
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

    def _token_ids(self, files: dict) -> dict:
        """bos / eos / pad ids from what `--tokenizer` brings: its folder's generation_config.json or config.json,
        or a sentencepiece model's own ids (sentencepiece installed); {} without --tokenizer."""
        tok = self.tokenizer
        if tok is None:
            return {}
        for source in ([files.get("generation_config.json"), tok / "config.json"] if tok.is_dir() else []):
            if source is not None and Path(source).is_file():
                found = {k: v for k, v in read_json_object(Path(source), "HF config").items()
                         if k in TOKEN_ID_KEYS and isinstance(v, int)}
                if found:
                    return found
        model = files.get("tokenizer.model")
        if model is not None:
            try:
                import sentencepiece
            except ImportError:
                self.written_notes.append("no bos/eos ids in config.json: reading them from tokenizer.model needs "
                                          "sentencepiece (pip install sentencepiece)")
                return {}
            try:
                sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
            except (RuntimeError, OSError) as exc:  # not a sentencepiece model: one line, not a traceback
                raise InteropError(f"--tokenizer {model}: not a sentencepiece tokenizer.model ({exc})") from None
            ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
            return {k: v for k, v in ids.items() if v >= 0}
        return {}

    def finish_units(self, state: dict | None = None) -> dict:
        """Close this writer's shard files: {file: bytes}."""
        return {name: writer.close()[0] for name, writer in self.writers.items()}

    def finish_global(self, state: dict | None, results: dict) -> None:
        """config.json, the shard index, tokenizer and generation config: the files beside the weights
        (`results`: {shard file: bytes})."""
        total = sum(results[name] for name in self.units)
        files = self._model_files()
        for name, path in files.items():
            shutil.copyfile(path, self.root / name)
        self._write_tokenizer_config(files)
        if not ({"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"} & set(files)):
            self.written_notes.append("output has no tokenizer: pass --tokenizer DIR_OR_FILE (an HF tokenizer "
                                      "directory, or the tokenizer.model Megatron's --tokenizer-model names)")
        ids = {**self._token_ids(files), **self.carried.get("config", {})}
        if ids and "generation_config.json" not in files and self.tokenizer is not None:
            generation = {k: ids[k] for k in TOKEN_ID_KEYS if k in ids}
            (self.root / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        config = {**hf_config_from_spec(self.spec, model_type=self.family), **ids}
        if self.fp8:
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(self.fp8.block)}
        (self.root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if len(self.shard_files) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, entries in self.shard_files for key, _, _ in entries}}
            (self.root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    @property
    def notes(self) -> list[str]:
        notes = list(self.written_notes)
        if self.fp8 and self.writers:
            kept, made = self.fp8_counts["kept"], self.fp8_counts["quantised"]
            notes.append(f"block-scaled FP8 (float8_e4m3fn + weight_scale_inv per 128x128 block): {kept} weights and "
                         f"scales kept byte-identical from the FP8 source, {made} quantised (transformers' rule); "
                         "the other tensors keep their dtype")
        elif self.fp8:
            notes.append("block-scaled FP8 written by the workers: weights the source stores as FP8 are re-quantised "
                         "there, not kept byte-identical (--workers 1 keeps them)")
        if self.dropped_optim:
            notes.append(f"optimizer state not written ({', '.join(sorted(self.dropped_optim))}): "
                         "a Hugging Face checkpoint holds weights only")
        return notes

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
