"""Llama-7B-shaped conversions (synthetic bf16 weights), each against a plain copy of the same bytes.

    .venv/bin/python benchmarks/bench_7b.py                 # 8 of the 32 layers (~5 GB; ~15 GB of disk at peak)
    .venv/bin/python benchmarks/bench_7b.py --layers 32     # the full 13.5 GB model (~45 GB of disk at peak)
    .venv/bin/python benchmarks/bench_7b.py --layers 32 --workers 2   # the same, split over 2 processes
    .venv/bin/python benchmarks/bench_7b.py --shape 70b --layers 4 --extrapolate-to 80
                                                            # 70B-shaped: 4 and 8 layers, per layer -> 80
                                                            # (8 layers: 14.8 GB; ~50 GB of disk at peak)
    .venv/bin/python benchmarks/bench_7b.py --shape 70b --layers 4 --extrapolate-to 80 --dry-run
                                                            # sizes and disk needed, nothing written
    .venv/bin/python benchmarks/bench_7b.py --shape tiny --workers 2 --min-mib-per-worker 1   # a smoke run

The chain, each step in a fresh interpreter (`common.measured_convert`) and each compared with
`common.copy_tree` (copy + fsync) of its own source, from one run:

    HF -> Megatron torch tp2/pp2 -> MindSpore tp8/pp4 -> HF
    HF -> Megatron torch_dist -> HF

Peak RSS is reported against the model size (with `--workers`, each worker's too: they are forked
from a fork server, so the parent's figure does not include them).  `--extrapolate-to N` runs the
chain at `--layers L` and at 2L layers and fits time and peak RSS per layer (a + b * layers) to N
layers: RSS is bounded by a layer plus the largest tensor, so its per-layer slope should be ~0 (the
bound is printed beside it).  A folder is deleted once no later step reads it, so the disk holds at most
about three copies of the model; the run refuses to start when the disk has less than that free.
A peers section runs transformers' and Megatron-LM's own converters where their environments exist
(`--megatron-lm DIR`: a Megatron-LM checkout), and says why it skips them otherwise.  Everything
is written under a temporary directory deleted at the end.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (llama_config, measured_convert, measured_copy, report, settle, tree_size,  # noqa: E402
                    write_synthetic_hf)

SHAPES = {"tiny": dict(layers=8, hidden=256, ffn=688, heads=8, kv=8, vocab=32000),
          "7b": dict(layers=32, hidden=4096, ffn=11008, heads=32, kv=32, vocab=32000),
          "70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv=8, vocab=32000)}

STEPS = [  # (label, source, destination, convert options)
    ("HF -> megatron torch tp2/pp2", "hf", "megatron", dict(dst_format="megatron", tp=2, pp=2)),
    ("megatron -> mindspore tp8/pp4", "megatron", "mindspore", dict(dst_format="mindspore", tp=8, pp=4)),
    ("mindspore -> HF", "mindspore", "hf-from-ms", dict(dst_format="hf")),
    ("HF -> torch_dist", "hf", "torch_dist", dict(dst_format="megatron", format="torch_dist")),
    ("torch_dist -> HF", "torch_dist", "hf-from-dist", dict(dst_format="hf")),
]


def sizes(shape: dict) -> tuple[int, int, int]:
    """(model bytes, one decoder layer's bytes, the largest stored tensor's bytes) of a bf16 Llama of `shape`:
    the largest is the vocab matrix or a layer's fused gate+up (Megatron's fc1)."""
    h, f, v, layers = shape["hidden"], shape["ffn"], shape["vocab"], shape["layers"]
    kv = shape["kv"] * (h // shape["heads"])
    layer = 2 * (2 * h * h + 2 * kv * h + 3 * f * h + 2 * h)
    return 2 * (2 * v * h + h) + layers * layer, layer, 2 * max(v * h, 2 * f * h)


def last_uses() -> dict[str, int]:
    """{folder: index of the last step that reads it}: after that step the folder can go."""
    out = {}
    for i, (_, src, dst, _) in enumerate(STEPS):
        out[src] = i
        out.setdefault(dst, i)
    return out


def peers(work: Path, megatron_lm: str | None) -> None:
    """The tools users would otherwise run; each skipped with its reason where its environment is missing."""
    print("peers:")
    script = importlib.util.find_spec("transformers.models.llama.convert_llama_weights_to_hf")
    print("  transformers' convert_llama_weights_to_hf: "
          + ("present, but it reads Meta's consolidated.*.pth layout, which this benchmark does not generate: skipped"
             if script else "skipped: not in the installed transformers (removed from recent releases)"))
    tool = Path(megatron_lm or os.environ.get("MEGATRON_LM", "")) / "tools" / "checkpoint" / "convert.py"
    if not (megatron_lm or os.environ.get("MEGATRON_LM")) or not tool.is_file():
        print("  Megatron-LM tools/checkpoint/convert.py: skipped: no Megatron-LM checkout "
              "(pass --megatron-lm DIR or set MEGATRON_LM; it also needs megatron.training and a GPU-free build)")
    else:
        print(f"  Megatron-LM {tool}: found; run it by hand with its loader/saver for the HF checkpoint in {work}: "
              "its command line depends on the checkout's version, so it is not timed here")


def run_chain(work: Path, shape: dict, name: str, workers: int, min_bytes: int | None) -> dict:
    """The chain at `shape`, in `work`: {label: (result, copy seconds, source bytes)}."""
    hf = work / "hf"
    write_synthetic_hf(hf, llama_config(**shape))
    size = tree_size(hf)
    print(f"{name}-shaped Llama, {shape['layers']} of {SHAPES[name]['layers']} layers: {size / 1e9:.2f} GB bf16, "
          f"--workers {workers}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    out, last = {}, last_uses()
    for i, (label, src, dst, kwargs) in enumerate(STEPS):
        source = work / src
        source_size = tree_size(source)
        warm = source_size * 5 // 4
        copy = measured_copy(source, work / "copy", warm)
        result = measured_convert(warm, src=source, dst=work / dst, workers=workers, min_bytes_per_worker=min_bytes,
                                  **kwargs)
        settle()
        print(f"  {report(label, result, copy, source_size)}  (copy {copy:.2f} s)")
        out[label] = (result, copy, source_size)
        for folder in (src, dst):  # nothing later reads it: free the disk for the next steps
            if last[folder] == i and (work / folder).exists():
                shutil.rmtree(work / folder)
    print(f"  load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return out


def extrapolate(small: dict, large: dict, layers: int, target: int, shape: dict) -> None:
    """Per step: time, copy and peak RSS as a + b * layers from the two depths, at `target` layers; beside the RSS
    the bound the design promises (one layer plus the largest tensor)."""
    model, layer, largest = sizes(dict(shape, layers=target))
    print(f"extrapolated from {layers} and {2 * layers} layers to {target} layers (a + b * layers): model "
          f"{model / 1e9:.1f} GB; bound on the RSS a conversion adds: a layer {layer / 2**20:.0f} MiB + the largest "
          f"tensor {largest / 2**20:.0f} MiB = {(layer + largest) / 2**20:.0f} MiB ({(layer + largest) / model:.3f} "
          "of the model)")
    at = lambda y1, y2: y1 + (y2 - y1) / layers * (target - layers)  # noqa: E731
    for label, (r1, c1, s1) in small.items():
        r2, c2, s2 = large[label]
        seconds, copy, size = at(r1["seconds"], r2["seconds"]), at(c1, c2), at(s1, s2)
        peak = max(at(r1["peak_rss"], r2["peak_rss"]), r1["peak_rss"], r2["peak_rss"])
        added1, added2 = r1["peak_rss"] - r1["base_rss"], r2["peak_rss"] - r2["base_rss"]
        added = max(at(added1, added2), added1, added2)
        workers = [at(a, b) for a, b in zip(r1.get("worker_peak_rss") or [], r2.get("worker_peak_rss") or [])]
        slope = (r2["peak_rss"] - r1["peak_rss"]) / layers / 2**20
        print(f"  {label:<32} {seconds:7.1f} s  copy {copy:7.1f} s  time/copy {seconds / copy:4.2f}  model "
              f"{size / 1e9:6.1f} GB  peak RSS {peak / 2**20:6.0f} MiB ({peak / size:5.3f} of size; {slope:+.1f} MiB "
              f"per layer)  added {added / 2**20:6.0f} MiB ({added / (layer + largest):4.2f} of the bound)"
              + (f"  workers' peak {max(workers) / 2**20:.0f} MiB" if workers else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers to generate (the 7B model has 32)")
    ap.add_argument("--workers", type=int, default=1, help="convert --workers (default 1: one process)")
    ap.add_argument("--min-mib-per-worker", type=int, help="lower interop.workers.MIN_BYTES_PER_WORKER "
                    "(1 GiB) to split small runs")
    ap.add_argument("--extrapolate-to", type=int, help="also run at twice --layers and extrapolate to this many layers")
    ap.add_argument("--megatron-lm", help="a Megatron-LM checkout, for the peers section")
    ap.add_argument("--keep", help="work in this directory and keep it")
    ap.add_argument("--dry-run", action="store_true", help="print the sizes and the disk needed; write nothing")
    opts = ap.parse_args()
    if opts.layers < 4 or opts.layers % 4:
        ap.error("--layers must be a multiple of 4 (the chain splits the layers over 2 and 4 pipeline stages)")
    min_bytes = opts.min_mib_per_worker << 20 if opts.min_mib_per_worker is not None else None
    depths = [opts.layers] + ([2 * opts.layers] if opts.extrapolate_to else [])
    largest = sizes(dict(SHAPES[opts.shape], layers=depths[-1]))[0]
    need = largest * 16 // 5  # three copies at the peak (a step's source, its copy or output, HF), and slack
    where = Path(opts.keep).parent if opts.keep else Path(tempfile.gettempdir())
    free = shutil.disk_usage(where).free
    print(f"{opts.shape}-shaped Llama at {' and '.join(map(str, depths))} layers: up to {largest / 1e9:.1f} GB bf16; "
          f"disk needed ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB free under {where}")
    if opts.dry_run:
        return
    if free < need:
        sys.exit(f"error: not enough free disk under {where} ({free / 1e9:.0f} GB, ~{need / 1e9:.0f} GB needed): "
                 "use fewer --layers or TMPDIR on a larger disk")
    work = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="bench_7b-"))
    try:
        runs = []
        for layers in depths:
            folder = work / f"layers-{layers}"
            folder.mkdir(parents=True, exist_ok=True)
            runs.append(run_chain(folder, dict(SHAPES[opts.shape], layers=layers), opts.shape, opts.workers, min_bytes))
            if not opts.keep:
                shutil.rmtree(folder)  # the disk holds one depth at a time
        if opts.extrapolate_to:
            extrapolate(runs[0], runs[1], opts.layers, opts.extrapolate_to, SHAPES[opts.shape])
        peers(work, opts.megatron_lm)
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
