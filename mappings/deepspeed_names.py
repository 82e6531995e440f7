"""Megatron-DeepSpeed pipeline layer files (`layer_XX-model_YY-model_states.pt`) <-> canonical names.

GPTModelPipe (Megatron-DeepSpeed megatron/model/gpt_model.py) is a DeepSpeed PipelineModule whose
specs are: functions (`_to_float16`, in BLOOM's fork also transposes) that have no file, the
EmbeddingPipe (tied as 'embed' unless --untie-embeddings-and-output-weights), one
ParallelTransformerLayerPipe per layer, the final LayerNorm / RMSNorm, and the head (the tied
embedding's forward_fn, no file; or LMHeadPipe when untied).  DeepSpeed saves each spec that has
a state dict as `layer_{index:02d}-model_{tp rank:02d}-model_states.pt`, index = position in the
specs, so the offsets differ by fork: the kind of a file is told by its keys (`FILE_KINDS`), and
transformer layers are numbered in index order.

Rows: (key in the layer file, its transform, canonical tensors), transforms as in
`megatron_names`: Copy (cut across TP ranks as its canonical split says), GroupedQKV
(query_key_value: per query group [q heads; k; v], megatron/model/transformer.py `split_tensor`),
GatedMLP (swiglu dense_h_to_4h: each TP rank holds [gate_r; up_r], `swiglu` chunks it in two).
A key with several rows: the first whose canonical tensors all exist applies.
"""
from ..transforms import Copy, GatedMLP, GroupedQKV

_QKV_W = ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]
_QKV_B = ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]

EMBEDDING = [
    ("word_embeddings.weight", Copy, ["embed.word.weight"]),
    ("position_embeddings.weight", Copy, ["embed.position.weight"]),
]

LAYER = [
    ("input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("input_layernorm.bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("self_attention.query_key_value.weight", GroupedQKV, _QKV_W),
    ("self_attention.query_key_value.bias", GroupedQKV, _QKV_B),
    ("self_attention.dense.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("self_attention.dense.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("post_attention_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("post_attention_layernorm.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    ("mlp.dense_h_to_4h.weight", GatedMLP, ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
    ("mlp.dense_h_to_4h.weight", Copy, ["layers.{i}.mlp.up.weight"]),
    ("mlp.dense_h_to_4h.bias", GatedMLP, ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
    ("mlp.dense_h_to_4h.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("mlp.dense_4h_to_h.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("mlp.dense_4h_to_h.bias", Copy, ["layers.{i}.mlp.down.bias"]),
]

FINAL_NORM = [
    ("weight", Copy, ["final_norm.weight"]),
    ("bias", Copy, ["final_norm.bias"]),
]

LM_HEAD = [("lm_head.weight", Copy, ["lm_head.weight"])]

TABLES = {"embedding": EMBEDDING, "layer": LAYER, "final_norm": FINAL_NORM, "lm_head": LM_HEAD}

# Layer-file keys that are buffers, not parameters: dropped with the reason.
IGNORED_SUFFIXES = {
    "rotary_emb.inv_freq": "rotary frequency buffer, recomputed from the rotary base",
    "attention.bias": "causal mask buffer",
    "masked_bias": "causal mask buffer",
}


def kind_of(keys) -> str | None:
    """Which module a layer file holds, from its keys (None: not a GPTModelPipe module)."""
    keys = set(keys)
    if "word_embeddings.weight" in keys:
        return "embedding"
    if any(k.startswith("self_attention.") for k in keys):
        return "layer"
    if keys == {"lm_head.weight"}:
        return "lm_head"
    if keys and keys <= {"weight", "bias"}:
        return "final_norm"
    return None


def hf_module_tables(hf_table: list) -> dict[str, list]:
    """The rows of a PipelineModule whose layers are a Hugging Face model's own modules, from that family's HF
    name table: each module's state dict names its parameters relative to the module, so a decoder layer's
    keys are the HF names after `...layers.{i}.` and the embedding, final norm and head hold just `weight`
    (and `bias`).  The kind of a row is told by its canonical tensors; a learned position table has no
    module of its own here (None: such a model is not read)."""
    tables: dict[str, list] = {"embedding": [], "layer": [], "final_norm": [], "lm_head": []}
    for key, transform, parts in hf_table:
        if "{i}." in key:
            tables["layer"].append((key.split("{i}.", 1)[1], transform, parts))
        elif parts[0].startswith("embed.position."):
            return None
        else:
            kind = ("embedding" if parts[0].startswith("embed.") else
                    "lm_head" if parts[0].startswith("lm_head.") else "final_norm")
            tables[kind].append((key.rsplit(".", 1)[1], transform, parts))
    return tables


# ATorch's DS 3D (atorch 0.2.5 auto/opt_lib/ds_3d_parallel_optimization.py) builds the PipelineModule from an HF
# model's own modules and splits some over the tensor-parallel ranks as its TPInfo says; for Llama (dlrover
# atorch/examples/llama2/ds_3d_llama2.py `get_llama_tpinfo`): q/k/v/gate/up are ColumnParallelLinear (each rank
# holds a block of rows: dim 0), o/down RowParallelLinear (a block of columns: dim 1), embed_tokens a
# VocabParallelEmbedding (a block of rows, the vocabulary padded to a multiple of tp: tensor_parallel/manual_tp.py
# `tp_shard_helper`); atorch/modules/distributed_modules/layers.py `_initialize_affine_weight` cuts them.
# {(file kind, key in the module's state dict): the dim cut}; every other key is whole on every rank.
ATORCH_TP_SPLITS = {
    ("embedding", "weight"): 0,
    **{("layer", f"{m}.weight"): 0 for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "mlp.gate_proj", "mlp.up_proj")},
    **{("layer", f"{m}.weight"): 1 for m in ("self_attn.o_proj", "mlp.down_proj")},
}
