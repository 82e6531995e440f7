"""Every row of the MindSpeed-Core-MS table (seed 001) maps both ways with the table's names and defaults."""
from __future__ import annotations

import pytest
import yaml

from interop import mapargs
from interop.mappings import megatron_args as M
from interop.mappings import mindspeed

# (Megatron name, MindSpeed-Core-MS path), transcribed from the seed-001 table.
SEED_TABLE = """
padded_vocab_size model_config.vocab_size
hidden_size model_config.hidden_size
seq_length model_config.seq_length
rotary_base model_config.rotary_base
num_layers model_config.num_layers
position_embedding_type model_config.position_embedding_type
init_method_std model_config.init_method_std
normalization model_config.normalization
norm_epsilon model_config.norm_epsilon
group_query_attention model_config.group_query_attention
num_attention_heads model_config.num_attention_heads
num_query_groups model_config.num_query_groups
attention_dropout model_config.attention_dropout_rate
ffn_hidden_size model_config.ffn_hidden_size
hidden_dropout model_config.hidden_dropout_rate
attention_softmax_in_fp32 model_config.attention_softmax_in_fp32
use_flash_attn model_config.use_flash_attention
untie_embeddings_and_output_weights model_config.untie_embeddings_and_output_weights
transformer_impl model_config.transformer_impl
recompute_granularity model_config.recompute_granularity
recompute_method model_config.recompute_method
recompute_num_layers model_config.recompute_num_layers
fp16_lm_cross_entropy model_config.fp16_lm_cross_entropy
fp32_residual_connection model_config.fp32_residual_connection
add_qkv_bias model_config.qkv_has_bias
add_dense_bias model_config.out_proj_has_bias
add_bias_linear model_config.add_bias_linear
use_sandwich_norm model_config.use_sandwich_norm
pre_tockens model_config.fa_config.pre_tokens
next_tockens model_config.fa_config.next_tokens
shape_order model_config.fa_config.input_layout
attn_post_norm_scale model_config.attn_post_norm_scale
ffn_post_norm_scale model_config.ffn_post_norm_scale
params_dtype model_config.params_dtype
compute_dtype model_config.compute_dtype
embedding_dtype model_config.embedding_init_dtype
use_fused_swiglu model_config.apply_swiglu_fusion
apply_rope_fusion model_config.apply_rope_fusion
hidden_act model_config.hidden_act
seed training_config.seed
log_interval training_config.log_interval
train_iters training_config.training_iters
save_interval training_config.save_interval
eval_interval training_config.eval_interval
accumulate_allreduce_grads_in_fp32 training_config.accumulate_allreduce_grads_in_fp32
clip_grad optimizer_config.clip_grad
bf16 training_config.bf16
fp16 training_config.fp16
loss_scale training_config.loss_scale
initial_loss_scale training_config.loss_scale_value
loss_scale_window training_config.loss_scale_window
hysteresis training_config.loss_scale_factor
use_distributed_optimizer training_config.use_distributed_optimizer
resume_training training_config.resume_training
resume_crc_check training_config.crc_check
load training_config.load_checkpoint
save training_config.output_dir
ckpt_prefix training_config.prefix
ckpt_format training_config.ckpt_format
keep_checkpoint_max training_config.keep_checkpoint_max
wrap_with_ddp training_config.wrap_with_ddp
bucket_size training_config.bucket_size
enable_mem_align training_config.enable_mem_align
overlap_grad_reduce training_config.overlap_grad_reduce
delay_grad_reduce training_config.delay_grad_reduce
no_load_optim training_config.no_load_optim
no_load_rng training_config.no_load_rng
new_dataset training_config.new_dataset
profile training_config.profile
profile_save_path training_config.profile_save_path
profile_step_start training_config.profile_step_start
profile_step_end training_config.profile_step_end
profile_level training_config.profile_level
profile_with_stack training_config.profile_with_stack
profile_memory training_config.profile_memory
profile_framework training_config.profile_framework
profile_communication training_config.profile_communication
profile_parallel_strategy training_config.profile_parallel_strategy
profile_aicore_metrics training_config.profile_aicore_metrics
profile_l2_cache training_config.profile_l2_cache
profile_hbm_ddr training_config.profile_hbm_ddr
profile_pcie training_config.profile_pcie
profile_data_process training_config.profile_data_process
profile_data_simplification training_config.profile_data_simplification
profile_op_time training_config.profile_op_time
profile_offline_analyse training_config.profile_offline_analyse
profile_dynamic_profiler_config_path training_config.profile_dynamic_profiler_config_path
micro_batch_size dataset_config.batch_size
micro_batch_num dataset_config.micro_batch_num
reset_attention_mask dataset_config.reset_attention_mask
reset_position_ids dataset_config.reset_position_ids
eod_mask_loss dataset_config.eod_mask_loss
pad_token_id dataset_config.pad_token_id
eos_token_id dataset_config.eos_token_id
drop_remainder dataset_config.drop_remainder
optimizer optimizer_config.optimizer_type
adam_beta1 optimizer_config.betas
adam_beta2 optimizer_config.betas
adam_eps optimizer_config.eps
lr_decay_style optimizer_config.lr_decay_style
lr optimizer_config.learning_rate
min_lr optimizer_config.min_lr
lr_warmup_iters optimizer_config.lr_warmup_iters
lr_decay_iters optimizer_config.lr_decay_iters
use_checkpoint_opt_param_scheduler optimizer_config.use_checkpoint_opt_param_scheduler
override_opt_param_scheduler optimizer_config.override_opt_param_scheduler
weight_decay optimizer_config.weight_decay
overlap_param_gather optimizer_config.overlap_param_gather
start_weight_decay optimizer_config.start_weight_decay
end_weight_decay optimizer_config.end_weight_decay
weight_decay_incr_style optimizer_config.weight_decay_incr_style
tensor_model_parallel_size parallel_config.tensor_model_parallel_size
context_parallel_size parallel_config.context_parallel_size
context_parallel_algo parallel_config.context_parallel_algo
ulysses_degree_in_cp parallel_config.ulysses_degree_in_cp
expert_model_parallel_size parallel_config.expert_model_parallel_size
virtual_pipeline_model_parallel_size parallel_config.virtual_pipeline_model_parallel_size
num_layers_per_virtual_pipeline_stage parallel_config.num_layers_per_virtual_pipeline_stage
sequence_parallel parallel_config.sequence_parallel
pipeline_model_parallel_size parallel_config.pipeline_model_parallel_size
num_layer_list parallel_config.num_layer_list
recompute parallel_config.recompute
select_recompute parallel_config.select_recompute
select_comm_recompute parallel_config.select_comm_recompute
"""
PAIRS = [tuple(line.split()) for line in SEED_TABLE.strip().splitlines()]

# The table's defaults where Megatron itself has no value (written when the Megatron value is None).
TABLE_DEFAULTS = {
    "model_config.num_query_groups": 32, "training_config.training_iters": 0,
    "training_config.load_checkpoint": "", "training_config.output_dir": "./output",
    "training_config.prefix": "network", "training_config.keep_checkpoint_max": 5,
    "training_config.profile_level": "level0", "training_config.profile_op_time": True,
    "dataset_config.batch_size": 1, "dataset_config.micro_batch_num": 1, "dataset_config.eos_token_id": 0,
    "dataset_config.drop_remainder": True, "optimizer_config.learning_rate": 1e-3,
    "optimizer_config.start_weight_decay": 0.0, "optimizer_config.end_weight_decay": 0.0,
    "parallel_config.context_parallel_algo": "ulysses_cp_algo", "model_config.attn_post_norm_scale": 1.0,
    "model_config.embedding_init_dtype": "float32", "training_config.profile_save_path": "./{output_dir}/profile",
}

BASE = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 128,
        "seq_length": 128, "vocab_size": 1000}

# A non-default Megatron value per row, and what the YAML must then hold (when it differs).
SAMPLES = {
    "padded_vocab_size": ({"vocab_size": 1000, "make_vocab_size_divisible_by": 64}, 1024),
    "position_embedding_type": ({"position_embedding_type": "rope"}, "rope"),
    "params_dtype": ({"bf16": True}, "bfloat16"),
    "compute_dtype": ({"fp16": True}, "float16"),
    "hidden_act": ({"swiglu": True}, "swiglu"),
    "adam_beta1": ({"adam_beta1": 0.8, "adam_beta2": 0.97}, [0.8, 0.97]),
    "adam_beta2": ({"adam_beta1": 0.85, "adam_beta2": 0.9}, [0.85, 0.9]),
    "optimizer": ({"optimizer": "sgd"}, "SGD"),
    "num_query_groups": ({"group_query_attention": True, "num_query_groups": 2}, 2),
    "add_qkv_bias": ({"add_bias_linear": False, "add_qkv_bias": True}, True),
    "add_dense_bias": ({"add_bias_linear": False}, False),
    "micro_batch_num": ({"world_size": 4, "micro_batch_size": 2, "global_batch_size": 32}, 4),
    # MindSpore's implementation and formats stand in for Megatron's (mindspeed_ms/core/config.py, r0.1.0).
    "transformer_impl": ({"transformer_impl": "transformer_engine"}, "local"),
    "ckpt_format": ({"ckpt_format": "torch_dist"}, "ckpt"),
    "profile_framework": ({"profile_framework": True}, "all"),
    "num_layer_list": ({"num_layer_list": "1,3", "pipeline_model_parallel_size": 2}, [1, 3]),
    "virtual_pipeline_model_parallel_size": (
        {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}, 2),
}


def _sample(dest):
    if dest in SAMPLES:
        return SAMPLES[dest]
    arg = M.ARGS[dest]
    if arg.kind in (M.TRUE, M.BOOLOPT):
        value = not arg.default
    elif arg.kind == M.FALSE:
        value = False
    elif arg.choices:
        value = next(c for c in arg.choices if c != arg.default)
    elif arg.kind == M.INT:
        value = (arg.default or 0) + (2 if dest.endswith("size") else 7)
    elif arg.kind == M.FLOAT:
        value = (arg.default or 0.0) + 0.25
    else:
        value = f"/some/{dest}"
    return {dest: value}, value


def _get(doc, path):
    for key in path.split("."):
        doc = doc[key]
    return doc


def test_every_seed_row_is_in_the_table():
    have = {(s, row.path) for row in mindspeed.ROWS for s in row.source}
    missing = [pair for pair in PAIRS if pair not in have]
    assert not missing
    assert len(PAIRS) == 124


@pytest.mark.parametrize("dest,path", PAIRS, ids=[f"{d}->{p}" for d, p in PAIRS])
def test_seed_row_maps_there_and_back(dest, path):
    given, expected = _sample(dest)
    explicit = {**BASE, **given}
    text, doc, why = mapargs.to_target(explicit, "mindspeed")
    assert _get(yaml.safe_load(text), path) == expected
    back, entries, _ = mapargs.read_target(text, "mindspeed")
    before, after = M.complete(explicit), M.complete(back)
    held = {s for row in mindspeed.ROWS for s in row.source}
    for d in given:
        if d in held:  # the job size, the true vocab: the YAML keeps only what they imply
            assert after[d] == before[d], d
    assert after[dest] == before[dest]
    assert entries == []


@pytest.mark.parametrize("path,default", sorted(TABLE_DEFAULTS.items()))
def test_table_defaults_fill_what_megatron_leaves_unset(path, default):
    row = next(r for r in mindspeed.ROWS if r.path == path)
    assert row.default == default
    doc = yaml.safe_load(mapargs.to_target(dict(BASE, vocab_size=None), "mindspeed")[0])
    megatron_value = M.complete(BASE).get(row.source[0])
    if megatron_value is None or path == "model_config.num_query_groups":
        expected = 8 if path == "model_config.num_query_groups" else default  # = heads without GQA
        assert _get(doc, path) == expected


def test_renamed_rows_land_on_their_mindspeed_names():
    explicit = dict(BASE, attention_dropout=0.3, add_qkv_bias=True, add_bias_linear=False,
                    initial_loss_scale=4096.0, hysteresis=5, resume_crc_check=True, micro_batch_size=3,
                    pre_tockens=2048, next_tockens=0, shape_order="SBH", use_flash_attn=True, train_iters=77)
    doc = yaml.safe_load(mapargs.to_target(explicit, "mindspeed")[0])
    mc, tc = doc["model_config"], doc["training_config"]
    assert mc["attention_dropout_rate"] == 0.3
    assert mc["qkv_has_bias"] is True and mc["add_bias_linear"] is False
    assert tc["loss_scale_value"] == 4096.0 and tc["loss_scale_factor"] == 5 and tc["crc_check"] is True
    assert doc["dataset_config"]["batch_size"] == 3
    assert mc["fa_config"] == {"pre_tokens": 2048, "next_tokens": 0, "input_layout": "SBH"}
    assert mc["use_flash_attention"] is True and tc["training_iters"] == 77
