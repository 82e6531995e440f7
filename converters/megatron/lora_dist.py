"""Megatron LoRA adapters in the `torch_dist` format, under Megatron-Bridge's PEFT names.

Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/peft/) wraps each adapted megatron-core linear
`M` in an `AdapterWrapper` whose `sharded_state_dict` adds the adapter's under `M.adapter.` (adapter_wrapper.py);
the adapter is a `ParallelLinearAdapter` (utils.py) of two megatron-core linears, `linear_in` (A, [r, in]) and
`linear_out` (B, [out, r]), scaled by alpha / dim.  Their tp cut (utils.py, `input_is_parallel` from
`get_adapter_attributes_from_linear`):
  column-parallel M (linear_qkv, linear_fc1): linear_in a ColumnParallelLinear(in, r) -> cut on r (axis 0),
      linear_out a ColumnParallelLinear(r, out) -> cut on out in M's fused row order; on linear_fc1 with a gated
      unit `apply_swiglu_sharded_factory` stores it [gate; up] globally, as the base weight;
  row-parallel M (linear_proj, linear_fc2): linear_in a RowParallelLinear(in, r) -> cut on in (axis 1),
      linear_out a ColumnParallelLinear(r, out) -> cut on out (axis 0).
Every tensor is thus cut (unlike peft's LoraParallelLinear, which MindSpeed-LLM uses: `lora.py`), but torch_dist
stores GLOBAL tensors, so what is written does not depend on tp: A [r, in] whole and B [out, r] in the weight's
global row order, layer-stacked like the weights (`decoder.layers.self_attention.linear_qkv.adapter.linear_in.
weight` [num_layers, r, h]).  Bridge saves adapter-only checkpoints by filtering the model section of its state
dict to `.adapter.` keys without `_extra_state` (training/checkpointing.py `apply_peft_adapter_filter_to_state_dict`,
`PEFT.adapter_key_filter` in peft/base.py), so no `_extra_state` objects are written.

Bridge keeps the LoRA settings (dim, alpha) in the iteration's `run_config.yaml`; interop states them in
common.pt's args as for the torch-format adapter (`lora_r`, `lora_alpha`, `lora_dropout`); the reader takes
them from the args, else from run_config.yaml's `peft` (dim, alpha, dropout); the base model from the args or
`--model-config` (Bridge's common.pt has no args; its run_config.yaml's `model` is not read).  Without
run_config.yaml Bridge's loader takes tp, pp and whether optimizer and rng state were saved from those args
(training/checkpointing.py `_extract_megatron_lm_args_from_state_dict`): `no_save_optim` and `no_save_rng` are
set, as neither is written.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...adapter import AdapterSpec, adapter_rows, target_of
from ...adapter_writer import AdapterWriter
from ...contract import BaseReader
from ...errors import InteropError
from ...io import megatron_dist as dist
from ...io.megatron_save import iteration_name, write_tracker
from ...layout import ParallelLayout
from ...mappings import megatron_args as M
from ...mappings.megatron_names import BRIDGE_LORA_NAMES, LORA_ARGS, MCORE
from ...mappings.megatron_spec import args_from_spec, layout_from_args, spec_from_args
from ...params import param_index
from ...rows import expand
from ...spec import ModelSpec
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from ...model_config import megatron_args_from_file
from .args import args_dict, check_args, check_model_config, explicit_args, padded_vocab
from .checkpoint import CHECKPOINT_VERSION, final_iteration
from .torch_dist import global_shape, stacked_key

WHAT = "Megatron-Bridge torch_dist"


def _rows(spec: ModelSpec, adapter: AdapterSpec) -> list:
    """The adapter's rows at tp 1, pp 1 (global tensors, global layer numbers)."""
    return adapter_rows(MCORE, BRIDGE_LORA_NAMES, spec, adapter, WHAT)


def holds_adapter(folder) -> bool:
    """Whether the torch_dist iteration folder holds a Megatron-Bridge LoRA adapter only."""
    try:
        keys = dist.DcpCheckpoint(folder).keys()
    except (InteropError, OSError):
        return False
    return bool(keys) and all(k.endswith((BRIDGE_LORA_NAMES.a, BRIDGE_LORA_NAMES.b)) for k in keys)


def _check(spec: ModelSpec, layout: ParallelLayout, adapter: AdapterSpec) -> None:
    if layout.ep > 1 or spec.is_moe:
        raise InteropError(f"{WHAT} LoRA adapters are written for dense models at tp, pp and vpp (no MoE, no --ep)")
    if adapter.layers is not None:
        raise InteropError(f"{WHAT} LoRA adapts its target modules in every layer (their tensors are layer-stacked): "
                           f"an adapter of layers {list(adapter.layers)} only has no such form")
    index = param_index(spec)  # the weights the adapter adapts, and how tp cuts them
    column = any(index[f"layers.0.{t}.weight"].split == "column" for t in adapter.targets)
    if column and adapter.rank % layout.tp:
        raise InteropError(f"{WHAT} LoRA cuts linear_in of a column-parallel module on its rank: rank "
                           f"{adapter.rank} is not a multiple of tp={layout.tp}")


RUN_CONFIG = "run_config.yaml"
BRIDGE_PEFT = {"rank": "dim", "alpha": "alpha", "dropout": "dropout"}  # peft/lora.py `LoRA` fields


def _run_config_lora(folder: Path) -> dict | None:
    """The LoRA settings Megatron-Bridge writes in the iteration's run_config.yaml: its ConfigContainer
    (training/config.py, field `peft`) dumped by `yaml.safe_dump` (utils/yaml_utils.py), `peft` holding the
    `LoRA` dataclass's dim, alpha, dropout.  None when there is no such file or section."""
    import yaml

    path = folder / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        peft = (yaml.safe_load(path.read_text()) or {}).get("peft")
    except (yaml.YAMLError, AttributeError) as exc:
        raise InteropError(f"{path}: not a Megatron-Bridge run config ({str(exc).splitlines()[0]})") from None
    if not isinstance(peft, dict):
        return None
    return {ours: peft.get(theirs) for ours, theirs in BRIDGE_PEFT.items()}


class Reader(BaseReader):
    """A Megatron-Bridge LoRA checkpoint (torch_dist, adapter only) as canonical `lora_a` / `lora_b` tensors."""

    options = ("iteration", "model_config", "vocab_size")

    def __init__(self, path, iteration: int | None = None, model_config=None, vocab_size: int | None = None):
        self.dir = dist.checkpoint_dir(path, iteration)
        self.ckpt = dist.DistCheckpoint(self.dir)
        common, notes, where = self.ckpt.common, [], self.dir / dist.COMMON_PT
        stored = args_dict(common.get("args"))
        check_args(stored, where)
        if model_config is not None:
            full = megatron_args_from_file(model_config)
            check_model_config(stored, full, model_config, where)
            notes.append(f"model description taken from {model_config}")
        elif stored and stored.get("num_layers"):
            full = M.complete(explicit_args(stored))
        else:
            raise InteropError(f"{where}: the checkpoint carries no model description (no args); pass --model-config")
        if vocab_size:
            full = dict(full, vocab_size=vocab_size)
        full = dict(full, padded_vocab_size=full.get("padded_vocab_size") or full.get("vocab_size"))
        lora = {ours: (stored or {}).get(theirs) for ours, theirs in LORA_ARGS.items()}
        if lora["rank"] is None and lora["alpha"] is None:
            lora = _run_config_lora(self.dir) or lora
        for key in ("rank", "alpha"):
            if lora[key] is None:
                raise InteropError(f"{where}: the args carry no {LORA_ARGS[key]} (the LoRA {key}), nor does a "
                                   f"{RUN_CONFIG} beside it (peft: {BRIDGE_PEFT[key]}): refused, never defaulted")
        keys = self.ckpt.keys()
        dtype = self.ckpt.meta(keys[0])[0]
        spec = spec_from_args(full, str(self.dir), NAME_OF_DTYPE.get(dtype, "float32"))
        layout = layout_from_args(full, spec.num_layers)
        weights = {stacked_key(row.key)[0]: row for row in expand(MCORE, spec)}
        found = set()
        for key in keys:
            module = BRIDGE_LORA_NAMES.weight_key(key)
            if module is None or module not in weights:
                raise InteropError(f"{self.dir}: {key} is not a LoRA tensor of a megatron-core linear weight of "
                                   "this model")
            found |= {target_of(n)[1] for n in weights[module].parts if target_of(n)}
        try:
            self.adapter = AdapterSpec(lora["rank"], lora["alpha"], tuple(sorted(found)), lora["dropout"] or 0.0)
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
        _check(spec, layout, self.adapter)
        self.rows = _rows(spec, self.adapter)
        self.part_of, expected = {}, {}
        for row in self.rows:
            key, layer = stacked_key(row.key)
            expected[key] = global_shape(spec, layer, row.transform.rank_shape())
            for i, n in enumerate(row.parts):
                self.part_of[n] = (row, key, layer, i)
        for key, shape in expected.items():
            if key not in self.ckpt:
                raise InteropError(f"{self.dir}: {key} is missing")
            if self.ckpt.meta(key)[1] != shape:
                raise InteropError(f"{self.dir}: {key} has shape {list(self.ckpt.meta(key)[1])}; the args' model "
                                   f"and {LORA_ARGS['rank']}={self.adapter.rank} need {list(shape)}")
        it = common.get("iteration")
        self.source = Source(spec, layout, {"iteration": it if isinstance(it, int) else None}, notes,
                             adapter=self.adapter)
        self._cached: tuple | None = None

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, self.ckpt.meta(self.part_of[p.name][1])[0], p.shape)
                for p in self.adapter.params(self.source.spec)]

    def read(self, name: str) -> torch.Tensor:
        row, key, layer, i = self.part_of[name]
        if self._cached is None or self._cached[0] != (key, layer):
            self._cached = ((key, layer), row.transform.split(self.ckpt.read(key, layer)))
        return self._cached[1][i]

    def native_name(self, name: str) -> str | None:
        row, key, layer, i = self.part_of[name]
        where = f"{key} [layer {layer}]"
        return where if len(row.parts) == 1 else f"{where} [part {i + 1}/{len(row.parts)}]"


class Writer(AdapterWriter):
    """A LoRA adapter as Megatron-Bridge saves one in torch_dist: `iter_*/` of DCP files, `.adapter.linear_in` /
    `.adapter.linear_out` keys only, common.pt with the args and the adapter's lora_* settings."""

    options = ("iteration",)
    padded_vocab = staticmethod(padded_vocab)

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta], adapter: AdapterSpec,
                 iteration: int | None = None):
        spec.check_tp(layout.tp)
        _check(spec, layout, adapter)
        self.root, self.spec, self.layout, self.adapter, self.iteration = Path(root), spec, layout, adapter, iteration
        self.use_rows(_rows(spec, adapter), metas, 'interop writes Megatron LoRA adapters without an optimizer')
        dtype_of = {m.name: m.dtype for m in metas}
        self.root.mkdir(parents=True, exist_ok=True)
        self.partial = self.root / ".partial"
        self.out = dist.DistWriter(self.partial)
        declared = set()
        for row in self.rows:
            key, layer = stacked_key(row.key)
            if key not in declared:
                declared.add(key)
                self.out.declare(key, dtype_of[row.parts[0]], global_shape(spec, layer, row.transform.rank_shape()))

    def place(self, row, parts) -> None:
        try:
            stored = row.transform.to_rank(parts, 0, 1)
        except InteropError as exc:
            raise InteropError(f"Megatron {row.key}: {exc} ({', '.join(row.parts)}): Megatron-Bridge's adapter holds "
                               "one linear_in for the fused module, so this adapter has no exact Megatron form; "
                               "--lora-stack-ranks writes it exactly at a higher rank, or merge it into the base "
                               "(interop convert BASE DST --adapter ADAPTER --merge --to megatron)") from None
        self.out.write(*stacked_key(row.key), stored)

    def finish_units(self, state: dict | None = None) -> dict:
        self.collector.check_done(f"{WHAT} LoRA adapter: ")
        return self.out.close_files()

    def finish_global(self, state: dict | None, results: dict) -> None:
        self.out.add_storage({i: info for i, info in results.items() if i not in self.out.storage})
        iteration = final_iteration(self.iteration, state or {})
        args = args_from_spec(self.spec, self.layout)
        modules = sorted({row.key.split(".")[-4] for row in self.rows})  # linear_qkv, linear_proj, ...
        args |= {LORA_ARGS["rank"]: self.adapter.rank, LORA_ARGS["alpha"]: self.adapter.alpha,
                 LORA_ARGS["dropout"]: self.adapter.dropout, "lora_target_modules": modules,
                 "ckpt_format": "torch_dist", "iteration": 0 if iteration == "release" else iteration,
                 # no optimizer, no rng state saved: Megatron-Bridge's loader, without run_config.yaml, takes
                 # save_optim / save_rng from these (checkpointing.py _extract_megatron_lm_args_from_state_dict)
                 "no_save_optim": True, "no_save_rng": True}
        args = argparse.Namespace(**args)
        self.out.finish({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": args.iteration})
        self.partial.rename(self.root / iteration_name(iteration))
        write_tracker(self.root, iteration)

    def abort(self) -> None:
        self.out.abort()
