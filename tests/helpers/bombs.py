"""Small files that stand for huge ones: a DEFLATE bomb inside a torch.save zip, Values appended to a
MindSpore `.ckpt`.  Built in a second or two; each would cost GBs or minutes if read naively."""
from __future__ import annotations

import io
import zipfile
import zlib

import torch

from interop.io.torch_file import TensorRef, _Pickler, _StorageRef

_CHUNK = 1 << 20


class _RepeatedZeros:
    """A DEFLATE compressor for 1 MiB chunks of zeros: one full-flush block computed once and repeated
    (each such block stands alone), so a GB record takes as long as writing its few MB."""

    def __init__(self):
        c = zlib.compressobj(1, zlib.DEFLATED, -15)
        self.block = c.compress(bytes(_CHUNK)) + c.flush(zlib.Z_FULL_FLUSH)
        self.tail = c.flush(zlib.Z_FINISH)

    def compress(self, data):
        assert len(data) == _CHUNK and not any(data[:64])
        return self.block

    def flush(self):
        return self.tail


def _refs(obj, records: list):
    """`obj` with every tensor replaced by a reference to a record appended to `records`."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().clone()
        key = str(len(records))
        records.append((key, t.reshape(-1).view(torch.uint8).numpy().tobytes()))
        return TensorRef(_StorageRef(key, t.dtype, t.numel()), t.shape)
    if isinstance(obj, dict):
        return type(obj)((k, _refs(v, records)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_refs(v, records) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_refs(v, records) for v in obj)
    return obj


def deflate_bomb_pt(src, dst, gib: int = 3, key: str = "bomb") -> None:
    """torch.save file `src` rewritten to `dst` with `obj[key]` a float32 tensor of `gib` GiB of zeros whose
    record is DEFLATEd (~4.5 MB a GiB on disk); torch.load reads it, allocating all of it."""
    obj = torch.load(src, map_location="cpu", weights_only=False)  # a file the test itself wrote
    records = []
    obj = _refs(obj, records)
    numel = (gib << 30) // 4
    obj[key] = TensorRef(_StorageRef("bomb", torch.float32, numel), (numel,))
    with open(dst, "wb") as f:
        _bomb_zip(f, obj, records, gib)


def deflate_bomb_tensor(shape, dtype: torch.dtype, gib: int = 3, declared: str = "huge") -> bytes:
    """A torch.save zip of one tensor of `shape` (as a DCP chunk holds it) whose storage record is `gib` GiB of
    DEFLATEd zeros.  `declared` "huge": the directory says so too (the tensor views the first elements of a
    GiB storage: torch.load allocates it all); "small": the directory says the record is the tensor's bytes (a reader
    trusting it inflates past them)."""
    numel = (gib << 30) // torch.empty((), dtype=dtype).element_size()
    size = torch.Size(shape).numel()
    small = declared == "small"
    obj = TensorRef(_StorageRef("0", dtype, size if small else numel), shape)
    buf = io.BytesIO()
    _bomb_zip(buf, obj, [], gib, name="0", declared=size * torch.empty((), dtype=dtype).element_size() if small
              else None)
    return buf.getvalue()


def oversized_record_tensor(shape, dtype: torch.dtype, mib: int = 8) -> bytes:
    """A torch.save zip of one tensor of `shape` viewing the first elements of a `mib` MiB storage of random
    values, every record DEFLATEd (they compress ~1x: no bomb by ratio, only by what the chunk needs)."""
    item = torch.empty((), dtype=dtype).element_size()
    storage = torch.rand((mib << 20) // item).to(dtype)
    raw = io.BytesIO()
    torch.save(storage[:torch.Size(shape).numel()].view(shape), raw)  # saves the whole storage
    out = io.BytesIO()
    with zipfile.ZipFile(raw) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def _bomb_zip(f, obj, records: list, gib: int, name: str = "bomb", declared: int | None = None) -> None:
    """torch.save's zip layout of `obj` into file object `f`: its `records` stored, record `name` `gib` GiB of
    DEFLATEd zeros, its directory entry saying `declared` bytes when given."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(f, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        for key, data in records:
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
        info = zipfile.ZipInfo(f"archive/data/{name}")
        info.compress_type = zipfile.ZIP_DEFLATED
        real = zipfile._get_compressor
        zipfile._get_compressor = lambda *_: _RepeatedZeros()
        try:
            with z.open(info, "w", force_zip64=True) as out:
                chunk = bytes(_CHUNK)
                for _ in range(gib << 10):
                    out.write(chunk)
        finally:
            zipfile._get_compressor = real
        if declared is not None:
            info.file_size = declared  # the central directory (what readers go by) lies


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def ckpt_value(tag: str, ttype: str, content: bytes, dims=()) -> bytes:
    """One MindSpore Checkpoint.Value as `save_checkpoint` writes it (0x0a len {tag, TensorProto})."""
    proto = b"".join(_varint(1 << 3) + _varint(d) for d in dims) + _field(2, ttype.encode()) + _field(3, content)
    return _field(1, _field(1, tag.encode()) + _field(2, proto))


def append_scalars(path, count: int) -> None:
    """`count` float32 scalar Values appended to the `.ckpt` at `path` (no crc trailer: interop writes none)."""
    one = ckpt_value("s0000000", "Float32", bytes(4))  # tags of one length: the template's lengths hold
    with open(path, "ab") as f:
        f.write(b"".join(one.replace(b"s0000000", f"s{i:07d}".encode()) for i in range(count)))
