"""Atomic output directories: build in a hidden sibling, then rename into place.

A failed or interrupted conversion leaves nothing at the destination; an existing
destination is replaced only with `force`, and only once the new one is complete.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import InteropError


def check_destination(dst, force: bool) -> Path:
    dst = Path(dst)
    if dst.exists() and not force:
        raise InteropError(f"{dst} already exists (use --force to replace it)")
    if dst.exists() and not dst.is_dir():
        raise InteropError(f"{dst} exists and is not a directory")
    return dst


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, so a rename publishes complete data."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_directory(dst, force: bool = False):
    """Yield a temporary directory beside `dst`; on success it becomes `dst`, on error it vanishes."""
    dst = check_destination(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
