"""Where each record's data lies in a zip (a torch.save file, or one inside a `.distcp` file).

The central directory gives a record's local header offset, size and CRC-32, not where its data starts:
that takes the local header's own name and extra lengths (30 bytes at the header's offset).  Knowing it
lets a reader take a tensor's bytes straight from the file and check them against the record.
"""
from __future__ import annotations

import os
import struct
import zipfile
from typing import Iterator, NamedTuple

LOCAL_HEADER = 30
LOCAL_MAGIC = b"PK\x03\x04"
MAX_EXPANSION = 64  # float weights deflate to ~90%; only zeros (a bomb) expand 1000x
FREE_EXPANSION = 64 << 20  # bytes any compressed records may expand to regardless (small all-zero buffers)


class BadLocalHeader(zipfile.BadZipFile):
    """A record's local header is not where the central directory says."""


class InflationBomb(zipfile.BadZipFile):
    """Compressed records that would expand far beyond what weights can (a DEFLATE bomb)."""


def check_expansion(zf: zipfile.ZipFile) -> None:
    """Raise `InflationBomb` when the compressed records of `zf` declare more than `MAX_EXPANSION` times their
    compressed bytes (plus `FREE_EXPANSION`): a reader (torch's too) allocates the declared size and inflates
    into it, so a few MB of DEFLATEd zeros would take GBs.  Declared sizes bound what either reader inflates."""
    packed = unpacked = 0
    for info in zf.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            packed, unpacked = packed + info.compress_size, unpacked + info.file_size
    if unpacked > FREE_EXPANSION + MAX_EXPANSION * packed:
        raise InflationBomb(f"its compressed records expand {unpacked // max(packed, 1):,}x, to {unpacked:,} bytes "
                            f"from {packed:,} (more than {MAX_EXPANSION}x + {FREE_EXPANSION >> 20} MiB is refused: "
                            "weights never compress so well; a DEFLATE bomb?)")


class ZipRecord(NamedTuple):
    name: str
    offset: int  # its data's first byte, counted from the zip's first byte
    size: int  # bytes as stored (uncompressed for a stored record)
    crc: int  # CRC-32 of the data (0 where the writer computed none)
    stored: bool  # not compressed: its bytes on disk are the record's contents


def zip_records(zf: zipfile.ZipFile, fd: int, base: int = 0) -> Iterator[ZipRecord]:
    """The records of open zip `zf`, in directory order, read as they are asked for; `fd` reads the same
    zip, which starts at byte `base` of that file.  A bad local header raises `BadLocalHeader`."""
    for info in zf.infolist():
        head = os.pread(fd, LOCAL_HEADER, base + info.header_offset)
        if len(head) != LOCAL_HEADER or head[:4] != LOCAL_MAGIC:
            raise BadLocalHeader(f"bad local header for {info.filename}")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        yield ZipRecord(info.filename, info.header_offset + LOCAL_HEADER + name_len + extra_len, info.file_size,
                        info.CRC, info.compress_type == zipfile.ZIP_STORED)
