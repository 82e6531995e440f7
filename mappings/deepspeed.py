"""Megatron args -> ATorch / DeepSpeed 3D parallel (seed 004): the parallel and precision parts.

One JSON file: `parallel_mode` is ATorch's load_strategy entry
`("parallel_mode", ([("tensor", t), ("data", d), ("pipeline", p)], None))` as a
mapping, and `ds_config` is the DeepSpeed config that DeepSpeed3DParallelConfig
takes (batch sizes, clipping, fp16/bf16 and loss scaling, ZeRO stage, optimizer).
"""
from __future__ import annotations

import math

from .megatron_args import R, Unmappable, rename

OPTIMIZER = {"adam": "AdamW", "sgd": "SGD"}


def _scale_power(scale):
    power = math.log2(scale) if scale and scale > 0 else -1
    if power != int(power) or power < 0:
        raise Unmappable(f"initial_scale_power holds a power of two, {scale} is not one")
    return int(power)


ROWS = [
    R("tensor_model_parallel_size", "parallel_mode.tensor", 1),
    R("data_parallel_size", "parallel_mode.data"),
    R("pipeline_model_parallel_size", "parallel_mode.pipeline", 1),
    R("global_batch_size", "ds_config.train_batch_size"),
    R("micro_batch_size", "ds_config.train_micro_batch_size_per_gpu"),
    R("micro_batch_num", "ds_config.gradient_accumulation_steps"),
    R("clip_grad", "ds_config.gradient_clipping"),
    R("log_interval", "ds_config.steps_per_print"),
    R("fp16", "ds_config.fp16.enabled", False),
    R("loss_scale", "ds_config.fp16.loss_scale", 0),  # 0: dynamic
    R("initial_loss_scale", "ds_config.fp16.initial_scale_power", to=_scale_power,
      back=lambda v, doc: {"initial_loss_scale": float(2 ** v)}),
    R("loss_scale_window", "ds_config.fp16.loss_scale_window"),
    R("hysteresis", "ds_config.fp16.hysteresis"),
    R("min_loss_scale", "ds_config.fp16.min_loss_scale"),
    R("bf16", "ds_config.bf16.enabled", False),
    R("use_distributed_optimizer", "ds_config.zero_optimization.stage", 0,
      to=lambda v: 1 if v else 0, back=lambda v, doc: {"use_distributed_optimizer": v >= 1}),
    rename("optimizer", "ds_config.optimizer.type", OPTIMIZER),
    R("lr", "ds_config.optimizer.params.lr"),
    R(("adam_beta1", "adam_beta2"), "ds_config.optimizer.params.betas", to=lambda b1, b2: [b1, b2],
      back=lambda v, doc: {"adam_beta1": v[0], "adam_beta2": v[1]}),
    R("adam_eps", "ds_config.optimizer.params.eps"),
    R("weight_decay", "ds_config.optimizer.params.weight_decay"),
]
