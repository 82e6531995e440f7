"""Hugging Face PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, as peft's
`PeftModel.save_pretrained` writes them (peft 0.21: keys `base_model.model.<HF module>.lora_A.weight` /
`.lora_B.weight`, the adapter name `default` left out; `r`, `lora_alpha`, `target_modules` in the config).

An adapter only: the base model is another checkpoint (`--base`), whose ModelSpec names and shapes the
adapter's tensors.  The HF module names are the HF weight table's (`mappings/hf_names.py`), each weight row
giving an A and a B row (`interop.adapter.adapter_table`: GPT2's fused, transposed `c_attn` has one A and a
[q; k; v] B, as peft's Conv1D LoRA with fan_in_fan_out).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..adapter import AdapterSpec, adapter_rows, sharing_notes, stated_shared_a, target_of
from ..adapter_writer import AdapterWriter
from ..contract import BaseReader
from ..errors import InteropError
from ..hf_named import hf_rows, hf_table
from ..io.safetensors import SafetensorsFile, SafetensorsWriter
from ..io.small_files import read_json_object
from ..mappings.hf_names import TABLES
from ..mappings.peft_names import CONFIG, LORA_NAMES, REFUSED, WEIGHTS, config_of
from ..spec import ModelSpec
from ..tensors import Source, TensorMeta
from ..transforms import Transpose


def detect(path) -> bool:
    return (Path(path) / CONFIG).is_file()


def _table(base: ModelSpec) -> list:
    return TABLES[hf_table(base)]


def shares_a(base: ModelSpec, adapter: AdapterSpec) -> bool | None:
    """Whether PEFT's LoRA on transformers' model of `base` holds `adapter`'s fused groups as one A (GPT2's
    c_attn: True; Llama's q_proj, k_proj, v_proj: False), as `stated_shared_a` says."""
    return stated_shared_a(adapter_rows(_table(base), LORA_NAMES, base, adapter, "PEFT"), base, adapter)


class Reader(BaseReader):
    """A PEFT LoRA adapter as canonical `lora_a` / `lora_b` tensors of base model `base`."""

    reads_adapter = True

    def __init__(self, path, base: ModelSpec | None = None):
        root = Path(path)
        if not detect(root):
            raise InteropError(f"{root}: not a PEFT adapter (no {CONFIG})")
        if base is None:
            raise InteropError(f"{root}: a PEFT adapter needs its base model: give --base BASE")
        config = read_json_object(root / CONFIG, "PEFT adapter config")
        where = str(root / CONFIG)
        if config.get("peft_type") != "LORA":
            raise InteropError(f"{where}: peft_type is {config.get('peft_type')!r}; interop reads LoRA adapters")
        for key, why in REFUSED.items():
            if config.get(key) not in (None, False, {}, [], "none"):
                raise InteropError(f"{where}: {key}={config[key]!r}: {why}")
        for key, what in (("r", "rank"), ("lora_alpha", "alpha")):
            if config.get(key) is None:
                raise InteropError(f"{where}: no {key} (the LoRA {what}): refused, never defaulted")
        if not (root / WEIGHTS).is_file():
            raise InteropError(f"{root}: {WEIGHTS} is missing")
        self.file = SafetensorsFile(root / WEIGHTS)
        keys = set(self.file.keys())
        modules = {}
        for key in sorted(keys):
            module = LORA_NAMES.weight_key(key)
            if module is None:
                raise InteropError(f"{root / WEIGHTS}: {key} is not a LoRA A or B under peft's names "
                                   f"({LORA_NAMES.prefix}<module>{LORA_NAMES.a})")
            modules[module] = key
        weights = {row.key: row for row in hf_rows(base)}
        found = set()
        for module, key in modules.items():
            if module not in weights or not module.endswith(".weight"):
                raise InteropError(f"{root / WEIGHTS}: {key} adapts {module[:-len('.weight')]}, which is not a "
                                   f"weight of the base model ({hf_table(base)}, {base.num_layers} layers)")
            targets = {target_of(p) for p in weights[module].parts}
            if None in targets:
                raise InteropError(f"{root / WEIGHTS}: {key} adapts {module[:-len('.weight')]}, outside the decoder "
                                   "layers: LoRA on embeddings or the output head is not held by interop's adapters")
            found |= targets
        found.discard(None)
        if not found:
            raise InteropError(f"{root / WEIGHTS}: holds no LoRA tensor of a decoder layer")
        targets = {t for _, t in found}
        layers = sorted({i for i, _ in found})
        try:
            self.adapter = AdapterSpec(config["r"], config["lora_alpha"], tuple(targets), config.get("lora_dropout") or 0.0,
                                       None if layers == list(range(base.num_layers)) else tuple(layers),
                                       config.get("base_model_name_or_path"))
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
        self.adapter.check_base(base, f"{root}: ")
        self.rows = adapter_rows(_table(base), LORA_NAMES, base, self.adapter, "PEFT")
        self.adapter = replace(self.adapter, shared_a=stated_shared_a(self.rows, base, self.adapter))
        self.part_of = {}
        for row in self.rows:
            if row.key not in keys:
                raise InteropError(f"{root / WEIGHTS}: {row.key} is missing (the adapter adapts "
                                   f"{', '.join(sorted(targets))} in layers {layers[0]}-{layers[-1]})")
            got, want = self.file.meta(row.key)[1], row.transform.rank_shape()
            if got != want:
                raise InteropError(f"{root / WEIGHTS}: {row.key} has shape {list(got)}; the base model and r="
                                   f"{self.adapter.rank} need {list(want)}")
            keys.discard(row.key)
            for i, p in enumerate(row.parts):
                self.part_of[p] = (row, i)
        if keys:
            raise InteropError(f"{root / WEIGHTS}: {sorted(keys)[0]} is not in a layer this adapter adapts")
        self.source = Source(base, None, notes=[], adapter=self.adapter)
        self._cached: tuple[str, list] | None = None

    @classmethod
    def named_base(cls, path) -> str | None:
        """The base model the adapter names (`base_model_name_or_path`), when that is a folder here."""
        config = read_json_object(Path(path) / CONFIG, "PEFT adapter config")
        named = config.get("base_model_name_or_path")
        return named if isinstance(named, str) and Path(named).is_dir() else None

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, self.file.meta(self.part_of[p.name][0].key)[0], p.shape)
                for p in self.adapter.params(self.source.spec)]

    def read(self, name: str) -> torch.Tensor:
        row, i = self.part_of[name]
        if self._cached is None or self._cached[0] != row.key:
            self._cached = (row.key, row.transform.split(self.file.read(row.key)))
        return self._cached[1][i]

    def native_name(self, name: str) -> str | None:
        return self.part_of[name][0].key

    def close(self) -> None:
        self.file.close()


_SAVE_ORDER = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}

class Writer(AdapterWriter):
    """A LoRA adapter as PEFT saves it, loadable by `peft.PeftModel.from_pretrained(base_model, DST)`."""

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        return spec.vocab  # an adapter holds no vocabulary rows

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], adapter: AdapterSpec | None = None):
        if adapter is None:
            raise InteropError("a peft target holds a LoRA adapter, and this source is a model: convert it --to hf")
        if layout.tp != 1 or layout.pp != 1 or layout.ep != 1:
            raise InteropError("a PEFT adapter is not sharded: use --tp 1 --pp 1 --ep 1")
        self.root, self.spec, self.adapter = Path(root), spec, adapter
        rows = adapter_rows(_table(spec), LORA_NAMES, spec, adapter, "PEFT")
        self.dtypes = {m.name: m.dtype for m in metas}
        self.fan_in_fan_out = any(isinstance(row.transform, Transpose) for row in hf_rows(spec)
                                  if any(adapter.adapts(p) for p in row.parts))  # GPT2's Conv1D
        self.stored: dict[str, torch.Tensor] = {}
        self.notes = sharing_notes(rows, spec, adapter, "PEFT")
        self.use_rows(rows, metas, 'a PEFT adapter holds weights only')

    def place(self, row, parts) -> None:
        try:
            self.stored[row.key] = row.transform.fuse(parts).contiguous()
        except InteropError as exc:
            raise InteropError(f"PEFT {row.key}: {exc}") from None

    def finish_units(self, state: dict | None = None) -> dict:
        self.collector.check_done("PEFT adapter: ")
        # in the order peft's save_pretrained (safetensors 0.8 `save_file`) writes them: wider dtype first (F64,
        # F32, BF16, F16), then by name; so an adapter read from peft is written back byte for byte
        keys = sorted(self.stored, key=lambda k: (_SAVE_ORDER.get(self.stored[k].dtype, len(_SAVE_ORDER)), k))
        entries = [(k, self.stored[k].dtype, tuple(self.stored[k].shape)) for k in keys]
        writer = SafetensorsWriter(self.root / WEIGHTS, entries, {"format": "pt"})
        for k in keys:
            writer.write(k, self.stored[k])
        nbytes, crc = writer.close()
        return {WEIGHTS: {"bytes": nbytes, "crc32": crc}}

    def finish_global(self, state: dict | None, results: dict) -> None:
        modules = sorted({LORA_NAMES.weight_key(row.key)[:-len(".weight")].rsplit(".", 1)[-1] for row in self.rows})
        config = config_of(self.adapter, modules, self.fan_in_fan_out)
        (self.root / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
