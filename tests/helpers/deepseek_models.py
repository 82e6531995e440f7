"""Tiny DeepSeek-V3 / V2 models built with transformers' own classes (nothing downloaded), and the MTP module
added the way the public DeepSeek-V3 release stores it (`model.layers.{L}.*` after the last decoder layer)."""
from __future__ import annotations

import json

import torch

VOCAB = 1000  # not a multiple of 128


def v3_config(**changes):
    """4 heads of 16 + 8 (rope) with v 16, ranks 48 / 32, 8 experts of 32 in 4 groups (2 kept), one dense layer,
    a shared expert, routed scaling 2.5, interleaved rope with YaRN (mscale 1 / 1), as DeepSeek-V3 is shaped."""
    transformers = __import__("transformers")
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
                  num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, num_nextn_predict_layers=1,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 1.0},
                  bos_token_id=0, eos_token_id=1)
    kwargs.update(changes)
    return transformers.DeepseekV3Config(**kwargs)


def v2_config(**changes):
    """DeepSeek-V2-Lite-shaped: no q compression, softmax routing over 8 experts in 4 groups (group-limited
    greedy, 2 kept), 2 shared experts, one dense layer, default rope."""
    transformers = __import__("transformers")
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                  n_routed_experts=8, routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=None,
                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
                  topk_method="group_limited_greedy", num_experts_per_tok=2, first_k_dense_replace=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=1)
    kwargs.update(changes)
    return transformers.DeepseekV2Config(**kwargs)


def build(config, seed: int = 0):
    """transformers' model for `config` (DeepSeek-V3 / V2, GLM-4.5: any with a correction bias), every tensor random
    (norms near 1, the correction bias spread)."""
    transformers = __import__("transformers")
    torch.manual_seed(seed)
    cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM, "deepseek_v2": transformers.DeepseekV2ForCausalLM,
           "glm4_moe": transformers.Glm4MoeForCausalLM}[config.model_type]
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model.eval()


def mtp_tensors(model, saved: dict, seed: int = 1) -> dict:
    """DeepSeek-V3's MTP module as its release stores it: `model.layers.{L}.{enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head, embed_tokens}` and a decoder layer named like the last one in `saved`
    (the hub layout transformers saved: one tensor per expert), with its own random values."""
    config = model.config
    L, h = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(seed)
    out = {}
    for name, t in saved.items():
        if name.startswith(f"model.layers.{L - 1}."):
            value = torch.randn_like(t) * 0.1 + (1.0 if "norm" in name else 0.0)
            out[name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")] = value
    out[f"model.layers.{L}.enorm.weight"] = torch.randn(h) * 0.1 + 1
    out[f"model.layers.{L}.hnorm.weight"] = torch.randn(h) * 0.1 + 1
    out[f"model.layers.{L}.eh_proj.weight"] = torch.randn(h, 2 * h) * 0.1
    out[f"model.layers.{L}.shared_head.norm.weight"] = torch.randn(h) * 0.1 + 1
    out[f"model.layers.{L}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    out[f"model.layers.{L}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    return out


def save(config, path, seed: int = 0, mtp: bool = False):
    """Save transformers' model (hub layout: one tensor per expert); `mtp` adds the release's MTP tensors."""
    from safetensors.torch import load_file, save_file
    model = build(config, seed)
    model.save_pretrained(path)
    if mtp:
        tensors = load_file(path / "model.safetensors")
        tensors.update(mtp_tensors(model, tensors))
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return model


def logits(path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own logits for the checkpoint at `path` (fp32, eager attention)."""
    transformers = __import__("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(tokens).logits


def config_json(path) -> dict:
    return json.loads((path / "config.json").read_text())
