"""Where a Megatron checkpoint's files are: the tracker file, iteration folders, rank folders.

Shared by the torch and torch_dist formats, which lay out `save/` the same way.
"""
from __future__ import annotations

import re
from pathlib import Path

from ...errors import InteropError
from ...io.megatron_save import TRACKER, iteration_name, iteration_of, read_tracker

RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
# mp_rank_TT, mp_rank_TT_PPP (pp > 1), mp_rank_TT_EEE (ep > 1, pp 1), mp_rank_TT_PPP_EEE (both): Megatron-LM's
# training/checkpointing.py get_checkpoint_name appends `_{pipeline_rank:03d}` when pp > 1, then
# `_{expert_rank:03d}` when ep > 1.  A two-part name is the pp rank or the ep rank as the args say.
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
CHECKPOINT_VERSION = 3.0


def rank_dir_name(t: int, p: int, pp: int, e: int = 0, ep: int = 1) -> str:
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    return name if ep == 1 else f"{name}_{e:03d}"


def rank_of_dir(match, pp: int, ep: int) -> tuple[int, int, int] | None:
    """(tp, pp, ep) rank of a RANK_DIR match at pipeline size `pp` and expert size `ep`; None when the
    name has a different number of parts than those sizes give."""
    numbers = [int(g) for g in match.groups() if g is not None]
    want = 1 + (pp > 1) + (ep > 1)
    if len(numbers) != want:
        return None
    t = numbers[0]
    p = numbers[1] if pp > 1 else 0
    e = numbers[-1] if ep > 1 else 0
    return t, p, e


def is_dist_dir(path: Path) -> bool:
    return (path / "metadata.json").is_file() and (path / ".metadata").is_file()


def has_rank_dirs(path: Path) -> bool:
    return path.is_dir() and any(RANK_DIR.match(c.name) and c.is_dir() for c in path.iterdir())


def iteration_dir(path, iteration: int | None = None) -> tuple[Path, int | str | None]:
    """The iteration directory to read: the tracker's (or `iteration`'s) under a save root, or `path` itself."""
    root = Path(path)
    if iteration is not None:
        sub = root / iteration_name(iteration)
        if not sub.is_dir():
            found = sorted(c.name for c in root.iterdir() if c.name.startswith("iter_")) if root.is_dir() else []
            raise InteropError(f"{sub}: no such iteration directory (found: {', '.join(found) or 'none'})")
        return sub, int(iteration)
    if has_rank_dirs(root) or is_dist_dir(root):
        return root, iteration_of(root.name)
    tracker = root / TRACKER
    if not tracker.is_file():
        raise InteropError(f"{root}: not a Megatron checkpoint (no {TRACKER}, no mp_rank_* folders)")
    it = read_tracker(root)
    sub = root / iteration_name(it)
    if not sub.is_dir():
        raise InteropError(f"{tracker}: names {sub.name}, which does not exist")
    return sub, it


def final_iteration(asked: int | None, state: dict) -> int | str:
    """The iteration to save as: the one asked for, the source's, or `release`."""
    iteration = asked if asked is not None else state.get("iteration")
    return iteration if isinstance(iteration, int) else "release"

