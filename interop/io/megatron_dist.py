"""Megatron `torch_dist` checkpoints with plain torch: no megatron import, no process group.

A torch_dist checkpoint directory (Megatron-LM's `iter_0000001/`) holds

- `.metadata` + `__{rank}_{k}.distcp`: a PyTorch DCP checkpoint of GLOBAL tensors under
  mcore sharded keys (`decoder.layers.self_attention.linear_qkv.weight`), each written
  as chunks (one per rank-local shard: per layer and TP rank for the stacked layers),
  and byte objects (`..._extra_state/shard_0_2`, `rng_state/...`);
- `common.pt`: a pickle of everything not sharded (`args`, `iteration`, ...);
- `metadata.json`: `{"sharded_backend": "torch_dist", ...}`.

Homogeneous decoder layers are STACKED: their keys carry no layer number and their
first axis is the global layer (`[num_layers, rows, h]`).  What this module returns is
exactly what is stored, by mcore key: stacked global tensors (or one layer of them),
with fused layouts untouched (QKV grouped per query group, swiglu fc1 as
`[gate; up]`).  Mapping mcore keys to canonical names is the converter's job.

Reading plans one DCP read per call, so memory is the tensor asked for plus one stored
chunk.  A chunk is a `torch.save` zip inside its `.distcp` file: its pickle and zip directory are read
to place its tensor bytes, which are then read straight into the tensor (or copied file to file by the
caller, `DistCheckpoint.span`), never through a Python file object.  `.metadata` is itself a pickle: it is loaded with an unpickler that admits only
DCP's metadata classes.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import itertools
import json
import math
import os
import pathlib
import pickle
import re
import tempfile
import uuid
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch

from . import background, dcp_metadata
from .dcp_metadata import (
    CURRENT_DCP_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _StorageInfo,
)
from ..errors import InteropError
from .small_files import read_json
from ..shards import Box, tiling_error
from .megatron_save import TRACKER, iteration_name, read_tracker
from .paths import inside
from .safe_pickle import safe_torch_load
from .torch_file import _BATCH, _CRC_THREAD, _crc_of_range, _crc_views, append_tensor
from .writeback import Writeback
from .zip_records import BadLocalHeader, InflationBomb, check_expansion, zip_records

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # megatron-core 0.19+: ShardedObject("common_state", ..., (1,), (0,))
DCP_METADATA = ".metadata"
# What megatron-core writes to metadata.json; its loader rejects any other field.
BACKEND_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}

_STACKED = re.compile(r"(^|\.)decoder\.layers\.(?!\d)")


def is_stacked(key: str) -> bool:
    """mcore stacks homogeneous layers under `decoder.layers.<module>` (no layer number): axis 0 is the layer."""
    return bool(_STACKED.search(key))


def is_dist_checkpoint(path) -> bool:
    path = Path(path)
    return (path / METADATA_JSON).is_file() and (path / DCP_METADATA).is_file()


def checkpoint_dir(root, iteration: int | None = None) -> Path:
    """The torch_dist directory for `root`: itself, or Megatron's `iter_{:07d}` / `release` under a save root."""
    root = Path(root)
    if is_dist_checkpoint(root):
        return root
    if iteration is None:
        if not (root / TRACKER).is_file():
            raise InteropError(f"{root}: neither a torch_dist checkpoint (metadata.json + .metadata) "
                               "nor a Megatron save directory (latest_checkpointed_iteration.txt)")
        sub = root / iteration_name(read_tracker(root))
    else:
        sub = root / iteration_name(iteration)
    if not is_dist_checkpoint(sub):
        raise InteropError(f"{sub}: not a torch_dist checkpoint (needs metadata.json and .metadata)")
    return sub


# --- reading ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _MCoreMetadata(Metadata):
    """megatron-core 0.15's `MCoreMetadata` (`megatron/core/dist_checkpointing/strategies/torch.py`):
    DCP's Metadata plus `mcore_data` (per-key shape facts).  The pickle's top-level object; it is
    rebuilt as this stand-in so that its fields survive (0.16's own class is an empty marker)."""
    mcore_data: Any = None


_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
_DCP = dcp_metadata.DCP

# Every global a genuine `.metadata` (written by DCP, by megatron-core 0.15/0.16 or by us) names, as an
# exact (module, name) pair, mapped to the light stand-ins of `dcp_metadata` (DCP itself is never imported).
# Nothing else is looked up: pickle would resolve a dotted name such as `os.system` through a module's imports.
_META_GLOBALS = {
    **{real: ours for ours, real in dcp_metadata.DCP_NAMES.items()},
    **{(cls.__module__, cls.__name__): cls for cls in dcp_metadata.DCP_NAMES},  # the stand-ins pickled as themselves
    # save plans that old checkpoints keep in `planner_data`: kept, never used
    **{(f"{_DCP}.planner", n): dcp_metadata.Opaque for n in (
        "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData", "SavePlan")},
    # torch <= 2.2 pickled TensorProperties from here (with the same state)
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): TensorProperties,
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # how torch pickles a layout
    (_MCORE_TORCH, "MCoreMetadata"): _MCoreMetadata,
    (_MCORE_TORCH, "MCoreSavePlan"): dcp_metadata.Opaque,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id may be a Path
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}
# dtypes, layouts and memory formats are pickled by name as attributes of `torch`: plain values, never called
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch.Size and dtypes, by exact name; anything else is refused
    (the file may be hostile).  Nothing is imported on the pickle's say-so."""

    def find_class(self, module, name):
        found = _META_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name.isidentifier() and isinstance(vars(torch).get(name), _TORCH_VALUES):
            return vars(torch)[name]
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


_PICKLE_BYTES = 1 << 20  # what a chunk's torch.save zip holds besides the tensor's record (its pickle, version)
_INFLATE_BLOCK = 1 << 20  # a compressed record is inflated (to check it) this much at a time


class _FileView(io.RawIOBase):
    """Bytes `offset`..`offset + length` of an open file, as a file of their own (what torch.load reads a
    DCP chunk from)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer) -> int:
        want = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, want, self.start + self.pos) if want else b""
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


class _Span(NamedTuple):
    """Where a stored chunk's tensor bytes lie: `nbytes` from `offset` in `file`; `crc`: its zip record's CRC-32
    when the record is exactly these bytes (0: none to check)."""
    file: Path
    offset: int
    nbytes: int
    crc: int


class _Reader:
    """Parses `.metadata` once, safely, and checks it before anything is read: every tensor's chunks tile
    it exactly once, every chunk's file stays inside the checkpoint.  Chunks are read by their byte ranges
    (no DCP load planning, no torch.distributed import)."""

    def __init__(self, path):
        self.path = str(path)
        file = Path(path) / DCP_METADATA
        try:
            with open(file, "rb") as f:
                self._metadata = _MetadataUnpickler(f).load()
        except Exception as exc:  # a damaged or hostile pickle raises many types
            raise InteropError(f"{file}: not a readable DCP metadata file ({_first_line(exc)})") from None
        if not isinstance(self._metadata, Metadata) or not isinstance(
                getattr(self._metadata, "state_dict_metadata", None), dict):
            raise InteropError(f"{file}: not a DCP metadata file")
        try:
            _check_metadata(Path(path), file, self._metadata)
        except (AttributeError, TypeError, ValueError) as exc:  # a damaged pickle builds objects missing fields
            raise InteropError(f"{file}: malformed DCP metadata ({_first_line(exc)})") from None
        self._spans: dict[MetadataIndex, _Span | None] = {}
        self._by_offsets: dict[str, dict] = {}

    def read_metadata(self, *args, **kwargs):
        return self._metadata

    def _chunk_file(self, index: MetadataIndex) -> tuple[Path, _StorageInfo]:
        info = self._metadata.storage_data[index]
        root = Path(self.path)
        return inside(root, info.relative_path, root / DCP_METADATA), info

    def _check_chunk(self, file: Path, index: MetadataIndex, tensor) -> None:
        """`tensor` (read, or its meta stand-in) is exactly the dtype and shape `.metadata` records for the chunk
        (DCP itself would cast whatever it finds into the target)."""
        key = index.fqn
        entry = self._metadata.state_dict_metadata[key]
        sizes = next((c.sizes for c in entry.chunks if c.offsets == index.offset), None)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != entry.properties.dtype \
                or sizes is None or tensor.shape != sizes:
            got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) \
                else type(tensor).__name__
            raise InteropError(f"{file}: the chunk of {key} at {list(index.offset)} holds {got}, .metadata says "
                               f"{entry.properties.dtype} {list(sizes or [])}")

    def load_chunk(self, file: Path, view, index: MetadataIndex) -> torch.Tensor:
        """The stored chunk `index` from `view` (its byte range), loaded by torch (the slow path: through a
        Python file object, for a chunk `span` cannot place), checked against `.metadata`."""
        self._check_compressed(file, view, index)
        view.seek(0)
        tensor = torch.load(view, map_location="cpu", weights_only=True)
        self._check_chunk(file, index, tensor)
        return tensor

    def _check_compressed(self, file: Path, view, index: MetadataIndex) -> None:
        """A chunk's compressed records (DEFLATE: torch.load inflates them) are bounded before torch allocates
        what their directory declares: at most `MAX_EXPANSION` x their bytes (`zip_records.check_expansion`) and
        at most the chunk's tensor bytes `.metadata` records (plus `_PICKLE_BYTES`); each is inflated here once,
        a block at a time, so that its CRC-32 and declared size are checked (torch checks neither).  A chunk of
        stored records (what DCP writes) costs a read of its zip directory."""
        entry = self._metadata.state_dict_metadata[index.fqn]
        sizes = next((c.sizes for c in entry.chunks if c.offsets == index.offset), ())
        need = math.prod(sizes) * entry.properties.dtype.itemsize
        where = f"{file}: the chunk of {index.fqn} at {list(index.offset)}"
        try:
            with zipfile.ZipFile(view) as z:
                check_expansion(z)
                packed = [info for info in z.infolist() if info.compress_type != zipfile.ZIP_STORED]
                declared = sum(info.file_size for info in packed)
                if declared > need + _PICKLE_BYTES:
                    raise InteropError(f"{where}: its compressed records declare {declared:,} bytes, its tensor is "
                                       f"{need:,} bytes (.metadata): a DEFLATE bomb?")
                for info in packed:
                    with z.open(info) as record:
                        while record.read(_INFLATE_BLOCK):
                            pass
        except InflationBomb as exc:
            raise InteropError(f"{where}: {exc}") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError, ValueError) as exc:
            raise InteropError(f"{where}: {_first_line(exc)}: the file is damaged") from None

    def span(self, index: MetadataIndex) -> _Span | None:
        """Where chunk `index`'s tensor bytes lie in its `.distcp` file, when they are one contiguous run of a
        stored (uncompressed) zip record: its `torch.save` zip's pickle and directory are read (a few KB), the
        bytes not.  None for anything else (read then through `load_chunk`).  Cached: a chunk is asked for
        once to be read, or twice when its tensor is fused (q, k and v of one layer)."""
        if index not in self._spans:
            self._spans[index] = self._find_span(index)
        return self._spans[index]

    def _find_span(self, index: MetadataIndex) -> _Span | None:
        file, info = self._chunk_file(index)
        fd = os.open(file, os.O_RDONLY)
        try:
            view = _FileView(fd, info.offset, info.length)
            meta = torch.load(view, map_location="meta", weights_only=True)
            self._check_chunk(file, index, meta)
            start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
            if start is None or not meta.is_contiguous():
                return None
            item = meta.element_size()
            start += meta.storage_offset() * item
            nbytes = meta.numel() * item
            view.seek(0)
            with zipfile.ZipFile(view) as z:
                for record in zip_records(z, fd, info.offset):
                    data = record.offset
                    if data <= start < data + record.size:
                        if not record.stored or start + nbytes > data + record.size or data + record.size > info.length:
                            return None
                        whole = start == data and nbytes == record.size
                        return _Span(file, info.offset + start, nbytes, record.crc if whole else 0)
            return None
        except BadLocalHeader:
            raise InteropError(f"{file}: the chunk of {index.fqn} at {list(index.offset)} is not a "
                               "readable torch.save zip (bad local header)") from None
        finally:
            os.close(fd)

    def read_span(self, span: _Span, out: torch.Tensor) -> torch.Tensor:
        """`span`'s bytes straight into contiguous `out` (os.preadv, no staging copy), checked against the
        record's CRC-32 on a second core while the next batch is read."""
        flat = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if span.nbytes else memoryview(b"")
        crc, pos = None, span.offset
        fd = os.open(span.file, os.O_RDONLY)
        try:
            for lo in range(0, span.nbytes, _BATCH):
                batch = [flat[lo:min(lo + _BATCH, span.nbytes)]]
                got = os.preadv(fd, batch, pos)
                if got != batch[0].nbytes:
                    raise InteropError(f"{span.file}: truncated (a chunk needs {span.nbytes} bytes at offset "
                                       f"{span.offset}, the file ends first)")
                pos += got
                if span.crc:
                    crc = _CRC_THREAD.submit(_crc_views, batch, crc)
        finally:
            os.close(fd)
        if span.crc and (crc.result() if crc is not None else 0) != span.crc:
            raise InteropError(f"{span.file}: a chunk at offset {span.offset} fails its CRC-32 check; the file is "
                               "damaged")
        return out

    def read_chunk(self, index: MetadataIndex, sizes, dtype: torch.dtype) -> torch.Tensor:
        """Stored chunk `index` (of `sizes`), by its byte range when `span` places it, else through torch.load."""
        span = self.span(index)
        if span is not None:
            return self.read_span(span, torch.empty(list(sizes), dtype=dtype))
        file, info = self._chunk_file(index)
        fd = os.open(file, os.O_RDONLY)
        try:
            return self.load_chunk(file, _FileView(fd, info.offset, info.length), index)
        finally:
            os.close(fd)

    def read_box(self, key: str, offsets, sizes) -> torch.Tensor:
        """The box `offsets`/`sizes` of tensor `key`: each stored chunk it meets is read by its byte range
        (no DCP load planning); a box that is exactly one chunk (a layer, a whole tensor) is that chunk."""
        entry = self._metadata.state_dict_metadata[key]
        out = None
        if math.prod(sizes) == 0:
            return torch.empty(list(sizes), dtype=entry.properties.dtype)
        for chunk in self._chunks_in(key, entry, offsets, sizes):
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + n, c + m) for o, n, c, m in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            tensor = self.read_chunk(MetadataIndex(key, chunk.offsets), chunk.sizes, entry.properties.dtype)
            if list(chunk.offsets) == list(offsets) and list(chunk.sizes) == list(sizes):
                return tensor
            if out is None:
                out = torch.empty(list(sizes), dtype=entry.properties.dtype)
            src = tensor[tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))].copy_(src)
        return out

    def box_span(self, key: str, offsets, sizes) -> _Span | None:
        """The span of box `offsets`/`sizes` of `key` when it is exactly one stored chunk that `span` places."""
        entry = self._metadata.state_dict_metadata[key]
        chunk = self._chunk_at(key, entry).get(tuple(offsets))
        if chunk is None or list(chunk.sizes) != list(sizes):
            return None
        return self.span(MetadataIndex(key, chunk.offsets))

    def _chunk_at(self, key: str, entry: TensorStorageMetadata) -> dict:
        """{offsets: chunk} of a tensor's chunks (built once per tensor: a stacked key has one per layer)."""
        found = self._by_offsets.get(key)
        if found is None:
            found = self._by_offsets[key] = {tuple(c.offsets): c for c in entry.chunks}
        return found

    def _chunks_in(self, key: str, entry: TensorStorageMetadata, offsets, sizes) -> list:
        """The chunks that meet the box: the one starting at `offsets` when it is the box (a layer), else a scan."""
        chunk = self._chunk_at(key, entry).get(tuple(offsets))
        if chunk is not None and list(chunk.sizes) == list(sizes):
            return [chunk]
        return [c for c in entry.chunks
                if all(max(o, a) < min(o + n, a + m) for o, n, a, m in zip(offsets, sizes, c.offsets, c.sizes))]

    def read_bytes(self, key: str) -> bytes:
        """The raw bytes of byte object `key` (its storage entry's byte range)."""
        info = self._metadata.storage_data[MetadataIndex(key)]
        root = Path(self.path)
        with open(inside(root, info.relative_path, root / DCP_METADATA), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise InteropError(f"{root / info.relative_path}: {key} is cut short ({len(data)} of {info.length} bytes)")
        return data


def _is_size(value) -> bool:
    return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)


def _check_metadata(root: Path, file: Path, md: Metadata) -> None:
    """Refuse (one line) what would make a read wrong rather than fail: chunks that overlap, leave
    elements uncovered or lie outside their tensor, and storage entries naming files outside `root`."""
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise InteropError(f"{file}: no storage table (storage_data)")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise InteropError(f"{file}: malformed storage entry {index!r}")
        inside(root, info.relative_path, file)
        if not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
            raise InteropError(f"{file}: {index.fqn}: invalid byte range ({info.offset!r}, {info.length!r})")
        if info.transform_descriptors:
            raise InteropError(f"{file}: {index.fqn}: stored with transforms {list(info.transform_descriptors)} "
                               "(compression or encryption), which this reader does not apply")
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata) or not _is_size(entry.size) \
                or not isinstance(getattr(entry.properties, "dtype", None), torch.dtype) \
                or not isinstance(entry.chunks, list):
            raise InteropError(f"{file}: malformed entry for {key!r}")
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not _is_size(chunk.offsets) or not _is_size(chunk.sizes) \
                    or not len(chunk.offsets) == len(chunk.sizes) == len(entry.size) \
                    or any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, entry.size)):
                raise InteropError(f"{file}: {key}: a chunk lies outside the tensor's shape {list(entry.size)}")
            if MetadataIndex(key, chunk.offsets) not in storage:
                raise InteropError(f"{file}: {key}: chunk at {list(chunk.offsets)} has no storage entry")
        if _regular_grid(entry.size, entry.chunks):
            continue
        why = tiling_error(entry.size, [Box(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks])
        if why:
            raise InteropError(f"{file}: {key}: {why}")


def _regular_grid(size, chunks) -> bool:
    """Whether `chunks` (checked to lie inside `size`) are all one shape and sit at distinct multiples of it,
    as many as the grid has cells: then they tile the tensor exactly, seen in one pass.  mcore's stacked keys
    are such grids ([layers, experts, ...] in [1, 1, ...] chunks); `tiling_error`'s sweep compares a layer's
    chunks pairwise (9 s for one key of 61 layers x 256 experts)."""
    if not chunks:
        return False
    sizes = tuple(chunks[0].sizes)
    if any(n <= 0 or d % n for n, d in zip(sizes, size)):
        return False
    seen = set()
    for c in chunks:
        offsets = tuple(c.offsets)
        if tuple(c.sizes) != sizes or any(o % n for o, n in zip(offsets, sizes)) or offsets in seen:
            return False
        seen.add(offsets)
    return len(seen) == math.prod(d // n for n, d in zip(sizes, size))


class DcpCheckpoint:
    """One PyTorch DCP folder (`.metadata` + `*.distcp`), read lazily and without a process group.

    `.keys()` (tensor keys), `.objects()` (byte-object keys), `.meta(key)` -> (dtype, global shape),
    `.read(key, layer=None)` -> the global tensor, or layer `layer` of a stacked one."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / DCP_METADATA).is_file():
            raise InteropError(f"{self.path}: not a PyTorch DCP checkpoint (no .metadata)")
        self._reader = _Reader(self.path)
        self._later = {}  # {(file, offset): (span, future CRC-32)} of chunks copied file to file
        entries = self._reader.read_metadata().state_dict_metadata
        self._tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
        self._objects = [k for k, v in entries.items() if isinstance(v, BytesStorageMetadata)]

    def keys(self) -> list[str]:
        return list(self._tensors)

    def objects(self) -> list[str]:
        """Keys of byte objects (`*._extra_state/shard_*`, `rng_state/*`, ...): not tensors, not read here
        (0.19's `common_state` is `.common`)."""
        return [k for k in self._objects if k != COMMON_STATE]

    def __contains__(self, key) -> bool:
        return key in self._tensors

    def meta(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        md = self._entry(key)
        return md.properties.dtype, tuple(md.size)

    def _entry(self, key: str) -> TensorStorageMetadata:
        try:
            return self._tensors[key]
        except KeyError:
            raise InteropError(f"{self.path}: no tensor named {key!r}") from None

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor `key`, or index `layer` of its leading (stacked-layer) axis."""
        dtype, shape = self.meta(key)
        offsets, sizes = [0] * len(shape), list(shape)
        if layer is not None:
            if not shape or not 0 <= layer < shape[0]:
                raise InteropError(f"{self.path}: {key} has no layer {layer} (shape {list(shape)})")
            offsets[0], sizes[0] = layer, 1
        out = self.read_box(key, offsets, sizes)
        return out[0] if layer is not None else out

    def read_object(self, key: str):
        """Byte object `key` (megatron-core stores a ShardedObject as `torch.save([value])`), unpickled safely."""
        if key not in self._objects:
            raise InteropError(f"{self.path}: no byte object named {key!r}")
        try:
            raw = self._reader.read_bytes(key)
        except InteropError:
            raise
        except Exception as exc:  # a missing or damaged file surfaces as many types
            raise InteropError(f"{self.path}: cannot read {key} ({_first_line(exc)})") from None
        with tempfile.TemporaryDirectory(prefix="interop-object-") as tmp:
            file = Path(tmp) / "object.pt"
            file.write_bytes(raw)
            value = _load_pickle(file)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def read_box(self, key: str, offsets, sizes) -> torch.Tensor:
        """The box `offsets` / `sizes` of global tensor `key` (e.g. one parameter's run of a flat buffer)."""
        return self._guarded(key, offsets, sizes, self._reader.read_box)

    def span(self, key: str, offsets, sizes) -> tuple[str, int, int] | None:
        """(file, offset, bytes) of the box `offsets` / `sizes` of `key` when it is exactly one stored chunk
        whose tensor bytes are one contiguous run of its file (a layer of a stacked key, a whole tensor): a
        copy can take them from there.  None otherwise."""
        span = self._guarded(key, offsets, sizes, self._reader.box_span)
        return None if span is None else (str(span.file), span.offset, span.nbytes)

    def check_later(self, key: str, offsets, sizes) -> None:
        """The box's bytes were copied file to file (`span`): check its record's CRC-32 on the CRC thread, as
        `read_box` would have; `confirm` reports it.  Each record once."""
        span = self._guarded(key, offsets, sizes, self._reader.box_span)
        if span is not None and span.crc and (span.file, span.offset) not in self._later:
            self._later[(span.file, span.offset)] = (span, _CRC_THREAD.submit(_crc_of_range, span.file, span.offset,
                                                                              span.nbytes))

    def confirm(self) -> None:
        """Raise if a chunk `check_later` was asked for fails its CRC-32."""
        later, self._later = self._later, {}
        for span, crc in later.values():
            if crc.result() != span.crc:
                raise InteropError(f"{span.file}: a chunk at offset {span.offset} fails its CRC-32 check; the file "
                                   "is damaged")

    def _guarded(self, key: str, offsets, sizes, job):
        dtype, shape = self.meta(key)
        if len(offsets) != len(shape) or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            raise InteropError(f"{self.path}: {key} {list(shape)} has no box at {list(offsets)} of {list(sizes)}")
        try:
            return job(key, offsets, sizes)
        except InteropError:
            raise
        except Exception as exc:  # missing/damaged .distcp files surface as many types
            raise InteropError(f"{self.path}: cannot read {key} ({_first_line(exc)})") from None


class DistCheckpoint(DcpCheckpoint):
    """One torch_dist checkpoint directory, read lazily.

    `.config` (metadata.json), `.common` (common.pt, loaded on first use), `.keys()` (tensor
    keys), `.objects()` (byte-object keys), `.meta(key)` -> (dtype, global shape), and
    `.read(key, layer=None)` -> the global tensor, or layer `layer` of a stacked one.
    """

    def __init__(self, path):
        path = Path(path)
        config_file = path / METADATA_JSON
        if not config_file.is_file() or not (path / DCP_METADATA).is_file():
            raise InteropError(f"{path}: not a torch_dist checkpoint (needs metadata.json and .metadata)")
        self.config = read_json(config_file, "torch_dist metadata.json", 1 << 20)  # bounded; nesting refused
        backend = self.config.get("sharded_backend") if isinstance(self.config, dict) else None
        if backend != "torch_dist":
            raise InteropError(f"{config_file}: sharded_backend is {backend!r}; only 'torch_dist' is supported")
        super().__init__(path)
        self._common = None

    @property
    def common(self) -> dict:
        """common.pt (args, iteration, ...), unpickled without running code; {} when absent.  megatron-core
        0.19 writes no common.pt: the same dict is the byte object `common_state` inside the DCP files
        (megatron/core/dist_checkpointing/serialization.py, `load_common_state_dict`)."""
        if self._common is None:
            file = self.path / COMMON_PT
            if file.is_file():
                self._common = _load_pickle(file)
            elif COMMON_STATE in self._objects:
                file = self.path / DCP_METADATA
                self._common = self.read_object(COMMON_STATE)
            else:
                self._common = {}
            if not isinstance(self._common, dict):
                raise InteropError(f"{file}: expected a dict, found {type(self._common).__name__}")
        return self._common

    @property
    def mcore_data(self) -> dict:
        """megatron-core 0.15's per-key facts from `MCoreMetadata.mcore_data` (e.g.
        `nd_reformulated_orig_global_shape`); {} for other writers."""
        return getattr(self._reader.read_metadata(), "mcore_data", None) or {}


def _load_pickle(file: Path):
    """common.pt may hold megatron classes (args enums): the shared safe loader handles those."""
    return safe_torch_load(file)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- writing ---------------------------------------------------------------------------------------------

class LazyTensor(NamedTuple):
    """A tensor produced only when written: `load(layer)` returns layer `layer` of a stacked key
    (without the layer axis), `load(None)` the whole tensor of any other key."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[int | None], torch.Tensor]


class DistWriter:
    """Writes a torch_dist checkpoint a chunk at a time, as DCP lays it out, without DCP's planning.

    Each chunk goes to the `.distcp` file `file_of(key, layer)` names (`__{n}_0.distcp`; default: all to
    `__0_0.distcp`), appended there as a `torch.save` of it (stacked keys one chunk per layer, `[1, ...]`,
    as mcore stores them); byte objects go to file 0 as their raw bytes.  `.metadata` (DCP's `Metadata`:
    per key its chunks, per chunk its file and byte range) is written last, by `finish`, after checking
    that every declared chunk arrived exactly once.  Chunks are written the moment they are given, in any
    order: memory is the chunk in hand.  Within `background.background_writes` (the conversion engine) they
    are written on the helper thread, in the order given, while the caller reads the next (up to
    `background.LIMIT` bytes queued); each chunk's byte range is recorded there, once it is written.

    `only`: the files this writer writes, for a checkpoint written by several processes
    (`interop.workers`): each closes its files with `close_files()`, which returns their storage
    entries, and one writer adds them all (`add_storage`) before `finish`.
    """

    FILE = "__0_0.distcp"

    def __init__(self, path, file_of: Callable[[str, int | None], int] | None = None, only=None):
        self.path = Path(path)
        if only is None and self.path.exists() and any(self.path.iterdir()):
            raise InteropError(f"{self.path}: destination is not empty")
        self.path.mkdir(parents=True, exist_ok=True)
        self.file_of = file_of or (lambda key, layer: 0)
        self.only = only
        self.open_files: dict[int, tuple[int, Writeback]] = {}
        self.offsets: dict[int, int] = {}
        self.declared: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.lead: dict[str, int] = {}  # leading axes written one index at a time (layer; layer, expert)
        self.objects: list[str] = []
        self.storage: dict[MetadataIndex, _StorageInfo] = {}  # filled as chunks are written (maybe on the helper)
        self.given: set[MetadataIndex] = set()  # chunks handed to `write`, written or queued
        self._background = background.enabled()

    @staticmethod
    def file_name(unit: int) -> str:
        return f"__{unit}_0.distcp"

    def _fd(self, unit: int) -> int:
        if unit not in self.open_files:
            fd = os.open(self.path / self.file_name(unit), os.O_WRONLY | os.O_CREAT, 0o666)
            self.offsets[unit] = os.lseek(fd, 0, os.SEEK_END)
            self.open_files[unit] = (fd, Writeback(fd))
        return self.open_files[unit][0]

    def declare(self, key: str, dtype: torch.dtype, shape, lead: int | None = None) -> None:
        """Tensor `key` of global `shape` will be written: per layer if stacked, else whole; `lead` overrides
        how many leading axes are written one index at a time (mcore's routed experts: [layers, experts, ...]
        stacked, [experts, ...] in a model of mixed layers)."""
        if key in self.declared:
            raise ValueError(f"duplicate tensor key {key!r}")
        lead = (1 if is_stacked(key) else 0) if lead is None else lead
        if is_stacked(key) and not shape or len(shape) < lead:
            raise ValueError(f"{key}: a stacked key needs a leading layer axis")
        self.declared[key] = (dtype, tuple(shape))
        self.lead[key] = lead

    def write(self, key: str, layer, data: torch.Tensor) -> None:
        """Layer `layer` of stacked `key` (without the layer axis; a (layer, expert) pair for a `lead=2` key),
        or (layer None) the whole tensor `key`."""
        dtype, shape = self.declared[key]
        lead = self.lead[key]
        at = () if layer is None else tuple(layer) if isinstance(layer, tuple) else (layer,)
        if len(at) != lead or any(not 0 <= i < n for i, n in zip(at, shape)):
            raise ValueError(f"{key}: {lead} leading indices in range expected, got {layer}")
        want = shape[lead:]
        if tuple(data.shape) != tuple(want) or data.dtype != dtype:
            raise ValueError(f"{key}: planned {dtype} {list(want)}, got {data.dtype} {list(data.shape)}")
        offsets = torch.Size(list(at) + [0] * (len(shape) - lead))
        index = MetadataIndex(key, offsets)
        if index in self.given:
            raise ValueError(f"{key}: layer {layer} written twice")
        unit = self.file_of(key, layer)
        if self.only is not None and unit not in self.only:
            raise ValueError(f"{key} (layer {layer}) belongs to {self.file_name(unit)}, not this writer's")
        self.given.add(index)
        self._fd(unit)
        chunk = data.reshape((1,) * lead + tuple(want))
        if self._background:
            background.submit(chunk.numel() * chunk.element_size(), self._append, unit, index, chunk)
        else:
            self._append(unit, index, chunk)

    def _append(self, unit: int, index: MetadataIndex, chunk: torch.Tensor) -> None:
        length = append_tensor(self.open_files[unit][0], self.path / self.file_name(unit), chunk)
        self._stored(unit, index, length)

    def _drain(self) -> None:
        """Wait for the chunks queued on the helper thread (their byte ranges are known after)."""
        if self._background:
            background.wait()

    def write_object(self, key: str, value) -> None:
        """A ShardedObject as mcore stores it: `torch.save([value])`, raw bytes in file 0."""
        self.write_pickled(key, [value])

    def write_pickled(self, key: str, value) -> None:
        """A byte object as DCP's own save stores a non-tensor value: `torch.save(value)`, raw bytes in file 0."""
        if key in self.objects or key in self.declared:
            raise ValueError(f"duplicate key {key!r}")
        self._drain()  # file 0's end is where the queued chunks end
        buffer = io.BytesIO()
        torch.save(value, buffer)
        raw = buffer.getbuffer()
        view, done = memoryview(raw), 0
        fd = self._fd(0)
        while done < len(view):
            done += os.write(fd, view[done:])
        self.objects.append(key)
        self._stored(0, MetadataIndex(key), len(view))

    def rename(self, new_key: Callable[[str], str]) -> None:
        """Store tensor keys under other names (decided only once the source's state is known)."""
        names = {key: new_key(key) for key in self.declared}
        if len(set(names.values())) != len(names) or set(names.values()) & set(self.objects):
            raise ValueError("renaming makes two keys one")
        self._drain()
        self.declared = {names[k]: v for k, v in self.declared.items()}
        self.lead = {names[k]: v for k, v in self.lead.items()}
        self.storage = {MetadataIndex(names.get(i.fqn, i.fqn), i.offset): info for i, info in self.storage.items()}

    def _stored(self, unit: int, index: MetadataIndex, length: int) -> None:
        self.storage[index] = _StorageInfo(self.file_name(unit), self.offsets[unit], length)
        self.offsets[unit] += length
        self.open_files[unit][1].wrote(self.offsets[unit])

    def close_files(self) -> dict:
        """Close the files written so far; returns their storage entries ({MetadataIndex: _StorageInfo})."""
        self._drain()
        while self.open_files:
            _, (fd, writeback) = self.open_files.popitem()
            writeback.wait()
            os.close(fd)
        return dict(self.storage)

    def add_storage(self, storage: dict) -> None:
        """Storage entries of chunks other writers wrote into this checkpoint's files."""
        self._drain()
        twice = next((i for i in storage if i in self.storage), None)
        if twice is not None:
            raise InteropError(f"{self.path}: {twice.fqn} at {list(twice.offset)} was written twice")
        self.storage.update(storage)

    def finish(self, common: dict | None = None) -> None:
        """`.metadata`, common.pt and metadata.json; refuses if a declared chunk never came."""
        self.write_metadata()
        torch.save(common or {}, self.path / COMMON_PT)
        (self.path / METADATA_JSON).write_text(json.dumps(BACKEND_CONFIG))

    def write_metadata(self) -> None:
        """DCP's `.metadata` alone (a plain DCP checkpoint ends here); refuses if a declared chunk never came."""
        self._drain()
        entries: dict[str, Any] = {}
        for key, (dtype, shape) in self.declared.items():
            size, lead = torch.Size(shape), self.lead[key]
            indices = itertools.product(*(range(n) for n in size[:lead]))
            chunks = [ChunkStorageMetadata(torch.Size([*at] + [0] * (len(size) - lead)), torch.Size([1] * lead + [*size[lead:]]))
                      for at in indices]
            missing = next((c for c in chunks if MetadataIndex(key, c.offsets) not in self.storage), None)
            if missing is not None:
                raise InteropError(f"{self.path}: {key} at {list(missing.offsets)} was never written")
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, chunks)
        entries.update({key: BytesStorageMetadata() for key in self.objects})
        self.close_files()
        # in file order (the same whichever process wrote which file)
        storage = dict(sorted(self.storage.items(), key=lambda item: (_file_number(item[1].relative_path),
                                                                       item[1].offset)))
        metadata = Metadata(state_dict_metadata=entries, planner_data=None, storage_data=storage,
                            storage_meta=StorageMeta(checkpoint_id=str(self.path), save_id=str(uuid.uuid4())),
                            version=CURRENT_DCP_VERSION)
        with open(self.path / DCP_METADATA, "wb") as f:
            dcp_metadata.dump(metadata, f)  # what DCP's pickle.dump writes, without importing DCP

    def abort(self) -> None:
        if self._background:
            background.abandon()
        for fd, writeback in self.open_files.values():
            writeback.wait()
            os.close(fd)
        self.open_files = {}


def _file_number(name: str) -> int:
    m = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return int(m.group(1)) if m else -1


def _as_lazy(value) -> LazyTensor:
    if isinstance(value, LazyTensor):
        return value
    if isinstance(value, torch.Tensor):
        return LazyTensor(value.dtype, tuple(value.shape), lambda layer: value if layer is None else value[layer])
    raise TypeError(f"expected a torch.Tensor or LazyTensor, got {type(value).__name__}")


def write_dist_checkpoint(path, tensors: Iterable[tuple[str, Any]], common: dict | None = None,
                          objects: dict[str, Any] | None = None) -> None:
    """Write a torch_dist checkpoint that megatron-core's `dist_checkpointing.load` accepts.

    `tensors`: (mcore key, global tensor or LazyTensor) pairs; stacked keys (`decoder.layers.<module>`)
    are stored one chunk per layer, as mcore does, so a reader can fetch one layer alone.  LazyTensors
    are loaded one at a time while writing (memory: one chunk).  `objects`: byte objects by their
    full mcore key (e.g. `decoder.layers.mlp.linear_fc1._extra_state/shard_0_2`), stored as mcore
    stores a ShardedObject (`torch.save([value])`); mcore's loader needs one for every ShardedObject
    its model declares.  `common` goes to common.pt (Megatron-LM: args, checkpoint_version,
    iteration, ...).  `path` must be empty or absent.
    """
    writer = DistWriter(path)
    try:
        planned = [(key, _as_lazy(value)) for key, value in tensors]
        for key, t in planned:
            writer.declare(key, t.dtype, t.shape)
        for key, value in (objects or {}).items():
            writer.write_object(key, value)
        for key, t in planned:
            for layer in (range(t.shape[0]) if is_stacked(key) else [None]):
                writer.write(key, layer, t.load(layer))
        writer.finish(common)
    finally:
        writer.abort()
