"""Rank files that are copies of one another: refused, one helper for every sharded source.

Two ranks of a split tensor hold different shards; a rank file whose split tensors are ALL byte-identical to
another rank's is a copied file (a damaged or hand-assembled checkpoint), and reading it would pass one shard off
as another.  One identical split tensor is common (zero biases), all of them is not.  Identity is judged from
checksums the files already carry (a torch zip record's CRC-32 and size, a MindSpore `.ckpt` trailer's CRC-32 and
the file's size): nothing is read for it.  Where no checksum covers the bytes, a sample of them stands in and the
files whose samples agree are compared in full (`confirm`): a read of a few KiB per file for a genuine
checkpoint, whose ranks differ from their first bytes on.  `--allow-identical-ranks` reads such files as given, noted."""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, NamedTuple

import torch

from .errors import InteropError
from .io.torch_file import LazyTorchFile

FLAG = "--allow-identical-ranks"


class RankPrint(NamedTuple):
    """One rank file in a group whose members must differ: `sums` identifies its split tensors' bytes (equal
    sums: equal bytes), None where no checksum covers them; `rank` names it ("tensor-parallel rank 1");
    `what` is what the sums cover ("every split tensor (12)")."""
    path: str
    rank: str
    sums: Hashable | None
    what: str


def record_sums(file: LazyTorchFile, tensors: Iterable[tuple[str, object]]) -> tuple | None:
    """The sums of `tensors` ((key, meta tensor) of `file`): each one's record CRC-32 and size from the zip's
    directory; None when no record of them carries a CRC (a file loaded whole, torch's compute_crc32=False)."""
    out = []
    for key, t in tensors:
        if isinstance(t, torch.Tensor):
            checksum = file.record_checksum(t)
            if checksum is not None and checksum[0]:
                out.append((key, *checksum))
    return tuple(sorted(out)) or None


def check_distinct(group: Iterable[RankPrint], notes: list[str], allow: bool,
                   confirm: Callable[[RankPrint, RankPrint], bool] | None = None) -> None:
    """Refuse (or, with `allow`, note) the first member of `group` whose sums equal an earlier member's (and,
    where the sums are a sample, that `confirm(member, earlier)` finds byte-identical)."""
    seen: dict = {}
    for member in group:
        if member.sums is None:
            continue
        earlier = seen.setdefault(member.sums, [])
        first = next((m for m in earlier if confirm is None or confirm(member, m)), None)
        if first is None:
            earlier.append(member)
            continue
        if not allow:
            raise InteropError(f"{member.path}: {member.what} is byte-identical to {first.rank}'s ({first.path}): "
                               f"a copied rank file, not a model (pass {FLAG} if it is genuinely so)")
        notes.append(f"{member.path}: {member.what} byte-identical to {first.rank}'s (read as given: {FLAG})")
