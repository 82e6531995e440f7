"""A small safetensors reader and a streaming writer.

Why not `safetensors.torch`?  Its writer needs every tensor of a file in memory at
once, and its reader maps the whole file, so every page it touched stays resident.
Here the writer lays out the header from the plan first and then takes one tensor
at a time, and the reader maps only the rows a slice needs, for as long as the
returned tensor lives (zero-copy, unmapped when it is dropped), so conversion memory
stays bounded by the largest tensor.  Files are plain safetensors that any loader reads.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import memory
from ..errors import InteropError
from .small_files import DuplicateKey, loads_unique
from ..shards import Box
from . import background
from .writeback import Writeback

DTYPE_CODES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # block-scaled FP8 weights (DeepSeek-V3; transformers fine-grained FP8)
}
CODE_OF_DTYPE = {v: k for k, v in DTYPE_CODES.items()}
# Header bytes: ~100 per tensor, so 16 MiB is ~170,000 tensors in one file (a whole DeepSeek-V3 is ~95,000);
# parsing one costs ~20 us a tensor in Python, so an 80 MB header of 1.5 million entries is refused unread.
MAX_HEADER = 16 << 20


def dtype_from_code(code: str) -> torch.dtype:
    try:
        return DTYPE_CODES[code]
    except KeyError:
        raise InteropError(f"unsupported safetensors dtype {code!r}") from None


def _counts(value) -> bool:
    """A JSON list of non-negative integers (not floats, not booleans)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


class SafetensorsFile:
    """Header parsed and checked against the file size up front; tensors read on demand."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise InteropError(f"{self.path}: cannot open ({exc.strerror})") from None
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            self.close()
            raise InteropError(f"{self.path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            self.close()
            raise InteropError(f"{self.path}: its safetensors header claims {n:,} bytes, more than {MAX_HEADER:,} "
                               "(~170,000 tensors): refused unread")
        if 8 + n > size:
            self.close()
            raise InteropError(f"{self.path}: corrupt or truncated safetensors header")
        try:
            header = loads_unique(os.pread(self._fd, n, 8))
        except DuplicateKey as exc:
            self.close()
            raise InteropError(f"{self.path}: corrupt safetensors header ({exc})") from None
        except (ValueError, RecursionError):
            self.close()
            raise InteropError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
            self.close()
            raise InteropError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self.entries = {}
        spans = []
        for key, entry in header.items():
            try:
                dtype = dtype_from_code(entry["dtype"])
                shape, offsets = entry["shape"], entry["data_offsets"]
                if not _counts(shape) or not _counts(offsets) or len(offsets) != 2:
                    raise ValueError
                start, end = offsets
            except (KeyError, TypeError, ValueError, InteropError):
                self.close()
                raise InteropError(f"{self.path}: corrupt safetensors entry for {key!r}") from None
            if end - start != math.prod(shape) * dtype.itemsize or self._base + end > size:
                self.close()
                raise InteropError(f"{self.path}: tensor {key!r} does not fit its byte range or runs past the end "
                                   "of the file (truncated?)")
            self.entries[key] = (dtype, tuple(shape), self._base + start)
            spans.append((start, end, key))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                self.close()
                raise InteropError(f"{self.path}: tensors {a!r} and {b!r} overlap on disk (corrupt header)")

    def keys(self):
        return list(self.entries)

    def meta(self, key) -> tuple[torch.dtype, tuple[int, ...]]:
        dtype, shape, _ = self._entry(key)
        return dtype, shape

    def _entry(self, key):
        try:
            return self.entries[key]
        except KeyError:
            raise InteropError(f"{self.path}: no tensor named {key!r}") from None

    def read(self, key, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor, or the part in `box`; only the rows the box spans are touched.

        With `out`, the data is written into it: straight from the file when the box is a
        block of whole rows and `out` is contiguous (no mapping, no staging copy).
        """
        dtype, shape, offset = self._entry(key)
        if box is None:
            box = Box.whole(shape)
        if not shape:
            block = self._map(offset, dtype, ())
            return block if out is None else out.copy_(block)
        row_bytes = dtype.itemsize
        for s in shape[1:]:
            row_bytes *= s
        first, rows = box.offset[0], box.shape[0]
        whole_rows = tuple(box.shape[1:]) == tuple(shape[1:])
        if out is not None and whole_rows and out.is_contiguous() and out.dtype == dtype:
            self._read_into(offset + first * row_bytes, out)
            return out
        block = self._map(offset + first * row_bytes, dtype, (rows, *shape[1:]))
        if not whole_rows:
            block = block[(slice(None),) + box.slices()[1:]]
        if out is not None:
            return out.copy_(block)
        return block if whole_rows else block.contiguous()

    def byte_range(self, key, box: Box | None = None) -> tuple[int, int] | None:
        """(file offset, bytes) of `box` when it is a block of whole rows (contiguous on disk), else None."""
        dtype, shape, offset = self._entry(key)
        box = box or Box.whole(shape)
        if not shape or tuple(box.shape[1:]) != tuple(shape[1:]):
            return None
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        return offset + box.offset[0] * row_bytes, box.shape[0] * row_bytes

    def _read_into(self, pos: int, out: torch.Tensor) -> None:
        view, done = memoryview(out.view(-1).view(torch.uint8).numpy()), 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], pos + done)
            if got <= 0:
                raise InteropError(f"{self.path}: unexpected end of file")
            done += got

    def _map(self, pos: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """A tensor over a private (copy-on-write) mapping of bytes [pos, pos + size) of the file."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = pos - pos % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(self._fd, pos + nbytes - start, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=pos - start).view(dtype).reshape(shape)

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Scratch(threading.local):
    """A growing buffer (one per thread) for making slices contiguous before they are written
    (allocating a fresh one per tensor costs a page fault per 4 KiB)."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def contiguous(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer.numel() < nbytes:
            self.buffer = memory.empty((nbytes,), torch.uint8)
        out = self.buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out


_SCRATCH = _Scratch()
_CRC_THREAD = ThreadPoolExecutor(1, thread_name_prefix="interop-crc")


class SafetensorsWriter:
    """Writes a safetensors file whose entries are known up front, one tensor at a time.

    `entries` is the plan: (key, dtype, shape) in the order the tensors will arrive.
    With `checksum` the CRC-32 of the whole file is computed as it is written.
    """

    def __init__(self, path, entries, metadata: dict | None = None, checksum: bool = True):
        self.path = os.fspath(path)
        header, offset = {}, 0
        self._order = []
        for key, dtype, shape in entries:
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            header[key] = {"dtype": CODE_OF_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((key, dtype, tuple(shape)))
            offset += nbytes
        if metadata:
            header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **header}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
        self._file = open(self.path, "wb", buffering=0)  # unbuffered: copy_ranges writes beside it
        self._background = background.enabled()
        self._crc = 0 if checksum else None
        self._writeback = Writeback(self._file.fileno())
        self.bytes = 0
        self._emit(struct.pack("<Q", len(raw)) + raw)
        self._next = self._rows = 0  # the next planned tensor; rows of it written so far (`write_rows`)

    def _emit(self, data) -> None:
        if self._crc is None:
            self._write_all(data)
        else:  # zlib.crc32 and write() both release the GIL: checksum on a second core while writing
            crc = _CRC_THREAD.submit(zlib.crc32, data, self._crc)
            self._write_all(data)
            self._crc = crc.result()
        self.bytes += len(data)
        self._writeback.wrote(self.bytes)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want_key, dtype, shape = self._order[self._next]
        if key != want_key or tensor.dtype != dtype or tuple(tensor.shape) != shape or self._rows:
            raise ValueError(
                f"{self.path}: expected {want_key} {dtype} {shape}, got {key} {tensor.dtype} {tuple(tensor.shape)}")
        self._submit(tensor)
        self._next += 1

    def next_key(self) -> str | None:
        """The tensor the file takes next (None once every planned tensor is written)."""
        return self._order[self._next][0] if self._next < len(self._order) else None

    def write_rows(self, key: str, rows: torch.Tensor) -> None:
        """The next rows of the next tensor (a stacked tensor written expert by expert, never held whole); the
        tensor is done once all its rows are written."""
        want_key, dtype, shape = self._order[self._next]
        if (key != want_key or rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:]
                or self._rows + rows.shape[0] > shape[0]):
            raise ValueError(f"{self.path}: expected rows {self._rows}.. of {want_key} {dtype} {shape}, got {key} "
                             f"{rows.dtype} {tuple(rows.shape)}")
        self._submit(rows)
        self._rows += rows.shape[0]
        if self._rows == shape[0]:
            self._next, self._rows = self._next + 1, 0

    def _submit(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if self._background:
            if background.busy() and not tensor.is_contiguous():  # share the gathering: do it here meanwhile
                tensor = background.gathered.empty(tensor.shape, tensor.dtype).copy_(tensor)
            background.submit(tensor.numel() * tensor.element_size(), self._put, tensor)
        else:
            self._put(tensor)

    def _put(self, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():  # a column slice: gather it in a reused buffer, not a fresh one
            tensor = _SCRATCH.contiguous(tensor)
        if tensor.numel():
            self._emit(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))

    def _write_all(self, data) -> None:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += self._file.write(view[done:])

    def copy_ranges(self, key: str, ranges: list[tuple[str, int, int]]) -> None:
        """Write the next tensor as the concatenation of byte ranges (path, offset, bytes) of other files,
        copied by the kernel (copy_file_range) without passing through this process's memory."""
        want_key, dtype, shape = self._order[self._next]
        if key != want_key or self._rows or sum(n for _, _, n in ranges) != dtype.itemsize * math.prod(shape):
            raise ValueError(f"{self.path}: byte ranges do not make up {want_key} {dtype} {shape}")
        if self._crc is not None:
            raise ValueError(f"{self.path}: copy_ranges cannot checksum what it does not read")
        if self._background:  # in order after the tensors before it (no memory held meanwhile)
            background.submit(0, self._copy, ranges)
        else:
            self._copy(ranges)
        self._next += 1

    def _copy(self, ranges: list[tuple[str, int, int]]) -> None:
        out = self._file.fileno()
        for path, offset, nbytes in ranges:
            fd = os.open(path, os.O_RDONLY)
            try:
                _copy_range(fd, out, offset, nbytes)
            finally:
                os.close(fd)
            self.bytes += nbytes
        self._writeback.wrote(self.bytes)

    def close(self) -> tuple[int, str]:
        """Flush, fsync and close; returns (bytes, crc32 hex or None without `checksum`)."""
        if self._next != len(self._order):
            missing = [k for k, _, _ in self._order[self._next:]]
            raise ValueError(f"{self.path}: {len(missing)} planned tensors never written, e.g. {missing[0]}")
        if self._background:
            background.wait()
        self._file.flush()
        self._writeback.wait()
        os.fsync(self._file.fileno())
        self._file.close()
        return self.bytes, None if self._crc is None else f"{self._crc:08x}"

    def abort(self) -> None:
        if self._background:
            background.abandon()
        self._writeback.wait()
        self._file.close()


def _copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Append `nbytes` of `src` from `offset` to `dst`, in the kernel where it can, else through a buffer."""
    done = 0
    try:
        while done < nbytes:
            got = os.copy_file_range(src, dst, nbytes - done, offset + done)
            if got <= 0:
                raise OSError("copy_file_range copied nothing")
            done += got
    except (OSError, AttributeError):  # another filesystem, an old kernel, or no copy_file_range
        while done < nbytes:
            block = os.pread(src, min(16 << 20, nbytes - done), offset + done)
            if not block:
                raise InteropError(f"unexpected end of file while copying {nbytes} bytes")
            os.write(dst, block)
            done += len(block)


def file_crc32(path, chunk: int = 4 << 20) -> str:
    """CRC-32 of a whole file, read into one reused buffer (no fresh memory per block)."""
    crc, buf = 0, bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"
