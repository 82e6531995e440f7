"""Benchmark: HF -> interop (tp 4 / pp 2) -> HF on a ~1 GB Llama-style bf16 checkpoint.

Reports, measured in one run: conversion time / time of a plain copy (+ fsync) of the
same bytes (target <= 1.5) and peak RSS / checkpoint size (target <= 0.25).  Each copy
and conversion runs in a fresh interpreter that has imported torch and has just touched
fresh page cache (see `common.warm_page_cache`).  Peak RSS is shown both whole (the
interpreter with torch imported is a few hundred MiB on its own) and as the part the
conversion added on top of that baseline.  Copies and conversions alternate, `--repeat`
times, each output removed before the next; the medians are reported.

    .venv/bin/python benchmarks/bench_convert.py [--workdir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (llama_config, measured_convert, measured_copy, median_run, report, settle,  # noqa: E402
                    write_synthetic_hf)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=8, help="8 layers of hidden 2048 ~ 1 GB in bf16")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="interop-bench-", dir=args.workdir))
    try:
        hf = work / "hf"
        size = write_synthetic_hf(hf, llama_config(layers=args.layers))
        print(f"checkpoint: {size / 1e9:.2f} GB (Llama-style, bf16, {args.layers} layers) in {work}")
        warm = size * 5 // 4  # fresh page cache for the output: see common.warm_page_cache
        copies, forward, backward = [], [], []
        for _ in range(args.repeat):
            copies.append(measured_copy(hf, work / "copy", warm))
            forward.append(measured_convert(warm, src=hf, dst=work / "tp4pp2", dst_format="interop", tp=4, pp=2))
            settle()
            copies.append(measured_copy(hf, work / "copy", warm))
            backward.append(measured_convert(warm, src=work / "tp4pp2", dst=work / "hf-again", dst_format="hf"))
            same = (hf / "model.safetensors").read_bytes() == (work / "hf-again" / "model.safetensors").read_bytes()
            shutil.rmtree(work / "tp4pp2")
            shutil.rmtree(work / "hf-again")
            settle()
        copy = statistics.median(copies)
        print(f"plain copy + fsync: median {copy:.2f} s of {', '.join(f'{c:.2f}' for c in copies)}")
        print(report("HF -> interop tp4/pp2", median_run(forward), copy, size))
        print(report("interop tp4/pp2 -> HF", median_run(backward), copy, size))
        print(f"round trip byte-identical: {same}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
