"""Megatron-LM's arguments (core_v0.16 era) as data, and the values Megatron derives from them.

Why a table: every other target (MindSpeed-Core-MS, MindFormers, HF, ...) maps
from these names, an unknown flag is only "unknown" against a complete list,
and a value is only "the default" against Megatron's own defaults.

One row per argparse destination: `A(dest, kind, default, *flags, choices=...)`.
The flag is `--dest-with-dashes` unless given. `kind` says how the flag parses:
INT / FLOAT / STR take one value, INTS / FLOATS / STRS one or more, TRUE is
store_true, FALSE is store_false (its flag is spelled `--no-...` /
`--disable-...`), BOOLOPT is `--x` / `--no-x`. Arguments with a custom argparse
type (tuples, enum names, frequency patterns) are kept as STR text.

Then DERIVED: values Megatron computes in `validate_args` (ffn_hidden_size,
kv_channels, padded vocab, params_dtype, data-parallel size, ...), each with an
`invert` that turns a derived value read from another format back into flags.
Then CHECKS: contradictions Megatron refuses, reported with the offending flags.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from interop.mappings.lora_modules import same_targets
from interop.spec import padded_vocab_size as _pad_vocab

INT, FLOAT, STR = "int", "float", "str"
INTS, FLOATS, STRS = "ints", "floats", "strs"
TRUE, FALSE, BOOLOPT = "store_true", "store_false", "bool_optional"
LISTS = (INTS, FLOATS, STRS)
BOOLS = (TRUE, FALSE, BOOLOPT)


@dataclass(frozen=True)
class Arg:
    dest: str
    kind: str
    default: object = None
    flags: tuple = ()  # empty: Megatron computes it, there is no flag for it
    choices: tuple | None = None
    origin: str = "megatron"  # or "mindspeed" (MindSpeed / MindSpeed-Core-MS parser), "mindspeed-llm" / "mindspeed-mm"
    # (those forks' own flags), "launcher", "bridge" (Megatron-Bridge layer-spec facts)

    @property
    def flag(self) -> str | None:
        return self.flags[0] if self.flags else None


def A(dest, kind, default=None, *flags, choices=None, origin="megatron"):
    if not flags:
        flags = ("--" + dest.replace("_", "-"),)
        if kind == BOOLOPT:
            flags += ("--no-" + dest.replace("_", "-"),)
    return Arg(dest, kind, default, tuple(flags), choices, origin)


def COMPUTED(dest, kind, default=None, origin="megatron"):
    """An attribute of Megatron's args namespace that no flag sets."""
    return Arg(dest, kind, default, (), None, origin)


# Upstream Megatron-LM core_v0.16 (megatron/training/arguments.py + TransformerConfig fields).
# norm_epsilon: v0.16 stores `--norm-epsilon` as layernorm_epsilon; we keep the long-standing
# name that checkpoints, MindSpeed and the seed table use (CHECKPOINT_ALIASES maps it back).
MEGATRON = [
    A('tensor_model_parallel_size', INT, 1),
    A('pipeline_model_parallel_comm_backend', STR, None, choices=('nccl', 'ucc')),
    A('pipeline_model_parallel_size', INT, 1),
    A('sequence_parallel', TRUE, False),
    A('context_parallel_size', INT, 1),
    A('hierarchical_context_parallel_sizes', INTS),
    A('max_seqlen_per_dp_cp_rank', INT),
    A('hybrid_context_parallel', TRUE, False),
    A('expert_model_parallel_size', INT, 1),
    A('expert_tensor_parallel_size', INT),
    A('moe_extended_tp', TRUE, False),
    A('perform_initialization', FALSE, True, '--no-initialization'),
    A('use_cpu_initialization', TRUE),
    A('fp16', TRUE, False),
    A('bf16', TRUE, False),
    A('deterministic_mode', TRUE, False),
    A('async_tensor_model_parallel_allreduce', FALSE, True, '--no-async-tensor-model-parallel-allreduce', '--disable-async-tensor-model-parallel-allreduce'),
    A('tp_comm_overlap', TRUE, False),
    A('tp_comm_bulk_wgrad', FALSE, True, '--no-tp-comm-bulk-wgrad', '--disable-tp-comm-bulk-wgrad'),
    A('tp_comm_bulk_dgrad', FALSE, True, '--no-tp-comm-bulk-dgrad', '--disable-tp-comm-bulk-dgrad'),
    A('tp_comm_overlap_ag', FALSE, True, '--no-tp-comm-overlap-ag', '--disable-tp-comm-overlap-ag'),
    A('tp_comm_overlap_rs', FALSE, True, '--no-tp-comm-overlap-rs', '--disable-tp-comm-overlap-rs'),
    A('tp_comm_overlap_rs_dgrad', TRUE, False),
    A('tp_comm_split_ag', FALSE, True, '--no-tp-comm-split-ag', '--disable-tp-comm-split-ag'),
    A('tp_comm_split_rs', FALSE, True, '--no-tp-comm-split-rs', '--disable-tp-comm-split-rs'),
    A('cross_entropy_loss_fusion', TRUE, False),
    A('cross_entropy_fusion_impl', STR, 'native', choices=('native', 'te')),
    A('tp_comm_bootstrap_backend', STR, 'nccl', choices=('nccl', 'mpi', 'gloo')),
    A('overlap_moe_expert_parallel_comm', TRUE, False),
    A('delay_wgrad_compute', TRUE, False),
    A('ep_overlap_early_attn_memory_release', TRUE, False),
    A('use_ring_exchange_p2p', TRUE, False),
    A('defer_embedding_wgrad_compute', TRUE, False),
    A('wgrad_deferral_limit', INT, 0),
    A('overlap_p2p_comm_warmup_flush', TRUE, False, '--overlap-p2p-communication-warmup-flush'),
    A('microbatch_group_size_per_vp_stage', INT, None, '--microbatch-group-size-per-virtual-pipeline-stage'),
    A('mtp_standalone', TRUE, False),
    A('cpu_offloading_num_layers', INT, 0),
    A('num_layers', INT),
    A('mtp_num_layers', INT),
    A('mtp_loss_scaling_factor', FLOAT, 0.1),
    A('account_for_embedding_in_pipeline_split', TRUE, False),
    A('account_for_loss_in_pipeline_split', TRUE, False),
    A('hidden_size', INT),
    A('num_attention_heads', INT),
    A('attention_backend', STR, 'auto', choices=('flash', 'fused', 'unfused', 'local', 'auto')),
    A('softmax_type', STR, 'vanilla', choices=('vanilla', 'off-by-one', 'learnable')),
    A('num_query_groups', INT, 1),
    A('ffn_hidden_size', INT),
    A('kv_channels', INT),
    A('hidden_dropout', FLOAT, 0.1),
    A('attention_dropout', FLOAT, 0.1),
    A('fp32_residual_connection', TRUE, False),
    A('apply_residual_connection_post_layernorm', TRUE, False),
    A('norm_epsilon', FLOAT, 1e-05),
    A('layernorm_zero_centered_gamma', TRUE, False, '--apply-layernorm-1p'),
    A('add_bias_linear', FALSE, True, '--disable-bias-linear'),
    A('add_qkv_bias', TRUE, False),
    A('glu_linear_offset', FLOAT, 0.0),
    A('activation_func_clamp_value', FLOAT),
    A('rotary_interleaved', TRUE, False),
    A('normalization', STR, 'LayerNorm', choices=('LayerNorm', 'RMSNorm')),
    A('qk_layernorm', TRUE, False),
    A('qk_l2_norm', TRUE, False),
    A('qk_clip', TRUE, False),
    A('qk_clip_alpha', FLOAT, 0.5),
    A('qk_clip_threshold', FLOAT, 100),
    A('attention_output_gate', TRUE, False),
    A('calculate_per_token_loss', TRUE, False),
    A('multi_latent_attention', TRUE, False),
    A('experimental_attention_variant', STR, None, choices=('gated_delta_net', 'dsa')),
    A('dsa_indexer_n_heads', INT),
    A('dsa_indexer_head_dim', INT),
    A('dsa_indexer_topk', INT),
    A('dsa_indexer_loss_coeff', FLOAT),
    A('dsa_indexer_use_sparse_loss', TRUE, False),
    A('linear_conv_kernel_dim', INT, 4),
    A('linear_key_head_dim', INT, 128),
    A('linear_value_head_dim', INT, 128),
    A('linear_num_key_heads', INT, 16),
    A('linear_num_value_heads', INT, 32),
    A('init_method_std', FLOAT, 0.02),
    A('embedding_init_method_std', FLOAT),
    A('init_model_with_meta_device', TRUE, False),
    A('apply_query_key_layer_scaling', TRUE, False),
    A('disable_bf16_reduced_precision_matmul', TRUE, False),
    A('use_fused_weighted_squared_relu', TRUE, False),
    A('recompute_granularity', STR, None, choices=('full', 'selective')),
    A('recompute_method', STR, None, choices=('uniform', 'block')),
    A('recompute_num_layers', INT),
    A('distribute_saved_activations', TRUE, False),
    A('recompute_modules', STRS),
    A('fp8', STR, None, '--fp8-format', choices=('e4m3', 'hybrid')),
    A('fp8_recipe', STR, 'delayed', choices=('tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom')),
    A('fp8_quantizer_factory', STR),
    A('fp8_margin', INT, 0),
    A('fp8_interval', INT, 1),
    A('fp8_amax_history_len', INT, 1),
    A('fp8_amax_compute_algo', STR, 'most_recent', choices=('most_recent', 'max')),
    A('fp8_wgrad', FALSE, True, '--no-fp8-wgrad', '--disable-fp8-wgrad'),
    A('first_last_layers_bf16', TRUE, False),
    A('num_layers_at_start_in_bf16', INT, 1),
    A('num_layers_at_end_in_bf16', INT, 1),
    A('use_kitchen_attention', TRUE, False),
    A('kitchen_attention_backend', STR, 'sdpa', choices=('sdpa', 'fa')),
    A('fp4', STR, None, '--fp4-format', choices=('e2m1',)),
    A('fp4_recipe', STR, 'nvfp4', choices=('nvfp4', 'custom')),
    A('fp4_param', TRUE, False, '--fp4-param-gather'),
    A('fp4_quantizer_factory', STR),
    A('moe_shared_expert_intermediate_size', INT),
    A('moe_shared_expert_gate', TRUE, False),
    A('moe_shared_expert_overlap', TRUE, False),
    A('moe_ffn_hidden_size', INT),
    A('moe_router_topk', INT, 2),
    A('moe_enable_routing_replay', TRUE, False),
    A('moe_router_padding_for_quantization', TRUE, False),
    A('moe_router_padding_for_fp8', TRUE, False),
    A('moe_router_num_groups', INT),
    A('moe_router_group_topk', INT),
    A('moe_router_pre_softmax', TRUE, False),
    A('moe_router_topk_scaling_factor', FLOAT),
    A('moe_router_score_function', STR, 'softmax', choices=('softmax', 'sigmoid')),
    A('moe_router_dtype', STR, None, choices=('fp32', 'fp64')),
    A('moe_router_enable_expert_bias', TRUE, False),
    A('moe_router_bias_update_rate', FLOAT, 0.001),
    A('moe_router_force_load_balancing', TRUE, False),
    A('moe_grouped_gemm', TRUE, False),
    A('moe_use_legacy_grouped_gemm', TRUE, False),
    A('moe_z_loss_coeff', FLOAT),
    A('moe_input_jitter_eps', FLOAT),
    A('moe_token_dispatcher_type', STR, 'allgather', choices=('allgather', 'alltoall', 'flex')),
    A('moe_enable_deepep', TRUE, False),
    A('moe_flex_dispatcher_backend', STR, 'deepep', choices=('deepep', 'hybridep')),
    A('moe_per_layer_logging', TRUE, False),
    A('moe_expert_capacity_factor', FLOAT),
    A('moe_pad_expert_input_to_capacity', TRUE, False),
    A('moe_token_drop_policy', STR, 'probs', choices=('probs', 'position')),
    A('moe_layer_recompute', TRUE, False),
    A('moe_permute_fusion', TRUE, False),
    A('moe_router_fusion', TRUE, False),
    A('moe_apply_probs_on_input', TRUE, False),
    A('moe_latent_size', INT),
    A('moe_deepep_num_sms', INT, 20),
    A('moe_hybridep_num_sms', INT, 16),
    A('enable_cuda_graph', TRUE, False),
    A('cuda_graph_warmup_steps', INT, 3),
    A('external_cuda_graph', TRUE, False),
    A('cuda_graph_impl', STR, 'none', choices=('none', 'local', 'transformer_engine')),
    A('clone_scatter_output_in_embedding', FALSE, True, '--no-clone-scatter-output-in-embedding', '--disable-clone-scatter-output-in-embedding'),
    A('config_logger_dir', STR, ''),
    A('flash_decode', TRUE, False),
    A('batch_invariant_mode', TRUE, False),
    A('use_te_activation_func', TRUE, False),
    A('symmetric_ar_type', STR, None, choices=('two_shot', 'one_shot', 'multimem_all_reduce')),
    A('inference_fuse_tp_communication', TRUE, False),
    A('mrope_section', INTS),
    A('is_hybrid_model', TRUE, False),
    A('mamba_state_dim', INT, 128),
    A('mamba_head_dim', INT, 64),
    A('mamba_num_groups', INT, 8),
    A('mamba_num_heads', INT),
    A('use_mamba_mem_eff_path', FALSE, True, '--disable-mamba-mem-eff-path'),
    A('mlp_chunks_for_prefill', INT, 1),
    A('transformer_impl', STR, 'transformer_engine', choices=('local', 'transformer_engine', 'inference_optimized')),
    A('fine_grained_activation_offloading', TRUE, False),
    A('offload_modules', STRS, []),
    A('min_offloaded_tensor_size', INT, 1048576),
    A('encoder_num_layers', INT),
    A('decoder_num_layers', INT),
    A('group_query_attention', TRUE, False),
    A('window_size', STR),
    A('window_attn_skip_freq', STR),
    A('max_position_embeddings', INT),
    A('position_embedding_type', STR, 'learned_absolute', choices=('learned_absolute', 'rope', 'mrope', 'relative', 'none')),
    A('relative_attention_num_buckets', INT, 32),
    A('relative_attention_max_distance', INT, 128),
    A('use_rotary_position_embeddings', TRUE, False),
    A('rotary_base', INT, 10000),
    A('rotary_percent', FLOAT, 1.0),
    A('rotary_seq_len_interpolation_factor', INT),
    A('use_rope_scaling', TRUE, False),
    A('rope_scaling_factor', FLOAT, 8.0),
    A('no_rope_freq', STR),
    A('add_position_embedding', FALSE, True, '--no-position-embedding'),
    A('make_vocab_size_divisible_by', INT, 128),
    A('openai_gelu', TRUE, False),
    A('squared_relu', TRUE, False),
    A('swiglu', TRUE, False),
    A('quick_geglu', TRUE, False),
    A('onnx_safe', STR),
    A('bert_binary_head', FALSE, True, '--bert-no-binary-head'),
    A('untie_embeddings_and_output_weights', TRUE, False),
    A('weight_decay', FLOAT, 0.01),
    A('apply_wd_to_qk_layernorm', TRUE, False),
    A('clip_grad', FLOAT, 1.0),
    A('adam_beta1', FLOAT, 0.9),
    A('adam_beta2', FLOAT, 0.999),
    A('adam_eps', FLOAT, 1e-08),
    A('sgd_momentum', FLOAT, 0.9),
    A('muon_momentum', FLOAT, 0.9),
    A('muon_split_qkv', FALSE, True, '--muon-no-split-qkv'),
    A('muon_use_nesterov', TRUE, False),
    A('muon_scale_mode', STR, 'spectral', choices=('spectral', 'unit_rms_norm', 'shape_scaling')),
    A('muon_fp32_matmul_prec', STR, 'medium', choices=('low', 'medium', 'high')),
    A('muon_num_ns_steps', INT, 5),
    A('muon_tp_mode', STR, 'blockwise', choices=('blockwise', 'duplicated', 'distributed')),
    A('muon_extra_scale_factor', FLOAT, 1.0),
    A('no_weight_decay_cond_type', STR, None, choices=('apply_wd_to_qk_layernorm',)),
    A('profile', TRUE, False),
    A('profile_step_start', INT, 10),
    A('profile_step_end', INT, 12),
    A('use_pytorch_profiler', TRUE, False),
    A('profile_ranks', INTS, [0]),
    A('record_memory_history', TRUE, False),
    A('memory_snapshot_path', STR, 'snapshot.pickle'),
    A('micro_batch_size', INT),
    A('global_batch_size', INT),
    A('rampup_batch_size', INTS),
    A('decrease_batch_size_if_needed', TRUE, False),
    A('empty_unused_memory_level', INT, 0, choices=('0', '1', '2')),
    A('check_weight_hash_across_dp_replicas_interval', INT),
    A('train_sync_interval', INT),
    A('train_iters', INT),
    A('train_samples', INT),
    A('exit_interval', INT),
    A('exit_duration_in_mins', INT),
    A('exit_signal_handler', TRUE, False),
    A('exit_signal', STR, 'SIGTERM'),
    A('exit_signal_handler_for_dataloader', TRUE, False),
    A('manual_gc', TRUE, False),
    A('manual_gc_interval', INT, 0),
    A('manual_gc_eval', FALSE, True, '--no-manual-gc-eval', '--disable-manual-gc-eval'),
    A('iterations_to_skip', INTS, []),
    A('batch_size', INT),
    A('recompute_activations', TRUE, False),
    A('check_for_nan_in_loss_and_grad', FALSE, True, '--no-check-for-nan-in-loss-and-grad'),
    A('check_for_large_grads', TRUE, False),
    A('result_rejected_tracker_filename', STR),
    A('enable_gloo_process_groups', FALSE, True, '--disable-gloo-process-groups'),
    A('tp_comm_overlap_cfg', STR),
    A('checkpoint_activations', TRUE, False),
    A('masked_softmax_fusion', FALSE, True, '--no-masked-softmax-fusion'),
    A('bias_gelu_fusion', FALSE, True, '--no-bias-gelu-fusion'),
    A('bias_swiglu_fusion', FALSE, True, '--no-bias-swiglu-fusion'),
    A('bias_dropout_fusion', FALSE, True, '--no-bias-dropout-fusion'),
    A('apply_rope_fusion', FALSE, True, '--no-rope-fusion'),
    A('rope_type', STR, None, choices=('rope', 'yarn')),
    A('use_flash_attn', TRUE, False),
    A('optimizer', STR, 'adam', choices=('adam', 'sgd', 'muon', 'dist_muon')),
    A('optimizer_cpu_offload', TRUE, False),
    A('optimizer_offload_fraction', FLOAT, 1.0),
    A('use_torch_optimizer_for_cpu_offload', TRUE, False),
    A('overlap_cpu_optimizer_d2h_h2d', TRUE, False),
    A('dump_param_to_param_group_map', STR),
    A('pin_cpu_grads', FALSE, True, '--no-pin-cpu-grads'),
    A('pin_cpu_params', FALSE, True, '--no-pin-cpu-params'),
    A('dataloader_type', STR, None, choices=('single', 'cyclic', 'external')),
    A('no_persist_layer_norm', TRUE, False),
    A('gradient_accumulation_fusion', FALSE, True, '--no-gradient-accumulation-fusion'),
    A('deprecated_use_mcore_models', TRUE, False, '--use-mcore-models'),
    A('use_legacy_models', TRUE, False),
    A('high_priority_stream_groups', STRS, []),
    A('disable_jit_fuser', TRUE, False),
    A('perform_rl_step', TRUE, False),
    A('rl_prompts_per_eval', INT, 32),
    A('grpo_prompts_per_step', INT, 32),
    A('grpo_group_size', INT, 2),
    A('grpo_iterations', INT, 2),
    A('grpo_clamp_eps_lower', FLOAT, 0.01),
    A('grpo_clamp_eps_upper', FLOAT, 0.01),
    A('grpo_kl_beta', FLOAT, 0.001),
    A('grpo_entropy_term_weight', FLOAT, 0.0),
    A('grpo_filter_groups_with_same_reward', TRUE, False),
    A('langrl_inference_server_type', STR, 'inplace_megatron', choices=('inplace_megatron', 'inplace_megatron_chat')),
    A('langrl_inference_server_conversation_template', STR),
    A('langrl_external_server', BOOLOPT, False),
    A('langrl_env_config', STR),
    A('rl_default_temperature', FLOAT, 1.0),
    A('rl_default_top_p', FLOAT, 0),
    A('rl_default_top_k', INT, -1),
    A('rl_offload_optimizer_during_inference', TRUE, False),
    A('rl_offload_kv_cache_during_training', BOOLOPT, False),
    A('rl_remove_kv_cache_during_training', BOOLOPT, False),
    A('rl_reset_cuda_graphs', BOOLOPT, False),
    A('rl_partial_rollouts', BOOLOPT, False),
    A('rl_inference_logprobs_is_correction', BOOLOPT, False),
    A('rl_importance_sampling_truncation_coef', FLOAT),
    A('rl_use_sequence_packing', BOOLOPT, False),
    A('rl_sequence_packing_max_sequences_per_bin', INT, 50),
    A('rl_sequence_packing_algo', STR, 'fifo', choices=('fifo', 'round-robin')),
    A('rl_training_cuda_graphs', BOOLOPT, False),
    A('rl_inference_tensor_model_parallel_size', INT),
    A('rl_inference_pipeline_model_parallel_size', INT),
    A('rl_inference_expert_model_parallel_size', INT),
    A('rl_inference_expert_tensor_model_parallel_size', INT),
    A('rl_inference_model_unified_memory_level', INT, 0, choices=('0', '1')),
    A('rl_offload_inference_model_weights_when_idle', BOOLOPT, False),
    A('refit_method', STR, 'gloo', choices=('nccl', 'gloo', 'nvshmem')),
    A('rl_verify_model_weights_swap', BOOLOPT, False),
    A('rl_parallel_generation_tasks', INT, 512),
    A('rl_skip_bos_token', BOOLOPT, False),
    A('seed', INT, 1234),
    A('te_rng_tracker', TRUE, False),
    A('inference_rng_tracker', TRUE, False),
    A('data_parallel_random_init', TRUE, False),
    A('init_method_xavier_uniform', TRUE, False),
    A('lr_decay_style', STR, 'linear', choices=('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD')),
    A('lr_wsd_decay_style', STR, 'exponential', choices=('exponential', 'linear', 'cosine', 'minus_sqrt')),
    A('lr_decay_iters', INT),
    A('lr_decay_samples', INT),
    A('lr_wsd_decay_iters', INT),
    A('lr_wsd_decay_samples', INT),
    A('lr_warmup_fraction', FLOAT),
    A('lr_warmup_iters', INT, 0),
    A('lr_warmup_samples', INT, 0),
    A('lr_warmup_init', FLOAT, 0.0),
    A('override_opt_param_scheduler', TRUE, False, '--override-opt_param-scheduler', '--override-opt-param-scheduler'),
    A('use_checkpoint_opt_param_scheduler', TRUE, False, '--use-checkpoint-opt_param-scheduler', '--use-checkpoint-opt-param-scheduler'),
    A('start_weight_decay', FLOAT),
    A('end_weight_decay', FLOAT),
    A('weight_decay_incr_style', STR, 'constant', choices=('constant', 'linear', 'cosine')),
    A('lr', FLOAT),
    A('warmup', INT),
    A('min_lr', FLOAT, 0.0),
    A('decoupled_lr', FLOAT),
    A('decoupled_min_lr', FLOAT),
    A('save', STR),
    A('save_interval', INT, None, '--save-interval', '--persistent-save-interval'),
    A('save_wgrads_interval', INT),
    A('save_dgrads_interval', INT),
    A('save_retain_interval', INT),
    A('load', STR),
    A('load_main_params_from_ckpt', TRUE, False),
    A('non_persistent_save_interval', INT),
    A('non_persistent_ckpt_type', STR, None, choices=('global', 'local', 'in_memory')),
    A('non_persistent_global_ckpt_dir', STR),
    A('non_persistent_local_ckpt_dir', STR),
    A('non_persistent_local_ckpt_algo', STR, 'fully_parallel', choices=('fully_parallel', 'atomic')),
    A('finetune', TRUE, False),
    A('pretrained_checkpoint', STR),
    A('ckpt_step', INT),
    A('use_checkpoint_args', TRUE, False),
    A('use_mp_args_from_checkpoint_args', TRUE, False),
    A('use_tokenizer_model_from_checkpoint_args', FALSE, True, '--no-use-tokenizer-model-from-checkpoint-args', '--disable-use-tokenizer-model-from-checkpoint-args'),
    A('exit_on_missing_checkpoint', TRUE, False),
    A('ckpt_format', STR, 'torch_dist', choices=('torch', 'torch_dist', 'torch_dcp', 'fsdp_dtensor')),
    A('auto_detect_ckpt_format', TRUE, False),
    A('ckpt_convert_format', STR, None, choices=('torch', 'torch_dist')),
    A('ckpt_convert_save', STR),
    A('ckpt_convert_update_legacy_dist_opt_format', TRUE, False),
    A('ckpt_fully_parallel_save', FALSE, True, '--no-ckpt-fully-parallel-save', '--disable-ckpt-fully-parallel-save'),
    A('async_save', TRUE, False),
    A('use_persistent_ckpt_worker', TRUE, False),
    A('ckpt_fully_parallel_load', TRUE, False),
    A('ckpt_assume_constant_structure', TRUE, False),
    A('strict_fsdp_dtensor_load', FALSE, True, '--no-strict-fsdp-dtensor-load', '--disable-strict-fsdp-dtensor-load'),
    A('dist_ckpt_strictness', STR, 'assume_ok_unexpected', choices=('assume_ok_unexpected', 'log_unexpected', 'log_all', 'raise_unexpected', 'raise_all', 'return_unexpected', 'return_all', 'ignore_all')),
    A('dist_ckpt_save_pre_mcore_014', TRUE, False),
    A('dist_ckpt_optim_fully_reshardable', TRUE, False),
    A('distrib_optim_fully_reshardable_mem_efficient', TRUE, False),
    A('replication', TRUE, False),
    A('replication_jump', INT),
    A('replication_factor', INT, 2),
    A('no_save_optim', TRUE),
    A('no_save_rng', TRUE),
    A('no_load_optim', TRUE),
    A('no_load_rng', TRUE),
    A('use_dist_ckpt_deprecated', TRUE, False, '--use-dist-ckpt'),
    A('dist_ckpt_format_deprecated', STR, None, '--dist-ckpt-format'),
    A('ckpt_fully_parallel_save_deprecated', TRUE, False, '--ckpt-fully-parallel-save'),
    A('grad_reduce_in_bf16', TRUE, False),
    A('loss_scale', FLOAT),
    A('initial_loss_scale', FLOAT, 4294967296),
    A('min_loss_scale', FLOAT, 1.0),
    A('loss_scale_window', FLOAT, 1000),
    A('hysteresis', INT, 2),
    A('attention_softmax_in_fp32', TRUE, False),
    A('accumulate_allreduce_grads_in_fp32', TRUE, False),
    A('fp16_lm_cross_entropy', TRUE, False),
    A('reuse_grad_buf_for_mxfp8_param_ag', TRUE, False),
    A('decoder_first_pipeline_num_layers', INT),
    A('decoder_last_pipeline_num_layers', INT),
    A('pipeline_model_parallel_layout', STR),
    A('model_parallel_size', INT),
    A('num_layers_per_virtual_pipeline_stage', INT),
    A('num_virtual_stages_per_pipeline_rank', INT),
    A('overlap_p2p_comm', FALSE, True, '--no-overlap-p2p-communication'),
    A('distributed_backend', STR, 'nccl', choices=('nccl', 'gloo')),  # MindSpeed's 'hccl' passes as a fork value
    A('distributed_timeout_minutes', INT, 10),
    A('distributed_timeout_seconds_after_init', INT),
    A('overlap_grad_reduce', TRUE, False),
    A('align_grad_reduce', FALSE, True, '--no-align-grad-reduce'),
    A('ddp_num_buckets', INT),
    A('ddp_bucket_size', INT),
    A('ddp_pad_buckets_for_high_nccl_busbw', TRUE, False),
    A('ddp_reduce_scatter_with_fp32_accumulation', TRUE, False),
    A('ddp_average_in_collective', TRUE, False),
    A('overlap_param_gather', TRUE, False),
    A('overlap_param_gather_with_optimizer_step', TRUE, False),
    A('align_param_gather', FALSE, True, '--no-align-param-gather'),
    A('scatter_gather_tensors_in_pipeline', FALSE, True, '--no-scatter-gather-tensors-in-pipeline'),
    A('local_rank', INT, 0),
    A('lazy_mpu_init', STR),
    A('use_distributed_optimizer', TRUE, False),
    A('nccl_ub', TRUE, False, '--use-nccl-ub'),
    A('disable_symmetric_registration', TRUE, False),
    A('fsdp_manual_registration', TRUE, False),
    A('use_sharp', TRUE, False),
    A('sharp_enabled_group', STR, None, choices=('dp', 'dp_replica')),
    A('create_all_gather_group', TRUE, False),
    A('use_megatron_fsdp', TRUE, False),
    A('data_parallel_sharding_strategy', STR, 'no_shard', choices=('no_shard', 'optim', 'optim_grads', 'optim_grads_params')),
    A('outer_dp_sharding_strategy', STR, 'no_shard', choices=('no_shard', 'optim')),
    A('gradient_reduce_div_fusion', FALSE, True, '--no-gradient-reduce-div-fusion'),
    A('fsdp_double_buffer', TRUE, False),
    A('suggested_communication_unit_size', INT),
    A('keep_fp8_transpose_cache', TRUE, False),
    A('enable_full_sharding_in_hsdp', TRUE, False),
    A('num_distributed_optimizer_instances', INT, 1),
    A('use_torch_fsdp2', TRUE, False),
    A('torch_fsdp2_reshard_after_forward', FALSE, True, '--torch-fsdp2-no-reshard-after-forward'),
    A('cp_comm_type', STRS, ['p2p']),
    A('nccl_communicator_config_path', STR),
    A('use_tp_pp_dp_mapping', TRUE, False),
    A('fake_process_group', TRUE, False),
    A('eval_iters', INT, 100),
    A('eval_interval', INT),
    A('skip_train', TRUE, False),
    A('test_mode', TRUE, False),
    A('full_validation', TRUE, False),
    A('multiple_validation_sets', TRUE, False),
    A('data_path', STRS),
    A('phase_transition_iterations', STR),
    A('split', STR),
    A('train_data_path', STRS),
    A('valid_data_path', STRS),
    A('test_data_path', STRS),
    A('data_args_path', STR),
    A('per_split_data_args_path', STR),
    A('per_dataset_sequences_path', STR),
    A('dataloader_fast_cache_load', TRUE, False),
    A('dataloader_defer_npy_index_mmap', TRUE, False),
    A('data_cache_path', STR),
    A('mmap_bin_files', FALSE, True, '--no-mmap-bin-files'),
    A('mock_data', TRUE, False),
    A('seq_length', INT),
    A('encoder_seq_length', INT),
    A('decoder_seq_length', INT),
    A('sample_rate', FLOAT, 1.0),
    A('mask_prob', FLOAT, 0.15),
    A('short_seq_prob', FLOAT, 0.1),
    A('num_workers', INT, 2),
    A('reset_position_ids', TRUE, False),
    A('reset_attention_mask', TRUE, False),
    A('eod_mask_loss', TRUE, False),
    A('create_attention_mask_in_dataloader', FALSE, True, '--no-create-attention-mask-in-dataloader'),
    A('num_dataset_builder_threads', INT, 1),
    A('object_storage_cache_path', STR),
    A('mid_level_dataset_surplus', FLOAT, 0.005),
    A('allow_ambiguous_pad_tokens', TRUE, False),
    A('fim_data', TRUE, False),
    A('fim_rate', FLOAT, 0.5),
    A('fim_spm_rate', FLOAT, 0.5),
    A('fim_split_sample', STR),
    A('fim_fragment_rate', FLOAT),
    A('fim_no_prefix', STR),
    A('fim_prefix_token', STR, '<fim_prefix>'),
    A('fim_middle_token', STR, '<fim_middle>'),
    A('fim_suffix_token', STR, '<fim_suffix>'),
    A('fim_pad_token', STR, '<fim_pad>'),
    A('fim_eod_token', STR, '<|endoftext|>'),
    A('vocab_size', INT),
    A('padded_vocab_size', INT),
    A('vocab_file', STR),
    A('merge_file', STR),
    A('vocab_extra_ids', INT, 0),
    A('tokenizer_type', STR, None, choices=('BertWordPieceLowerCase', 'BertWordPieceCase', 'GPT2BPETokenizer', 'SentencePieceTokenizer', 'GPTSentencePieceTokenizer', 'HuggingFaceTokenizer', 'Llama2Tokenizer', 'TikTokenizer', 'MultimodalTokenizer', 'NullTokenizer', 'NullMultimodalTokenizer', 'SFTTokenizer')),
    A('tokenizer_model', STR),
    A('tokenizer_metadata', STR),
    A('tokenizer_special_tokens', STRS),
    A('legacy_tokenizer', TRUE, False),
    A('tiktoken_pattern', STR),
    A('tiktoken_num_special_tokens', INT, 1000),
    A('tiktoken_special_tokens', STRS),
    A('tokenizer_sentencepiece_legacy', TRUE, False),
    A('tokenizer_hf_use_fast', TRUE, False),
    A('tokenizer_hf_include_special_tokens', TRUE, False),
    A('trust_remote_code', TRUE, False),
    A('adlr_autoresume', TRUE, False),
    A('adlr_autoresume_interval', INT, 1000),
    A('ict_head_size', INT),
    A('biencoder_projection_dim', INT, 0),
    A('biencoder_shared_query_context_model', TRUE, False),
    A('ict_load', STR),
    A('bert_load', STR),
    A('titles_data_path', STR),
    A('query_in_block_prob', FLOAT, 0.1),
    A('use_one_sent_docs', TRUE, False),
    A('evidence_data_path', STR),
    A('retriever_report_topk_accuracies', INTS, []),
    A('retriever_score_scaling', TRUE, False),
    A('block_data_path', STR),
    A('embedding_path', STR),
    A('indexer_batch_size', INT, 128),
    A('indexer_log_interval', INT, 1000),
    A('num_classes', INT, 1000),
    A('img_h', INT, 224),
    A('img_w', INT, 224),
    A('num_channels', INT, 3),
    A('patch_dim', INT, 16),
    A('classes_fraction', FLOAT, 1.0),
    A('data_per_class_fraction', FLOAT, 1.0),
    A('data_sharding', FALSE, True, '--no-data-sharding'),
    A('head_lr_mult', FLOAT, 1.0),
    A('vision_pretraining', TRUE, False),
    A('vision_pretraining_type', STR, 'classify', choices=('classify', 'inpaint', 'dino')),
    A('vision_backbone_type', STR, 'vit', choices=('vit', 'mit', 'swin')),
    A('swin_backbone_type', STR, 'tiny', choices=('tiny', 'base', 'h3')),
    A('mask_type', STR, 'random', choices=('random', 'row')),
    A('mask_factor', FLOAT, 1.0),
    A('iter_per_epoch', INT, 1250),
    A('dino_local_img_size', INT, 96),
    A('dino_local_crops_number', INT, 10),
    A('dino_head_hidden_size', INT, 2048),
    A('dino_bottleneck_size', INT, 256),
    A('dino_freeze_last_layer', FLOAT, 1),
    A('dino_norm_last_layer', TRUE, False),
    A('dino_warmup_teacher_temp', FLOAT, 0.04),
    A('dino_teacher_temp', FLOAT, 0.07),
    A('dino_warmup_teacher_temp_epochs', INT, 30),
    A('num_experts', INT),
    A('moe_layer_freq', STR, 1),
    A('moe_use_upcycling', TRUE, False),
    A('moe_router_load_balancing_type', STRS, 'aux_loss', choices=('aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn', 'none')),
    A('moe_aux_loss_coeff', FLOATS, 0.0),
    A('moe_upcycling_granularity', INT, 1),
    A('moe_pad_experts_for_cuda_graph_inference', TRUE, False),
    A('q_lora_rank', INT),
    A('kv_lora_rank', INT, 32),
    A('qk_head_dim', INT, 128),
    A('qk_pos_emb_head_dim', INT, 64),
    A('v_head_dim', INT, 128),
    A('rotary_scaling_factor', FLOAT, 1.0),
    A('mscale', FLOAT, 1.0),
    A('mscale_all_dim', FLOAT, 0.0),
    A('cache_mla_latents', TRUE, False),
    A('linear_attention_freq', STR),
    A('heterogeneous_layers_config_path', STR),
    A('heterogeneous_layers_config_encoded_json', STR),
    A('log_interval', INT, 100),
    A('log_params_norm', TRUE, False),
    A('log_throughput', TRUE, False),
    A('log_progress', TRUE, False),
    A('timing_log_level', INT, 0, choices=('0', '1', '2')),
    A('timing_log_option', STR, 'minmax', choices=('max', 'minmax', 'all')),
    A('tensorboard_dir', STR),
    A('tensorboard_log_interval', INT, 1),
    A('tensorboard_queue_size', INT, 1000),
    A('log_timers_to_tensorboard', TRUE, False),
    A('log_loss_scale_to_tensorboard', FALSE, True, '--no-log-loss-scale-to-tensorboard', '--disable-log-loss-scale-to-tensorboard'),
    A('log_validation_ppl_to_tensorboard', TRUE, False),
    A('log_memory_to_tensorboard', TRUE, False),
    A('log_memory_interval', INT),
    A('log_device_memory_used', TRUE, False),
    A('log_num_zeros_in_grad', TRUE, False),
    A('log_max_attention_logit', TRUE, False),
    A('barrier_with_L1_time', FALSE, True, '--no-barrier-with-level-1-timing'),
    A('log_world_size_to_tensorboard', TRUE, False),
    A('wandb_project', STR),
    A('wandb_exp_name', STR),
    A('wandb_save_dir', STR),
    A('wandb_entity', STR),
    A('logging_level', INT),
    A('log_energy', TRUE, False),
    A('log_straggler', TRUE, False),
    A('straggler_ctrlr_port', INT, 65535),
    A('straggler_minmax_count', INT, 1),
    A('disable_straggler_on_startup', TRUE, False),
    A('run_workload_inspector_server', TRUE, False),
    A('inference_batch_times_seqlen_threshold', INT, -1),
    A('max_tokens_to_oom', INT, 12000),
    A('output_bert_embeddings', TRUE, False),
    A('bert_embedder_type', STR, 'megatron', choices=('megatron', 'huggingface')),
    A('cuda_graph_scope', STRS, []),
    A('use_legacy_static_engine', TRUE, False),
    A('inference_max_batch_size', INT, 8, '--inference-max-requests'),
    A('inference_max_seq_length', INT, 2560),
    A('inference_max_batch_size', INT),
    A('inference_dynamic_batching', TRUE, False),
    A('inference_dynamic_batching_buffer_size_gb', FLOAT, 40.0),
    A('inference_dynamic_batching_paused_buffer_size_gb', FLOAT),
    A('inference_dynamic_batching_block_size', INT, 256),
    A('inference_dynamic_batching_max_requests', INT),
    A('inference_dynamic_batching_max_tokens', INT),
    A('inference_dynamic_batching_num_cuda_graphs', INT, 16),
    A('inference_dynamic_batching_track_paused_request_events', TRUE, False),
    A('decode_only_cuda_graphs', TRUE, False),
    A('inference_dynamic_batching_unified_memory_level', INT, 0, choices=('0', '1')),
    A('nccl_all_reduce_for_prefill', TRUE, False),
    A('disable_chunked_prefill', FALSE, True, '--enable-chunked-prefill'),
    A('disable_chunked_prefill', TRUE, False),
    A('inference_dynamic_batching_cuda_graph_max_tokens', INT, 16384),
    A('inference_dynamic_batching_cuda_graph_mixed_prefill_count', INT, 16),
    A('inference_logging_step_interval', INT, 0),
    A('inference_wandb_logging', BOOLOPT, False),
    A('inference_coordinator_port', INT, 12346),
    A('fp8_param_gather', TRUE, False),
    A('te_precision_config_file', STR),
    A('enable_experimental', TRUE, False),
    A('spec', STRS),
    A('hybrid_attention_ratio', FLOAT, 0.0),
    A('hybrid_mlp_ratio', FLOAT, 0.0),
    A('hybrid_override_pattern', STR),
    A('yaml_cfg', STR),
    A('use_precision_aware_optimizer', TRUE, False),
    A('main_grads_dtype', STR, 'fp32', choices=('fp32', 'bf16')),
    A('main_params_dtype', STR, 'fp32', choices=('fp32', 'fp16')),
    A('exp_avg_dtype', STR, 'fp32', choices=('fp32', 'fp16', 'bf16', 'fp8')),
    A('exp_avg_sq_dtype', STR, 'fp32', choices=('fp32', 'fp16', 'bf16', 'fp8')),
    A('enable_one_logger', FALSE, True, '--no-one-logger'),
    A('one_logger_project', STR, 'megatron-lm'),
    A('one_logger_run_name', STR),
    A('one_logger_async', TRUE, False),
    A('app_tag_run_name', STR),
    A('app_tag_run_version', STR, '0.0.0'),
    A('inprocess_restart', TRUE, False),
    A('inprocess_max_iterations', INT),
    A('inprocess_monitor_thread_interval', FLOAT, 1.0),
    A('inprocess_monitor_process_interval', FLOAT, 1.0),
    A('inprocess_progress_watchdog_interval', FLOAT, 1.0),
    A('inprocess_heartbeat_interval', FLOAT, 30),
    A('inprocess_soft_timeout', FLOAT, 60),
    A('inprocess_hard_timeout', FLOAT, 90),
    A('inprocess_heartbeat_timeout', FLOAT, 60),
    A('inprocess_barrier_timeout', FLOAT, 120),
    A('inprocess_completion_timeout', FLOAT, 120),
    A('inprocess_last_call_wait', FLOAT, 1),
    A('inprocess_termination_grace_time', FLOAT, 1),
    A('inprocess_granularity', STR, 'node', choices=('node', 'rank')),
    A('inprocess_active_world_size', INT, 1),
    A('inprocess_empty_cuda_cache', TRUE, False),
    A('enable_ft_package', TRUE, False),
    A('calc_ft_timeouts', TRUE, False),
    A('ft_num_warmup_iters', INT, 5),
    A('error_injection_rate', INT, 0),
    A('error_injection_type', STR, 'transient_error', choices=('correct_result', 'transient_error', 'persistent_error')),
    A('rerun_mode', STR, 'validate_results', choices=('disabled', 'validate_results', 'report_stats')),
    A('check_for_spiky_loss', TRUE, False),
    A('enable_msc', FALSE, True, '--disable-msc'),
    A('sft', TRUE, False),
    A('sft_tokenizer_prompt_format', STR, 'nemotron-h-aligned'),
]

# Gone from v0.16 but still in the example scripts people have (core_r0.6 era).
OLDER = [
    A("virtual_pipeline_model_parallel_size", INT, None, origin="megatron<0.16"),
]

# Names the MindSpeed-Core-MS table (seed 001) lists on the Megatron side that upstream
# Megatron-LM lacks: MindSpeed / MindSpeed-Core-MS add them to Megatron's parser. Defaults
# are the table's; None where the table gives none.
MINDSPEED = [
    A("add_dense_bias", BOOLOPT, None, origin="mindspeed"),  # None: follows add_bias_linear
    A("use_sandwich_norm", TRUE, False, origin="mindspeed"),
    A("pre_tockens", INT, None, origin="mindspeed"),
    A("next_tockens", INT, None, origin="mindspeed"),
    A("shape_order", STR, None, choices=("SBH", "BSH", "BSND", "BNSD", "TND"), origin="mindspeed"),
    A("attn_post_norm_scale", FLOAT, 1.0, origin="mindspeed"),
    A("ffn_post_norm_scale", FLOAT, 1.0, origin="mindspeed"),
    A("compute_dtype", STR, None, choices=("float16", "bfloat16", "float32"), origin="mindspeed"),
    A("embedding_dtype", STR, "float32", choices=("float16", "bfloat16", "float32"), origin="mindspeed"),
    A("use_fused_swiglu", TRUE, False, origin="mindspeed"),
    A("use_fused_rmsnorm", TRUE, False, origin="mindspeed"),
    A("use_fused_rotary_pos_emb", TRUE, False, origin="mindspeed"),
    A("jit_compile", TRUE, False, origin="mindspeed"),
    A("hidden_act", STR, None, origin="mindspeed"),  # None: "swiglu" with --swiglu, else "gelu"
    A("resume_training", TRUE, False, origin="mindspeed"),
    A("resume_crc_check", TRUE, False, origin="mindspeed"),
    A("ckpt_prefix", STR, "network", origin="mindspeed"),
    A("keep_checkpoint_max", INT, 5, origin="mindspeed"),
    A("wrap_with_ddp", TRUE, False, origin="mindspeed"),
    A("bucket_size", INT, None, origin="mindspeed"),
    A("enable_mem_align", TRUE, False, origin="mindspeed"),
    A("delay_grad_reduce", TRUE, False, origin="mindspeed"),
    A("new_dataset", TRUE, False, origin="mindspeed"),
    A("profile_save_path", STR, "./{output_dir}/profile", origin="mindspeed"),
    A("profile_level", STR, "level0", choices=("level0", "level1", "level2"), origin="mindspeed"),
    A("profile_with_stack", TRUE, False, origin="mindspeed"),
    A("profile_memory", TRUE, False, origin="mindspeed"),
    A("profile_framework", TRUE, False, origin="mindspeed"),
    A("profile_communication", TRUE, False, origin="mindspeed"),
    A("profile_parallel_strategy", TRUE, False, origin="mindspeed"),
    A("profile_aicore_metrics", INT, 0, origin="mindspeed"),
    A("profile_l2_cache", TRUE, False, origin="mindspeed"),
    A("profile_hbm_ddr", TRUE, False, origin="mindspeed"),
    A("profile_pcie", TRUE, False, origin="mindspeed"),
    A("profile_data_process", TRUE, False, origin="mindspeed"),
    A("profile_data_simplification", TRUE, False, origin="mindspeed"),
    A("profile_op_time", BOOLOPT, True, origin="mindspeed"),
    A("profile_offline_analyse", TRUE, False, origin="mindspeed"),
    A("profile_dynamic_profiler_config_path", STR, "", origin="mindspeed"),
    A("micro_batch_num", INT, None, origin="mindspeed"),  # None: global / (micro * dp)
    A("pad_token_id", INT, None, origin="mindspeed"),
    A("eos_token_id", INT, 0, origin="mindspeed"),
    A("drop_remainder", BOOLOPT, True, origin="mindspeed"),
    A("context_parallel_algo", STR, "ulysses_cp_algo",
      choices=("ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo"), origin="mindspeed"),
    A("ulysses_degree_in_cp", INT, None, origin="mindspeed"),
    A("num_layer_list", STR, None, origin="mindspeed"),
    A("recompute", STR, None, origin="mindspeed"),
    A("select_recompute", STR, None, origin="mindspeed"),
    A("select_comm_recompute", STR, None, origin="mindspeed"),
    # MindSpeed-LLM / MindSpeed-Core-MS launch-script flags (their example scripts): accepted, carried
    # where a target has a field, reported where not.
    A("tokenizer_name_or_path", STR, None, origin="mindspeed"),
    A("use_mc2", TRUE, False, origin="mindspeed"),
    A("reuse_fp32_param", TRUE, False, origin="mindspeed"),
    A("moe_permutation_async_comm", TRUE, False, origin="mindspeed"),
    A("moe_alltoall_overlap_comm", TRUE, False, origin="mindspeed"),
    A("moe_tp_extend_ep", TRUE, False, origin="mindspeed"),
    A("first_k_dense_replace", INT, None, origin="mindspeed"),
    # MindSpeed-LLM's YaRN spellings (examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh: --rope-scaling-type
    # yarn with --rope-scaling-factor 40, --rope-scaling-mscale(-all-dim), --rope-scaling-original-max-position-
    # embeddings, --beta-fast / --beta-slow): derived into megatron-core's rope_type / rotary_scaling_factor / mscale
    A("rope_scaling_type", STR, None, origin="mindspeed"),
    A("rope_scaling_mscale", FLOAT, None, origin="mindspeed"),
    A("rope_scaling_mscale_all_dim", FLOAT, None, origin="mindspeed"),
    A("rope_scaling_original_max_position_embeddings", INT, None, origin="mindspeed"),
    A("beta_fast", FLOAT, None, origin="mindspeed"),
    A("beta_slow", FLOAT, None, origin="mindspeed"),
    A("n_shared_experts", INT, None, origin="mindspeed"),
    A("shared_expert_gate", TRUE, False, origin="mindspeed"),
    A("norm_topk_prob", TRUE, False, origin="mindspeed"),
    A("topk_softmax_in_fp32", TRUE, False, origin="mindspeed"),
    A("use_cp_send_recv_overlap", TRUE, False, origin="mindspeed"),
    A("use_fused_ring_attention_update", TRUE, False, origin="mindspeed"),
    A("no_shared_storage", TRUE, False, origin="mindspeed"),
    A("noop_layers", STR, None, origin="mindspeed"),
    A("handler_name", STR, None, origin="mindspeed"),
    A("prompt_type", STR, None, origin="mindspeed"),
    A("enable_hf2mg_convert", TRUE, False, origin="mindspeed"),
    A("model_type_hf", STR, None, origin="mindspeed"),
    A("use_ascend_mc2", TRUE, False, origin="mindspeed"),
    A("add_rmsnorm_offset", TRUE, False, origin="mindspeed"),
    A("rmsnorm_weight_in_fp32", TRUE, False, origin="mindspeed"),
]

# MindSpeed-LLM's LoRA (mindspeed_llm/features_manager/finetune/lora.py LoraFeature.register_args; training.py
# builds PEFT's LoraConfig(r=lora_r, lora_alpha=lora_alpha, target_modules=..., lora_dropout=0.0) from them): LoRA
# is on when --lora-target-modules names modules.  --lora-dropout is MindSpeed-MM's (mindspeed_mm/arguments.py,
# default 0.0); MindSpeed-LLM has no such flag and fixes the dropout at 0.0.  Megatron-Bridge says the same in
# Python (peft/lora.py LoRA: target_modules, dim, alpha, dropout).  Module names: `mappings/lora_modules.py`.
LORA = [
    A("lora_target_modules", STRS, [], origin="mindspeed-llm"),
    A("lora_r", INT, 16, origin="mindspeed-llm"),
    A("lora_alpha", INT, 32, origin="mindspeed-llm"),
    A("lora_dropout", FLOAT, 0.0, origin="mindspeed-mm"),
    A("lora_load", STR, None, origin="mindspeed-llm"),
    A("lora_modules_to_save", STRS, None, origin="mindspeed-llm"),
    A("lora_register_forward_hook", STRS, ["word_embeddings", "input_layernorm"], origin="mindspeed-llm"),
    A("lora_fusion", TRUE, False, origin="mindspeed-llm"),
    A("lora_ckpt_filter", TRUE, False, origin="mindspeed-llm"),
    A("qlora", TRUE, False, origin="mindspeed-llm"),
    A("qlora_save_dequantize", TRUE, False, origin="mindspeed-llm"),
]

# Fork values of upstream choices: (dest, fork value) -> (upstream value, why). A fork value not
# listed here is passed through with a note; it is never refused.
FORK_VALUES = {
    ("tokenizer_type", "PretrainedFromHF"): (
        "HuggingFaceTokenizer", "MindSpeed-LLM's Hugging Face AutoTokenizer (--tokenizer-name-or-path); "
        "Megatron-LM calls it HuggingFaceTokenizer"),
    ("distributed_backend", "hccl"): (
        "nccl", "Ascend's collective library (HCCL); Megatron-LM on GPUs uses NCCL"),
    ("moe_token_dispatcher_type", "alltoall_seq"): (
        "alltoall", "MindSpeed's sequence-sharded all-to-all dispatcher; Megatron-LM core_v0.16 has only 'alltoall' "
        "for it (same routing, different communication)"),
}

# Values Megatron computes: no flag sets them.
COMPUTED_ARGS = [
    COMPUTED("world_size", INT, origin="launcher"),  # torchrun's WORLD_SIZE
    COMPUTED("data_parallel_size", INT),
    COMPUTED("params_dtype", STR),
    COMPUTED("activation", STR),  # interop's name for the MLP activation Megatron picks
    # Layer-spec facts megatron-core has no argument for: Megatron-Bridge builds them with a layer spec of its own
    # (models/olmo2/olmo2_provider.py olmo2_layer_spec: IdentityOp pre-norms, `linear_proj.post_layernorm` and
    # `linear_fc2.post_layernorm`).  interop keeps them in its checkpoints' args so that the args say the model;
    # no Megatron-LM flag states them (map-args reports them).
    COMPUTED("pre_norm", TRUE, True, origin="bridge"),  # input_layernorm / pre_mlp_layernorm hold weights
    COMPUTED("post_norm", TRUE, False, origin="bridge"),  # linear_proj / linear_fc2 .post_layernorm
    COMPUTED("qk_layernorm_scope", STR, "head", origin="bridge"),  # head | projection (ModelSpec.qk_norm_scope)
    # Gemma's, as Megatron-Bridge's providers hold them (models/gemma/gemma2_provider.py / gemma2_bridge.py:
    # gated_linear_unit with fast_gelu, query_pre_attn_scalar, attn_logit_softcapping, final_logit_softcapping; the
    # embedding's sqrt(hidden) scale in its Gemma embedding; the layers' window pattern) and --apply-layernorm-1p
    COMPUTED("gated_linear_unit", TRUE, False, origin="bridge"),
    COMPUTED("embedding_scale", TRUE, False, origin="bridge"),  # embedding output x sqrt(hidden) in the model dtype
    COMPUTED("softmax_scale", FLOAT, None, origin="bridge"),  # TransformerConfig.softmax_scale (None: 1/sqrt(d))
    COMPUTED("attn_logit_softcapping", FLOAT, None, origin="bridge"),
    COMPUTED("final_logit_softcapping", FLOAT, None, origin="bridge"),
    COMPUTED("sliding_window_layers", STR, None, origin="bridge"),  # the layers --window-size applies to
    # Gemma 3 (models/gemma/gemma3_bridge.py: rotary_base = (rope_local_base_freq, rope_theta) and its
    # rope_scaling_factor for the global layers' linear scaling)
    COMPUTED("rotary_base_local", FLOAT, None, origin="bridge"),  # the sliding layers' rope base
    COMPUTED("rope_linear_factor", FLOAT, None, origin="bridge"),  # linear rope scaling (positions / factor)
    # gpt-oss's YaRN on a GPT model (not multi-latent attention): GPTModelProvider's fields that Megatron-Bridge's
    # models/gpt_oss/gpt_oss_bridge.py sets with position_embedding_type "yarn" (Megatron-LM's
    # --position-embedding-type has no yarn; its --rope-type yarn is multi-latent attention's)
    COMPUTED("yarn_rotary_scaling_factor", FLOAT, None, origin="bridge"),
    COMPUTED("yarn_original_max_position_embeddings", INT, None, origin="bridge"),
    COMPUTED("yarn_beta_fast", FLOAT, None, origin="bridge"),
    COMPUTED("yarn_beta_slow", FLOAT, None, origin="bridge"),
    COMPUTED("yarn_mscale", FLOAT, None, origin="bridge"),
    COMPUTED("yarn_mscale_all_dim", FLOAT, None, origin="bridge"),
    COMPUTED("yarn_correction_range_round_to_int", TRUE, True, origin="bridge"),
]

ALL = MEGATRON + OLDER + MINDSPEED + LORA + COMPUTED_ARGS
ARGS: dict[str, Arg] = {a.dest: a for a in ALL}
FLAGS: dict[str, Arg] = {f: a for a in ALL for f in a.flags}
CHECKPOINT_ALIASES = {"layernorm_epsilon": "norm_epsilon"}
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")

# True vocabulary of the tokenizers whose size is fixed by their name.
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000}


def flag_of(dest: str) -> str:
    """How a report names an argument: its flag, or its dest when no flag sets it."""
    arg = ARGS.get(dest)
    return arg.flag if arg and arg.flag else dest


# ---------------------------------------------------------------- derived values

@dataclass(frozen=True)
class Derived:
    """`dest = rule(args)`; fill=True: only where the user gave nothing (None)."""

    dest: str
    rule: Callable[[dict], object]
    fill: bool = True
    invert: Callable[[object, dict], dict | None] | None = None  # value -> flags that produce it
    why: str = ""


def _vocab(a):
    if a["tokenizer_type"] in TOKENIZER_VOCAB:
        return TOKENIZER_VOCAB[a["tokenizer_type"]]
    if a["tokenizer_type"] is None and a["merge_file"] is not None:  # GPT-2 BPE vocab + merges
        return TOKENIZER_VOCAB["GPT2BPETokenizer"]
    return None


def _ffn(a):
    h = a["hidden_size"]
    if h is None:
        return None
    return int(4 * h * 2 / 3 / 64) * 64 if a["swiglu"] else 4 * h


def _dp(a):
    model = a["tensor_model_parallel_size"] * a["pipeline_model_parallel_size"] * a["context_parallel_size"]
    ws = a["world_size"]
    return ws // model if ws and ws % model == 0 else None


def _micro_batch_num(a):
    mbs, dp, gbs = a["micro_batch_size"], a["data_parallel_size"], a["global_batch_size"]
    if mbs and dp and gbs and gbs % (mbs * dp) == 0:
        return gbs // (mbs * dp)
    return None


def _activation(a):
    if a["swiglu"]:
        return "swiglu"
    if a["quick_geglu"]:  # arguments.py: quick_gelu gated (gpt-oss's experts, with the clamp and the offset)
        return "quick_geglu"
    if a.get("gated_linear_unit") and (a["openai_gelu"] or a["bias_gelu_fusion"]):
        return "geglu_tanh"  # Megatron-Bridge's Gemma: gated_linear_unit with fast_gelu
    return "gelu_tanh" if a["openai_gelu"] or a["bias_gelu_fusion"] else "gelu"


def _invert_activation(v, a):
    return {"swiglu": {"swiglu": True},
            "gelu_tanh": {"swiglu": False, "openai_gelu": True},
            "geglu_tanh": {"swiglu": False, "openai_gelu": True, "gated_linear_unit": True},
            "quick_geglu": {"swiglu": False, "quick_geglu": True},
            "gelu": {"swiglu": False, "openai_gelu": False, "bias_gelu_fusion": False}}.get(v)


def _vpp(a):
    per, pp, n = a["num_layers_per_virtual_pipeline_stage"], a["pipeline_model_parallel_size"], a["num_layers"]
    if per and n and n % pp == 0 and (n // pp) % per == 0 and n // pp // per > 1:
        return n // pp // per
    return None


def _invert_vpp(v, a):
    n, pp = a["num_layers"], a["pipeline_model_parallel_size"]
    if v and n and n % (pp * v) == 0:
        return {"num_layers_per_virtual_pipeline_stage": n // pp // v}
    return None


_DTYPE_FLAGS = {"bfloat16": {"bf16": True, "fp16": False}, "float16": {"fp16": True, "bf16": False},
                "float32": {"fp16": False, "bf16": False}}

def _shared_experts(a):
    """MindSpeed-LLM's --n-shared-experts N: N shared experts of the routed experts' size, one MLP of N times it."""
    n, size = a["n_shared_experts"], a["moe_ffn_hidden_size"] or a["ffn_hidden_size"]
    return a["moe_shared_expert_intermediate_size"] if a["moe_shared_expert_intermediate_size"] or not n or not size \
        else n * size


def _first_dense(a):
    """MindSpeed-LLM's --first-k-dense-replace K: the first K layers dense, as the pattern Megatron's flag says."""
    k, layers, freq = a["first_k_dense_replace"], a["num_layers"], a["moe_layer_freq"]
    if not k or k < 0 or not layers or str(freq) != "1" or k > layers:
        return freq
    return f"[0]*{k}+[1]*{layers - k}"


DERIVED = [
    Derived("vocab_size", _vocab, why="fixed by --tokenizer-type (GPT-2 BPE when only --merge-file is given)"),
    Derived("padded_vocab_size",
            lambda a: _pad_vocab(a["vocab_size"], a["tensor_model_parallel_size"], a["make_vocab_size_divisible_by"])
            if a["vocab_size"] else None,
            why="vocab rounded up to make_vocab_size_divisible_by * tp"),
    Derived("ffn_hidden_size", _ffn, why="4*hidden, or int(4*hidden*2/3/64)*64 with --swiglu"),
    Derived("kv_channels", lambda a: a["hidden_size"] // a["num_attention_heads"]
            if a["hidden_size"] and a["num_attention_heads"] else None, why="hidden / heads"),
    Derived("num_query_groups", lambda a: a["num_query_groups"] if a["group_query_attention"]
            else a["num_attention_heads"], fill=False, why="= heads without --group-query-attention"),
    Derived("add_qkv_bias", lambda a: bool(a["add_qkv_bias"] or a["add_bias_linear"]), fill=False,
            why="Megatron sets it whenever add_bias_linear"),
    Derived("add_dense_bias", lambda a: a["add_bias_linear"], why="follows add_bias_linear"),
    Derived("bias_gelu_fusion", lambda a: bool(a["bias_gelu_fusion"] and a["add_bias_linear"]), fill=False,
            why="Megatron turns it off without biases"),
    Derived("activation", _activation, invert=_invert_activation,
            why="swiglu; the tanh GeLU with --openai-gelu or the fused bias-GeLU; else exact GeLU"),
    Derived("hidden_act", lambda a: "swiglu" if a["swiglu"] else "gelu", why="swiglu with --swiglu, else gelu"),
    Derived("params_dtype", lambda a: "bfloat16" if a["bf16"] else "float16" if a["fp16"] else "float32",
            invert=lambda v, a: _DTYPE_FLAGS.get(v), why="from --bf16 / --fp16"),
    Derived("compute_dtype", lambda a: a["params_dtype"], invert=lambda v, a: _DTYPE_FLAGS.get(v),
            why="the training precision (--bf16 / --fp16)"),
    Derived("lr_decay_iters", lambda a: a["train_iters"], why="defaults to --train-iters"),
    Derived("start_weight_decay", lambda a: a["weight_decay"], why="= --weight-decay"),
    Derived("end_weight_decay", lambda a: a["weight_decay"], why="= --weight-decay"),
    Derived("data_parallel_size", _dp,
            invert=lambda v, a: {"world_size": v * a["tensor_model_parallel_size"]
                                 * a["pipeline_model_parallel_size"] * a["context_parallel_size"]},
            why="world size / (tp * pp * cp)"),
    Derived("global_batch_size", lambda a: a["micro_batch_size"] * a["data_parallel_size"]
            if a["micro_batch_size"] and a["data_parallel_size"] else None, why="micro batch * dp"),
    Derived("micro_batch_num", _micro_batch_num,
            invert=lambda v, a: {"global_batch_size": v * a["micro_batch_size"] * a["data_parallel_size"]}
            if a["micro_batch_size"] and a["data_parallel_size"] else None,
            why="global batch / (micro batch * dp)"),
    Derived("virtual_pipeline_model_parallel_size", _vpp, invert=_invert_vpp,
            why="layers per stage / --num-layers-per-virtual-pipeline-stage"),
    Derived("moe_shared_expert_intermediate_size", _shared_experts, fill=False,
            why="MindSpeed's --n-shared-experts times the expert size"),
    Derived("moe_layer_freq", _first_dense, fill=False, why="MindSpeed's --first-k-dense-replace: the first K layers dense"),
    Derived("rope_type", lambda a: "yarn" if a["rope_scaling_type"] == "yarn" else a["rope_type"], fill=False,
            why="MindSpeed's --rope-scaling-type yarn"),
    Derived("rotary_scaling_factor", lambda a: a["rope_scaling_factor"] if a["rope_scaling_type"] == "yarn"
            else a["rotary_scaling_factor"], fill=False, why="MindSpeed's --rope-scaling-factor under yarn"),
    Derived("mscale", lambda a: a["mscale"] if a["rope_scaling_mscale"] is None else a["rope_scaling_mscale"],
            fill=False, why="MindSpeed's --rope-scaling-mscale"),
    Derived("mscale_all_dim", lambda a: a["mscale_all_dim"] if a["rope_scaling_mscale_all_dim"] is None
            else a["rope_scaling_mscale_all_dim"], fill=False, why="MindSpeed's --rope-scaling-mscale-all-dim"),
]
DERIVED_BY_DEST = {d.dest: d for d in DERIVED}


def defaults() -> dict:
    return {a.dest: a.default for a in ALL}


def complete(explicit: dict) -> dict:
    """Megatron's full view: defaults, then what was given, then the derived values."""
    args = defaults()
    args.update(explicit)
    for d in DERIVED:
        if d.fill and args.get(d.dest) is not None:
            continue
        args[d.dest] = d.rule(args)
    return args


def normalize(values: dict) -> dict:
    """Turn values read from another format into what Megatron flags can say.

    A derived value that the remaining flags reproduce is dropped; one they do not is
    inverted into flags (params_dtype=bfloat16 -> bf16) where Megatron has a way to say it.
    """
    out = dict(values)
    for d in DERIVED:
        if d.dest not in out:
            continue
        value = out.pop(d.dest)
        rest = complete(out)
        if rest[d.dest] == value:
            continue
        flags = d.invert(value, rest) if d.invert else None
        if flags is None:
            out[d.dest] = value
        else:
            out.update(flags)
    return out


# ---------------------------------------------------------------- contradictions

def _divides(a, num, den):
    return a[num] is None or a[den] is None or a[den] == 0 or a[num] % a[den] == 0


def _show(a, *dests):
    return " ".join(f"{flag_of(d)} {a[d]}" for d in dests)


# (flags involved, test on the completed args that is True when they contradict, message)
CHECKS = [
    (("hidden_size", "num_attention_heads"),
     lambda a, e: "kv_channels" not in e and not _divides(a, "hidden_size", "num_attention_heads"),
     "hidden size is not divisible by the number of attention heads (give --kv-channels)"),
    (("num_attention_heads", "tensor_model_parallel_size"),
     lambda a, e: not _divides(a, "num_attention_heads", "tensor_model_parallel_size"),
     "attention heads are not divisible by tensor parallelism"),
    (("num_query_groups", "group_query_attention"),
     lambda a, e: "num_query_groups" in e and not a["group_query_attention"]
     and e["num_query_groups"] != a["num_attention_heads"],
     "--num-query-groups needs --group-query-attention"),
    (("num_attention_heads", "num_query_groups"),
     lambda a, e: a["group_query_attention"] and not _divides(a, "num_attention_heads", "num_query_groups"),
     "attention heads are not divisible by the query groups"),
    (("num_query_groups", "tensor_model_parallel_size"),
     lambda a, e: a["group_query_attention"] and not _divides(a, "num_query_groups", "tensor_model_parallel_size"),
     "query groups are not divisible by tensor parallelism"),
    (("num_layers", "pipeline_model_parallel_size"),
     lambda a, e: a["decoder_first_pipeline_num_layers"] is None and a["decoder_last_pipeline_num_layers"] is None
     and a["num_layer_list"] is None and not _divides(a, "num_layers", "pipeline_model_parallel_size"),
     "layers are not divisible by pipeline parallelism (give the split with --num-layer-list, "
     "e.g. --set num_layer_list=16,16,16,14)"),
    (("num_layer_list", "num_layers", "pipeline_model_parallel_size"),
     lambda a, e: a["num_layer_list"] is not None and _bad_layer_list(a),
     "--num-layer-list must give one layer count per pipeline stage, adding up to --num-layers"),
    (("bf16", "fp16"), lambda a, e: a["bf16"] and a["fp16"], "--bf16 and --fp16 exclude each other"),
    *[((dest,), lambda a, e, dest=dest: a[dest] is not None and a[dest] < 1, "must be a positive number")
      for dest in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                   "seq_length", "max_position_embeddings", "micro_batch_size", "global_batch_size",
                   "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                   "expert_model_parallel_size", "vocab_size", "padded_vocab_size")],
    (("seq_length", "max_position_embeddings"),
     lambda a, e: a["seq_length"] and a["max_position_embeddings"] and a["seq_length"] > a["max_position_embeddings"],
     "sequence length exceeds max position embeddings"),
    (("lr_warmup_fraction", "lr_warmup_iters"),
     lambda a, e: a["lr_warmup_fraction"] is not None and a["lr_warmup_iters"],
     "give only one of --lr-warmup-fraction and --lr-warmup-iters"),
]

# Facts about the job, not the model: a mismatch is a warning (the script's node count is often a placeholder).
SOFT_CHECKS = [
    (("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
     lambda a, e: a["world_size"] and a["world_size"] % (a["tensor_model_parallel_size"]
                                                       * a["pipeline_model_parallel_size"]
                                                       * a["context_parallel_size"]),
     "world size is not a multiple of tp * pp * cp: data-parallel size not derived"),
    (("global_batch_size", "micro_batch_size", "data_parallel_size"),
     lambda a, e: a["global_batch_size"] and a["micro_batch_size"] and a["data_parallel_size"]
     and a["global_batch_size"] % (a["micro_batch_size"] * a["data_parallel_size"]),
     "global batch is not a multiple of micro batch * dp: micro-batch count not derived"),
]


def _list_expression(node):
    """A `--moe-layer-freq` pattern ("[1,0,1]", "([0]*3+[1]*29)") evaluated without eval: lists of 0/1,
    `+` and `*` by an integer, as Megatron's own eval of the string would give."""
    import ast

    if isinstance(node, ast.Expression):
        return _list_expression(node.body)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            raise ValueError("a number, not a layer list")
        sizes = [len(x) if isinstance(x, list) else x for x in (left, right)]
        if (sizes[0] * sizes[1] if isinstance(node.op, ast.Mult) else sizes[0] + sizes[1]) > 100000:
            raise ValueError("more layers than a model has")  # checked before the list is built
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a list expression")


def moe_layer_pattern(freq, num_layers: int | None) -> list[int] | None:
    """Megatron's per-layer MoE pattern (1 MoE, 0 dense) for --moe-layer-freq (megatron/core/models/gpt/
    gpt_layer_specs.py: an int N is `i % N == 0`, so 1 and -1 are every layer; else a list); None if unreadable."""
    import ast

    if num_layers is None or freq is None:
        return None
    try:
        value = int(freq) if isinstance(freq, int) or str(freq).lstrip("-").isdigit() else \
            _list_expression(ast.parse(str(freq), mode="eval"))
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return None
    if isinstance(value, int):
        return [1 if value and i % value == 0 else 0 for i in range(num_layers)] if value else None
    if isinstance(value, list) and len(value) == num_layers and all(v in (0, 1) for v in value):
        return value
    return None


# Values that differ as written but build the same model: dest -> same(before args, after args).
def _same_list(dest):
    """nargs='+' arguments: Megatron's default is the bare value ('aux_loss'), a given flag a list (['aux_loss'])."""
    def same(a, b):
        x, y = a[dest], b[dest]
        return (x if isinstance(x, list) else [x]) == (y if isinstance(y, list) else [y])
    return same


SAME_MEANING = {
    "moe_router_load_balancing_type": _same_list("moe_router_load_balancing_type"),
    "moe_aux_loss_coeff": _same_list("moe_aux_loss_coeff"),
    # MindSpeed's spellings, carried as the upstream values they derive
    "n_shared_experts": lambda a, b: bool(a["moe_shared_expert_intermediate_size"]) and
    a["moe_shared_expert_intermediate_size"] == b["moe_shared_expert_intermediate_size"],
    "first_k_dense_replace": lambda a, b: SAME_MEANING["moe_layer_freq"](a, b),
    **{dest: lambda a, b, d=derived: a[d] == b[d] for dest, derived in (
        ("rope_scaling_type", "rope_type"), ("rope_scaling_mscale", "mscale"),
        ("rope_scaling_mscale_all_dim", "mscale_all_dim"))},
    "rope_scaling_factor": lambda a, b: a["rope_scaling_type"] == "yarn" and
    a["rotary_scaling_factor"] == b["rotary_scaling_factor"],
    **{dest: lambda a, b, d=dest, fixed=fixed: (a[d] if a[d] is not None else fixed) ==
       (b[d] if b[d] is not None else fixed) for dest, fixed in (
        ("beta_fast", 32.0), ("beta_slow", 1.0), ("rope_scaling_original_max_position_embeddings", 4096))},
    # the same over the positions (a target that keeps them), or over the real layers (one that drops the noop ones)
    "moe_layer_freq": lambda a, b: _real_moe_pattern(a) is not None and (
        moe_layer_pattern(a["moe_layer_freq"], a["num_layers"]) == moe_layer_pattern(b["moe_layer_freq"], b["num_layers"])
        or _real_moe_pattern(a) == _real_moe_pattern(b)),
}


def _real_moe_pattern(a) -> list | None:
    """The MoE pattern over the real layers: Megatron's counts MindSpeed's noop positions too (num_layers does)."""
    pattern = moe_layer_pattern(a["moe_layer_freq"], a["num_layers"])
    noop = {int(x) for x in str(a.get("noop_layers") or "").split(",") if x.strip()}
    return None if pattern is None else [f for i, f in enumerate(pattern) if i not in noop]


def layer_list(value) -> list[int] | None:
    """MindSpeed's --num-layer-list "16,16,16,14" (or a list) as ints; None when it is not one."""
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).strip("[]() ").split(",")
    try:
        return [int(str(v).strip()) for v in items]
    except ValueError:
        return None


# The args that say how the decoder's layers split over the pipeline stages (`pipeline_split`).
SPLIT_ARGS = ("num_layer_list", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "num_layers", "pipeline_model_parallel_size")


def pipeline_split(num_layer_list, first, last, num_layers, pp) -> list[int] | None:
    """The layers of each pipeline stage when they are not an even split, else None.

    MindSpeed's --num-layer-list gives them all; Megatron-LM's --decoder-first/last-pipeline-num-layers give
    the first and last stage and split the rest evenly over the stages between (core_v0.16
    TransformerConfig.__post_init__ refuses a remainder; so does this: None).
    """
    counts = layer_list(num_layer_list)
    if counts is not None:
        return counts
    if (first is None and last is None) or not num_layers or not pp or pp < 2:
        return None
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle == 0:
        return [first, last] if rest == 0 else None
    if rest < 0 or rest % middle:
        return None
    return ([first] if first is not None else []) + [rest // middle] * middle + ([last] if last is not None else [])


def _same_split(a, b) -> bool:
    return pipeline_split(*(a[d] for d in SPLIT_ARGS)) == pipeline_split(*(b[d] for d in SPLIT_ARGS))


SAME_MEANING.update({dest: _same_split for dest in SPLIT_ARGS[:3]})
SAME_MEANING["lora_target_modules"] = lambda a, b: same_targets(a["lora_target_modules"], b["lora_target_modules"])  # one split, said by either set of flags


def _bad_layer_list(a) -> bool:
    counts = layer_list(a["num_layer_list"])
    return (counts is None or len(counts) != a["pipeline_model_parallel_size"]
            or (a["num_layers"] is not None and sum(counts) != a["num_layers"]))


def contradictions(args: dict, explicit: dict, checks=CHECKS) -> list[str]:
    """One line per contradiction, naming the flags and their values."""
    return [f"{message}: {_show(args, *dests)}" for dests, test, message in checks if test(args, explicit)]


def missing_required(args: dict) -> list[str]:
    return [flag_of(d) for d in REQUIRED if args.get(d) is None]
