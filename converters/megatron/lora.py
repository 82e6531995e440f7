"""Megatron LoRA adapters in the `torch` format, as MindSpeed-LLM saves them (`--lora-r`, `--lora-alpha`,
`--lora-target-modules`, `--lora-ckpt-filter`: the rank files' `model` holds the adapter only).

MindSpeed-LLM wraps megatron-core's parallel linears with peft's `LoraParallelLinear` (peft/tuners/lora/
tp_layer.py), so each adapted module `M` of a megatron-core state dict gains `M.lora_A.default.weight` and
`M.lora_B.default.weight`, cut over tensor parallelism exactly as the common format cuts them: a column-parallel
M (linear_qkv, linear_fc1) has A as an `nn.Linear` (whole on every rank) and B a ColumnParallelLinear (rows cut,
in M's fused row order: grouped q/k/v, [gate_t; up_t]); a row-parallel M (linear_proj, linear_fc2) has A a
RowParallelLinear (columns cut) and B an `nn.Linear`.  MindSpeed-LLM's own converter reads them so
(mindspeed_llm/tasks/checkpoint/convert_mg2hf.py `set_model_layer_mlp_lora`: fc1 A from tp rank 0, fc1 B
gathered and split into gate and up, fc2 A gathered over tp, fc2 B from tp rank 0; gate and up get the same A).

The rows are the megatron-core weight table's (`mappings/megatron_names.py` MCORE) through
`interop.adapter.adapter_table`; the base model's description is the args (with `lora_r`, `lora_alpha`,
`lora_dropout`, `lora_target_modules`, MindSpeed-LLM's spellings).
"""
from __future__ import annotations

import argparse
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch

from ...adapter import AdapterSpec, adapter_rows, sharing_notes, stated_shared_a, target_of
from ...adapter_writer import AdapterWriter
from ...contract import BaseReader
from ...errors import InteropError
from ...io.megatron_save import iteration_name, write_tracker
from ...io.torch_file import LazyTorchFile
from ...layout import ParallelLayout
from ...mappings.megatron_names import LORA_ARGS, LORA_NAMES, MCORE
from ...mappings.megatron_spec import args_from_spec, layout_from_args, spec_from_args
from ...rows import expand
from ...spec import ModelSpec
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from .args import args_dict, check_args, padded_vocab
from .checkpoint import CHECKPOINT_VERSION, RANK_FILE, final_iteration, iteration_dir, rank_dir_name
from .model_spec import model_args
from .rank_files import RankFiles


def _stage_rows(spec: ModelSpec, adapter: AdapterSpec, layout: ParallelLayout) -> list:
    rows = []
    for p, chunks in enumerate(layout.stages):
        for v, (start, stop) in enumerate(chunks):  # layers numbered from each virtual chunk's first
            rows += adapter_rows(MCORE, LORA_NAMES, spec, adapter, "Megatron", layers=range(start, stop),
                                 first=start, stage=p, chunk=v)
    held = {n for row in rows for n in row.parts}
    for name in adapter.index(spec):
        if name not in held:
            raise InteropError(f"Megatron has no place for LoRA tensor {name}: megatron-core fuses that weight with "
                               "others (q, k, v in linear_qkv; gate, up in linear_fc1), and the adapter must adapt "
                               "all of its parts (--lora-stack-ranks gives the others a zero adapter)")
    return rows


def _check_layout(layout: ParallelLayout) -> None:
    if layout.ep > 1:
        raise InteropError("Megatron LoRA adapters are written at tp, pp and vpp only (no --ep)")


def _chunk_key(v: int, vpp: int) -> str:
    """The rank file's key of virtual chunk v: `model`, or `model0..N-1` with virtual pipeline chunks."""
    return "model" if vpp == 1 else f"model{v}"


def holds_adapter(path, iteration: int | None = None) -> bool:
    """Whether the torch-format checkpoint at `path` is a LoRA adapter (its first rank file's model holds only
    `lora_A` / `lora_B` tensors)."""
    try:
        folder, _ = iteration_dir(Path(path), iteration)
        first = next(iter(sorted(folder.glob(f"mp_rank_*/{RANK_FILE}"))), None)
        obj = LazyTorchFile(first).obj if first is not None else None
        model = obj.get("model", obj.get("model0")) if isinstance(obj, dict) else None
    except (InteropError, OSError, AttributeError):
        return False
    keys = [k for k in model if not k.endswith("_extra_state")] if isinstance(model, dict) else []
    return bool(keys) and all(k.endswith((LORA_NAMES.a, LORA_NAMES.b)) for k in keys)


class Reader(BaseReader):
    """A MindSpeed-LLM LoRA checkpoint (torch format, adapter only) as canonical `lora_a` / `lora_b` tensors."""

    options = ("iteration", "model_config", "vocab_size")

    def __init__(self, path, iteration: int | None = None, model_config=None, vocab_size: int | None = None):
        self.root = Path(path)
        self.dir, it = iteration_dir(self.root, iteration)
        ranks = RankFiles(self.dir)
        self.ranks, self.tp = ranks, ranks.tp
        where = ranks.files[(0, 0)].path
        first = ranks.files[(0, 0)].obj
        stored = args_dict(first.get("args"))
        check_args(stored, where)
        notes: list[str] = []
        full = model_args(stored, model_config, ranks, notes)
        if vocab_size:
            full = dict(full, vocab_size=vocab_size)
        lora = {}
        for ours, theirs in LORA_ARGS.items():
            lora[ours] = (stored or {}).get(theirs)
        for key, what in (("rank", "rank"), ("alpha", "alpha")):
            if lora[key] is None:
                raise InteropError(f"{where}: the args carry no {LORA_ARGS[key]} (the LoRA {what}): refused, never "
                                   "defaulted")
        vpp = int(full.get("virtual_pipeline_model_parallel_size") or 1)
        models = {(t, p, v): f.obj.get(_chunk_key(v, vpp)) for (t, p), f in ranks.files.items() for v in range(vpp)}
        for (t, p, v), model in models.items():
            if not isinstance(model, dict):
                raise InteropError(f"{ranks.files[(t, p)].path}: no {_chunk_key(v, vpp)} state dict")
        dtype = next(x.dtype for x in models[(0, 0, 0)].values() if isinstance(x, torch.Tensor))
        full = dict(full, padded_vocab_size=full.get("padded_vocab_size") or full.get("vocab_size"))
        spec = spec_from_args(full, str(where), NAME_OF_DTYPE.get(dtype, "float32"))
        layout = layout_from_args(full, spec.num_layers)
        if (layout.tp, layout.pp) != (ranks.tp, ranks.pp):
            raise InteropError(f"{self.dir}: the args say tp={layout.tp} pp={layout.pp}, the rank folders "
                               f"tp={ranks.tp} pp={ranks.pp}")
        _check_layout(layout)
        found = set()
        for p, chunks in enumerate(layout.stages):
            for v, (start, stop) in enumerate(chunks):
                weights = {row.key: row for row in expand(MCORE, spec, layers=range(start, stop), first=start)}
                for key in models[(0, p, v)]:
                    if key.endswith("_extra_state"):
                        continue
                    module = LORA_NAMES.weight_key(key)
                    if module is None or module not in weights:
                        raise InteropError(f"{ranks.files[(0, p)].path}: {key} is not a LoRA tensor of a "
                                           "megatron-core linear weight of this model")
                    found |= {target_of(n) for n in weights[module].parts}
        found.discard(None)
        if not found:
            raise InteropError(f"{self.dir}: the rank files hold no LoRA tensor")
        layers = sorted({i for i, _ in found})
        try:
            self.adapter = AdapterSpec(lora["rank"], lora["alpha"], tuple(sorted({t for _, t in found})),
                                       lora["dropout"] or 0.0,
                                       None if layers == list(range(spec.num_layers)) else tuple(layers))
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
        self.rows = _stage_rows(spec, self.adapter, layout)
        self.adapter = replace(self.adapter, shared_a=stated_shared_a(self.rows, spec, self.adapter))
        self.part_of = {}
        for row in self.rows:
            for t in range(self.tp):
                model, path = models[(t, row.stage, row.chunk)], ranks.files[(t, row.stage)].path
                if row.key not in model:
                    raise InteropError(f"{path}: {row.key} is missing")
                got, want = tuple(model[row.key].shape), row.transform.rank_shape(t, self.tp)
                if got != want:
                    raise InteropError(f"{path}: {row.key} has shape {list(got)}; the args' model and "
                                       f"{LORA_ARGS['rank']}={self.adapter.rank} need {list(want)} at tp={self.tp}")
            for i, n in enumerate(row.parts):
                self.part_of[n] = (row, i)
        extra = {(p, v, k) for (t, p, v), model in models.items() for k in model if t == 0
                 and not k.endswith("_extra_state")} - {(row.stage, row.chunk, row.key) for row in self.rows}
        if extra:
            raise InteropError(f"{self.dir}: {sorted(extra)[0][2]} is not a tensor of this adapter")
        self.models = models
        self.source = Source(spec, layout, {"iteration": first.get("iteration") if isinstance(
            first.get("iteration"), int) else it}, notes, adapter=self.adapter)
        self._cached: tuple | None = None

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, self._stored(0, self.part_of[p.name][0]).dtype, p.shape)
                for p in self.adapter.params(self.source.spec)]

    def _stored(self, t: int, row):
        """Rank t's stored tensor of `row` (a meta tensor, read on demand)."""
        return self.models[(t, row.stage, row.chunk)][row.key]

    def read(self, name: str) -> torch.Tensor:
        row, i = self.part_of[name]
        if self._cached is None or self._cached[0] is not row:
            shards = [self.ranks.files[(t, row.stage)].read(self._stored(t, row)) for t in range(self.tp)]
            self._cached = (row, row.transform.from_ranks(shards))
        return self._cached[1][i]

    def native_name(self, name: str) -> str | None:
        return self.part_of[name][0].key


class Writer(AdapterWriter):
    """A LoRA adapter as MindSpeed-LLM's rank files hold it (adapter only, args with its lora_* settings)."""

    options = ("iteration",)
    padded_vocab = staticmethod(padded_vocab)

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta], adapter: AdapterSpec,
                 iteration: int | None = None):
        _check_layout(layout)
        spec.check_tp(layout.tp)
        self.root, self.spec, self.layout, self.adapter, self.iteration = Path(root), spec, layout, adapter, iteration
        rows = _stage_rows(spec, adapter, layout)
        self.models = {(t, p, v): OrderedDict() for t, p in layout.ranks() for v in range(layout.vpp)}
        self.notes = sharing_notes(rows, spec, adapter, "Megatron (megatron-core's fused linears)")
        self.use_rows(rows, metas, 'interop writes Megatron LoRA adapters without an optimizer')

    def place(self, row, parts) -> None:
        for t in range(self.layout.tp):
            try:
                self.models[(t, row.stage, row.chunk)][row.key] = row.transform.to_rank(parts, t, self.layout.tp).clone()
            except InteropError as exc:
                raise InteropError(f"Megatron {row.key}: {exc} ({', '.join(row.parts)}): megatron-core's fused "
                                   "linear holds one LoRA A for them all, so this adapter has no exact Megatron form; "
                                   "--lora-stack-ranks writes it exactly at a higher rank, or merge it into the base "
                                   "(interop convert BASE DST --adapter ADAPTER --merge --to megatron)") from None

    def finish_units(self, state: dict | None = None) -> dict:
        self.collector.check_done("Megatron LoRA adapter: ")
        iteration = final_iteration(self.iteration, state or {})
        args = args_from_spec(self.spec, self.layout)
        modules = sorted({row.key.split(".")[-4] for row in self.rows})  # linear_qkv, linear_proj, ...
        args |= {LORA_ARGS["rank"]: self.adapter.rank, LORA_ARGS["alpha"]: self.adapter.alpha,
                 LORA_ARGS["dropout"]: self.adapter.dropout, "lora_target_modules": modules,
                 "iteration": 0 if iteration == "release" else iteration}
        folder = self.root / iteration_name(iteration)
        vpp = self.layout.vpp
        for t, p in self.layout.ranks():
            path = folder / rank_dir_name(t, p, self.layout.pp) / RANK_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"args": argparse.Namespace(**args), "checkpoint_version": CHECKPOINT_VERSION,
                        "iteration": args["iteration"],
                        **{_chunk_key(v, vpp): self.models[(t, p, v)] for v in range(vpp)}}, path)
        self._iteration = iteration
        return {}

    def finish_global(self, state: dict | None, results: dict) -> None:
        write_tracker(self.root, self._iteration)
