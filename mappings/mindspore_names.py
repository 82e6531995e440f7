"""MindSpore parameter names <-> canonical names, one table per dialect and architecture.

Each row: (MindSpore name, its transform, the canonical tensors it holds, in order).
Transforms (`interop.transforms`):
  Copy         one canonical tensor as it is
  Transpose    one canonical tensor stored transposed ([in, out], MindFormers GPT2 linears)
  GroupedQKV   q, k, v fused per KV group: each group's q heads, then its k, then its v
  GatedMLP     Megatron-style fc1: each TP rank holds [gate_r; up_r]
  Interleave   MindFormers w_gate_hidden: gate and up rows interleaved g0, u0, g1, u1, ...
  PlainConcat  MindFormers r1.3's [q; k; v] / [gate; up] (PLAIN_LAYOUT below)
  Stack        experts' tensors stacked on a new first axis (MindFormers Llama MoE)
  ExpertRows   experts' transposed matrices stacked as rows (MindFormers mcore-style weight1 / weight2)
  WholeConcat / WholeCopy / WholeInterleave   as PlainConcat / Copy / Interleave, whole on every TP rank
`{i}` is the GLOBAL layer number.  A row whose canonical tensors are absent from the
model is skipped, and the first row that claims a MindSpore name wins (so a gated
`mapping` row comes before the plain one).
"""
from ..adapter import LoraNames
from ..transforms import Copy, GatedMLP, GroupedQKV, Interleave, PlainConcat, Stack, Transpose, WholeConcat
from ..transforms.whole import WholeCopy, WholeInterleave
from ..transforms.expert_rows import ExpertRows

# MindSpeed-Core-MS: Megatron's legacy names, with its renames (dense_h_to_4h -> mapping, ...).
MINDSPEED = [
    ("language_model.embedding.word_embeddings.weight", Copy, ["embed.word.weight"]),
    ("language_model.embedding.position_embeddings.weight", Copy, ["embed.position.weight"]),
    ("language_model.encoder.layers.{i}.input_norm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("language_model.encoder.layers.{i}.input_norm.bias", Copy, ["layers.{i}.attn_norm.bias"]),
    ("language_model.encoder.layers.{i}.attention.qkv_proj.weight", GroupedQKV,
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("language_model.encoder.layers.{i}.attention.qkv_proj.bias", GroupedQKV,
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("language_model.encoder.layers.{i}.attention.out_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("language_model.encoder.layers.{i}.attention.out_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("language_model.encoder.layers.{i}.post_attention_norm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("language_model.encoder.layers.{i}.post_attention_norm.bias", Copy, ["layers.{i}.mlp_norm.bias"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.weight", GatedMLP,
     ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.bias", GatedMLP,
     ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.weight", Copy, ["layers.{i}.mlp.up.weight"]),
    ("language_model.encoder.layers.{i}.mlp.mapping.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("language_model.encoder.layers.{i}.mlp.projection.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("language_model.encoder.layers.{i}.mlp.projection.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("language_model.encoder.final_norm.weight", Copy, ["final_norm.weight"]),
    ("language_model.encoder.final_norm.bias", Copy, ["final_norm.bias"]),
    ("language_model.output_layer.weight", Copy, ["lm_head.weight"]),
    # use_sandwich_norm (ModelSpec pre_norm + post_norm): mindspeed_ms/legacy/model/transformer.py at
    # MindSpeed-Core-MS 3a86578 ParallelTransformerLayer builds `attn_post_norm` and `ffn_post_norm`
    # (get_norm(config, config.attn_post_norm_scale / ffn_post_norm_scale)); convert_pt2ckpt.py keeps the names.
    ("language_model.encoder.layers.{i}.attn_post_norm.weight", Copy, ["layers.{i}.attn_post_norm.weight"]),
    ("language_model.encoder.layers.{i}.attn_post_norm.bias", Copy, ["layers.{i}.attn_post_norm.bias"]),
    ("language_model.encoder.layers.{i}.ffn_post_norm.weight", Copy, ["layers.{i}.mlp_post_norm.weight"]),
    ("language_model.encoder.layers.{i}.ffn_post_norm.bias", Copy, ["layers.{i}.mlp_post_norm.bias"]),
]
# The tied head's copy on the last pipeline stage.  MindSpeed-Core-MS r0.1.0's model holds it as
# `language_model.output_layer.weight` (mindspeed_ms/legacy/model/language_model.py builds output_layer
# when `untie_embeddings_and_output_weights or pipeline_parallel`; module.py initialize_word_embeddings
# all-reduces it from the embedding), so that name is written.  convert_pt2ckpt.py passes Megatron's
# `word_embeddings_for_head.weight` through unrenamed: read, never written.
MINDSPEED_TIED_HEAD = "language_model.output_layer.weight"
MEGATRON_TIED_HEAD = "word_embeddings_for_head.weight"

# Names MindSpeed-Core-MS r0.1.0's model gives parameters where convert_pt2ckpt.py keeps Megatron's:
# its LayerNorm (mindspeed_ms/legacy/model/norm.py) holds `gamma` / `beta`; its position embedding is a
# mindspore nn.Embedding (`embedding_table`) unless parallel_position_embedding (default False,
# mindspeed_ms/core/config.py) makes it a VocabParallelEmbedding (`weight`).  Written with the model's
# names; either name is read.
MINDSPEED_LAYERNORM_NORMS = (".input_norm.", ".post_attention_norm.", ".final_norm.", ".attn_post_norm.",
                             ".ffn_post_norm.")
MINDSPEED_LAYERNORM_PARAMS = {"weight": "gamma", "bias": "beta"}
MINDSPEED_MODEL_RENAMES = {
    "language_model.embedding.position_embeddings.weight": "language_model.embedding.position_embeddings.embedding_table",
}

# MindFormers Llama: separate q/k/v and gate/down/up (w1 = gate, w2 = down, w3 = up), no transposes.
_LLAMA_COMMON = [
    ("model.tok_embeddings.embedding_weight", Copy, ["embed.word.weight"]),
    ("model.layers.{i}.attention_norm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("model.layers.{i}.attention.wo.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("model.layers.{i}.attention.wo.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("model.layers.{i}.ffn_norm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("model.layers.{i}.feed_forward.w2.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("model.layers.{i}.feed_forward.w2.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("model.norm_out.weight", Copy, ["final_norm.weight"]),
    ("lm_head.weight", Copy, ["lm_head.weight"]),
]
MINDFORMERS_LLAMA = _LLAMA_COMMON + [
    ("model.layers.{i}.attention.wq.weight", Copy, ["layers.{i}.attn.q.weight"]),
    ("model.layers.{i}.attention.wq.bias", Copy, ["layers.{i}.attn.q.bias"]),
    ("model.layers.{i}.attention.wk.weight", Copy, ["layers.{i}.attn.k.weight"]),
    ("model.layers.{i}.attention.wk.bias", Copy, ["layers.{i}.attn.k.bias"]),
    ("model.layers.{i}.attention.wv.weight", Copy, ["layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.attention.wv.bias", Copy, ["layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.feed_forward.w1.weight", Copy, ["layers.{i}.mlp.gate.weight"]),
    ("model.layers.{i}.feed_forward.w1.bias", Copy, ["layers.{i}.mlp.gate.bias"]),
    ("model.layers.{i}.feed_forward.w3.weight", Copy, ["layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.feed_forward.w3.bias", Copy, ["layers.{i}.mlp.up.bias"]),
]
# Where model_parallel does not divide the vocabulary, MindFormers' legacy Llama keeps its embedding and its lm_head
# whole on every rank (models/llama/llama_layer.py LlamaEmbedding.shard: gather ((1, 1), ...) when vocab %
# (mp * cp) != 0; llama.py: lm_head.shard ((dp * cp, 1), (1, 1)) when vocab % mp != 0), whatever vocab_emb_dp says.
MINDFORMERS_LLAMA_VOCAB_WHOLE = {"model.tok_embeddings.embedding_weight": WholeCopy, "lm_head.weight": WholeCopy}
# With `qkv_concat`: one w_qkv per layer (grouped per KV group) and one w_gate_hidden.
MINDFORMERS_LLAMA_CONCAT = _LLAMA_COMMON + [
    ("model.layers.{i}.attention.w_qkv.weight", GroupedQKV,
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("model.layers.{i}.attention.w_qkv.bias", GroupedQKV,
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("model.layers.{i}.feed_forward.w_gate_hidden.weight", Interleave,
     ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
    ("model.layers.{i}.feed_forward.w_gate_hidden.bias", Interleave,
     ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
]

# MindFormers GPT2 (backbone + tied head): attention dense1/2/3 are q/k/v as [out, in];
# the attention projection and the FeedForward mapping/projection are [in, out].
MINDFORMERS_GPT2 = [
    ("backbone.embedding.word_embedding.embedding_table", Copy, ["embed.word.weight"]),
    ("backbone.embedding.position_embedding.embedding_table", Copy, ["embed.position.weight"]),
    ("backbone.blocks.{i}.layernorm1.gamma", Copy, ["layers.{i}.attn_norm.weight"]),
    ("backbone.blocks.{i}.layernorm1.beta", Copy, ["layers.{i}.attn_norm.bias"]),
    ("backbone.blocks.{i}.attention.dense1.weight", Copy, ["layers.{i}.attn.q.weight"]),
    ("backbone.blocks.{i}.attention.dense1.bias", Copy, ["layers.{i}.attn.q.bias"]),
    ("backbone.blocks.{i}.attention.dense2.weight", Copy, ["layers.{i}.attn.k.weight"]),
    ("backbone.blocks.{i}.attention.dense2.bias", Copy, ["layers.{i}.attn.k.bias"]),
    ("backbone.blocks.{i}.attention.dense3.weight", Copy, ["layers.{i}.attn.v.weight"]),
    ("backbone.blocks.{i}.attention.dense3.bias", Copy, ["layers.{i}.attn.v.bias"]),
    ("backbone.blocks.{i}.attention.projection.weight", Transpose, ["layers.{i}.attn.o.weight"]),
    ("backbone.blocks.{i}.attention.projection.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("backbone.blocks.{i}.layernorm2.gamma", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("backbone.blocks.{i}.layernorm2.beta", Copy, ["layers.{i}.mlp_norm.bias"]),
    ("backbone.blocks.{i}.output.mapping.weight", Transpose, ["layers.{i}.mlp.up.weight"]),
    ("backbone.blocks.{i}.output.mapping.bias", Copy, ["layers.{i}.mlp.up.bias"]),
    ("backbone.blocks.{i}.output.projection.weight", Transpose, ["layers.{i}.mlp.down.weight"]),
    ("backbone.blocks.{i}.output.projection.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("backbone.layernorm.gamma", Copy, ["final_norm.weight"]),
    ("backbone.layernorm.beta", Copy, ["final_norm.bias"]),
    ("head.weight", Copy, ["lm_head.weight"]),
]

# MindFormers qkv_concat layouts by release (same names and shapes: the file cannot tell them apart):
#   plain    r1.3.0 / r1.3.1: w_qkv = [q; k; v], w_gate_hidden = [gate; up], bias [q; k; v]
#            (mindformers/models/llama/convert_weight.py np.concatenate; llama_transformer.py splits
#            (hidden, kv_dim, kv_dim); llama_layer.py splits (hidden_dim, hidden_dim)).
#   grouped  r1.5.0 and later (2.1.0 included): w_qkv per KV group [q_g; k_g; v_g], w_gate_hidden rows
#            interleaved (convert_utils.qkv_concat_hf2mg / ffn_concat_hf2mg; the model reshapes to
#            (n_kv_head, (n_rep + 2) * head_dim) and (hidden_dim, 2)).  The model's fused bias follows the
#            weight (grouped), but convert_weight.py joins the biases plainly: `--qkv-bias-layout plain`.
QKV_LAYOUTS = ("grouped", "plain")
PLAIN_LAYOUT = {GroupedQKV: PlainConcat, Interleave: PlainConcat}  # the "plain" layout's transforms

# MindFormers' mcore-style models (mindformers/parallel_core/, the `use_legacy: False` models: qwen3, qwen3_moe,
# deepseek3, ...; read off MindFormers 2.1.0's TrainingQwen3ForCausalLM / TrainingQwen3MoeForCausalLM built on CPU,
# whose GPTModel is `self.model` with auto_prefix=False, so the saved names have no `model.` prefix).
# Fused layouts are the TransformerConfig defaults: use_contiguous_weight_layout_attention=False -> linear_qkv
# grouped per KV group (checkpoint/converter/convert_op.py QKVConvertOp); use_interleaved_weight_layout_mlp=True ->
# linear_fc1 rows interleaved gate, up (transformer/mlp.py MLPInterleaved; ConcatConvertOp interleaved).
MINDFORMERS_MCORE = [
    ("embedding.word_embeddings.weight", Copy, ["embed.word.weight"]),
    ("decoder.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", GroupedQKV,
     ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias", GroupedQKV,
     ["layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"]),
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", Copy, ["layers.{i}.attn.q_norm.weight"]),
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", Copy, ["layers.{i}.attn.k_norm.weight"]),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    ("decoder.layers.{i}.self_attention.linear_proj.bias", Copy, ["layers.{i}.attn.o.bias"]),
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", Copy, ["layers.{i}.mlp_norm.weight"]),
    ("decoder.layers.{i}.mlp.linear_fc1.weight", Interleave, ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
    ("decoder.layers.{i}.mlp.linear_fc1.bias", Interleave, ["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"]),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", Copy, ["layers.{i}.mlp.down.weight"]),
    ("decoder.layers.{i}.mlp.linear_fc2.bias", Copy, ["layers.{i}.mlp.down.bias"]),
    ("decoder.final_layernorm.weight", Copy, ["final_norm.weight"]),
    ("output_layer.weight", Copy, ["lm_head.weight"]),
]
# Multi-latent attention as MindFormers 2.1.0's deepseek3 builds it by default (mla_qkv_concat=True:
# parallel_core/training_graph/transformer/multi_latent_attention.py MLASelfAttentionConcatenated, "the same structure
# as MindSpeed"): `linear_qkv` = [q_down; kv_down] (or [q; kv_down] without q compression), split as
# (q_lora_rank, kv_lora_rank, qk_pos_emb_head_dim) after the projection; `linear_qb` = q_up, `linear_kvb` = kv_up;
# `q_layernorm` / `k_layernorm` the compression norms (with qk_layernorm: True); the rope part rotated as interleaved
# pairs like megatron-core's (rope_utils.py multi_latent_attention), so HF's rows are copied as they are.  Read off
# TrainingDeepseekV3ForCausalLM built on CPU (tests/formats/test_mindformers_mla.py).  Over tp
# (base_models/gpt/gpt_layer_specs.py): linear_qkv is a SequenceParallelLinear, whole on every rank (its q part too,
# without q compression), linear_qb / linear_kvb ColumnParallelLinear (cut by heads), linear_proj RowParallelLinear;
# each one's sharded_state_dict states it (tests/formats/test_mindformers_mla_tp.py).
_MF_ATTN = "decoder.layers.{i}.self_attention."
MINDFORMERS_MCORE_MLA_ATTENTION = [
    ("decoder.layers.{i}.input_layernorm.weight", Copy, ["layers.{i}.attn_norm.weight"]),
    (_MF_ATTN + "linear_proj.weight", Copy, ["layers.{i}.attn.o.weight"]),
    (_MF_ATTN + "q_layernorm.weight", Copy, ["layers.{i}.attn.q_down_norm.weight"]),
    (_MF_ATTN + "linear_qb.weight", Copy, ["layers.{i}.attn.q_up.weight"]),
    (_MF_ATTN + "linear_qkv.weight", WholeConcat, ["layers.{i}.attn.q_down.weight", "layers.{i}.attn.kv_down.weight"]),
    (_MF_ATTN + "linear_qkv.weight", WholeConcat, ["layers.{i}.attn.q.weight", "layers.{i}.attn.kv_down.weight"]),
    (_MF_ATTN + "k_layernorm.weight", Copy, ["layers.{i}.attn.kv_down_norm.weight"]),
    (_MF_ATTN + "linear_kvb.weight", Copy, ["layers.{i}.attn.kv_up.weight"]),
]
# ... and with mla_qkv_concat=False (megatron-core's names): names that mark it; such a checkpoint is refused.
MINDFORMERS_MCORE_MLA_MARKERS = (".self_attention.linear_q_down_proj.", ".self_attention.linear_kv_down_proj.",
                                 ".self_attention.linear_q_proj.", ".self_attention.linear_kv_up_proj.")

# The MTP module's eh_proj, whole on every TP rank in MindFormers (multi_token_prediction.py builds it a
# SequenceParallelLinear; megatron-core cuts it by rows): {its name: its transform there}.
MINDFORMERS_MCORE_MTP_WHOLE = {"mtp.layers.{k}.eh_proj.weight": WholeCopy}

# The word embedding where tp does not divide its rows: MindFormers 2.1.0's VocabParallelEmbedding
# (parallel_core/training_graph/tensor_parallel/layers.py) sets enable_embedding_tp = tp > 1 and
# num_embeddings % tp == 0, and otherwise shards it layout("None", "None") and states axis_fragmentations (1, 1):
# whole and unpadded on every rank.  Its output_layer is a ColumnParallelLinear, always cut over tp (layout("tp",
# "None")), so an untied head of such rows has no layout there (`Dialect.rows` refuses it).
MINDFORMERS_MCORE_VOCAB_WHOLE = {"embedding.word_embeddings.weight": WholeCopy}
MINDFORMERS_MCORE_HEAD = "output_layer.weight"

MINDFORMERS_MCORE_MLA = [row for row in MINDFORMERS_MCORE if not row[0].startswith(
    ("decoder.layers.{i}.self_attention.", "decoder.layers.{i}.input_layernorm."))]
MINDFORMERS_MCORE_MLA[1:1] = MINDFORMERS_MCORE_MLA_ATTENTION

# (dialect, arch, qkv_concat) -> table
TABLES = {
    ("mindspeed", "gpt2", False): MINDSPEED,
    ("mindspeed", "llama", False): MINDSPEED,
    ("mindformers", "llama", False): MINDFORMERS_LLAMA,
    ("mindformers", "llama", True): MINDFORMERS_LLAMA_CONCAT,
    ("mindformers", "gpt2", False): MINDFORMERS_GPT2,
    ("mindformers-mcore", "llama", False): MINDFORMERS_MCORE,
}
DIALECTS = ("mindspeed", "mindformers", "mindformers-mcore")

# Adam moments ride in the same files under these prefixes of the MindSpore name.
OPTIM_PREFIXES = {
    "mindspeed": {"optim.exp_avg.": "exp_avg.", "optim.exp_avg_sq.": "exp_avg_sq."},
    "mindformers": {"optim.exp_avg.": "adam_m.", "optim.exp_avg_sq.": "adam_v."},
    # the same optimizer (mindformers/core/optim/adamw.py clone_state(prefix="adam_m" / "adam_v"))
    "mindformers-mcore": {"optim.exp_avg.": "adam_m.", "optim.exp_avg_sq.": "adam_v."},
}

# Training-state scalars MindSpeed-Core-MS writes beside the tensors (convert_pt2ckpt.py r0.1.0
# get_pt2ms_args, saved with mindspore.save_checkpoint(append_dict=...); dtypes as mindspore 2.10 stores
# them): `step_num` / `epoch_num` (python int -> Int64 0-d), `state_step` ([step] -> Float32 (1,)), each
# optimizer param group's values as `<key>_group_<i>` (`lr` -> `learning_rate`; numbers -> Float32 0-d,
# lists -> Float32 1-d), and the LR scheduler's values by OPT_SCHEDULER_MAP.  MindSpeed's loader pops
# step_num / epoch_num (core/dist_checkpointing/checkpointing.py load_checkpoint) and its
# OptimizerParamScheduler.load_state_dict takes the scheduler keys (training/optimizer_param_scheduler.py).
STEP_NUM, EPOCH_NUM, STATE_STEP = "step_num", "epoch_num", "state_step"
SCHEDULER_TYPES = {  # OPT_SCHEDULER_MAP: fp64 -> Tensor(float64); int64 -> Parameter(int) (stored Int32)
    "max_lr": "float64", "lr_warmup_steps": "int32", "num_steps": "int32", "lr_decay_style": "int32",
    "lr_decay_steps": "int32", "min_lr": "float64", "start_wd": "float64", "end_wd": "float64",
    "wd_incr_style": "int32", "wd_incr_steps": "int32",
}
SCHEDULER_STYLES = {  # stored as the index into these lists (LR_DECAY_STYLE, WD_INCR_STYLE)
    "lr_decay_style": ["constant", "WSD", "linear", "cosine", "inverse-square-root"],
    "wd_incr_style": ["constant", "linear", "cosine"],
}
GROUP_RENAMES = {"lr": "learning_rate"}
# torch Adam / apex param-group flags: stored as 0.0 / 1.0, read back as booleans.
GROUP_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "bias_correction",
               "is_expert_parallel", "is_decoupled_lr", "decoupled_weight_decay")
# Random-generator states MindSpeed's own save_checkpoint adds (core/tensor_parallel/random.py CANDIDATE_MODES).
RNG_TAGS = ("dp_rng_generator", "tp_rng_generator", "exp_rng_generator", "default_generator")

# A tag that tells the dialect of a checkpoint that carries no description.
DIALECT_MARKERS = {
    "language_model.": "mindspeed",
    "model.tok_embeddings.": "mindformers",
    "backbone.": "mindformers",
    "embedding.word_embeddings.": "mindformers-mcore",
    "decoder.layers.": "mindformers-mcore",
}


# Buffers some MindFormers checkpoints carry that are not parameters (GPT2's converter writes HF's
# attention mask buffers as attention.beta / masked_beta): dropped with this reason.
IGNORED_SUFFIXES = {
    ".router.router.expert_load": "MindFormers MoE router's running expert-load counts, rebuilt in training",
    ".mlp.router.expert_load": "MindFormers MoE router's running expert-load counts, rebuilt in training",
    ".mlp.router.fi_accu": "MindFormers MoE router's accumulated load-balancing statistic, rebuilt in training",
    ".attention.beta": "GPT2 causal-mask buffer, rebuilt by the model",
    ".attention.masked_beta": "GPT2 mask-fill buffer, rebuilt by the model",
}

# `pt_meta/` beside MindSpeed-Core-MS r0.1.0's rank folders (tools/converter/convert_pt2ckpt.py): per Megatron
# rank file `args_tp{TT}_pp{PPP}.pt` (save_args: a torch.save dict of the source's `args`, `checkpoint_version`,
# `iteration`, `optimizer`, `opt_param_scheduler`, `rng_state`, `num_floating_point_operations_so_far`, and with
# --convert-param-only `param_name_list` = per virtual chunk the Megatron keys `model[v].<flat name>`, reversed,
# local layer numbers), plus the `param_map_buffer*_dp*tp*pp*vpp*.json` files its patched Megatron training
# writes (copied without --convert-param-only).  convert_ckpt2pt.py reads them back from --param-map-path.
PT_META = "pt_meta"
PT_META_ARGS = "args_tp{t:02}_pp{p:03}.pt"
PT_META_KEYS = ("args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state",
                "num_floating_point_operations_so_far", "param_name_list")
# convert_pt2ckpt.py PARAM_KEY_MAP: Megatron legacy name components -> MindSpeed's (a component at a time)
MINDSPEED_PARAM_KEY_MAP = {"dense_h_to_4h": "mapping", "dense_4h_to_h": "projection", "self_attention": "attention",
                           "query_key_value": "qkv_proj", "dense": "out_proj"}

# Mixture of experts (appended to a model's table when its spec has experts; `{e}` is the GLOBAL expert).
# Stack: one MindSpore tensor holding every expert's canonical tensor, stacked along a new first axis
# ([E, out, in]); its parts are the row's canonical names with `{e}` = 0 .. E-1, in order.
#
# MindSpeed-Core-MS r0.1.0: mindspeed_ms/legacy/model/transformer.py makes every layer's `mlp` a MoELayer when
# moe_config.num_experts > 1; moe/moe_layer.py holds `router` (TopKRouter) and `experts` (SequentialMLP; its
# GroupedMLP raises NotImplementedError); moe/router.py: `gating` = mint.nn.Linear(hidden, num_experts,
# bias=False); moe/experts.py: `local_experts` = nn.SequentialCell of ParallelMLP(is_expert=True), numbered from
# 0 on each expert-parallel rank; legacy/model/mlp.py: `mapping` (gate and up per TP rank, as the dense MLP) and
# `projection`.  No shared expert, router bias or sigmoid score in r0.1.0.
MINDSPEED_MOE = [
    ("language_model.encoder.layers.{i}.mlp.router.gating.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("language_model.encoder.layers.{i}.mlp.experts.local_experts.{e}.mapping.weight", GatedMLP,
     ["layers.{i}.mlp.experts.{e}.gate.weight", "layers.{i}.mlp.experts.{e}.up.weight"]),
    ("language_model.encoder.layers.{i}.mlp.experts.local_experts.{e}.mapping.weight", Copy,
     ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("language_model.encoder.layers.{i}.mlp.experts.local_experts.{e}.projection.weight", Copy,
     ["layers.{i}.mlp.experts.{e}.down.weight"]),
]
# MindFormers 2.1.0 Llama with a moe_config (models/llama/llama_transformer.py LLamaDecodeLayer): MoEV2 over a
# LlamaFeedForward of expert_num experts (weights [E, out, in], w1 gate / w2 down / w3 up) and its router's
# `dense`; with shared_expert_num > 0 LlamaFeedForwardWithMoE: the same under `routed_experts`, plus
# `shared_experts` (a LlamaFeedForward of intermediate_size * shared_expert_num) and, with
# use_shared_expert_gating, `shared_experts_gate` [1, h]; balance_via_topk_bias adds the router's `topk_bias` [E].
# (Names and shapes read off the real model built on CPU: tests/formats/test_mindspore_moe.py loads them strictly.)
MINDFORMERS_LLAMA_MOE = [
    ("model.layers.{i}.feed_forward.router.dense.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.feed_forward.router.router.topk_bias", Copy, ["layers.{i}.mlp.router.expert_bias"]),
    ("model.layers.{i}.feed_forward.ffn.w1.weight", Stack, ["layers.{i}.mlp.experts.{e}.gate.weight"]),
    ("model.layers.{i}.feed_forward.ffn.w2.weight", Stack, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("model.layers.{i}.feed_forward.ffn.w3.weight", Stack, ["layers.{i}.mlp.experts.{e}.up.weight"]),
]
MINDFORMERS_LLAMA_MOE_SHARED = [
    ("model.layers.{i}.feed_forward.routed_experts.router.dense.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("model.layers.{i}.feed_forward.routed_experts.router.router.topk_bias", Copy,
     ["layers.{i}.mlp.router.expert_bias"]),
    ("model.layers.{i}.feed_forward.routed_experts.ffn.w1.weight", Stack, ["layers.{i}.mlp.experts.{e}.gate.weight"]),
    ("model.layers.{i}.feed_forward.routed_experts.ffn.w2.weight", Stack, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("model.layers.{i}.feed_forward.routed_experts.ffn.w3.weight", Stack, ["layers.{i}.mlp.experts.{e}.up.weight"]),
    ("model.layers.{i}.feed_forward.shared_experts.w1.weight", Copy, ["layers.{i}.mlp.shared.gate.weight"]),
    ("model.layers.{i}.feed_forward.shared_experts.w2.weight", Copy, ["layers.{i}.mlp.shared.down.weight"]),
    ("model.layers.{i}.feed_forward.shared_experts.w3.weight", Copy, ["layers.{i}.mlp.shared.up.weight"]),
    ("model.layers.{i}.feed_forward.shared_experts_gate.weight", Copy, ["layers.{i}.mlp.shared_gate.weight"]),
]
# MindFormers mcore-style MoE layer (parallel_core/training_graph/transformer/moe/: moe_layer.py `router`,
# `experts`, `shared_experts`; router.py `weight` [E, h] and with moe_router_enable_expert_bias `expert_bias` [E];
# ffn.py FFNGroupedGEMM `weight1` [E*h, 2f] / `weight2` [E*f, h]; shared_experts.py SharedExpertMLPInterleaved's
# linear_fc1 / linear_fc2 and with use_shared_expert_gating `shared_experts_gate` [1, h]).  A layer left dense
# (first_k_dense_replace, moe_layer_freq) takes MINDFORMERS_MCORE's mlp rows.  Checked against the real models
# built on CPU in tests/formats/test_mindformers_mcore.py.  Over tp: the router and the experts whole on every rank
# (experts placed by ep only: ffn.py), the shared experts too (SequenceParallelLinear: moe_module_specs.py).
MINDFORMERS_MCORE_MOE = [
    ("decoder.layers.{i}.mlp.router.weight", Copy, ["layers.{i}.mlp.router.weight"]),
    ("decoder.layers.{i}.mlp.router.expert_bias", Copy, ["layers.{i}.mlp.router.expert_bias"]),
    ("decoder.layers.{i}.mlp.experts.weight1", ExpertRows,
     ["layers.{i}.mlp.experts.{e}.gate.weight", "layers.{i}.mlp.experts.{e}.up.weight"]),
    ("decoder.layers.{i}.mlp.experts.weight2", ExpertRows, ["layers.{i}.mlp.experts.{e}.down.weight"]),
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight", WholeInterleave,
     ["layers.{i}.mlp.shared.gate.weight", "layers.{i}.mlp.shared.up.weight"]),
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight", WholeCopy, ["layers.{i}.mlp.shared.down.weight"]),
    ("decoder.layers.{i}.mlp.shared_experts.shared_experts_gate.weight", Copy, ["layers.{i}.mlp.shared_gate.weight"]),
]
LOCAL_EXPERTS = ".local_experts."  # MindSpeed: the expert number after it is local to its expert-parallel rank
# (dialect, has a shared expert) -> the MoE rows; a combination not here is refused
MOE_TABLES = {
    ("mindspeed", False): MINDSPEED_MOE,
    ("mindformers", False): MINDFORMERS_LLAMA_MOE,
    ("mindformers", True): MINDFORMERS_LLAMA_MOE_SHARED,
    ("mindformers-mcore", False): MINDFORMERS_MCORE_MOE,
    ("mindformers-mcore", True): MINDFORMERS_MCORE_MOE,
}


# MindFormers' LoRA (mindformers/pet/tuners/lora_adapter.py replaces a matched Linear by mindpet 1.0.4's LoRADense,
# whose parameters are `mindpet_delta_lora_a` [rank, in] / `mindpet_delta_lora_b` [out, rank], mindpet/delta/lora.py;
# the LoraModel keeps the base's names), and the file interop keeps its pet_config in (a MindFormers YAML's nesting).
LORA_NAMES = LoraNames(".mindpet_delta_lora_a", ".mindpet_delta_lora_b")
PET_CONFIG = "pet_config.yaml"
# The mcore-style models' LoRA (parallel_core/training_graph/tensor_parallel/lora_layers.py: ColumnParallelLinear-
# WithLoRA / RowParallelLinearWithLoRA hold `lora_A` and `lora_B` linears, so `<module>.lora_A.weight` [r, in] and
# `.lora_B.weight` [out, r] in the fused module's row order; read off LoraModel(TrainingQwen3ForCausalLM) built on
# CPU: `decoder.layers.0.self_attention.linear_qkv.lora_A.weight`).  Dialect -> (its name table, its LoRA names).
LORA_DIALECTS = {"mindformers": (("mindformers", "llama", False), LORA_NAMES),
                 "mindformers-mcore": (("mindformers-mcore", "llama", False), LoraNames(".lora_A.weight", ".lora_B.weight"))}
