"""Writing on a helper thread while the caller prepares the next tensor.

Within `background_writes()` (the conversion engine's loop), writers hand each tensor to
one helper thread, which gathers it if it must (a transpose, a column slice) and writes it
while the caller reads and prepares the next: write(), torch's zip writer and tensor copies
all release the GIL, so two cores share the work.  Outside it (the trainer's checkpoints)
writers write in the caller's thread.

Writes queue up to `LIMIT` bytes, so the small tensors between two large ones (norms,
biases) need not wait for the large one; past that, the caller waits for the oldest.  The
caller must not change a tensor once it has handed it over (the engine never does; a
writer that builds tensors in reused memory takes it from a `memory.BufferPool`, which
hands a buffer out again only when nothing refers to it).
"""
from __future__ import annotations

import collections
import contextlib
from concurrent.futures import ThreadPoolExecutor

from .. import memory

LIMIT = 32 << 20
_THREAD = ThreadPoolExecutor(1, thread_name_prefix="interop-write")
_pending: collections.deque = collections.deque()  # (future, bytes), oldest first
_enabled = False
gathered = memory.BufferPool(keep=4)  # slices gathered by the caller while the helper was busy


def enabled() -> bool:
    """Whether a writer created now should write through `submit`."""
    return _enabled


def busy() -> bool:
    return any(not f.done() for f, _ in _pending)


def submit(nbytes: int, job, *args) -> None:
    """Run `job(*args)` on the helper thread after every job submitted before it; `nbytes` is what
    its arguments hold in memory until it is done."""
    while _pending and (_pending[0][0].done() or sum(n for _, n in _pending) + nbytes > LIMIT):
        _pending.popleft()[0].result()  # a failed write raises here, in the caller's thread
    _pending.append((_THREAD.submit(job, *args), nbytes))


def wait() -> None:
    """Until every submitted job is done and collected; the first that failed raises here (after the
    rest are collected, so that none is left for a later conversion to trip over)."""
    error = None
    while _pending:
        try:
            _pending.popleft()[0].result()
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


def abandon() -> None:
    """Wait for every submitted job, dropping failures: for a writer being aborted, whose caller is
    already leaving on an error of its own."""
    with contextlib.suppress(Exception):
        wait()


def idle() -> bool:
    """Nothing submitted and not yet collected."""
    return not _pending


@contextlib.contextmanager
def background_writes():
    global _enabled
    before, _enabled = _enabled, True
    try:
        yield
    finally:
        _enabled = before
        abandon()  # only ever waits when leaving on an error: writers' close() waited
