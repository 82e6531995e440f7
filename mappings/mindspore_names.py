"""MindSpore parameter names <-> canonical names, one table per dialect and architecture.

Each row: (MindSpore name, how it is stored, the canonical tensors it holds, in order).
  "copy"        the canonical tensors concatenated along the output axis (one part: a copy)
  "t"           one canonical tensor stored transposed ([in, out], MindFormers GPT2 linears)
  "qkv"         q, k, v fused per KV group: each group's q heads, then its k, then its v
  "gate_up"     Megatron-style fc1: each TP rank holds [gate_r; up_r]
  "interleave"  MindFormers w_gate_hidden: gate and up rows interleaved g0, u0, g1, u1, ...
`{i}` is the GLOBAL layer number.  A row whose canonical tensors are absent from the
model is skipped, and the first row that claims a MindSpore name wins (so a gated
`mapping` row comes before the plain one).
"""

# MindSpeed-Core-MS: Megatron's legacy names, with its renames (dense_h_to_4h -> mapping, ...).
MINDSPEED = [
    ("language_model.embedding.word_embeddings.weight", "copy", ["embed.word.weight"]),
    ("language_model.embedding.position_embeddings.weight", "copy", ["embed.position.weight"]),
    ("language_model.encoder.layers.{i}.input_norm.weight", "copy", ["layers.{i}.attn_norm.weight"]),
    ("language_model.encoder.layers.{i}.input_norm.bias", "copy", ["layers.{i}.attn_norm.bias"]),
    ("language_model.encoder.layers.{i}.attention.qkv_proj.weight", "qkv",
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("language_model.encoder.layers.{i}.attention.qkv_proj.bias", "qkv",
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("language_model.encoder.layers.{i}.attention.out_proj.weight", "copy", ["layers.{i}.attn.o.weight"]),
    ("language_model.encoder.layers.{i}.attention.out_proj.bias", "copy", ["layers.{i}.attn.o.bias"]),
    ("language_model.encoder.layers.{i}.post_attention_norm.weight", "copy", ["layers.{i}.mlp_norm.weight"]),
    ("language_model.encoder.layers.{i}.post_attention_norm.bias", "copy", ["layers.{i}.mlp_norm.bias"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.weight", "gate_up",
     ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.bias", "gate_up",
     ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.weight", "copy", ["layers.{i}.mlp.up.weight"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.bias", "copy", ["layers.{i}.mlp.up.bias"]),
    ("language_model.encoder.layers.{i}.mlp.projection.weight", "copy", ["layers.{i}.mlp.down.weight"]),
    ("language_model.encoder.layers.{i}.mlp.projection.bias", "copy", ["layers.{i}.mlp.down.bias"]),
    ("language_model.encoder.final_norm.weight", "copy", ["final_norm.weight"]),
    ("language_model.encoder.final_norm.bias", "copy", ["final_norm.bias"]),
    ("language_model.output_layer.weight", "copy", ["lm_head.weight"]),
]
# Megatron's copy of the tied embedding on the last pipeline stage: written, never read back.
MINDSPEED_TIED_HEAD = "word_embeddings_for_head.weight"

# MindFormers Llama: separate q/k/v and gate/down/up (w1 = gate, w2 = down, w3 = up), no transposes.
_LLAMA_COMMON = [
    ("model.tok_embeddings.embedding_weight", "copy", ["embed.word.weight"]),
    ("model.layers.{i}.attention_norm.weight", "copy", ["layers.{i}.attn_norm.weight"]),
    ("model.layers.{i}.attention.wo.weight", "copy", ["layers.{i}.attn.o.weight"]),
    ("model.layers.{i}.attention.wo.bias", "copy", ["layers.{i}.attn.o.bias"]),
    ("model.layers.{i}.ffn_norm.weight", "copy", ["layers.{i}.mlp_norm.weight"]),
    ("model.layers.{i}.feed_forward.w2.weight", "copy", ["layers.{i}.mlp.down.weight"]),
    ("model.layers.{i}.feed_forward.w2.bias", "copy", ["layers.{i}.mlp.down.bias"]),
    ("model.norm_out.weight", "copy", ["final_norm.weight"]),
    ("lm_head.weight", "copy", ["lm_head.weight"]),
]
MINDFORMERS_LLAMA = _LLAMA_COMMON + [
    ("model.layers.{i}.attention.wq.weight", "copy", ["layers.{i}.attn.q.weight"]),
    ("model.layers.{i}.attention.wq.bias", "copy", ["layers.{i}.attn.q.bias"]),
    ("model.layers.{i}.attention.wk.weight", "copy", ["layers.{i}.attn.k.weight"]),
    ("model.layers.{i}.attention.wk.bias", "copy", ["layers.{i}.attn.k.bias"]),
    ("model.layers.{i}.attention.wv.weight", "copy", ["layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.attention.wv.bias", "copy", ["layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.feed_forward.w1.weight", "copy", ["layers.{i}.mlp.gate.weight"]),
    ("model.layers.{i}.feed_forward.w1.bias", "copy", ["layers.{i}.mlp.gate.bias"]),
    ("model.layers.{i}.feed_forward.w3.weight", "copy", ["layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.feed_forward.w3.bias", "copy", ["layers.{i}.mlp.up.bias"]),
]
# With `qkv_concat`: one w_qkv per layer (grouped per KV group) and one w_gate_hidden.
MINDFORMERS_LLAMA_CONCAT = _LLAMA_COMMON + [
    ("model.layers.{i}.attention.w_qkv.weight", "qkv",
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.attention.w_qkv.bias", "qkv",
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.feed_forward.w_gate_hidden.weight", "interleave",
     ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.feed_forward.w_gate_hidden.bias", "interleave",
     ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
]

# MindFormers GPT2 (backbone + tied head): attention dense1/2/3 are q/k/v as [out, in];
# the attention projection and the FeedForward mapping/projection are [in, out].
MINDFORMERS_GPT2 = [
    ("backbone.embedding.word_embedding.embedding_table", "copy", ["embed.word.weight"]),
    ("backbone.embedding.position_embedding.embedding_table", "copy", ["embed.position.weight"]),
    ("backbone.blocks.{i}.layernorm1.gamma", "copy", ["layers.{i}.attn_norm.weight"]),
    ("backbone.blocks.{i}.layernorm1.beta", "copy", ["layers.{i}.attn_norm.bias"]),
    ("backbone.blocks.{i}.attention.dense1.weight", "copy", ["layers.{i}.attn.q.weight"]),
    ("backbone.blocks.{i}.attention.dense1.bias", "copy", ["layers.{i}.attn.q.bias"]),
    ("backbone.blocks.{i}.attention.dense2.weight", "copy", ["layers.{i}.attn.k.weight"]),
    ("backbone.blocks.{i}.attention.dense2.bias", "copy", ["layers.{i}.attn.k.bias"]),
    ("backbone.blocks.{i}.attention.dense3.weight", "copy", ["layers.{i}.attn.v.weight"]),
    ("backbone.blocks.{i}.attention.dense3.bias", "copy", ["layers.{i}.attn.v.bias"]),
    ("backbone.blocks.{i}.attention.projection.weight", "t", ["layers.{i}.attn.o.weight"]),
    ("backbone.blocks.{i}.attention.projection.bias", "copy", ["layers.{i}.attn.o.bias"]),
    ("backbone.blocks.{i}.layernorm2.gamma", "copy", ["layers.{i}.mlp_norm.weight"]),
    ("backbone.blocks.{i}.layernorm2.beta", "copy", ["layers.{i}.mlp_norm.bias"]),
    ("backbone.blocks.{i}.output.mapping.weight", "t", ["layers.{i}.mlp.up.weight"]),
    ("backbone.blocks.{i}.output.mapping.bias", "copy", ["layers.{i}.mlp.up.bias"]),
    ("backbone.blocks.{i}.output.projection.weight", "t", ["layers.{i}.mlp.down.weight"]),
    ("backbone.blocks.{i}.output.projection.bias", "copy", ["layers.{i}.mlp.down.bias"]),
    ("backbone.layernorm.gamma", "copy", ["final_norm.weight"]),
    ("backbone.layernorm.beta", "copy", ["final_norm.bias"]),
    ("head.weight", "copy", ["lm_head.weight"]),
]

# (dialect, arch, qkv_concat) -> table
TABLES = {
    ("mindspeed", "gpt2", False): MINDSPEED,
    ("mindspeed", "llama", False): MINDSPEED,
    ("mindformers", "llama", False): MINDFORMERS_LLAMA,
    ("mindformers", "llama", True): MINDFORMERS_LLAMA_CONCAT,
    ("mindformers", "gpt2", False): MINDFORMERS_GPT2,
}
DIALECTS = ("mindspeed", "mindformers")

# Adam moments ride in the same files under these prefixes of the MindSpore name.
OPTIM_PREFIXES = {
    "mindspeed": {"optim.exp_avg.": "exp_avg.", "optim.exp_avg_sq.": "exp_avg_sq."},
    "mindformers": {"optim.exp_avg.": "adam_m.", "optim.exp_avg_sq.": "adam_v."},
}

# A tag that tells the dialect of a checkpoint that carries no description.
DIALECT_MARKERS = {
    "language_model.": "mindspeed",
    "model.tok_embeddings.": "mindformers",
    "backbone.": "mindformers",
}


# Buffers some MindFormers checkpoints carry that are not parameters (GPT2's converter writes HF's
# attention mask buffers as attention.beta / masked_beta): dropped with this reason.
IGNORED_SUFFIXES = {
    ".attention.beta": "GPT2 causal-mask buffer, rebuilt by the model",
    ".attention.masked_beta": "GPT2 mask-fill buffer, rebuilt by the model",
}
