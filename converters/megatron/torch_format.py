"""Megatron-LM `torch` format checkpoints (rank files) <-> canonical tensors.

On disk (the `torch` format):

    save/latest_checkpointed_iteration.txt        an iteration number or `release`
    save/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   (_PPP when pp > 1, _EEE when ep > 1)

Each rank file is a pickle of one (tp, pp[, ep]) rank's state: `args`, `iteration`,
`checkpoint_version`, `model` (or `model0..N-1`, one per virtual pipeline chunk,
layer numbers local to the chunk), `optimizer`, `opt_param_scheduler`, `rng_state`.
Names follow megatron-core (with or without Transformer Engine's fused norms) or the
legacy model (older spellings included): `interop.mappings.megatron_names`.  With expert parallelism
every EP rank's file holds the same non-expert tensors and its own routed experts, numbered locally
(`local_experts.<j>`, j = e - ep_rank * E / EP); a two-part folder name is the pp or the ep rank as the
args say (MEGATRON-LAYOUTS.md s.1).  

The Reader is the tensor access; what it finds first is one module each: `rank_files` (which rank files and
folders exist), `model_state` (their model state dicts, naming scheme, expert layout; every tensor checked),
`model_spec` (args -> ModelSpec and layout), `optimizer_state` (Adam's moments, or distrib_optim.pt's buffers).

Rank files are unpickled safely (`interop.io.safe_pickle`) with tensors left on
disk (`interop.io.torch_file`): a read costs the tensor's bytes, not the file's.
The writer streams each rank file the same way, tensor by tensor.
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
from ...io.safe_pickle import to_plain
from ...io.torch_file import TorchFileWriter
from ...layout import ParallelLayout
from ...mappings.megatron_names import EXTRA_STATE_MODULES
from ...memory import BufferPool
from ...params import TensorKey, base_param_name, param_index, param_table
from ...rows import RowCollector
from ...spec import ModelSpec
from ...tensors import NAME_OF_DTYPE, Source, TensorMeta
from ...mappings.megatron_spec import args_from_spec, args_losses, refuse_unstated
from .args import args_dict, check_args, base_args, padded_vocab, vocab_divisor
from ...io.megatron_save import iteration_name, write_tracker
from .checkpoint import CHECKPOINT_VERSION, DISTRIB_OPTIM_FILE, RANK_FILE, final_iteration, iteration_dir, rank_dir_name
from . import distrib
from .distrib_file import DistribOptimFile, grad_dtype
from .model_spec import layout_of, local_numbers, model_args, spec_of
from .model_state import ModelState, check_distinct_ranks, check_tensors
from .optimizer import (DENSE, EXPERT, distrib_entry, expert_data_parallel, expert_groups, is_expert_param, pack,
                        parameter_order)
from .optimizer_state import OptimizerState
from .rank_files import FolderPlan, RankFiles
from .training import from_megatron, optimizer_hyper, to_megatron
from .rows import expand_rows, read_ranks

DISTRIB_KIND = {ours: theirs for theirs, ours in distrib.KINDS.items()}  # optim kind -> distrib_optim.pt's
EXPERT_SCRATCH = "distrib_optim.experts.scratch"  # the expert optimizer's pieces, beside the dense optimizer's
# modules whose state dict holds an `_extra_state` entry (layer and local expert numbers as digits)
_EXTRA_STATE = re.compile("|".join(re.sub(r"\\\{[ijk]\\\}", r"\\d+", re.escape(m)) for m in EXTRA_STATE_MODULES))


# ------------------------------------------------------------------------------------------------
# Reading

def bands_of(rows) -> dict:
    """{canonical name: its rows} of the canonical tensors stored as several bands of rows (`HeadRows`)."""
    out: dict = {}
    for r in rows:
        if not r.transform.covers_part:
            out.setdefault(r.parts[0], []).append(r)
    return out


class Reader(BaseReader):
    """A Megatron checkpoint in the `torch` format (rank files)."""

    options = ("iteration", "model_config", "vocab_size", "allow_identical_ranks")

    @classmethod
    def options_for_worker(cls, options: dict) -> dict:
        return dict(options, verify=False)  # the parent compared the tied head's copy with the embedding

    def __init__(self, path, iteration: int | None = None, model_config=None, vocab_size: int | None = None,
                 verify: bool = True, allow_identical_ranks: bool = False):
        """`verify=False` skips reading tensor bytes to check the files (a tied head's stored copy): a
        `--workers` worker, whose parent checked them."""
        self.root = Path(path)
        self.dir, it = iteration_dir(self.root, iteration)
        ranks = RankFiles(self.dir)
        self.tp, self.pp, self.ep, self.etp, self.plan = ranks.tp, ranks.pp, ranks.ep, ranks.etp, ranks.plan
        self.ep_files, self.files, self.rank_dirs = ranks.ep_files, ranks.files, ranks.rank_dirs
        first = self.files[(0, 0)].obj
        if not isinstance(first, dict):
            raise InteropError(f"{self.files[(0, 0)].path}: expected a dict, found {type(first).__name__}")
        notes: list[str] = []
        stored = args_dict(first.get("args"))
        check_args(stored, self.files[(0, 0)].path)
        full = model_args(stored, model_config, ranks, notes)
        # the padded size the checkpoint's own args state (a --model-config or --vocab-size gives the true one)
        stated = None if model_config is not None or vocab_size else (stored or {}).get("padded_vocab_size")
        if vocab_size:
            full = dict(full, vocab_size=vocab_size)
        model = ModelState(ranks)
        self.chunks, self.scheme, self.experts = model.chunks, model.scheme, model.experts
        self.ep_dicts, self.state_dicts = model.ep_dicts, model.state_dicts
        spec = spec_of(full, model, ranks, notes, stated)
        numbers = local_numbers(model, ranks, notes)
        self.layout = layout_of(spec, model, ranks, numbers)
        self.spec = spec
        self.index = param_index(spec)
        self.rows = expand_rows(self.scheme, spec, self.layout, self.experts, model.moe_norm_apart, numbers)
        check_tensors(model, ranks, self.rows, spec, notes, compare_tied=verify)
        check_distinct_ranks(model, ranks, self.rows, notes, allow_identical_ranks)
        self.row_of = {n: (r, j) for r in self.rows if r.transform.reads_back for j, n in enumerate(r.parts)}
        self.bands = bands_of(self.rows)
        optimizer = OptimizerState(ranks, model, self.rows, spec, stored or {}, first)
        self.moments, self.moment_files = optimizer.moments, optimizer.files  # (distrib_optim.pt: their own files)
        hyper = optimizer.hyper
        if optimizer.note:
            notes.append(optimizer.note)
        if "rng_state" in first:
            notes.append("dropped the rng state (per-rank random generator states do not survive resharding)")
        scheduler = to_plain(first.get("opt_param_scheduler"))
        state = {
            "iteration": first.get("iteration") if isinstance(first.get("iteration"), int) else it,
            **from_megatron(stored or {}, scheduler, (hyper or {}).get("step")),
            "megatron": {"checkpoint_version": to_plain(first.get("checkpoint_version")), "scheme": self.scheme,
                         "args": {k: to_plain(v) for k, v in (stored or {}).items()},
                         "opt_param_scheduler": scheduler, "optimizer": hyper,
                         "num_floating_point_operations_so_far": to_plain(
                             first.get("num_floating_point_operations_so_far"))},
        }
        self.source = Source(spec, self.layout, state, notes)
        self._cache: OrderedDict = OrderedDict()
        self.memory = BufferPool(keep=4)  # a layer's four large rows (qkv, proj, fc1, fc2); 8 held 0.06 of a 7B model
        self.vocab_buffer = False
        self._native: dict | None = None  # canonical name -> its key and stage, built on first ask

    # -- opening -------------------------------------------------------------------------------
    # -- the Reader contract -------------------------------------------------------------------
    def _stored(self, name: str) -> tuple[dict, str, dict]:
        """The per-rank dicts `name` lives in (weights, or one optimizer kind's), its parameter, and the files."""
        base = base_param_name(name)
        if base == name:
            return self.ep_dicts, base, self.ep_files
        return self.moments[TensorKey.parse(name).kind], base, self.moment_files

    def metas(self) -> list[TensorMeta]:
        out = []
        for prefix in [""] + [TensorKey("", k).prefix for k in self.moments]:
            for p in param_table(self.spec):
                dicts, _, files = self._stored(prefix + p.name)
                row, _ = self.row_of[p.name]
                dicts, _ = self._on_ep_rank(dicts, files, row)
                out.append(TensorMeta(prefix + p.name, dicts[(0, row.stage, row.chunk)][row.key].dtype, p.shape))
        return out

    def _replicated(self, row) -> bool:
        """Every TP rank holds the whole tensor (norms, biases of row-parallel layers): rank 0's is read."""
        return row.transform.replicated

    def _on_ep_rank(self, dicts: dict, files: dict, row) -> tuple[dict, dict]:
        """`dicts` / `files` keyed (folder tp rank, p, v, e) / (t, p, e), as (shard, p, v) / (shard, p) of `row`'s
        shards (`FolderPlan.of`: a routed expert's of its EP rank, by expert tp rank; the rest by tp rank)."""
        out_dicts, out_files = {}, {}
        for rank in range(self._ranks(row)):
            t, e = self.plan.of(row.ep, rank)
            for (t2, p, v, e2), sd in dicts.items():
                if (t2, e2) == (t, e):
                    out_dicts[(rank, p, v)] = sd
            for (t2, p, e2), f in files.items():
                if (t2, e2) == (t, e):
                    out_files[(rank, p)] = f
        return out_dicts, out_files

    def _ranks(self, row) -> int:
        """How many shards a row is cut in: a routed expert's over the expert tp ranks, the rest over tp."""
        return self.etp if row.ep is not None else self.tp

    def _read_row(self, dicts: dict, files: dict, row, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        if self.index[row.parts[0]].split == "vocab":  # the largest tensor: drop what the layers held
            self._cache.clear()
            self.memory.release_idle()
            self.vocab_buffer = True  # left idle in the pool after it, which no layer's row fits
        dicts, files = self._on_ep_rank(dicts, files, row)
        n = self._ranks(row)
        stored = {t: dicts[(t, row.stage, row.chunk)][row.key] for t in range(n)}
        dtypes = {t: s.dtype for t, s in stored.items()}
        if len(set(dtypes.values())) > 1:  # never cast one rank's bytes to its peers' type
            raise InteropError(f"{self.dir}: {row.key} is stored as {', '.join(str(d) for d in dtypes.values())} "
                               "by the tp ranks (tp 0, 1, ...): one dtype expected")
        if self._replicated(row):  # rank 0's copy (a fused one, MindSpeed-LLM's [q_a; kv_a], split into its parts)
            tensor = files[(0, row.stage)].read(stored[0])
            parts = row.transform.split(tensor) if len(row.parts) > 1 else [tensor]
            return parts if out is None else [o.copy_(x) for o, x in zip(out, parts)]
        read_into = lambda t, runs: files[(t, row.stage)].read_into(stored[t], runs)  # noqa: E731
        return read_ranks(row, read_into, n, stored[0].dtype, self.memory, out)

    def read(self, name: str) -> torch.Tensor:
        dicts, base, files = self._stored(name)
        if base in self.bands:
            return self._read_bands(dicts, files, base)
        row, j = self.row_of[base]
        if len(row.parts) == 1:
            return self._read_row(dicts, files, row)[0]
        ident = (name[:len(name) - len(base)], row.stage, row.chunk, row.ep, row.key)
        if ident not in self._cache:  # fused: the row's other tensors are asked for next
            self._cache[ident] = self._read_row(dicts, files, row)
            while len(self._cache) > 2:  # a fused weight and its bias alternate in canonical order
                self._cache.popitem(last=False)
        return self._cache[ident][j]

    def _read_bands(self, dicts: dict, files: dict, base: str, out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """A canonical tensor stored as bands of its heads' rows (`HeadRows`), each band's row read into it."""
        for row in self.bands[base]:
            out = self._read_row(dicts, files, row, out)
        return out[0]

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """`name`'s bytes as ranges (path, offset, bytes) of the rank files in row-major order, when every
        rank holds its part as runs of whole rows (q, k, v of a fused QKV, gate and up, vocab blocks,
        replicated norms); None for a split on dim 1 or a file without record offsets."""
        dicts, base, files = self._stored(name)
        if base in self.bands:
            return None
        row, j = self.row_of[base]
        dicts, files = self._on_ep_rank(dicts, files, row)
        replicated = self._replicated(row)
        ranks = [0] if replicated else range(self._ranks(row))
        stored = {t: dicts[(t, row.stage, row.chunk)][row.key] for t in ranks}
        if any(x.device.type != "meta" or not x.is_contiguous() for x in stored.values()):
            return None
        full = [torch.empty(self.index[n].shape, dtype=stored[0].dtype, device="meta") for n in row.parts]
        pieces = []  # (first element, path, file offset, bytes) of the runs that belong to `name`
        for t in ranks:
            runs = [(full[0], 0, full[0].numel())] if replicated else row.transform.runs(full, t, self._ranks(row))
            if runs is None:
                return None
            x, item = stored[t], stored[t].element_size()
            pos = x.untyped_storage()._checkpoint_offset + x.storage_offset() * item
            for target, start, stop in runs:
                if target is full[j]:
                    pieces.append((start, str(files[(t, row.stage)].path), pos, (stop - start) * item))
                pos += (stop - start) * item
        ranges, at = [], 0
        for start, path, pos, nbytes in sorted(pieces):
            if start != at:
                return None
            if ranges and ranges[-1][0] == path and ranges[-1][1] + ranges[-1][2] == pos:
                ranges[-1] = (path, ranges[-1][1], ranges[-1][2] + nbytes)
            else:
                ranges.append((path, pos, nbytes))
            at += nbytes // full[j].element_size()
        return ranges if at == full[j].numel() else None

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Fill `out` with `name` when its Megatron tensor holds nothing else (not fused); else False."""
        dicts, base, files = self._stored(name)
        if base in self.bands:
            self._read_bands(dicts, files, base, [out])
            return True
        row, _ = self.row_of[base]
        if len(row.parts) != 1:
            return False
        self._read_row(dicts, files, row, [out])
        return True

    # -- fused rows (interop.engine.fused_plan) ------------------------------------------------
    def fused_row(self, name: str):
        """(transform, canonical names) of the fused Megatron tensor holding `name`; None for a lone one."""
        base = base_param_name(name)
        row, _ = self.row_of[base]
        if len(row.parts) < 2:
            return None
        prefix = name[:len(name) - len(base)]
        return row.transform, [prefix + n for n in row.parts]

    def read_fused(self, name: str) -> torch.Tensor:
        """The whole fused tensor holding `name` (as at tp 1), each rank's rows read straight into place."""
        dicts, base, files = self._stored(name)
        row, _ = self.row_of[base]
        dicts, files = self._on_ep_rank(dicts, files, row)
        n = self._ranks(row)  # a routed expert's shards: over the expert tp ranks
        stored = {t: dicts[(t, row.stage, row.chunk)][row.key] for t in range(n)}
        if len({s.dtype for s in stored.values()}) > 1:
            raise InteropError(f"{self.dir}: {row.key} is stored as {', '.join(str(s.dtype) for s in stored.values())} "
                               "by the tp ranks (tp 0, 1, ...): one dtype expected")
        if self.vocab_buffer:  # the embedding's buffer would stay mapped through every layer
            self.memory.release_idle()
            self.vocab_buffer = False
        fused = row.transform
        out = self.memory.empty(fused.rank_shape(), stored[0].dtype)
        per_row = out[0].numel()
        for t in [0] if fused.replicated else range(n):
            ranges = fused.fused_rows(0, 1) if fused.replicated else fused.fused_rows(t, n)
            files[(t, row.stage)].read_into(stored[t], [(out, a * per_row, b * per_row) for a, b in ranges])
        return out

    def native_name(self, name: str) -> str | None:
        """The key holding `name` in its stage's rank files (a key is local to its pipeline stage and virtual
        chunk), with the part when the stored tensor is fused."""
        if self._native is None:
            self._native = {}
            for row in self.rows:
                where = f"pp{row.stage}" + (f" chunk {row.chunk}" if self.layout.vpp > 1 else "")
                key, parts = f"{row.key} ({where})", row.parts
                for i, part in enumerate(parts):
                    self._native.setdefault(part, key if len(parts) == 1 else f"{key} [part {i + 1}/{len(parts)}]")
        return self._native.get(name)

    def copied(self, name: str) -> None:
        """`byte_ranges(name)` went file to file: each rank's record it came from is CRC-checked in the
        background (`confirm`), as `read` checks what it reads."""
        dicts, base, files = self._stored(name)
        row, _ = self.row_of[base]
        dicts, files = self._on_ep_rank(dicts, files, row)
        for t in [0] if self._replicated(row) else range(self._ranks(row)):
            files[(t, row.stage)].check_later(dicts[(t, row.stage, row.chunk)][row.key])

    def confirm(self) -> None:
        for f in {id(f): f for files in (self.ep_files, self.moment_files) for f in files.values()}.values():
            f.confirm()

    def close(self) -> None:
        self._cache.clear()


# ------------------------------------------------------------------------------------------------
# Writing

class Writer(BaseWriter):
    """Writes a Megatron-LM `torch` checkpoint (megatron-core names) that Megatron can load."""

    options = ("iteration", "distributed_optimizer", "dp", "transformer_impl")
    splits = True
    holds_moe = True  # routed experts, router and shared experts, at any --ep (EP rank folders)
    padded_vocab = staticmethod(padded_vocab)

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta],
                 iteration: int | None = None, distributed_optimizer: bool | None = None, dp: int | None = None,
                 transformer_impl: str | None = None, only=None):
        """`only`: the (tp, pp) rank files (`units`) to write, for a conversion split over processes
        (`interop.workers`); None: all of them."""
        spec.check_tp(layout.tp)
        if layout.ep > 1:
            spec.check_ep(layout.ep)
        if layout.num_layers != spec.num_layers:
            raise InteropError(f"layout has {layout.num_layers} layers, the model {spec.num_layers}")
        self.root, self.spec, self.layout, self.iteration = Path(root), spec, layout, iteration
        self.index = param_index(spec)
        # the Transformer Engine spec's names (its MoE layers keep pre_mlp_layernorm apart), or the local spec's
        self.impl = transformer_impl or "local"
        te = self.impl == "transformer_engine"
        if te and distributed_optimizer:
            raise InteropError("--transformer-impl transformer_engine with --distributed-optimizer: distrib_optim.pt "
                               "is laid out in the local spec's parameter order only (write --format torch_dist)")
        self.rows = self._expand_rows(te)
        self.row_of = {n: r for r in self.rows if r.transform.reads_back for n in r.parts}
        self.bands = bands_of(self.rows)
        self.tied_rows = [r for r in self.rows if not r.transform.reads_back]
        self.names = {m.name for m in metas}
        self.optim_kinds = sorted({key.kind for key in map(TensorKey.parse, self.names) if key.is_optim})
        refuse_unstated(spec)  # before a file is written
        self.notes: list[str] = args_losses(spec)
        self.pending = RowCollector()
        self.memory = BufferPool(keep=4)  # fused or strided rank tensors, reused once written
        self.refs: dict[tuple, object] = {}  # (t, stage, chunk, parts) -> TensorRef
        # --distributed-optimizer: the moments (and fp32 masters) go to each rank's distrib_optim.pt
        distributed = self._check_distrib(distributed_optimizer, dp)
        self.dp = dp
        self.weight_dtypes: set = set()
        self.dir = self.root / "iter_pending"
        # units: the (t, p) rank files, each with its ep ranks' files; none to split with distrib_optim.pt, whose
        # args need every rank's weight dtypes
        self.units = [] if distributed else layout.ranks()
        self.owned = {(t, p) for t, p in layout.ranks() if only is None or (t, p) in only}
        self.plan = FolderPlan(layout.tp, layout.etp, layout.ep)  # which (t, e) folders exist (all at etp = tp)
        self.files = {}  # (t, p, e): one rank file per tensor, pipeline and expert parallel rank
        for t, p in layout.ranks():
            if (t, p) not in self.owned:
                continue
            for e in range(layout.ep):
                if (t, e) not in self.plan.folders:
                    continue
                path = self.dir / rank_dir_name(t, p, layout.pp, e, layout.ep) / RANK_FILE
                path.parent.mkdir(parents=True, exist_ok=True)
                self.files[(t, p, e)] = TorchFileWriter(path)
        # distrib_optim.pt: the dense optimizer's buffers on EP rank 0, with MoE the expert optimizer's on every EP rank
        self.distrib = {(t, p): DistribOptimFile(f.path.parent) for (t, p, e), f in self.files.items()
                        if e == self.plan.dense_ep[t]} if distributed else {}
        self.expert_distrib = {key: DistribOptimFile(f.path.parent, EXPERT_SCRATCH) for key, f in self.files.items()} \
            if distributed and layout.ep > 1 else {}
        # the expert optimizer's buffers: one per model chunk that holds routed experts, numbered in chunk order
        self.expert_chunks = {p: sorted({r.chunk for r in self.rows if r.stage == p and is_expert_param(r.key)})
                              for p in range(layout.pp)}

    # what a fork of Megatron-LM writes differently (`mindspeed_llm.Writer`)
    experts = "sequential"  # how routed experts are stored (`EXPERT_LAYOUTS`): SequentialMLP's local_experts.N
    extra_state = True  # each linear module's (empty) `_extra_state` entry, as megatron-core's state_dict has it
    tracker_newline = True  # latest_checkpointed_iteration.txt ends its number with a newline

    def _iteration(self, state: dict) -> int | str:
        """The iteration to save as: --iteration, the source's, or `release`."""
        return final_iteration(self.iteration, state)

    def _expand_rows(self, te: bool) -> list:
        """The rows this writer stores: megatron-core's local or Transformer Engine spec names."""
        return expand_rows("mcore_te" if te else "mcore", self.spec, self.layout, moe_norm_apart=te)

    def _check_distrib(self, distributed_optimizer: bool | None, dp: int | None) -> bool:
        """Whether distrib_optim.pt files are written (refused in one line where they cannot be)."""
        if not distributed_optimizer or not self.optim_kinds:
            if distributed_optimizer:
                self.notes.append(f"no optimizer state in the source: no {DISTRIB_OPTIM_FILE} written")
            return False
        missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in self.optim_kinds]
        if missing:
            raise InteropError(f"--distributed-optimizer: the source has no {missing[0]} (Adam's state is needed)")
        if dp is None or dp < 1:
            raise InteropError(f"--distributed-optimizer with --format torch: pass --dp N, the data-parallel size "
                               f"{DISTRIB_OPTIM_FILE}'s buffers are laid out for")
        if self.layout.pp > 1 and self.spec.tied_embeddings:
            raise InteropError(f"--distributed-optimizer: a tied embedding over several pipeline stages has a bucket "
                               f"of its own in {DISTRIB_OPTIM_FILE} (not supported); write --format torch_dist")
        if self.layout.ep > 1:
            edp = expert_data_parallel(dp, self.layout.tp, self.layout.ep, self.layout.etp)
            if isinstance(edp, str):
                raise InteropError(f"--distributed-optimizer --dp {dp}: {edp}")
            self.expert_dp = edp
        return True

    def _distrib_file(self, t: int, row):
        """The DistribOptimFile and buffer number `row`'s optimizer state goes to (a routed expert's: its EP rank's
        expert optimizer, buffers counted over the chunks holding experts)."""
        if self.expert_distrib and is_expert_param(row.key):
            return self.expert_distrib[(t, row.stage, row.ep or 0)], self.expert_chunks[row.stage].index(row.chunk)
        return self.distrib[(t, row.stage)], row.chunk

    def _targets(self, row, base: str) -> list:
        return [row] + (self.tied_rows if base == "embed.word.weight" else [])

    def wants(self, name: str) -> bool:
        base = base_param_name(name)
        stages = {r.stage for r in self._targets(self.row_of[base], base)}
        return any((t, p) in self.owned for t in range(self.layout.tp) for p in stages)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        base = base_param_name(name)
        kind = TensorKey.parse(name).kind or ""  # optimizer moments: fused like their weight
        if kind and kind not in self.optim_kinds:
            return
        row = self.row_of[base]
        parts = self.pending.add((kind, row.parts), row.parts, base, tensor)
        if parts is None:
            return
        if self.index[base].split == "vocab":  # the largest tensor: the layers' buffers would only add to the peak
            self.memory.release_idle()
        for row in self.bands.get(base, (row,)):
            fused = row.transform
            self._place(kind, row, base, lambda rank, n: fused.to_rank(
                parts, rank, n, out=self.memory.empty(fused.rank_shape(rank, n), parts[0].dtype)))

    def _place(self, kind: str, row, base: str, piece_of) -> None:
        """Each owned shard's stored tensor (`piece_of(shard, shards)`) into its rank files (or distrib_optim.pt):
        a routed expert's shards over the expert tp ranks, in the folders `FolderPlan` says; the rest over tp."""
        shards = self.layout.etp if row.ep is not None else self.layout.tp
        for rank in range(shards):
            t = self.plan.of(row.ep, rank)[0]  # the folders' tp rank holding this shard
            mine = [r for r in self._targets(row, base) if (t, r.stage) in self.owned]
            if not mine:
                continue
            piece = piece_of(rank, shards)
            for r in mine:
                if kind and self.distrib:
                    target, buffer = self._distrib_file(t, r)
                    target.add(DISTRIB_KIND[kind], buffer, r.key, piece)
                    continue
                for e in (range(self.layout.ep) if r.ep is None else [r.ep]):  # every EP rank: a copy
                    if (t, e) in self.plan.folders:
                        self.refs[(kind, t, r.stage, r.chunk, e, r.key)] = self.files[(t, r.stage, e)].add(piece)
                if not kind:
                    self.weight_dtypes.add(piece.dtype)
                if not kind and self.distrib and "fp32_param" not in self.optim_kinds:  # masters: the weights
                    target, buffer = self._distrib_file(t, r)
                    target.add("param", buffer, r.key, piece)

    # -- fused rows (interop.engine.fused_plan) ------------------------------------------------
    def accepts_fused(self, names: list[str], transform) -> bool:
        """Whether `names` are one of our rows, in its order, stored by an equal transform."""
        base = base_param_name(names[0])
        kind = TensorKey.parse(names[0]).kind or ""
        row = self.row_of.get(base)
        prefix = names[0][:len(names[0]) - len(base)]
        return (row is not None and base not in self.bands and (not kind or kind in self.optim_kinds)
                and row.transform == transform
                and [prefix + n for n in row.parts] == list(names))

    def write_fused(self, names: list[str], fused: torch.Tensor) -> None:
        """The whole stored tensor of one row, re-sliced for each TP rank (`Transform.rank_from_fused`)."""
        base = base_param_name(names[0])
        row = self.row_of[base]
        kind = TensorKey.parse(names[0]).kind or ""
        cut = row.transform
        self._place(kind, row, base, lambda t, n: cut.rank_from_fused(  # one range of rows: a view, no buffer
            fused, t, n, out=None if len(cut.fused_rows(t, n)) == 1 else self.memory.empty(cut.rank_shape(t, n),
                                                                                             fused.dtype)))

    def _model_dict(self, t: int, p: int, v: int, e: int) -> OrderedDict:
        """Rank (t, p, e)'s state dict of chunk v: its rows in megatron-core's module (parameter) order, each linear
        module followed by its (empty) `_extra_state`, as megatron-core's state_dict has them (the optimizer
        numbers and lays out the parameters in that order)."""
        refs = {r.key: self.refs[("", t, p, v, e, r.key)] for r in self.rows
                if (r.stage, r.chunk) == (p, v) and r.ep in (None, e)}
        out = OrderedDict()
        pending_extra = None
        for key in parameter_order(list(refs)):
            module = key.rsplit(".", 1)[0]
            if pending_extra is not None and module != pending_extra:
                out[pending_extra + "._extra_state"] = None
                pending_extra = None
            out[key] = refs[key]
            if self.extra_state and _EXTRA_STATE.fullmatch(module):
                pending_extra = module
        if pending_extra is not None:
            out[pending_extra + "._extra_state"] = None
        return out

    def _final(self, state: dict) -> tuple:
        """(args, iteration, scheduler, notes) for the rank files, from the source's state."""
        meg = state.get("megatron") or {}
        base = base_args(meg)
        divisor = vocab_divisor(self.spec.vocab, self.spec.padded_vocab, self.layout.tp) or 128
        args = args_from_spec(self.spec, self.layout, base, divisor)
        args["transformer_impl"] = self.impl
        expert_notes = []
        if self.spec.is_moe and args.get("moe_grouped_gemm") and self.experts == "sequential":
            # the rank files hold SequentialMLP's keys (local_experts.N): a run building GroupedMLP would not load them
            args["moe_grouped_gemm"] = args["moe_use_legacy_grouped_gemm"] = False
            expert_notes.append("the experts are written as SequentialMLP (local_experts.N) and the args say "
                              "moe_grouped_gemm=False; for --moe-grouped-gemm runs write --format torch_dist, "
                              "whose expert layout is the same for every expert implementation")
        iteration = self._iteration(state)
        scheduler, notes = to_megatron(state, args, 0 if iteration == "release" else iteration)
        if not self.optim_kinds:  # a schedule matters to a run that resumes its optimizer
            notes = []
        elif self.distrib:
            self._finish_distrib(args, state, notes)
        elif args.get("use_distributed_optimizer"):
            args["use_distributed_optimizer"] = False
            notes.append("the distributed optimizer's state is written as the non-distributed optimizer's "
                         f"(in the rank files; no {DISTRIB_OPTIM_FILE}): resume without "
                         "--use-distributed-optimizer, or pass --distributed-optimizer --dp N")
        args = argparse.Namespace(**args)
        args.iteration = 0 if iteration == "release" else iteration
        return args, iteration, scheduler, expert_notes + notes

    def finish_units(self, state: dict | None = None) -> dict:
        """Write this writer's rank files (their pickles, after the tensors already in them)."""
        self.pending.check_done()
        state = state or {}
        meg = state.get("megatron") or {}
        args, iteration, scheduler, _ = self._final(state)
        for (t, p, e), f in self.files.items():
            obj = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                   "iteration": 0 if iteration == "release" else iteration}
            chunks = [self._model_dict(t, p, v, e) for v in range(self.layout.vpp)]
            if self.distrib:
                self._write_distrib(t, p, e, chunks, vars(args), state, obj)
            elif self.optim_kinds:
                hyper = optimizer_hyper(state) or {}
                step = hyper.get("step") if hyper.get("step") is not None else args.iteration
                parts = self._optimizer_parts(chunks, True)  # every EP rank's file: the whole dense state
                entries = [pack([(key, tuple(ref.shape), {k: self.refs[(k, t, p, v, e, key)] for k in self.optim_kinds})
                                 for v, key, ref in params],
                                hyper if which != EXPERT else dict(hyper, param_groups=self._expert_groups(hyper)),
                                step, f.add, bare=self.weight_dtype == torch.float32) if params is not None else None
                           for which, params in parts]
                obj["optimizer"] = entries[0] if self.layout.ep == 1 else entries
            if self.layout.vpp == 1:
                obj["model"] = chunks[0]
            else:
                for v, sd in enumerate(chunks):
                    obj[f"model{v}"] = sd
            if scheduler is not None:
                obj["opt_param_scheduler"] = scheduler
            if meg.get("num_floating_point_operations_so_far") is not None:
                obj["num_floating_point_operations_so_far"] = meg["num_floating_point_operations_so_far"]
            f.finish(obj)
        return {}

    def _expert_groups(self, hyper: dict) -> list[dict]:
        """The expert optimizer's param groups, the same on every rank (megatron-core gathers the group keys over
        all ranks: a pipeline stage without MoE layers still has them, empty)."""
        return expert_groups(hyper, [(r.key, tuple(self.index[r.parts[0]].shape)) for r in self.rows
                                     if is_expert_param(r.key)])

    def _optimizer_parts(self, chunks: list[OrderedDict], with_dense: bool) -> list[tuple]:
        """[(which, [(chunk, key, ref)] in megatron-core's parameter order)] per optimizer: one (None) without expert
        parallelism; else the chained optimizer's dense (None where `with_dense` is False: distrib_optim.pt holds the
        dense buffers only in the folder of the tp rank's data-parallel rank 0, FolderPlan.dense_ep) and expert entries."""
        params = [(v, key, sd[key]) for v, sd in enumerate(chunks)
                  for key in parameter_order([k for k, ref in sd.items() if ref is not None])]
        if self.layout.ep == 1:
            return [(None, params)]
        dense = [x for x in params if not is_expert_param(x[1])] if with_dense else None
        return [(DENSE, dense), (EXPERT, [x for x in params if is_expert_param(x[1])])]

    def _write_distrib(self, t: int, p: int, e: int, chunks: list[OrderedDict], args: dict, state: dict,
                       obj: dict) -> None:
        """Rank (t, p, e)'s optimizer entry and distrib_optim.pt (for MoE the chained optimizer's two of each)."""
        hyper = optimizer_hyper(state) or {}
        step = hyper.get("step") if hyper.get("step") is not None else args["iteration"]
        dtypes = (self.weight_dtype, grad_dtype(self.weight_dtype, args))
        parts = self._optimizer_parts(chunks, e == self.plan.dense_ep[t])
        if self.layout.ep == 1:
            obj["optimizer"] = distrib_entry(hyper, step)
            self.distrib[(t, p)].finish([[(key, math.prod(ref.shape)) for c, key, ref in parts[0][1] if c == v]
                                         for v in range(self.layout.vpp)], self.dp,
                                        [distrib.bucket_size(args, p, v) for v in range(self.layout.vpp)], dtypes)
            return
        (_, dense), (_, experts) = parts
        groups = self._expert_groups(hyper)
        obj["optimizer"] = [distrib_entry(hyper, step), distrib_entry(dict(hyper, param_groups=groups), step)]
        out = TorchFileWriter(self.files[(t, p, e)].path.parent / DISTRIB_OPTIM_FILE)
        try:
            saved = [None, None]
            if dense is not None:
                saved[DENSE] = self.distrib[(t, p)].build(
                    out, [[(key, math.prod(ref.shape)) for c, key, ref in dense if c == v] for v in range(self.layout.vpp)],
                    self.dp, [distrib.bucket_size(args, p, v) for v in range(self.layout.vpp)], dtypes)
            owned = self.expert_chunks[p]
            saved[EXPERT] = self.expert_distrib[(t, p, e)].build(
                out, [[(key, math.prod(ref.shape)) for c, key, ref in experts if c == v] for v in owned],
                self.expert_dp, [distrib.bucket_size(args, p, v) for v in owned], dtypes)
            out.finish(saved)
        except BaseException:
            out.abort()
            raise

    def finish_global(self, state: dict | None, results: dict) -> None:
        """Name the iteration folder and write the tracker, once every rank file is written."""
        _, iteration, _, notes = self._final(state or {})
        self.notes += notes
        self.dir.rename(self.root / iteration_name(iteration))
        write_tracker(self.root, iteration, self.tracker_newline)

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(iter(self.weight_dtypes), torch.float32)

    def _finish_distrib(self, args: dict, state: dict, notes: list[str]) -> None:
        """The args of a distributed-optimizer run at the dp the buffers are laid out for."""
        if len(self.weight_dtypes) > 1:  # megatron-core then keeps one buffer per dtype: not laid out here
            raise InteropError(f"--distributed-optimizer: the weights have several dtypes "
                               f"({', '.join(sorted(NAME_OF_DTYPE[d] for d in self.weight_dtypes))}); "
                               f"{DISTRIB_OPTIM_FILE} is written for one (cast with --dtype)")
        args["use_distributed_optimizer"] = True
        args["data_parallel_size"] = self.dp
        args["world_size"] = self.layout.tp * self.layout.pp * self.dp
        if self.weight_dtype == torch.bfloat16 and not args.get("grad_reduce_in_bf16"):
            args["accumulate_allreduce_grads_in_fp32"] = True  # as Megatron-LM's --bf16 sets it
        if "fp32_param" not in self.optim_kinds and self.weight_dtype != torch.float32:
            notes.append(f"the source has no fp32 master weights: {DISTRIB_OPTIM_FILE}'s masters are the "
                              f"{NAME_OF_DTYPE[self.weight_dtype]} weights")
        buckets = {distrib.bucket_size(args, p, v) for p in range(self.layout.pp) for v in range(self.layout.vpp)}
        notes.append(f"the optimizer state is written as the distributed optimizer's ({DISTRIB_OPTIM_FILE}) "
                          f"for dp {self.dp}, " + ("one bucket per model chunk" if buckets == {None} else
                                                   f"buckets of {max(b for b in buckets if b)} elements")
                          + ": resume at that dp with --use-distributed-optimizer")

    def abort(self) -> None:
        for f in [*self.distrib.values(), *self.expert_distrib.values()]:
            f.close()
        for f in self.files.values():
            f.abort()
