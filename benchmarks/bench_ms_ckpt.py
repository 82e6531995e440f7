"""Read and write a ~1 GB MindSpore `.ckpt` with interop and with mindspore, in the same run.

    .venv/bin/python benchmarks/bench_ms_ckpt.py [--mib 1024] [--repeat 3] [--convert]

The checkpoint mixes one tensor over mindspore's 512 MiB slice (written as two
Values) with many 4 MiB tensors, float32.  Each operation runs `--repeat` times
and the best time is kept (the file is warm in the page cache for every reader);
the peak RSS above the starting point is sampled alongside.  Both writers must
produce the same bytes.  Files live in a temporary directory removed at the end.

`--to-hf` measures MindSpore (MindSpeed tp8/pp4 rank folders) -> HF of a 7B-shaped Llama with `--layers`
of its 32 layers (bf16; 4 layers: 2.1 GB) against a copy + fsync of the same folders, each in a fresh
interpreter, with one worker and with `--workers` (HF shards of `--shard-size`, so that there are units
to split): time / copy and peak RSS of the process and of each worker, from one run.

`--convert` instead measures a HF -> mindspore conversion of a ~1 GB Llama (GQA,
fp32, written straight to safetensors): the peak RSS the conversion adds over the
process after imports, relative to the checkpoint size (target <= 0.25).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import threading
import time

import torch

from interop.io.ms_ckpt import CkptFile, load_ckpt, save_ckpt

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


def best(fn, repeat: int):
    """(best seconds, largest peak RSS increase) over `repeat` runs; the result is dropped each time."""
    times, peaks = [], []
    for _ in range(repeat):
        gc.collect()
        with PeakRss() as m:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        del out
        peaks.append(m.extra)
    return min(times), max(peaks)


def make_tensors(total_mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big_mib = min(640, total_mib // 2)  # over 512 MiB: mindspore splits it into two Values
    tensors = {"embedding.weight": torch.randn(big_mib * 256, 1024, generator=g)}
    for i in range((total_mib - big_mib) // 4):
        tensors[f"layers.{i}.weight"] = torch.randn(1024, 1024, generator=g)
    return tensors


def bench_convert(tp: int = 2, pp: int = 2) -> None:
    """HF Llama (~1 GiB fp32) -> mindspeed tp/pp: peak RSS added by the conversion / checkpoint bytes."""
    import json

    import transformers

    from interop.convert import convert
    from interop.io.safetensors import SafetensorsWriter
    from interop.mappings.hf_config import spec_from_hf_config
    from interop.params import param_table

    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                      num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                      tie_word_embeddings=False).to_dict()
    spec = spec_from_hf_config(config, "float32")
    hf_name = {}
    from interop.mappings.hf_names import LLAMA
    for name, _, parts in LLAMA:
        for i in range(spec.num_layers):
            hf_name[parts[0].format(i=i)] = name.format(i=i)
    tmp = tempfile.mkdtemp(prefix="bench_ms_convert_")
    try:
        src = os.path.join(tmp, "hf")
        os.mkdir(src)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(config, f)
        params = param_table(spec)
        w = SafetensorsWriter(os.path.join(src, "model.safetensors"),
                              [(hf_name[p.name], torch.float32, p.shape) for p in params])
        g = torch.Generator().manual_seed(0)
        for p in params:
            w.write(hf_name[p.name], torch.randn(p.shape, generator=g) * 0.02)
        size, _ = w.close()
        gc.collect()
        with PeakRss() as m:
            t0 = time.perf_counter()
            convert(src, os.path.join(tmp, "ms"), dst_format="mindspore", tp=tp, pp=pp,
                    options={"dialect": "mindspeed"})
            sec = time.perf_counter() - t0
        largest = max(p.shape[0] * (p.shape[1] if len(p.shape) > 1 else 1) * 4 for p in params)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"HF -> mindspore (mindspeed, tp={tp} pp={pp}): {size / 2**20:.0f} MiB checkpoint in {sec:.2f} s; "
          f"peak RSS added {m.extra / 2**20:.0f} MiB = {m.extra / size:.3f} x checkpoint "
          f"(largest tensor {largest / 2**20:.0f} MiB)")


def bench_to_hf(layers: int, workers: int, shard: str) -> None:
    """MindSpeed tp8/pp4 -> HF against a copy of the rank folders, one worker and `workers`, one run."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from common import llama_config, measured_convert, measured_copy, settle, tree_size, write_synthetic_hf

    from interop.convert import convert

    work = Path(tempfile.mkdtemp(prefix="bench_ms_to_hf_"))
    try:
        write_synthetic_hf(work / "hf", llama_config(layers=layers, hidden=4096, ffn=11008, heads=32, kv=32))
        convert(work / "hf", work / "ms", dst_format="mindspore", tp=8, pp=4)
        shutil.rmtree(work / "hf")
        size = tree_size(work / "ms")
        print(f"MindSpeed tp8/pp4 -> HF, 7B-shaped, {layers} of 32 layers: {size / 1e9:.2f} GB bf16; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
        for n in sorted({1, workers}):
            copy = measured_copy(work / "ms", work / "copy", size * 5 // 4)
            r = measured_convert(size * 5 // 4, min_bytes_per_worker=1 << 28, src=work / "ms", dst=work / "out",
                                 dst_format="hf", workers=n, max_shard_size=shard)
            shutil.rmtree(work / "out")
            settle()
            each = " ".join(f"{x / 2**20:.0f}" for x in r["worker_peak_rss"])
            print(f"  --workers {n}: {r['seconds']:.2f} s, copy {copy:.2f} s, time/copy {r['seconds'] / copy:.2f}; "
                  f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB ({r['peak_rss'] / size:.3f} of the model)"
                  + (f", each worker {each} MiB" if each else ""))
        print(f"  load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--convert", action="store_true", help="measure a HF -> mindspore conversion's peak RSS instead")
    ap.add_argument("--to-hf", action="store_true", help="measure MindSpeed tp8/pp4 -> HF against a copy instead")
    ap.add_argument("--layers", type=int, default=4, help="--to-hf: layers of the 7B shape (multiple of 4)")
    ap.add_argument("--workers", type=int, default=2, help="--to-hf: also run with this many workers")
    ap.add_argument("--shard-size", default="1300MB", help="--to-hf: HF shard size (the units workers split)")
    args = ap.parse_args()
    if args.to_hf:
        return bench_to_hf(args.layers, args.workers, args.shard_size)
    if args.convert:
        return bench_convert()

    import mindspore as ms

    tensors = make_tensors(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    ms_params = [{"name": k, "data": ms.Tensor(v.numpy())} for k, v in tensors.items()]  # not timed
    tmp = tempfile.mkdtemp(prefix="bench_ms_ckpt_")
    try:
        ours, ref = os.path.join(tmp, "interop.ckpt"), os.path.join(tmp, "mindspore.ckpt")
        w_ours = best(lambda: save_ckpt(ours, tensors), args.repeat)
        w_ms = best(lambda: ms.save_checkpoint(ms_params, ref), args.repeat)
        same = _same_bytes(ours, ref)

        def read_all():  # every tensor in its own memory, one at a time, kept (as load_checkpoint does)
            return load_ckpt(ref)

        def list_only():
            with CkptFile(ref, verify=False) as f:
                return [f.meta(k) for k in f.keys()]

        def stream():  # a converter's access pattern: one tensor alive at a time
            with CkptFile(ref) as f:
                return sum(float(t.view(-1)[0]) for _, t in f.items())

        r_ours = best(read_all, args.repeat)
        r_stream = best(stream, args.repeat)
        r_list = best(list_only, args.repeat)
        r_ms = best(lambda: ms.load_checkpoint(ref), args.repeat)
        loaded, mine = ms.load_checkpoint(ref), load_ckpt(ref)
        equal = all(loaded[k].asnumpy().tobytes() == mine[k].numpy().tobytes() for k in tensors)
        del loaded, mine
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    gib = nbytes / 2**30
    print(f"checkpoint: {len(tensors)} float32 tensors, {nbytes / 2**20:.0f} MiB; best of {args.repeat}; "
          f"page cache warm; {os.cpu_count()} CPUs")
    print(f"{'operation':44s} {'seconds':>8s} {'GiB/s':>7s} {'peak RSS +MiB':>14s}")
    rows = [
        ("write  interop save_ckpt", w_ours), ("write  mindspore.save_checkpoint", w_ms),
        ("read   interop load_ckpt (all tensors kept)", r_ours), ("read   mindspore.load_checkpoint", r_ms),
        ("read   interop streaming, one at a time", r_stream), ("list   interop CkptFile(verify=False)", r_list),
    ]
    for name, (sec, peak) in rows:
        print(f"{name:44s} {sec:8.3f} {gib / sec:7.2f} {peak / 2**20:14.0f}")
    print(f"write speed-up (mindspore / interop): {w_ms[0] / w_ours[0]:.2f}x   bytes identical: {same}")
    print(f"read  speed-up (mindspore / interop): {r_ms[0] / r_ours[0]:.2f}x   tensors identical: {equal}")
    print(f"read peak RSS, mindspore / interop: {r_ms[1] / max(r_ours[1], 1):.2f}x")


def _same_bytes(a: str, b: str, block: int = 64 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


if __name__ == "__main__":
    main()
