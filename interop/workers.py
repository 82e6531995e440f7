"""`--workers N`: one conversion split over processes by target files.

A writer that can be split (`Writer.splits`) names its target *units* (`writer.units`): the Megatron torch and
MindSpore rank files, the common store's rank files, HF's shard files, torch_dist's `.distcp`
files (one per decoder layer), listed stage by stage.  Worker w of N owns the w-th of N runs of
consecutive units (`engine.split_units`: a source tensor is read by as few workers as can be).  It
gets one `engine.Task` and opens the source itself (only names, shapes and options cross the
process boundary, never a tensor; with `Reader.options_for_worker`: the parent's reader made the
checks that read every byte, such as a MindSpore file's crc, and holds no tensor itself),
streams the canonical tensors in the usual order, reads only those its units need
(`writer.wants(name)`), and finishes its units' files (`writer.finish_units(state)`, which returns
what the files describing the whole checkpoint need: sizes, checksums, DCP storage entries).
The parent holds the atomic temporary directory, shows progress, and once every worker is done
writes the describing files itself (`writer.finish_global(state, results)` of a writer that owns
no unit).  Each worker's unit files are what one process would write: the bytes are the same.

Workers start from a fork server that has imported torch and interop once ('forkserver': a fork
of a process whose torch threads may be running is unsafe, and a fresh interpreter per worker
pays torch's import again).  A worker costs its start-up, so a job is split only into parts of
at least `MIN_BYTES_PER_WORKER` of source.
"""
from __future__ import annotations

import multiprocessing
import os
import queue as queues
import traceback

from .engine import Task, one_torch_thread, write_units
from .errors import InteropError
from .io.background import background_writes

# Below this much source per worker, a worker's start-up (fork server: ~0.1 s per fork after a one-time
# ~1.5 s torch import; measured in tests/formats/test_workers.py's docstring) costs more than it saves.
MIN_BYTES_PER_WORKER = 1 << 30
PROGRESS_BYTES = 16 << 20  # a worker reports progress at most every this many bytes of source
last_peak_rss: list[int] = []  # each worker's peak RSS (bytes) in the last run: the benchmarks report it
last_start_rss: list[int] = []  # each worker's RSS as it began (forked from the fork server), in the last run


def available_cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(requested: int | None, total_bytes: int, units: int) -> int:
    """How many processes to use: at most `requested` (default: the cores), one per unit, and one per
    `MIN_BYTES_PER_WORKER` of source; 1 means convert in this process."""
    if requested is not None and requested < 1:
        raise InteropError(f"--workers must be >= 1, got {requested}")
    wanted = available_cores() if requested is None else requested
    return max(1, min(wanted, units, total_bytes // max(MIN_BYTES_PER_WORKER, 1)))


def one_process_reason(requested: int, total_bytes: int, units: int | None, cores: int | None = None) -> str:
    """Why `--workers requested` (> 1) runs in one process, as the note says it."""
    if units is None:
        return "the target is not split into files workers could share"
    if units < 2:
        return "the target is one file"
    wanted = min(requested, cores or requested)
    if total_bytes // max(MIN_BYTES_PER_WORKER, 1) < 2:
        return (f"{total_bytes / 2**20:.0f} MiB of source, under the {MIN_BYTES_PER_WORKER >> 20} MiB per worker "
                f"that pays for a worker's start")
    return f"{wanted} core{'s' if wanted > 1 else ''} available"


def merge_notes(lists) -> list[str]:
    """Every note once, in first-seen order (each worker repeats the notes all of them make)."""
    out: list[str] = []
    for notes in lists:
        out += [n for n in notes if n not in out]
    return out


def convert_split(task: Task, parts: list[frozenset], reader, writer, progress, notes: list[str]) -> tuple[int, int]:
    """The conversion engine's loop, split: one worker per part of the writer's units, then the describing
    files from the writer in this process (which owns no unit).  Appends the notes; returns (tensors, bytes)."""
    total = sum(m.nbytes for m in task.metas_in)
    done = run([task.for_part(w, only) for w, only in enumerate(parts)], progress, total)
    notes += [n for n in merge_notes(d["notes"] for d in done) if n not in notes]
    reader.confirm()  # this process's reader too (e.g. a background checksum)
    writer.finish_global(reader.source.state, {k: v for d in done for k, v in d["results"].items()})
    notes += merge_notes([*(d["writer_notes"] for d in done), writer.notes])
    return len(task.metas_out), sum(m.nbytes for m in task.metas_out)


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["interop.workers", "interop.engine"])
        return ctx
    return multiprocessing.get_context("spawn")


def run(tasks: list[Task], progress=None, total: int = 0) -> list[dict]:
    """Run one `_work(task)` per task in its own process; returns each worker's result in task order.

    A worker that fails stops the others and raises here as it would have raised alone (an
    InteropError with its message, an OSError with its errno and file); one that dies without a word
    (killed, out of memory) is an InteropError naming its exit."""
    ctx = _context()
    messages = ctx.Queue()
    procs = [ctx.Process(target=_work, args=(task, messages), daemon=True, name=f"interop-worker-{w}")
             for w, task in enumerate(tasks)]
    results: dict[int, dict] = {}
    seen = shown = 0
    silent: dict[int, int] = {}  # worker -> polls since it ended (status 0) without its result arriving
    try:
        for p in procs:
            p.start()
        while len(results) < len(procs):
            try:
                kind, w, payload = messages.get(timeout=0.5)
            except queues.Empty:
                for w, p in enumerate(procs):
                    if w in results or p.exitcode is None:
                        continue
                    silent[w] = silent.get(w, 0) + 1  # a result sent just before the end may still be on its way
                    if p.exitcode != 0 or silent[w] > 4:
                        _raise_dead(w, p.exitcode, messages)
                continue
            if kind == "progress":
                seen += payload
                if progress is not None:  # every worker passes over every tensor: show their mean
                    step = min(seen // len(procs), total) - shown
                    if step > 0:
                        progress.update(step)
                        shown += step
            elif kind == "done":
                results[w] = payload
            else:
                _raise_failed(w, payload)
        for p in procs:
            p.join()
    finally:
        procs = [p for p in procs if p.pid is not None]  # started
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        messages.close()
    last_peak_rss[:] = [results[w].get("peak_rss") or 0 for w in range(len(results))]
    last_start_rss[:] = [results[w].get("start_rss") or 0 for w in range(len(results))]
    return [results[w] for w in range(len(results))]


def _raise_dead(w: int, exitcode: int, messages) -> None:
    try:  # its last words may still be in the queue
        kind, who, payload = messages.get(timeout=1)
        if kind == "error":
            _raise_failed(who, payload)
    except queues.Empty:
        pass
    how = (f"was killed by signal {-exitcode} (out of memory?)" if exitcode < 0 else
           f"exited with status {exitcode}" if exitcode else "ended without a result")
    raise InteropError(f"conversion worker {w} {how}; nothing was written")


def _raise_failed(w: int, error: dict) -> None:
    if error["type"] == "interop":
        raise InteropError(error["message"])
    if error["type"] == "os":
        raise OSError(error["errno"], error["strerror"], error["filename"])
    if error["type"] == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError(f"conversion worker {w} failed:\n{error['traceback']}")


def _peak_rss(field: str = "VmHWM") -> int | None:
    """This process's peak RSS in bytes (`field="VmRSS"`: its RSS now); None where /proc says nothing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None


class _Progress:
    """Sends the bytes of source a worker has passed, in steps of PROGRESS_BYTES."""

    def __init__(self, messages, w: int):
        self.messages, self.w, self.pending = messages, w, 0

    def update(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= PROGRESS_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.messages.put(("progress", self.w, self.pending))
            self.pending = 0


def _work(task: Task, messages) -> None:
    """One worker: open the source, stream the tensors its units need, finish its units' files."""
    w = task.part
    start_rss = _peak_rss("VmRSS")
    try:
        reader = task.open_reader()  # classes travel by name
        try:
            with one_torch_thread(), background_writes():
                writer = task.open_writer()
                notes: list[str] = []
                progress = _Progress(messages, w)
                results = write_units(reader, writer, task, notes, progress)
                progress.flush()
        finally:
            reader.close()
        messages.put(("done", w, {"results": results, "notes": notes, "peak_rss": _peak_rss(),
                                  "start_rss": start_rss, "writer_notes": list(writer.notes)}))
    except InteropError as exc:
        messages.put(("error", w, {"type": "interop", "message": str(exc)}))
    except OSError as exc:
        messages.put(("error", w, {"type": "os", "errno": exc.errno, "strerror": exc.strerror or str(exc),
                                   "filename": exc.filename}))
    except KeyboardInterrupt:
        messages.put(("error", w, {"type": "interrupt"}))
    except BaseException:
        messages.put(("error", w, {"type": "bug", "traceback": traceback.format_exc()}))
    finally:
        messages.close()
        messages.join_thread()  # the message is in the pipe before the process ends
