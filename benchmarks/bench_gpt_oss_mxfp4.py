"""A gpt-oss-shaped MXFP4 HF checkpoint at gpt-oss-20b's widths (hidden 2880, 64 heads of 64, 8 kv heads, experts of
2880 with biases, sinks) with fewer layers and experts and a 32000-row vocabulary (about 1 GB as stored), converted
from one run, each step against a plain copy of the same bytes:

    .venv/bin/python benchmarks/bench_gpt_oss_mxfp4.py                        # 2 layers of 32 experts, ~1.2 GB
    .venv/bin/python benchmarks/bench_gpt_oss_mxfp4.py --layers 1 --experts 4 # a smoke run

    MXFP4 HF -> HF bf16              (every expert tensor dequantised: FP4 x 2^(scale - 127), exact)
    MXFP4 HF -> Megatron tp 2 ep 2   (dequantised, de-interleaved into linear_fc1 = [gate; up], cut per rank)

Each step runs in a fresh interpreter (`common.measured_convert`); peak RSS is reported against the source size: it
is bounded by a few experts' slices, never a layer or the model: the reader reads and dequantises one expert's slice of a
stacked tensor at a time, and the HF writer writes gate_up_proj / down_proj expert by expert (holding only down_proj's
slices that arrive before gate_up_proj is done).  Each step is also timed against a copy of its OUTPUT, the bytes it
must write (3.7 GB of bf16 from 1.3 GB of MXFP4).  The blocks are random bytes, the scales random exponents near 2^0.  Written under a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_convert, measured_copy, report, settle, tree_size  # noqa: E402

from interop.io.safetensors import SafetensorsWriter  # noqa: E402

H, HEADS, KV, D, FFN, VOCAB = 2880, 64, 8, 64, 2880, 32000
STEPS = [("MXFP4 HF -> HF bf16", "hf-bf16", dict(dst_format="hf", dtype="bf16")),
         ("MXFP4 HF -> Megatron tp2 ep2", "megatron", dict(dst_format="megatron", tp=2, ep=2, dtype="bf16"))]


def config(layers: int, experts: int) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB, "hidden_size": H,
            "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "head_dim": D, "num_local_experts": experts, "num_experts_per_tok": 4,
            "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "swiglu_limit": 7.0, "attention_bias": True,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
            "quantization_config": {"quant_method": "mxfp4"}}


def entries(layers: int, experts: int) -> list[tuple[str, torch.dtype, tuple]]:
    out = [("model.embed_tokens.weight", torch.bfloat16, (VOCAB, H))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", torch.bfloat16, (H,))]
        for n, rows in (("q", HEADS * D), ("k", KV * D), ("v", KV * D)):
            out += [(p + f"self_attn.{n}_proj.weight", torch.bfloat16, (rows, H)),
                    (p + f"self_attn.{n}_proj.bias", torch.bfloat16, (rows,))]
        out += [(p + "self_attn.o_proj.weight", torch.bfloat16, (H, HEADS * D)),
                (p + "self_attn.o_proj.bias", torch.bfloat16, (H,)), (p + "self_attn.sinks", torch.bfloat16, (HEADS,)),
                (p + "post_attention_layernorm.weight", torch.bfloat16, (H,)),
                (p + "mlp.router.weight", torch.bfloat16, (experts, H)), (p + "mlp.router.bias", torch.bfloat16, (experts,)),
                (p + "mlp.experts.gate_up_proj_blocks", torch.uint8, (experts, 2 * FFN, H // 32, 16)),
                (p + "mlp.experts.gate_up_proj_scales", torch.uint8, (experts, 2 * FFN, H // 32)),
                (p + "mlp.experts.gate_up_proj_bias", torch.bfloat16, (experts, 2 * FFN)),
                (p + "mlp.experts.down_proj_blocks", torch.uint8, (experts, H, FFN // 32, 16)),
                (p + "mlp.experts.down_proj_scales", torch.uint8, (experts, H, FFN // 32)),
                (p + "mlp.experts.down_proj_bias", torch.bfloat16, (experts, H))]
    return out + [("model.norm.weight", torch.bfloat16, (H,)), ("lm_head.weight", torch.bfloat16, (VOCAB, H))]


def write_source(path: Path, layers: int, experts: int) -> None:
    path.mkdir(parents=True)
    plan = entries(layers, experts)
    writer = SafetensorsWriter(path / "model.safetensors", plan, {"format": "pt"}, checksum=False)
    gen = torch.Generator().manual_seed(0)
    for name, dtype, shape in plan:
        if name.endswith("_blocks"):
            writer.write(name, torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8))
        elif name.endswith("_scales"):
            writer.write(name, torch.randint(120, 128, shape, generator=gen, dtype=torch.uint8))
        else:
            writer.write(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    (path / "config.json").write_text(json.dumps(config(layers, experts)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="interop-bench-gptoss-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        write_source(work / "mxfp4", args.layers, args.experts)
        size = tree_size(work / "mxfp4")
        print(f"gpt-oss-shaped MXFP4 HF, {args.layers} layers of {args.experts} experts, gpt-oss-20b widths: "
              f"{size / 1e9:.2f} GB; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} cores")
        for label, dst, kwargs in STEPS:
            warm = size * 5 // 4
            copy = measured_copy(work / "mxfp4", work / "copy", warm)
            result = measured_convert(warm, src=work / "mxfp4", dst=work / dst, workers=1, **kwargs)
            settle()
            out = tree_size(work / dst)
            out_copy = measured_copy(work / dst, work / "copy-out", out * 5 // 4)  # the bytes it had to write
            shutil.rmtree(work / dst)
            print(f"  {report(label, result, copy, size)}  (copy {copy:.2f} s; output {out / 1e9:.2f} GB, "
                  f"its copy {out_copy:.2f} s: time / copy of the output {result['seconds'] / out_copy:.2f})")


if __name__ == "__main__":
    main()
