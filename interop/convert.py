"""`convert`: one conversion from start to end, around the engine (`interop.engine`).

It finds the formats, routes their options, checks the job, lays out the target, and runs the
engine in this process or over workers (`interop.workers`), inside an atomic output directory.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import dataclass, field, replace
from pathlib import Path


from . import distributed
from . import workers as parallel
from .atomic import atomic_directory, check_destination
from .engine import Task, one_torch_thread, split_units, stream, write_units
from .workers import merge_notes
from .formats import base_spec_of, detect_format, looks_like, reader_of, target_names, writer_of
from .errors import InteropError
from .io.background import background_writes
from .layout import ParallelLayout
from .named_tokenizer import with_named_tokenizer
from .adapter import tensor_index
from .lora_stack import StackedReader
from .merge import MergedReader, check_merge_args
from .params import TensorKey, base_param_name
from .progress import Progress
from .tensors import DTYPE_NAMES, TensorMeta
from .weights_on_disk import check_weights_on_disk

# fp8: block-scaled float8_e4m3fn projections (the writer quantises, `quantize_to`), every other tensor kept
DTYPE_CHOICES = {"keep": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": None}


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
    rank: int = 0  # of a distributed conversion (`interop.distributed`): rank 0 reports the job, the others nothing
    unchecked: str | None = None  # the source's files whose tensor bytes no checksum covers (`Source.unchecked`)

    def lines(self, verbose: bool = False) -> list[str]:
        """The CLI text.  A note is one line; what follows a note's first newline is its detail, shown with
        `verbose` (the CLI's -v) and otherwise announced by "(-v: more)"."""
        if self.rank:
            return []
        rate = self.bytes / max(self.seconds, 1e-9) / 1e6
        out = [f"converted {self.src} ({self.src_format}) -> {self.dst} ({self.dst_format}, {self.layout})",
               f"  {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s ({rate:.1f} MB/s)"]
        for note in self.notes:
            first, _, detail = note.partition("\n")
            out.append(f"  note: {first}" + (" (-v: more)" if detail and not verbose else ""))
            out += [f"    {line}" for line in detail.splitlines()] if verbose else []
        if self.unchecked:
            out.append(f"  unchecked: {self.unchecked} carry no checksums; damaged tensor bytes there show only in "
                       f"`interop verify {self.src} {self.dst}`")
        return out


def _accepted(cls, options: dict) -> dict:
    return {k: v for k, v in options.items() if k in cls.options}  # the keywords the class declares


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
    if not writer_cls.splits:
        return one_process(None)
    if parallel.worker_count(requested, total, 2) < 2:
        return one_process(2)
    planner = writer_cls(*args, **options, only=frozenset())
    n = parallel.worker_count(requested, total, len(planner.units))
    if n < 2:
        return one_process(len(planner.units))
    return planner, split_units(list(planner.units), n)


def _carry(writer, reader, dst_format: str, src, notes: list[str], tokenizer_given: bool = False) -> None:
    # e.g. an HF source's tokenizer and generation config; a tokenizer the checkpoint names, from inside it only
    carried, named_note = with_named_tokenizer(reader.carried, reader.source.state, src, tokenizer_given)
    notes += [named_note] if named_note else []
    if not writer.carry(carried) and carried.get("files"):
        notes.append(f"not carried: {', '.join(sorted(carried['files']))} (--tokenizer SRC when "
                     f"converting to hf)\na {dst_format} checkpoint holds weights and the model's "
                     f"shape only; give --tokenizer {src} when converting it to hf")


def _convert_ranks(group, reader, task: Task, workers: int | None, dst, force: bool, inputs, summary: Summary,
                   progress) -> None:
    """This process's part of a distributed conversion (`interop.distributed`): the units of its rank (split
    again over `--workers` processes), and on rank 0 the describing files and the rename."""
    stack = contextlib.ExitStack()
    holder = []  # rank 0's writer of the describing files

    def tmp_of():
        return stack.enter_context(atomic_directory(dst, force, inputs, summary.notes))

    def work(tmp):
        job = replace(task, dst=str(tmp))
        args = (str(tmp), job.spec, job.layout, list(job.metas_out))
        if not job.writer_cls.splits:  # one file: rank 0 writes it all
            if group.rank:
                return {"results": {}, "notes": []}
            writer = job.writer_cls(*args, **job.writer_options)
            mine = None
        else:
            planner = job.writer_cls(*args, **job.writer_options, only=frozenset())
            units = list(planner.units)
            share = split_units(units, group.world)[group.rank]
            mine = [u for u in units if u in share]
            writer = planner  # rank 0's writes the describing files
        if group.rank == 0:
            _carry(writer, reader, summary.dst_format, summary.src, summary.notes,
                   task.writer_options.get("tokenizer") is not None)
            holder.append(writer)
        notes: list[str] = []
        if mine is None:
            with one_torch_thread(), background_writes():
                stream(reader, writer, job.metas_in, job.metas_out, job.index(), job.true_vocab, job.src,
                       notes, progress)
                reader.confirm()
                return {"results": writer.finish_units(reader.source.state), "notes": notes}
        n = parallel.worker_count(workers, sum(m.nbytes for m in job.metas_in), len(mine)) if mine else 1
        if n > 1:
            done = parallel.run([job.for_part(w, p) for w, p in enumerate(split_units(mine, n))])
            return {"results": {k: v for d in done for k, v in d["results"].items()},
                    "notes": merge_notes(d["notes"] for d in done),
                    "writer_notes": merge_notes(d["writer_notes"] for d in done)}
        part = job.for_part(group.rank, frozenset(mine))
        with one_torch_thread(), background_writes():
            unit_writer = part.open_writer()
            results = write_units(reader, unit_writer, job, notes, progress)
        return {"results": results, "notes": notes, "writer_notes": list(unit_writer.notes)}

    def finish(tmp, done):
        writer = holder[0]
        summary.notes += [n for n in merge_notes(d["notes"] for d in done) if n not in summary.notes]
        writer.finish_global(reader.source.state, {k: v for d in done for k, v in d["results"].items()})
        summary.notes += merge_notes([*(d.get("writer_notes", []) for d in done), writer.notes])
        summary.tensors, summary.bytes = len(task.metas_out), sum(m.nbytes for m in task.metas_out)
        stack.close()  # fsync and the atomic rename

    with stack:
        distributed.run(group, tmp_of, work, finish)


def convert(src, dst, **kwargs) -> Summary:
    """Convert checkpoint `src` into `dst` (`convert_here`'s arguments); under torchrun (WORLD_SIZE > 1) this
    process is one rank of a distributed conversion (`interop.distributed`)."""
    group = distributed.from_env()
    if group is None:
        return convert_here(src, dst, **kwargs)
    with distributed.guarded(group):
        distributed.check_paths(group, src, dst)
        return convert_here(src, dst, group=group, **kwargs)


@without_gc_pauses
def convert_here(src, dst, *, group=None, dst_format: str, src_format: str | None = None, tp: int = 1, pp: int = 1, vpp: int = 1,
            first_stage_layers: int | None = None, last_stage_layers: int | None = None, dtype: str = "keep",
            force: bool = False, options: dict | None = None, progress=None, ep: int = 1, workers: int | None = 1,
            etp: int | None = None, base=None, adapter=None, merge: bool = False, lora_stack_ranks: bool = False,
            **format_options) -> Summary:
    """Convert checkpoint `src` into `dst` (format `dst_format`, at tp/pp/vpp, and `ep` expert-parallel
    ranks for a mixture-of-experts model). Returns a Summary.

    Format-specific options are keyword arguments (`dialect="mindspeed"`, `format="torch_dist"`,
    `iteration=`, `model_config=`, `qkv_concat=`, `tokenizer=`, `max_shard_size=`, ...; or the
    same as a dict in `options`): each goes to the reader and/or writer whose constructor names it;
    one that neither takes is an error.  `progress`, when given, is a tqdm bar, a
    callable(done_bytes, total_bytes), or an object with `.start(total_bytes)` and `.update(nbytes)`.
    `workers`: processes to split the writing over by target files (`interop.workers`; None: the
    cores available); small jobs and targets of one file stay in this process.
    `base`: the base model's checkpoint of a LoRA adapter source that needs it (PEFT); `adapter` with `merge`:
    a LoRA adapter merged into `src`'s weights (W + alpha/r B A in fp32, cast once; `interop.merge`);
    `lora_stack_ranks`: an adapter source rewritten exactly with one A per group of projections that read the
    same input, at a higher rank (`interop.lora_stack`), for targets that fuse them (Megatron's linear_qkv).
    `dst` appears only when complete.
    """
    started = time.perf_counter()
    options = {**(options or {}), **format_options}
    progress = Progress(progress) if progress is not None else None
    named_format = src_format is not None
    src_format = src_format or detect_format(src)
    if not Path(src).exists():
        raise InteropError(f"{src}: no such file or directory")
    if dtype not in DTYPE_CHOICES:
        raise InteropError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    reader_cls, writer_cls = reader_of(src_format), writer_of(dst_format)
    reader_options, writer_options = split_options(reader_cls, writer_cls, options, src_format, dst_format)
    if DTYPE_CHOICES[dtype]:  # a reader that decodes stored values (block-scaled FP8) decodes straight to --dtype
        reader_options.update(_accepted(reader_cls, {"dequantize_to": DTYPE_CHOICES[dtype]}))
    if dtype == "fp8":  # only a writer that stores block-scaled FP8 weights takes it
        if not _accepted(writer_cls, {"quantize_to": "fp8"}):
            raise InteropError(f"--dtype fp8: a {dst_format} target {writer_cls.no_fp8}")
        writer_options["quantize_to"] = "fp8"
    ParallelLayout.check_flags(tp, pp, vpp, first_stage_layers, last_stage_layers, ep, etp)
    if group is not None:  # checks that read every byte: each rank makes its share
        reader_options = reader_cls.options_for_rank(reader_options, group.rank, group.world)
    check_merge_args(adapter, merge, base)
    if adapter is not None:  # the merge happens in this process's reader: workers would reopen the base alone
        if group is not None:
            raise InteropError("--merge runs in one process: run it without torchrun")
        workers = 1
    inputs = (src, options.get("model_config"), options.get("tokenizer"), base, adapter)  # what --force must never delete
    check_destination(dst, force, inputs)
    if reader_cls.reads_adapter:
        reader_options["base"] = base_spec_of(src, base or reader_cls.named_base(src))
    elif base is not None:
        raise InteropError(f"--base applies to a LoRA adapter source that does not hold its base's description; "
                           f"{src} is a {src_format} checkpoint")
    try:
        reader = reader_cls(src, **reader_options)
    except InteropError as exc:  # with --from naming another format than the files': say what they look like
        raise (looks_like(src, src_format) if named_format else None) or exc from None
    try:
        if adapter is not None:
            reader = MergedReader(reader, open_adapter(adapter, reader.source.spec),
                                  DTYPE_NAMES[DTYPE_CHOICES[dtype]] if DTYPE_CHOICES[dtype] else None, str(adapter))
        if lora_stack_ranks:
            reader = StackedReader(reader)
        spec, lora = reader.source.spec, reader.source.adapter
        if lora is None:
            check_weights_on_disk(spec, src)
        elif not writer_cls.holds_adapter:
            holders = ", ".join(n for n in target_names() if writer_of(n).holds_adapter)
            raise InteropError(f"a {dst_format} target cannot hold a LoRA adapter yet ({holders} can); or merge "
                               f"it into its base: interop convert BASE DST --adapter {src} --merge --to {dst_format}")
        else:
            writer_options = {**writer_options, "adapter": lora}
        spec.check_tp(tp)
        spec.check_ep(ep)
        spec.check_etp(tp if etp is None else etp, tp)
        if spec.is_moe and not writer_cls.holds_moe:
            raise InteropError(f"a {dst_format} target cannot hold a mixture-of-experts model yet "
                               f"({spec.num_experts} experts): convert it --to hf or --to interop")
        out_dtype = DTYPE_CHOICES[dtype] or spec.dtype
        out_spec = spec.replace(padded_vocab=writer_cls.padded_vocab(spec, tp), dtype=out_dtype)
        sizes = dict(tp=tp, pp=pp, vpp=vpp, first_stage_layers=first_stage_layers,
                     last_stage_layers=last_stage_layers, ep=ep, etp=etp)
        layout = writer_cls.build_layout(spec.num_layers, sizes, writer_options)
        index = tensor_index(out_spec, lora)
        metas_in = reader.metas()
        metas_out = []
        for m in metas_in:
            param = index[base_param_name(m.name)]
            cast = DTYPE_NAMES[out_dtype] if DTYPE_CHOICES[dtype] and not TensorKey.parse(m.name).is_optim else m.dtype
            metas_out.append(TensorMeta(m.name, cast, param.shape))
        if progress:
            progress.start(sum(m.nbytes for m in metas_in))
        summary = Summary(str(src), str(dst), src_format, dst_format, layout.tp, layout.pp, layout.vpp,
                          layout.describe(), notes=list(reader.source.notes), unchecked=reader.source.unchecked)
        task = Task(str(src), reader_cls, writer_cls, reader_options, writer_options, "", out_spec, layout,
                    tuple(metas_in), tuple(metas_out), spec.vocab)
        if group is not None:
            summary.rank = group.rank
            _convert_ranks(group, reader, task, workers, dst, force, inputs, summary, progress)
        else:
            with atomic_directory(dst, force, inputs, summary.notes) as tmp, one_torch_thread(), background_writes():
                writer, parts = _writer_and_parts(writer_cls, workers, sum(m.nbytes for m in metas_in),
                                                  (tmp, out_spec, layout, metas_out), writer_options,
                                                  summary.notes)
                task = replace(task, dst=str(tmp))
                _carry(writer, reader, dst_format, src, summary.notes, writer_options.get("tokenizer") is not None)
                try:
                    if len(parts) > 1:  # workers write the units' files, this process the describing ones
                        summary.tensors, summary.bytes = parallel.convert_split(task, parts, reader, writer, progress,
                                                                                summary.notes)
                    else:
                        summary.tensors, summary.bytes = stream(reader, writer, metas_in, metas_out, index, spec.vocab,
                                                                src, summary.notes, progress)
                        reader.confirm()  # e.g. checksums verified in the background while we read
                        writer.finish(reader.source.state)
                        summary.notes += writer.notes  # what the writer could not write, and why
                except BaseException:
                    writer.abort()
                    raise
    finally:
        reader.close()
    if DTYPE_CHOICES[dtype] and out_dtype != spec.dtype:
        summary.notes.append(f"cast weights from {spec.dtype} to {out_dtype}")
    if lora is not None:
        summary.notes.append(f"a LoRA adapter (rank {lora.rank}, alpha {lora.alpha:g}, {', '.join(lora.targets)}) "
                             f"on a base model of {spec.num_layers} layers, hidden {spec.hidden}")
    summary.seconds = time.perf_counter() - started
    return summary


def open_adapter(path, base_spec):
    """The reader of the LoRA adapter at `path`, for base model `base_spec` (a PEFT adapter is read against it;
    a common-format adapter states its own base, which its tensors are checked against)."""
    if not Path(path).exists():
        raise InteropError(f"{path}: no such file or directory")
    cls = reader_of(detect_format(path))
    reader = cls(path, base=base_spec) if cls.reads_adapter else cls(path)
    if reader.source.adapter is None:
        reader.close()
        raise InteropError(f"{path}: not a LoRA adapter (--adapter names one: a PEFT folder or an interop adapter)")
    return reader
