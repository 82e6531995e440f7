"""Convert a ~1 GB Megatron tp 2 / pp 2 checkpoint to HF and to Megatron tp 4 / pp 1.

    .venv/bin/python benchmarks/bench_megatron.py [--layers 36] [--keep DIR]

The checkpoint is a GPT2-style model (hidden 1024, ffn 4096, vocab 32000 padded to
32256, bf16), written with interop's Megatron writer.  In one run it reports, for each
conversion, the time relative to a plain copy of the same bytes (copy + fsync, since
the conversion fsyncs its output too; target <= 1.5) and the peak RSS above the
starting point relative to the checkpoint size (target <= 0.25).  Files live in a
temporary directory removed at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from interop.convert import convert
from interop.converters.megatron import Writer
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.tensors import TensorMeta

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Samples this process's RSS every 2 ms while the block runs."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


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


def plain_copy(src: Path, dst: Path) -> None:
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


def timed(fn):
    with PeakRss() as m:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return seconds, m.extra


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--keep", help="work in this directory and keep it")
    opts = ap.parse_args()
    work = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="bench_megatron-"))
    try:
        src = work / "megatron-tp2pp2"
        if not src.exists():
            size = make_checkpoint(src, opts.layers)
        else:
            size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        for d in ("copy", "hf", "tp4"):
            shutil.rmtree(work / d, ignore_errors=True)
        plain_copy(src, work / "warm")  # page cache warm for every reader alike
        shutil.rmtree(work / "warm")
        copy_s, copy_rss = timed(lambda: plain_copy(src, work / "copy"))
        print(f"checkpoint: {size / 1e9:.2f} GB (megatron tp2 pp2, {opts.layers} layers, bf16)")
        print(f"plain copy + fsync: {copy_s:.2f} s")
        rows = []
        for name, kwargs in (("hf", {"dst_format": "hf"}),
                             ("tp4", {"dst_format": "megatron", "tp": 4, "pp": 1})):
            seconds, extra = timed(lambda: convert(src, work / name, **kwargs))
            rows.append((name, seconds, extra))
            print(f"megatron tp2 pp2 -> {'HF' if name == 'hf' else 'megatron tp4 pp1'}: {seconds:.2f} s "
                  f"= {seconds / copy_s:.2f} x copy (target <= 1.5), peak RSS +{extra / 1e6:.0f} MB "
                  f"= {extra / size:.3f} x checkpoint (target <= 0.25)")
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
