"""Tiny mixture-of-experts specs and transformers models (Mixtral, Qwen2-MoE) the MoE tests share."""
from __future__ import annotations
import torch


BASE = dict(arch="llama", num_layers=2, hidden=32, heads=4, kv_groups=2, head_dim=8, vocab=64, padded_vocab=64,
            max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu", position="rope",
            rope_base=10000.0, tied_embeddings=False)


MIXTRAL = dict(BASE, ffn_hidden=16, num_experts=4, moe_topk=2, moe_ffn_hidden=16)


# Qwen2-MoE: q/k/v biases, layer 0 dense (mlp_only_layers), no top-k renormalisation, gated shared expert
QWEN2_MOE = dict(BASE, ffn_hidden=48, qkv_bias=True, num_experts=4, moe_topk=2, moe_ffn_hidden=16, moe_layers=[1],
                 moe_norm_topk=False, shared_expert_ffn_hidden=24, shared_expert_gate=True)


def hf_model(kind: str):
    transformers = __import__("transformers")
    torch.manual_seed(0)
    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=24, num_experts=4, norm_topk_prob=False,
                                             decoder_sparse_step=1, mlp_only_layers=[0], **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # every tensor random (Qwen2-MoE's router starts at 0: top-k would be ties)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()
