"""MindFormers LoRA adapters (tp 1): the LoRA tensors of a MindFormers model in one `.ckpt`, as its LoRA model
names them, and the `pet_config` that states rank and alpha.

MindFormers 2.1.0's `LoraModel` (mindformers/pet/models/lora.py, `auto_prefix=False`: the base model's names
stay) replaces each matched `Linear` by mindpet 1.0.4's `LoRADense` (mindformers/pet/tuners/lora_adapter.py
`recursive_replace_dense_cell`), whose parameters are `mindpet_delta_lora_a` [lora_rank, in] and
`mindpet_delta_lora_b` [out, lora_rank] (mindpet/delta/lora.py; mindspore names a parameter by its attribute
path: `model.layers.0.attention.wq.mindpet_delta_lora_a`).  Rank, alpha, dropout and the target regex live in
the run's YAML (`model.model_config.pet_config`: pet_type lora, lora_rank, lora_alpha, lora_dropout,
target_modules, mindformers/pet/pet_config.py LoraConfig); scaling alpha / rank (mindpet LoRADense).

On disk (what interop writes and reads):

    adapter/
      model.ckpt             the LoRA tensors only (the MindFormers legacy Llama names, `--dialect mindformers`)
      pet_config.yaml        `model: model_config: pet_config: {...}` as a MindFormers YAML nests it
      mindspore_model.json   interop's description of the base model (`spec`), as beside its MindSpore models

A MindFormers run's own adapter is read with `--model-config RUN.yaml` (the base model and its pet_config).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from ...adapter import AdapterSpec, adapter_rows, optimizer_dropped_notes, sharing_notes, stated_shared_a, target_of
from ...contract import BaseReader, BaseWriter
from ...errors import InteropError
from ...io.ms_ckpt import CkptFile, save_ckpt
from ...io.small_files import read_json_object, require_small_file
from ...mappings.mindspore_names import LORA_DIALECTS, PET_CONFIG, TABLES
from ...model_config import spec_from_file
from ...params import TensorKey
from ...rows import expand
from ...spec import ModelSpec, padded_to_tp
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from .files import SIDECAR, SINGLE_FILE

FORMAT = "mindformers-lora"


def _names(dialect: str, spec: ModelSpec):
    """(name table, LoRA names) of a MindFormers dialect's LoRA model."""
    if dialect not in LORA_DIALECTS:
        raise InteropError(f"MindSpore LoRA adapters are MindFormers' ({', '.join(LORA_DIALECTS)}), not {dialect}'s")
    key, names = LORA_DIALECTS[dialect]
    if key[1] != spec.arch:
        raise InteropError(f"no MindFormers {dialect} name table for {spec.arch} LoRA adapters")
    return TABLES[key], names


def _dialect_of(keys) -> str | None:
    """The dialect whose LoRA names every key has (None: no such dialect)."""
    for dialect, (_, names) in LORA_DIALECTS.items():
        if keys and all(names.weight_key(k) is not None for k in keys):
            return dialect
    return None


def holds_adapter(path) -> bool:
    """A folder with MindFormers' pet_config beside a `.ckpt`: a LoRA adapter."""
    path = Path(path)
    return path.is_dir() and (path / PET_CONFIG).is_file() and (path / SINGLE_FILE).is_file()


def states_pet_config(model_config) -> bool:
    """Whether a --model-config is a MindFormers YAML with a pet_config (a run that trained an adapter): a look at
    its text, so that a plain model description costs nothing more."""
    if model_config is None or Path(model_config).suffix.lower() not in (".yaml", ".yml"):
        return False
    try:
        return "pet_config" in require_small_file(model_config, "model config").read_text(errors="replace")
    except (InteropError, OSError):
        return False


def names_adapter(path) -> bool:
    """A `.ckpt` (or a folder's model.ckpt) holding LoRA tensors only: a MindFormers run's adapter."""
    path = Path(path)
    path = path / SINGLE_FILE if path.is_dir() else path
    if not path.is_file() or path.suffix != ".ckpt":
        return False
    try:
        with CkptFile(path, verify=False) as f:
            keys = f.keys()
    except InteropError:
        return False
    return _dialect_of(keys) is not None


def _pet_config(path: Path) -> dict:
    """`model.model_config.pet_config` of a MindFormers YAML."""
    path = require_small_file(path, "MindFormers YAML")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InteropError(f"{path}: not YAML ({type(exc).__name__})") from None
    pet = None
    if isinstance(doc, dict):  # a run YAML nests it under model: (mindformers/models/build_model.py build_network
        #                        reads config.model_config.pet_config of the `model` section); a bare model_config too
        for section in (doc.get("model"), doc):
            config = section.get("model_config") if isinstance(section, dict) else None
            if isinstance(config, dict) and isinstance(config.get("pet_config"), dict):
                pet = config["pet_config"]
                break
    if not isinstance(pet, dict):
        raise InteropError(f"{path}: no model.model_config.pet_config (the LoRA rank and alpha)")
    if pet.get("pet_type") != "lora":
        raise InteropError(f"{path}: pet_type is {pet.get('pet_type')!r}; interop reads LoRA adapters")
    return pet


class Reader(BaseReader):
    """A MindFormers LoRA adapter (tp 1) as canonical `lora_a` / `lora_b` tensors."""

    options = ("model_config",)

    def __init__(self, path, model_config=None):
        root = Path(path)
        folder = root.parent if root.is_file() else root
        pet = _pet_config(Path(model_config) if model_config is not None else folder / PET_CONFIG)
        where = model_config or folder / PET_CONFIG
        for key, what in (("lora_rank", "rank"), ("lora_alpha", "alpha")):
            if pet.get(key) is None:
                raise InteropError(f"{where}: pet_config has no {key} (the LoRA {what}): refused, never defaulted")
        self.file = CkptFile(root if root.is_file() else root / SINGLE_FILE)
        root = folder
        keys = set(self.file.keys())
        dtype = self.file.meta(sorted(keys)[0])[0] if keys else torch.float32
        if model_config is not None:
            spec = spec_from_file(model_config, NAME_OF_DTYPE.get(dtype, "float32"))
        elif (folder / SIDECAR).is_file():
            spec = ModelSpec.from_dict(read_json_object(folder / SIDECAR, "MindSpore model description").get("spec") or {})
        else:
            raise InteropError(f"{root}: no description of the base model: pass --model-config (the run's YAML)")
        sidecar = read_json_object(folder / SIDECAR, "MindSpore model description") if (folder / SIDECAR).is_file() else {}
        dialect = sidecar.get("dialect") or _dialect_of(sorted(keys))
        if dialect is None:
            raise InteropError(f"{root / SINGLE_FILE}: its tensors are not LoRA tensors under one MindFormers dialect's "
                               "names")
        table, names = _names(dialect, spec)
        weights = {row.key: row for row in expand(table, spec)}
        found = set()
        for key in sorted(keys):
            module = names.weight_key(key)
            if module is None or module not in weights:
                raise InteropError(f"{root / SINGLE_FILE}: {key} is not a LoRA tensor of a MindFormers "
                                   f"{spec.arch} linear weight ({names.a} / {names.b})")
            found |= {target_of(n) for n in weights[module].parts}
        found.discard(None)
        if not found:
            raise InteropError(f"{root / SINGLE_FILE}: holds no LoRA tensor")
        layers = sorted({i for i, _ in found})
        try:
            self.adapter = AdapterSpec(pet["lora_rank"], pet["lora_alpha"], tuple(sorted({t for _, t in found})),
                                       pet.get("lora_dropout") or 0.0,
                                       None if layers == list(range(spec.num_layers)) else tuple(layers))
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
        self.rows = adapter_rows(table, names, spec, self.adapter, "MindFormers")
        self.adapter = replace(self.adapter, shared_a=stated_shared_a(self.rows, spec, self.adapter))
        self.part_of = {}
        for row in self.rows:
            got = self.file.meta(row.key)[1] if row.key in keys else None
            if got != row.transform.rank_shape():
                raise InteropError(f"{root / SINGLE_FILE}: {row.key} " + ("is missing" if got is None else
                                   f"has shape {list(got)}; the base model and lora_rank={self.adapter.rank} "
                                   f"need {list(row.transform.rank_shape())}"))
            for i, n in enumerate(row.parts):
                self.part_of[n] = (row, i)
        self.source = Source(spec, None, notes=[], adapter=self.adapter)

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, self.file.meta(self.part_of[p.name][0].key)[0], p.shape)
                for p in self.adapter.params(self.source.spec)]

    def read(self, name: str) -> torch.Tensor:
        row, i = self.part_of[name]
        return row.transform.split(self.file.read(row.key))[i]

    def native_name(self, name: str) -> str | None:
        return self.part_of[name][0].key

    def close(self) -> None:
        self.file.close()


class Writer(BaseWriter):
    """A LoRA adapter as MindFormers' LoRA model names it (tp 1; `dialect` mindformers or mindformers-mcore)."""

    options = ("dialect",)
    holds_adapter = True
    padded_vocab = staticmethod(padded_to_tp)

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], adapter: AdapterSpec,
                 dialect: str = "mindformers"):
        if layout.tp != 1 or layout.pp != 1 or layout.ep != 1:
            raise InteropError("MindFormers LoRA adapters are written at tp 1, pp 1 (one model.ckpt) for now")
        self.root, self.spec, self.adapter, self.dialect = Path(root), spec, adapter, dialect
        table, self.names = _names(dialect, spec)
        self.rows = adapter_rows(table, self.names, spec, adapter, "MindFormers")
        self.row_of = {n: row for row in self.rows for n in row.parts}
        self.got: dict[str, torch.Tensor] = {}
        self.notes = [] if adapter.layers is None else [
            f"MindFormers' pet_config adapts every layer its target_modules match: layers other than "
            f"{', '.join(map(str, adapter.layers))} have no LoRA tensors in model.ckpt (a run would start them new)"]
        self.notes += sharing_notes(self.rows, spec, adapter, "MindFormers")
        self.notes += optimizer_dropped_notes(metas, 'interop writes MindFormers LoRA adapters without an optimizer')

    def wants(self, name: str) -> bool:
        return not TensorKey.parse(name).is_optim

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if TensorKey.parse(name).is_optim:  # weights only (a note says so)
            return
        self.got[name] = tensor

    def finish_units(self, state: dict | None = None) -> dict:
        tensors = {row.key: row.transform.fuse([self.got[n] for n in row.parts]).contiguous() for row in self.rows}
        save_ckpt(self.root / SINGLE_FILE, tensors)
        return {}

    def finish_global(self, state: dict | None, results: dict) -> None:
        modules = sorted({self.names.weight_key(row.key)[:-len(".weight")].rsplit(".", 1)[-1] for row in self.rows})
        pet = {"pet_type": "lora", "lora_rank": self.adapter.rank, "lora_alpha": self.adapter.alpha,
               "lora_dropout": self.adapter.dropout,
               "target_modules": "|".join(f".*{re.escape(m)}" for m in modules)}
        (self.root / PET_CONFIG).write_text(yaml.safe_dump({"model": {"model_config": {"pet_config": pet}}}))
        (self.root / SIDECAR).write_text(json.dumps({"format": FORMAT, "dialect": self.dialect,
                                                     "spec": self.spec.to_dict()}, indent=1))
