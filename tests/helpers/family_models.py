"""Tiny Qwen2 / Qwen3 / Llama-3.x / Mistral / OLMo 2 / Phi-3 / Gemma 2 / Gemma 3 / gpt-oss models built with transformers' own classes (nothing downloaded)."""
from __future__ import annotations

import torch

VOCAB = 250
COMMON = dict(max_position_embeddings=64 * 1024, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
              intermediate_size=96, vocab_size=VOCAB, rms_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=0)
# Llama-3.1's rope scaling (megatron-core's fixed 1 / 4 / 8192), and one Megatron cannot express.
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ODD_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0, "original_max_position_embeddings": 1024}
# Scaling that moves short sequences (original context 64): the reference trainer's logits test sees it.
SHORT_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
              "high_freq_factor": 2.0, "original_max_position_embeddings": 64}
SLIDING_WINDOW = 5  # shorter than the test sequences, so the window changes the logits


def build(kind: str, seed: int = 0):
    transformers = __import__("transformers")
    torch.manual_seed(seed)
    if kind in ("qwen2", "qwen2-tied"):
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=kind == "qwen2-tied", rope_theta=7000.0)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "qwen3":  # head_dim 24: heads * head_dim (192) != hidden (64)
        config = transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False, rope_theta=7000.0)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind in ("llama3", "llama3-odd", "llama3-short"):
        rope = {"llama3": LLAMA31_ROPE, "llama3-odd": ODD_ROPE, "llama3-short": SHORT_ROPE}[kind]
        config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=dict(rope))
        model = transformers.LlamaForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**COMMON, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False,
                                            rope_theta=7000.0)
        model = transformers.MistralForCausalLM(config)
    elif kind == "olmo2":  # post norms only, q/k norms over the whole projection; pad_token_id None: Olmo2Config's
        # default 1 would make embedding row 1 a padding row (zero gradient), which no other trainer has
        config = transformers.Olmo2Config(**COMMON, tie_word_embeddings=False, rope_theta=7000.0, pad_token_id=None)
        model = transformers.Olmo2ForCausalLM(config)
    elif kind in ("phi3", "phi3-longrope"):  # fused qkv_proj / gate_up_proj; a window on every layer, or longrope
        # whose original context (8) is shorter than the test sequences, so both factor lists are used
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.3],
                "long_factor": [2.0, 2.5, 3.0, 3.5], "original_max_position_embeddings": 8}
        extra = {"rope_parameters": rope} if kind == "phi3-longrope" else {"sliding_window": SLIDING_WINDOW}
        config = transformers.Phi3Config(**{**COMMON, "head_dim": 8}, tie_word_embeddings=False, pad_token_id=None,
                                         original_max_position_embeddings=8, **extra)
        model = transformers.Phi3ForCausalLM(config)
    elif kind == "gemma2":  # sandwich norms, (1 + w), sqrt(hidden) embedding scale, GeGLU, soft-capping, a window on
        # every other layer, query_pre_attn_scalar unlike head_dim; caps small enough to bite on these logits
        config = transformers.Gemma2Config(**{**COMMON, "rms_norm_eps": 1e-6}, head_dim=16, sliding_window=SLIDING_WINDOW,
                                           query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                           final_logit_softcapping=5.0, pad_token_id=None)
        model = transformers.Gemma2ForCausalLM(config)
    elif kind == "gemma3":  # Gemma 2's facts with q/k norms, 5 sliding layers to 1 full, the sliding layers' own rope
        # base and linear scaling on the full ones (rope_parameters per layer type), no soft-capping
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 7000.0}}
        config = transformers.Gemma3TextConfig(**{**COMMON, "rms_norm_eps": 1e-6, "num_hidden_layers": 6}, head_dim=16,
                                               sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24,
                                               rope_parameters=rope, pad_token_id=None)
        model = transformers.Gemma3ForCausalLM(config)
    elif kind == "gpt_oss":  # sinks, q/k/v/o biases, every other layer windowed, YaRN without truncation (original
        # context 8, shorter than the test sequences), 4 experts with biases, top-2, router bias, a clamp that bites
        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 8, "rope_theta": 150000.0}
        config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32, "max_position_embeddings": 256},
                                           head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=SLIDING_WINDOW, rope_parameters=rope, swiglu_limit=0.5,
                                           pad_token_id=None)
        model = transformers.GptOssForCausalLM(config)
    else:
        raise ValueError(kind)
    # Non-trivial norms and biases, so that a swapped tensor cannot hide behind ones and zeros.
    # Gemma's norms store w of (1 + w): centred on 0 like theirs (1 + (1 + noise) would double every norm, and
    # 4 norms per layer make the training curve sensitive enough for rounding to show by step 10).
    one = 0.0 if kind.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 0.1 + (one if name.endswith("weight") else 0.0))
        if kind == "gpt_oss":  # router logits with clear margins: a top-k choice that is a near-tie flips with the
            # order of float sums (tp, ep), a discrete change no tolerance covers; x10 keeps 10 training steps clear
            for layer in model.model.layers:
                layer.mlp.router.weight.mul_(10.0)
    return model.eval()


KINDS = ["qwen2", "qwen2-tied", "qwen3", "llama3", "mistral"]
