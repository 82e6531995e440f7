"""Benchmark: HF -> interop (tp 4 / pp 2) -> HF on a ~1 GB Llama-style bf16 checkpoint (or `--family gemma3`:
Gemma-3-1B's widths at 8 layers, 1.0 GB, one KV head, so tp 1 / pp 2).

Reports, measured in one run: conversion time / time of a plain copy (+ fsync) of the
same bytes (target <= 1.5) and peak RSS / checkpoint size (target <= 0.25).  Each copy
and conversion runs in a fresh interpreter that has imported torch and has just touched
fresh page cache (see `common.warm_page_cache`).  Peak RSS is shown both whole (the
interpreter with torch imported is a few hundred MiB on its own) and as the part the
conversion added on top of that baseline.  Copies and conversions alternate, `--repeat`
times, each output removed before the next; the medians are reported.

    .venv/bin/python benchmarks/bench_convert.py [--workdir DIR] [--family gemma3]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (GEMMA3_1B, llama_config, measured_convert, measured_copy, median_run, report,  # noqa: E402
                    settle, write_synthetic_family, write_synthetic_hf)


def _same_tensors(a: Path, b: Path) -> bool:
    """Equal tensors under equal names (the order in the file is the writer's: Gemma's source order is not HF's)."""
    from safetensors import safe_open
    with safe_open(a, "pt") as x, safe_open(b, "pt") as y:
        return set(x.keys()) == set(y.keys()) and all(
            torch.equal(x.get_tensor(k).view(torch.uint8), y.get_tensor(k).view(torch.uint8)) for k in x.keys())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=8, help="8 layers of hidden 2048 ~ 1 GB in bf16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--family", choices=("llama", "gemma3"), default="llama")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="interop-bench-", dir=args.workdir))
    try:
        hf = work / "hf"
        if args.family == "gemma3":
            size, tp = write_synthetic_family(hf, {**GEMMA3_1B, "num_hidden_layers": args.layers}), 1
        else:
            size, tp = write_synthetic_hf(hf, llama_config(layers=args.layers)), 4
        print(f"checkpoint: {size / 1e9:.2f} GB ({args.family}, bf16, {args.layers} layers) in {work}")
        warm = size * 5 // 4  # fresh page cache for the output: see common.warm_page_cache
        copies, forward, backward = [], [], []
        for _ in range(args.repeat):
            copies.append(measured_copy(hf, work / "copy", warm))
            forward.append(measured_convert(warm, src=hf, dst=work / "tp4pp2", dst_format="interop", tp=tp, pp=2))
            settle()
            copies.append(measured_copy(hf, work / "copy", warm))
            backward.append(measured_convert(warm, src=work / "tp4pp2", dst=work / "hf-again", dst_format="hf"))
            same = _same_tensors(hf / "model.safetensors", work / "hf-again" / "model.safetensors")
            shutil.rmtree(work / "tp4pp2")
            shutil.rmtree(work / "hf-again")
            settle()
        copy = statistics.median(copies)
        print(f"plain copy + fsync: median {copy:.2f} s of {', '.join(f'{c:.2f}' for c in copies)}")
        print(report(f"HF -> interop tp{tp}/pp2", median_run(forward), copy, size))
        print(report(f"interop tp{tp}/pp2 -> HF", median_run(backward), copy, size))
        print(f"round trip: every tensor identical (names, dtypes, bytes): {same}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
