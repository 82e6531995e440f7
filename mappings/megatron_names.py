"""Megatron-LM parameter names <-> canonical names, one table per naming scheme.

Each row: (Megatron key, its transform, the canonical tensors it holds).  In the
Megatron key `{i}` is the layer number LOCAL to its pipeline stage / virtual chunk;
in the canonical names `{i}` is the global layer.  Transforms (`interop.transforms`):
  Copy        one canonical tensor, cut across TP ranks the way its canonical split says
  GroupedQKV  fused q, k, v: per query group [its q heads; k; v], a TP rank holds whole groups
  GatedMLP    SwiGLU's gate and up: each TP rank holds [gate_r; up_r]
  Tied        the last stage's copy of the tied embedding (TIED_HEAD), written, never read
  GroupedExperts  megatron-core's legacy GroupedMLP: ALL of an EP rank's experts in one tensor
        (`weight1` [h, E_local * 2F/tp]: per local expert a [h, 2F/tp] block = its linear_fc1.T;
        `weight2` [E_local * F/tp, h]: per local expert a [F/tp, h] block = its linear_fc2.T)
In MoE keys `{j}` is the LOCAL expert number on its expert-parallel rank, `{e}` the global one
(e = ep_rank * E / EP + j); a routed expert's row belongs to that one EP rank.  A key may have several rows (fc1 with and without a gate): the first row whose
canonical tensors all exist in the model applies; rows whose tensors are absent (a
bias the model lacks, the head of a tied model) are skipped.  Row order is the
module order of Megatron's models, which is also the parameter order its optimizer uses.
"""
from ..adapter import LoraNames
from ..transforms import (Copy, GatedMLP, GroupedExperts, GroupedQKV, KVNopeRows, PlainConcat, QNopeRows, QRopeRows,
                          RowsSplit, VRows, WholeConcat)

_QKV_W = ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]
_QKV_B = ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]

# --qk-layernorm (Qwen3): one [head_dim] norm each for q and k, the same on every TP rank (megatron-core
# SelfAttention builds them after linear_qkv: transformer/attention.py; docs/megatron-layouts.md).  Legacy
# megatron/model has no such norm: a model with them has no place there and is refused.
_QK_NORM = [
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", Copy, ["layers.{i}.attn.q_norm.weight"]),
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", Copy, ["layers.{i}.attn.k_norm.weight"]),
]


# Attention sinks (ModelSpec.attn_sinks): megatron-core's DotProductAttention with softmax_type "learnable" holds a
# `softmax_offset` parameter of its TP rank's heads (transformer/dot_product_attention.py, sharded on axis 0), built
# before linear_proj; Megatron-Bridge maps HF `self_attn.sinks` to `self_attention.core_attention.softmax_offset`
# (models/gpt_oss/gpt_oss_bridge.py).

# Norms on the attention's and the MLP's output (ModelSpec.post_norm): Megatron-Bridge folds each into the row-parallel
# linear before it, as `post_layernorm` (models/olmo2/olmo2_provider.py TERowParallelLinearPostLN, models/gemma/
# gemma2_bridge.py / gemma3_bridge.py: `self_attention.linear_proj.post_layernorm.weight`,
# `mlp.linear_fc2.post_layernorm.weight`).  The legacy model has them as MindSpeed's sandwich norm
# (--use-sandwich-norm; `attn_post_norm`, `ffn_post_norm`: LEGACY_SANDWICH below).
_ATTN_POST_NORM = [
    ("decoder.layers.{i}.self_attention.linear_proj.post_layernorm.weight", Copy, ["layers.{i}.attn_post_norm.weight"]),
    ("decoder.layers.{i}.self_attention.linear_proj.post_layernorm.bias", Copy, ["layers.{i}.attn_post_norm.bias"]),
]
_MLP_POST_NORM = [
    ("decoder.layers.{i}.mlp.linear_fc2.post_layernorm.weight", Copy, ["layers.{i}.mlp_post_norm.weight"]),
    ("decoder.layers.{i}.mlp.linear_fc2.post_layernorm.bias", Copy, ["layers.{i}.mlp_post_norm.bias"]),
]


def _mlp(prefix: str, fc1: str, fc2: str) -> list:
    return [
        (f"{prefix}.{fc1}.weight", GatedMLP, ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
        (f"{prefix}.{fc1}.weight", Copy, ["layers.{i}.mlp.up.weight"]),
        (f"{prefix}.{fc1}.bias", GatedMLP, ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
        (f"{prefix}.{fc1}.bias", Copy, ["layers.{i}.mlp.up.bias"]),
        (f"{prefix}.{fc2}.weight", Copy, ["layers.{i}.mlp.down.weight"]),
        (f"{prefix}.{fc2}.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ]


# A MoE layer's MLP (megatron-core transformer/moe/: router.py TopKRouter, experts.py SequentialMLP /
# GroupedMLP, shared_experts.py SharedExpertMLP), in the state-dict order of a real 0.16.1 model.
# `expert_bias` is the router's persistent buffer (--moe-router-enable-expert-bias); `gate_weight` exists only
# with --moe-shared-expert-gate (docs/megatron-layouts.md section 3).
_EXPERT = ["layers.{i}.mlp.experts.{e}.gate.weight", "layers.{i}.mlp.experts.{e}.up.weight"]
_EXPERT_B = ["layers.{i}.mlp.experts.{e}.gate.bias", "layers.{i}.mlp.experts.{e}.up.bias"]
_SHARED = ["layers.{i}.mlp.shared.gate.weight", "layers.{i}.mlp.shared.up.weight"]
# The router's `bias` (added to its logits) and the experts' biases exist with add_bias_linear (router.py TopKRouter,
# experts' linear_fc1 / linear_fc2): gpt-oss, named so by Megatron-Bridge models/gpt_oss/gpt_oss_bridge.py
# (`mlp.router.bias`, `mlp.experts.linear_fc1.bias*`, `mlp.experts.local_experts.*.linear_fc1.bias`).
ROUTER = [
    ("decoder.layers.{i}.mlp.router.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("decoder.layers.{i}.mlp.router.bias", Copy, ["layers.{i}.mlp.router.bias"]),
    ("decoder.layers.{i}.mlp.router.expert_bias", Copy, ["layers.{i}.mlp.router.expert_bias"]),
]
SHARED_EXPERTS = [
    ("decoder.layers.{i}.mlp.shared_experts.gate_weight", Copy, ["layers.{i}.mlp.shared_gate.weight"]),
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight", GatedMLP, _SHARED),
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight", Copy, ["layers.{i}.mlp.shared.up.weight"]),
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight", Copy, ["layers.{i}.mlp.shared.down.weight"]),
]
# SequentialMLP (no --moe-grouped-gemm): one megatron-core MLP per local expert
SEQUENTIAL_EXPERTS = [
    ("decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight", GatedMLP, _EXPERT),
    ("decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight", Copy, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.bias", GatedMLP, _EXPERT_B),
    ("decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.bias", Copy, ["layers.{i}.mlp.experts.{e}.up.bias"]),
    ("decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight", Copy, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.bias", Copy, ["layers.{i}.mlp.experts.{e}.down.bias"]),
]
# Transformer Engine's TEGroupedMLP (--moe-grouped-gemm with TE): one TE GroupedLinear per fc holding
# `weight0..weight{E_local-1}`, each shaped like SequentialMLP's linear (megatron/core/extensions/
# transformer_engine.py TEGroupedLinear, `_sharded_state_dict_grouped`: `{prefix}weight{gemm_idx}`).
TE_GROUPED_EXPERTS = [
    ("decoder.layers.{i}.mlp.experts.linear_fc1.weight{j}", GatedMLP, _EXPERT),
    ("decoder.layers.{i}.mlp.experts.linear_fc1.weight{j}", Copy, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("decoder.layers.{i}.mlp.experts.linear_fc1.bias{j}", GatedMLP, _EXPERT_B),
    ("decoder.layers.{i}.mlp.experts.linear_fc1.bias{j}", Copy, ["layers.{i}.mlp.experts.{e}.up.bias"]),
    ("decoder.layers.{i}.mlp.experts.linear_fc2.weight{j}", Copy, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("decoder.layers.{i}.mlp.experts.linear_fc2.bias{j}", Copy, ["layers.{i}.mlp.experts.{e}.down.bias"]),
]
# The legacy GroupedMLP (--moe-grouped-gemm without TE, or --moe-use-legacy-grouped-gemm): one tensor per fc
# for all of an EP rank's experts (megatron/core/transformer/moe/experts.py GroupedMLP: weight1 [h, E_l*2F/tp],
# weight2 [E_l*F/tp, h], read as .view(E_l, h, -1) and .view(E_l, -1, h)); the parts repeat per local expert.
LEGACY_GROUPED_EXPERTS = [
    ("decoder.layers.{i}.mlp.experts.weight1", GroupedExperts, _EXPERT),
    ("decoder.layers.{i}.mlp.experts.weight1", GroupedExperts, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("decoder.layers.{i}.mlp.experts.weight2", GroupedExperts, ["layers.{i}.mlp.experts.{e}.down.weight"]),
]
EXPERT_LAYOUTS = {"sequential": SEQUENTIAL_EXPERTS, "te_grouped": TE_GROUPED_EXPERTS, "grouped": LEGACY_GROUPED_EXPERTS}
# torch_dist: every expert implementation stores its experts under SequentialMLP's sharded key, a tensor
# [layers, E, rows, cols] over the GLOBAL expert axis, one chunk per (layer, expert) (gate and up separate
# chunks of fc1): experts.py SequentialMLP.sharded_state_dict / GroupedMLP's ShardedTensorFactory;
# confirmed on real 0.16.1 models (tests/formats/test_moe_megatron.py).
DIST_EXPERT_KEYS = {"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight":
                    "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight":
                    "decoder.layers.mlp.experts.experts.linear_fc2.weight",
                    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.bias":
                    "decoder.layers.mlp.experts.experts.linear_fc1.bias",
                    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.bias":
                    "decoder.layers.mlp.experts.experts.linear_fc2.bias"}


def moe_rows(experts: str = "sequential") -> list:
    return [*ROUTER, *EXPERT_LAYOUTS[experts], *SHARED_EXPERTS]


# megatron-core GPTModel with the local (non Transformer-Engine) layer spec
MCORE = [
    ("embedding.word_embeddings.weight", Copy, ["embed.word.weight"]),
    ("embedding.position_embeddings.weight", Copy, ["embed.position.weight"]),
    ("decoder.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("decoder.layers.{i}.input_layernorm.bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("decoder.layers.{i}.self_attention.core_attention.softmax_offset", Copy, ["layers.{i}.attn.sinks"]),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("decoder.layers.{i}.self_attention.linear_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    *_ATTN_POST_NORM,  # inside linear_proj: right after its weight and bias in the state dict
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", GroupedQKV, _QKV_W),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias", GroupedQKV, _QKV_B),
    *_QK_NORM,
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("decoder.layers.{i}.pre_mlp_layernorm.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    *_mlp("decoder.layers.{i}.mlp", "linear_fc1", "linear_fc2"),
    *_MLP_POST_NORM,
    *moe_rows(),
    ("decoder.final_layernorm.weight", Copy, ["final_norm.weight"]),
    ("decoder.final_layernorm.bias", Copy, ["final_norm.bias"]),
    ("output_layer.weight", Copy, ["lm_head.weight"]),
]

# megatron-core with Transformer Engine: the norms are fused into the following linear
MCORE_TE = [
    ("embedding.word_embeddings.weight", Copy, ["embed.word.weight"]),
    ("embedding.position_embeddings.weight", Copy, ["embed.position.weight"]),
    ("decoder.layers.{i}.self_attention.core_attention.softmax_offset", Copy, ["layers.{i}.attn.sinks"]),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("decoder.layers.{i}.self_attention.linear_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    *_ATTN_POST_NORM,  # inside linear_proj: right after its weight and bias in the state dict
    ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", GroupedQKV, _QKV_W),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias", GroupedQKV, _QKV_B),
    *_QK_NORM,
    # a MoE layer of the TE spec keeps its pre-MLP norm apart (MoE layers have no linear_fc1 to fuse it
    # into): `TE_MOE_NORM` rows apply to MoE layers of such checkpoints, the fused ones to every other layer
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("decoder.layers.{i}.pre_mlp_layernorm.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    *_mlp("decoder.layers.{i}.mlp", "linear_fc1", "linear_fc2"),
    *_MLP_POST_NORM,
    *moe_rows(),
    ("decoder.final_layernorm.weight", Copy, ["final_norm.weight"]),
    ("decoder.final_layernorm.bias", Copy, ["final_norm.bias"]),
    ("output_layer.weight", Copy, ["lm_head.weight"]),
]


def _mla(te: bool) -> list:
    """Multi-latent attention (DeepSeek-V2/V3) as megatron-core names it, in its state-dict order
    (transformer/multi_latent_attention.py MLASelfAttention; models/gpt/gpt_layer_specs.py with
    multi_latent_attention=True and --qk-layernorm, which builds the compression norms):
    - the local spec: `input_layernorm`, `linear_proj`, `linear_q_proj` (no q compression) or `linear_q_down_proj`
      + `linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`, then `q_layernorm` and `kv_layernorm`; every
      linear a ColumnParallelLinear, so the two down projections are cut on their rows over TP (`RowsSplit`);
    - the Transformer Engine spec: the input norm stays apart (TENorm), the down projections are TELinear
      (parallel_mode 'duplicated': whole on every rank) and the compression norms are fused into the up projections
      (TELayerNormColumnParallelLinear `layer_norm_weight`, registered before its `weight`).
    Each head's q rows are its qk_head_dim (nope) part then its qk_pos_emb_head_dim (rope) part, kv_up's its k_nope
    rows then its v rows, kv_down's rows the latent then the shared rope key: the canonical layouts (interop/params.py
    mla_rows).  Confirmed on a real 0.16.1 local-spec model (tests/helpers/mcore_mla.py)."""
    a, down = "decoder.layers.{i}.self_attention.", Copy if te else RowsSplit
    q_norm, kv_norm = ["layers.{i}.attn.q_down_norm.weight"], ["layers.{i}.attn.kv_down_norm.weight"]
    rows = [
        ("decoder.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
        (a + "linear_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
        (a + "linear_q_proj.weight", Copy, ["layers.{i}.attn.q.weight"]),
        (a + "linear_q_down_proj.weight", down, ["layers.{i}.attn.q_down.weight"]),
        *([(a + "linear_q_up_proj.layer_norm_weight", Copy, q_norm)] if te else []),
        (a + "linear_q_up_proj.weight", Copy, ["layers.{i}.attn.q_up.weight"]),
        (a + "linear_kv_down_proj.weight", down, ["layers.{i}.attn.kv_down.weight"]),
        *([(a + "linear_kv_up_proj.layer_norm_weight", Copy, kv_norm)] if te else []),
        (a + "linear_kv_up_proj.weight", Copy, ["layers.{i}.attn.kv_up.weight"]),
    ]
    return rows if te else rows + [(a + "q_layernorm.weight", Copy, q_norm), (a + "kv_layernorm.weight", Copy, kv_norm)]


def mtp_rows(table: list) -> list:
    """megatron-core's multi-token prediction modules (transformer/multi_token_prediction.py
    MultiTokenPredictionLayer, on the last pipeline stage): `mtp.layers.{k}.enorm` (the next token's embedding),
    `hnorm` (the hidden state), `eh_proj` ([h, 2h] over [enorm(embedding); hnorm(hidden)], a column-parallel
    linear: its h output rows cut over TP), the decoder layer under `transformer_layer.` (the last decoder layer's
    spec: `table`'s layer rows) and `final_layernorm`; embedding and output head are the model's own.  torch_dist
    keeps these keys, module numbers included (MultiTokenPredictionBlock.sharded_state_dict).  MindFormers'
    mcore-style GPTModel names its MTP modules alike (parallel_core/training_graph/transformer/
    multi_token_prediction.py; its deepseek3 built on CPU)."""
    layer = "decoder.layers.{i}."
    rows = [("mtp.layers.{k}.enorm.weight", Copy, ["mtp.{k}.enorm.weight"]),
            ("mtp.layers.{k}.hnorm.weight", Copy, ["mtp.{k}.hnorm.weight"]),
            ("mtp.layers.{k}.eh_proj.weight", Copy, ["mtp.{k}.eh_proj.weight"])]
    rows += [(MTP_LAYER + key[len(layer):], transform, [p.replace("layers.{i}.", "mtp.{k}.layer.") for p in parts])
             for key, transform, parts in table if key.startswith(layer)]
    return rows + [("mtp.layers.{k}.final_layernorm.weight", Copy, ["mtp.{k}.final_norm.weight"])]


MTP_LAYER = "mtp.layers.{k}.transformer_layer."


# MindSpeed-LLM's multi-latent attention, as its converter writes it (Ascend/MindSpeed-LLM
# mindspeed_llm/tasks/checkpoint/convert_hf2mg.py set_model_layer_attn, model_builder.py MegatronModel names, at
# c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91; torch format): `linear_qkv` = [q_a; kv_a] (q_down then kv_down; without
# query compression [q_proj; kv_a]) whole on every TP rank (`WholeConcat`), `linear_q_up_proj` / `linear_kv_up_proj` cut by heads,
# `q_layernorm` / `kv_layernorm` the compression norms.  Its converter before 2025-07-23 (MindSpeed-LLM 1050caf3
# "update keys about mla of V3 ckpt"; examples/mcore/deepseek3/convert_ckpt_deepseek3.py) named the up projections
# `linear_qb` / `linear_kvb` and the latent's norm `k_layernorm`: read as the scheme `mindspeed_llm_qb`.
_MS = "decoder.layers.{i}.self_attention."


def _mindspeed_llm_mla(q_up: str, kv_up: str, kv_norm: str) -> list:
    return [
        ("decoder.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
        (_MS + "linear_qkv.weight", WholeConcat, ["layers.{i}.attn.q_down.weight", "layers.{i}.attn.kv_down.weight"]),
        (_MS + "linear_qkv.weight", WholeConcat, ["layers.{i}.attn.q.weight", "layers.{i}.attn.kv_down.weight"]),
        (_MS + "linear_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
        (_MS + "q_layernorm.weight", Copy, ["layers.{i}.attn.q_down_norm.weight"]),
        (_MS + kv_norm + ".weight", Copy, ["layers.{i}.attn.kv_down_norm.weight"]),
        (_MS + q_up + ".weight", Copy, ["layers.{i}.attn.q_up.weight"]),
        (_MS + kv_up + ".weight", Copy, ["layers.{i}.attn.kv_up.weight"]),
    ]


MINDSPEED_LLM_MLA = _mindspeed_llm_mla("linear_q_up_proj", "linear_kv_up_proj", "kv_layernorm")
MINDSPEED_LLM_QB_MLA = _mindspeed_llm_mla("linear_qb", "linear_kvb", "k_layernorm")
# --mla-mm-split (convert_hf2mg.py set_model_layer_attn with mla_mm_split; model_builder.py names): the up projections
# stored as bands of each head's rows, `linear_qk_nope` / `linear_qk_rope` of q_up and `linear_kv_nope` / `linear_v`
# of kv_up, each cut by heads over tp (`HeadRows`); written after the norms, in that order
MINDSPEED_LLM_MM_MLA = [row for row in MINDSPEED_LLM_MLA if not row[0].endswith(("_up_proj.weight",))] + [
    (_MS + "linear_qk_nope.weight", QNopeRows, ["layers.{i}.attn.q_up.weight"]),
    (_MS + "linear_qk_rope.weight", QRopeRows, ["layers.{i}.attn.q_up.weight"]),
    (_MS + "linear_kv_nope.weight", KVNopeRows, ["layers.{i}.attn.kv_up.weight"]),
    (_MS + "linear_v.weight", VRows, ["layers.{i}.attn.kv_up.weight"]),
]
# ... and its MTP modules' names where megatron-core's differ (convert_hf2mg.py set_model_postprocess /
# set_mtp_postprocess, model_builder.py `mtp_final_layernorms` / `mtp_post_norm`: with MTP the model's final norm is
# `final_layernorm.weight`, each module's `mtp.final_layernorms.{k}.weight`)
_MINDSPEED_LLM_MTP = {"decoder.final_layernorm.weight": "final_layernorm.weight",
                      "mtp.layers.{k}.final_layernorm.weight": "mtp.final_layernorms.{k}.weight"}
MTP_RENAMES = {"mindspeed_llm": _MINDSPEED_LLM_MTP, "mindspeed_llm_qb": _MINDSPEED_LLM_MTP,
               "mindspeed_llm_mm": _MINDSPEED_LLM_MTP}
# The order its converter fills a rank's state dict in (convert_hf2mg.py run(): set_model_preprocess, then per MTP
# module set_mtp_preprocess (enorm, hnorm, eh_proj, the embedding copy), its layer, set_mtp_postprocess, then the
# decoder layers (set_model_layer_norm, _attn, _mlp), then set_model_postprocess); a layer's keys in this order:
MINDSPEED_LLM_LAYER_ORDER = (
    "input_layernorm.", "pre_mlp_layernorm.", "self_attention.linear_qkv.", "self_attention.linear_proj.",
    "self_attention.q_layernorm.", "self_attention.kv_layernorm.", "self_attention.k_layernorm.",
    "self_attention.linear_q_up_proj.", "self_attention.linear_kv_up_proj.", "self_attention.linear_qk_nope.",
    "self_attention.linear_qk_rope.", "self_attention.linear_kv_nope.", "self_attention.linear_v.",
    "mlp.linear_fc1.", "mlp.linear_fc2.",
    "mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.linear_fc1.", "mlp.shared_experts.linear_fc2.",
    "mlp.experts.weight1", "mlp.experts.weight2")
MINDSPEED_LLM_MTP_ORDER = ("enorm.", "hnorm.", "eh_proj.")
# Its converter's args namespace (convert_hf2mg.py __parameter_packaging: the HF config.json's scalar fields, its
# model_cfg.json fields and the converter's own, such as these): not Megatron's arguments, and without the config's
# dict fields (rope scaling), so such a checkpoint is read with --model-config.
MINDSPEED_LLM_CONVERTER_ARGS = ("model_type_hf", "load_model_type")
# ... and the args of its layouts not read (yet): set (truthy) in a checkpoint's args, refused in one line.
MINDSPEED_LLM_UNREAD_ARGS = {
    "moe_tp_extend_ep": "MindSpeed-LLM's --moe-tp-extend-ep layout (experts over ep x tp, not cut by tp) is not read",
    "schedules_method": "MindSpeed-LLM's --schedules-method dualpipev layout (layers folded over the stages) is "
                        "not read",
}
# Its layouts not read (yet), each refused in one line naming the flag that made it (convert_hf2mg.py).
MINDSPEED_LLM_UNREAD: dict = {}


def _mla_table(table: list, attention_rows: list) -> list:
    """`table` with its attention rows (and the fused input norm) replaced by `attention_rows`."""
    attention = ("self_attention.", "input_layernorm.")
    out = []
    for row in table:
        key = row[0]
        if key.startswith("decoder.layers.{i}.") and key[len("decoder.layers.{i}."):].startswith(attention):
            if key.endswith("self_attention.linear_proj.weight"):
                out += attention_rows
            continue
        out.append(row)
    return out


def with_mtp(table: list, scheme: str = "mcore") -> list:
    """`table` with the MTP modules between the final norm and the output layer (megatron-core's GPTModel
    state-dict order), their decoder layer named as `table`'s layers (`MTP_RENAMES`: a scheme's own names)."""
    at = next(n for n, row in enumerate(table) if row[0] == "output_layer.weight")
    renames = MTP_RENAMES.get(scheme, {})
    return [(renames.get(key, key), t, parts) for key, t, parts in table[:at] + mtp_rows(table) + table[at:]]


# legacy megatron/model (nested dicts under `model`, flattened here with dots)
LEGACY = [
    ("language_model.embedding.word_embeddings.weight", Copy, ["embed.word.weight"]),
    ("language_model.embedding.position_embeddings.weight", Copy, ["embed.position.weight"]),
    ("language_model.encoder.layers.{i}.input_norm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("language_model.encoder.layers.{i}.input_norm.bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("language_model.encoder.layers.{i}.self_attention.query_key_value.weight", GroupedQKV, _QKV_W),
    ("language_model.encoder.layers.{i}.self_attention.query_key_value.bias", GroupedQKV, _QKV_B),
    ("language_model.encoder.layers.{i}.self_attention.dense.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("language_model.encoder.layers.{i}.self_attention.dense.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("language_model.encoder.layers.{i}.post_attention_norm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("language_model.encoder.layers.{i}.post_attention_norm.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    *_mlp("language_model.encoder.layers.{i}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
    ("language_model.encoder.final_norm.weight", Copy, ["final_norm.weight"]),
    ("language_model.encoder.final_norm.bias", Copy, ["final_norm.bias"]),
    ("language_model.output_layer.weight", Copy, ["lm_head.weight"]),
]
# The sandwich norm of the legacy model as MindSpeed-Core-MS patches Megatron for PanGu (tools/rules/line_rules.py
# at 5c4f1310, LINE_RULES_megatron["megatron/legacy/model/transformer.py"]: with args.use_sandwich_norm the layer
# builds `attn_post_norm` after `input_norm` and `ffn_post_norm` after `post_attention_norm`, each applied to its
# branch's output before the residual add); the same names as MindSpeed-Core-MS's own legacy model.
LEGACY_SANDWICH = [
    ("language_model.encoder.layers.{i}.attn_post_norm.weight", Copy, ["layers.{i}.attn_post_norm.weight"]),
    ("language_model.encoder.layers.{i}.attn_post_norm.bias", Copy, ["layers.{i}.attn_post_norm.bias"]),
    ("language_model.encoder.layers.{i}.ffn_post_norm.weight", Copy, ["layers.{i}.mlp_post_norm.weight"]),
    ("language_model.encoder.layers.{i}.ffn_post_norm.bias", Copy, ["layers.{i}.mlp_post_norm.bias"]),
]
LEGACY += LEGACY_SANDWICH

# The TE spec's separate pre-MLP norm of MoE layers, and the fused one it replaces there
# (megatron/core/models/gpt/gpt_layer_specs.py: a MoE layer's `pre_mlp_layernorm` is TENorm; docs/megatron-layouts.md s.4).
# megatron-core's local spec renames its pre_mlp_layernorm to the fused name in torch_dist, MoE layers too.
TE_MOE_NORM = {"decoder.layers.{i}.pre_mlp_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.bias"}
TE_FUSED_MLP_NORM = {"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", "decoder.layers.{i}.mlp.linear_fc1.layer_norm_bias"}

TABLES = {"mcore": MCORE, "mcore_te": MCORE_TE, "legacy": LEGACY, "mindspeed_llm": MCORE, "mindspeed_llm_qb": MCORE,
          "mindspeed_llm_mm": MCORE}
# A multi-latent-attention model's tables (its attention rows and MTP modules; the legacy model has neither).
# megatron-core's local spec gives MLA layers no sharded_state_dict_keys_map, so its torch_dist keys are its
# state-dict names (`input_layernorm`, `pre_mlp_layernorm`, `q_layernorm`), not the Transformer Engine ones
# (models/gpt/gpt_layer_specs.py get_gpt_layer_local_spec: the map is on the non-MLA branch only).
MLA_TABLES = {"mcore": _mla_table(MCORE, _mla(te=False)), "mcore_te": _mla_table(MCORE_TE, _mla(te=True)),
              "mindspeed_llm": _mla_table(MCORE, MINDSPEED_LLM_MLA),
              "mindspeed_llm_qb": _mla_table(MCORE, MINDSPEED_LLM_QB_MLA),
              "mindspeed_llm_mm": _mla_table(MCORE, MINDSPEED_LLM_MM_MLA)}

# Older legacy spellings, renamed component by component before a key is matched.
LEGACY_ALIASES = {
    "transformer": "encoder",
    "attention": "self_attention",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attention_norm",
    "final_layernorm": "final_norm",
}

# The last pipeline stage's copy of the tied input embedding (pp > 1): Megatron keeps it in
# sync by an all-reduce, so it equals embed.word.weight and is written, never read back.
TIED_HEAD = {"mcore": "output_layer.weight", "mcore_te": "output_layer.weight", "mindspeed_llm": "output_layer.weight",
             "mindspeed_llm_qb": "output_layer.weight", "legacy": "word_embeddings_for_head.weight"}

# Modules that carry an `_extra_state` entry in a megatron-core state dict (None for the
# local spec); Megatron's strict load expects them, so the writer puts them back.
EXTRA_STATE_MODULES = [
    "decoder.layers.{i}.self_attention.linear_proj",
    "decoder.layers.{i}.self_attention.linear_qkv",
    "decoder.layers.{i}.mlp.linear_fc1",
    "decoder.layers.{i}.mlp.linear_fc2",
    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1",
    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2",
    "decoder.layers.{i}.mlp.shared_experts.linear_fc1",
    "decoder.layers.{i}.mlp.shared_experts.linear_fc2",
    "decoder.layers.{i}.self_attention.linear_q_proj",
    "decoder.layers.{i}.self_attention.linear_q_down_proj",
    "decoder.layers.{i}.self_attention.linear_q_up_proj",
    "decoder.layers.{i}.self_attention.linear_kv_down_proj",
    "decoder.layers.{i}.self_attention.linear_kv_up_proj",
    "mtp.layers.{k}.eh_proj",
    "output_layer",
]
# ... and the same linears of an MTP module's decoder layer (`{k}`: the module)
EXTRA_STATE_MODULES += [MTP_LAYER + m[len("decoder.layers.{i}."):] for m in EXTRA_STATE_MODULES
                        if m.startswith("decoder.layers.{i}.")]

# Entries that are not weights: dropped, with the reason reported.
IGNORED_SUFFIXES = {
    "._extra_state": "_extra_state holding Transformer Engine / fp8 metadata, not weights (TE rebuilds it)",
    "_extra_state": "_extra_state holding Transformer Engine / fp8 metadata, not weights (TE rebuilds it)",
    ".inv_freq": "rotary frequency buffer, recomputed from the rotary base",
}


def scheme_of(keys) -> str | None:
    """Which table a state dict's (flattened) keys follow."""
    keys = list(keys)
    if any(k.startswith("language_model.") for k in keys):
        return "legacy"
    if any(k.endswith(("linear_qkv.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight")) for k in keys):
        return "mcore_te"
    if any(k.endswith((".self_attention.linear_qb.weight", ".self_attention.linear_kvb.weight")) for k in keys):
        return "mindspeed_llm_qb"
    if any(k.endswith(".self_attention.linear_qkv.weight") for k in keys) and \
            any(k.endswith(".self_attention.linear_kv_nope.weight") for k in keys):
        return "mindspeed_llm_mm"  # its --mla-mm-split: the up projections as bands of each head's rows
    if any(k.endswith(".self_attention.linear_qkv.weight") for k in keys) and \
            any(k.endswith(".self_attention.linear_kv_up_proj.weight") for k in keys):
        return "mindspeed_llm"  # MLA's down projections fused in linear_qkv: MindSpeed-LLM's, not megatron-core's
    if any(k.startswith(("decoder.", "embedding.", "output_layer.")) for k in keys):
        return "mcore"
    return None


# LoRA adapters as MindSpeed-LLM saves them (peft's LoraParallelLinear around megatron-core's linears: the adapter
# name `default` kept; mindspeed_llm/tasks/checkpoint/convert_mg2hf.py reads
# `decoder.layers.{i}.self_attention.linear_qkv.lora_A.default.weight`), and the args that state the adapter
# (mindspeed_llm/features_manager/finetune/lora.py: --lora-r, --lora-alpha, --lora-target-modules; no dropout
# flag: `lora_dropout` is interop's, kept for a round trip).
LORA_NAMES = LoraNames(".lora_A.default.weight", ".lora_B.default.weight")
LORA_ARGS = {"rank": "lora_r", "alpha": "lora_alpha", "dropout": "lora_dropout"}
# Megatron-Bridge's PEFT (src/megatron/bridge/peft/adapter_wrapper.py puts the adapter under `<module>.adapter.`,
# utils.py ParallelLinearAdapter names its two linears `linear_in` (A) and `linear_out` (B)), in torch_dist.
BRIDGE_LORA_NAMES = LoraNames(".adapter.linear_in.weight", ".adapter.linear_out.weight")
