"""The conversion engine: any reader -> canonical tensors -> any writer, one tensor (or one fused row) at a time.

Peak memory is one global tensor or fused row (plus the reader's and writer's view of it, and up
to `io.background.LIMIT` bytes still being written on the helper thread), never the model.
Resharding is the same operation: the writer cuts each global tensor into the target
layout's shards.  A row that both sides store with an equal transform (a grouped QKV, a gated
fc1) moves whole, re-sliced, never split and rebuilt (`fused_plan`; ARCHITECTURE.md, "Rows").
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import memory
from . import workers as parallel
from .atomic import atomic_directory, check_destination
from .formats import detect_format, looks_like, reader_of, writer_of
from .errors import InteropError
from .io.background import background_writes
from .layout import ParallelLayout
from .params import base_param_name, param_index
from .tensors import DTYPE_NAMES, TensorMeta
from .weights_on_disk import check_weights_on_disk

DTYPE_CHOICES = {"keep": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Summary:
    """What a conversion did, as data (`dataclasses.asdict(summary)` is JSON-able); `lines()` is the CLI text."""
    src: str
    dst: str
    src_format: str
    dst_format: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    layout: str = ""  # the layout in words: which layers each pipeline stage holds
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def lines(self, verbose: bool = False) -> list[str]:
        """The CLI text.  A note is one line; what follows a note's first newline is its detail, shown with
        `verbose` (the CLI's -v) and otherwise announced by "(-v: more)"."""
        rate = self.bytes / max(self.seconds, 1e-9) / 1e6
        out = [f"converted {self.src} ({self.src_format}) -> {self.dst} ({self.dst_format}, {self.layout})",
               f"  {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s ({rate:.1f} MB/s)"]
        for note in self.notes:
            first, _, detail = note.partition("\n")
            out.append(f"  note: {first}" + (" (-v: more)" if detail and not verbose else ""))
            out += [f"    {line}" for line in detail.splitlines()] if verbose else []
        return out


class _Progress:
    """One interface over what a caller may pass as `progress=`: an object with start(total)/update(n)
    (the CLI's bar), a tqdm bar (update(n) and a settable .total), or a callable(done_bytes, total_bytes)."""

    def __init__(self, target):
        self.target, self.total, self.done = target, 0, 0

    def start(self, total: int) -> None:
        self.total = total
        if hasattr(self.target, "start"):
            self.target.start(total)
        elif hasattr(self.target, "update"):  # tqdm: learn the total now, refresh the bar
            self.target.total = total
            if hasattr(self.target, "refresh"):
                self.target.refresh()
        else:
            self.target(0, total)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if hasattr(self.target, "update"):
            self.target.update(nbytes)
        else:
            self.target(self.done, self.total)


def fit_vocab(tensor: torch.Tensor, rows: int, true_vocab: int, name: str, notes: list[str]) -> torch.Tensor:
    """Pad with zero rows, or drop padding rows (reported when they held anything), to `rows`."""
    have = tensor.shape[0]
    if have < rows:
        pad = torch.zeros((rows - have, *tensor.shape[1:]), dtype=tensor.dtype)
        return torch.cat([tensor, pad])
    if have > rows:
        if rows < true_vocab:
            raise InteropError(f"cannot fit {name} into {rows} rows: the vocabulary has {true_vocab} tokens")
        if tensor[rows:].any():
            notes.append(f"dropped {have - rows} padding rows of {name} (beyond the true vocab of {true_vocab})")
        return tensor[:rows]
    return tensor


def _accepted(cls, options: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in params and k != "only"}  # `only`: the engine's (workers)


def split_options(reader_cls, writer_cls, options: dict, src_format: str, dst_format: str) -> tuple[dict, dict]:
    """Hand each format-specific option to the reader and/or writer that takes it; refuse the rest.

    Between two checkpoints of one format an option both sides take would describe both: it is the
    output's, and the reader gets its `src_` twin instead (`--qkv-layout` / `--src-qkv-layout`)."""
    options = {k: v for k, v in options.items() if v is not None}
    reader_opts, writer_opts = _accepted(reader_cls, options), _accepted(writer_cls, options)
    if src_format == dst_format:
        twins = _accepted(reader_cls, {f"src_{k}": None for k in reader_opts if k in writer_opts})
        for twin in twins:
            del reader_opts[twin[len("src_"):]]
    unused = sorted(set(options) - set(reader_opts) - set(writer_opts))
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        raise InteropError(f"{flags} does not apply to a {src_format} -> {dst_format} conversion")
    return reader_opts, writer_opts


@contextlib.contextmanager
def one_torch_thread():
    """Conversion copies are memory-bound: torch's thread pool only adds spinning, which on a busy
    2-core machine made strided copies 50x slower (measured).  The CRC thread has the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def without_gc_pauses(fn):
    """Run `fn` with Python's cyclic garbage collector off.  A full collection walks every object
    torch created on import, ~0.1 s each time (measured), and a conversion allocates enough to
    set off several; it makes no cycles worth collecting early, so collection resumes afterwards."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return wrapper


def _passed_through(reader, writer, m_in: TensorMeta, m_out: TensorMeta) -> bool:
    """Bytes that need no change go from file to file in the kernel (copy_file_range), when the reader can
    name them as file ranges and the writer stores them as they are."""
    if m_in.dtype != m_out.dtype or m_in.shape != m_out.shape:
        return False
    if not (hasattr(reader, "byte_ranges") and hasattr(writer, "write_ranges")):
        return False
    ranges = reader.byte_ranges(m_in.name)
    return ranges is not None and writer.write_ranges(m_out.name, ranges)


def _read_padded(reader, m_in: TensorMeta, m_out: TensorMeta) -> torch.Tensor | None:
    """A vocab tensor that the target pads, read straight into its padded buffer when the reader can
    (`read_into`): padding by concatenation would hold the model's largest tensor twice.  None otherwise."""
    if m_out.shape[0] <= m_in.shape[0] or m_in.dtype != m_out.dtype or not hasattr(reader, "read_into"):
        return None
    out = memory.empty(m_out.shape, m_out.dtype)
    if not reader.read_into(m_in.name, out[:m_in.shape[0]]):
        return None
    out[m_in.shape[0]:].zero_()
    return out


def fused_plan(reader, writer, metas_in, metas_out) -> dict[int, tuple]:
    """The fused rows that move whole: {index of the row's last tensor: (transform, names, indices)}.

    A row moves whole when the reader serves it fused (`reader.fused_row(name)` -> (transform, names))
    and the writer stores the same names fused by an equal transform (`writer.accepts_fused(names,
    transform)`): then the stored tensor is only re-sliced for the target's TP ranks
    (`Transform.rank_from_fused`), never split into canonical tensors and fused again.  The row moves at
    its last tensor's place, where the per-tensor path would have completed it (so files get their tensors
    in the same order).  Rows that change shape (vocab padding) or mix dtypes take the per-tensor path."""
    if not (hasattr(reader, "fused_row") and hasattr(writer, "accepts_fused")):
        return {}
    position = {m.name: i for i, m in enumerate(metas_in)}
    plan, placed = {}, set()
    for i, m in enumerate(metas_in):
        if i in placed:
            continue
        found = reader.fused_row(m.name)
        if found is None:
            continue
        transform, names = found
        indices = [position.get(n) for n in names]
        if (len(names) < 2 or None in indices or transform.fused_rows() is None
                or len({metas_in[k].dtype for k in indices}) > 1 or len({metas_out[k].dtype for k in indices}) > 1
                or any(metas_in[k].shape != metas_out[k].shape for k in indices)
                or not writer.accepts_fused(names, transform)):
            continue
        plan[max(indices)] = (transform, names, indices)
        placed.update(indices)
    return plan


def _move_fused(reader, writer, transform, names: list[str], dtype, src) -> None:
    """One fused row from reader to writer as its whole stored tensor (cast to `dtype`)."""
    tensor = reader.read_fused(names[0])
    if tuple(tensor.shape) != transform.rank_shape():
        raise InteropError(f"{src}: the tensor holding {names[0]} has shape {list(tensor.shape)}, "
                           f"expected {list(transform.rank_shape())}")
    writer.write_fused(names, tensor.to(dtype))


def stream(reader, writer, metas_in, metas_out, index: dict, true_vocab: int, src, notes: list[str], progress=None,
           wants=None) -> tuple[int, int]:
    """Read each source tensor, fit and cast it, hand it to the writer; returns (tensors, bytes) written.
    A fused row both sides store alike moves whole (`fused_plan`).
    `wants(name)`, when given, says which tensors the writer needs (a worker's share): the others are
    not read.  `progress.update(n)` gets every tensor's source bytes, read or not."""
    tensors = nbytes = 0
    plan = fused_plan(reader, writer, metas_in, metas_out)
    in_plan = {k for _, _, indices in plan.values() for k in indices}
    for i, (m_in, m_out) in enumerate(zip(metas_in, metas_out)):
        if wants is None or wants(m_out.name):
            if i in plan:
                transform, names, _ = plan[i]
                _move_fused(reader, writer, transform, names, m_out.dtype, src)
            elif i in in_plan:
                pass  # moves with its row, at the row's last tensor
            elif not _passed_through(reader, writer, m_in, m_out):
                vocab = index[base_param_name(m_in.name)].split == "vocab"
                tensor = _read_padded(reader, m_in, m_out) if vocab else None
                if tensor is None:
                    tensor = reader.read(m_in.name)
                    if tuple(tensor.shape) != m_in.shape:
                        raise InteropError(f"{src}: {m_in.name} has shape {list(tensor.shape)}, "
                                           f"expected {list(m_in.shape)}")
                    if vocab:
                        tensor = fit_vocab(tensor, m_out.shape[0], true_vocab, m_in.name, notes)
                writer.write(m_out.name, tensor.to(m_out.dtype))
            tensors += 1
            nbytes += m_out.nbytes
        if progress:
            progress.update(m_in.nbytes)
    return tensors, nbytes


def _writer_and_parts(writer_cls, requested: int | None, total: int, args: tuple, options: dict, notes: list[str]):
    """The writer, and the unit sets of the workers (`interop.workers`); one part: convert in this process.
    With workers, this process's writer owns no unit: it writes only the files describing the whole.
    `--workers N` (N > 1) that ends in one process says so, and why, in `notes`."""
    def one_process(units):
        if requested is not None and requested > 1:
            why = parallel.one_process_reason(requested, total, units, parallel.available_cores())
            notes.append(f"--workers {requested}: converted in one process ({why})")
        return writer_cls(*args, **options), [None]

    if requested == 1:
        return writer_cls(*args, **options), [None]
    if not parallel.splittable(writer_cls):
        return one_process(None)
    if parallel.worker_count(requested, total, 2) < 2:
        return one_process(2)
    planner = writer_cls(*args, **options, only=frozenset())
    n = parallel.worker_count(requested, total, len(planner.units))
    if n < 2:
        return one_process(len(planner.units))
    return planner, parallel.assign(list(planner.units), n)


@without_gc_pauses
def convert(src, dst, *, dst_format: str, src_format: str | None = None, tp: int = 1, pp: int = 1, vpp: int = 1,
            first_stage_layers: int | None = None, last_stage_layers: int | None = None, dtype: str = "keep",
            force: bool = False, options: dict | None = None, progress=None, ep: int = 1, workers: int | None = 1,
            etp: int | None = None, **format_options) -> Summary:
    """Convert checkpoint `src` into `dst` (format `dst_format`, at tp/pp/vpp, and `ep` expert-parallel
    ranks for a mixture-of-experts model). Returns a Summary.

    Format-specific options are keyword arguments (`dialect="mindspeed"`, `format="torch_dist"`,
    `iteration=`, `model_config=`, `qkv_concat=`, `tokenizer=`, `max_shard_size=`, ...; or the
    same as a dict in `options`): each goes to the reader and/or writer whose constructor names it;
    one that neither takes is an error.  `progress`, when given, is a tqdm bar, a
    callable(done_bytes, total_bytes), or an object with `.start(total_bytes)` and `.update(nbytes)`.
    `workers`: processes to split the writing over by target files (`interop.workers`; None: the
    cores available); small jobs and targets of one file stay in this process.
    `dst` appears only when complete.
    """
    started = time.perf_counter()
    options = {**(options or {}), **format_options}
    progress = _Progress(progress) if progress is not None else None
    named_format = src_format is not None
    src_format = src_format or detect_format(src)
    if not Path(src).exists():
        raise InteropError(f"{src}: no such file or directory")
    if dtype not in DTYPE_CHOICES:
        raise InteropError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    reader_cls, writer_cls = reader_of(src_format), writer_of(dst_format)
    reader_options, writer_options = split_options(reader_cls, writer_cls, options, src_format, dst_format)
    ParallelLayout.check_flags(tp, pp, vpp, first_stage_layers, last_stage_layers, ep, etp)
    inputs = (src, options.get("model_config"), options.get("tokenizer"))  # what --force must never delete
    check_destination(dst, force, inputs)
    try:
        reader = reader_cls(src, **reader_options)
    except InteropError as exc:  # with --from naming another format than the files': say what they look like
        raise (looks_like(src, src_format) if named_format else None) or exc from None
    try:
        spec = reader.source.spec
        check_weights_on_disk(spec, src)
        spec.check_tp(tp)
        spec.check_ep(ep)
        spec.check_etp(tp if etp is None else etp, tp)
        if spec.is_moe and not getattr(writer_cls, "holds_moe", False):
            raise InteropError(f"a {dst_format} target cannot hold a mixture-of-experts model yet "
                               f"({spec.num_experts} experts): convert it --to hf or --to interop")
        out_dtype = DTYPE_CHOICES[dtype] or spec.dtype
        out_spec = spec.replace(padded_vocab=writer_cls.padded_vocab(spec, tp), dtype=out_dtype)
        layout = ParallelLayout.build(spec.num_layers, tp, pp, vpp, first_stage_layers, last_stage_layers, ep, etp)
        index = param_index(out_spec)
        metas_in = reader.metas()
        metas_out = []
        for m in metas_in:
            param = index[base_param_name(m.name)]
            cast = DTYPE_NAMES[out_dtype] if dtype != "keep" and not m.name.startswith("optim.") else m.dtype
            metas_out.append(TensorMeta(m.name, cast, param.shape))
        if progress:
            progress.start(sum(m.nbytes for m in metas_in))
        summary = Summary(str(src), str(dst), src_format, dst_format, layout.tp, layout.pp, layout.vpp,
                          layout.describe(), notes=list(reader.source.notes))
        with atomic_directory(dst, force, inputs, summary.notes) as tmp, one_torch_thread(), background_writes():
            writer, parts = _writer_and_parts(writer_cls, workers, sum(m.nbytes for m in metas_in),
                                              (tmp, out_spec, layout, metas_out), writer_options, summary.notes)
            task = dict(src=src, reader_cls=reader_cls, writer_cls=writer_cls, reader_options=reader_options,
                        writer_options=writer_options, dst=tmp, spec=out_spec, layout=layout, metas_in=metas_in,
                        metas_out=metas_out, true_vocab=spec.vocab)
            carried = getattr(reader, "carried", None) or {}
            if hasattr(writer, "carry"):
                writer.carry(carried)  # e.g. an HF source's tokenizer and generation config
            elif carried.get("files"):
                summary.notes.append(f"not carried: {', '.join(sorted(carried['files']))} (--tokenizer SRC when "
                                     f"converting to hf)\na {dst_format} checkpoint holds weights and the model's "
                                     f"shape only; give --tokenizer {src} when converting it to hf")
            try:
                if len(parts) > 1:  # workers write the units' files, this process the describing ones
                    summary.tensors, summary.bytes = parallel.convert_split(task, parts, reader, writer, progress,
                                                                            summary.notes)
                else:
                    summary.tensors, summary.bytes = stream(reader, writer, metas_in, metas_out, index, spec.vocab,
                                                            src, summary.notes, progress)
                    if hasattr(reader, "confirm"):
                        reader.confirm()  # e.g. checksums verified in the background while we read
                    writer.finish(reader.source.state)
                    summary.notes += getattr(writer, "notes", [])  # what the writer could not write, and why
            except BaseException:
                if hasattr(writer, "abort"):
                    writer.abort()
                raise
    finally:
        reader.close()
    if dtype != "keep" and out_dtype != spec.dtype:
        summary.notes.append(f"cast weights from {spec.dtype} to {out_dtype}")
    summary.seconds = time.perf_counter() - started
    return summary
