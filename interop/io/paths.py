"""File names that a checkpoint's own metadata hands us must stay inside the checkpoint.

`interop.json` shard files, an HF `*.index.json` weight map and a DCP `.metadata`'s
`relative_path`s are all written by whoever wrote the checkpoint: an absolute name, a
`..` or a symlink pointing elsewhere would make us read (and echo) files outside it.
"""
from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from ..errors import InteropError


def inside(root, name, where) -> Path:
    """`root / name`, refused (InteropError naming `where`) unless it is a plain relative name
    that stays under `root`, symlinks resolved."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InteropError(f"{where}: file name {name!r} is not a relative path inside the checkpoint")
    parts = PurePosixPath(name).parts
    if os.path.isabs(name) or name.startswith("\\") or ".." in parts or "\\" in name:
        raise InteropError(f"{where}: file name {name!r} points outside the checkpoint "
                           "(absolute or climbing out with '..'); refused")
    root = Path(root)
    path = root / name
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise InteropError(f"{where}: file name {name!r} resolves to {real}, outside the checkpoint; refused")
    return path
