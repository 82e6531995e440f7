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


class BadLocalHeader(zipfile.BadZipFile):
    """A record's local header is not where the central directory says."""


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
