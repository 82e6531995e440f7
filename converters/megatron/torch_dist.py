"""Megatron-LM `torch_dist` checkpoints <-> canonical tensors (part of the `megatron` format).

On disk: `save/latest_checkpointed_iteration.txt` and `save/iter_0000001/` holding a
PyTorch DCP checkpoint plus `common.pt` (args, iteration) and `metadata.json`; file I/O is
`interop.io.megatron_dist`.  A torch_dist checkpoint stores GLOBAL tensors, so it is the
tp=1, pp=1 case of the `torch` format under megatron-core's sharded keys, which are the
Transformer-Engine names (`linear_qkv.layer_norm_weight`) whatever layer spec trained the
model, with the homogeneous layers stacked on a leading axis
(`decoder.layers.self_attention.linear_qkv.weight` is `[num_layers, rows, h]`).  The name
table and the Megatron args <-> ModelSpec rules are the `torch` converter's
(`rows.py`, `args.py` beside this file, `mappings/megatron_names.py`); only the stacking is added here.

Adam state of the non-distributed optimizer is stored by megatron-core as tensors of the same
layout under `optimizer.state.<kind>.<weight key>` (`optimizer.py` has the common.pt side): it
becomes `optim.<kind>.<canonical name>` through the same unfusing as the weights, and back.
The distributed optimizer's layouts are read too: `fully_sharded_model_space` (the same keys, each
tensor flattened per fragment), `fully_reshardable` (the same keys, the master under `param`; also
written, for a source that used the distributed optimizer) and `dp_reshardable` (flat buckets per
tp x pp rank and model chunk, at any tp/pp/vpp/dp, mapped to parameters by `distrib.py` in the local or the
Transformer Engine layer spec's module order, and checked against the chunk boundaries stored with them).

Reading goes one layer slice at a time; writing appends each finished Megatron tensor (one layer of a
stacked key) to the DCP file as it comes (`megatron_dist.DistWriter`), so memory stays at one tensor.
"""
from __future__ import annotations

import argparse
import math
import re
from collections import OrderedDict
from pathlib import Path

import torch

from ...contract import BaseReader, BaseWriter
from ...errors import InteropError
from ...io import megatron_dist as dist
from ...io.safe_pickle import to_plain
from ...layout import ParallelLayout
from ...mappings import megatron_args as M
from ...mappings.megatron_names import DIST_EXPERT_KEYS, EXTRA_STATE_MODULES, scheme_of
from ...params import TensorKey, base_param_name, param_index, param_table
from ...rows import RowCollector
from ...spec import ModelSpec, vocab_from_rows
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from ...model_config import megatron_args_from_file
from ...mappings.megatron_spec import (args_from_spec, args_losses, layout_from_args, refuse_unstated,
                                        spec_from_args)
from .args import args_dict, check_args, check_model_config, base_args, explicit_args, padded_vocab, vocab_divisor
from ...io.megatron_save import iteration_name, write_tracker
from .checkpoint import CHECKPOINT_VERSION, final_iteration
from . import distrib
from .optimizer import KINDS, dist_common, dist_common_distributed, dist_hyper, distrib_hyper
from .training import from_megatron, optimizer_hyper, to_megatron
from .rows import expand_rows

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_EXPERT_TEMPLATE = "decoder.layers.{{i}}.mlp.experts.local_experts.{{j}}.{fc}.{kind}"
# an MTP module's routed experts: stacked on the global expert axis alone (its layer has no layer offsets:
# MultiTokenPredictionBlock.sharded_state_dict passes none; confirmed on a real 0.16.1 model)
_MTP_EXPERT = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])"
                         r"\.(weight|bias)$")
# the distributed optimizer's `dp_reshardable` buckets (megatron-core 0.14+): one flat tensor per bucket and kind
# (keyed by the tp x pp rank, `dp_group_idx_<pp rank * tp + tp rank>`, and the model chunk's buffer, `gbuf_idx`)
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+)\)\.bucket_idx_(\d+)\."
                     r"(param|exp_avg|exp_avg_sq)$")


def stacked_key(key: str, homogeneous: bool = True) -> tuple[str, int | tuple | None]:
    """Where a global Megatron tensor is stored: (DCP key, leading index).

    `decoder.layers.3.mlp.linear_fc2.weight` -> (`decoder.layers.mlp.linear_fc2.weight`, 3); a routed expert's
    `decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight` (expert numbers global at ep 1) ->
    (`decoder.layers.mlp.experts.experts.linear_fc1.weight`, (3, 5)): megatron-core stacks experts on a
    second axis over ALL experts, whatever the expert parallelism (docs/megatron-layouts.md s.3.3).
    A model that mixes dense and MoE layers (`homogeneous` False) is not layer-stacked: megatron-core keeps the
    global layer number in every key (transformer_block.py sharded_state_dict, `non_homogeneous_layers` when
    moe_layer_freq is a list or > 1), and the experts are stacked alone: (`decoder.layers.3.mlp.experts.experts.
    linear_fc1.weight`, (5,))."""
    m = _MTP_EXPERT.match(key)
    if m:
        return f"{m.group(1)}.experts.{m.group(3)}.{m.group(4)}", (int(m.group(2)),)
    m = _EXPERT.match(key)
    if m:
        stacked = DIST_EXPERT_KEYS[_EXPERT_TEMPLATE.format(fc=m.group(3), kind=m.group(4))]
        layer, expert = int(m.group(1)), int(m.group(2))
        if homogeneous:
            return stacked, (layer, expert)
        return stacked.replace("decoder.layers.", f"decoder.layers.{layer}.", 1), (expert,)
    m = _LAYER.match(key)
    if m is None or not homogeneous:
        return key, None
    return f"decoder.layers.{key[m.end():]}", int(m.group(1))


def homogeneous(spec: ModelSpec) -> bool:
    """Whether megatron-core stacks this model's layers in torch_dist: not when some layers are MoE and others
    dense (moe_layer_freq a list, which is how interop writes `moe_layers`)."""
    return not (spec.is_moe and spec.moe_layers is not None)


def dist_scheme(spec: ModelSpec, te: bool = False) -> str:
    """The names interop writes in torch_dist: the sharded keys every megatron-core layer spec shares (the
    Transformer Engine names, which the local spec maps its norms to), except for multi-latent attention, whose
    local spec keeps its own names (no sharded_state_dict_keys_map: gpt_layer_specs.py get_gpt_layer_local_spec):
    those unless `te` (--transformer-impl transformer_engine)."""
    return "mcore" if spec.is_mla and not te else "mcore_te"


def global_shape(spec: ModelSpec, at, shape) -> tuple:
    """The stored global shape of a Megatron tensor of `shape` held at leading index `at` (`stacked_key`)."""
    if at is None:
        return tuple(shape)
    if isinstance(at, tuple):
        return ((spec.num_layers,) if len(at) == 2 else ()) + (spec.num_experts, *shape)
    return (spec.num_layers, *shape)


def optim_key(kind: str, key: str) -> str:
    """megatron-core's key for optimizer state `kind` of weight `key` (same global layout as the weight)."""
    return f"optimizer.state.{kind}.{key}"


def _prefix(name: str) -> str:
    """`optim.exp_avg.layers.0...` -> `optimizer.state.exp_avg.`; a weight's name -> ``."""
    key = TensorKey.parse(name)
    return f"optimizer.state.{key.kind}." if key.is_optim else ""


def detect(path) -> bool:
    try:
        dist.checkpoint_dir(path)
    except InteropError:
        return False
    return True


def _file_of(key: str, layer: int | tuple | None) -> int:
    """The `.distcp` file of a chunk: one per decoder layer (1 + layer; a routed expert's (layer, expert) goes
    with its layer), and file 0 for the rest (and for a model of mixed dense and MoE layers, whose keys are
    not layer-stacked: `stacked_key`)."""
    if isinstance(layer, tuple):
        layer = layer[0] if len(layer) == 2 else None
    return 0 if layer is None else 1 + layer


def _rows(spec: ModelSpec, scheme: str, moe_norm_apart: bool = False):
    """The name table at tp=1, pp=1, ep=1 (global tensors, global layer and expert numbers)."""
    return expand_rows(scheme, spec, ParallelLayout.build(spec.num_layers), moe_norm_apart=moe_norm_apart)


class Reader(BaseReader):
    """A Megatron checkpoint in the `torch_dist` format (PyTorch DCP, through `interop.io.megatron_dist`)."""

    options = ("iteration", "model_config", "vocab_size")

    def __init__(self, path, iteration: int | None = None, model_config=None, vocab_size: int | None = None):
        self.dir = dist.checkpoint_dir(path, iteration)
        self.ckpt = dist.DistCheckpoint(self.dir)
        common, notes = self.ckpt.common, []
        stored = args_dict(common.get("args"))
        check_args(stored, self.dir / dist.COMMON_PT)
        if model_config is not None:
            full = megatron_args_from_file(model_config)
            check_model_config(stored, full, model_config, self.dir / dist.COMMON_PT)
            notes.append(f"model description taken from {model_config}")
        elif stored and stored.get("num_layers"):
            full = M.complete(explicit_args(stored))
        else:
            raise InteropError(f"{self.dir / dist.COMMON_PT}: the checkpoint carries no model description (no args); "
                               "pass --model-config (a HF config.json, a Megatron args file or a MindSpeed YAML)")
        keys = self.ckpt.keys()
        model_keys = [k for k in keys if not k.startswith("optimizer.")]
        flat = [k.replace("decoder.layers.", "decoder.layers.0.", 1) if dist.is_stacked(k) else k for k in model_keys]
        scheme = scheme_of(flat)
        if scheme not in ("mcore", "mcore_te"):
            raise InteropError(f"{self.dir}: not megatron-core parameter names (e.g. {keys[0] if keys else 'no tensors'})")
        emb = "embedding.word_embeddings.weight"
        if emb not in self.ckpt:
            raise InteropError(f"{self.dir}: {emb} is missing")
        dtype, (rows, _) = self.ckpt.meta(emb)
        # the padded size the checkpoint's own args state (a --model-config or --vocab-size gives the true one)
        stated = None if model_config is not None or vocab_size else (stored or {}).get("padded_vocab_size")
        vocab, rows, vocab_notes = vocab_from_rows(rows, vocab_size or full.get("vocab_size"), stated,
                                                   f"{self.dir}: {emb}")
        notes += vocab_notes
        full = dict(full, padded_vocab_size=rows, vocab_size=vocab)
        if full.get("untie_embeddings_and_output_weights") is None:
            full["untie_embeddings_and_output_weights"] = False
        self.spec = spec = spec_from_args(full, str(self.dir), NAME_OF_DTYPE.get(dtype, "float32"))
        self.index = param_index(spec)
        self.row_of, expected = {}, {}
        # the TE spec keeps a MoE layer's pre-MLP norm apart; the local spec's sharded keys fuse its name
        moe_norm_apart = any(k.endswith(".pre_mlp_layernorm.weight") for k in model_keys)
        self.homogeneous = not any(_LAYER.match(k) for k in model_keys)
        for row in _rows(spec, scheme, moe_norm_apart):
            key, layer = stacked_key(row.key, self.homogeneous)
            shape = row.transform.rank_shape()
            expected[key] = global_shape(spec, layer, shape)
            for j, name in enumerate(row.parts):
                self.row_of[name] = (row, key, layer, j)
        for key, shape in expected.items():
            if key not in self.ckpt:
                raise InteropError(f"{self.dir}: tensor {key} is missing")
            if self.ckpt.meta(key)[1] != shape:
                raise InteropError(f"{self.dir}: {key} has shape {list(self.ckpt.meta(key)[1])}, args imply {list(shape)}")
        unknown = sorted(set(model_keys) - set(expected))
        if unknown:
            raise InteropError(f"{self.dir}: tensor {unknown[0]} does not belong to this {spec.arch} model "
                               "(args describe a different model?)")
        self.stored_args = stored or {}
        hyper = self._optimizer([k for k in keys if k.startswith("optimizer.")], expected, common, notes)
        if self.ckpt.objects():
            notes.append(f"ignored {len(self.ckpt.objects())} byte objects (_extra_state slots, rng state): not weights")
        it = common.get("iteration")
        scheduler = to_plain(common.get("opt_param_scheduler"))
        state = {"iteration": it if isinstance(it, int) else None,
                 **from_megatron(stored or {}, scheduler, (hyper or {}).get("step")),
                 "megatron": {"checkpoint_version": to_plain(common.get("checkpoint_version")), "scheme": scheme,
                              "args": {k: to_plain(v) for k, v in (stored or {}).items()},
                              "opt_param_scheduler": scheduler, "optimizer": hyper,
                              "num_floating_point_operations_so_far": to_plain(
                                  common.get("num_floating_point_operations_so_far"))}}
        # torch_dist holds global tensors (readable at any layout); the layout shown is the one it was saved at
        self.source = Source(spec, layout_from_args(full, spec.num_layers), state, notes)
        self._cache: OrderedDict = OrderedDict()

    def _optimizer(self, optim: list[str], expected: dict, common: dict, notes: list[str]) -> dict | None:
        """Which Adam state kinds map onto the weights (`self.kinds`), and the hyperparameters."""
        self.kinds: list[str] = []
        self.buckets = None  # the distributed optimizer's: {(bucket, megatron kind): key}
        if not optim:
            return None
        if all(_BUCKET.match(k) for k in optim):
            why = self._distributed(optim)
            if isinstance(why, str):
                notes.append(f"optimizer state not converted (distributed optimizer, {len(optim)} bucket tensors: "
                             f"{why}); weights converted")
                return None
            notes.append(f"converted the optimizer state ({', '.join(self.kinds)}) from the distributed optimizer's "
                         f"buckets (dp_reshardable, saved at {self.dist_at}), "
                         f"step {why['step']}")
            return why
        # megatron-core 0.16's distributed optimizer (`fully_reshardable`) keeps the fp32 master under `param`
        self.native = {"fp32_param": "param"} if any(k.startswith(optim_key("param", "")) for k in optim) else {}
        kinds = [k for k in KINDS if any(key.startswith(optim_key(self.native.get(k, k), "")) for key in optim)]
        mapped = {optim_key(self.native.get(k, k), key): shape for k in kinds for key, shape in expected.items()}
        other = sorted(set(optim) - set(mapped))
        self.fragments = {key: _fragments(self.ckpt.meta(key)[1], shape, dist.is_stacked(key))
                          for key, shape in mapped.items() if key in self.ckpt and self.ckpt.meta(key)[1] != shape}
        why = (f"{other[0]} is not per-parameter Adam state (distributed optimizer?)" if other else
               next((f"no {key}" for key in mapped if key not in self.ckpt), None) or
               next((f"{key} has shape {list(self.ckpt.meta(key)[1])}, its weight {list(mapped[key])}"
                     for key, fragments in self.fragments.items() if fragments is None), None))
        if why:
            notes.append(f"optimizer state not converted ({len(optim)} optimizer.* tensors: {why}); weights converted")
            return None
        self.kinds = kinds
        saved = common.get("optimizer")
        # the distributed optimizer's per-parameter layouts keep the step inside the param groups
        distributed = bool(self.fragments or self.native)
        hyper = distrib_hyper(saved) if distributed else dist_hyper(saved)
        how = (" (distributed optimizer, fully_sharded_model_space)" if self.fragments else
               " (distributed optimizer, fully_reshardable)" if self.native else "")
        notes.append(f"converted the optimizer state ({', '.join(kinds)}){how}, step {hyper['step']}")
        return hyper

    def _distributed(self, optim: list[str]) -> dict | str:
        """Map the distributed optimizer's `dp_reshardable` buckets onto parameters (`distrib.py` has the
        layout); the hyperparameters (param groups, step) are a byte object beside them.

        megatron-core keys each model-parallel rank's buckets by its rank in the tp x pp group
        (`dp_group_idx_<pp rank * tp + tp rank>`, optimizer/__init__.py `data_parallel_group_idx=model_parallel_rank`)
        and each model chunk's buffer by `gbuf_idx`; a bucket holds that rank's tp shards of its stage's parameters."""
        args = self.stored_args
        found = {}
        for key in optim:
            m = _BUCKET.match(key)
            found[(int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5))] = key
        if len({d for _, _, d, _, _ in found}) != 1:
            return "buffers of more than one dtype: not understood"
        if self.spec.is_moe:
            return "mixture of experts: the expert parameters' buffers are not mapped"
        try:
            layout = ParallelLayout.build(
                self.spec.num_layers, *[int(args.get(k) or 1) for k in ("tensor_model_parallel_size",
                                                                          "pipeline_model_parallel_size",
                                                                          "virtual_pipeline_model_parallel_size")],
                args.get("decoder_first_pipeline_num_layers"), args.get("decoder_last_pipeline_num_layers"))
        except (InteropError, TypeError, ValueError) as exc:
            return f"the args' tp/pp/vpp do not lay out this model ({exc})"
        if layout.pp > 1 and self.spec.tied_embeddings:
            return "a tied embedding over several pipeline stages has a bucket of its own (not modelled)"
        dp = args.get("data_parallel_size")
        if not isinstance(dp, int) or dp < 1:
            return "the args do not say data_parallel_size, which lays out the buckets"
        want = {(m, v) for m in range(layout.tp * layout.pp) for v in range(layout.vpp)}
        if {f[:2] for f in found} != want:
            return (f"bucket tensors for {len({f[:2] for f in found})} (rank, model chunk) buffers, tp {layout.tp} x "
                    f"pp {layout.pp} x vpp {layout.vpp} make {len(want)}")
        # the parameter order in a bucket is the layer spec's module order: the args name the spec (Megatron-LM's
        # --transformer-impl); when they don't, the one whose boundaries the checkpoint's chunks show
        impl = args.get("transformer_impl")
        schemes = {"local": ["mcore"], "transformer_engine": ["mcore_te"], None: ["mcore", "mcore_te"]}.get(impl)
        if schemes is None:
            return f"transformer_impl={impl!r}: its parameter order in the buckets is not known"
        why = ""
        for scheme in schemes:
            got = self._bucket_slots(scheme, layout, dp, found, args)
            if not isinstance(got, str):
                self.dist_slots = got
                break
            why = got
        else:
            return why
        self.dist_tp = layout.tp
        self.dist_at = (f"tp {layout.tp}, pp {layout.pp}" + (f", vpp {layout.vpp}" if layout.vpp > 1 else "") +
                        f", dp {dp}, {'local' if scheme == 'mcore' else 'Transformer Engine'} layer spec")
        self.buckets = {(m, v, b, kind): key for (m, v, _, b, kind), key in found.items()}
        self.kinds = [distrib.KINDS[k] for k in distrib.KINDS]
        groups = next((k for k in self.ckpt.objects() if k.startswith("optimizer.distributed.dp_group_idx_0.optimizer/")),
                      None)
        return distrib_hyper({"optimizer": self.ckpt.read_object(groups)} if groups else None)

    def _bucket_slots(self, scheme: str, layout: ParallelLayout, dp: int, found: dict, args: dict) -> dict | str:
        """{canonical name: (rank row, part, [(rank, chunk, Slot) per tp rank])} when megatron-core's layout of
        `scheme`'s parameters fits the stored buckets (sizes and every parameter's boundaries, which the DCP
        chunks show: one chunk per parameter piece and padding); else why not."""
        rows = [r for r in expand_rows(scheme, self.spec, layout) if r.transform.reads_back]
        out = {}
        for (p, v) in {(r.stage, r.chunk) for r in rows}:
            mine = {r.key: r for r in rows if (r.stage, r.chunk) == (p, v)}
            order = distrib.module_order(list(mine))
            for t in range(layout.tp):
                m = p * layout.tp + t
                buffer = distrib.layout([(k, math.prod(mine[k].transform.rank_shape(t, layout.tp))) for k in order],
                                        dp, distrib.bucket_size(args, p, v),
                                        bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")))
                for b in range(max(len(buffer.unpadded), 1 + max(f[3] for f in found if f[:2] == (m, v)))):
                    for kind in distrib.KINDS:
                        key = next((k for f, k in found.items() if f[:2] == (m, v) and f[3:] == (b, kind)), None)
                        where = f"rank {m} (tp {t}, pp {p}) chunk {v} bucket {b}"
                        if key is None:
                            return f"no {kind} for {where}"
                        if b >= len(buffer.unpadded):
                            return f"{where}: megatron-core's layout of this model at dp {dp} has no such bucket"
                        size = self.ckpt.meta(key)[1]
                        if size not in ((buffer.unpadded[b],), (buffer.padded[b],)):
                            return (f"{key} holds {list(size)} elements, megatron-core's {scheme} layout of this model "
                                    f"at dp {dp} {buffer.unpadded[b]}")
                    starts = {c.offsets[0] for c in self.ckpt._entry(key).chunks}  # noqa: SLF001 (the chunk list)
                    if starts != distrib.chunk_starts(buffer, b, dp):
                        return (f"{where}: the stored parameter boundaries are not megatron-core's {scheme} layout of "
                                "this model's parameters")
                for k in order:
                    for j, name in enumerate(mine[k].parts):
                        out.setdefault(name, (mine[k], j, []))[2].append((m, v, buffer.slots[k]))
        return out

    def _read_distributed(self, name: str) -> torch.Tensor:
        """Every tp rank's run of the parameter's bucket, joined into the canonical tensor."""
        base, theirs = base_param_name(name), {v: k for k, v in distrib.KINDS.items()}[TensorKey.parse(name).kind]
        row, j, where = self.dist_slots[base]
        if (theirs, row.parts) not in self._cache:
            shards = [self.ckpt.read_box(self.buckets[(m, v, slot.bucket, theirs)], [slot.start], [slot.numel])
                      .view(row.transform.rank_shape(t, self.dist_tp)) for t, (m, v, slot) in enumerate(where)]
            self._cache[(theirs, row.parts)] = row.transform.from_ranks(shards)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[(theirs, row.parts)][j]

    def metas(self) -> list[TensorMeta]:
        out = []
        for prefix in [""] + [TensorKey("", k).prefix for k in self.kinds]:
            for p in param_table(self.spec):
                if prefix and self.buckets is not None:
                    out.append(TensorMeta(prefix + p.name, self.ckpt.meta(next(iter(self.buckets.values())))[0],
                                          p.shape))
                    continue
                key = self._key_prefix(prefix + p.name) + self.row_of[p.name][1]
                out.append(TensorMeta(prefix + p.name, self.ckpt.meta(key)[0], p.shape))
        return out

    def read(self, name: str) -> torch.Tensor:
        if self.buckets is not None and TensorKey.parse(name).is_optim:
            return self._read_distributed(name)
        row, key, layer, j = self.row_of[base_param_name(name)]
        key = self._key_prefix(name) + key  # optimizer state: the weight's layout under its own key
        if len(row.parts) == 1:  # holds nothing else: no reason to keep it
            return row.transform.split(self._read_stored(key, layer))[0]
        if (key, layer) not in self._cache:  # fused: the row's other tensors are asked for next
            stored = self._read_stored(key, layer)
            self._cache[(key, layer)] = row.transform.split(stored)
            while len(self._cache) > 2:  # a fused weight and its bias alternate in canonical order
                self._cache.popitem(last=False)
        return self._cache[(key, layer)][j]

    def native_name(self, name: str) -> str:
        """Where canonical `name` is stored: its DCP key (at its layer when the key is layer-stacked), with its
        part when fused; the distributed optimizer's flat bucket and element range for optimizer state."""
        row, key, layer, j = self.row_of[base_param_name(name)]
        if self.buckets is not None and TensorKey.parse(name).is_optim:
            theirs = {v: k for k, v in distrib.KINDS.items()}[TensorKey.parse(name).kind]
            rank_row, j, ranks = self.dist_slots[base_param_name(name)]
            where = " + ".join(f"{self.buckets[(m, v, slot.bucket, theirs)]} [{slot.start}:{slot.start + slot.numel}]"
                               for m, v, slot in ranks)
            return where if len(rank_row.parts) == 1 else f"{where} [part {j + 1}/{len(rank_row.parts)}]"
        key = self._key_prefix(name) + key
        where = key if layer is None else f"{key} [layer {layer}]"
        return where if len(row.parts) == 1 else f"{where} [part {j + 1}/{len(row.parts)}]"

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """`name`'s bytes as ranges (path, offset, bytes) of the `.distcp` files, when its stored tensor (a layer of
        a stacked key, a whole tensor, one expert) is one contiguous chunk and `name` is runs of whole rows of it
        (the tensor itself; q, k, v of a grouped QKV; gate and up of fc1): the engine then copies them file to
        file.  None for the optimizer's flattened layouts and whatever else must be read."""
        if self.buckets is not None and TensorKey.parse(name).is_optim:
            return None
        row, key, layer, j = self.row_of[base_param_name(name)]
        key = self._key_prefix(name) + key
        if getattr(self, "fragments", {}).get(key) is not None:
            return None
        span = self.ckpt.span(key, *self._box(key, layer))
        if span is None:
            return None
        path, pos, nbytes = span
        if len(row.parts) == 1:
            return [span]
        dtype = self.ckpt.meta(key)[0]
        full = [torch.empty(self.index[n].shape, dtype=dtype, device="meta") for n in row.parts]
        runs = row.transform.runs(full, 0, 1)
        if runs is None or sum(stop - start for _, start, stop in runs) * dtype.itemsize != nbytes:
            return None
        ranges, at = [], 0
        for target, start, stop in runs:  # in stored order; those of part j are in its own order
            if target is full[j]:
                if start != at:
                    return None
                if ranges and ranges[-1][1] + ranges[-1][2] == pos:
                    ranges[-1] = (path, ranges[-1][1], ranges[-1][2] + (stop - start) * dtype.itemsize)
                else:
                    ranges.append((path, pos, (stop - start) * dtype.itemsize))
                at = stop
            pos += (stop - start) * dtype.itemsize
        return ranges if at == full[j].numel() else None

    def _box(self, key: str, layer) -> tuple[list, list]:
        """(offsets, sizes) of what `stacked_key` stores at leading index `layer` of `key`."""
        shape = self.ckpt.meta(key)[1]
        lead = () if layer is None else layer if isinstance(layer, tuple) else (layer,)
        n = len(lead)
        return [*lead] + [0] * (len(shape) - n), [1] * n + [*shape[n:]]

    def _key_prefix(self, name: str) -> str:
        """`optimizer.state.<kind>.` of an optimizer tensor's name as this checkpoint spells the kind; `` for a weight."""
        if not TensorKey.parse(name).is_optim:
            return ""
        kind = TensorKey.parse(name).kind
        return f"optimizer.state.{getattr(self, 'native', {}).get(kind, kind)}."

    def _read_stored(self, key: str, layer) -> torch.Tensor:
        """The Megatron tensor `key` (layer `layer`, or a (layer, expert) pair), reassembled when the distributed
        optimizer stored it flattened."""
        if isinstance(layer, tuple):  # (layer, expert) or (expert,)
            stored = self.ckpt.read_box(key, *self._box(key, layer))
            stored = stored.reshape(self.ckpt.meta(key)[1][len(layer):])
        else:
            stored = self.ckpt.read(key, layer)
        fragments = getattr(self, "fragments", {}).get(key)
        return stored if fragments is None else _unflatten(stored, *fragments)

    # -- fused rows (interop.engine.fused_plan) ------------------------------------------------
    def fused_row(self, name: str):
        """(transform, canonical names) of the fused tensor holding `name`; None for a lone one, and for the
        distributed optimizer's buckets (flat, not laid out as the row)."""
        base = base_param_name(name)
        row = self.row_of[base][0]
        if len(row.parts) < 2 or self.buckets is not None and TensorKey.parse(name).is_optim:
            return None
        prefix = name[:len(name) - len(base)]
        return row.transform, [prefix + n for n in row.parts]

    def read_fused(self, name: str) -> torch.Tensor:
        """The whole fused tensor holding `name`: torch_dist stores it global, as at tp 1."""
        _, key, layer, _ = self.row_of[base_param_name(name)]
        return self._read_stored(self._key_prefix(name) + key, layer)

    def copied(self, name: str) -> None:
        """`byte_ranges(name)` went file to file: its chunk's record is CRC-checked in the background."""
        _, key, layer, _ = self.row_of[base_param_name(name)]
        key = self._key_prefix(name) + key
        self.ckpt.check_later(key, *self._box(key, layer))

    def confirm(self) -> None:
        self.ckpt.confirm()

    def close(self) -> None:
        self._cache.clear()


def _fragments(stored: tuple, weight: tuple, stacked: bool) -> tuple[tuple, tuple] | None:
    """(fragments per axis, weight shape) when `stored` is megatron-core's flattened form of a tensor of
    shape `weight` (the distributed optimizer's `fully_sharded_model_space`): [layers,] *fragments, elements
    of one fragment, each fragment a block of the weight (e.g. fc1's gate and up halves); else None."""
    if stacked:
        if not stored or stored[0] != weight[0]:
            return None
        stored, weight = stored[1:], weight[1:]
    fragments, n = stored[:-1], stored[-1] if stored else 0
    if len(fragments) != len(weight) or any(f < 1 or w % f for f, w in zip(fragments, weight)):
        return None
    if n != math.prod(w // f for f, w in zip(fragments, weight)):
        return None
    return tuple(fragments), tuple(weight)


def _unflatten(stored: torch.Tensor, fragments: tuple, weight: tuple) -> torch.Tensor:
    """[*fragments, elements] -> the weight: fragment (i, j, ..) is block (i, j, ..) in row-major order."""
    block = [w // f for f, w in zip(fragments, weight)]
    x = stored.reshape(*fragments, *block)
    d = len(fragments)
    order = [a for i in range(d) for a in (i, d + i)]  # (f0, b0, f1, b1, ...)
    return x.permute(*order).reshape(weight)


def _extra_template(module: str) -> str:
    """The EXTRA_STATE_MODULES template `module` (a layer's linear) matches, or '' (no `_extra_state`)."""
    for m in EXTRA_STATE_MODULES:
        if re.fullmatch(re.sub(r"\\\{[ijk]\\\}", r"\\d+", re.escape(m)), module):
            return m
    return ""


class Writer(BaseWriter):
    """Writes `save/iter_XXXXXXX/` in torch_dist, loadable by Megatron-LM at any tp/pp."""

    options = ("iteration", "distributed_optimizer", "transformer_impl")
    splits = True
    holds_moe = True  # routed experts, router and shared experts, at any --ep
    padded_vocab = staticmethod(padded_vocab)

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta],
                 iteration: int | None = None, distributed_optimizer: bool | None = None,
                 transformer_impl: str | None = None, only=None):
        """`only`: the `.distcp` files (`units`: 0 for the embedding, final norm and output layer, 1 + i for
        decoder layer i) to write, for a conversion split over processes (`interop.workers`); None: all."""
        spec.check_tp(layout.tp)
        self.root, self.spec, self.layout, self.iteration = Path(root), spec, layout, iteration
        self.distributed_optimizer = distributed_optimizer  # None: as the source's args say
        self.index = param_index(spec)
        if layout.ep > 1:
            spec.check_ep(layout.ep)
        self.impl = transformer_impl or "local"
        te = self.impl == "transformer_engine"
        self.rows = _rows(spec, dist_scheme(spec, te), moe_norm_apart=te)
        refuse_unstated(spec)  # before a file is written
        self.notes: list[str] = args_losses(spec)
        self.row_of = {n: r for r in self.rows for n in r.parts}
        if spec.is_moe and any(TensorKey.parse(m.name).is_optim for m in metas):
            self.notes.append("the experts' optimizer state is written in their weights' layout (the global expert "
                              "axis), as megatron-core shards optimizer state like its parameter; not checked against "
                              "megatron-core's MoE optimizer loading")
        dtype_of = {m.name: m.dtype for m in metas}
        self.kinds = [k for k in KINDS if any(TensorKey.parse(m.name).kind == k for m in metas)]
        self.planned: dict[str, tuple[torch.dtype, tuple]] = {}
        self.homogeneous = homogeneous(spec)
        lead: dict[str, int] = {}  # leading axes written one index at a time
        for prefix in [""] + [TensorKey("", k).prefix for k in self.kinds]:
            for row in self.rows:
                key, layer = stacked_key(row.key, self.homogeneous)
                shape = tuple(row.transform.rank_shape())
                self.planned[_prefix(prefix) + key] = (dtype_of[prefix + row.parts[0]], global_shape(spec, layer, shape))
                lead[_prefix(prefix) + key] = 0 if layer is None else len(layer) if isinstance(layer, tuple) else 1
        self.pending = RowCollector()
        # Finished Megatron tensors go straight into the DCP file of a folder renamed `iter_*` at the end
        # (the iteration is known only from the final state).
        self.root.mkdir(parents=True, exist_ok=True)
        self.partial = self.root / ".partial"
        self.units = list(range(spec.num_layers + 1))
        self.only = only
        self.out = dist.DistWriter(self.partial, _file_of, only)
        for key, (dtype, shape) in self.planned.items():
            self.out.declare(key, dtype, shape, lead=lead[key])

    def wants(self, name: str) -> bool:
        key, layer = stacked_key(self.row_of[base_param_name(name)].key, self.homogeneous)
        return self.only is None or _file_of(key, layer) in self.only

    def write(self, name: str, tensor: torch.Tensor) -> None:
        base, prefix = base_param_name(name), _prefix(name)  # optimizer state: fused like its weight
        row = self.row_of[base]
        parts = self.pending.add((prefix, row.parts), row.parts, base, tensor)
        if parts is None:
            return
        fused = row.transform.fuse(parts)
        key, layer = stacked_key(row.key, self.homogeneous)
        self.out.write(prefix + key, layer, fused)

    def accepts_fused(self, names: list[str], transform) -> bool:
        """Whether `names` are one of our rows, in its order, stored by an equal transform."""
        base = base_param_name(names[0])
        row, prefix = self.row_of.get(base), names[0][:len(names[0]) - len(base)]
        return row is not None and row.transform == transform and [prefix + n for n in row.parts] == list(names)

    def write_fused(self, names: list[str], fused: torch.Tensor) -> None:
        """The whole stored tensor of one row, as torch_dist keeps it (global)."""
        key, layer = stacked_key(self.row_of[base_param_name(names[0])].key, self.homogeneous)
        self.out.write(_prefix(names[0]) + key, layer, fused)

    def finish_units(self, state: dict | None = None) -> dict:
        """Close this writer's `.distcp` files; returns their DCP storage entries."""
        self.pending.check_done()
        return self.out.close_files()

    def finish_global(self, state: dict | None, results: dict) -> None:
        """`.metadata` (every file's chunks, `results`: their DCP storage entries), the byte objects, common.pt,
        metadata.json; then the folder's name."""
        self.out.add_storage({i: info for i, info in results.items() if i not in self.out.storage})
        state = state or {}
        meg = state.get("megatron") or {}
        base = base_args(meg)
        divisor = vocab_divisor(self.spec.vocab, self.spec.padded_vocab, self.layout.tp) or 128
        args = args_from_spec(self.spec, self.layout, base, divisor)
        args["transformer_impl"] = self.impl
        iteration = final_iteration(self.iteration, state)
        scheduler, notes = to_megatron(state, args, 0 if iteration == "release" else iteration)
        if self.kinds:  # a schedule matters to a run that resumes its optimizer
            self.notes += notes
        args = argparse.Namespace(**args)
        args.ckpt_format = "torch_dist"
        args.iteration = 0 if iteration == "release" else iteration
        common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": args.iteration}
        if scheduler is not None:
            common["opt_param_scheduler"] = scheduler
        if meg.get("num_floating_point_operations_so_far") is not None:
            common["num_floating_point_operations_so_far"] = meg["num_floating_point_operations_so_far"]
        distributed = self.distributed_optimizer
        if distributed is None:
            distributed = bool((base or {}).get("use_distributed_optimizer"))
        args.use_distributed_optimizer = distributed
        renamed = {}
        if self.kinds:
            hyper = optimizer_hyper(state) or {}
            step = hyper.get("step") if hyper.get("step") is not None else args.iteration
            if distributed:
                # megatron-core 0.16's `fully_reshardable` layout: per-parameter tensors as the non-distributed
                # optimizer's, the fp32 master under `param`; param groups carry the step
                # (megatron/core/optimizer/distrib_optimizer.py, sharded_param_state_fully_reshardable)
                if "fp32_param" not in self.kinds:
                    raise InteropError("the distributed optimizer layout needs fp32 master weights, the source has "
                                       "none (write the non-distributed optimizer's layout instead)")
                renamed = {optim_key("fp32_param", ""): optim_key("param", "")}
                common["optimizer"] = dist_common_distributed(hyper, step)
                common["content_metadata"] = {"distrib_optim_sharding_type": "fully_reshardable",
                                              "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
            else:
                common["optimizer"] = dist_common(hyper, step, self.kinds)
        self.out.rename(lambda key: next((new + key[len(old):] for old, new in renamed.items() if key.startswith(old)),
                                         key))
        # mcore's loader asks for one (empty) `_extra_state` object per layer of each linear module, and per
        # (layer, expert) of each routed expert's (a ShardedObject's key: `<key>/shard_<offset>_<shape>`).
        n, written = self.spec.num_layers, set()
        for row in self.rows:
            module = row.key.rsplit(".", 1)[0]
            template = _extra_template(module)
            if "{i}" not in template and "{k}" not in template:
                continue
            key, layer = stacked_key(row.key, self.homogeneous)
            name = f"{key.rsplit('.', 1)[0]}._extra_state"
            if isinstance(layer, tuple) and len(layer) == 2:
                name += f"/shard_{layer[0]}.{layer[1]}_{n}.{self.spec.num_experts}"
            elif isinstance(layer, tuple):
                name += f"/shard_{layer[0]}_{self.spec.num_experts}"
            elif layer is None:  # megatron-core's ShardedObject without offsets (transformer/utils.py)
                name += "/shard_0_1"
            else:
                name += f"/shard_{layer}_{n}"
            if name not in written:
                written.add(name)
                self.out.write_object(name, None)
        self.out.finish(common)
        self.partial.rename(self.root / iteration_name(iteration))
        write_tracker(self.root, iteration)

    def abort(self) -> None:
        self.out.abort()
