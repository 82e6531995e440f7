"""Canonical tensors -> MindSpore rank files (see `files` for where they go)."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ...contract import BaseWriter
from ...errors import InteropError
from ...io.ms_ckpt import CkptWriter
from ...layout import ParallelLayout
from ...mappings.mindspore_names import LOCAL_EXPERTS
from ...params import TensorKey, param_index
from ...rows import RowCollector
from ...spec import ModelSpec, padded_to_tp
from ...tensors import TensorMeta
from . import lora, pt_meta
from .files import SIDECAR
from .dialects import DIALECTS, dialect_named
from .scalars import state_to_scalars
from .strategy import stage_strategy

FORMAT = "mindspore"
_LAYER_TAG = re.compile(r"\blayers\.(\d+)\.")


class Writer(BaseWriter):
    """Writes one dialect's files, a global canonical tensor at a time, cut into TP/PP shards.

    mindspeed: the layout MindSpeed-Core-MS training loads (`rank_{r}/network.ckpt`, the model's own
    parameter names, step/epoch/optimizer/scheduler scalars as convert_pt2ckpt.py writes them), any
    tp/pp/vpp, and `pt_meta/` for its reverse converter; `dp` numbers the folders like the run's
    data-parallel size (cp folded in).
    mindformers: `qkv_layout` "grouped" (r1.5.0 and later, the default) or "plain" (r1.3.0) for qkv_concat.
    `mindspore_model.json` (spec, layout, state) is an extra for interop; no reader needs it.
    """

    options = ("dialect", "qkv_concat", "qkv_layout", "qkv_bias_layout", "dp", "noop_layers")
    holds_adapter = True  # a LoRA adapter goes to MindFormers' names (`lora.Writer`)
    splits = True
    holds_moe = True  # routed (and, MindFormers, shared) experts: mappings.mindspore_names MOE_TABLES
    padded_vocab = staticmethod(padded_to_tp)

    @classmethod
    def vocab_rows(cls, spec: ModelSpec, tp: int, options: dict) -> int:
        """The dialect's rows (`Dialect.vocab_rows`): MindFormers keeps an embedding tp does not divide whole."""
        return dialect_named(options.get("dialect") or "mindspeed").vocab_rows(spec, tp)

    def __new__(cls, root, spec, layout, metas, dialect: str | None = None, qkv_concat: bool = False,
                qkv_layout: str | None = None, qkv_bias_layout: str | None = None, dp: int | None = None, only=None,
                adapter=None, noop_layers: str | None = None):
        if adapter is None:
            return super().__new__(cls)
        if qkv_concat or qkv_layout or qkv_bias_layout or dp or noop_layers:
            raise InteropError("MindSpore LoRA adapters are written as MindFormers' LoRA models name them "
                               "(--dialect mindformers or mindformers-mcore, without --qkv-concat, --qkv-layout or --dp)")
        return lora.Writer(root, spec, layout, metas, adapter, dialect or "mindformers")

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta],
                 dialect: str | None = None, qkv_concat: bool = False, qkv_layout: str | None = None,
                 qkv_bias_layout: str | None = None, dp: int | None = None, only=None, adapter=None,
                 noop_layers: str | None = None):
        """`only`: the (tp, pp) ranks (`units`; each with its ep ranks' files) to write, for a conversion split
        over processes (`interop.workers`); None: all of them."""
        dialect = dialect_named(dialect or "mindspeed")
        if not dialect.virtual_chunks and layout.vpp > 1:
            raise InteropError(f"{dialect.title} checkpoints are written without virtual pipeline chunks: use --vpp 1")
        if not dialect.fuses_qkv and qkv_concat:
            raise InteropError(f"--qkv-concat applies to --dialect {_those(lambda d: d.fuses_qkv)} only")
        if not qkv_concat and (qkv_layout or qkv_bias_layout):
            raise InteropError("--qkv-layout / --qkv-bias-layout describe the written w_qkv (--qkv-concat); "
                               "a MindSpore source's layout is --src-qkv-layout / --src-qkv-bias-layout")
        if not dialect.dp_folders and dp is not None:
            raise InteropError(f"--dp numbers MindSpeed rank folders: it applies to --dialect "
                               f"{_those(lambda d: d.dp_folders)} only")
        if dp is not None and dp < 1:
            raise InteropError(f"--dp must be >= 1, got {dp}")
        qkv_layout = qkv_layout or "grouped"
        if qkv_concat and "plain" in (qkv_layout, qkv_bias_layout) and layout.tp > 1:
            raise InteropError("a plainly joined w_qkv ([q; k; v], MindFormers r1.3) is split by rows across tp "
                               "ranks, not per head: write it at --tp 1 (reshard with transform_checkpoints)")
        spec.check_tp(layout.tp)
        if layout.ep > 1 and not (dialect.expert_parallel or dialect.ep_cuts_expert_rows):
            raise InteropError(f"{dialect.title} MoE output is written at --ep 1 (all experts in each rank file, "
                               f"as MindFormers holds them at expert_parallel 1; transform_checkpoints reshards them "
                               f"for an expert-parallel run), not --ep {layout.ep}")
        if layout.ep > 1 and (dp or layout.ep) % layout.ep:
            raise InteropError(f"--dp {dp} is no multiple of --ep {layout.ep}: MindSpeed's expert-parallel ranks "
                               "are data-parallel ranks")
        self.root, self.spec, self.layout = Path(root), spec, layout
        self.dialect, self.qkv_concat, self.dp = dialect, bool(qkv_concat), dp or dialect.rank_files(layout)
        self.qkv_layout = qkv_layout if qkv_concat else None
        self.qkv_bias_layout = qkv_bias_layout if qkv_concat else None
        if noop_layers and not dialect.noop_positions:
            raise InteropError(f"--noop-layers applies to --dialect {_those(lambda d: d.noop_positions)} only")
        # MindSpeed's noop layers: each layer's position among num_layers + len(noop), the noop ones left out
        self.noop = noop_layout(spec, layout, noop_layers) if noop_layers else None
        self.rows = dialect.rows(spec, qkv_concat, qkv_layout, qkv_bias_layout, layout.tp)
        self.index = param_index(spec)
        self.row_of = {p: row for row in self.rows for p in row.parts}
        self.first_part = {row.key: row.parts[0] for row in self.rows}
        # LayerNorm / position-embedding tensors also under convert_pt2ckpt.py's names, which its reverse
        # convert_ckpt2pt.py reads (MindSpeed's loader skips unknown names with a warning); a few KB.
        self.copies = dialect.converter_names(self.rows, spec)
        self.prefixes = dialect.moments
        self.metas = metas
        self.masters = any(TensorKey.parse(m.name).is_master for m in metas)
        self.notes: list[str] = dialect.weight_notes(spec, self.masters)
        self.pending = RowCollector()
        # {(tp rank, stage, expert-parallel rank): its file}; ep ranks are the first data-parallel ranks
        self.files: dict[tuple[int, int, int], CkptWriter] = {}
        self.units = layout.ranks()
        self.owned = {(t, p) for t, p in self.units if only is None or (t, p) in only}
        for t, p in layout.ranks():
            if (t, p) not in self.owned:
                continue
            for d in range(dialect.rank_files(layout)):
                path = self._path(t, p, d)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.files[(t, p, d)] = CkptWriter(path)

    def _path(self, t: int, p: int, d: int) -> Path:
        return self.dialect.file(self.root, t, p, self.layout, self.dp, d)

    def _targets(self, param, ms_name: str, transform, t: int) -> list[tuple[int, str, tuple[int, int] | None]]:
        """[(data-parallel rank, name, the stored tensor's rows it holds or None: all)] a tensor of tp rank t goes
        to: every rank's file; MindSpeed: an expert's own ep rank's with its local number (moe_layer.py:
        local_expert_indices = ep_rank * num_local_experts + i; experts.py numbers them from 0); MindFormers: the
        rows of the experts of each file's ep coordinate (`Dialect.rank_files`)."""
        ep, files = self.layout.ep, self.dialect.rank_files(self.layout)
        if ep > 1 and transform.every_expert and self.dialect.ep_cuts_expert_rows:
            return [(d, ms_name, transform.ep_rows((d * self.layout.tp + t) % ep, ep)) for d in range(files)]
        if param.expert is None or ep == 1:
            return [(d, ms_name, None) for d in range(files)]
        per = self.spec.num_experts // ep
        local = ms_name.replace(f"{LOCAL_EXPERTS}{param.expert}.", f"{LOCAL_EXPERTS}{param.expert % per}.")
        return [(param.expert // per, local, None)]

    def _split(self, name: str) -> tuple[str, str]:
        for prefix, native in self.prefixes.items():
            if name.startswith(prefix):
                return native, name[len(prefix):]
        return "", name

    def wants(self, name: str) -> bool:
        """Whether `write(name)` would put anything into this writer's files."""
        key = TensorKey.parse(name)
        if key.is_master:
            if not self.dialect.masters_as_weights:
                return False
            name = key.param
        elif self.masters and self.dialect.masters_as_weights and not key.is_optim:
            return False
        canonical = self._split(name)[1]
        stages = {self.layout.stage_of(self.index[canonical])}
        if self._tied_head_copied(canonical):
            stages.add(self.layout.pp - 1)
        return any((t, p) in self.owned for t in range(self.layout.tp) for p in stages)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        name = self._weight_name(name)
        if name is None:
            return
        native_prefix, canonical = self._split(name)
        row = self.row_of[canonical]
        ms_name, transform, parts = row.key, row.transform, row.parts
        tensors = self.pending.add(native_prefix + ms_name, parts, canonical, tensor)
        if tensors is None:
            return
        self._emit(native_prefix + ms_name, transform, tensors)
        if self._tied_head_copied(canonical):
            # the last stage's output_layer is the tied embedding's copy (its moments too); Megatron's name
            # for it as well, which convert_pt2ckpt.py passes through and convert_ckpt2pt.py reads back
            for head in self.dialect.tied_heads:
                self._emit(native_prefix + head, transform, tensors, stage=self.layout.pp - 1)

    def _tied_head_copied(self, canonical: str) -> bool:
        """Whether the last stage also stores `canonical` as the tied head's copy (the dialect's `tied_heads`)."""
        return (self.dialect.writes_tied_head and canonical == "embed.word.weight" and self.spec.tied_embeddings
                and self.layout.pp > 1)

    def _weight_name(self, name: str) -> str | None:
        """The name `write` files `name` under (a master copy under its weight's), or None when it drops it."""
        key = TensorKey.parse(name)
        if key.is_master:
            return key.param if self.dialect.masters_as_weights else None
        if self.masters and self.dialect.masters_as_weights and not key.is_optim:
            return None  # the master copy stands for it
        return name

    def accepts_fused(self, names: list[str], transform) -> bool:
        """Whether `names` are one of our rows, in its order, stored by an equal transform
        (`interop.engine.fused_plan`: then the whole stored tensor comes to `write_fused`)."""
        name = self._weight_name(names[0])
        if name is None:
            return False
        canonical = self._split(name)[1]
        row = self.row_of.get(canonical)
        prefix = name[:len(name) - len(canonical)]
        return (row is not None and row.transform == transform and [prefix + p for p in row.parts] ==
                [self._weight_name(n) for n in names])

    def write_fused(self, names: list[str], fused: torch.Tensor) -> None:
        """One row's whole stored tensor, re-sliced for each TP rank (`Transform.rank_from_fused`)."""
        native_prefix, canonical = self._split(self._weight_name(names[0]))
        row = self.row_of[canonical]
        ms_name, transform = row.key, row.transform
        self._emit(native_prefix + ms_name, transform, rank_of=lambda t, tp: transform.rank_from_fused(fused, t, tp))

    def _emit(self, ms_name: str, transform, parts: list[torch.Tensor] | None = None, stage: int | None = None,
              rank_of=None) -> None:
        """Each TP rank's stored tensor (the transform's, from the parts or `rank_of(t, tp)`), appended to the
        stage's files."""
        first = self.index[self._canonical_of(ms_name)]
        stage = self.layout.stage_of(first) if stage is None else stage
        tp = self.layout.tp
        for t in range(tp):
            if (t, stage) not in self.owned:
                continue
            fused = transform.to_rank(parts, t, tp) if rank_of is None else rank_of(t, tp)
            native, base = self._native_split(ms_name)
            for d, name, rows in self._targets(first, ms_name, transform, t):
                held = fused if rows is None else fused[rows[0]:rows[1]]
                self.files[(t, stage, d)].write(self._at_position(name, first), held)
                if base in self.copies:
                    self.files[(t, stage, d)].write(self._at_position(native + self.copies[base], first), fused)

    def _at_position(self, name: str, param) -> str:
        """`name` with its layer number the layer's position, where noop layers are written."""
        if self.noop is None or param.layer is None:
            return name
        return _LAYER_TAG.sub(f"layers.{self.noop.positions[param.layer]}.", name, count=1)

    def _copy_for_other_dp_ranks(self) -> None:
        """With experts split over ep ranks, a data-parallel rank d >= ep without its folder would load the dp-0
        folder (training.py), ep rank 0's experts: give each such rank of ep rank d % ep > 0 its copy."""
        ep = self.layout.ep
        extra = [(t, p, d) for t, p in self.layout.ranks() for d in range(ep, self.dp) if d % ep] if ep > 1 else []
        for t, p, d in extra:
            path = self._path(t, p, d)
            path.parent.mkdir(parents=True)
            shutil.copyfile(self._path(t, p, d % ep), path)
        if extra:
            self.notes.append(f"copied expert-parallel ranks' files for {len(extra)} data-parallel ranks beyond "
                              f"ep={ep} (MindSpeed would give them dp rank 0's folder, ep rank 0's experts)")

    def _native_split(self, ms_name: str) -> tuple[str, str]:
        for native in self.prefixes.values():
            if ms_name.startswith(native):
                return native, ms_name[len(native):]
        return "", ms_name

    def _canonical_of(self, ms_name: str) -> str:
        """The first canonical part of a MindSpore name (moment prefixes and the tied head included)."""
        ms_name = self._native_split(ms_name)[1]
        if ms_name in self.dialect.tied_heads and ms_name not in self.first_part:
            return "embed.word.weight"
        return self.first_part[ms_name]

    def finish_units(self, state: dict | None = None) -> dict:
        """Close this writer's rank files (MindSpeed's: after the step/epoch/optimizer scalars)."""
        state = dict(state or {})
        self.pending.check_done(f"{self.root}: ")
        if self.dialect.scalars:
            scalars, notes = state_to_scalars(state)
            self.notes += [n for n in notes if n not in self.notes]
            for writer in self.files.values():
                for tag, value in scalars.items():
                    writer.write(tag, value)
        for writer in self.files.values():
            writer.close()
        return {}

    def finish_global(self, state: dict | None, results: dict) -> None:
        """The files describing all ranks (pt_meta/, MindFormers' strategy files, interop's sidecar), and copies
        of expert-parallel ranks' files, once every rank file is closed."""
        state = dict(state or {})
        if self.dialect.scalars:  # the scalars' notes (a writer split over processes wrote none itself)
            self.notes += [n for n in state_to_scalars(state)[1] if n not in self.notes]
        if self.dialect.pt_meta:
            if self.spec.is_moe:
                self.notes.append("pt_meta/ not written: MindSpeed's convert_ckpt2pt.py (r0.1.0) converts no "
                                  "MoE model back")
            else:
                self.notes += pt_meta.write(self.root, self.spec, self.layout, self.rows, self.copies, state,
                                            self.noop)
        self._copy_for_other_dp_ranks()
        files = self.dialect.rank_files(self.layout)
        if self.dialect.strategy and self.layout.tp * self.layout.pp * files > 1:
            (self.root / "strategy").mkdir()
            for p in range(self.layout.pp):
                strategy = stage_strategy(self.spec, self.layout, self.rows, p, dp=files,
                                          ep_rows=self.dialect.ep_cuts_expert_rows)
                (self.root / "strategy" / f"strategy_stage{p}.json").write_text(json.dumps(strategy, indent=1))
        if self.dialect.layout_note(self.spec):
            self.notes.append(self.dialect.layout_note(self.spec))
        if self.qkv_concat:
            self.notes.append(f"w_qkv / w_gate_hidden written {self.qkv_layout} "
                              f"({'MindFormers r1.3' if self.qkv_layout == 'plain' else 'MindFormers r1.5 and later'}"
                              f"{', biases ' + self.qkv_bias_layout if self.qkv_bias_layout else ''})")
        sidecar = {"format": FORMAT, "dialect": self.dialect.name, "qkv_concat": self.qkv_concat,
                   "qkv_layout": self.qkv_layout, "qkv_bias_layout": self.qkv_bias_layout, "dp": self.dp,
                   "spec": self.spec.to_dict(), "layout": self.layout.to_dict(), "state": state}
        if self.noop is not None:
            sidecar["noop_layers"] = self.noop.noop
        (self.root / SIDECAR).write_text(json.dumps(sidecar, indent=1) + "\n")

    def abort(self) -> None:
        for writer in self.files.values():
            writer.abort()


@dataclass(frozen=True)
class NoopLayout:
    """Where MindSpeed's noop layers sit: `noop` positions among `total` (= the real layers + the noop ones),
    `positions[i]` the position of real layer i."""
    total: int
    noop: list[int]
    positions: list[int]


def noop_layout(spec: ModelSpec, layout: ParallelLayout, text: str) -> NoopLayout:
    """--noop-layers "62,63": MindSpeed-Core-MS splits all positions evenly over pp x vpp chunks with noop layers
    (br_master training/arguments.py 367-374; legacy/model/utils.py get_num_layer_list, get_layers_and_offset:
    chunk (p, v) is run v * pp + p), its noop positions without weights (transformer.py 1633); each chunk must
    then hold as many real layers as the layout gives it."""
    try:
        noop = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise InteropError(f"--noop-layers {text!r}: expected layer positions such as 62,63") from None
    total = spec.num_layers + len(noop)
    chunks = layout.pp * layout.vpp
    if not noop or noop[0] < 0 or noop[-1] >= total:
        raise InteropError(f"--noop-layers {text!r}: positions among the {total} layers (the model's "
                           f"{spec.num_layers} and the noop ones), from 0")
    if total % chunks:
        raise InteropError(f"--noop-layers {text!r}: {total} layers do not split evenly over pp={layout.pp} x "
                           f"vpp={layout.vpp} (MindSpeed splits them evenly with noop layers)")
    per = total // chunks
    positions, want, have = [], [], []
    for v in range(layout.vpp):
        for p in range(layout.pp):
            c = v * layout.pp + p
            real = [i for i in range(c * per, (c + 1) * per) if i not in noop]
            start, stop = layout.stages[p][v]
            want.append(len(real))
            have.append(stop - start)
            positions += real
    if want != have:
        raise InteropError(f"--noop-layers {text!r} leaves {','.join(map(str, want))} real layers per pipeline "
                           f"chunk, the layout {','.join(map(str, have))}: give the split that matches "
                           "(--first-stage-layers / --last-stage-layers)")
    # positions were listed chunk by chunk in Megatron's order (v, then p), which is the canonical layer order
    return NoopLayout(total, noop, positions)


def _those(has) -> str:
    """The names of the dialects with a capability, for a refusal."""
    return ", ".join(d.name for d in DIALECTS.values() if has(d))
