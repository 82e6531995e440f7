"""`torchrun --nproc-per-node K -m interop convert` over K = 1, 2, 4 ranks on this machine: a 7B-Llama-shaped
HF checkpoint (synthetic bf16, `--layers` of the 32) -> Megatron torch_dist, against a copy of the same bytes.

    .venv/bin/python benchmarks/bench_distributed.py --layers 3 --ranks 1 2 4

Each rank writes its run of torch_dist's per-layer files (`engine.split_units`); rank 0 writes `.metadata`.
On one machine of few cores and one disk the ranks share both, so this shows the cost of the split, not a
cluster's scaling: the per-rank share of the written bytes is what a parallel filesystem would take in parallel.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import llama_config, measured_copy, settle, tree_size, write_synthetic_hf  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)  # 3 layers: 4 files, split evenly over 1, 2, 4 ranks
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="interop-bench-dist-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        write_synthetic_hf(work / "hf", llama_config(layers=args.layers, hidden=4096, ffn=11008, heads=32, kv=32))
        size = tree_size(work / "hf")
        copy = measured_copy(work / "hf", work / "copy", size * 5 // 4)
        print(f"7B-shaped, {args.layers} layers: {size / 1e9:.2f} GB bf16; copy + fsync {copy:.2f} s; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
        for k in args.ranks:
            dst = work / f"dist{k}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(k), "--master-addr",
                   "127.0.0.1", "--master-port", str(_port()), "-m", "interop", "convert", str(work / "hf"), str(dst),
                   "--to", "megatron", "--format", "torch_dist", "-q", "--workers", "1"]
            started = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
            seconds = time.perf_counter() - started
            if out.returncode:
                raise SystemExit(out.stderr)
            inner = next(line for line in out.stdout.splitlines() if " MB in " in line).split(" in ")[1].split(" s")[0]
            files = sorted(dst.rglob("*.distcp"))
            print(f"  {k} rank(s): {seconds:6.2f} s with torchrun's start-up, conversion {inner} s (rank 0's clock), "
                  f"time/copy {float(inner) / copy:.2f}; {len(files)} .distcp files, "
                  f"{sum(f.stat().st_size for f in files) / k / 1e9:.2f} GB written per rank (mean)", flush=True)
            shutil.rmtree(dst)
            settle()


if __name__ == "__main__":
    main()
