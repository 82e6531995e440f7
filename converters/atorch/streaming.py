"""Where each parameter lies in ATorch FSDP's streaming checkpoint (atorch/utils/fsdp_save_util.py, atorch 0.2.5).

`save_fsdp_flat_param(model, path)` (FSDP with `use_orig_params`): rank r of the w data-parallel ranks writes

    flat_param.RRRRR-WWWWW   safetensors: per FSDP unit (key: its module name, "" for the root) rank r's shard of
                             the unit's 1-D flat parameter: the unit's parameters one after another, FSDP's
                             alignment padding between them, the world size's padding at the end of the last shard
    flat_meta.RRRRR-WWWWW    pickle {"param_meta": {name: {"param_shapes", "param_numels", "param_offsets": (start,
                             end) in this shard, "rank", "striped_fsdp_name": the unit, ...}} for each parameter
                             with a piece here, "flat_param_meta": {unit: sizes}} (version 1; version 0 pickled
                             the param_meta dict alone)
    ckpt_meta                pickle {"version", "world_size", "wrap_class"} (rank 0)
    buffers                  safetensors of the model's buffers (rank 0)

ATorch's consolidation, `ConvertFlatParam` (`ShardTensorUtil.load_tensor_by_name`), concatenates a parameter's
pieces in rank order (the meta files' sorted names) and reshapes them to `param_shapes`; so does this, reading
only the pieces' bytes.  `save_fsdp_optim_param(model, optimizer, path)` writes `optim_param.RRRRR-WWWWW`
(safetensors `<name>-<state>`: rank r's 1-D piece of each parameter's `exp_avg`, `exp_avg_sq`; `step` a scalar)
and `optim_meta` (pickle: the param groups, names for ids); ATorch's `ShardOptim` concatenates a state's pieces
in the files' order.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ...errors import InteropError
from ...io.safe_pickle import load_plain_pickle
from ...io.safetensors import SafetensorsFile
from ...shards import Box

CKPT_META, OPTIM_META = "ckpt_meta", "optim_meta"
NAME = re.compile(r"^(flat_param|flat_meta|optim_param)\.(\d{5})-(\d{5})$")
VERSIONS = (0, 1)  # fsdp_save_util.CKPT_VERSION is 1; a folder without ckpt_meta is version 0
MOMENTS = ("exp_avg", "exp_avg_sq")


def rank_files(folder: Path) -> tuple[dict[str, dict[int, Path]], int]:
    """({kind: {rank: path}} of the folder's `kind.RRRRR-WWWWW` files, their one world size); the flat_param and
    flat_meta files of every rank (the weights), the optimizer's checked by `missing_ranks`."""
    found: dict[str, dict[int, Path]] = {}
    worlds = set()
    for path in folder.iterdir():
        m = NAME.match(path.name)
        if m:
            found.setdefault(m[1], {})[int(m[2])] = path
            worlds.add(int(m[3]))
    if len(worlds) > 1:
        raise InteropError(f"{folder}: files of {len(worlds)} world sizes ({sorted(worlds)}) in one folder "
                           "(saved more than once into it?)")
    world = worlds.pop() if worlds else 0
    beyond = sorted(f"{kind}.{r:05d}" for kind, files in found.items() for r in files if r >= world)
    if beyond:
        raise InteropError(f"{folder}: {beyond[0]}-{world:05d} names a rank beyond the world size {world}")
    for kind in ("flat_param", "flat_meta"):
        missing = missing_ranks(found.get(kind, {}), world)
        if missing:
            raise InteropError(f"{folder}: {kind} files of ranks {missing} missing for world size {world}")
    return found, world


def missing_ranks(files: dict[int, Path], world: int) -> list[int]:
    return sorted(set(range(world)) - set(files))


class FlatShards:
    """The parameters of a streaming checkpoint: {name: (dtype, shape)} and each one's bytes from its pieces."""

    def __init__(self, folder: Path, files: dict[str, dict[int, Path]]):
        self.folder = folder
        flat, meta = files.get("flat_param", {}), files.get("flat_meta", {})
        if not flat or len(flat) != len(meta):
            raise InteropError(f"{folder}: {len(flat)} flat_param and {len(meta)} flat_meta files (ATorch's "
                               "save_fsdp_flat_param writes one of each per rank)")
        self.world = len(flat)
        self.version = self._version(folder)
        self.shards = [SafetensorsFile(flat[r]) for r in range(self.world)]
        self.pieces: dict[str, list[tuple[int, str, int, int]]] = {}  # name -> [(rank, unit, start, end)]
        self.shapes: dict[str, tuple[int, ...]] = {}
        dtypes = set()
        for r in range(self.world):
            param_meta, units = self._meta(meta[r])
            expert = [u for u, m in units.items() if isinstance(m, dict) and "expert_ranks" in m]
            if expert:
                raise InteropError(f"{meta[r]}: FSDP unit {expert[0]!r} is sharded over an expert-parallel group "
                                   "(FSDP with expert parallelism): not read")
            shard = self.shards[r]
            for name, m in param_meta.items():
                try:
                    unit, (start, end), shape = m["striped_fsdp_name"], m["param_offsets"], tuple(m["param_shapes"])
                    owner = m["rank"]
                    if not all(type(d) is int and d >= 0 for d in shape):
                        raise ValueError
                except (KeyError, TypeError, ValueError):
                    raise InteropError(f"{meta[r]}: malformed entry for {name!r}") from None
                if owner != r:
                    raise InteropError(f"{meta[r]}: {name} says rank {owner}, the file is rank {r}'s")
                if unit not in shard.entries:
                    raise InteropError(f"{flat[r]}: no flat parameter for FSDP unit {unit!r}, which {name} is in")
                dtype, unit_shape = shard.meta(unit)
                if len(unit_shape) != 1 or not (type(start) is int and type(end) is int
                                                and 0 <= start <= end <= unit_shape[0]):
                    raise InteropError(f"{meta[r]}: {name}'s piece [{start}, {end}) lies outside unit {unit!r}'s "
                                       f"shard in {flat[r].name}")
                if self.shapes.setdefault(name, shape) != shape:
                    raise InteropError(f"{folder}: {name} has shape {list(shape)} on rank {r}, "
                                       f"{list(self.shapes[name])} on another")
                dtypes.add(dtype)
                self.pieces.setdefault(name, []).append((r, unit, start, end))
        for name, pieces in self.pieces.items():
            held, want = sum(e - s for _, _, s, e in pieces), math.prod(self.shapes[name])
            if held != want:
                raise InteropError(f"{folder}: the ranks' pieces of {name} hold {held} values, its shape "
                                   f"{list(self.shapes[name])} {want} (a rank's files from another save?)")
        if len(dtypes) != 1:
            raise InteropError(f"{folder}: flat parameters of {len(dtypes)} dtypes ({sorted(map(str, dtypes))})")
        self.dtype = dtypes.pop()

    def _version(self, folder: Path) -> int:
        path = folder / CKPT_META
        if not path.is_file():
            return 0
        meta = load_plain_pickle(path, "ATorch ckpt_meta")
        version = meta.get("version") if isinstance(meta, dict) else None
        if version not in VERSIONS:
            raise InteropError(f"{path}: checkpoint version {version!r}; ATorch 0.2.5 writes {VERSIONS[-1]}")
        if meta.get("world_size") != self.world:
            raise InteropError(f"{path}: world_size {meta.get('world_size')!r}, but {self.world} ranks' files")
        return version

    def _meta(self, path: Path) -> tuple[dict, dict]:
        data = load_plain_pickle(path, "ATorch flat_meta")
        if self.version == 0:
            param_meta, units = data, {}
        else:
            param_meta = data.get("param_meta") if isinstance(data, dict) else None
            units = data.get("flat_param_meta") if isinstance(data, dict) else None
        if not isinstance(param_meta, dict) or not isinstance(units, dict):
            raise InteropError(f"{path}: not an ATorch flat_meta of checkpoint version {self.version}")
        return param_meta, units

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(math.prod(self.shapes[name]), dtype=self.dtype)
        pos = 0
        for r, unit, start, end in self.pieces[name]:
            self.shards[r].read(unit, Box((start,), (end - start,)), out=out[pos:pos + end - start])
            pos += end - start
        return out.view(self.shapes[name])

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


class OptimShards:
    """Adam's moments of a streaming checkpoint (`optim_param.*`, `optim_meta`), whole per parameter."""

    def __init__(self, folder: Path, paths: dict[int, Path], shapes: dict[str, tuple[int, ...]]):
        self.folder, self.shapes = folder, shapes
        self.files = [SafetensorsFile(paths[r]) for r in sorted(paths)]
        self.groups = load_plain_pickle(folder / OPTIM_META, "ATorch optim_meta") \
            if (folder / OPTIM_META).is_file() else None
        if not isinstance(self.groups, list) or not all(isinstance(g, dict) for g in self.groups):
            raise InteropError(f"{folder / OPTIM_META}: missing or not ATorch's list of parameter groups")
        self.pieces: dict[tuple[str, str], list[int]] = {}  # (name, state) -> ranks holding a piece
        for r, f in enumerate(self.files):
            for key in f.keys():
                name, _, state = key.rpartition("-")
                self.pieces.setdefault((name, state), []).append(r)

    def holds_moments(self) -> bool:
        """Every parameter's exp_avg and exp_avg_sq, whole."""
        for name, shape in self.shapes.items():
            for state in MOMENTS:
                ranks = self.pieces.get((name, state), [])
                shapes = [self.files[r].meta(f"{name}-{state}")[1] for r in ranks]
                if any(len(s) != 1 for s in shapes) or sum(s[0] for s in shapes) != math.prod(shape):
                    return False
        return True

    def dtype(self) -> torch.dtype:
        name = next(iter(self.shapes))
        return self.files[self.pieces[(name, MOMENTS[0])][0]].meta(f"{name}-{MOMENTS[0]}")[0]

    def step(self) -> int:
        name = next(iter(self.shapes))
        ranks = self.pieces.get((name, "step"), [])
        steps = set()
        for r in ranks:
            step = self.files[r].read(f"{name}-step")
            if step.numel() != 1:
                raise InteropError(f"{self.files[r].path}: {name}-step holds {step.numel()} values, not a step count")
            steps.add(int(step.item()))
        if len(steps) != 1:
            raise InteropError(f"{self.folder}: {name}'s step is {sorted(steps) or 'missing'} on its ranks")
        return steps.pop()

    def hyper(self) -> dict:
        """lr, betas, eps, weight_decay of the first param group (ATorch's optim_meta)."""
        group = self.groups[0]
        return {k: list(group[k]) if isinstance(group[k], tuple) else group[k]
                for k in ("lr", "betas", "eps", "weight_decay") if k in group}

    def read(self, name: str, state: str) -> torch.Tensor:
        key = f"{name}-{state}"
        return torch.cat([self.files[r].read(key) for r in self.pieces[(name, state)]]).view(self.shapes[name])

    def close(self) -> None:
        for f in self.files:
            f.close()
