"""Launch a fixture script as the ranks of a DeepSpeed-on-CPU job (gloo on localhost), the way the fixture scripts
that run DeepSpeed or ATorch do: the script re-runs itself once per rank with torch.distributed's environment."""
from __future__ import annotations

import os
import subprocess
import sys


def is_rank() -> bool:
    """Whether this process is one of the launched ranks (else it is the launcher)."""
    return os.environ.get("RANK") is not None


def launch(script: str, world: int, port: int) -> None:
    """Run `script` with this process's arguments as `world` ranks; one line and exit 1 when a rank fails."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, script, *sys.argv[1:]], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def remove_deepspeed_copies(out) -> None:
    """DeepSpeed copies its own scripts beside a checkpoint: not test data."""
    for name in ("zero_to_fp32.py", "zero_to_torch.py", "ds_to_universal.py"):
        (out / name).unlink(missing_ok=True)
