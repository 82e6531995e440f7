"""Tiny GLM-4.5 models built with transformers' own Glm4MoeForCausalLM (nothing downloaded), with the MTP module
added the way the zai-org/GLM-4.5 release stores it (`model.layers.{L}.*` after the last decoder layer, as
DeepSeek-V3's)."""
from __future__ import annotations

from helpers import deepseek_models

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


build = deepseek_models.build  # transformers' Glm4MoeForCausalLM for the config, every tensor random


def save(cfg, path, seed: int = 0, mtp: bool = True):
    """Save transformers' model (hub layout: one tensor per expert); `mtp` adds the release's MTP tensors."""
    return deepseek_models.save(cfg, path, seed, mtp)
