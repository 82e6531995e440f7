"""A common-format reader that SIGKILLs the first `--workers` worker to reach its third tensor, as the
kernel's OOM killer would: for the test that a run losing a worker mid-way ends in one line, nothing left."""
from __future__ import annotations

import os
import signal

from interop.converters.interop_format import Reader


class KilledInOneWorker(Reader):
    def __init__(self, path, kill_flag: str | None = None):
        super().__init__(path)
        self.kill_flag, self.reads = kill_flag, 0

    def read(self, name, *args, **kwargs):
        self.reads += 1
        if self.kill_flag and self.reads == 3:
            try:
                os.close(os.open(self.kill_flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # the first worker only
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().read(name, *args, **kwargs)
