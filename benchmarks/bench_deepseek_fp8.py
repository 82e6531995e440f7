"""A DeepSeek-V3-shaped block-scaled FP8 HF checkpoint at the real widths (hidden 7168, 128 heads of 128 + 64,
MLA ranks 1536 / 512, vocabulary 129280, experts of 2048, 128x128 blocks) with fewer layers and experts,
converted from one run, each step against a plain copy of the same bytes:

    .venv/bin/python benchmarks/bench_deepseek_fp8.py                         # 2 layers (1 dense), 16 experts
    .venv/bin/python benchmarks/bench_deepseek_fp8.py --layers 3 --experts 64
    .venv/bin/python benchmarks/bench_deepseek_fp8.py --chain          # the issue-24 chain, with extrapolation

    FP8 HF -> HF bf16      (every projection dequantised: float32 product, rounded to bf16)
    FP8 HF -> HF fp8       (--dtype fp8 --workers 1: weights and scales kept byte-identical)
    --chain: FP8 HF -> Megatron torch_dist ep 8 (bf16) -> HF bf16, each hop against a copy of its own source,
             then the time and memory this gives for DeepSeek-V3 671B (61 layers + 1 MTP, 256 experts): time
             scales with the bytes (each hop's seconds per source byte), peak memory does not (a few tensors).

Each step runs in a fresh interpreter (`common.measured_convert`); peak RSS is reported against the source size:
it must stay a few tensors (the largest is the bf16 embedding, 1.85 GB), never a layer.  The weights are random
bytes (no NaN pattern), the scales random positives.  Everything is written under a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_convert, measured_copy, report, settle, tree_size  # noqa: E402

from interop.io.safetensors import SafetensorsWriter  # noqa: E402

H, HEADS, NOPE, ROPE, V, QR, KVR, FFN, EFFN, VOCAB = 7168, 128, 128, 64, 128, 1536, 512, 18432, 2048, 129280
STEPS = [("FP8 HF -> HF bf16", "fp8", "hf-bf16", dict(dst_format="hf")),
         ("FP8 HF -> HF fp8 (kept)", "fp8", "hf-fp8", dict(dst_format="hf", dtype="fp8"))]
CHAIN = [("FP8 HF -> Megatron torch_dist ep 8", "fp8", "mcore-ep8",
          dict(dst_format="megatron", format="torch_dist", ep=8, dtype="bf16")),
         ("Megatron ep 8 -> HF bf16", "mcore-ep8", "hf-bf16", dict(dst_format="hf"))]


def v3_671b_bytes() -> int:
    """DeepSeek-V3's FP8 release as this benchmark lays it out at 61 layers (3 dense) + 1 MTP, 256 experts."""
    full = sum(_nbytes(shape, kind) for _, shape, kind in entries(62, 256, dense=3))
    return full + 2 * VOCAB * H * 2 + 2 * H * H * 2  # the MTP layer's own embed/head copies and eh_proj (bf16)


def _nbytes(shape, kind) -> int:
    n = 1
    for d in shape:
        n *= d
    if kind == "fp8":
        return n + 4 * (-(-shape[0] // 128)) * (-(-shape[1] // 128))
    return n * (2 if kind == "bf16" else 4)


def config(layers: int, experts: int, dense: int = 1) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": VOCAB,
            "hidden_size": H, "intermediate_size": FFN, "moe_intermediate_size": EFFN, "num_hidden_layers": layers,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "n_shared_experts": 1,
            "n_routed_experts": experts, "routed_scaling_factor": 2.5, "kv_lora_rank": KVR, "q_lora_rank": QR,
            "qk_rope_head_dim": ROPE, "v_head_dim": V, "qk_nope_head_dim": NOPE, "n_group": 8,
            "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": dense, "norm_topk_prob": True,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 0, "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}}


def entries(layers: int, experts: int, dense: int = 1) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind): kind fp8 (with a scale), bf16, or fp32 (the correction bias)."""
    out = [("model.embed_tokens.weight", (VOCAB, H), "bf16")]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), "bf16"), (p + "self_attn.q_a_proj.weight", (QR, H), "fp8"),
                (p + "self_attn.q_a_layernorm.weight", (QR,), "bf16"),
                (p + "self_attn.q_b_proj.weight", (HEADS * (NOPE + ROPE), QR), "fp8"),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (KVR + ROPE, H), "fp8"),
                (p + "self_attn.kv_a_layernorm.weight", (KVR,), "bf16"),
                (p + "self_attn.kv_b_proj.weight", (HEADS * (NOPE + V), KVR), "fp8"),
                (p + "self_attn.o_proj.weight", (H, HEADS * V), "fp8"),
                (p + "post_attention_layernorm.weight", (H,), "bf16")]
        if i < dense:
            out += [(p + f"mlp.{n}_proj.weight", s, "fp8") for n, s in
                    (("gate", (FFN, H)), ("up", (FFN, H)), ("down", (H, FFN)))]
            continue
        out += [(p + "mlp.gate.weight", (experts, H), "bf16"), (p + "mlp.gate.e_score_correction_bias", (experts,), "fp32")]
        for e in ["shared_experts"] + [f"experts.{e}" for e in range(experts)]:
            out += [(f"{p}mlp.{e}.{n}_proj.weight", s, "fp8") for n, s in
                    (("gate", (EFFN, H)), ("up", (EFFN, H)), ("down", (H, EFFN)))]
    return out + [("model.norm.weight", (H,), "bf16"), ("lm_head.weight", (VOCAB, H), "bf16")]


def write_source(path: Path, layers: int, experts: int, dense: int = 1) -> None:
    path.mkdir(parents=True)
    plan = []
    for name, shape, kind in entries(layers, experts, dense):
        if kind == "fp8":
            plan += [(name, torch.float8_e4m3fn, shape),
                     (name + "_scale_inv", torch.float32, (-(-shape[0] // 128), -(-shape[1] // 128)))]
        else:
            plan.append((name, torch.bfloat16 if kind == "bf16" else torch.float32, shape))
    writer = SafetensorsWriter(path / "model.safetensors", plan, {"format": "pt"}, checksum=False)
    gen = torch.Generator().manual_seed(0)
    for name, dtype, shape in plan:
        if dtype == torch.float8_e4m3fn:  # magnitudes 0..0x7E (0x7F is NaN), random signs
            raw = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8) | \
                (torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)
            writer.write(name, raw.view(torch.float8_e4m3fn))
        elif name.endswith("_scale_inv"):
            writer.write(name, torch.rand(shape, generator=gen) * 1e-3 + 1e-5)
        else:
            writer.write(name, torch.randn(shape, generator=gen).to(dtype) * 0.02)
    writer.close()
    (path / "config.json").write_text(json.dumps(config(layers, experts, dense)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--chain", action="store_true", help="FP8 HF -> Megatron torch_dist ep 8 -> HF, extrapolated")
    ap.add_argument("--dense", type=int, default=1, help="dense first layers (DeepSeek-V3: 3)")
    ap.add_argument("--hops", type=int, default=2, help="with --chain: 1 stops at Megatron (disk for one copy less)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="interop-bench-ds-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        write_source(work / "fp8", args.layers, args.experts, args.dense)
        size = tree_size(work / "fp8")
        print(f"DeepSeek-V3-shaped FP8 HF, {args.layers} layers ({args.layers - args.dense} MoE of {args.experts} experts), "
              f"real widths: {size / 1e9:.2f} GB; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} cores")
        per_byte, peak = 0.0, 0
        for label, src, dst, kwargs in CHAIN[:args.hops] if args.chain else STEPS:
            here = tree_size(work / src)
            warm = here * 5 // 4
            copy = measured_copy(work / src, work / "copy", warm)
            result = measured_convert(warm, src=work / src, dst=work / dst, workers=1, **kwargs)
            settle()
            out = tree_size(work / dst)
            print(f"  {report(label, result, copy, here)}  (copy {copy:.2f} s; output {out / 1e9:.2f} GB)")
            per_byte += result["seconds"] / size  # this hop's time per byte of the FP8 source
            peak = max(peak, result["peak_rss"])
        if args.chain:
            full = v3_671b_bytes()
            print(f"DeepSeek-V3 671B (61 layers + 1 MTP, 256 experts): FP8 source {full / 1e9:.0f} GB; this chain "
                  f"at the measured rate: {per_byte * full / 3600:.1f} h on one process (workers split it by "
                  f"target files), peak memory {peak / 2**30:.2f} GiB as here: the largest tensors (the bf16 "
                  f"embedding and head, {VOCAB * H * 2 / 1e9:.2f} GB each), not a layer")


if __name__ == "__main__":
    main()
