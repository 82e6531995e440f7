"""Hugging Face parameter names <-> canonical names, one table per architecture.

Each row: (HF name, its transform, the canonical tensors it holds, in order).  Transforms
(`interop.transforms`): Copy (one tensor as it is), PlainConcat (GPT2 c_attn's bias [q; k; v]),
Transpose (GPT2's Conv1D: the parts joined on the output axis, stored [in, out]).
`{i}` is the global layer number; a row whose canonical names are absent from the
model (a bias it does not have, the head of a tied model) is skipped.
"""
from ..transforms import Copy, PlainConcat, Transpose

GPT2 = [
    ("transformer.wte.weight", Copy, ["embed.word.weight"]),
    ("transformer.wpe.weight", Copy, ["embed.position.weight"]),
    ("transformer.h.{i}.ln_1.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("transformer.h.{i}.ln_1.bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("transformer.h.{i}.attn.c_attn.weight", Transpose,
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("transformer.h.{i}.attn.c_attn.bias", PlainConcat,
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("transformer.h.{i}.attn.c_proj.weight", Transpose, ["layers.{i}.attn.o.weight"]),
    ("transformer.h.{i}.attn.c_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("transformer.h.{i}.ln_2.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("transformer.h.{i}.ln_2.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    ("transformer.h.{i}.mlp.c_fc.weight", Transpose, ["layers.{i}.mlp.up.weight"]),
    ("transformer.h.{i}.mlp.c_fc.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("transformer.h.{i}.mlp.c_proj.weight", Transpose, ["layers.{i}.mlp.down.weight"]),
    ("transformer.h.{i}.mlp.c_proj.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("transformer.ln_f.weight", Copy, ["final_norm.weight"]),
    ("transformer.ln_f.bias", Copy, ["final_norm.bias"]),
    ("lm_head.weight", Copy, ["lm_head.weight"]),
]

# Llama and the families that share its names (Qwen2, Qwen3, Mistral): absent tensors are skipped.
LLAMA = [
    ("model.embed_tokens.weight", Copy, ["embed.word.weight"]),
    ("model.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("model.layers.{i}.self_attn.q_proj.weight", Copy, ["layers.{i}.attn.q.weight"]),
    ("model.layers.{i}.self_attn.q_proj.bias", Copy, ["layers.{i}.attn.q.bias"]),
    ("model.layers.{i}.self_attn.k_proj.weight", Copy, ["layers.{i}.attn.k.weight"]),
    ("model.layers.{i}.self_attn.k_proj.bias", Copy, ["layers.{i}.attn.k.bias"]),
    ("model.layers.{i}.self_attn.v_proj.weight", Copy, ["layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.self_attn.v_proj.bias", Copy, ["layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.self_attn.o_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("model.layers.{i}.self_attn.q_norm.weight", Copy, ["layers.{i}.attn.q_norm.weight"]),  # Qwen3
    ("model.layers.{i}.self_attn.k_norm.weight", Copy, ["layers.{i}.attn.k_norm.weight"]),
    ("model.layers.{i}.self_attn.o_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("model.layers.{i}.post_attention_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("model.layers.{i}.mlp.gate_proj.weight", Copy, ["layers.{i}.mlp.gate.weight"]),
    ("model.layers.{i}.mlp.gate_proj.bias", Copy, ["layers.{i}.mlp.gate.bias"]),
    ("model.layers.{i}.mlp.up_proj.weight", Copy, ["layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.mlp.up_proj.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("model.layers.{i}.mlp.down_proj.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("model.layers.{i}.mlp.down_proj.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("model.norm.weight", Copy, ["final_norm.weight"]),
    ("lm_head.weight", Copy, ["lm_head.weight"]),
]

TABLES = {"gpt2": GPT2, "llama": LLAMA}

# Buffers some HF checkpoints carry that are not parameters: dropped with this reason.
IGNORED_SUFFIXES = {
    ".attn.bias": "GPT2 causal-mask buffer, rebuilt by the model",
    ".attn.masked_bias": "GPT2 mask-fill buffer, rebuilt by the model",
    ".rotary_emb.inv_freq": "RoPE frequency buffer, recomputed from rope_theta",
}
