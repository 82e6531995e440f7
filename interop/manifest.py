"""The schema of `interop.json`, checked at the door.

A manifest is written by us, but read from wherever the user points: every key a reader
relies on is checked here (type, range, known tensor names, shards that tile each tensor
exactly once, every shard file listed under `files` with its size and CRC-32, no file
outside the checkpoint), so that a damaged or hand-edited manifest is one line,
`error: <file>: <what is wrong>`, and never a traceback or a silently partial read.
"""
from __future__ import annotations

import re
from pathlib import Path

from .adapter import AdapterSpec
from .errors import InteropError
from .io.paths import inside
from .layout import ParallelLayout
from .params import OPTIM_PREFIXES, base_param_name, param_index
from .shards import Box, tiling_error
from .spec import DTYPES, ModelSpec  # the dtype names (interop.tensors.DTYPE_NAMES's keys, without torch)

FORMAT = "interop"
VERSION = 1
_CRC = re.compile(r"^[0-9a-f]{8}$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _counts(value, length: int | None = None) -> bool:
    return isinstance(value, list) and all(_is_count(n) for n in value) and (length is None or len(value) == length)


def check_manifest(root, manifest, where) -> tuple[ModelSpec, ParallelLayout, AdapterSpec | None]:
    """Validate a parsed manifest of the checkpoint at `root`; returns its spec, layout and LoRA adapter (None:
    the checkpoint is a model; else its tensors are that adapter's on base model `spec`).

    Raises InteropError naming `where` (the manifest file) and the first thing wrong."""
    def fail(what: str):
        raise InteropError(f"{where}: {what}")

    if not isinstance(manifest, dict):
        fail(f"expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        fail(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        fail(f"version {manifest.get('version')!r} is not supported (this is {VERSION})")
    for key, kind in (("spec", dict), ("layout", dict), ("tensors", dict), ("files", dict)):
        if key not in manifest:
            fail(f"missing {key!r}")
        if not isinstance(manifest[key], kind):
            fail(f"{key!r} must be a JSON object, found {type(manifest[key]).__name__}")
    if not isinstance(manifest.get("state", {}) or {}, dict):
        fail("'state' must be a JSON object")
    tensors, files = manifest["tensors"], manifest["files"]
    try:
        spec = ModelSpec.from_dict(manifest["spec"])
        layout = ParallelLayout.from_dict(manifest["layout"])
    except InteropError as exc:
        fail(str(exc))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        fail(f"invalid spec or layout ({type(exc).__name__}: {exc})")
    if not _is_count(spec.num_layers) or spec.num_layers > len(tensors):  # before any table is built from it
        fail(f"spec.num_layers is {spec.num_layers!r}, but only {len(tensors)} tensors are listed")
    if layout.num_layers != spec.num_layers:
        fail(f"the layout places {layout.num_layers} layers, the model has {spec.num_layers}")
    try:
        spec.check_ep(layout.ep)
    except InteropError as exc:
        fail(f"layout: {exc}")

    for name, info in files.items():
        inside(root, name, where)
        if not isinstance(info, dict) or not _is_count(info.get("bytes")) \
                or not (isinstance(info.get("crc32"), str) and _CRC.match(info["crc32"])):
            fail(f"files[{name!r}] needs 'bytes' (a non-negative integer) and 'crc32' (8 hex digits)")

    _check_carried(manifest.get("carried"), files, fail)

    adapter = None
    if manifest.get("adapter") is not None:
        adapter = AdapterSpec.from_dict(manifest["adapter"], str(where))
        try:
            adapter.check_base(spec)
        except InteropError as exc:
            fail(str(exc))
    index = param_index(spec) if adapter is None else adapter.index(spec)
    what = f"{spec.arch} model" if adapter is None else "LoRA adapter"
    used: dict[tuple[str, str], str] = {}  # (file, key) -> tensor: one stored entry never serves two shards
    for name, entry in tensors.items():
        param = index.get(base_param_name(name))
        if param is None:
            fail(f"tensor {name!r} is not a parameter of this {what}")
        if not isinstance(entry, dict):
            fail(f"tensor {name!r}: expected a JSON object")
        if entry.get("dtype") not in DTYPES:
            fail(f"tensor {name!r}: unsupported dtype {entry.get('dtype')!r}")
        shape = entry.get("shape")
        if not _counts(shape) or tuple(shape) != tuple(param.shape):
            fail(f"tensor {name!r}: shape {shape!r}, the {what} expects {list(param.shape)}")
        shards = entry.get("shards")
        if not isinstance(shards, list) or not shards:
            fail(f"tensor {name!r}: 'shards' must be a non-empty list")
        boxes = []
        for shard in shards:
            if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) \
                    or not isinstance(shard.get("key"), str) or not _counts(shard.get("offset"), len(shape)) \
                    or not _counts(shard.get("shape"), len(shape)):
                fail(f"tensor {name!r}: each shard needs 'file', 'key', and 'offset' and 'shape' "
                     f"(lists of {len(shape)} non-negative integers)")
            if shard["file"] not in files:
                fail(f"tensor {name!r}: shard file {shard['file']!r} is not listed under 'files' "
                     "(so it could not be verified)")
            where_stored = (shard["file"], shard["key"])
            if where_stored in used:
                fail(f"tensor {name!r}: shard {shard['key']!r} in {shard['file']} is also a shard of "
                     f"{used[where_stored]!r}")
            used[where_stored] = name
            boxes.append(Box(tuple(shard["offset"]), tuple(shard["shape"])))
        why = tiling_error(shape, boxes)
        if why:
            fail(f"tensor {name!r}: {why}")

    missing = [p for p in index if p not in tensors]
    if missing:
        fail(f"tensor {missing[0]!r} is missing ({len(missing)} parameters of the model are not listed)")
    for prefix in OPTIM_PREFIXES:
        present = {n[len(prefix):] for n in tensors if n.startswith(prefix)}
        if present and len(present) != len(index):
            lost = next(p for p in index if p not in present)
            fail(f"optimizer state {prefix}{lost} is missing (the others of {prefix.rstrip('.')} are listed)")
    return spec, layout, adapter


def _check_carried(carried, files: dict, fail) -> None:
    """`carried`: {"files": [plain file names, each listed under files as carried/NAME], "config": {...}}."""
    if carried is None:
        return
    if not isinstance(carried, dict) or not isinstance(carried.get("files", []), list) \
            or not isinstance(carried.get("config", {}), dict):
        fail("'carried' must be {\"files\": [names], \"config\": {...}}")
    for name in carried.get("files", []):
        if not isinstance(name, str) or not _PLAIN_NAME.match(name) or f"carried/{name}" not in files:
            fail(f"carried file {name!r} must be a plain file name listed under 'files' as carried/NAME")


def check_files_exist(root: Path, files: dict, where) -> None:
    """Every listed file is a regular file of the recorded size (the CRC-32 is checked separately)."""
    for name, info in files.items():
        path = inside(root, name, where)
        if not path.is_file():
            raise InteropError(f"{root}: manifest names {name}, which is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise InteropError(f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced?)")
