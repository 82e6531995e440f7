"""Which rank files a Megatron `torch` checkpoint's iteration folder has, and which one holds which shard.

A folder `mp_rank_TT[_PPP][_EEE]` per (tp rank, stage, expert-parallel rank) saved; its name's parts are read
with the args the first file carries (a two-part name is the pp or the ep rank as the args say:
MEGATRON-LAYOUTS.md s.1).  With expert tensor parallelism not every (tp, ep) pair saves (`rank_folders`).
"""
from __future__ import annotations

from pathlib import Path

from ...errors import InteropError
from ...io.torch_file import LazyTorchFile
from .args import args_dict
from .checkpoint import RANK_DIR, RANK_FILE, rank_dir_name, rank_of_dir


def rank_folders(tp: int, etp: int, ep: int) -> dict[tuple[int, int], int]:
    """{(folder tp rank t, EP rank e): expert tp rank} of the rank files Megatron-LM's `--ckpt-format torch` writes on
    a pipeline stage.  The ranks of expert-data-parallel rank 0 save (training/checkpointing.py): local ranks
    r < etp * ep in parallel_state.py's rank order (tp-cp-ep-dp-pp, the experts' tp being etp).  Rank r's folder is
    named by its dense tp rank r % tp and its EP rank (r // etp) % ep (`get_checkpoint_name`) and holds the dense
    shards of tp rank r % tp and the expert shards of expert tp rank r % etp.  At etp = tp (megatron-core's default):
    every (t, e), holding expert shard t.  Refused where Megatron-LM's files would lose shards."""
    out: dict[tuple[int, int], int] = {}
    for r in range(etp * ep):
        folder = (r % tp, (r // etp) % ep)
        if folder in out:
            raise InteropError(f"etp={etp} with tp={tp}, ep={ep}: Megatron-LM's torch format writes two ranks' files "
                               f"into {rank_dir_name(folder[0], 0, 1, folder[1], ep)} (expert shards lost); "
                               "use --format torch_dist")
        out[folder] = r % etp
    missing = sorted(set(range(tp)) - {t for t, _ in out})
    if missing:
        raise InteropError(f"etp={etp} x ep={ep} is less than tp={tp}: Megatron-LM's torch format writes no file for "
                           f"tp rank {missing[0]} (its dense shards lost); use --format torch_dist")
    return out


class FolderPlan:
    """Where a rank's tensors are in the torch format's rank folders (`rank_folders`): the dense shards of tp rank t
    in folder (t, dense_ep[t]) (and copies in every folder named t), expert shard et of EP rank e in folder
    (expert_tp[(et, e)], e)."""

    def __init__(self, tp: int, etp: int, ep: int):
        self.folders = rank_folders(tp, etp, ep)
        self.expert_tp = {(et, e): t for (t, e), et in self.folders.items()}
        # the folder rank t itself saves (dense data-parallel rank 0: its distrib_optim.pt holds the dense buffers)
        self.dense_ep = {t: (t // etp) % ep for t in range(tp)}

    def of(self, row_ep: int | None, rank: int) -> tuple[int, int]:
        """(folder tp rank, EP rank) holding shard `rank` of a row (a dense row: tp rank; an expert row of EP rank
        `row_ep`: expert tp rank)."""
        if row_ep is None:
            return rank, self.dense_ep[rank]
        return self.expert_tp[(rank, row_ep)], row_ep


class RankFiles:
    """The rank files of one iteration folder, opened lazily: `ep_files` {(t, p, e): file}, `files` {(t, p): file}
    of the folder each tp rank's dense tensors are read from, `rank_dirs` their folder names, the sizes
    tp / pp / ep / etp and the `plan` of which folder holds which shard."""

    def __init__(self, dir: Path):
        self.dir = dir
        matches = {}
        for c in self.dir.iterdir():
            m = RANK_DIR.match(c.name)
            if m and c.is_dir():
                matches[c.name] = m
        if not matches:
            raise InteropError(f"{self.dir}: no mp_rank_* folders")
        first_name = min(matches, key=lambda n: [int(g or 0) for g in matches[n].groups()])
        first = LazyTorchFile(self._rank_path({0: first_name}, 0))
        stored = args_dict(first.obj.get("args")) if isinstance(first.obj, dict) else None
        stored = stored or {}
        parts = {len([g for g in m.groups() if g is not None]) for m in matches.values()}
        if len(parts) > 1:
            raise InteropError(f"{self.dir}: rank folder names mix {sorted(parts)} numbers ({', '.join(sorted(matches)[:3])})")
        parts = parts.pop()
        ep = int(stored.get("expert_model_parallel_size") or 1) if stored.get("num_experts") else 1
        if not stored and parts == 3:  # no args: a three-part name is unambiguous
            ep = max(int(m.group(3)) for m in matches.values()) + 1
        pp = stored.get("pipeline_model_parallel_size")
        if pp is None:  # no args: the names say (a two-part name taken as the pp rank, as before ep existed)
            pp = max(int(m.group(2) or 0) for m in matches.values()) + 1 if parts >= 2 else 1
        pp = int(pp)
        found = {}
        for name, m in matches.items():
            rank = rank_of_dir(m, pp, ep)
            if rank is None:
                raise InteropError(f"{self.dir}: rank folder {name} does not match pipeline size {pp} and expert "
                                   f"parallel size {ep} (mp_rank_TT[_PPP][_EEE]: _PPP when pp > 1, _EEE when ep > 1)")
            found[rank] = name
        tp = int(stored.get("tensor_model_parallel_size") or max(t for t, _, _ in found) + 1)
        etp = int(stored.get("expert_tensor_parallel_size") or tp) if stored.get("num_experts") else tp
        try:
            self.plan = FolderPlan(tp, etp, ep)
        except InteropError as exc:
            raise InteropError(f"{self.dir}: {exc}") from None
        shape = f"tp={tp} pp={pp}{f' ep={ep}' if ep > 1 else ''}{f' etp={etp}' if etp != tp else ''}"
        for p in range(pp):
            for t, e in self.plan.folders:
                if (t, p, e) not in found:
                    raise InteropError(f"{self.dir}: rank folder {rank_dir_name(t, p, pp, e, ep)} is missing "
                                       f"(the checkpoint is {shape})")
        extra = sorted(name for (t, p, e), name in found.items() if p >= pp or (t, e) not in self.plan.folders)
        if extra:
            raise InteropError(f"{self.dir}: rank folder {extra[0]} is beyond the checkpoint's {shape}")
        self.tp, self.pp, self.ep, self.etp = tp, pp, ep, etp
        self.ep_files = {}
        for key in sorted(found):
            self.ep_files[key] = first if found[key] == first_name else LazyTorchFile(self._rank_path(found, key))
        dense = self.plan.dense_ep
        self.rank_dirs = {(t, p): found[(t, p, e)] for t, p, e in found if e == dense[t]}
        # every EP rank holds the same non-expert tensors: those are read from one folder per tp rank (EP rank 0's
        # at etp = tp)
        self.files = {(t, p): f for (t, p, e), f in self.ep_files.items() if e == dense[t]}

    def _rank_path(self, found, key) -> Path:
        path = self.dir / found[key] / RANK_FILE
        if not path.is_file():
            raise InteropError(f"{path.parent}: {RANK_FILE} is missing")
        return path
