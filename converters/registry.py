"""The formats `interop convert` speaks: name -> converter module (detect, Reader, Writer).

Adding a format is one line here plus its module; modules are imported on first use
so that a format's optional dependencies never slow down the others.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import InteropError

FORMATS = {
    "interop": "interop.converters.interop_format",
    "hf": "interop.converters.hf",
    "mindspore": "interop.converters.mindspore",
    "deepspeed": "interop.converters.deepspeed",  # before megatron: Megatron-DeepSpeed also writes its tracker file
    "megatron": "interop.converters.megatron",
}


def converter(name: str):
    try:
        return importlib.import_module(FORMATS[name])
    except KeyError:
        raise InteropError(f"unknown format {name!r} (known: {', '.join(FORMATS)})") from None


def detect_format(path) -> str:
    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path}: no such file or directory")
    for name in FORMATS:
        if converter(name).detect(path):
            return name
    raise InteropError(f"{path}: cannot tell its format (known: {', '.join(FORMATS)}); name it with --from")
