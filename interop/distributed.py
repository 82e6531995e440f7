"""A conversion over the ranks of a torch.distributed job (`torchrun ... -m interop convert`, or Slurm `srun`
with torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

The work is split as `--workers` splits it (`engine.split_units`): rank r of W writes the target files
(units) of the r-th of W runs of consecutive units, into one temporary directory beside the destination
that rank 0 makes and every rank sees (a filesystem shared at the same path: checked at start-up).
Each rank sends rank 0 what its files' describers need (`writer.finish_units`); rank 0 writes the
describing files (indexes, `interop.json`, `.metadata`, ...) once, last, and renames the directory into
place.  The bytes are those of one process.

Coordination goes through the job's key-value store (the c10d store torch.distributed sets up over
gloo), never through a collective a dead rank would hang: each rank beats a heartbeat and posts its end
("ok" or its error).  A watcher thread in each rank stops the rank (KeyboardInterrupt in its main thread)
once any rank has failed; rank 0 watches every rank's heartbeat and every rank watches rank 0's, so a
SIGKILLed rank is found within `HEARTBEAT_TIMEOUT`.  The first rank to post a failure (`compare_set`) is
the one that prints the one `error:` line, naming the failed rank; the others exit quietly
(`RankStopped`).  Every rank removes the temporary directory after a failure, once the others have
stopped writing (or `STOP_WAIT` has passed).
"""
from __future__ import annotations

import _thread
import contextlib
import os
import pickle
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .errors import InteropError, RankStopped

HEARTBEAT_S = 0.5  # how often a rank beats and looks for a failure
HEARTBEAT_TIMEOUT = float(os.environ.get("INTEROP_DIST_HEARTBEAT_TIMEOUT", 20))  # a silent rank is dead after this
STOP_WAIT = 60.0  # after a failure, how long a rank waits for the others to stop writing before cleaning up
STORE_TIMEOUT = timedelta(seconds=float(os.environ.get("INTEROP_DIST_TIMEOUT", 1800)))


_conversions = [0]


def from_env() -> "Group | None":
    """The job this process is a rank of, when torchrun (or srun with its variables) started it with
    WORLD_SIZE > 1; None for an ordinary run."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "RANK" not in os.environ:
        return None
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=STORE_TIMEOUT)
    _conversions[0] += 1  # every rank converts in the same order: the n-th conversion of a job has its own keys
    store = dist.PrefixStore(f"interop/{_conversions[0]}/", dist.distributed_c10d._get_default_store())
    return Group(dist.get_rank(), dist.get_world_size(), store)


@dataclass
class Group:
    rank: int
    world: int
    store: object

    def __post_init__(self):
        self.host = socket.gethostname()
        self.failed = False
        self.stopping = threading.Event()
        self.beat = 0
        self.tmp = None  # the shared temporary directory, once rank 0 made it
        self.announces = False  # this rank posted the job's failure: it prints the error line
        self.lock = threading.Lock()  # the watcher interrupts the main thread only before it handles a failure
        self.store.set(f"who/{self.rank}", f"{self.host} pid {os.getpid()}")
        self._watch = threading.Thread(target=self._watcher, daemon=True, name="interop-rank-watcher")
        self._watch.start()

    # -- failure: posted once, seen by all --------------------------------------------------------------------
    def fail(self, message: str) -> bool:
        """Post `message` as the job's failure; True when this rank posted it first: then it `announces` it
        (prints the one error line), whichever thread posted it."""
        try:
            got = self.store.compare_set("failed", "", message)
            won = (got.decode() if isinstance(got, bytes) else got) == message
        except Exception:  # the store is gone: this rank is on its own
            won = True
        self.announces = self.announces or won
        return won

    def failure(self) -> str | None:
        try:
            if self.store.check(["failed"]):
                return self.store.get("failed").decode()
        except Exception:  # no one can coordinate any more: each rank that sees it says it
            self.announces = True
            return "the job's store stopped answering (rank 0's node gone?)"
        return None

    def _watcher(self) -> None:
        watched = range(self.world) if self.rank == 0 else [0]
        last = {r: (None, time.monotonic()) for r in watched if r != self.rank}
        while not self.stopping.is_set():
            try:
                self.beat += 1
                self.store.set(f"beat/{self.rank}", str(self.beat))
                now = time.monotonic()
                for r, (value, since) in list(last.items()):
                    if self.store.check([f"end/{r}"]):
                        del last[r]
                        continue
                    seen = self.store.get(f"beat/{r}") if self.store.check([f"beat/{r}"]) else None
                    if seen != value:
                        last[r] = (seen, now)
                    elif now - since > HEARTBEAT_TIMEOUT:
                        self.fail(f"rank {r} ({self._who(r)}) stopped answering for {HEARTBEAT_TIMEOUT:.0f} s "
                                  "(killed, or out of memory?)")
                        del last[r]
                if self.failure() is not None:
                    self._interrupt()
            except Exception:  # the store is gone (its host ended): stop this rank, unless it is ending anyway
                if not self.stopping.is_set():
                    self._interrupt()
            self.stopping.wait(HEARTBEAT_S)

    def _interrupt(self) -> None:
        with self.lock:
            if not self.failed:
                self.failed = True
                _thread.interrupt_main()

    def handling(self) -> None:
        """The main thread handles a failure now: no interrupt from here on."""
        with self.lock:
            self.failed = True

    def _who(self, r: int) -> str:
        try:
            return self.store.get(f"who/{r}").decode()
        except Exception:
            return "?"

    # -- the happy path ---------------------------------------------------------------------------------------
    def post(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def wait_for(self, keys: list[str]) -> list:
        """The values posted under `keys`, once all are there; raises when the job failed meanwhile."""
        pending = list(keys)
        while pending:
            if self.failure() is not None:
                raise KeyboardInterrupt  # turned into the failure by `run`
            if self.store.check(pending[:1]):
                pending.pop(0)
            else:
                time.sleep(0.05)
        return [pickle.loads(self.store.get(k)) for k in keys]

    def end(self, status: str) -> None:
        try:
            self.store.set(f"end/{self.rank}", status)
        except Exception:
            pass

    def wait_stopped(self) -> None:
        """After a failure: until every other rank has posted its end or gone silent (bounded by STOP_WAIT)."""
        deadline = time.monotonic() + STOP_WAIT
        beats = {}
        for r in range(self.world):
            while r != self.rank and time.monotonic() < deadline:
                try:
                    if self.store.check([f"end/{r}"]):
                        break
                    beat = self.store.get(f"beat/{r}") if self.store.check([f"beat/{r}"]) else None
                except Exception:
                    return
                first = beats.setdefault(r, (beat, time.monotonic()))
                if beat != first[0] or time.monotonic() - first[1] < 3 * HEARTBEAT_S:
                    if beat != first[0]:
                        beats[r] = (beat, time.monotonic())
                    time.sleep(HEARTBEAT_S / 2)
                    continue
                break  # no beat for a few periods: gone

    def close(self) -> None:
        """Stop the watcher and wait for it: a thread still inside a store call when the interpreter exits aborts
        the process ("terminate called without an active exception", seen once on a rank of a finished job)."""
        self.stopping.set()
        if self._watch is not threading.current_thread():
            self._watch.join(timeout=10 * HEARTBEAT_S)


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "interrupted"
    if isinstance(exc, InteropError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie: dead, not yet reaped
    except (OSError, IndexError):
        return True


def _dead_neighbour(group: Group) -> str | None:
    """A rank on this host whose process has ended: what a launcher's SIGTERM after a SIGKILL is about."""
    for r in range(group.world):
        who = group._who(r)
        host, _, pid = who.partition(" pid ")
        if r != group.rank and host == group.host and pid.isdigit() and _pid_gone(int(pid)):
            return f"rank {r} ({who}) ended without a word (killed, or out of memory?)"
    return None


def check_paths(group: Group, src, dst) -> None:
    """Start-up: every rank sees SRC and the destination's parent (which rank 0 makes); else one error line
    naming the first rank that does not."""
    parent = Path(dst).absolute().parent
    if group.rank == 0:
        parent.mkdir(parents=True, exist_ok=True)
        group.post("parent", True)
    group.wait_for(["parent"])
    missing = [str(p) for p in (src, parent) if not Path(p).exists()]
    group.post(f"seen/{group.rank}", missing)
    for r, seen in enumerate(group.wait_for([f"seen/{r}" for r in range(group.world)])):
        if seen:
            raise InteropError(f"rank {r} ({group._who(r)}) does not see {' nor '.join(seen)}: every rank needs "
                               "the source and the destination's parent on one filesystem, at the same path")


@contextlib.contextmanager
def guarded(group: Group):
    """Run a rank's whole conversion: any failure stops every rank; the rank that failed first raises its
    InteropError (one `error:` line), the others `RankStopped`; the shared temporary directory goes."""
    try:
        yield
    except BaseException as exc:
        group.handling()
        if group.failure() is None:  # this rank's own failure (an error, or a signal)
            why = _dead_neighbour(group) if isinstance(exc, KeyboardInterrupt) else None
            group.fail(why or f"rank {group.rank}: {describe_error(exc)}")
        first = group.announces
        group.end("failed")
        group.close()
        group.wait_stopped()
        if group.tmp is not None:
            shutil.rmtree(group.tmp, ignore_errors=True)
        if first:
            raise InteropError(group.failure() or describe_error(exc)) from exc
        raise RankStopped(group.failure() or "another rank failed") from None
    finally:
        group.close()


def run(group: Group, tmp_of, work, finish) -> None:
    """Drive one rank inside `guarded`: `tmp_of()` (rank 0: make the shared temporary directory and return its
    path) -> `work(tmp)` (this rank's units; returns what rank 0's describers need) -> rank 0
    `finish(tmp, results)` (the describing files and the rename)."""
    if group.rank == 0:
        group.tmp = Path(tmp_of())
        group.post("tmp", str(group.tmp))
    tmp = Path(group.wait_for(["tmp"])[0])
    group.post(f"tmp-seen/{group.rank}", tmp.is_dir())
    for r, seen in enumerate(group.wait_for([f"tmp-seen/{r}" for r in range(group.world)])):
        if not seen:
            raise InteropError(f"rank {r} ({group._who(r)}) does not see rank 0's temporary directory {tmp}: every "
                               "rank needs the destination's parent on one shared filesystem, at the same path")
    group.tmp = tmp
    result = work(tmp)
    group.post(f"result/{group.rank}", result)
    group.end("ok")
    if group.rank == 0:
        finish(tmp, group.wait_for([f"result/{r}" for r in range(group.world)]))
        group.tmp = None  # renamed into place: nothing to remove now
        group.post("published", "ok")
    else:
        group.wait_for(["published"])
