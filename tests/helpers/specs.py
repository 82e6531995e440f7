"""Tiny ModelSpec dicts the trainer tests share: GQA + untied + padded vocab; MHA + tied + learned positions + biases."""
from __future__ import annotations
import yaml

LLAMA = dict(arch="llama", num_layers=4, hidden=32, ffn_hidden=64, heads=4, kv_groups=2, head_dim=8, vocab=120,
             padded_vocab=128, max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu",
             position="rope", rope_base=10000.0, tied_embeddings=False)


GPT2 = dict(arch="gpt2", num_layers=2, hidden=32, ffn_hidden=128, heads=4, kv_groups=4, head_dim=8, vocab=250,
            padded_vocab=256, max_positions=64, norm="layernorm", norm_eps=1e-5, activation="gelu_tanh",
            position="learned", tied_embeddings=True, qkv_bias=True, linear_bias=True)


def write_spec(path, spec: dict):
    path.write_text(yaml.safe_dump(spec))
    return path
