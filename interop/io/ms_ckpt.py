"""MindSpore `.ckpt` files read and written without mindspore.

Why our own?  `mindspore.load_checkpoint` reads the whole file into one bytes
object, parses it into protobuf objects and copies every tensor twice more, so it
needs several times the checkpoint in RAM; `save_checkpoint` needs every tensor
in memory at once.  The format is simple enough to walk by hand:

    file  = Value* [b"crc_num" + crc32 as 10 big-endian bytes]
    Value = 0x0a len Checkpoint.Value{1: tag (string), 2: TensorProto, 3: MapTensorProto}
    TensorProto{1: dims (int64, one unpacked varint each), 2: tensor_type (string),
                3: tensor_content (raw little-endian bytes)}

Each Value is a one-element `Checkpoint` message, written back to back.  A tensor
over 512 MiB is cut into consecutive Values with the same tag and the full dims
whose contents concatenate.  0-d tensors (the `append_dict` scalars) have no dims;
strings have dims [0], type "str" and UTF-32-LE content.  The crc32 covers every
byte before the trailer.

`CkptFile` indexes the Values by pread of a small window at each Value's start (only
headers are read: no tensor byte is read, paged in or mapped), so listing is cheap and
a process that only indexes (the parent of `--workers`) holds no tensor memory; `read`
preads one tensor into its own buffer (memory bounded by the largest tensor),
`read_into` fills the caller's buffers (a gather straight into place), `byte_ranges`
names a tensor's bytes as file ranges (for a kernel copy), `view` maps the file (only
when asked) and returns a zero-copy view when the tensor is one aligned chunk.

Why not index over mmap, as before: every header touched maps its page and the pages
around it (fault-around, whole large folios on recent kernels), which stay in the
process's RSS; at 7B (32 rank files, 8 layers each) that was ~1.4 GB in every process
that opened the checkpoint, the parent of `--workers` included.  `CkptWriter` streams Values one tensor at a time; its bytes equal
`mindspore.save_checkpoint`'s (synchronous save, the default) for the same tensors.
"""
from __future__ import annotations

import mmap
import os
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InteropError
from .safetensors import SafetensorsFile, SafetensorsWriter

SLICE_BYTES = 512 << 20  # mindspore's SLICE_SIZE (KiB) * 1024: the largest content of one Value
CRC_MAGIC = b"crc_num"
CRC_TRAILER = len(CRC_MAGIC) + 10
# mindspore's encrypted files (AES-GCM, AES-CBC, SM4-CBC) start with one of these 4-byte magics.
CIPHER_MAGICS = (b"\xd8^:\x7f", b"\xd9^:\x7f", b"\xda^:\x7f")

TYPES = {
    "Float32": torch.float32, "Float16": torch.float16, "Float64": torch.float64, "BFloat16": torch.bfloat16,
    "Int8": torch.int8, "Int16": torch.int16, "Int32": torch.int32, "Int64": torch.int64,
    "UInt8": torch.uint8, "UInt16": torch.uint16, "UInt32": torch.uint32, "UInt64": torch.uint64,
    "Bool": torch.bool,
}
TYPE_OF_DTYPE = {v: k for k, v in TYPES.items()}
STR_TYPE = "str"
# Values per file, checked while indexing (~15 us each): a rank file holds a few dozen scalars (step,
# epoch, optimizer groups, scheduler, rng) and at most some 200,000 tensors (a whole MoE model with
# its moments); a file of a million tiny Values is a bomb, refused before it costs minutes and GBs.
MAX_SCALARS = 10_000
MAX_VALUES = 1_000_000


# ---------------------------------------------------------------- reading

@dataclass(frozen=True)
class Entry:
    """One tag: its MindSpore type name, shape and the (offset, length) of each content chunk."""
    tag: str
    type: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype, None for a string."""
        return TYPES.get(self.type)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.chunks)


class _Corrupt(Exception):
    """Internal: a wire-format violation at some offset; turned into an InteropError with the path."""


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise _Corrupt("varint runs past the end")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _Corrupt("varint longer than 10 bytes")


def _field(buf, pos: int, end: int) -> tuple[int, int, int, int]:
    """Next field: (number, wire type, value or payload offset, position after it)."""
    key, pos = _varint(buf, pos, end)
    number, wire = key >> 3, key & 7
    if wire == 0:
        value, pos = _varint(buf, pos, end)
        return number, wire, value, pos
    if wire == 2:
        n, pos = _varint(buf, pos, end)
        if pos + n > end:
            raise _Corrupt(f"field {number} of {n} bytes runs past the end (truncated?)")
        return number, wire, pos, pos + n
    if wire == 1 and pos + 8 <= end:
        return number, wire, pos, pos + 8
    if wire == 5 and pos + 4 <= end:
        return number, wire, pos, pos + 4
    raise _Corrupt(f"field {number} has wire type {wire}, not a checkpoint field")


def _tensor_proto(buf, pos: int, end: int):
    dims, ttype, content = [], None, None
    while pos < end:
        number, wire, value, pos = _field(buf, pos, end)
        if number == 1 and wire == 0:
            dims.append(value)
        elif number == 1 and wire == 2:  # packed dims, as proto3 writers emit them
            p = value
            while p < pos:
                d, p = _varint(buf, p, pos)
                dims.append(d)
        elif number == 2 and wire == 2:
            ttype = bytes(buf[value:pos]).decode("utf-8", "replace")
        elif number == 3 and wire == 2:
            content = (value, pos - value)
    if ttype is None or content is None:
        raise _Corrupt("tensor without tensor_type or tensor_content")
    return tuple(dims), ttype, content


def _value(buf, pos: int, end: int):
    tag = tensor = None
    while pos < end:
        number, wire, value, pos = _field(buf, pos, end)
        if number == 1 and wire == 2:
            tag = bytes(buf[value:pos]).decode("utf-8", "replace")
        elif number == 2 and wire == 2:
            tensor = _tensor_proto(buf, value, pos)
        elif number == 3:
            raise _Corrupt(f"{tag!r} is a MapParameter (maptensor), which is not supported")
    if tag is None or tensor is None:
        raise _Corrupt("a value without tag or tensor")
    return tag, tensor


class _Window:
    """The file as `buf[i]` / `buf[a:b]` for the wire parser, read by pread of a small window around
    the position asked for: the parser skips each tensor's content by its length, so indexing
    reads the Values' headers and never the tensors between them."""

    SIZE = 16 << 10

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.start, self.data = 0, b""

    def _load(self, pos: int, n: int) -> None:
        self.start, self.data = pos, os.pread(self.fd, max(n, min(self.SIZE, self.size - pos)), pos)
        if len(self.data) < n:
            raise _Corrupt("unexpected end of file")

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b = key.start, key.stop
            if not (self.start <= a and b <= self.start + len(self.data)):
                self._load(a, b - a)
            return self.data[a - self.start:b - self.start]
        if not (self.start <= key < self.start + len(self.data)):
            self._load(key, 1)
        return self.data[key - self.start]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class CkptFile:
    """A MindSpore `.ckpt` indexed over mmap; tensors are read on demand.

    With `verify` (the default) a file that ends in a crc trailer has its crc32
    checked at open, which reads the whole file; `verify=False` only touches the
    Value headers.  Encrypted files are refused (we never decrypt).
    """

    def __init__(self, path, verify: bool = True):
        self.path = os.fspath(path)
        self._mm = None
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise InteropError(f"{self.path}: cannot open ({exc.strerror})") from None
        try:
            self._open(verify)
        except BaseException:
            self.close()
            raise

    def _open(self, verify: bool) -> None:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 4, 0)
        if head in CIPHER_MAGICS:
            raise InteropError(f"{self.path}: the checkpoint is encrypted (enc_key/enc_mode); "
                               "decrypt it with mindspore first, interop does not handle keys")
        end, self.crc = size, None
        if size >= CRC_TRAILER and os.pread(self._fd, len(CRC_MAGIC), size - CRC_TRAILER) == CRC_MAGIC:
            end = size - CRC_TRAILER
            self.crc = int.from_bytes(os.pread(self._fd, 10, end + len(CRC_MAGIC)), "big")
            if verify:
                got = _crc32_range(self._fd, 0, end)
                if got != self.crc:
                    raise InteropError(f"{self.path}: crc check failed (file says {self.crc:08x}, "
                                       f"contents give {got:08x}): the checkpoint is damaged")
        if end and head[:1] != b"\x0a":
            raise InteropError(f"{self.path}: not a MindSpore checkpoint (first byte {head[:1].hex()}, "
                               "expected a protobuf value)")
        self.entries: dict[str, Entry] = {}
        if end == 0:
            return
        if hasattr(os, "posix_fadvise"):  # scattered header reads: no readahead of the tensors between them
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            self._index(_Window(self._fd, end), end)
        finally:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_NORMAL)  # tensors are read whole: readahead again

    def _index(self, buf, end: int) -> None:
        pos, last, scalars = 0, None, 0
        parts: dict[str, list] = {}
        try:
            while pos < end:
                start = pos
                number, wire, value, pos = _field(buf, pos, end)
                if number != 1 or wire != 2:
                    raise _Corrupt(f"top-level field {number} (wire {wire}) at byte {start}, expected a value")
                tag, (dims, ttype, chunk) = _value(buf, value, pos)
                scalars += dims in ((), (0,))
                if scalars > MAX_SCALARS or len(parts) >= MAX_VALUES:
                    what = f"{MAX_SCALARS:,} scalars" if scalars > MAX_SCALARS else f"{MAX_VALUES:,} values"
                    raise InteropError(f"{self.path}: more than {what} (a rank file holds a few dozen scalars and "
                                       "at most some 200,000 tensors); refused unread")
                if tag == last:
                    first = parts[tag]
                    if first[0] != dims or first[1] != ttype:
                        raise _Corrupt(f"{tag!r} continues with other dims or type")
                    first[2].append(chunk)
                elif tag in parts:
                    raise _Corrupt(f"tag {tag!r} appears twice, not in consecutive pieces")
                else:
                    parts[tag] = [dims, ttype, [chunk]]
                last = tag
        except _Corrupt as exc:
            raise InteropError(f"{self.path}: corrupt or truncated checkpoint near byte {pos}: {exc}") from None
        for tag, (dims, ttype, chunks) in parts.items():
            nbytes = sum(n for _, n in chunks)
            if ttype != STR_TYPE:
                dtype = TYPES.get(ttype)
                if dtype is None:
                    raise InteropError(f"{self.path}: tensor {tag!r} has unsupported tensor_type {ttype!r}")
                if dims == (0,) and nbytes == dtype.itemsize:
                    dims = ()  # mindspore reads dims [0] as a scalar
                want = _numel(dims) * dtype.itemsize
                if nbytes != want:
                    raise InteropError(f"{self.path}: tensor {tag!r} has {nbytes} bytes but dims {list(dims)} "
                                       f"of {ttype} need {want} (truncated or corrupt)")
            self.entries[tag] = Entry(tag, ttype, dims, tuple(chunks))

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, tag) -> bool:
        return tag in self.entries

    def entry(self, tag) -> Entry:
        try:
            return self.entries[tag]
        except KeyError:
            raise InteropError(f"{self.path}: no tensor named {tag!r}") from None

    def meta(self, tag) -> tuple[torch.dtype | None, tuple[int, ...]]:
        e = self.entry(tag)
        return e.dtype, e.shape

    def read(self, tag) -> torch.Tensor | str:
        """The tensor in its own (aligned, writable) memory; a string for "str" values."""
        e = self.entry(tag)
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        self.read_into(tag, [buf.numpy()])
        if e.type == STR_TYPE:
            return buf.numpy().tobytes().decode("utf-32-le").rstrip("\0")
        return buf.view(e.dtype).reshape(e.shape)

    def read_into(self, tag, targets) -> None:
        """Fill `targets` (writable buffers whose byte lengths add up to the tensor's) with its bytes, in
        order: a tensor gathered from several files is read straight into its place, with no copy."""
        e = self.entry(tag)
        views = [memoryview(t).cast("B") for t in targets]
        if sum(len(v) for v in views) != e.nbytes:
            raise ValueError(f"{self.path}: {tag} has {e.nbytes} bytes, the targets {sum(len(v) for v in views)}")
        pieces = iter(self._pieces(e, 0, e.nbytes))
        for view in views:
            done = 0
            while done < len(view):
                offset, n = next(pieces)
                if n > len(view) - done:  # the chunk runs on into the next target
                    pieces = iter([(offset + len(view) - done, n - (len(view) - done)), *pieces])
                    n = len(view) - done
                _pread_into(self._fd, view[done:done + n], offset, self.path)
                done += n

    def byte_ranges(self, tag, start: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        """Bytes [start, stop) of the tensor's content as (file offset, bytes) ranges."""
        e = self.entry(tag)
        return self._pieces(e, start, e.nbytes if stop is None else stop)

    def head(self, tag, n: int) -> bytes:
        """The first `n` bytes of the tensor's content (all of it when shorter)."""
        e = self.entry(tag)
        buf = bytearray(min(n, e.nbytes))
        self._read_span(e, 0, memoryview(buf))
        return bytes(buf)

    def _read_span(self, e: Entry, start: int, view: memoryview) -> None:
        """Bytes [start, start + len(view)) of entry `e`'s content into `view`."""
        done = 0
        for offset, n in self._pieces(e, start, start + len(view)):
            _pread_into(self._fd, view[done:done + n], offset, self.path)
            done += n

    def same_bytes(self, tag, other: "CkptFile", other_tag, block: int = 1 << 20) -> bool:
        """Whether the tensor's content equals `other`'s `other_tag`, compared a block at a time (stops at the
        first difference)."""
        a, b = self.entry(tag), other.entry(other_tag)
        if a.nbytes != b.nbytes:
            return False
        x, y = bytearray(min(block, a.nbytes)), bytearray(min(block, a.nbytes))
        for start in range(0, a.nbytes, block):
            n = min(block, a.nbytes - start)
            self._read_span(a, start, memoryview(x)[:n])
            other._read_span(b, start, memoryview(y)[:n])
            if x[:n] != y[:n]:
                return False
        return True

    @staticmethod
    def _pieces(e: Entry, start: int, stop: int) -> list[tuple[int, int]]:
        out, at = [], 0
        for offset, n in e.chunks:  # a tensor over 512 MiB is several chunks
            a, b = max(start, at), min(stop, at + n)
            if a < b:
                out.append((offset + a - at, b - a))
            at += n
        return out

    def view(self, tag) -> torch.Tensor | str:
        """A zero-copy view of the mapping when possible (one chunk, aligned), else `read`.

        The view is copy-on-write: writing to it never changes the file.
        """
        e = self.entry(tag)
        if self._mm is None:  # mapped only once a view is asked for (indexing and reads never map)
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        if e.type == STR_TYPE or len(e.chunks) != 1 or e.nbytes == 0:
            return self.read(tag)
        offset, n = e.chunks[0]
        if offset % e.dtype.itemsize:
            return self.read(tag)
        t = torch.frombuffer(self._mm, dtype=torch.uint8, count=n, offset=offset)
        return t.view(e.dtype).reshape(e.shape)

    def items(self):
        """(tag, tensor) in file order, one at a time."""
        for tag in self.entries:
            yield tag, self.read(tag)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views are still alive; the mapping goes when they do
            self._mm = None
        if getattr(self, "_fd", None) is not None:
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


def _pread_into(fd, view: memoryview, pos: int, path: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], pos + done)
        if got <= 0:
            raise InteropError(f"{path}: unexpected end of file")
        done += got


def _crc32_range(fd, start: int, end: int, block: int = 16 << 20) -> int:
    buf = bytearray(min(block, max(end - start, 1)))
    view, crc, pos = memoryview(buf), 0, start
    while pos < end:
        n = os.preadv(fd, [view[:min(block, end - pos)]], pos)
        if n <= 0:
            raise InteropError("unexpected end of file while checking crc")
        crc = zlib.crc32(view[:n], crc)
        pos += n
    return crc


def load_ckpt(path, verify: bool = True) -> dict:
    """Every tensor (and string) of a `.ckpt` file, by tag, in file order."""
    with CkptFile(path, verify=verify) as f:
        return dict(f.items())


# ---------------------------------------------------------------- writing

def _put_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf does
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(number: int, payload_len: int) -> bytes:
    return _put_varint(number << 3 | 2) + _put_varint(payload_len)


def _value_header(tag: bytes, dims, ttype: bytes, content_len: int) -> bytes:
    """Every byte of one Value except its content, in the order protobuf serializes them."""
    tensor = b"".join(b"\x08" + _put_varint(d) for d in dims)
    tensor += _len_field(2, len(ttype)) + ttype + _len_field(3, content_len)
    tensor_len = len(tensor) + content_len
    value = _len_field(1, len(tag)) + tag + _len_field(2, tensor_len) + tensor
    return _len_field(1, len(value) + content_len) + value


def _as_payload(value) -> tuple[list[int], str, memoryview]:
    """(dims, tensor_type, raw bytes) for a tensor, array or `append_dict`-style scalar."""
    if isinstance(value, str):
        return [0], STR_TYPE, memoryview(value.encode("utf-32-le"))
    if isinstance(value, bool):
        value = torch.tensor(value)
    elif isinstance(value, int):
        value = torch.tensor(value, dtype=torch.int64)
    elif isinstance(value, float):
        value = torch.tensor(value, dtype=torch.float32)  # mindspore.Tensor(float) is Float32
    elif isinstance(value, np.ndarray):
        if value.dtype.name == "bfloat16":  # ml_dtypes / mindspore's numpy bfloat16
            value = torch.from_numpy(np.ascontiguousarray(value).view(np.uint16)).view(torch.bfloat16)
        else:
            value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot store a {type(value).__name__} in a MindSpore checkpoint")
    ttype = TYPE_OF_DTYPE.get(value.dtype)
    if ttype is None:
        raise TypeError(f"MindSpore checkpoints have no type for {value.dtype}")
    t = value.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy()
    return list(t.shape), ttype, memoryview(data)


class CkptWriter:
    """Writes a `.ckpt` one tensor at a time, byte-identical to `mindspore.save_checkpoint`.

    `slice_bytes` is the largest content of one Value (mindspore's 512 MiB); `crc`
    appends the `crc_num` trailer as `save_checkpoint(crc_check=True)` does.  `fsync`
    is off by default, as in mindspore: the converters' atomic output directory
    fsyncs the whole tree once it is complete.  One
    deliberate difference: mindspore silently drops tensors with no elements, we
    write them (as a Value with empty content, which mindspore loads).
    """

    def __init__(self, path, crc: bool = False, slice_bytes: int = SLICE_BYTES, fsync: bool = False):
        if slice_bytes <= 0:
            raise ValueError("slice_bytes must be positive")
        self.path = os.fspath(path)
        self.crc = crc
        self.slice_bytes = slice_bytes
        self.fsync = fsync
        self._file = open(self.path, "wb")
        self._crc = 0
        self._tags: set[str] = set()
        self.bytes = 0

    def _emit(self, data) -> None:
        self._file.write(data)
        if self.crc:
            self._crc = zlib.crc32(data, self._crc)
        self.bytes += len(data)

    def write(self, tag: str, value) -> None:
        """One tensor (torch or numpy), or an int / float / bool / str as `append_dict` stores it."""
        if tag in self._tags:
            raise ValueError(f"{self.path}: tag {tag!r} written twice")
        self._tags.add(tag)
        dims, ttype, data = _as_payload(value)
        tag_b, type_b = tag.encode("utf-8"), ttype.encode()
        n = len(data)
        # mindspore cuts the raw bytes every slice_bytes (strings are never that long)
        step = n if ttype == STR_TYPE else self.slice_bytes
        for start in range(0, max(n, 1), max(step, 1)):
            piece = data[start:start + step]
            self._emit(_value_header(tag_b, dims, type_b, len(piece)))
            self._emit(piece)

    def close(self) -> int:
        """Append the crc trailer if asked, flush (and fsync if asked), close; returns the file size."""
        if self.crc:
            trailer = CRC_MAGIC + self._crc.to_bytes(10, "big")
            self._file.write(trailer)
            self.bytes += len(trailer)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        return self.bytes

    def abort(self) -> None:
        """Close and remove a half-written file."""
        self._file.close()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_ckpt(path, tensors, crc: bool = False, slice_bytes: int = SLICE_BYTES, fsync: bool = False) -> int:
    """Write a dict (or iterable of pairs) of tag -> tensor/scalar/str; returns the file size."""
    items = tensors.items() if hasattr(tensors, "items") else tensors
    with CkptWriter(path, crc=crc, slice_bytes=slice_bytes, fsync=fsync) as w:
        for tag, value in items:
            w.write(tag, value)
    return w.bytes


# ---------------------------------------------------------------- mindspore's safetensors flavour

MS_FORMAT = {"format": "ms"}


class MsSafetensorsFile(SafetensorsFile):
    """A safetensors file written by `mindspore.save_checkpoint(format="safetensors")`.

    Checks the `{"format": "ms"}` metadata and, with `verify`, the `crc_num` metadata
    (crc32 over each name and its bytes, in sorted name order), which reads every tensor.
    """

    def __init__(self, path, verify: bool = True):
        super().__init__(path)
        if self.metadata.get("format") != "ms":
            fmt = self.metadata.get("format")
            self.close()
            raise InteropError(f"{self.path}: not a MindSpore safetensors file (metadata format is {fmt!r}, "
                               "expected 'ms')")
        for key, value in self.metadata.items():
            if key in self.entries and value != "":
                self.close()
                raise InteropError(f"{self.path}: tensor {key!r} is stored as {value}, which is not supported")
        if verify and "crc_num" in self.metadata:
            crc = 0
            for key in sorted(self.entries):
                crc = zlib.crc32(key.encode("utf-8"), crc)
                t = self.read(key)
                crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
            try:
                want = int(self.metadata["crc_num"])
            except ValueError:
                want = None
            if crc != want:
                self.close()
                raise InteropError(f"{self.path}: crc check failed (metadata crc_num {self.metadata['crc_num']}, "
                                   f"contents give {crc}): the file is damaged")


def ms_safetensors_writer(path, entries, remove_redundancy: bool | None = None) -> SafetensorsWriter:
    """A streaming safetensors writer whose metadata marks the file as MindSpore's.

    `entries` is the plan, (name, dtype, shape) in write order.  No `crc_num` is
    written (it would sit in the header, before the data it covers); mindspore
    only warns about its absence when asked to check.
    """
    metadata = dict(MS_FORMAT)
    if remove_redundancy is not None:
        metadata["remove_redundancy"] = str(bool(remove_redundancy))
    return SafetensorsWriter(path, entries, metadata=metadata)
