"""Reading the small text files a user points at (`--model-config`, config sidecars): regular files
of bounded size only.

`/dev/zero` would fill memory, a FIFO would hang, a directory would raise deep inside a parser;
a model description is a few kilobytes.  The file is opened without blocking (a FIFO opens at
once), checked with fstat on the descriptor that is then read, and never read past the limit.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..errors import InteropError

LIMIT = 8 << 20  # far above any model description (a Llama config.json is ~1 KB)

_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: Path, what: str, limit: int) -> tuple[int, int]:
    """(fd, size) of a regular file no larger than `limit`; the caller closes fd."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise InteropError(f"{path}: cannot open the {what} ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InteropError(f"{path}: the {what} must be a regular file, this is {_kind(info.st_mode)}")
        if info.st_size > limit:
            raise InteropError(f"{path}: the {what} is {info.st_size:,} bytes; more than {limit:,} is not "
                               "a model description")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def require_small_file(path, what: str, limit: int = LIMIT) -> Path:
    """Check that `path` is a regular file of at most `limit` bytes, for a parser that opens it itself."""
    fd, _ = _open_regular(Path(path), what, limit)
    os.close(fd)
    return Path(path)


def read_small_bytes(path, what: str, limit: int = LIMIT) -> bytes:
    """The bytes of a regular file of at most `limit` bytes."""
    path = Path(path)
    fd, _ = _open_regular(path, what, limit)
    chunks, total = [], 0
    try:
        while total <= limit:
            block = os.read(fd, min(1 << 20, limit + 1 - total))
            if not block:
                break
            chunks.append(block)
            total += len(block)
    except OSError as exc:
        raise InteropError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise InteropError(f"{path}: the {what} grew past {limit:,} bytes while being read")
    return b"".join(chunks)


def read_small_text(path, what: str, limit: int = LIMIT) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes."""
    data = read_small_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InteropError(f"{path}: the {what} is not UTF-8 text (byte {exc.start})") from None


def json_kind(value) -> str:
    """How a JSON value reads in a message: 'an array', 'a string', ..."""
    kinds = {list: "an array", dict: "an object", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


class DuplicateKey(ValueError):
    """A JSON object names one key twice: `json` would keep the last silently."""


def unique_keys(pairs: list) -> dict:
    """`json.loads(..., object_pairs_hook=unique_keys)`: an object whose keys repeat is refused, since which
    copy a reader keeps (the first, the last) is a guess a damaged or crafted file must not decide."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"key {key!r} appears twice")
        out[key] = value
    return out


def loads_unique(text):
    """`json.loads` with repeated keys refused (`DuplicateKey`, a ValueError)."""
    return json.loads(text, object_pairs_hook=unique_keys)


def read_json(path, what: str, limit: int = LIMIT):
    """A JSON document from a small regular file; any syntax error, over-long number or nesting too
    deep for the parser is one InteropError naming the file."""
    text = read_small_text(path, what, limit)
    try:
        return loads_unique(text)
    except RecursionError:
        raise InteropError(f"{path}: the {what} is nested too deeply") from None
    except DuplicateKey as exc:
        raise InteropError(f"{path}: the {what} is ambiguous: {exc}") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python refuses numbers past 4,300 digits
            raise InteropError(f"{path}: the {what} holds a number with more than 4,300 digits") from None
        raise InteropError(f"{path}: the {what} is not valid JSON ({str(exc).splitlines()[0]})") from None


def read_json_object(path, what: str, limit: int = LIMIT) -> dict:
    """Like `read_json`, and the document must be an object (a JSON list where one belongs is refused)."""
    data = read_json(path, what, limit)
    if not isinstance(data, dict):
        raise InteropError(f"{path}: the {what} must be a JSON object, found {json_kind(data)}")
    return data
