"""A Mixtral-shaped mixture-of-experts checkpoint (~1 GB, synthetic bf16) converted from Megatron at tp 2 / ep 2,
each step against a plain copy of the same bytes, from one run:

    .venv/bin/python benchmarks/bench_moe.py                # 8 layers x 8 experts, hidden 1024: ~1.0 GB
    .venv/bin/python benchmarks/bench_moe.py --layers 16    # ~2 GB

    HF -> Megatron torch tp2/ep2          (the source of the next two)
    Megatron tp2/ep2 -> HF
    Megatron tp2/ep2 -> MindSpore (MindSpeed-Core-MS) tp2/ep2
    Megatron tp2/ep2 -> torch_dist ep1

Each step runs in a fresh interpreter (`common.measured_convert`); peak RSS is reported against the model
size.  Everything is written under a temporary directory deleted at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_convert, measured_copy, mixtral_config, report, settle, tree_size, write_synthetic_hf  # noqa: E402

STEPS = [  # (label, source, destination, convert options)
    ("HF -> megatron tp2/ep2", "hf", "megatron", dict(dst_format="megatron", tp=2, ep=2)),
    ("megatron tp2/ep2 -> HF", "megatron", "hf-out", dict(dst_format="hf")),
    ("megatron -> mindspore tp2/ep2", "megatron", "mindspore", dict(dst_format="mindspore", tp=2, ep=2)),
    ("megatron -> torch_dist", "megatron", "torch_dist", dict(dst_format="megatron", format="torch_dist")),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1, help="convert --workers (default 1: one process)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="interop-bench-moe-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        write_synthetic_hf(work / "hf", mixtral_config(layers=args.layers))
        size = tree_size(work / "hf")
        print(f"Mixtral-shaped MoE, {args.layers} layers x 8 experts (top-2), hidden 1024: {size / 1e9:.2f} GB bf16, "
              f"--workers {args.workers}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} cores")
        for label, src, dst, kwargs in STEPS:
            source = work / src
            source_size = tree_size(source)
            warm = source_size * 5 // 4
            copy = measured_copy(source, work / "copy", warm)
            result = measured_convert(warm, src=source, dst=work / dst, workers=args.workers, **kwargs)
            settle()
            print(f"  {report(label, result, copy, source_size)}  (copy {copy:.2f} s)")


if __name__ == "__main__":
    main()
