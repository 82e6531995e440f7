"""Memory for large tensors that conversions fill and drop, one after another.

A freshly allocated tensor costs a page fault and a zeroing per 4 KiB page when first
written (~0.6 s per GB on the virtual machines we measured, more on never-used guest
memory).  Two remedies: `empty` asks Linux for 2 MiB pages (madvise MADV_HUGEPAGE,
~3x cheaper faults; elsewhere a plain torch.empty), and `BufferPool` hands the same
memory out again once no tensor refers to it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys

import torch

_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
_MIN_BYTES = 8 << 20


def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _madvise()


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _MADVISE is not None and nbytes >= _MIN_BYTES:
        start = (out.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
        end = (out.data_ptr() + nbytes) & ~(_HUGE - 1)
        if end > start:
            _MADVISE(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return out


class BufferPool:
    """Large result tensors in anonymous mappings of their own, reused once nothing refers to them.

    Filling new memory took four times as long as filling reused memory.  Plain heap tensors
    are reused too, but freed between small allocations they left the C heap fragmented and
    the RSS climbed with the model (0.6 of a 1 GB checkpoint).  A mapping here is reused when
    idle (no tensor keeps its buffer exported) and unmapped when dropped; at most `keep` are held.
    """

    def __init__(self, keep: int = 8):
        self.keep, self.buffers = keep, []

    def _idle(self, i: int) -> bool:
        return sys.getrefcount(self.buffers[i]) <= 2  # the list's reference and getrefcount's argument

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < 1 << 20:
            return torch.empty(shape, dtype=dtype)
        fits = [i for i in range(len(self.buffers)) if nbytes <= len(self.buffers[i]) <= 2 * nbytes and self._idle(i)]
        if fits:
            buf = self.buffers[min(fits, key=lambda i: len(self.buffers[i]))]
        else:
            idle = [i for i in range(len(self.buffers)) if self._idle(i)]
            for i in reversed(idle[:max(0, len(self.buffers) + 1 - self.keep)]):
                del self.buffers[i]  # unmapped: nothing else refers to it
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
            self.buffers.append(buf)
        return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)

    def release_idle(self) -> None:
        """Unmap every idle buffer: before the model's largest tensor (the vocab rows, read before the
        first layer and after the last) the layers' buffers would only add to the peak."""
        for i in reversed([i for i in range(len(self.buffers)) if self._idle(i)]):
            del self.buffers[i]
