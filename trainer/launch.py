"""Starting the ranks: in this process (one rank), as spawned processes, or under torchrun.

`train(cfg)` is the Python API behind `interop train`.  It checks the run first (so
user mistakes are one-line errors before any process starts), then:
  - under torchrun (RANK / WORLD_SIZE set): this process is one rank of the run;
  - world size 1: runs here, no process group at all;
  - otherwise: spawns dp * tp * pp processes on this machine (gloo on CPU, NCCL on
    GPU) and collects rank 0's metrics through a queue.
"""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import sys

import torch
import torch.multiprocessing as mp

from interop.errors import InteropError

from .config import TrainConfig
from .train import Plan, cleanup, describe_plan, discard_failed_save, prepare, run


class TrainingFailed(Exception):
    """A rank died (killed, out of memory, a bug): not a user mistake, so exit 1, not 2."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCHRUN_JOB_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                     "ROLE_WORLD_SIZE", "ROLE_NAME")


def enter_own_world(env: dict) -> None:
    """In a child that starts a gloo world of its own (`env`: its RANK, WORLD_SIZE, MASTER_*): forget the
    torchrun job this process may run inside.  Else `TORCHELASTIC_USE_AGENT_STORE` makes init_process_group
    wait as a client of the launcher's store, on the child's own port where no store will ever be."""
    for key in [k for k in os.environ if k.startswith("TORCHELASTIC_") or k in TORCHRUN_JOB_VARS]:
        del os.environ[key]
    os.environ.update(env)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "INTEROP_SPAWNED" not in os.environ


def train(cfg: TrainConfig) -> list[dict]:
    """Run (or join) a training run; returns the per-step metrics [{step, loss, lr, ...}]."""
    if under_torchrun():
        plan = prepare(cfg, world=int(os.environ["WORLD_SIZE"]))
        if int(os.environ["RANK"]) == 0:
            _announce(plan)
        try:
            return run(plan, int(os.environ["RANK"]), plan.world, int(os.environ.get("LOCAL_RANK", 0)))
        except BaseException:
            if int(os.environ["RANK"]) == 0:
                discard_failed_save(plan)
            raise
        finally:
            cleanup(plan)
    plan = prepare(cfg)
    _announce(plan)
    try:
        if plan.world == 1:
            return run(plan)
        return spawn(plan)
    except BaseException:
        discard_failed_save(plan)
        raise
    finally:
        cleanup(plan)


def _announce(plan: Plan) -> None:
    if not plan.cfg.quiet:
        print("\n".join(describe_plan(plan)), flush=True)


def _rank_main(rank: int, plan: Plan, results, env: dict) -> None:
    enter_own_world(env)  # a forkserver child has the server's environment, not the launcher's
    os.environ["INTEROP_SPAWNED"] = "1"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.world))
    try:
        history = run(plan, rank, plan.world)
    except InteropError as exc:
        results.put(("error", str(exc)))
        sys.exit(2)
    if rank == 0:
        results.put(("ok", history))


def start_method() -> str:
    """forkserver where there is one: a clean server process imports torch once, then every rank of
    every later run forks from it (fast, and no threads inherited).  INTEROP_START_METHOD overrides."""
    default = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    return os.environ.get("INTEROP_START_METHOD", default)


def spawn(plan: Plan) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k.startswith("INTEROP_")}
    env.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(free_port()))
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["interop.trainer.train"])
    results = ctx.Queue()
    procs = mp.start_processes(_rank_main, args=(plan, results, env), nprocs=plan.world, join=False, start_method=method)
    outcome = []

    def drain():
        while True:
            try:
                outcome.append(results.get_nowait())
            except queue_mod.Empty:
                return

    try:
        while not procs.join(timeout=0.2):
            drain()
    except mp.ProcessExitedException as exc:
        drain()
        errors = [msg for kind, msg in outcome if kind == "error"]
        if errors:
            raise InteropError(errors[0]) from None
        raise TrainingFailed(f"rank {exc.error_index} of {plan.world} died ({exc}); "
                             f"the last complete checkpoint is still usable") from None
    except mp.ProcessRaisedException as exc:
        raise TrainingFailed(f"rank {exc.error_index} of {plan.world} failed:\n{exc}") from None
    except BaseException:  # Ctrl-C, or SIGTERM raised by the CLI: stop the ranks too (exit would wait for them)
        for proc in procs.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in procs.processes:
            proc.join(timeout=30)
        raise
    drain()
    for kind, value in outcome:
        if kind == "ok":
            return value
    raise TrainingFailed("rank 0 finished without reporting its metrics")
