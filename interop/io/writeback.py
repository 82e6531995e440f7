"""Start writing a file's dirty pages to disk while the file is still being written.

Linux starts background writeback only past 10% of memory dirty, so a 1 GB output
would sit in the page cache until the closing fsync and then be written all at once.
`Writeback` asks for it (sync_file_range SYNC_FILE_RANGE_WRITE) every `WRITEBACK_BYTES`,
on a helper thread: the call itself blocks while the disk queue is full (measured:
0.1-0.25 s per GB on the main thread), which would stall the conversion.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from concurrent.futures import ThreadPoolExecutor

WRITEBACK_BYTES = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_THREAD = ThreadPoolExecutor(1, thread_name_prefix="interop-writeback")


class Writeback:
    """Writeback requests for one open file descriptor; `wait()` before closing it."""

    def __init__(self, fd: int):
        self.fd, self._asked_at, self._pending = fd, 0, None

    def wrote(self, total: int) -> None:
        """`total` bytes are in the file so far: past another WRITEBACK_BYTES, ask for writeback of all
        that is dirty (unless the previous request is still running)."""
        if _SYNC_FILE_RANGE is None or total - self._asked_at < WRITEBACK_BYTES:
            return
        if self._pending is not None and not self._pending.done():
            return
        self._pending = _THREAD.submit(_SYNC_FILE_RANGE, self.fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
        self._asked_at = total

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
