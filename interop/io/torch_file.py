"""torch.save files (zip format) read and written a tensor at a time.

Megatron's `model_optim_rng.pt` is one pickle holding a whole rank's state.  Loading
it with `torch.load` (even with mmap) keeps every page it touches resident, and
`torch.save` needs the whole object in memory.  Here:

- `LazyTorchFile` unpickles the structure only (safely, through
  `safe_pickle`, with tensors on the meta device carrying their file offset) and
  reads a tensor's bytes with `pread` when asked: memory is that tensor.
- `TorchFileWriter` writes each tensor's storage record as soon as it is given and
  the pickle (which only refers to records by key) last; the result is an ordinary
  torch.save zip that `torch.load` reads, mmap included.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import uuid
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import InteropError
from . import background
from .safe_pickle import load_pickle, safe_torch_load
from .writeback import Writeback
from .zip_records import InflationBomb, check_expansion, zip_records
from .zipfile_writer import ALIGNMENT, ZipWriter

STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
}


def _globals_in(path: Path) -> list[str]:
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:  # damaged zip or pickle: many exception types
        raise InteropError(f"{path}: not a readable torch checkpoint ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None


class _Record(NamedTuple):
    name: str
    size: int
    crc: int


def _records(path: Path) -> tuple[dict[int, _Record], bool]:
    """The zip's records by the file offset of their data, and whether any is compressed.

    torch reports a storage's place as its record's data offset; knowing each record's
    size and CRC-32 there lets a read check that it stays inside the record and verify it."""
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb", buffering=0) as f:
            check_expansion(z)
            by_offset, compressed = {}, False
            for record in zip_records(z, f.fileno()):
                compressed = compressed or not record.stored
                by_offset[record.offset] = _Record(record.name, record.size, record.crc)
    except InflationBomb as exc:
        raise InteropError(f"{path}: {exc}") from None
    except (OSError, zipfile.BadZipFile, ValueError, struct.error) as exc:
        raise InteropError(f"{path}: not a readable zip file ({exc})") from None
    return by_offset, compressed


class LazyTorchFile:
    """The object in a torch.save file, its tensors as meta-device stand-ins read on demand.

    Reads stay inside the tensor's record, and a read of a whole record is checked against
    the record's CRC-32 when it has one (interop and torch.save write them; torch's own
    `compute_crc32=False` leaves zeros).  A file whose records are compressed (deflate: torch
    reads those too) is loaded whole instead: its bytes on disk are not the tensor's."""

    def __init__(self, path):
        self.path = Path(path)
        self.placeholders = []
        self._later = {}  # {record offset: (record, future CRC-32)} of records copied file to file
        if not self.path.is_file():
            raise InteropError(f"{self.path}: no such file")
        self.lazy = zipfile.is_zipfile(self.path)
        if not self.lazy:  # the pre-1.6 format: no offsets to read from, load it whole
            self.obj = safe_torch_load(self.path, mmap=False)
            return
        self._records, compressed = _records(self.path)
        if compressed:
            self.lazy = False
            self.obj = safe_torch_load(self.path, mmap=False)
            return
        self._check_small_records()
        self.obj, self.placeholders = load_pickle(self.path, _globals_in(self.path), map_location="meta", mmap=False)

    def _check_small_records(self) -> None:
        """The pickle (names, shapes, offsets) and the small records are verified up front: cheap."""
        with open(self.path, "rb", buffering=0) as f:
            for offset, record in self._records.items():
                if record.crc and (record.name.endswith("/data.pkl") or record.size <= 4096):
                    self._check_crc(record, zlib.crc32(os.pread(f.fileno(), record.size, offset)))

    def _span(self, t: torch.Tensor) -> tuple[int, int, _Record | None]:
        """(file offset, bytes) of the part of its storage record that meta tensor `t` views, checked to lie
        inside the record, and the record when `t` views all of it (then its CRC-32 can be checked)."""
        offset = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        record = self._records.get(offset) if offset is not None else None
        if record is None:
            raise InteropError(f"{self.path}: a tensor without a storage record (not a torch.save file?)")
        item = t.element_size()
        if t.numel() == 0:
            return offset, 0, None
        if t.storage_offset() < 0 or any(s < 0 for s in t.stride()):
            raise InteropError(f"{self.path}: a tensor with a negative offset or stride into {record.name}")
        last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        start, nbytes = t.storage_offset() * item, (last - t.storage_offset() + 1) * item
        if start + nbytes > record.size or t.untyped_storage().nbytes() > record.size:
            raise InteropError(f"{self.path}: a tensor reaches past the end of its storage record {record.name} "
                               f"(bytes {start}..{start + nbytes} of {record.size}); the file is damaged")
        whole = start == 0 and nbytes == record.size and record.crc != 0
        return offset + start, nbytes, record if whole else None

    def record_checksum(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(CRC-32, bytes) of the record meta tensor `t` views whole, from the zip's directory (nothing read);
        None for a partial view or a record without a CRC."""
        if t.device.type != "meta" or t.numel() == 0:
            return None
        _, _, record = self._span(t)
        return None if record is None else (record.crc, record.size)

    def check_later(self, t: torch.Tensor) -> None:
        """Check the CRC-32 of the record meta tensor `t` views whole, on the CRC thread (the bytes were copied
        file to file, never read here); `confirm` reports it.  A record is checked once; a partial view not."""
        if t.device.type != "meta" or t.numel() == 0:
            return
        pos, nbytes, record = self._span(t)
        if record is not None and pos not in self._later:
            self._later[pos] = (record, _CRC_THREAD.submit(_crc_of_range, self.path, pos, nbytes))

    def _check_record_later(self, t: torch.Tensor) -> None:
        """`t` views part of its record (a parameter's run of distrib_optim.pt's flat buffer): the whole
        record is CRC-checked once, on the CRC thread (from the page cache its reads filled); `confirm`
        reports it."""
        offset = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        record = self._records.get(offset) if offset is not None else None
        if record is not None and record.crc and offset not in self._later:
            self._later[offset] = (record, _CRC_THREAD.submit(_crc_of_range, self.path, offset, record.size))

    def confirm(self) -> None:
        """Raise if a record `check_later` was asked for fails its CRC-32."""
        later, self._later = self._later, {}
        for record, crc in later.values():
            self._check_crc(record, crc.result())

    def _check_crc(self, record: _Record | None, crc: int) -> None:
        if record is not None and crc != record.crc:
            raise InteropError(f"{self.path}: record {record.name} fails its CRC-32 check "
                               f"({crc:08x}, stored {record.crc:08x}); the file is damaged")

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """The real contents of tensor `t` from this file's structure (a fresh CPU tensor)."""
        if t.device.type != "meta":
            return t.clone()
        pos, nbytes, record = self._span(t)
        if t.numel() == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        buf = bytearray(nbytes)
        with open(self.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], pos)
        if got != len(buf):
            raise InteropError(f"{self.path}: truncated (a tensor needs {len(buf)} bytes at offset {pos}, {got} there)")
        if record is not None:
            self._check_crc(record, zlib.crc32(buf))
        else:
            self._check_record_later(t)
        flat = torch.frombuffer(buf, dtype=t.dtype)
        if t.is_contiguous():
            return flat.view(t.shape)
        return flat.as_strided(t.shape, t.stride()).clone()

    def read_into(self, t: torch.Tensor, runs: list[tuple[torch.Tensor, int, int]]) -> None:
        """Read tensor `t`'s elements straight into `runs`, (contiguous tensor, start, stop) element ranges
        of their flattened targets in the order `t` stores its elements: scattered reads, no staging copy.
        The CRC-32 of what was read is computed on a second core while the next batch is read."""
        if sum(stop - start for _, start, stop in runs) != t.numel() or any(
                x.dtype != t.dtype or not x.is_contiguous() for x, _, _ in runs):
            raise ValueError(f"{self.path}: runs do not match a {t.dtype} tensor of {t.numel()} elements")
        if t.device.type != "meta" or not t.is_contiguous():
            flat, at = self.read(t).reshape(-1), 0
            for x, start, stop in runs:
                x.view(-1)[start:stop].copy_(flat[at:at + stop - start])
                at += stop - start
            return
        item = t.element_size()
        offset, _, record = self._span(t)
        if record is None:
            self._check_record_later(t)
        bytes_of = {}
        views = []
        for x, start, stop in runs:
            if id(x) not in bytes_of:
                bytes_of[id(x)] = memoryview(x.view(-1).view(torch.uint8).numpy())
            for lo in range(start * item, stop * item, _CHUNK):
                views.append(bytes_of[id(x)][lo:min(lo + _CHUNK, stop * item)])
        crc = None
        with open(self.path, "rb", buffering=0) as f:
            i = 0
            while i < len(views):
                batch, want = [], 0  # one preadv: at most IOV_MAX buffers, under Linux's 2 GiB per call
                while i < len(views) and len(batch) < _IOV_MAX and want + views[i].nbytes <= _BATCH:
                    want += views[i].nbytes
                    batch.append(views[i])
                    i += 1
                got = os.preadv(f.fileno(), batch, offset)
                if got != want:
                    raise InteropError(f"{self.path}: truncated (a tensor needs {want} bytes at offset {offset}, "
                                       f"{got} there)")
                offset += want
                if record is not None:  # chained in order on the one CRC thread
                    crc = _CRC_THREAD.submit(_crc_views, batch, crc)
        if record is not None:
            self._check_crc(record, crc.result() if crc is not None else 0)


def _crc_of_range(path, pos: int, nbytes: int) -> int:
    """CRC-32 of `nbytes` of `path` from `pos` (just copied by the kernel: in the page cache), in 64 MiB reads."""
    crc, buf = 0, bytearray(min(nbytes, _CHUNK))
    with open(path, "rb", buffering=0) as f:
        while nbytes:
            view = memoryview(buf)[:min(nbytes, len(buf))]
            got = os.preadv(f.fileno(), [view], pos)
            if got != len(view):
                raise InteropError(f"{path}: truncated (a record needs {len(view)} bytes at offset {pos}, {got} there)")
            crc = zlib.crc32(view, crc)
            pos, nbytes = pos + got, nbytes - got
    return crc


def _crc_views(views, before) -> int:
    crc = 0 if before is None else before.result()
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


_CRC_THREAD = ThreadPoolExecutor(1, thread_name_prefix="interop-read-crc")
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_CHUNK = 64 << 20
_BATCH = 64 << 20  # read this much, then checksum it while reading the next


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class TensorRef:
    """A tensor already written to a `TorchFileWriter`; put it in the object passed to `finish`."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, tuple(shape)

    def stride(self) -> tuple[int, ...]:
        strides, acc = [], 1
        for n in reversed(self.shape):
            strides.append(acc)
            acc *= n
        return tuple(reversed(strides))


class _Pickler(pickle.Pickler):
    """torch.save's pickle: tensors rebuilt by `_rebuild_tensor_v2` over storages named by key."""

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", getattr(torch, STORAGE_TYPES[obj.dtype]), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, TensorRef):
            return (torch._utils._rebuild_tensor_v2,
                    (obj.storage, 0, torch.Size(obj.shape), obj.stride(), False, collections.OrderedDict()))
        if isinstance(obj, torch.Tensor):
            raise TypeError("TorchFileWriter.finish: give tensors through add() first")
        return NotImplemented


class TorchFileWriter:
    """Writes a torch.save zip whose tensors arrive one by one before the object that holds them.

    The zip is ours (`zipfile_writer`): records carry their CRC-32 (computed on a second core
    while writing), so `unzip -t` checks the file and `LazyTorchFile` verifies what it reads;
    a write error (a full disk) is an OSError, never an abort."""

    def __init__(self, path):
        self.path = Path(path)
        self._zip = ZipWriter(self.path, _archive_name(self.path))
        self._writeback = Writeback(self._zip.fd)
        self._background = background.enabled()
        self._count = 0
        self.nbytes = 0

    def add(self, tensor: torch.Tensor) -> TensorRef:
        """Write `tensor`'s bytes (now, or on the helper thread within `background.background_writes`);
        returns the reference to place in the final object."""
        if tensor.dtype not in STORAGE_TYPES:
            raise InteropError(f"{self.path}: cannot store dtype {tensor.dtype}")
        t = tensor.detach().cpu().contiguous()
        key = str(self._count)
        self._count += 1
        nbytes = t.numel() * t.element_size()
        self.nbytes += nbytes
        if self._background:
            background.submit(nbytes, self._write, f"data/{key}", t, self.nbytes)
        else:
            self._write(f"data/{key}", t, self.nbytes)
        return TensorRef(_StorageRef(key, t.dtype, t.numel()), t.shape)

    def _write(self, name: str, t: torch.Tensor, total: int) -> None:
        """One record: the bytes of contiguous `t` (a TP slice of a larger tensor is written without a copy)."""
        self._zip.write_record(name, t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
        self._writeback.wrote(total)

    def finish(self, obj) -> None:
        if self._background:
            background.wait()
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        self._zip.write_record("data.pkl", buf.getbuffer())
        # No `.format_version` record: version 1 promises storages in pickle order (torch then
        # computes offsets instead of looking them up), and ours are in arrival order.
        self._zip.write_record(".storage_alignment", str(ALIGNMENT).encode())
        self._zip.write_record("byteorder", b"little")
        self._zip.write_record("version", b"3\n")
        self._zip.write_record(".data/serialization_id", f"{uuid.uuid4().int:040d}"[:40].encode())
        self._writeback.wait()
        self._zip.close()

    def abort(self) -> None:
        if self._background:
            background.abandon()
        self._writeback.wait()
        self._zip.release()


def append_tensor(fd: int, path, tensor: torch.Tensor) -> int:
    """Append `torch.save(tensor)` at fd's position (our zip: CRCs, no copy of the bytes); returns its length.

    DCP's `.distcp` files are such saves one after another, each found by its byte range."""
    if tensor.dtype not in STORAGE_TYPES:
        raise InteropError(f"{path}: cannot store dtype {tensor.dtype}")
    t = tensor.detach().cpu().contiguous()
    zip_ = ZipWriter(path, "archive", fd=fd)
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(TensorRef(_StorageRef("0", t.dtype, t.numel()), t.shape))
    zip_.write_record("data.pkl", buf.getbuffer())
    zip_.write_record("data/0", t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    zip_.write_record(".storage_alignment", str(ALIGNMENT).encode())
    zip_.write_record("byteorder", b"little")
    zip_.write_record("version", b"3\n")
    zip_.close()
    return zip_.offset


def _archive_name(path: Path) -> str:
    """torch.save names the zip's top folder after the file (`model_optim_rng.pt` -> `model_optim_rng`)."""
    return path.name.rsplit(".", 1)[0] if "." in path.name else path.name
