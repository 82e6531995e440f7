"""The common sharded format: `interop.json` plus one safetensors file per (tp, pp) rank.

    ckpt/
      interop.json                  format + version, ModelSpec, ParallelLayout, every tensor's
                                    dtype, global shape, split and shards (file, key, global
                                    offset, shape), every file's size and CRC-32, training state
      model-tp00-pp00.safetensors   weights held by tp rank 0 of pipeline stage 0
      optim-tp00-pp00.safetensors   Adam moments (optional), same sharding as the weights
      model-tp00-pp00-ep01.safetensors   at ep > 1: the routed experts of expert-parallel rank 1
                                    (tp rank 0's slice of each), so each ep rank's experts are its own files
      carried/tokenizer.json ...    what the source held besides weights (an HF source's tokenizer and
                                    generation config), kept so that a later HF output gets them back

Every shard records its global offset, so a reader at any tp/pp/ep reads only what
it needs.  Replicated tensors are stored once, on tp rank 0 of their stage; tensors
other than routed experts (attention, router, shared expert) in the files without `-ep`.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .adapter import AdapterSpec, tensor_index
from .contract import BaseReader, BaseWriter
from .errors import InteropError
from .io.small_files import read_json
from .io.safetensors import SafetensorsFile, SafetensorsWriter, file_crc32
from .io.paths import inside
from .layout import ParallelLayout
from .manifest import FORMAT, VERSION, check_files_exist, check_manifest
from .memory import BufferPool
from .params import TensorKey, base_param_name
from .shards import Box, assemble, shard_box
from .spec import ModelSpec, padded_to_tp
from .tensors import DTYPE_NAMES, NAME_OF_DTYPE, Source, TensorMeta

MANIFEST = "interop.json"
MANIFEST_LIMIT = 64 << 20  # bytes of interop.json: ~200 bytes a file, far above any checkpoint
CARRIED = "carried"  # the folder of files carried as they are (`StoreWriter.carry`)


def is_store(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _dtype(name: str, where: str) -> torch.dtype:
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise InteropError(f"{where}: unsupported dtype {name!r}") from None


class StoreReader(BaseReader):
    """Opens a common-format checkpoint; `read(name, box)` reads only the shards that overlap `box`.

    `verify`: True checks every file's CRC-32 before anything is read; "background" checks
    them in a thread while the caller reads, and `confirm()` waits for the verdict (the
    conversion engine calls it before it finishes its output); False checks sizes only.
    """

    def __init__(self, path, verify: bool | str = True):
        self.root = Path(path)
        manifest_path = self.root / MANIFEST
        if not manifest_path.is_file():
            raise InteropError(f"{self.root}: not an interop checkpoint (no {MANIFEST})")
        manifest = read_json(manifest_path, "manifest", MANIFEST_LIMIT)  # bounded, nesting and duplicates refused
        spec, layout, adapter = check_manifest(self.root, manifest, manifest_path)
        self.manifest = manifest
        self.source = Source(spec, layout, state=manifest.get("state") or {}, adapter=adapter)
        self._check_files(verify)
        self._files: dict[str, SafetensorsFile] = {}
        self._memory = BufferPool()
        carried = manifest.get("carried") or {}
        self.carried = {"files": {name: self.root / CARRIED / name for name in carried.get("files", [])},
                        "config": dict(carried.get("config", {}))}

    @property
    def spec(self) -> ModelSpec:
        return self.source.spec

    @property
    def layout(self) -> ParallelLayout:
        return self.source.layout

    def _check_files(self, verify: bool | str) -> None:
        files = self.manifest["files"]
        check_files_exist(self.root, files, self.root / MANIFEST)
        self._pending_check = None
        if verify == "background":
            pool = ThreadPoolExecutor(1, thread_name_prefix="interop-verify")
            self._pending_check = pool.submit(self._verify_checksums, files)
            pool.shutdown(wait=False)
        elif verify:
            self._verify_checksums(files)

    def _verify_checksums(self, files: dict) -> None:
        for name, info in files.items():
            crc = file_crc32(self.root / name)
            if crc != info["crc32"]:
                raise InteropError(f"{self.root / name}: checksum mismatch (crc32 {crc}, the manifest says {info['crc32']})")

    def confirm(self) -> None:
        """Raise if the background checksum check found a corrupt file."""
        if self._pending_check is not None:
            self._pending_check.result()

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, _dtype(t["dtype"], name), tuple(t["shape"]))
                for name, t in self.manifest["tensors"].items()]

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(inside(self.root, name, self.root / MANIFEST))
        return self._files[name]

    def _shard_file(self, name: str, shard: dict, dtype: torch.dtype) -> SafetensorsFile:
        """The shard's file, once its entry is checked to hold exactly what the manifest says."""
        f = self._file(shard["file"])
        got = f.meta(shard["key"])
        if got != (dtype, tuple(shard["shape"])):
            raise InteropError(f"{f.path}: {shard['key']} is {got[0]} {list(got[1])}, the manifest says "
                               f"{dtype} {shard['shape']} for a shard of {name}")
        return f

    def read(self, name: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (or the part in `box`), assembled from its shards; into `out` when given."""
        try:
            entry = self.manifest["tensors"][name]
        except KeyError:
            raise InteropError(f"{self.root}: no tensor {name!r} in the checkpoint") from None
        box = box or Box.whole(entry["shape"])
        if entry.get("split") == "vocab":  # the largest tensor: the layers' buffers would only add to the peak
            self._memory.release_idle()
        dtype = _dtype(entry["dtype"], name)
        pieces = []
        for shard in entry["shards"]:
            shard_box_ = Box(tuple(shard["offset"]), tuple(shard["shape"]))
            f, key = self._shard_file(name, shard, dtype), shard["key"]
            pieces.append((shard_box_, lambda common, out=None, f=f, key=key, b=shard_box_:
                           f.read(key, common.relative_to(b), out)))
        if out is None:
            return assemble(box, pieces, dtype, self._memory.empty)
        got = assemble(box, pieces, dtype, lambda shape, dtype: out)
        return got if got is out else out.copy_(got)

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        self.read(name, out=out)
        return True

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """The whole tensor's bytes as file ranges (path, offset, bytes) in row-major order, when its
        shards are blocks of whole rows (replicated, or split on axis 0); None otherwise."""
        entry = self.manifest["tensors"][name]
        shards = sorted(entry["shards"], key=lambda sh: sh["offset"])
        ranges, row = [], 0
        for shard in shards:
            if shard["offset"][0] != row or any(o != 0 for o in shard["offset"][1:]):
                return None
            where = self._shard_file(name, shard, _dtype(entry["dtype"], name)).byte_range(shard["key"])
            if where is None or list(shard["shape"][1:]) != list(entry["shape"][1:]):
                return None
            ranges.append((str(inside(self.root, shard["file"], self.root / MANIFEST)), *where))
            row += shard["shape"][0]
        return ranges if row == (entry["shape"] or [1])[0] else None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def file_name(kind: str, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    ep = "" if ep_rank is None else f"-ep{ep_rank:02d}"
    return f"{kind}-tp{tp_rank:02d}-pp{pp_rank:02d}{ep}.safetensors"


def plan_shards(spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta], adapter: AdapterSpec | None = None):
    """Where each tensor's shards go: {name: [(file, Box)]}, and each file's entries in write order
    (`adapter`: the tensors are that LoRA adapter's, on base model `spec`)."""
    index = tensor_index(spec, adapter)
    placement, files = {}, {}
    for meta in metas:
        param = index.get(base_param_name(meta.name))
        if param is None:
            raise InteropError(f"tensor {meta.name!r} is not a parameter of this {spec.arch} "
                               f"{'model' if adapter is None else 'LoRA adapter'}")
        if tuple(meta.shape) != param.shape:
            raise InteropError(f"tensor {meta.name!r} has shape {tuple(meta.shape)}, the model expects {param.shape}")
        kind = "optim" if TensorKey.parse(meta.name).is_optim else "model"
        stage = layout.stage_of(param)
        ep_rank = layout.ep_rank_of(param, spec.num_experts) if layout.ep > 1 else None
        ranks = range(layout.tp) if param.axis is not None else [0]
        placement[meta.name] = []
        for t in ranks:
            box = shard_box(meta.shape, param.axis, t, layout.tp)
            fname = file_name(kind, t, stage, ep_rank)
            placement[meta.name].append((fname, box))
            files.setdefault(fname, []).append((meta.name, meta.dtype, box.shape))
    return placement, files


class StoreWriter(BaseWriter):
    """Writes a common-format checkpoint at `layout`, taking one global tensor at a time.

    `only`: the files (`units`) this writer writes, for a conversion split over processes
    (`interop.workers`); None: all of them.  `adapter`: the tensors are this LoRA adapter's on base `spec`."""

    splits = True
    padded_vocab = staticmethod(padded_to_tp)
    holds_adapter = True

    def __init__(self, root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta], only=None,
                 adapter: AdapterSpec | None = None):
        spec.check_tp(layout.tp)
        spec.check_ep(layout.ep)
        if layout.num_layers != spec.num_layers:
            raise InteropError(f"layout has {layout.num_layers} layers, the model {spec.num_layers}")
        self.root, self.spec, self.layout = Path(root), spec, layout
        self.metas, self.adapter = metas, adapter
        self.placement, files = plan_shards(spec, layout, metas, adapter)
        self.units = list(files)  # stage by stage (the tensors' order), for `interop.workers`
        self.writers = {name: SafetensorsWriter(self.root / name, entries, {"format": "pt"})
                        for name, entries in sorted(files.items()) if only is None or name in only}
        self.carried: dict = {}

    def carry(self, carried) -> bool:
        """What the source holds besides weights (`Reader.carried`: files such as an HF tokenizer, and
        config values such as token ids): kept in `carried/` and the manifest for a later HF output."""
        self.carried = carried
        return True

    def wants(self, name: str) -> bool:
        return any(fname in self.writers for fname, _ in self.placement[name])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        for fname, box in self.placement[name]:
            if fname in self.writers:
                self.writers[fname].write(name, tensor[box.slices()])

    def finish_units(self, state: dict | None = None) -> dict:
        """Close this writer's files: {file: {"bytes", "crc32"}}."""
        files = {}
        for name, writer in self.writers.items():
            nbytes, crc = writer.close()
            files[name] = {"bytes": nbytes, "crc32": crc}
        return files

    def finish_global(self, state: dict | None, results: dict) -> None:
        """The carried files, then interop.json from every file's size and checksum (`results`)."""
        files = {name: results[name] for name in sorted(self.units)}
        names = sorted(self.carried.get("files", {}))
        if names:
            (self.root / CARRIED).mkdir()
        for name in names:
            target = self.root / CARRIED / name
            shutil.copyfile(self.carried["files"][name], target)
            files[f"{CARRIED}/{name}"] = {"bytes": target.stat().st_size, "crc32": file_crc32(target)}
        carried = {"files": names, "config": dict(self.carried.get("config", {}))}
        write_manifest(self.root, self.spec, self.layout, self.metas, self.placement, files, state,
                       carried if names or carried["config"] else None, self.adapter)

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()


def write_manifest(root, spec: ModelSpec, layout: ParallelLayout, metas: list[TensorMeta],
                   placement: dict, files: dict, state: dict | None = None, carried: dict | None = None,
                   adapter: AdapterSpec | None = None) -> None:
    """Write interop.json last: a directory without it is not a checkpoint.

    `placement` is `plan_shards`'s {name: [(file, Box)]}; `files` is {file: {"bytes", "crc32"}}.
    Split out so that ranks of a distributed trainer can write their own files and
    rank 0 the manifest.  `adapter`: the tensors are that LoRA adapter's (on base model `spec`).
    """
    index = tensor_index(spec, adapter)
    tensors = {}
    for meta in metas:
        tensors[meta.name] = {
            "dtype": NAME_OF_DTYPE[meta.dtype],
            "shape": list(meta.shape),
            "split": index[base_param_name(meta.name)].split,
            "shards": [{"file": f, "key": meta.name, "offset": list(b.offset), "shape": list(b.shape)}
                       for f, b in placement[meta.name]],
        }
    manifest = {
        "format": FORMAT, "version": VERSION,
        "spec": spec.to_dict(), "layout": layout.to_dict(),
        "tensors": tensors, "files": files, "state": state or {},
    }
    if carried:
        manifest["carried"] = carried
    if adapter is not None:
        manifest["adapter"] = adapter.to_dict()
    (Path(root) / MANIFEST).write_text(json.dumps(manifest, indent=1))
