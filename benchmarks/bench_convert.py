"""Benchmark: HF -> interop (tp 4 / pp 2) -> HF on a ~1 GB Llama-style bf16 checkpoint.

Reports, measured in one run: conversion time / time of a plain copy (+ fsync) of the
same bytes (target <= 1.5) and peak RSS / checkpoint size (target <= 0.25).  Peak RSS
is shown both whole (the interpreter with torch imported is a few hundred MiB on its
own) and as the part the conversion added on top of that baseline.

    .venv/bin/python benchmarks/bench_convert.py [--workdir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import llama_config, measured_convert, report, timed_copy, write_synthetic_hf  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=8, help="8 layers of hidden 2048 ~ 1 GB in bf16")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="interop-bench-", dir=args.workdir))
    try:
        hf = work / "hf"
        size = write_synthetic_hf(hf, llama_config(layers=args.layers))
        print(f"checkpoint: {size / 1e9:.2f} GB (Llama-style, bf16, {args.layers} layers) in {work}")
        copies = [timed_copy(hf, work / "copy")]
        to_common = measured_convert(src=hf, dst=work / "tp4pp2", dst_format="interop", tp=4, pp=2)
        copies.append(timed_copy(hf, work / "copy"))
        back = measured_convert(src=work / "tp4pp2", dst=work / "hf-again", dst_format="hf")
        copies.append(timed_copy(hf, work / "copy"))
        copy = sum(copies) / len(copies)
        print(f"plain copy + fsync: {copy:.2f} s (mean of {len(copies)}: {', '.join(f'{c:.2f}' for c in copies)})")
        print(report("HF -> interop tp4/pp2", to_common, copy, size))
        print(report("interop tp4/pp2 -> HF", back, copy, size))
        same = (hf / "model.safetensors").read_bytes() == (work / "hf-again" / "model.safetensors").read_bytes()
        print(f"round trip byte-identical: {same}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
