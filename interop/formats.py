"""The checkpoint formats `convert`, `inspect` and `verify` speak, by name.

Core knows no format.  Each format registers itself as an entry point in the `interop.formats`
group (pyproject.toml: `name = "module"`); the module has `detect(path) -> bool`, `Reader` and
`Writer`.  Modules are imported on first use, so a format's dependencies never slow down the
others, and the names are read from the installed metadata without importing anything.
Detection tries the formats in name order, and each format's `detect` claims only its own files;
the one overlap left is resolved by that order: deepspeed before megatron (a Megatron-DeepSpeed
save also holds Megatron's tracker file; tests/test_deepspeed.py holds it).
"""
from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from pathlib import Path

from .errors import InteropError

GROUP = "interop.formats"


@functools.lru_cache(maxsize=1)
def _registered() -> dict[str, str]:
    found = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    if not found:
        raise InteropError(f"no checkpoint formats are registered (entry point group {GROUP!r}): reinstall "
                           "interop (`pip install -e .` or `bash scripts/setup.sh`) so its metadata lists them")
    return dict(sorted(found.items()))


def names() -> tuple[str, ...]:
    """Every registered format's name, in detection order."""
    return tuple(_registered())


def converter(name: str):
    """The module of format `name` (detect, Reader, Writer)."""
    modules = _registered()
    if name not in modules:
        raise InteropError(f"unknown format {name!r} (known: {', '.join(modules)})")
    return importlib.import_module(modules[name])


def reader_of(name: str):
    """Format `name`'s Reader class."""
    return converter(name).Reader


def writer_of(name: str):
    """Format `name`'s Writer class; one line for a format that is read only (a source, never a target)."""
    module = converter(name)
    if not hasattr(module, "Writer"):
        raise InteropError(f"interop reads {name} checkpoints but does not write them: choose another --to")
    return module.Writer


def detect_format(path) -> str:
    """The name of the one format that claims `path`."""
    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path}: no such file or directory")
    for name in names():
        if converter(name).detect(path):
            return name
    raise InteropError(f"{path}: cannot tell its format (known: {', '.join(names())}); name it with --from")
