"""Where each rank's `.ckpt` lives, for writing and for finding them again.

  mindspeed     `rank_{r}/network.ckpt`, r = the global rank of (tp rank t, stage p) at data-parallel rank 0:
                r = p * dp * tp + t (MindSpeed-Core-MS r0.1.0 tools/converter/convert_pt2ckpt.py
                get_ms_dir_format, order tp-cp-ep-dp-pp, cp folded into dp; its training loads the newest
                `load_checkpoint/rank_{get_rank()}/*.ckpt` and a rank without a folder loads rank
                p * dp * tp + t, training/training.py).  Older interop wrote Megatron's
                `iter_*/mp_rank_TT[_PPP]/model_optim_rng.ckpt`: still read.
  mindformers   one `model.ckpt`, or `rank_{r}/checkpoint_{r}.ckpt` (r = p * dp * tp + d * tp + t; dp > 1 only
                where expert parallelism needs more ranks than tp: `Dialect.rank_files`) plus `strategy/`.
"""
from __future__ import annotations

import re
from pathlib import Path

from ...errors import InteropError
from ...io.megatron_save import TRACKER, iteration_name, read_tracker

SIDECAR = "mindspore_model.json"
OLD_RANK_FILE = "model_optim_rng.ckpt"
MINDSPEED_FILE = "network.ckpt"  # convert_pt2ckpt.py --file-prefix default 'network', --format 'ckpt'
SINGLE_FILE = "model.ckpt"

_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_RANK = re.compile(r"^rank_(\d+)$")


def mindspeed_file(root: Path, t: int, p: int, tp: int, dp: int = 1, d: int = 0) -> Path:
    r = p * dp * tp + d * tp + t  # d: the data-parallel rank (expert-parallel rank d < ep)
    return root / f"rank_{r}" / MINDSPEED_FILE


def mindformers_file(root: Path, t: int, p: int, tp: int, pp: int, dp: int = 1, d: int = 0) -> Path:
    if tp == 1 and pp == 1 and dp == 1:
        return root / SINGLE_FILE
    r = p * dp * tp + d * tp + t  # d: the data-parallel rank (MindFormers' ranks: dp outer, tp inner per stage)
    return root / f"rank_{r}" / f"checkpoint_{r}.ckpt"


def detect(path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.suffix == ".ckpt"
    if (path / SIDECAR).is_file():
        return True
    return any(path.glob("*.ckpt")) or any(path.glob("rank_*/*.ckpt")) or any(path.glob("*/mp_rank_*/*.ckpt"))


def old_mindspeed_tree(path: Path) -> tuple[dict[tuple[int, int], Path], int, int] | None:
    """{(tp rank, stage): file} of interop's earlier `iter_*/mp_rank_*` layout, or None."""
    tracker = path / TRACKER
    if not (tracker.is_file() or any(path.glob("*/mp_rank_*"))):
        return None
    if tracker.is_file():
        folder = iteration_name(read_tracker(path))
    else:
        folders = sorted({p.parent.name for p in path.glob("*/mp_rank_*")})
        if len(folders) != 1:
            raise InteropError(f"{path}: several iterations ({', '.join(folders)}) and no {TRACKER}")
        folder = folders[0]
    ranks = {}
    for d in sorted((path / folder).glob("mp_rank_*")):
        m = _MP_RANK.match(d.name)
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = d / OLD_RANK_FILE
    if not ranks:
        raise InteropError(f"{path / folder}: no mp_rank_* folders")
    tp, pp = max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks or not ranks[(t, p)].is_file()]
    if missing:
        t, p = missing[0]
        raise InteropError(f"{path}: the checkpoint of tp rank {t}, stage {p} is missing "
                           f"({len(missing)} of {tp * pp} rank files)")
    return ranks, tp, pp


def rank_folders(path: Path) -> tuple[dict[int, Path], list[str]]:
    """{global rank: its .ckpt} for `rank_N/` folders, and notes.  Like MindSpeed's loader
    (get_last_checkpoint), a folder with several .ckpt files is read from its newest one."""
    out, notes = {}, []
    for d in path.iterdir():
        m = _RANK.match(d.name)
        if not (m and d.is_dir()):
            continue
        files = sorted(d.glob("*.ckpt"), key=lambda f: (f.stat().st_mtime, f.name))
        if not files:
            raise InteropError(f"{d}: no .ckpt file")
        if len(files) > 1:
            notes.append(f"{d.name}: read the newest of {len(files)} .ckpt files ({files[-1].name}), "
                         "as MindSpeed's loader does")
        out[int(m.group(1))] = files[-1]
    if 0 not in out:
        raise InteropError(f"{path}: rank_N folders without rank_0")
    return out, notes[:1]


def single_file(path: Path) -> Path | None:
    """The one .ckpt of a file path or a folder holding exactly one."""
    if path.is_file():
        return path
    files = sorted(path.glob("*.ckpt"))
    if len(files) == 1:
        return files[0]
    if files:
        raise InteropError(f"{path}: expected one .ckpt file (or rank folders), found {len(files)}")
    return None
