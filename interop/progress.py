"""The progress a caller asks `convert` for (`progress=`), whatever kind of object it passes."""
from __future__ import annotations


class Progress:
    """One interface over what a caller may pass as `progress=`: an object with start(total)/update(n)
    (the CLI's bar), a tqdm bar (update(n) and a settable .total), or a callable(done_bytes, total_bytes)."""

    def __init__(self, target):
        self.target, self.total, self.done = target, 0, 0

    def start(self, total: int) -> None:
        self.total = total
        if hasattr(self.target, "start"):
            self.target.start(total)
        elif hasattr(self.target, "update"):  # tqdm: learn the total now, refresh the bar
            self.target.total = total
            if hasattr(self.target, "refresh"):
                self.target.refresh()
        else:
            self.target(0, total)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if hasattr(self.target, "update"):
            self.target.update(nbytes)
        else:
            self.target(self.done, self.total)
