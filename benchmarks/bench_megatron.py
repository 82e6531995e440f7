"""Convert a ~1 GB Megatron tp 2 / pp 2 checkpoint to HF and to Megatron tp 4 / pp 1.

    .venv/bin/python benchmarks/bench_megatron.py [--layers 36] [--repeat 2] [--keep DIR]

The checkpoint is a GPT2-style model (hidden 1024, ffn 4096, vocab 32000 padded to
32256, bf16), written with interop's Megatron writer.  Each conversion runs in a fresh
interpreter (`common.measured_convert`); it reports the time relative to a plain copy of
the same bytes (copy + fsync, since the conversion fsyncs its output too; target <= 1.5)
and the peak RSS the conversion added relative to the checkpoint size (target <= 0.25).
The machine may be shared: every round prints the load average, and `--repeat` runs the
copy and both conversions again.  Files live in a temporary directory removed at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_convert, report  # noqa: E402

from interop.converters.megatron import Writer  # noqa: E402
from interop.layout import ParallelLayout  # noqa: E402
from interop.params import param_table  # noqa: E402
from interop.spec import ModelSpec  # noqa: E402
from interop.tensors import TensorMeta  # noqa: E402


def make_checkpoint(root: Path, layers: int) -> int:
    spec = ModelSpec(arch="gpt2", num_layers=layers, hidden=1024, ffn_hidden=4096, heads=16, kv_groups=16, head_dim=64,
                     vocab=32000, padded_vocab=32256, max_positions=2048, norm="layernorm", norm_eps=1e-5,
                     activation="gelu", position="learned", qkv_bias=True, linear_bias=True, dtype="bfloat16")
    layout = ParallelLayout.build(layers, tp=2, pp=2)
    metas = [TensorMeta(p.name, torch.bfloat16, p.shape) for p in param_table(spec)]
    writer = Writer(root, spec, layout, metas)
    g = torch.Generator().manual_seed(0)
    for m in metas:
        writer.write(m.name, (torch.randn(m.shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.finish({"iteration": 100})
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def plain_copy(src: Path, dst: Path) -> float:
    """Seconds to copy the checkpoint tree and fsync every file."""
    started = time.perf_counter()
    for f in sorted(src.rglob("*")):
        target = dst / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            fd = os.open(target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    seconds = time.perf_counter() - started
    shutil.rmtree(dst)
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", help="work in this directory and keep it")
    opts = ap.parse_args()
    work = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="bench_megatron-"))
    try:
        src = work / "megatron-tp2pp2"
        if not src.exists():
            make_checkpoint(src, opts.layers)
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        print(f"checkpoint: {size / 1e9:.2f} GB (megatron tp2 pp2, {opts.layers} layers, bf16)")
        plain_copy(src, work / "warm")  # page cache warm for every reader alike
        for _ in range(opts.repeat):
            print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
            copy_s = plain_copy(src, work / "copy")
            print(f"{'plain copy + fsync':<34} {copy_s:6.2f} s")
            for label, kwargs in (("megatron tp2 pp2 -> HF", {"dst_format": "hf"}),
                                  ("megatron tp2 pp2 -> megatron tp4 pp1", {"dst_format": "megatron", "tp": 4, "pp": 1})):
                shutil.rmtree(work / "out", ignore_errors=True)
                result = measured_convert(src=src, dst=work / "out", **kwargs)
                print(report(label, result, copy_s, size))
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
