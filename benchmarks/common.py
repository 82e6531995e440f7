"""Shared benchmark helpers: a synthetic HF Llama checkpoint, a timed plain copy, and peak RSS of a child run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from interop.io.safetensors import SafetensorsWriter


def llama_config(layers=8, hidden=2048, ffn=5504, heads=16, kv=4, vocab=32000) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def write_synthetic_hf(path: Path, config: dict, seed: int = 0) -> int:
    """A HF Llama checkpoint of random bf16 weights, written one tensor at a time. Returns its size."""
    path.mkdir(parents=True)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    entries = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        entries += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f))]
    entries += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    writer = SafetensorsWriter(path / "model.safetensors", [(k, torch.bfloat16, s) for k, s in entries], {"format": "pt"})
    gen = torch.Generator().manual_seed(seed)
    for key, shape in entries:
        writer.write(key, torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))
    size, _ = writer.close()
    (path / "config.json").write_text(json.dumps(config))
    return size


def warm_memory(work: Path, gigabytes: int = 3) -> None:
    """Touch memory and page cache once before measuring.

    On the virtual machines we run on, the first touch of never-used guest memory costs
    ~2 s per GB (the host maps it in); after that it is ~10x cheaper.  Without this, whichever
    side of a comparison runs first pays for it.  Both sides then run on warm memory.
    """
    block = torch.ones(1 << 30, dtype=torch.uint8)
    for _ in range(gigabytes):
        block.add_(1)
    del block
    path = work / "warm.bin"
    data = memoryview(torch.zeros(64 << 20, dtype=torch.uint8).numpy())
    with open(path, "wb") as f:
        for _ in range(gigabytes * 16):
            f.write(data)
    path.unlink()


def settle() -> None:
    """Flush the filesystem's deferred work (freed blocks, journal) so the next timing doesn't pay for it."""
    os.sync()
    time.sleep(0.2)


def timed_copy(src: Path, dst: Path) -> float:
    """Seconds to copy every file of `src` into `dst` and fsync them (conversion output is fsynced too)."""
    started = time.perf_counter()
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, dst / f.name)
        fd = os.open(dst / f.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    seconds = time.perf_counter() - started
    shutil.rmtree(dst)
    settle()
    return seconds


CHILD = """
import json, sys, time
from interop.convert import convert

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

base = status("VmRSS")  # the interpreter with torch and interop imported
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
args = json.loads(sys.argv[1])
t = time.perf_counter()
convert(**args)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak_rss": status("VmHWM"), "base_rss": base}))
"""


def measured_convert(**kwargs) -> dict:
    """Run one conversion in a fresh interpreter: its seconds, peak RSS and the RSS before it began."""
    kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items()}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_run(results: list[dict]) -> dict:
    """The run with the median time (its RSS figures come with it); the worst peak RSS is kept."""
    middle = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]
    return {**middle, "peak_rss": max(r["peak_rss"] for r in results),
            "base_rss": min(r["base_rss"] for r in results), "all_seconds": [r["seconds"] for r in results]}


def report(label: str, result: dict, copy_seconds: float, size: int) -> str:
    added = result["peak_rss"] - result["base_rss"]
    runs = ", ".join(f"{s:.2f}" for s in result.get("all_seconds", [result["seconds"]]))
    return (f"{label:<24} {result['seconds']:5.2f} s (runs: {runs})  time/copy {result['seconds'] / copy_seconds:4.2f}  "
            f"peak RSS {result['peak_rss'] / 2**20:6.0f} MiB ({result['peak_rss'] / size:4.2f} of size)  "
            f"added by the conversion {added / 2**20:5.0f} MiB ({added / size:4.2f} of size)")
