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


def mixtral_config(layers=8, hidden=1024, ffn=2048, heads=16, kv=4, vocab=32000, experts=8, topk=2) -> dict:
    return {**llama_config(layers, hidden, ffn, heads, kv, vocab), "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": topk, "sliding_window": None}


# Gemma-3-1B's widths (hidden 1152, 4 heads of 256 over 1 KV head, GeGLU of 6912, vocabulary 262144, tied) at 8
# layers: about 1 GB in bf16, 5 sliding layers to 1 full, q/k norms and four norms per layer.
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "intermediate_size": 6912, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
             "query_pre_attn_scalar": 256, "sliding_window": 512, "tie_word_embeddings": True,
             "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16"}


def write_synthetic_family(path: Path, config: dict, seed: int = 0) -> int:
    """Random bf16 weights under the names and shapes transformers' own model class for `config` has (built on
    the meta device: no memory), written one tensor at a time. Returns the checkpoint's size."""
    import transformers
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(cfg)
    entries = [(k, tuple(t.shape)) for k, t in model.state_dict().items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    path.mkdir(parents=True)
    writer = SafetensorsWriter(path / "model.safetensors", [(k, torch.bfloat16, s) for k, s in entries],
                               {"format": "pt"})
    gen = torch.Generator().manual_seed(seed)
    for key, shape in entries:
        writer.write(key, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    size, _ = writer.close()
    (path / "config.json").write_text(json.dumps(config))
    return size


def write_synthetic_hf(path: Path, config: dict, seed: int = 0) -> int:
    """A HF Llama (or Mixtral, with `num_local_experts`) checkpoint of random bf16 weights, written one tensor
    at a time. Returns its size."""
    path.mkdir(parents=True)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    entries = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        entries += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,))]
        experts = config.get("num_local_experts")
        if experts:  # Mixtral's hub names: w1 gate, w2 down, w3 up
            entries.append((p + "block_sparse_moe.gate.weight", (experts, h)))
            for e in range(experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                entries += [(q + "w1.weight", (f, h)), (q + "w2.weight", (h, f)), (q + "w3.weight", (f, h))]
        else:
            entries += [(p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                        (p + "mlp.down_proj.weight", (h, f))]
    entries += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    writer = SafetensorsWriter(path / "model.safetensors", [(k, torch.bfloat16, s) for k, s in entries], {"format": "pt"})
    gen = torch.Generator().manual_seed(seed)
    for key, shape in entries:
        writer.write(key, torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))
    size, _ = writer.close()
    (path / "config.json").write_text(json.dumps(config))
    return size


def warm_page_cache(scratch: Path, nbytes: int) -> None:
    """Write `nbytes` to a scratch file and delete it (no fsync): run right before each timed step.

    The virtual machines we measure on hand freed memory back to the host (virtio-balloon
    free page reporting, about 2 s after it is freed), and the host charges for the next
    first touch of such a page: writing 1 GB into new page cache took 2.3-2.6 s there,
    against 0.24 s into pages freed a moment before (a plain os.write loop, same run).
    Which of the two a step got depended on how long ago the previous step had freed its
    output (for a conversion, on how long its interpreter took to import torch), so copies
    and conversions were charged the host's cost at random.  Every timed step, copy and
    conversion alike, now starts in a fresh interpreter right after this.
    """
    block = memoryview(bytearray(64 << 20))
    path = scratch / ".warm-page-cache"
    with open(path, "wb", buffering=0) as f:
        for done in range(0, nbytes, len(block)):
            f.write(block[:min(len(block), nbytes - done)])
    path.unlink()


def settle() -> None:
    """Flush the filesystem's deferred work (freed blocks, journal) so the next timing doesn't pay for it."""
    os.sync()
    time.sleep(0.2)


def tree_size(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def copy_tree(src: Path, dst: Path) -> None:
    """The plain copy a conversion is compared with: every file copied (sendfile) and fsynced."""
    for f in sorted(src.rglob("*")):
        target = dst / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


CHILD = """
import json, sys, time
from pathlib import Path
task = json.loads(sys.argv[1])
sys.path.insert(0, task["benchmarks"])
from common import copy_tree, warm_page_cache
from interop.convert import convert
import interop.workers
if task.get("min_bytes_per_worker") is not None:
    interop.workers.MIN_BYTES_PER_WORKER = task["min_bytes_per_worker"]
if task.get("per_tensor"):  # the engine's per-tensor path only: no fused row moved whole (before/after)
    import interop.engine
    interop.engine.fused_plan = lambda *args: {}

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

warm_page_cache(Path(task["scratch"]), task["warm"])
base = status("VmRSS")  # the interpreter with torch and interop imported
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
t = time.perf_counter()
if task["copy"]:
    copy_tree(Path(task["copy"][0]), Path(task["copy"][1]))
else:
    convert(**task["convert"])
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak_rss": status("VmHWM"), "base_rss": base,
                  "worker_peak_rss": interop.workers.last_peak_rss}))
"""


def _child(task: dict, warm: int, scratch: Path) -> dict:
    """Run CHILD; with workers (interop.workers, forked from a fork server, not this child's children) the
    result also has each worker's peak RSS."""
    task = {**task, "benchmarks": str(Path(__file__).parent), "warm": warm, "scratch": str(scratch)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(task)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measured_copy(src: Path, dst: Path, warm: int) -> float:
    """Seconds of `copy_tree(src, dst)` in a fresh interpreter set up as a conversion's is; dst removed after."""
    result = _child({"copy": [str(src), str(dst)]}, warm, dst.parent)
    shutil.rmtree(dst)
    settle()
    return result["seconds"]


def measured_convert(warm: int, min_bytes_per_worker: int | None = None, per_tensor: bool = False, **kwargs) -> dict:
    """Run one conversion in a fresh interpreter: its seconds, peak RSS and the RSS before it began (and with
    `workers=`, each worker's peak RSS; `min_bytes_per_worker` overrides interop.workers' threshold;
    `per_tensor`: with `interop.engine.fused_plan` emptied, every fused row split and rebuilt as before)."""
    kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items()}
    return _child({"copy": None, "convert": kwargs, "min_bytes_per_worker": min_bytes_per_worker,
                   "per_tensor": per_tensor}, warm, Path(kwargs["dst"]).parent)


def median_run(results: list[dict]) -> dict:
    """The run with the median time (its RSS figures come with it); the worst peak RSS is kept."""
    middle = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]
    return {**middle, "peak_rss": max(r["peak_rss"] for r in results),
            "base_rss": min(r["base_rss"] for r in results), "all_seconds": [r["seconds"] for r in results]}


def report(label: str, result: dict, copy_seconds: float, size: int) -> str:
    added = result["peak_rss"] - result["base_rss"]
    runs = ", ".join(f"{s:.2f}" for s in result.get("all_seconds", [result["seconds"]]))
    workers = result.get("worker_peak_rss") or []
    per_worker = (f"  {len(workers)} workers, peak RSS each {' '.join(f'{w / 2**20:.0f}' for w in workers)} MiB"
                  if workers else "")
    return (f"{label:<24} {result['seconds']:5.2f} s (runs: {runs})  time/copy {result['seconds'] / copy_seconds:4.2f}  "
            f"peak RSS {result['peak_rss'] / 2**20:6.0f} MiB ({result['peak_rss'] / size:4.2f} of size)  "
            f"added by the conversion {added / 2**20:5.0f} MiB ({added / size:4.2f} of size){per_worker}")
