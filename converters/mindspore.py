"""MindSpore `.ckpt` checkpoints (MindSpeed-Core-MS or MindFormers names) <-> canonical tensors.

Two dialects (name tables in `interop.mappings.mindspore_names`):

  mindspeed     Megatron's folder layout, `iter_{:07d}/mp_rank_TT[_PPP]/model_optim_rng.ckpt`
                (or `release/`), one file per (tp, pp) rank, Adam moments as `exp_avg.<name>`.
  mindformers   one `model.ckpt`, or with tp/pp > 1 `rank_N/checkpoint_N.ckpt` (N = stage * tp
                + tp rank) plus `strategy/` JSON files whose `dev_matrix` / `tensor_map` say how
                each parameter is split, as `mindspore.transform_checkpoints` reads them.

A `.ckpt` carries no model description, so the writer adds `mindspore_model.json`
(spec, layout, dialect, training state); a checkpoint without it is read with
`model_config` (a HF config.json or such a JSON).  Files are written and read
with `interop.io.ms_ckpt`: no mindspore needed, one tensor at a time.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import InteropError
from ..fused import deinterleave_rows, fuse_qkv_grouped, interleave_rows, split_qkv_grouped
from ..io.ms_ckpt import CkptFile, CkptWriter
from ..io.small_files import read_json_object
from ..layout import ParallelLayout
from ..mappings.mindspore_names import (DIALECT_MARKERS, DIALECTS, IGNORED_SUFFIXES, MINDSPEED_TIED_HEAD,
                                        OPTIM_PREFIXES, TABLES)
from ..params import param_index, param_table
from ..shards import shard_box
from ..spec import ModelSpec
from ..tensors import Source, TensorMeta

SIDECAR = "mindspore_model.json"
FORMAT = "mindspore"
TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.ckpt"
SINGLE_FILE = "model.ckpt"


# ---------------------------------------------------------------- names and fused layouts

def ms_rows(spec: ModelSpec, dialect: str, qkv_concat: bool = False) -> list[tuple[str, str, list[str]]]:
    """The dialect's name table expanded for this model: (MindSpore name, kind, canonical parts)."""
    key = (dialect, spec.arch, bool(qkv_concat))
    if key not in TABLES:
        raise InteropError(f"no MindSpore name table for dialect {dialect!r}, arch {spec.arch!r}"
                           f"{' with qkv_concat' if qkv_concat else ''}")
    present = param_index(spec)
    rows, taken = [], set()
    for ms_name, kind, parts in TABLES[key]:
        for i in (range(spec.num_layers) if "{i}" in ms_name else [None]):
            name, names = ms_name.format(i=i), [p.format(i=i) for p in parts]
            if name not in taken and all(n in present for n in names):
                rows.append((name, kind, names))
                taken.add(name)
    return rows


def fuse(kind: str, parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """One MindSpore tensor (or one TP rank's shard of it) from its canonical parts (or their shards)."""
    if kind == "qkv":
        return fuse_qkv_grouped(*parts, groups)
    if kind == "interleave":
        return interleave_rows(*parts)
    if kind == "t":
        return parts[0].t().contiguous()
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # copy, gate_up


def unfuse(kind: str, tensor: torch.Tensor, sizes: list[int], groups: int, heads: int, head_dim: int):
    """Inverse of `fuse`: the canonical parts (rows `sizes`) of one tensor or shard."""
    if kind == "qkv":
        return list(split_qkv_grouped(tensor, groups, heads, head_dim))
    if kind == "interleave":
        return list(deinterleave_rows(tensor))
    if kind == "t":
        return [tensor.t().contiguous()]
    if len(sizes) == 1:
        return [tensor]
    return [p.contiguous() for p in torch.split(tensor, sizes, dim=0)]


def _native_axis(kind: str, axis: int | None) -> int | None:
    return None if axis is None else (1 - axis if kind == "t" else axis)


# ---------------------------------------------------------------- files on disk

def mindspeed_file(root: Path, folder: str, t: int, p: int, pp: int) -> Path:
    rank = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    return root / folder / rank / RANK_FILE


def mindformers_file(root: Path, t: int, p: int, tp: int, pp: int) -> Path:
    if tp == 1 and pp == 1:
        return root / SINGLE_FILE
    r = p * tp + t
    return root / f"rank_{r}" / f"checkpoint_{r}.ckpt"


def _iteration_folder(state: dict) -> str:
    it = state.get("iteration")
    return f"iter_{int(it):07d}" if isinstance(it, int) else "release"


def detect(path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.suffix == ".ckpt"
    if (path / SIDECAR).is_file():
        return True
    return any(path.glob("*.ckpt")) or any(path.glob("rank_*/*.ckpt")) or any(path.glob("*/mp_rank_*/*.ckpt"))


def _strategy(spec: ModelSpec, layout: ParallelLayout, rows, stage: int) -> dict:
    """MindSpore's JSON strategy for one pipeline stage: dev_matrix [tp], tensor_map per dim.

    tensor_map counts devices from the right of dev_matrix: 0 = split over tp, -1 = whole.
    """
    index = param_index(spec)
    items = {}
    for name, kind, parts in rows:
        param = index[parts[0]]
        if layout.stage_of(param) != stage:
            continue
        ndim = len(param.shape)
        axis = _native_axis(kind, param.axis)
        tensor_map = [0 if (d == axis and layout.tp > 1) else -1 for d in range(ndim)]
        items[name] = {"field": 0, "opt_weight_shard_size": 0, "opt_weight_shard_step": 0,
                       "dev_matrix": [layout.tp], "tensor_map": tensor_map, "param_split_shape": [],
                       "indices_offset": []}
    return {"current_stage": stage, "parallel_strategy_item": {"interop": {"stage": stage}},
            "parallel_layout_item": items}


# ---------------------------------------------------------------- writer

class Writer:
    """Writes one dialect's files, a global canonical tensor at a time, cut into TP/PP shards."""

    @staticmethod
    def padded_vocab(spec: ModelSpec, tp: int) -> int:
        """Keep the source's padding when tp divides it; otherwise the true vocab rounded up to tp."""
        if spec.padded_vocab % tp == 0:
            return spec.padded_vocab
        return -(-spec.vocab // tp) * tp

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta],
                 dialect: str | None = None, qkv_concat: bool = False):
        dialect = dialect or "mindspeed"
        if dialect not in DIALECTS:
            raise InteropError(f"unknown MindSpore dialect {dialect!r} (known: {', '.join(DIALECTS)})")
        if layout.vpp > 1:
            raise InteropError("MindSpore checkpoints have no virtual pipeline chunks: use --vpp 1")
        spec.check_tp(layout.tp)
        self.root, self.spec, self.layout = Path(root), spec, layout
        self.dialect, self.qkv_concat = dialect, bool(qkv_concat)
        self.rows = ms_rows(spec, dialect, qkv_concat)
        self.index = param_index(spec)
        self.row_of = {p: row for row in self.rows for p in row[2]}
        self.first_part = {name: parts[0] for name, _, parts in self.rows}
        self.prefixes = OPTIM_PREFIXES[dialect]
        self.metas = metas
        self.pending: dict[str, dict] = {}
        self.files: dict[tuple[int, int], CkptWriter] = {}
        for t, p in layout.ranks():
            path = self._path(t, p)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.files[(t, p)] = CkptWriter(path)

    def _path(self, t: int, p: int) -> Path:
        if self.dialect == "mindspeed":
            # the iteration is known only at finish(): write under a placeholder folder, rename then
            return mindspeed_file(self.root, ".partial", t, p, self.layout.pp)
        return mindformers_file(self.root, t, p, self.layout.tp, self.layout.pp)

    def _split(self, name: str) -> tuple[str, str]:
        for prefix, native in self.prefixes.items():
            if name.startswith(prefix):
                return native, name[len(prefix):]
        return "", name

    def write(self, name: str, tensor: torch.Tensor) -> None:
        native_prefix, canonical = self._split(name)
        ms_name, kind, parts = self.row_of[canonical]
        got = self.pending.setdefault(native_prefix + ms_name, {})
        got[canonical] = tensor
        if len(got) < len(parts):
            return
        del self.pending[native_prefix + ms_name]
        self._emit(native_prefix + ms_name, kind, [got[p] for p in parts])
        if (self.dialect == "mindspeed" and not native_prefix and canonical == "embed.word.weight"
                and self.spec.tied_embeddings and self.layout.pp > 1):
            self._emit(MINDSPEED_TIED_HEAD, kind, [got[canonical]], stage=self.layout.pp - 1)

    def _emit(self, ms_name: str, kind: str, parts: list[torch.Tensor], stage: int | None = None) -> None:
        """Cut the parts into TP shards, fuse each rank's shards, append them to the stage's files."""
        first = self.index[self._canonical_of(ms_name)]
        stage = self.layout.stage_of(first) if stage is None else stage
        tp = self.layout.tp
        for t in range(tp):
            shards = [part[shard_box(tuple(part.shape), first.axis, t, tp).slices()] for part in parts]
            self.files[(t, stage)].write(ms_name, fuse(kind, shards, self.spec.kv_groups // tp))

    def _canonical_of(self, ms_name: str) -> str:
        """The first canonical part of a MindSpore name (moment prefixes and the tied head included)."""
        for native in self.prefixes.values():
            if ms_name.startswith(native):
                ms_name = ms_name[len(native):]
        if ms_name == MINDSPEED_TIED_HEAD:
            return "embed.word.weight"
        return self.first_part[ms_name]

    def finish(self, state: dict | None = None) -> None:
        state = dict(state or {})
        if self.pending:
            raise InteropError(f"{self.root}: fused tensors left incomplete: {sorted(self.pending)[:3]}")
        for writer in self.files.values():
            writer.close()
        if self.dialect == "mindspeed":
            folder = _iteration_folder(state)
            (self.root / ".partial").rename(self.root / folder)
            (self.root / TRACKER).write_text(str(int(state["iteration"])) if folder != "release" else "release")
        elif self.layout.tp * self.layout.pp > 1:
            (self.root / "strategy").mkdir()
            for p in range(self.layout.pp):
                strategy = _strategy(self.spec, self.layout, self.rows, p)
                (self.root / "strategy" / f"strategy_stage{p}.json").write_text(json.dumps(strategy, indent=1))
        sidecar = {"format": FORMAT, "dialect": self.dialect, "qkv_concat": self.qkv_concat,
                   "spec": self.spec.to_dict(), "layout": self.layout.to_dict(), "state": state}
        (self.root / SIDECAR).write_text(json.dumps(sidecar, indent=1) + "\n")

    def abort(self) -> None:
        for writer in self.files.values():
            writer.abort()


# ---------------------------------------------------------------- reader

_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_RANK = re.compile(r"^rank_(\d+)$")


def _load_json(path: Path, what: str) -> dict:
    return read_json_object(path, what)


def _find_files(path: Path, sidecar: dict | None) -> tuple[dict[tuple[int, int], Path], int, int]:
    """{(tp rank, stage): file}, tp, pp for a single file, a mindspeed tree or rank_N folders."""
    if path.is_file():
        return {(0, 0): path}, 1, 1
    tracker = path / TRACKER
    if tracker.is_file() or any(path.glob("*/mp_rank_*")):
        if tracker.is_file():
            it = tracker.read_text(errors="replace").strip()  # damaged: the error below, not a traceback
            folder = "release" if it == "release" else (f"iter_{int(it):07d}" if it.isdigit() else None)
            if folder is None:
                raise InteropError(f"{tracker}: expected an iteration number or 'release', found {it!r}")
        else:
            folders = sorted({p.parent.name for p in path.glob("*/mp_rank_*")})
            if len(folders) != 1:
                raise InteropError(f"{path}: several iterations ({', '.join(folders)}) and no {TRACKER}")
            folder = folders[0]
        ranks = {}
        for d in sorted((path / folder).glob("mp_rank_*")):
            m = _MP_RANK.match(d.name)
            if m:
                ranks[(int(m.group(1)), int(m.group(2) or 0))] = d / RANK_FILE
        if not ranks:
            raise InteropError(f"{path / folder}: no mp_rank_* folders")
        tp, pp = max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1
    elif any(path.glob("rank_*")):
        if sidecar is None:
            raise InteropError(f"{path}: rank_N folders without {SIDECAR}: cannot tell tp from pp")
        layout = sidecar["layout"]
        tp, pp = int(layout["tp"]), int(layout["pp"])
        ranks = {}
        for d in path.glob("rank_*"):
            m = _RANK.match(d.name)
            if m:
                r = int(m.group(1))
                files = sorted(d.glob("*.ckpt"))
                if len(files) != 1:
                    raise InteropError(f"{d}: expected one .ckpt file, found {len(files)}")
                ranks[(r % tp, r // tp)] = files[0]
    else:
        files = sorted(path.glob("*.ckpt"))
        if len(files) != 1:
            raise InteropError(f"{path}: expected one .ckpt file (or rank folders), found {len(files)}")
        return {(0, 0): files[0]}, 1, 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks or not ranks[(t, p)].is_file()]
    if missing:
        t, p = missing[0]
        raise InteropError(f"{path}: the checkpoint of tp rank {t}, stage {p} is missing "
                           f"({len(missing)} of {tp * pp} rank files)")
    return ranks, tp, pp


def _spec_from_config(path, dtype: str) -> ModelSpec:
    from ..mappings.hf_config import spec_from_hf_config
    data = _load_json(Path(path), "model config")
    if "spec" in data:
        return ModelSpec.from_dict(data["spec"], where=str(path))
    return spec_from_hf_config(data, dtype, where=str(path))


class Reader:
    """Reads every rank file of a MindSpore checkpoint and hands out global canonical tensors."""

    def __init__(self, path, model_config=None):
        path = Path(path)
        if not path.exists():
            raise InteropError(f"{path}: no such file or directory")
        root = path.parent if path.is_file() else path
        sidecar = _load_json(root / SIDECAR, "MindSpore model description") if (root / SIDECAR).is_file() else None
        if sidecar is not None and sidecar.get("format") != FORMAT:
            raise InteropError(f"{root / SIDECAR}: format is {sidecar.get('format')!r}, expected {FORMAT!r}")
        paths, tp, pp = _find_files(path, sidecar)
        self.files = {}
        try:
            for key, p in sorted(paths.items()):
                self.files[key] = CkptFile(p)
            self._describe(path, sidecar, model_config, tp, pp)
        except BaseException:
            self.close()
            raise

    def _describe(self, path: Path, sidecar, model_config, tp: int, pp: int) -> None:
        first = self.files[(0, 0)]
        tags = first.keys()
        float_dtypes = [first.meta(k)[0] for k in tags if first.meta(k)[0] is not None and first.meta(k)[0].is_floating_point]
        dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(float_dtypes[0] if float_dtypes else None,
                                                                           "float32")
        if model_config is not None:
            spec = _spec_from_config(model_config, dtype)
        elif sidecar is not None:
            spec = ModelSpec.from_dict(sidecar["spec"])
        else:
            raise InteropError(f"{path}: a bare MindSpore checkpoint carries no model description; "
                               "pass --model-config (a HF config.json)")
        dialect = (sidecar or {}).get("dialect") or _guess_dialect(tags, path)
        if dialect not in DIALECTS:
            raise InteropError(f"unknown MindSpore dialect {dialect!r} (known: {', '.join(DIALECTS)})")
        qkv_concat = bool((sidecar or {}).get("qkv_concat", any(".w_qkv." in t for t in tags)))
        if sidecar is not None and "layout" in sidecar:
            layout = ParallelLayout.from_dict(sidecar["layout"])
            if (layout.tp, layout.pp) != (tp, pp):
                raise InteropError(f"{path}: {SIDECAR} says tp={layout.tp} pp={layout.pp}, "
                                   f"the files are tp={tp} pp={pp}")
        else:
            layout = ParallelLayout.build(spec.num_layers, tp, pp)
        self.rows = ms_rows(spec, dialect, qkv_concat)
        embed = self.rows[0][0]
        if embed not in first:
            raise InteropError(f"{first.path}: no {embed}: not a {dialect} {spec.arch} checkpoint "
                               f"(found e.g. {tags[0] if tags else 'nothing'})")
        rows = first.meta(embed)[1][0] * tp
        if rows != spec.padded_vocab:
            if rows < spec.vocab:
                raise InteropError(f"{first.path}: {embed} has {rows} rows, fewer than the vocabulary ({spec.vocab})")
            spec = spec.replace(padded_vocab=rows)
        self.spec, self.layout, self.dialect = spec, layout, dialect
        self.index = param_index(spec)
        self.prefixes = OPTIM_PREFIXES[dialect]
        self.row_of = {p: row for row in self.rows for p in row[2]}
        notes = self._check(path)
        self.source = Source(spec, layout, state=(sidecar or {}).get("state") or {}, notes=notes)
        self._cached = (None, None)

    def _local_shape(self, kind: str, parts: list[str]) -> tuple[int, ...]:
        tp = self.layout.tp
        shapes = [shard_box(self.index[p].shape, self.index[p].axis, 0, tp).shape for p in parts]
        shape = (sum(s[0] for s in shapes),) + shapes[0][1:]
        return tuple(reversed(shape)) if kind == "t" else shape

    def _check(self, path: Path) -> list[str]:
        """Every expected tensor present with its shard's shape; anything else is an error or noted."""
        expected: dict[tuple[int, int], dict[str, tuple]] = {key: {} for key in self.files}
        optional: dict[tuple[int, int], set] = {key: set() for key in self.files}
        for name, kind, parts in self.rows:
            stage = self.layout.stage_of(self.index[parts[0]])
            shape = self._local_shape(kind, parts)
            for t in range(self.layout.tp):
                expected[(t, stage)][name] = shape
                optional[(t, stage)].update(native + name for native in self.prefixes.values())
        if self.dialect == "mindspeed" and self.spec.tied_embeddings:
            for t in range(self.layout.tp):
                optional[(t, self.layout.pp - 1)].add(MINDSPEED_TIED_HEAD)
        scalars, buffers, self.optim = set(), set(), True
        for key, f in self.files.items():
            for name, shape in expected[key].items():
                if name not in f:
                    raise InteropError(f"{f.path}: tensor {name} is missing (a {self.dialect} {self.spec.arch} "
                                       f"model with {self.spec.num_layers} layers at tp={self.layout.tp} "
                                       f"pp={self.layout.pp})")
                if f.meta(name)[1] != shape:
                    raise InteropError(f"{f.path}: {name} has shape {list(f.meta(name)[1])}, "
                                       f"expected {list(shape)}")
                for native in self.prefixes.values():
                    if native + name not in f:
                        self.optim = False
            for tag in f.keys():
                if tag in expected[key] or tag in optional[key]:
                    continue
                dtype, shape = f.meta(tag)
                if dtype is None or shape == ():
                    scalars.add(tag)
                    continue
                why = next((why for suffix, why in IGNORED_SUFFIXES.items() if tag.endswith(suffix)), None)
                if why:
                    buffers.add(why)
                    continue
                raise InteropError(f"{f.path}: tensor {tag} does not belong to a {self.dialect} {self.spec.arch} "
                                   f"model at tp={self.layout.tp} pp={self.layout.pp} (unknown tag layout)")
        notes = [f"dropped buffers that are not parameters ({why})" for why in sorted(buffers)]
        if scalars:
            notes.append(f"dropped {len(scalars)} scalar entries that are not parameters "
                         f"({', '.join(sorted(scalars)[:5])})")
        return notes

    def metas(self) -> list[TensorMeta]:
        out = []
        for param in param_table(self.spec):
            ms_name = self.row_of[param.name][0]
            f = self.files[(0, self.layout.stage_of(param))]
            out.append(TensorMeta(param.name, f.meta(ms_name)[0], param.shape))
        if self.optim:
            for prefix, native in self.prefixes.items():
                for param in param_table(self.spec):
                    f = self.files[(0, self.layout.stage_of(param))]
                    dtype = f.meta(native + self.row_of[param.name][0])[0]
                    out.append(TensorMeta(prefix + param.name, dtype, param.shape))
        return out

    def read(self, name: str) -> torch.Tensor:
        native, canonical = "", name
        for prefix, nat in self.prefixes.items():
            if name.startswith(prefix):
                native, canonical = nat, name[len(prefix):]
        ms_name, kind, parts = self.row_of[canonical]
        if self._cached[0] != native + ms_name:  # q, k and v come from one fused tensor: read it once
            self._cached = (native + ms_name, self._gather(native + ms_name, kind, parts))
        return self._cached[1][parts.index(canonical)]

    def _gather(self, tag: str, kind: str, parts: list[str]) -> list[torch.Tensor]:
        tp = self.layout.tp
        first = self.index[parts[0]]
        stage = self.layout.stage_of(first)
        sizes = [shard_box(self.index[p].shape, self.index[p].axis, 0, tp).shape[0] for p in parts]
        heads, groups = self.spec.heads // tp, self.spec.kv_groups // tp
        ranks = range(tp) if first.axis is not None else [0]
        per_rank = [unfuse(kind, self.files[(t, stage)].read(tag), sizes, groups, heads, self.spec.head_dim)
                    for t in ranks]
        if len(per_rank) == 1:
            return per_rank[0]
        return [torch.cat([r[i] for r in per_rank], dim=first.axis) for i in range(len(parts))]

    def close(self) -> None:
        self._cached = (None, None)
        for f in self.files.values():
            f.close()


def _guess_dialect(tags: list[str], path: Path) -> str:
    for tag in tags:
        for marker, dialect in DIALECT_MARKERS.items():
            if tag.startswith(marker):
                return dialect
    raise InteropError(f"{path}: cannot tell the MindSpore dialect from its tensor names "
                       f"(known prefixes: {', '.join(DIALECT_MARKERS)})")
