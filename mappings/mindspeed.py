"""Megatron args -> MindSpeed-Core-MS YAML: every row of the tutorial's mapping table (seed 001).

Row order and sections follow the table (model_config, training_config,
dataset_config, optimizer_config, parallel_config); the default is the table's
"默认值" (None where it gives none). Values Megatron derives (padded vocab,
params_dtype, micro_batch_num, ...) come from `megatron_args.complete`.
"""
from __future__ import annotations

import ast

from .key_mapping import OMIT, R, Unmappable, rename
from .megatron_args import SPLIT_ARGS, layer_list, pipeline_split

ADAM = {"adam": "AdamWeightDecay", "sgd": "SGD"}  # Megatron's "adam" is decoupled-decay AdamW
POSITION = {"learned_absolute": "absolute", "rope": "rope", "relative": "relative", "none": "none"}
# mindspeed_ms/core/config.py (r0.1.0) check_fa_config: input_layout in ('BNSD', 'SBH').
FA_LAYOUTS = ("BNSD", "SBH")
# mindspeed_ms/core/config.py (r0.1.0) validate_lr_decay_style: the schedules its OptimizerConfig accepts.
LR_DECAY_STYLES = ("constant", "WSD", "linear", "cosine", "inverse-square-root")
# profile_framework is a string there: 'all', 'time' or 'None'.
PROFILE_FRAMEWORK = {True: "all", False: "None"}
# MindSpore has no Transformer Engine: Megatron's local and transformer_engine both run as its 'local'.
SAME_VALUES = {"transformer_impl": {"local", "transformer_engine"}}
# Given values the YAML holds under another meaning: (completed source args, completed read-back) -> held.
SAME_MEANING = {
    # model_config.vocab_size is the embedding's rows (Megatron's padded size): a --vocab-size that needs no
    # padding is that number exactly.
    "vocab_size": lambda before, after: before["vocab_size"] == after["padded_vocab_size"],
}
# Given values with no key, and why (beyond "no field").
UNHELD = {"vocab_size": "model_config.vocab_size holds Megatron's padded size (the embedding's rows); the "
                        "tokenizer's own vocabulary has no key"}
# (dest, given value) -> the note a value written another way gets (nothing is lost, the user is told).
NOTES = {
    ("transformer_impl", "transformer_engine"): "MindSpore has no Transformer Engine: written as 'local', the "
    "implementation MindSpeed-Core-MS runs (the same model, without TE's fused kernels)",
}


def _betas(b1, b2):
    return [b1, b2]


def _whole(value):
    """An integral number as int: MindSpeed-Core-MS checks loss_scale_window and friends with check_positive_int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _wrap_with_ddp(wrap, dist_opt, overlap, bucket):
    # mindspeed_ms/core/config.py (r0.1.0) resets use_distributed_optimizer and overlap_grad_reduce to False
    # and refuses bucket_size unless wrap_with_ddp; Megatron always wraps the model in its DDP.
    return bool(wrap or dist_opt or overlap or bucket is not None)


def _ckpt_format(fmt):
    if fmt in ("ckpt", "safetensors"):
        return fmt
    raise Unmappable(f"MindSpore saves 'ckpt' or 'safetensors'; Megatron's {fmt!r} is not a MindSpore format "
                     "(convert the checkpoint with `interop convert`)")


def _ckpt_format_back(value, doc):
    if value == "ckpt":
        return {}  # MindSpore's default format: Megatron's default (torch_dist) stands for it
    if value == "safetensors":
        return {"_note": f"MindSpore's {value!r} format has no Megatron --ckpt-format (Megatron writes torch_dist)"}
    return {"ckpt_format": value}


def _transformer_impl(impl):
    if impl not in SAME_VALUES["transformer_impl"]:
        raise Unmappable(f"MindSpeed-Core-MS runs its local implementation only, not {impl!r}")
    return "local"


def _input_layout(order):
    if order not in FA_LAYOUTS:
        raise Unmappable(f"MindSpeed-Core-MS flash attention takes input_layout {' or '.join(FA_LAYOUTS)}")
    return order


def stage_layers(absent):
    """A row's `to` for the pipeline split (`megatron_args.pipeline_split` over SPLIT_ARGS): the layer count of
    every stage, from --num-layer-list or --decoder-first/last-pipeline-num-layers; `absent` for an even split
    (a --num-layer-list that is not one count per stage is refused before: megatron_args.CHECKS)."""
    def to(*split):
        counts = pipeline_split(*split)
        return absent if counts is None else counts
    return to


def stage_layers_back(value, doc):
    return {"num_layer_list": ",".join(map(str, layer_list(value) or [value]))}


def _hidden_act_back(value, doc):
    return {"swiglu": True} if value == "swiglu" else {"hidden_act": value}


def one_of(*allowed):
    def convert(value):
        if value not in allowed:
            raise Unmappable(f"{value!r} is not one of {', '.join(allowed)} (what this loader accepts)")
        return value
    return convert


ROWS = [
    # model_config
    R("padded_vocab_size", "model_config.vocab_size"),
    R("hidden_size", "model_config.hidden_size"),
    # No max_position_embeddings key: the model sizes its position table by seq_length.
    R("seq_length", "model_config.seq_length",
      back=lambda v, doc: {"seq_length": v, "max_position_embeddings": v}),
    R("rotary_base", "model_config.rotary_base", 10000),
    R("num_layers", "model_config.num_layers"),
    rename("position_embedding_type", "model_config.position_embedding_type", POSITION, "absolute"),
    R("init_method_std", "model_config.init_method_std", 0.01),
    # mindspeed_ms/core/config.py (r0.1.0, modify_flatten_dict): --use-fused-rmsnorm is normalization FusedRMSNorm.
    R(("normalization", "use_fused_rmsnorm"), "model_config.normalization", "LayerNorm",
      to=lambda norm, fused: "FusedRMSNorm" if fused and norm == "RMSNorm" else norm,
      back=lambda v, doc: {"normalization": "RMSNorm", "use_fused_rmsnorm": True} if v == "FusedRMSNorm"
      else {"normalization": v}),
    R("norm_epsilon", "model_config.norm_epsilon", 1e-5),
    R("group_query_attention", "model_config.group_query_attention", False),
    R("num_attention_heads", "model_config.num_attention_heads"),
    R("num_query_groups", "model_config.num_query_groups", 32),
    R("attention_dropout", "model_config.attention_dropout_rate", 0.0),
    R("ffn_hidden_size", "model_config.ffn_hidden_size"),
    R("hidden_dropout", "model_config.hidden_dropout_rate", 0.0),
    R("attention_softmax_in_fp32", "model_config.attention_softmax_in_fp32", True),
    R("use_flash_attn", "model_config.use_flash_attention", False),
    R("untie_embeddings_and_output_weights", "model_config.untie_embeddings_and_output_weights", False),
    # MindSpore has no Transformer Engine: the local implementation is the only one that runs.
    R("transformer_impl", "model_config.transformer_impl", "local", to=_transformer_impl,
      back=lambda v, doc: {} if v == "local" else {"transformer_impl": v}),
    R("recompute_granularity", "model_config.recompute_granularity", None),
    R("recompute_method", "model_config.recompute_method", None),
    R("recompute_num_layers", "model_config.recompute_num_layers", None),
    R("fp16_lm_cross_entropy", "model_config.fp16_lm_cross_entropy", False),
    R("fp32_residual_connection", "model_config.fp32_residual_connection", False),
    R("add_qkv_bias", "model_config.qkv_has_bias", True),
    R("add_dense_bias", "model_config.out_proj_has_bias", True),
    R("add_bias_linear", "model_config.add_bias_linear", False),
    # TransformerConfig's own defaults are mlp_has_bias=True, gated_linear_unit=False: say them.
    R("add_bias_linear", "model_config.mlp_has_bias", False, back=lambda v, doc: {}),
    R("swiglu", "model_config.gated_linear_unit", False, back=lambda v, doc: {}),
    R("use_sandwich_norm", "model_config.use_sandwich_norm", False),
    R("pre_tockens", "model_config.fa_config.pre_tokens"),
    R("next_tockens", "model_config.fa_config.next_tokens"),
    R("shape_order", "model_config.fa_config.input_layout", to=_input_layout),
    R("attn_post_norm_scale", "model_config.attn_post_norm_scale", 1.0),
    R("ffn_post_norm_scale", "model_config.ffn_post_norm_scale", 1.0),
    R("params_dtype", "model_config.params_dtype", "float32"),
    R("compute_dtype", "model_config.compute_dtype", "float16"),
    R("embedding_dtype", "model_config.embedding_init_dtype", "float32"),
    R("use_fused_swiglu", "model_config.apply_swiglu_fusion", False),
    R("apply_rope_fusion", "model_config.apply_rope_fusion", False),
    R(("hidden_act",), "model_config.hidden_act", "gelu", back=_hidden_act_back),
    # training_config
    R("seed", "training_config.seed", None),
    R("log_interval", "training_config.log_interval", None),
    R("train_iters", "training_config.training_iters", 0, unset=True),
    R("save_interval", "training_config.save_interval", None),
    R("eval_interval", "training_config.eval_interval", None),
    R("accumulate_allreduce_grads_in_fp32", "training_config.accumulate_allreduce_grads_in_fp32", False),
    R("clip_grad", "optimizer_config.clip_grad", 0.0),
    R("bf16", "training_config.bf16", False),
    R("fp16", "training_config.fp16", False),
    R("loss_scale", "training_config.loss_scale", None),
    R("initial_loss_scale", "training_config.loss_scale_value", None, to=_whole),
    R("loss_scale_window", "training_config.loss_scale_window", None, to=_whole),
    R("hysteresis", "training_config.loss_scale_factor", None),
    R("use_distributed_optimizer", "training_config.use_distributed_optimizer", False),
    R("resume_training", "training_config.resume_training", False),
    R("resume_crc_check", "training_config.crc_check", False),
    R("load", "training_config.load_checkpoint", "", unset=True),
    R("save", "training_config.output_dir", "./output", unset=True),
    R("ckpt_prefix", "training_config.prefix", "network"),
    R("ckpt_format", "training_config.ckpt_format", "ckpt", to=_ckpt_format, back=_ckpt_format_back),
    R("keep_checkpoint_max", "training_config.keep_checkpoint_max", 5),
    R(("wrap_with_ddp", "use_distributed_optimizer", "overlap_grad_reduce", "bucket_size"),
      "training_config.wrap_with_ddp", False, to=_wrap_with_ddp, back=lambda v, doc: {"wrap_with_ddp": v},
      unset=True),
    R("bucket_size", "training_config.bucket_size", None),
    R("enable_mem_align", "training_config.enable_mem_align", False),
    R("overlap_grad_reduce", "training_config.overlap_grad_reduce", False),
    R("delay_grad_reduce", "training_config.delay_grad_reduce", False),
    R("no_load_optim", "training_config.no_load_optim", False),
    R("no_load_rng", "training_config.no_load_rng", True),
    R("new_dataset", "training_config.new_dataset", False),
    R("profile", "training_config.profile", False),
    R("profile_save_path", "training_config.profile_save_path", "./{output_dir}/profile"),
    R("profile_step_start", "training_config.profile_step_start", 1),
    R("profile_step_end", "training_config.profile_step_end", 5),
    R("profile_level", "training_config.profile_level", "level0"),
    R("profile_with_stack", "training_config.profile_with_stack", False),
    R("profile_memory", "training_config.profile_memory", False),
    rename("profile_framework", "training_config.profile_framework", PROFILE_FRAMEWORK, "None"),
    R("profile_communication", "training_config.profile_communication", False),
    R("profile_parallel_strategy", "training_config.profile_parallel_strategy", False),
    R("profile_aicore_metrics", "training_config.profile_aicore_metrics", 0),
    R("profile_l2_cache", "training_config.profile_l2_cache", False),
    R("profile_hbm_ddr", "training_config.profile_hbm_ddr", False),
    R("profile_pcie", "training_config.profile_pcie", False),
    R("profile_data_process", "training_config.profile_data_process", False),
    R("profile_data_simplification", "training_config.profile_data_simplification", False),
    R("profile_op_time", "training_config.profile_op_time", True),
    R("profile_offline_analyse", "training_config.profile_offline_analyse", False),
    R("profile_dynamic_profiler_config_path", "training_config.profile_dynamic_profiler_config_path", ""),
    # dataset_config
    R("micro_batch_size", "dataset_config.batch_size", 1),
    R("micro_batch_num", "dataset_config.micro_batch_num", 1, unset=True),
    R("reset_attention_mask", "dataset_config.reset_attention_mask"),
    R("reset_position_ids", "dataset_config.reset_position_ids"),
    R("eod_mask_loss", "dataset_config.eod_mask_loss"),
    R("pad_token_id", "dataset_config.pad_token_id"),
    R("eos_token_id", "dataset_config.eos_token_id", 0),
    R("drop_remainder", "dataset_config.drop_remainder", True),
    # optimizer_config
    rename("optimizer", "optimizer_config.optimizer_type", ADAM, "AdamWeightDecay"),
    R(("adam_beta1", "adam_beta2"), "optimizer_config.betas", to=_betas,
      back=lambda v, doc: {"adam_beta1": v[0], "adam_beta2": v[1]}),
    R("adam_eps", "optimizer_config.eps"),
    # OptimizerConfig validate_lr_decay_style (r0.1.0) takes these five only; a fork's other style is named
    # and the loader's default written instead.
    R("lr_decay_style", "optimizer_config.lr_decay_style", "constant", to=one_of(*LR_DECAY_STYLES)),
    R("lr", "optimizer_config.learning_rate", 1e-3, unset=True),
    R("min_lr", "optimizer_config.min_lr", 0.0),
    R("lr_warmup_iters", "optimizer_config.lr_warmup_iters", 0),
    R("lr_decay_iters", "optimizer_config.lr_decay_iters"),
    # Beyond the seed table: OptimizerConfig (mindspeed_ms/core/config.py, r0.1.0) takes Megatron's other
    # schedule arguments under their own names.
    R("lr_warmup_fraction", "optimizer_config.lr_warmup_fraction"),
    R("lr_warmup_samples", "optimizer_config.lr_warmup_samples", 0),
    R("lr_warmup_init", "optimizer_config.lr_warmup_init", 0.0),
    R("lr_decay_samples", "optimizer_config.lr_decay_samples"),
    R("use_checkpoint_opt_param_scheduler", "optimizer_config.use_checkpoint_opt_param_scheduler", True),
    R("override_opt_param_scheduler", "optimizer_config.override_opt_param_scheduler", False),
    R("weight_decay", "optimizer_config.weight_decay", 0.0),
    R("overlap_param_gather", "optimizer_config.overlap_param_gather", False),
    R("start_weight_decay", "optimizer_config.start_weight_decay", 0.0),
    R("end_weight_decay", "optimizer_config.end_weight_decay", 0.0),
    R("weight_decay_incr_style", "optimizer_config.weight_decay_incr_style", "constant"),
    # parallel_config
    R("tensor_model_parallel_size", "parallel_config.tensor_model_parallel_size", 1),
    R("context_parallel_size", "parallel_config.context_parallel_size", 1),
    R("context_parallel_algo", "parallel_config.context_parallel_algo", "ulysses_cp_algo"),
    R("ulysses_degree_in_cp", "parallel_config.ulysses_degree_in_cp", None),
    R("expert_model_parallel_size", "parallel_config.expert_model_parallel_size", 1),
    R("virtual_pipeline_model_parallel_size", "parallel_config.virtual_pipeline_model_parallel_size", None),
    R("num_layers_per_virtual_pipeline_stage", "parallel_config.num_layers_per_virtual_pipeline_stage"),
    R("sequence_parallel", "parallel_config.sequence_parallel", False),
    R("pipeline_model_parallel_size", "parallel_config.pipeline_model_parallel_size", 1),
    # ModelParallelConfig.num_layer_list (mindspeed_ms/core/config.py r0.1.0: a list, or its text, or None).
    R(SPLIT_ARGS, "parallel_config.num_layer_list", to=stage_layers(None), back=stage_layers_back),
    R("recompute", "parallel_config.recompute", None),
    R("select_recompute", "parallel_config.select_recompute", None),
    R("select_comm_recompute", "parallel_config.select_comm_recompute", None),
]

# ---------------------------------------------------------------- moe_config

def moe_only(convert=None):
    """A MoE row's `to`: its value only for a model with experts (a dense model's file gets no MoE keys)."""
    def to(value, experts):
        if not experts or value is None:  # None: Megatron's "not set", the loader's own default applies
            return OMIT
        return convert(value) if convert is not None else value
    return to


def one_value(what: str):
    """Megatron takes one value per loss type (--moe-router-load-balancing-type aux_loss seq_aux_loss); a
    target with one slot takes one."""
    def convert(values):
        values = values if isinstance(values, list) else [values]
        if len(values) != 1:
            raise Unmappable(f"one {what} here, Megatron gives {len(values)}: {values}")
        return values[0]
    return convert


def moe_row(dest: str, path: str, convert=None, listed: bool = False):
    """Megatron's `dest` <-> `path`, written only for a MoE model; `listed`: Megatron's side is a list."""
    back = (lambda v, doc: {dest: [v]}) if listed else (lambda v, doc: {dest: v})
    return R((dest, "num_experts"), path, to=moe_only(convert), back=back)


# MindSpeed-Core-MS r0.1.0 `MoEConfig` (mindspeed_ms/core/config.py: config_name "moe_config", a top-level
# section TransformerConfig depends on); MindFormers r1.3.0's dynamic graph has the same class
# (mindformers/experimental/parallel_core/pynative/config.py).  Its validators accept load balancing
# aux_loss / none and the alltoall dispatcher only.  Megatron's other MoE flags (expert size, shared experts,
# router score function and bias, layer frequency, expert tensor parallelism) have no key there: reported.
MOE_ROWS = [
    moe_row("num_experts", "moe_config.num_experts"),
    moe_row("moe_router_topk", "moe_config.moe_router_topk"),
    moe_row("moe_grouped_gemm", "moe_config.moe_grouped_gemm"),
    moe_row("moe_router_load_balancing_type", "moe_config.moe_router_load_balancing_type",
            lambda v: one_of("aux_loss", "none")(one_value("load-balancing type")(v)), listed=True),
    moe_row("moe_token_dispatcher_type", "moe_config.moe_token_dispatcher_type", one_of("alltoall")),
    moe_row("moe_aux_loss_coeff", "moe_config.moe_aux_loss_coeff", one_value("aux loss coefficient"), listed=True),
    moe_row("moe_z_loss_coeff", "moe_config.moe_z_loss_coeff"),
    moe_row("moe_input_jitter_eps", "moe_config.moe_input_jitter_eps"),
    moe_row("moe_expert_capacity_factor", "moe_config.moe_expert_capacity_factor"),
    moe_row("moe_pad_expert_input_to_capacity", "moe_config.moe_pad_expert_input_to_capacity"),
    moe_row("moe_token_drop_policy", "moe_config.moe_token_drop_policy"),
]
ROWS += MOE_ROWS

# Paths whose None MindSpeed-Core-MS r0.1.0 accepts (its validators skip None or have none); anywhere
# else a None from Megatron ("not set") is left out, so the loader's own default applies.
NULLABLE = {
    "training_config.seed", "training_config.log_interval", "training_config.save_interval",
    "training_config.eval_interval", "training_config.loss_scale", "training_config.bucket_size",
    "training_config.keep_checkpoint_max", "model_config.recompute_granularity", "model_config.recompute_method",
    "model_config.recompute_num_layers", "dataset_config.pad_token_id", "optimizer_config.lr_decay_iters",
    "parallel_config.virtual_pipeline_model_parallel_size", "parallel_config.ulysses_degree_in_cp",
    "parallel_config.num_layer_list", "parallel_config.recompute", "parallel_config.select_recompute",
    "parallel_config.select_comm_recompute", "parallel_config.num_layers_per_virtual_pipeline_stage",
    "optimizer_config.lr_warmup_fraction", "optimizer_config.lr_decay_samples",
}


# ---------------------------------------------------------------- seed 001's nested config (read only)

def _num(value):
    """YAML 1.1 reads `1e-5` as a string; the config means the number."""
    return float(value) if isinstance(value, str) else value


def _one(dest, convert=None):
    return lambda v, doc: {dest: convert(v) if convert else v}


def _dtype_flags(value, doc):
    flags = {"bfloat16": {"bf16": True}, "float16": {"fp16": True}, "float32": {}}
    if value not in flags:
        return {"_note": f"compute dtype {value!r} has no Megatron flag"}
    return flags[value]


FUSED_OPERATORS = {"flash_attention": "use_flash_attn", "rope": "use_fused_rotary_pos_emb",
                   "rmsnorm": "use_fused_rmsnorm", "swiglu": "use_fused_swiglu"}


def _fused_operators(value, doc):
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    flags = {FUSED_OPERATORS[n]: True for n in names if n in FUSED_OPERATORS}
    unknown = [n for n in names if n not in FUSED_OPERATORS]
    if unknown:
        flags["_note"] = f"fused operators with no Megatron switch: {', '.join(unknown)}"
    return flags


L = "model_config.llm."
P = "accelerate_config.parallelization."
# The 38BV3 config of the MindSpeed-Core-MS GPT guide (seed 001): model_config.llm / accelerate_config /
# train_config. Keys no row reads are reported as having no Megatron equivalent.
NESTED_ROWS = [
    R("padded_vocab_size", L + "tokenizer.padded_size"),
    R("make_vocab_size_divisible_by", L + "tokenizer.divided_by"),
    R("hidden_size", L + "embedding.hidden_size"),
    R("embedding_init_method_std", L + "embedding.init_std", back=_one("embedding_init_method_std", _num)),
    R("position_embedding_type", L + "position.type",
      back=_one("position_embedding_type", lambda v: {"absolute": "learned_absolute"}.get(v, v))),
    R("max_position_embeddings", L + "position.max_size",
      back=lambda v, doc: {"max_position_embeddings": v, "seq_length": v}),
    R("rotary_base", L + "position.rope_base", back=_one("rotary_base", lambda v: int(_num(v)))),
    R("num_layers", L + "blocks.num_layers"),
    R("init_method_std", L + "blocks.init_std", back=_one("init_method_std", _num)),
    R("use_sandwich_norm", L + "blocks.sandwich_norm"),
    R("normalization", L + "blocks.layernorm.norm_type"),
    R("norm_epsilon", L + "blocks.layernorm.epsilon", back=_one("norm_epsilon", _num)),
    R("group_query_attention", L + "blocks.attention.attention_type",
      back=lambda v, doc: {"group_query_attention": v == "GQA"}),
    R("num_attention_heads", L + "blocks.attention.head_num"),
    R("num_query_groups", L + "blocks.attention.kv_group_size"),
    R("add_qkv_bias", L + "blocks.attention.qkv_bias"),
    R("add_dense_bias", L + "blocks.attention.projection_bias"),
    R("attention_dropout", L + "blocks.attention.dropout_rate", back=_one("attention_dropout", _num)),
    R("attn_post_norm_scale", L + "blocks.attention.post_norm_scale", back=_one("attn_post_norm_scale", _num)),
    R("ffn_hidden_size", L + "blocks.ffn.hidden_size"),
    R("swiglu", L + "blocks.ffn.activation", back=lambda v, doc: _hidden_act_back(v, doc)),
    R("hidden_dropout", L + "blocks.ffn.dropout_rate", back=_one("hidden_dropout", _num)),
    R("add_bias_linear", L + "blocks.ffn.mlp_bias"),
    R("ffn_post_norm_scale", L + "blocks.ffn.post_norm_scale", back=_one("ffn_post_norm_scale", _num)),
    R("untie_embeddings_and_output_weights", L + "head.shared_embedding",
      back=lambda v, doc: {"untie_embeddings_and_output_weights": not v}),
    R("tensor_model_parallel_size", P + "tensor_parallel"),
    R("pipeline_model_parallel_size", P + "pipeline.num_stages"),
    R("num_layer_list", P + "pipeline.layer_list", back=_one("num_layer_list", lambda v: ",".join(
        str(sum(x) if isinstance(x, list) else x) for x in (ast.literal_eval(v) if isinstance(v, str) else v)))),
    R("micro_batch_size", P + "pipeline.micro_batch_size"),
    R("num_layers_per_virtual_pipeline_stage", P + "pipeline.num_layers_per_vpp"),
    R("virtual_pipeline_model_parallel_size", P + "pipeline.virtual_pipeline_model_parallel_size"),
    R("noop_layers", P + "pipeline.noop_layers"),
    R("sequence_parallel", P + "use_sequence_parallel"),
    R("use_distributed_optimizer", P + "use_distributed_optimizer"),
    R("params_dtype", "accelerate_config.precision.param_init_dtype", back=lambda v, doc: {}),
    R("compute_dtype", "accelerate_config.precision.compute_dtype", back=_dtype_flags),
    R("use_flash_attn", "accelerate_config.precision.fused_operators", back=_fused_operators),
    R("resume_training", "train_config.ms_training_config.resume_training"),
    R("wrap_with_ddp", "train_config.ms_training_config.wrap_with_ddp"),
    R("bucket_size", "train_config.ms_training_config.bucket_size"),
    R("select_comm_recompute", "train_config.recompute_config.select_comm_recompute"),
]
