"""Checkpoint I/O in the common format: every rank reads its own shards, writes its own files.

Loading: a rank asks the store for the box of each of its parameters (its tp slice of
the global tensor), whatever layout the checkpoint was written at.

Saving `SAVE/step_000010/`:
  1. each file of the layout's plan (`model-tpXX-ppYY.safetensors`, `optim-...` with the Adam
     moments) is written by the lowest rank holding all its tensors (data-parallel replica 0;
     with expert parallelism, the replica holding those experts) into the hidden sibling
     `SAVE/.step_000010.tmp/`; a file mixing several ep ranks' experts is written by the rank
     holding most of it, the others sending it their tensors;
  2. rank 0 gathers the files' sizes and checksums, writes `interop.json` (with the
     training state: step, scheduler, optimizer settings, rng, data position) last,
     fsyncs, and renames the directory into place.
A run killed at any point before the rename leaves only the hidden directory behind,
which is never mistaken for a checkpoint; the previous `step_*` stays the newest.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from interop.atomic import fsync_tree
from interop.errors import InteropError
from interop.io.safetensors import SafetensorsWriter
from interop.adapter import AdapterSpec, tensor_index
from interop.params import TensorKey, base_param_name, param_index, param_table
from interop.shards import shard_box
from interop.store import StoreReader, is_store, plan_shards, write_manifest
from interop.tensors import TensorMeta

STEP_DIR = re.compile(r"^step_(\d+)$")
MOMENTS = ("exp_avg", "exp_avg_sq")


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def newest_checkpoint(root) -> Path | None:
    """`root` itself when it is a checkpoint, else its newest complete `step_*` directory."""
    root = Path(root)
    if is_store(root):
        return root
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and is_store(p)]
    return max(steps)[1] if steps else None


def remove_partial_saves(root) -> list[Path]:
    """Delete the hidden directories saves killed midway left in `root` (never checkpoints); returns them."""
    root = Path(root)
    stale = [p for p in root.glob(".step_*.tmp") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def _box(index: dict, name: str, grid):
    param = index[name]
    return shard_box(param.shape, param.axis, grid.tp_rank, grid.tp)


def load_weights(stage, reader: StoreReader, grid) -> None:
    index = param_index(stage.spec)
    with torch.no_grad():
        for name, p in stage.named_tensors():
            p.copy_(reader.read(name, _box(index, name, grid)).to(p.dtype))


def load_adapter(stage, reader: StoreReader, grid, names: list[str]) -> None:
    """The adapter's tensors `names` (this stage's) from a common-format adapter, at this rank's slices."""
    index, params = reader.source.adapter.index(stage.spec), dict(stage.named_parameters(remove_duplicate=False))
    loaded = {}  # Parameter -> the first name it was read as: a shared A (--lora-shared-a) is read once per part
    with torch.no_grad():
        for name in names:
            tensor = reader.read(name, _box(index, name, grid)).to(params[name].dtype)
            first = loaded.setdefault(params[name], name)
            if first != name and not torch.equal(params[name], tensor):
                raise InteropError(f"{reader.root}: {name} differs from {first}, and the adapter says a fused "
                                   "module's parts share one A (shared_a): it is damaged")
            params[name].copy_(tensor)


def has_moments(reader: StoreReader) -> bool:
    return any(TensorKey.parse(name).kind == "exp_avg" for name in reader.manifest["tensors"])


def load_optimizer(optimizer: torch.optim.Optimizer, named, reader: StoreReader, grid, step: int) -> None:
    """Restore AdamW's moments of the trained parameters `named` (read at this rank's slice) and its step count
    (bias correction); `reader` is a model checkpoint, or the adapter's when a LoRA adapter trains."""
    index = tensor_index(reader.spec, reader.source.adapter)
    for name, p in named:
        box = _box(index, name, grid)
        state = {"step": torch.tensor(float(step))}
        for m in MOMENTS:
            state[m] = reader.read(str(TensorKey(name, m)), box).to(device=p.device, dtype=p.dtype).clone()
        optimizer.state[p] = state


def _metas(table, with_optim: bool) -> list[TensorMeta]:
    metas = [TensorMeta(p.name, torch.float32, p.shape) for p in table]
    if with_optim:
        metas += [TensorMeta(str(TensorKey(meta.name, m)), torch.float32, meta.shape) for m in MOMENTS for meta in metas]
    return metas


def _local_tensor(name: str, params: dict, optimizer) -> torch.Tensor:
    key = TensorKey.parse(name)
    if key.is_optim:
        moment, base = key.kind, key.param
        if base.endswith(".router.expert_bias"):  # a buffer AdamW never steps: its moments are 0
            return torch.zeros_like(params[base]).cpu()
        return optimizer.state[params[base]][moment].cpu()
    return params[name].detach().cpu()


def _held(files: dict, placement: dict, params: dict, index: dict, grid) -> dict[str, list[str]]:
    """{file: the entries of it this rank holds}: the tensor is here, at the box the file stores."""
    held = {}
    for fname, entries in files.items():
        mine = []
        for name, _, _ in entries:
            base = base_param_name(name)
            box = shard_box(index[base].shape, index[base].axis, grid.tp_rank, grid.tp)
            if base in params and (fname, box) in placement[name]:
                mine.append(name)
        held[fname] = mine
    return held


def _writers(files: dict, holdings: list[dict]) -> dict[str, int]:
    """Each file's writer: the lowest rank holding all of it, else (a file mixing ep ranks' experts)
    the lowest rank holding most of it."""
    out = {}
    for fname, entries in files.items():
        counts = [len(h.get(fname, ())) for h in holdings]
        out[fname] = counts.index(max(counts))
    return out


def _missing(fname: str, files: dict, holdings: list[dict], writer: int) -> list[tuple[str, int]]:
    """(entry, lowest rank holding it) for the entries of `fname` its writer lacks, in file order."""
    have = set(holdings[writer].get(fname, ()))
    out = []
    for name, _, _ in files[fname]:
        if name not in have:
            holders = [r for r, h in enumerate(holdings) if name in h.get(fname, ())]
            if not holders:
                raise RuntimeError(f"no rank holds {name} for {fname}")
            out.append((name, holders[0]))
    return out


def _fail_hook(step: int, where: str, grid) -> None:
    """Test hook: INTEROP_TRAIN_KILL_AT=<step>:<write|rename> SIGKILLs rank 0 mid-save (a power cut, an OOM kill)."""
    if grid.rank == 0 and os.environ.get("INTEROP_TRAIN_KILL_AT") == f"{step}:{where}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(root, step: int, stage, optimizer, grid, layout, state: dict,
                    adapter: AdapterSpec | None = None) -> Path | None:
    """Write the checkpoint of update `step` collectively (every rank calls this); returns its path.
    `adapter`: a LoRA adapter trains on a frozen base; the checkpoint is the adapter (and its AdamW moments)."""
    spec, root = stage.spec, Path(root)
    final, tmp = step_dir(root, step), root / f".step_{step:06d}.tmp"
    distributed = grid.world > 1  # a one-rank run never touches torch.distributed (even if the caller did)
    if grid.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if distributed:
        dist.barrier()
    table = param_table(spec) if adapter is None else adapter.params(spec)
    metas = _metas(table, with_optim=bool(optimizer.state))
    placement, files = plan_shards(spec, layout, metas, adapter)
    index = tensor_index(spec, adapter)
    params = {name: p for name, p in stage.named_tensors() if stage.owned(name) and name in index}
    held = _held(files, placement, params, index, grid)
    holdings = [None] * grid.world
    if distributed:
        dist.all_gather_object(holdings, held)
    else:
        holdings = [held]
    writers = _writers(files, holdings)
    written = {}
    for fname in sorted(files):  # the same order on every rank: the sends below pair up
        missing = _missing(fname, files, holdings, writers[fname])
        if grid.rank != writers[fname]:
            for name, holder in missing:
                if holder == grid.rank:
                    dist.send(_local_tensor(name, params, optimizer).contiguous(), writers[fname])
            continue
        received = {}
        for name, holder in missing:
            dtype, shape = next((dtype, shape) for n, dtype, shape in files[fname] if n == name)
            received[name] = torch.empty(shape, dtype=dtype)
            dist.recv(received[name], holder)
        writer = SafetensorsWriter(tmp / fname, files[fname], {"format": "pt"})
        for i, (name, _, _) in enumerate(files[fname]):
            writer.write(name, received[name] if name in received else _local_tensor(name, params, optimizer))
            if i == len(files[fname]) // 2:
                _fail_hook(step, "write", grid)
        nbytes, crc = writer.close()
        written[fname] = {"bytes": nbytes, "crc32": crc}
    if distributed:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, written)
    else:
        gathered = [written]
    if grid.rank == 0:
        all_files = {k: v for part in gathered for k, v in part.items()}
        missing = sorted(set(files) - set(all_files))
        if missing:
            raise RuntimeError(f"checkpoint files never written: {missing}")
        write_manifest(tmp, spec, layout, metas, placement, dict(sorted(all_files.items())), state, adapter=adapter)
        _fail_hook(step, "rename", grid)
        fsync_tree(tmp)
        old = root / f".step_{step:06d}.old"
        if final.exists():  # a rerun of this step: move the old one aside, never leave a gap with neither
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if distributed:
        dist.barrier()
    return final


def open_checkpoint(path, what: str = "checkpoint") -> StoreReader:
    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path}: {what} not found")
    if not is_store(path):
        raise InteropError(f"{path}: not a complete interop checkpoint (no interop.json); other formats: "
                           f"interop convert {path} DST --to interop")
    return StoreReader(path)
