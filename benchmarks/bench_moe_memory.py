"""Peak RSS of a conversion of one mixture-of-experts layer as the number of experts grows (8, 64, 256):
memory bounded by a tensor stays flat; memory bounded by a layer grows with the experts.

Each expert's weights are fixed in size (hidden 512, expert ffn 512: three 0.5 MiB bf16 tensors), so the
layer grows from 12 MiB (8 experts) to 384 MiB (256 experts) while the largest tensor (the 32000 x 512
embedding, 31 MiB) stays the same.  Each conversion runs in a fresh interpreter, one process:

    .venv/bin/python benchmarks/bench_moe_memory.py
    .venv/bin/python benchmarks/bench_moe_memory.py --experts 8 64 256 --layers 1
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_convert, mixtral_config, settle, tree_size, write_synthetic_hf  # noqa: E402

TARGETS = [  # (label, convert options)
    ("HF -> megatron torch ep2", dict(dst_format="megatron", ep=2)),
    ("HF -> torch_dist", dict(dst_format="megatron", format="torch_dist")),
    ("HF -> mindspore ep2", dict(dst_format="mindspore", ep=2)),
    ("HF -> interop ep2", dict(dst_format="interop", ep=2)),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores; peak RSS added "
          "by the conversion (MiB, over the interpreter with torch and interop imported)")
    print(f"{'target':<26}" + "".join(f"{f'{n} experts':>16}" for n in args.experts))
    with tempfile.TemporaryDirectory(prefix="interop-bench-moe-mem-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        sizes = {}
        for n in args.experts:
            write_synthetic_hf(work / f"hf{n}", mixtral_config(layers=args.layers, hidden=512, ffn=512, heads=8, kv=4,
                                                               experts=n))
            sizes[n] = tree_size(work / f"hf{n}")
        print(f"{'(source size, MiB)':<26}" + "".join(f"{sizes[n] / 2**20:16.0f}" for n in args.experts))
        for label, options in TARGETS:
            row = []
            for n in args.experts:
                src = work / f"hf{n}"
                result = measured_convert(sizes[n] * 5 // 4, src=src, dst=work / "out", workers=1, **options)
                row.append((result["peak_rss"] - result["base_rss"]) / 2**20)
                shutil.rmtree(work / "out")
                settle()
            print(f"{label:<26}" + "".join(f"{r:16.0f}" for r in row), flush=True)


if __name__ == "__main__":
    main()
