"""Hugging Face parameter names <-> canonical names, one table per architecture.

Each row: (HF name, how it is stored, the canonical tensors it holds, in order).
  "copy"    the canonical tensors concatenated along the output axis (one part: a plain copy)
  "conv1d"  GPT2's Conv1D: the same, stored transposed ([in, out])
`{i}` is the global layer number; a row whose canonical names are absent from the
model (a bias it does not have, the head of a tied model) is skipped.
"""

GPT2 = [
    ("transformer.wte.weight", "copy", ["embed.word.weight"]),
    ("transformer.wpe.weight", "copy", ["embed.position.weight"]),
    ("transformer.h.{i}.ln_1.weight", "copy", ["layers.{i}.attn_norm.weight"]),
    ("transformer.h.{i}.ln_1.bias", "copy", ["layers.{i}.attn_norm.bias"]),
    ("transformer.h.{i}.attn.c_attn.weight", "conv1d",
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("transformer.h.{i}.attn.c_attn.bias", "copy",
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("transformer.h.{i}.attn.c_proj.weight", "conv1d", ["layers.{i}.attn.o.weight"]),
    ("transformer.h.{i}.attn.c_proj.bias", "copy", ["layers.{i}.attn.o.bias"]),
    ("transformer.h.{i}.ln_2.weight", "copy", ["layers.{i}.mlp_norm.weight"]),
    ("transformer.h.{i}.ln_2.bias", "copy", ["layers.{i}.mlp_norm.bias"]),
    ("transformer.h.{i}.mlp.c_fc.weight", "conv1d", ["layers.{i}.mlp.up.weight"]),
    ("transformer.h.{i}.mlp.c_fc.bias", "copy", ["layers.{i}.mlp.up.bias"]),
    ("transformer.h.{i}.mlp.c_proj.weight", "conv1d", ["layers.{i}.mlp.down.weight"]),
    ("transformer.h.{i}.mlp.c_proj.bias", "copy", ["layers.{i}.mlp.down.bias"]),
    ("transformer.ln_f.weight", "copy", ["final_norm.weight"]),
    ("transformer.ln_f.bias", "copy", ["final_norm.bias"]),
    ("lm_head.weight", "copy", ["lm_head.weight"]),
]

# Llama and the families that share its names (Qwen2, Qwen3, Mistral): absent tensors are skipped.
LLAMA = [
    ("model.embed_tokens.weight", "copy", ["embed.word.weight"]),
    ("model.layers.{i}.input_layernorm.weight", "copy", ["layers.{i}.attn_norm.weight"]),
    ("model.layers.{i}.self_attn.q_proj.weight", "copy", ["layers.{i}.attn.q.weight"]),
    ("model.layers.{i}.self_attn.q_proj.bias", "copy", ["layers.{i}.attn.q.bias"]),
    ("model.layers.{i}.self_attn.k_proj.weight", "copy", ["layers.{i}.attn.k.weight"]),
    ("model.layers.{i}.self_attn.k_proj.bias", "copy", ["layers.{i}.attn.k.bias"]),
    ("model.layers.{i}.self_attn.v_proj.weight", "copy", ["layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.self_attn.v_proj.bias", "copy", ["layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.self_attn.o_proj.weight", "copy", ["layers.{i}.attn.o.weight"]),
    ("model.layers.{i}.self_attn.q_norm.weight", "copy", ["layers.{i}.attn.q_norm.weight"]),  # Qwen3
    ("model.layers.{i}.self_attn.k_norm.weight", "copy", ["layers.{i}.attn.k_norm.weight"]),
    ("model.layers.{i}.self_attn.o_proj.bias", "copy", ["layers.{i}.attn.o.bias"]),
    ("model.layers.{i}.post_attention_layernorm.weight", "copy", ["layers.{i}.mlp_norm.weight"]),
    ("model.layers.{i}.mlp.gate_proj.weight", "copy", ["layers.{i}.mlp.gate.weight"]),
    ("model.layers.{i}.mlp.gate_proj.bias", "copy", ["layers.{i}.mlp.gate.bias"]),
    ("model.layers.{i}.mlp.up_proj.weight", "copy", ["layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.mlp.up_proj.bias", "copy", ["layers.{i}.mlp.up.bias"]),
    ("model.layers.{i}.mlp.down_proj.weight", "copy", ["layers.{i}.mlp.down.weight"]),
    ("model.layers.{i}.mlp.down_proj.bias", "copy", ["layers.{i}.mlp.down.bias"]),
    ("model.norm.weight", "copy", ["final_norm.weight"]),
    ("lm_head.weight", "copy", ["lm_head.weight"]),
]

TABLES = {"gpt2": GPT2, "llama": LLAMA}

# Buffers some HF checkpoints carry that are not parameters: dropped with this reason.
IGNORED_SUFFIXES = {
    ".attn.bias": "GPT2 causal-mask buffer, rebuilt by the model",
    ".attn.masked_bias": "GPT2 mask-fill buffer, rebuilt by the model",
    ".rotary_emb.inv_freq": "RoPE frequency buffer, recomputed from rope_theta",
}
