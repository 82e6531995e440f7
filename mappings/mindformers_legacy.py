"""Megatron args -> the older MindFormers run_*.yaml (seed 002: GPT2 on MindSpore's static graph).

Seed 002 shows `context`, `parallel`, `recompute_config` and `parallel_config`
(data_parallel / model_parallel / pipeline_stage / micro_batch_num /
optimizer_shard / vocab_emb_dp / gradient_aggregation_group); the model,
runner, optimizer, lr_schedule and loss-scale keys are those of the same
r0.3-era GPT2 configs. Only the GPT2 model_config shape is written.
"""
from __future__ import annotations

from .megatron_args import CONST, R, Unmappable, rename

ADAM = {"adam": "AdamWeightDecay"}
LR_STYLE = {"cosine": "cosine", "linear": "linear", "constant": "constant"}


def _expand_ratio(ffn, hidden):
    if ffn % hidden:
        raise Unmappable(f"expand_ratio holds ffn/hidden as an integer, {ffn}/{hidden} is not one")
    return ffn // hidden


def _recompute(granularity):
    if granularity == "selective":
        raise Unmappable("recompute is all-or-nothing here, 'selective' has no equivalent")
    return granularity == "full"


ROWS = [
    R("seed", "seed"),
    R("save", "output_dir", "./output", unset=True),
    CONST("context.mode", 0),
    CONST("context.device_target", "Ascend"),
    CONST("parallel.parallel_mode", 1),
    CONST("parallel.full_batch", True),
    R("use_distributed_optimizer", "parallel.enable_parallel_optimizer", False),
    R("recompute_granularity", "recompute_config.recompute", False, to=_recompute,
      back=lambda v, doc: {"recompute_granularity": "full"} if v else {}),
    R("data_parallel_size", "parallel_config.data_parallel", 1, unset=True),
    R("tensor_model_parallel_size", "parallel_config.model_parallel", 1),
    R("pipeline_model_parallel_size", "parallel_config.pipeline_stage", 1),
    R("use_distributed_optimizer", "parallel_config.optimizer_shard", False),
    R("micro_batch_num", "parallel_config.micro_batch_num", 1, unset=True),
    CONST("parallel_config.vocab_emb_dp", True),
    CONST("parallel_config.gradient_aggregation_group", 4),
    R("micro_batch_size", "runner_config.batch_size", 1),
    CONST("model.arch.type", "GPT2LMHeadModel"),
    CONST("model.model_config.type", "GPT2Config"),
    R("seq_length", "model.model_config.seq_length"),
    R("padded_vocab_size", "model.model_config.vocab_size"),
    R("hidden_size", "model.model_config.hidden_size"),
    R("num_layers", "model.model_config.num_layers"),
    R("num_attention_heads", "model.model_config.num_heads"),
    R(("ffn_hidden_size", "hidden_size"), "model.model_config.expand_ratio", to=_expand_ratio,
      back=lambda v, doc: {"ffn_hidden_size": v * doc["model"]["model_config"]["hidden_size"]}),
    R("hidden_dropout", "model.model_config.hidden_dropout_prob"),
    R("attention_dropout", "model.model_config.attention_probs_dropout_prob"),
    R("max_position_embeddings", "model.model_config.max_position_embeddings"),
    R("init_method_std", "model.model_config.initializer_range"),
    R("params_dtype", "model.model_config.param_init_type", "float32"),
    R("compute_dtype", "model.model_config.compute_dtype", "float16"),
    rename("optimizer", "optimizer.type", ADAM, "AdamWeightDecay"),
    R("adam_beta1", "optimizer.beta1"),
    R("adam_beta2", "optimizer.beta2"),
    R("adam_eps", "optimizer.eps"),
    R("weight_decay", "optimizer.weight_decay"),
    rename("lr_decay_style", "lr_schedule.type", LR_STYLE),
    R("lr", "lr_schedule.learning_rate"),
    R("min_lr", "lr_schedule.lr_end"),
    R("lr_warmup_iters", "lr_schedule.warmup_steps"),
    R("lr_decay_iters", "lr_schedule.total_steps"),
    CONST("runner_wrapper.type", "MFTrainOneStepCell"),
    CONST("runner_wrapper.scale_sense.type", "DynamicLossScaleUpdateCell"),
    R("initial_loss_scale", "runner_wrapper.scale_sense.loss_scale_value"),
    R("loss_scale_window", "runner_wrapper.scale_sense.scale_window"),
]
