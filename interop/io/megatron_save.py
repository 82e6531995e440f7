"""Megatron's save folder: `latest_checkpointed_iteration.txt` names `iter_NNNNNNN/` (or `release/`).

Megatron (torch and torch_dist), interop's earlier MindSpore layout and map-args all find their
files through it (megatron/training/checkpointing.py: get_checkpoint_tracker_filename,
get_checkpoint_name).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import InteropError
from .small_files import read_small_text

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_name(iteration) -> str:
    """The folder of `iteration` (an int or "release") under a save root."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def iteration_of(name: str) -> int | str | None:
    """The iteration a folder name stands for (`iter_0000010` -> 10, `release`), or None."""
    if name == "release":
        return "release"
    return int(name[5:]) if name.startswith("iter_") and (name[5:].isascii() and name[5:].isdigit()) else None


TRACKER_LIMIT = 4096  # bytes: an iteration number or 'release'


def read_tracker(root) -> int | str:
    """The iteration `root`'s tracker file names; one line for a damaged one."""
    tracker = Path(root) / TRACKER
    text = read_small_text(tracker, "tracker file", TRACKER_LIMIT).strip()  # a number: bounded, FIFOs refused
    if text == "release":
        return "release"
    if not (text.isascii() and text.isdigit()):
        raise InteropError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    return int(text)


def write_tracker(root, iteration, newline: bool = True) -> None:
    """`newline` False: the number alone, as Megatron-LM's save_checkpoint and MindSpeed-LLM's converter write it."""
    (Path(root) / TRACKER).write_text(f"{iteration}\n" if newline else str(iteration))
