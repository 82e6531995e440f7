"""Sizes in a model description checked against the bytes on disk, before anything is sized by them.

A config (or a manifest) that asks for far more weights than the checkpoint's files can hold is
wrong or hostile: converting it would allocate what it asks (tens of GB for 100,000,000 layers)
before failing.  Every weight is stored at least once in at least half a byte (MXFP4, two FP4 values a byte:
gpt-oss's release; block-scaled float8, DeepSeek-V3's, takes 1), so the files must hold at least 1 byte per two
parameters.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import InteropError
from .params import layer_params
from .spec import ModelSpec

WEIGHTS_PER_BYTE = 2  # the narrowest stored weight: MXFP4's 4 bits


def min_parameter_count(spec: ModelSpec) -> int:
    """Parameters every checkpoint of `spec` stores at least once (tied output counted once, the true
    vocabulary without padding rows), computed from one layer, not a table of all of them."""
    h = spec.hidden
    kinds = {0, spec.num_layers - 1}  # a dense first layer and a MoE last one (DeepSeek): the smaller counts
    per_layer = min(sum(math.prod(p.shape) for p in layer_params(spec, i)) for i in kinds)
    embeddings = spec.vocab * h * (1 if spec.tied_embeddings else 2)
    positions = spec.max_positions * h if spec.position == "learned" else 0
    final_norm = h * (2 if spec.norm == "layernorm" else 1)
    return per_layer * spec.num_layers + embeddings + positions + final_norm


def bytes_on_disk(path, enough: int | None = None) -> int:
    """Sizes of the regular files at or under `path` (symlinked files followed, symlinked folders not);
    stops counting once past `enough`."""
    path = Path(path)
    if not path.is_dir():
        return path.stat().st_size if path.is_file() else 0
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                info = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            if os.path.isfile(os.path.join(folder, name)):
                total += info.st_size
            if enough is not None and total > enough:
                return total
    return total


def check_weights_on_disk(spec: ModelSpec, src) -> None:
    """Refuse a description of more weights than the files under `src` can hold."""
    need = -(-min_parameter_count(spec) // WEIGHTS_PER_BYTE)
    have = bytes_on_disk(src, enough=need)
    if have < need:
        raise InteropError(
            f"{src}: the model description ({spec.num_layers:,} layers, hidden {spec.hidden:,}, vocab {spec.vocab:,}) "
            f"needs at least {need:,} bytes of weights, but the checkpoint's files hold {have:,} bytes")
