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
    if not within(root, path):
        raise InteropError(f"{where}: file name {name!r} resolves to {os.path.realpath(path)}, outside the "
                           "checkpoint; refused")
    return path


def bound(root) -> str:
    """Where symlinks under the checkpoint `root` may resolve to: `root` itself, or, for a snapshot of the
    Hugging Face hub cache (`models--ORG--NAME/snapshots/REV/`, every file a symlink to `../../blobs/HASH`),
    that model's cache repository `models--ORG--NAME/`: its layout, not an escape."""
    real = os.path.realpath(root)
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return repo
    return real


def within(root, path) -> bool:
    """Whether `path`, symlinks resolved, lies under the checkpoint `root` (see `bound`)."""
    limit = bound(root)
    return os.path.commonpath([limit, os.path.realpath(path)]) == limit
