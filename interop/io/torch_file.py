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
import zipfile
from pathlib import Path

import torch

from ..errors import InteropError
from . import background
from .safe_pickle import plan_globals, safe_torch_load
from .writeback import Writeback

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


class LazyTorchFile:
    """The object in a torch.save file, its tensors as meta-device stand-ins read on demand."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise InteropError(f"{self.path}: no such file")
        self.lazy = zipfile.is_zipfile(self.path)
        if not self.lazy:  # the pre-1.6 format: no offsets to read from, load it whole
            self.obj = safe_torch_load(self.path, mmap=False)
            return
        entries, self.placeholders = plan_globals(self.path, _globals_in(self.path))
        try:
            with torch.serialization.safe_globals(entries):
                self.obj = torch.load(self.path, map_location="meta", weights_only=True)
        except Exception as exc:
            raise InteropError(f"{self.path}: cannot load safely ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """The real contents of tensor `t` from this file's structure (a fresh CPU tensor)."""
        if t.device.type != "meta":
            return t.clone()
        storage = t.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None:
            raise InteropError(f"{self.path}: a tensor without a record offset (not a torch.save file?)")
        item = t.element_size()
        # the span of the storage this view covers
        if t.numel() == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        start, count = t.storage_offset(), last - t.storage_offset() + 1
        buf = bytearray(count * item)
        with open(self.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], offset + start * item)
        if got != len(buf):
            raise InteropError(f"{self.path}: truncated (a tensor needs {len(buf)} bytes at offset "
                               f"{offset + start * item}, {got} there)")
        flat = torch.frombuffer(buf, dtype=t.dtype) if buf else torch.empty(0, dtype=t.dtype)
        if t.is_contiguous():
            return flat.view(t.shape)
        return flat.as_strided(t.shape, t.stride()).clone()


    def read_into(self, t: torch.Tensor, runs: list[tuple[torch.Tensor, int, int]]) -> None:
        """Read tensor `t`'s elements straight into `runs`, (contiguous tensor, start, stop) element ranges
        of their flattened targets in the order `t` stores its elements: scattered reads, no staging copy."""
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
        offset = t.untyped_storage()._checkpoint_offset + t.storage_offset() * item
        bytes_of = {}
        views = []
        for x, start, stop in runs:
            if id(x) not in bytes_of:
                bytes_of[id(x)] = memoryview(x.view(-1).view(torch.uint8).numpy())
            for lo in range(start * item, stop * item, _CHUNK):
                views.append(bytes_of[id(x)][lo:min(lo + _CHUNK, stop * item)])
        with open(self.path, "rb", buffering=0) as f:
            i = 0
            while i < len(views):
                batch, want = [], 0  # one preadv: at most IOV_MAX buffers, under Linux's 2 GiB per call
                while i < len(views) and len(batch) < _IOV_MAX and want + views[i].nbytes <= 4 * _CHUNK:
                    want += views[i].nbytes
                    batch.append(views[i])
                    i += 1
                got = os.preadv(f.fileno(), batch, offset)
                if got != want:
                    raise InteropError(f"{self.path}: truncated (a tensor needs {want} bytes at offset {offset}, "
                                       f"{got} there)")
                offset += want


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_CHUNK = 256 << 20


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

    Records carry no CRC-32, as with torch's own `compute_crc32=False` setting: torch.load never
    checks it, and computing it cost a third of a Megatron conversion's time."""

    def __init__(self, path):
        self.path = Path(path)
        self._zip = torch._C.PyTorchFileWriter(str(self.path), False, torch.serialization._get_storage_alignment())
        self._fd = os.open(self.path, os.O_RDONLY)  # to start writeback early: torch's writer keeps its own
        self._writeback = Writeback(self._fd)
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
        storage = t.untyped_storage()
        if storage.nbytes() != nbytes:  # a view into a larger tensor (a TP slice): its bytes, without a copy
            start = t.storage_offset() * t.element_size()
            storage = storage[start:start + nbytes]
        self.nbytes += nbytes
        if self._background:
            background.submit(nbytes, self._write, f"data/{key}", storage, nbytes, self.nbytes, t)
        else:
            self._write(f"data/{key}", storage, nbytes, self.nbytes, t)
        return TensorRef(_StorageRef(key, t.dtype, t.numel()), t.shape)

    def _write(self, name: str, storage, nbytes: int, total: int, owner: torch.Tensor) -> None:
        """One record; `owner` keeps the memory under `storage` alive (and out of its pool) until written."""
        self._zip.write_record(name, storage, nbytes)
        self._writeback.wrote(total)

    def finish(self, obj) -> None:
        if self._background:
            background.wait()
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        # No `.format_version` record: version 1 promises storages in pickle order (torch then
        # computes offsets instead of looking them up), and ours are in arrival order.
        alignment = str(torch.serialization._get_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", "little", len("little"))
        self._zip.write_end_of_file()
        self._zip = None
        self._close_fd()

    def abort(self) -> None:
        if self._background:
            background.abandon()
        self._zip = None
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            self._writeback.wait()
            os.close(self._fd)
            self._fd = None
