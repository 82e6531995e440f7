"""The zip container of torch.save files, written by us: stored records, 64-byte aligned, with CRC-32.

torch's own `PyTorchFileWriter` was used before; with `compute_crc32=False` it left every CRC
field zero (`unzip -t` reports errors and a reader cannot check anything), and on a full disk
its destructor aborted the process.  This writer produces the same layout torch does
(`<archive>/data/<key>`, `data.pkl`, `byteorder`, `version`, ... each record's data at a
multiple of 64 bytes, padded with an `FB` extra field, sizes and CRC in a data descriptor
and the central directory, zip64 where sizes or offsets need it), computes each record's
CRC-32 on a second core while the bytes are written, and raises OSError on a write error.
"""
from __future__ import annotations

import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

ALIGNMENT = 64  # torch.serialization._get_storage_alignment(): torch.load(mmap=True) relies on it
_ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on go in zip64 fields
_MARK = 0xFFFFFFFF  # "see the zip64 field"
_FLAGS = 0x0808  # sizes and CRC in a data descriptor after the data; UTF-8 names
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
_CRC_THREAD = ThreadPoolExecutor(1, thread_name_prefix="interop-zip-crc")


class ZipWriter:
    """Appends stored (uncompressed) records to a new file; `close()` writes the central directory."""

    def __init__(self, path, archive_name: str, fd: int | None = None):
        """A new file at `path`; or, with `fd`, a zip appended at fd's position (offsets counted from there;
        the caller keeps the fd: DCP's `.distcp` files are torch.save zips one after another)."""
        self.path = os.fspath(path)
        self.prefix = archive_name
        self._owned = fd is None
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666) if fd is None else fd
        self.offset = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # (name, crc, size, header offset)

    def _write(self, data) -> None:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.write(self.fd, view[done:])
        self.offset += len(view)

    def write_record(self, name: str, data) -> None:
        """One record `<archive>/<name>` holding the bytes of `data` (bytes or a buffer)."""
        view = memoryview(data).cast("B")
        full = f"{self.prefix}/{name}".encode()
        start = self.offset
        pad = -(start + 30 + len(full) + 4) % ALIGNMENT
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, _FLAGS, 0, 0, _DOS_DATE, 0, 0, 0, len(full), 4 + pad)
                    + full + struct.pack("<HH", 0x4246, pad) + b"Z" * pad)
        if len(view) > (1 << 20):  # checksum on the CRC thread (zlib releases the GIL) while writing
            crc = _CRC_THREAD.submit(zlib.crc32, view)
            self._write(view)
            crc = crc.result()
        else:
            crc = zlib.crc32(view)
            self._write(view)
        size = len(view)
        if size >= _ZIP64_LIMIT:
            self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        else:
            self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self._entries.append((full, crc, size, start))

    def close(self) -> None:
        """Central directory and end records; the file is complete (not fsynced) afterwards."""
        cd_start = self.offset
        for name, crc, size, start in self._entries:
            extra = b""
            size32 = offset32 = None
            if size >= _ZIP64_LIMIT:
                extra += struct.pack("<QQ", size, size)
                size32 = _MARK
            if start >= _ZIP64_LIMIT:
                extra += struct.pack("<Q", start)
                offset32 = _MARK
            if extra:
                extra = struct.pack("<HH", 0x0001, len(extra)) + extra
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, _FLAGS, 0, 0, _DOS_DATE, crc,
                                    size if size32 is None else size32, size if size32 is None else size32,
                                    len(name), len(extra), 0, 0, 0, 0, start if offset32 is None else offset32)
                        + name + extra)
        cd_size, count = self.offset - cd_start, len(self._entries)
        if count >= 0xFFFF or cd_start >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
            eocd64 = self.offset
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start))
            self._write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _MARK, _MARK, 0))
        else:
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            if self._owned:
                os.close(self.fd)
            self.fd = None
