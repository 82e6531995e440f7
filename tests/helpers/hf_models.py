"""Tiny Hugging Face models built in the test run (nothing is downloaded)."""
from __future__ import annotations

import torch

# 6 layers fit pp 1, 2 and 3; 8 heads / 4 kv groups / ffn 96 fit tp 1, 2 and 4;
# a vocabulary of 250 needs padding at tp 4.
VOCAB = 250


def build(kind: str, seed: int = 0):
    transformers = __import__("transformers")
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=8, n_inner=128, vocab_size=VOCAB, n_positions=64,
                                         bos_token_id=0, eos_token_id=0, activation_function="gelu_new")
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                          num_hidden_layers=6, intermediate_size=96, vocab_size=VOCAB,
                                          max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
                                          tie_word_embeddings=(kind == "llama-tied"), bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    # Non-trivial norms and biases, so that a swapped tensor cannot hide behind ones and zeros.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def save(kind: str, path, seed: int = 0):
    model = build(kind, seed)
    model.save_pretrained(path)
    return model


KINDS = ["gpt2", "llama", "llama-tied"]


def assert_same_hf(a, b):
    """Two HF checkpoint folders (one model.safetensors each) hold the same tensors: names, dtypes, values."""
    from safetensors.torch import load_file
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for key in x:
        assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key
