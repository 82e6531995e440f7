"""Tiny GLM-4.5 models built with transformers' own Glm4MoeForCausalLM (nothing downloaded), with the MTP module
added the way the zai-org/GLM-4.5 release stores it (`model.layers.{L}.*` after the last decoder layer, as
DeepSeek-V3's)."""
from __future__ import annotations

import torch

from helpers.deepseek_models import mtp_tensors

VOCAB = 1000  # not a multiple of 128


def config(**changes):
    """GQA (4 heads of 16, 2 kv heads), q/k/v biases, q/k norms, partial rotary 0.5, 8 experts of 32 in 2 groups
    (1 kept), top-2, one shared expert, one dense first layer, routed scaling 2.5, one MTP module: GLM-4.5's shape."""
    transformers = __import__("transformers")
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                  num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True, use_qk_norm=True,
                  num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    kwargs.update(changes)
    return transformers.Glm4MoeConfig(**kwargs)


def build(cfg, seed: int = 0):
    """transformers' model for `cfg`, every tensor random (norms near 1, the correction bias spread)."""
    transformers = __import__("transformers")
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model.eval()


def save(cfg, path, seed: int = 0, mtp: bool = True):
    """Save transformers' model (hub layout: one tensor per expert); `mtp` adds the release's MTP tensors."""
    from safetensors.torch import load_file, save_file
    model = build(cfg, seed)
    model.save_pretrained(path)
    if mtp:
        tensors = load_file(path / "model.safetensors")
        tensors.update(mtp_tensors(model, tensors))
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return model
