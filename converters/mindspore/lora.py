"""MindFormers LoRA adapters: the LoRA tensors of a MindFormers model in `.ckpt` files, as its LoRA model
names them, and the `pet_config` that states rank and alpha.

MindFormers 2.1.0's `LoraModel` (mindformers/pet/models/lora.py, `auto_prefix=False`: the base model's names
stay) replaces each matched `Linear` by mindpet 1.0.4's `LoRADense` (mindformers/pet/tuners/lora_adapter.py
`recursive_replace_dense_cell`), whose parameters are `mindpet_delta_lora_a` [lora_rank, in] and
`mindpet_delta_lora_b` [out, lora_rank] (mindpet/delta/lora.py; mindspore names a parameter by its attribute
path: `model.layers.0.attention.wq.mindpet_delta_lora_a`).  Rank, alpha, dropout and the target regex live in
the run's YAML (`model.model_config.pet_config`: pet_type lora, lora_rank, lora_alpha, lora_dropout,
target_modules, mindformers/pet/pet_config.py LoraConfig); scaling alpha / rank (mindpet LoRADense).

Tensor parallelism cuts A and B as `interop.adapter.SPLITS` says, like the weight they adapt, which is what both
MindFormers LoRA layers do:
  - legacy (mindformers/pet/tuners/lora_adapter.py lines 121-145): the Linear's matmul strategy
    ((dp, mp_in), (mp_out, mp_in)) gives lora_a_matmul (.., (1, mp_in)) and lora_b_matmul (.., (mp_out, 1)):
    wq / wk / wv / w1 / w3 (column, mp_out = mp) keep A whole and cut B's rows; wo / w2 (row, mp_in = mp) cut
    A's columns and keep B whole;
  - mcore-style (parallel_core/training_graph/tensor_parallel/lora_layers.py): ColumnParallelLinearWithLoRA's
    lora_A is a LinearNoTP, its lora_B a ColumnParallelLinear (rows cut); RowParallelLinearWithLoRA's lora_A a
    RowParallelLinear (columns cut), its lora_B a LinearNoTP.  B of linear_qkv / linear_fc1 is cut in
    contiguous rows of its fused layout, as the fused weight is (whole KV groups; interleaved gate/up pairs).

On disk (what interop writes and reads), as MindFormers' weights are (`files.mindformers_file`):

    adapter/
      model.ckpt             tp 1, pp 1: the LoRA tensors only (MindFormers legacy Llama names, `--dialect mindformers`)
      rank_{r}/checkpoint_{r}.ckpt    else: tp rank t of stage p (r = p * tp + t), its stage's layers' slices, and
      strategy/strategy_stage{p}.json their split for `mindspore.transform_checkpoints`
      pet_config.yaml        `model: model_config: pet_config: {...}` as a MindFormers YAML nests it
      mindspore_model.json   interop's description of the base model (`spec`), as beside its MindSpore models

A MindFormers run's own adapter is read with `--model-config RUN.yaml` (the base model and its pet_config); tp
comes from the tensors' shapes, a file's stage from its layers, and a stage's rank folders past its first tp are
data-parallel copies (not read).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from ...adapter import AdapterSpec, adapter_rows, sharing_notes, stated_shared_a, target_of
from ...adapter_writer import AdapterWriter
from ...contract import BaseReader
from ...errors import InteropError
from ...io.ms_ckpt import CkptFile, save_ckpt
from ...io.small_files import read_json_object, require_small_file
from ...layout import ParallelLayout
from ...mappings.mindspore_names import LORA_DIALECTS, PET_CONFIG, TABLES
from ...model_config import spec_from_file
from ...rows import expand
from ...spec import ModelSpec, padded_to_tp
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from .files import SIDECAR, SINGLE_FILE, mindformers_file, rank_folders
from .strategy import stage_strategy

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


def _ckpt_files(path: Path) -> tuple[dict[int, Path], list[str]]:
    """{tp-or-dp rank: its .ckpt} of an adapter: a `.ckpt` file, a folder's model.ckpt (rank 0), or its
    `rank_N/` folders (MindFormers' per-rank files); and notes."""
    if path.is_file():
        return {0: path}, []
    if (path / SINGLE_FILE).is_file():
        return {0: path / SINGLE_FILE}, []
    return rank_folders(path)


def _has_rank_files(path: Path) -> bool:
    return any(path.glob("rank_*/*.ckpt"))


def holds_adapter(path) -> bool:
    """A folder with MindFormers' pet_config beside a `.ckpt` (or rank folders of them): a LoRA adapter."""
    path = Path(path)
    return path.is_dir() and (path / PET_CONFIG).is_file() and ((path / SINGLE_FILE).is_file()
                                                                 or _has_rank_files(path))


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
    if not (path.is_file() or (path.is_dir() and ((path / SINGLE_FILE).is_file() or _has_rank_files(path)))):
        return False
    try:
        path = _ckpt_files(path)[0][0]
        if path.suffix != ".ckpt":
            return False
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
    """A MindFormers LoRA adapter (one `.ckpt`, or tp ranks' files) as canonical `lora_a` / `lora_b` tensors."""

    options = ("model_config",)

    def __init__(self, path, model_config=None):
        root = Path(path)
        folder = root.parent if root.is_file() else root
        pet = _pet_config(Path(model_config) if model_config is not None else folder / PET_CONFIG)
        where = model_config or folder / PET_CONFIG
        for key, what in (("lora_rank", "rank"), ("lora_alpha", "alpha")):
            if pet.get(key) is None:
                raise InteropError(f"{where}: pet_config has no {key} (the LoRA {what}): refused, never defaulted")
        paths, notes = _ckpt_files(root)
        self.files: dict[int, CkptFile] = {}
        try:
            for r, p in sorted(paths.items()):
                self.files[r] = CkptFile(p)
            self._describe(folder, pet, where, model_config, notes)
        except BaseException:
            self.close()
            raise

    def _describe(self, folder: Path, pet: dict, where, model_config, notes: list[str]) -> None:
        first = self.files[0]
        keys = set().union(*(f.keys() for f in self.files.values()))
        dtype = first.meta(sorted(keys)[0])[0] if keys else torch.float32
        if model_config is not None:
            spec = spec_from_file(model_config, NAME_OF_DTYPE.get(dtype, "float32"))
        elif (folder / SIDECAR).is_file():
            spec = ModelSpec.from_dict(read_json_object(folder / SIDECAR, "MindSpore model description").get("spec") or {})
        else:
            raise InteropError(f"{folder}: no description of the base model: pass --model-config (the run's YAML)")
        sidecar = read_json_object(folder / SIDECAR, "MindSpore model description") if (folder / SIDECAR).is_file() else {}
        dialect = sidecar.get("dialect") or _dialect_of(sorted(keys))
        if dialect is None:
            raise InteropError(f"{first.path}: its tensors are not LoRA tensors under one MindFormers dialect's names")
        table, names = _names(dialect, spec)
        weights = {row.key: row for row in expand(table, spec)}
        found = set()
        for key in sorted(keys):
            module = names.weight_key(key)
            if module is None or module not in weights:
                raise InteropError(f"{first.path}: {key} is not a LoRA tensor of a MindFormers "
                                   f"{spec.arch} linear weight ({names.a} / {names.b})")
            found |= {target_of(n) for n in weights[module].parts}
        found.discard(None)
        if not found:
            raise InteropError(f"{first.path}: holds no LoRA tensor")
        layers = sorted({i for i, _ in found})
        try:
            self.adapter = AdapterSpec(pet["lora_rank"], pet["lora_alpha"], tuple(sorted({t for _, t in found})),
                                       pet.get("lora_dropout") or 0.0,
                                       None if layers == list(range(spec.num_layers)) else tuple(layers))
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
        self.rows = adapter_rows(table, names, spec, self.adapter, "MindFormers")
        self.adapter = replace(self.adapter, shared_a=stated_shared_a(self.rows, spec, self.adapter))
        self.tp = self._tp_from_shapes(first)
        spec.check_tp(self.tp)
        index = self.adapter.index(spec)
        self.layer_of = {row.key: index[row.parts[0]].layer for row in self.rows}
        self.layout = self._place(spec, notes)
        self.stage_of = {row.key: self.layout.stage_of_layer(self.layer_of[row.key]) for row in self.rows}
        for (t, p), f in self.files.items():
            held, mine = set(f.keys()), [row for row in self.rows if self.stage_of[row.key] == p]
            for row in mine:
                got = f.meta(row.key)[1] if row.key in held else None
                want = row.transform.rank_shape(t, self.tp)
                if got != want:
                    raise InteropError(f"{f.path}: {row.key} " + ("is missing" if got is None else
                                       f"has shape {list(got)}; the base model and lora_rank={self.adapter.rank} "
                                       f"need {list(want)}" + (f" at tp={self.tp}" if self.tp > 1 else "")))
                stage_first = self.files[(0, p)]
                if f.meta(row.key)[0] != stage_first.meta(row.key)[0]:  # never cast a rank's bytes to another's type
                    raise InteropError(f"{f.path}: {row.key} is {f.meta(row.key)[0]}, tp rank 0's "
                                       f"{stage_first.meta(row.key)[0]}: one tensor type expected")
            extra = sorted(held - {row.key for row in mine})
            if extra:
                raise InteropError(f"{f.path}: {extra[0]} is not in tp rank 0's file of its stage")
        self.part_of = {n: (row, i) for row in self.rows for i, n in enumerate(row.parts)}
        self._cached = (None, None)
        self.source = Source(spec, self.layout, notes=notes, adapter=self.adapter)

    def _place(self, spec: ModelSpec, notes: list[str]) -> ParallelLayout:
        """{global rank: file} -> {(tp rank, stage): file} and the layout.  A file's stage is the layers its
        LoRA tensors belong to; within a stage, MindFormers numbers rank p * dp * tp + d * tp + t, so a
        stage's first tp files are its tp ranks and the rest data-parallel copies (closed unread).  Stage p
        is taken to run from its first adapted layer to the next stage's (layers without LoRA tensors have no
        stage on disk)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, f in sorted(self.files.items()):
            layers = tuple(sorted({self.layer_of[k] for k in f.keys() if k in self.layer_of}))
            if not layers:
                raise InteropError(f"{f.path}: holds no LoRA tensor")
            groups.setdefault(layers, []).append(r)
        stages = sorted(groups)
        for a, b in zip(stages, stages[1:]):
            if a[-1] >= b[0]:
                raise InteropError(f"{Path(self.files[groups[b][0]].path).parent.parent}: rank files hold LoRA "
                                   f"tensors of layers {list(a)} and {list(b)}: not one pipeline stage each")
        placed = {}
        for p, layers in enumerate(stages):
            ranks = groups[layers]
            where = Path(self.files[ranks[0]].path).parent.parent
            for t in range(self.tp):
                if t >= len(ranks) or ranks[t] - ranks[0] != t:
                    raise InteropError(f"{where}: the LoRA tensors' shapes say tp={self.tp}; rank_{ranks[0] + t} "
                                       f"(tp rank {t} of stage {p}) is missing")
                placed[(t, p)] = self.files[ranks[t]]
            if len(ranks) % self.tp:
                raise InteropError(f"{where}: stage {p} has {len(ranks)} rank files, no multiple of tp={self.tp}")
        copies = [f for r, f in self.files.items() if all(f is not g for g in placed.values())]
        for f in copies:
            f.close()
        self.files = placed
        if copies:
            notes.append(f"read data-parallel rank 0's files; {len(copies)} data-parallel copies were not read")
        bounds = [0] + [layers[0] for layers in stages[1:]] + [spec.num_layers]
        return ParallelLayout(self.tp, len(stages), tuple(((a, b),) for a, b in zip(bounds, bounds[1:])))

    def _tp_from_shapes(self, first: CkptFile) -> int:
        """tp, from rank 0's slice of the first tensor TP cuts (B of a column-parallel weight, A of a row one)."""
        keys = set(first.keys())
        for row in self.rows:
            axis = row.transform.native_axis
            if axis is None or row.key not in keys:
                continue
            full, local = row.transform.rank_shape(), first.meta(row.key)[1]
            if len(local) != len(full) or not local[axis] or full[axis] % local[axis]:
                raise InteropError(f"{first.path}: {row.key} has shape {list(local)}, which no tp splits from "
                                   f"{list(full)} (the base model and lora_rank={self.adapter.rank})")
            return full[axis] // local[axis]
        return 1

    def metas(self) -> list[TensorMeta]:
        out = []
        for p in self.adapter.params(self.source.spec):
            row = self.part_of[p.name][0]
            out.append(TensorMeta(p.name, self._file(0, row).meta(row.key)[0], p.shape))
        return out

    def read(self, name: str) -> torch.Tensor:
        row, i = self.part_of[name]
        if self._cached[0] is not row:  # q, k and v (gate, up) come from one stored tensor: read it once
            ranks = [0] if row.transform.replicated else range(self.tp)
            self._cached = (None, None)
            self._cached = (row, row.transform.from_ranks([self._file(t, row).read(row.key) for t in ranks]))
        return self._cached[1][i]

    def _file(self, t: int, row) -> CkptFile:
        return self.files[(t, self.stage_of[row.key])]

    def native_name(self, name: str) -> str | None:
        return self.part_of[name][0].key

    def close(self) -> None:
        for f in self.files.values():
            f.close()


class Writer(AdapterWriter):
    """A LoRA adapter as MindFormers' LoRA model names it (`dialect` mindformers or mindformers-mcore): one
    model.ckpt at tp 1, else a file per tp rank and the strategy file, as MindFormers' weights are written."""

    options = ("dialect",)
    padded_vocab = staticmethod(padded_to_tp)

    def __init__(self, root, spec: ModelSpec, layout, metas: list[TensorMeta], adapter: AdapterSpec,
                 dialect: str = "mindformers"):
        if layout.vpp != 1 or layout.ep != 1:
            raise InteropError(f"MindFormers LoRA adapters are written without virtual pipeline chunks or expert "
                               f"parallelism (--vpp 1 --ep 1), not vpp={layout.vpp} ep={layout.ep}")
        spec.check_tp(layout.tp)
        self.root, self.spec, self.layout, self.adapter, self.dialect = Path(root), spec, layout, adapter, dialect
        table, self.names = _names(dialect, spec)
        rows = adapter_rows(table, self.names, spec, adapter, "MindFormers")
        self.index = adapter.index(spec)
        held = {layout.stage_of(self.index[row.parts[0]]) for row in rows}
        for p in range(layout.pp):
            if p not in held:  # its files would hold nothing, and no reader could tell their stage
                raise InteropError(f"MindFormers LoRA adapter at --pp {layout.pp}: stage {p} (layers "
                                   f"{layout.layers_of_stage(p)[0]}-{layout.layers_of_stage(p)[-1]}) holds none of "
                                   f"the adapted layers {', '.join(map(str, adapter.layers or ()))}")
        self.slices = {rank: {} for rank in layout.ranks()}  # {(tp rank, stage): {key: its slice}}
        self.notes = [] if adapter.layers is None else [
            f"MindFormers' pet_config adapts every layer its target_modules match: layers other than "
            f"{', '.join(map(str, adapter.layers))} have no LoRA tensors in model.ckpt (a run would start them new)"]
        self.notes += sharing_notes(rows, spec, adapter, "MindFormers")
        self.use_rows(rows, metas, 'interop writes MindFormers LoRA adapters without an optimizer')

    def place(self, row, parts) -> None:
        p = self.layout.stage_of(self.index[row.parts[0]])
        for t in range(self.layout.tp):
            self.slices[(t, p)][row.key] = row.transform.to_rank(parts, t, self.layout.tp).contiguous()

    def finish_units(self, state: dict | None = None) -> dict:
        self.collector.check_done("MindFormers LoRA adapter: ")
        tp, pp = self.layout.tp, self.layout.pp
        for t, p in self.layout.ranks():
            path = mindformers_file(self.root, t, p, tp, pp)
            path.parent.mkdir(parents=True, exist_ok=True)
            held = self.slices.pop((t, p))
            save_ckpt(path, {row.key: held[row.key] for row in self.rows if row.key in held})  # in table order
        if tp * pp > 1:  # where each rank's slices sit, for mindspore.transform_checkpoints (as beside the weights)
            (self.root / "strategy").mkdir()
            for p in range(pp):
                strategy = stage_strategy(self.spec, self.layout, self.rows, p, self.index)
                (self.root / "strategy" / f"strategy_stage{p}.json").write_text(json.dumps(strategy, indent=1))
        return {}

    def finish_global(self, state: dict | None, results: dict) -> None:
        modules = sorted({self.names.weight_key(row.key)[:-len(".weight")].rsplit(".", 1)[-1] for row in self.rows})
        pet = {"pet_type": "lora", "lora_rank": self.adapter.rank, "lora_alpha": self.adapter.alpha,
               "lora_dropout": self.adapter.dropout,
               "target_modules": "|".join(f".*{re.escape(m)}" for m in modules)}
        (self.root / PET_CONFIG).write_text(yaml.safe_dump({"model": {"model_config": {"pet_config": pet}}}))
        (self.root / SIDECAR).write_text(json.dumps({"format": FORMAT, "dialect": self.dialect,
                                                     "spec": self.spec.to_dict(), "layout": self.layout.to_dict()},
                                                    indent=1))
