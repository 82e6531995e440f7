"""Convert ~1 GB Megatron tp 2 / pp 2 checkpoints to HF, to Megatron tp 4 / pp 1, to torch_dist and to MindSpore
(MindSpeed) tp 4 / pp 4; torch_dist to HF.

    .venv/bin/python benchmarks/bench_megatron.py [--arch gpt2 llama] [--repeat 3] [--jobs mindspore] [--keep DIR]

`--jobs WORD...` runs only the jobs whose label contains one of the words.  The Megatron and MindSpore
targets also run along the engine's per-tensor path (`per-tensor`: fused QKV and fc1 split into canonical
tensors and fused again, as before rows moved whole), in the same run, for a before/after comparison.

Two checkpoints, written with interop's Megatron writer (bf16): GPT2-style (36 layers,
hidden 1024, ffn 4096, LayerNorm, biases, tied, vocab 32000 padded to 32256: every HF
weight is a Conv1D transpose) and Llama-style (8 layers, hidden 2048, ffn 5504, 16
heads in 4 query groups, SwiGLU, RMSNorm, untied, vocab 32000).  Each copy and each
conversion runs in a fresh interpreter that has imported torch and just touched fresh
page cache (`common.warm_page_cache`); it reports the time relative to a plain copy of
the same bytes (copy + fsync, since the conversion fsyncs its output too; target <= 1.5)
and the peak RSS the conversion added relative to the checkpoint size (target <= 0.25).
Copies and conversions alternate `--repeat` times; medians are reported.  Files live in a
temporary directory removed at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_convert, measured_copy, median_run, report, settle, tree_size  # noqa: E402

from interop.converters.megatron import Writer  # noqa: E402
from interop.convert import convert  # noqa: E402
from interop.layout import ParallelLayout  # noqa: E402
from interop.params import param_table  # noqa: E402
from interop.spec import ModelSpec  # noqa: E402
from interop.tensors import TensorMeta  # noqa: E402

SPECS = {
    "gpt2": dict(arch="gpt2", num_layers=36, hidden=1024, ffn_hidden=4096, heads=16, kv_groups=16, head_dim=64,
                 vocab=32000, padded_vocab=32256, max_positions=2048, norm="layernorm", norm_eps=1e-5,
                 activation="gelu", position="learned", qkv_bias=True, linear_bias=True, dtype="bfloat16"),
    "llama": dict(arch="llama", num_layers=8, hidden=2048, ffn_hidden=5504, heads=16, kv_groups=4, head_dim=128,
                  vocab=32000, padded_vocab=32000, max_positions=4096, norm="rmsnorm", norm_eps=1e-5,
                  activation="swiglu", position="rope", tied_embeddings=False, dtype="bfloat16"),
}


def make_checkpoint(root: Path, arch: str) -> None:
    spec = ModelSpec(**SPECS[arch])
    layout = ParallelLayout.build(spec.num_layers, tp=2, pp=2)
    metas = [TensorMeta(p.name, torch.bfloat16, p.shape) for p in param_table(spec)]
    writer = Writer(root, spec, layout, metas)
    g = torch.Generator().manual_seed(0)
    for m in metas:
        writer.write(m.name, (torch.randn(m.shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.finish({"iteration": 100})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", choices=sorted(SPECS), default=["gpt2", "llama"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", nargs="+", help="only the jobs whose label contains one of these words")
    ap.add_argument("--keep", help="work in this directory and keep it")
    opts = ap.parse_args()
    work = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="bench_megatron-"))
    try:
        for arch in opts.arch:
            src = work / f"megatron-{arch}-tp2pp2"
            if not src.exists():
                make_checkpoint(src, arch)
            size = tree_size(src)
            warm = size * 5 // 4  # fresh page cache for the output: see common.warm_page_cache
            print(f"checkpoint: {size / 1e9:.2f} GB (megatron tp2 pp2, {arch}-style, bf16)")
            copies = []
            dist_src = work / f"torch_dist-{arch}"
            if not dist_src.exists():
                convert(src, dist_src, dst_format="megatron", format="torch_dist")
            pp = 4 if SPECS[arch]["num_layers"] % 4 == 0 else 2
            targets = {"-> HF": {"dst_format": "hf"}, "-> megatron tp4 pp1": {"dst_format": "megatron", "tp": 4, "pp": 1},
                       "-> megatron tp4 pp1, per-tensor": {"dst_format": "megatron", "tp": 4, "pp": 1, "per_tensor": True},
                       f"-> mindspore tp4 pp{pp}": {"dst_format": "mindspore", "tp": 4, "pp": pp},
                       f"-> mindspore tp4 pp{pp}, per-tensor": {"dst_format": "mindspore", "tp": 4, "pp": pp,
                                                                "per_tensor": True},
                       "-> torch_dist": {"dst_format": "megatron", "format": "torch_dist"},
                       "torch_dist -> HF": {"dst_format": "hf", "src": dist_src}}
            if opts.jobs:
                targets = {k: v for k, v in targets.items() if any(word in k for word in opts.jobs)}
            runs = {label: [] for label in targets}
            for _ in range(opts.repeat):
                print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
                for label, kwargs in targets.items():
                    copies.append(measured_copy(src, work / "copy", warm))
                    runs[label].append(measured_convert(warm, **{"src": src, "dst": work / "out", **kwargs}))
                    shutil.rmtree(work / "out")
                    settle()
            copy = statistics.median(copies)
            print(f"  plain copy + fsync: median {copy:.2f} s of {', '.join(f'{c:.2f}' for c in copies)}")
            for label, results in runs.items():
                print("  " + report(f"{arch} tp2 pp2 {label}", median_run(results), copy, size))
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
