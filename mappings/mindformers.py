"""Megatron args -> MindFormers dynamic-graph (parallel_core pynative) YAML, the shape of seed 000.

training_config / parallel_config / dataset_config / optimizer_config are the
keys seed 000 shows; model_config is the same config class MindSpeed-Core-MS
grew from, so its rows are the MindSpeed table's model_config rows.
"""
from __future__ import annotations

from . import mindspeed
from .key_mapping import CONST, OMIT, R, Unmappable, rename
from .megatron_args import SPLIT_ARGS

ADAMW = {"adam": "AdamW", "sgd": "SGD"}  # Megatron's "adam" is AdamW (decoupled weight decay)
COSINE = {"cosine": True, "linear": False}


def _dataset_dir(paths):
    if not paths:
        return OMIT
    if len(paths) > 1:
        raise Unmappable(f"dataset_dir holds one directory, --data-path gives {len(paths)} entries")
    return paths[0]


FA_LAYOUT = "model_config.fa_config.input_layout"


def _bnsd_only(order):
    if order != "BNSD":
        raise Unmappable("MindFormers r1.3 flash attention takes input_layout 'BNSD' only")
    return order


# The same loader family as MindSpeed-Core-MS (init_configs_from_yaml): the same paths accept None.
NULLABLE = mindspeed.NULLABLE | {"parallel_config.virtual_pipeline_model_parallel_size"}

ROWS = [
    R("seed", "training_config.seed"),
    R("save", "training_config.output_dir", "./output", unset=True),
    R("train_iters", "training_config.training_iters"),
    R("log_interval", "training_config.log_interval"),
    R("save_interval", "training_config.save_interval"),
    R("loss_scale", "training_config.loss_scale"),
    CONST("training_config.grad_clip_kwargs.grad_clip_type", "ClipGlobalNorm"),
    R("clip_grad", "training_config.grad_clip_kwargs.clip_value"),
    CONST("training_config.loss_reduction", "mean"),
    CONST("training_config.loss_func_kwargs.loss_func_type", "VocabParallelCrossEntropy"),
    R("use_distributed_optimizer", "training_config.use_distributed_optimizer", False),
    *[row for row in mindspeed.ROWS if row.path == "training_config.wrap_with_ddp"],
    R("tensor_model_parallel_size", "parallel_config.tensor_model_parallel_size", 1),
    R("pipeline_model_parallel_size", "parallel_config.pipeline_model_parallel_size", 1),
    R("context_parallel_size", "parallel_config.context_parallel_size", 1),
    R("expert_model_parallel_size", "parallel_config.expert_model_parallel_size", 1),
    R("virtual_pipeline_model_parallel_size", "parallel_config.virtual_pipeline_model_parallel_size"),
    R("sequence_parallel", "parallel_config.sequence_parallel", False),
    # r1.3.0's ModelParallelConfig.num_layer_list (validate_num_layer_list: a list or None); written only for
    # an uneven split.
    R(SPLIT_ARGS, "parallel_config.num_layer_list", to=mindspeed.stage_layers(OMIT),
      back=mindspeed.stage_layers_back),
    *[row for row in mindspeed.ROWS if row.path.startswith("model_config.") and row.path != FA_LAYOUT],
    # r1.3.0's check_fa_config takes input_layout 'BNSD' only (mindformers/experimental/parallel_core/pynative/config.py).
    R("shape_order", FA_LAYOUT, to=_bnsd_only),
    R("micro_batch_size", "dataset_config.batch_size", 1),
    R("micro_batch_num", "dataset_config.micro_batch_num", 1, unset=True),
    R("data_path", "dataset_config.dataset_dir", to=_dataset_dir, back=lambda v, doc: {"data_path": [v]}),
    CONST("dataset_config.shuffle", False),
    rename("optimizer", "optimizer_config.optimizer_type", ADAMW, "AdamW"),
    R(("adam_beta1", "adam_beta2"), "optimizer_config.betas", to=lambda b1, b2: [b1, b2],
      back=lambda v, doc: {"adam_beta1": v[0], "adam_beta2": v[1]}),
    R("adam_eps", "optimizer_config.eps"),
    R("lr", "optimizer_config.learning_rate"),
    R("weight_decay", "optimizer_config.weight_decay"),
    R("lr_warmup_iters", "optimizer_config.learning_rate_scheduler_kwargs.warmup_steps"),
    R("lr_decay_iters", "optimizer_config.learning_rate_scheduler_kwargs.decay_steps"),
    rename("lr_decay_style", "optimizer_config.learning_rate_scheduler_kwargs.use_cosine", COSINE),
    R("min_lr", "optimizer_config.learning_rate_scheduler_kwargs.end_learning_rate"),
    *mindspeed.MOE_ROWS,  # r1.3.0's MoEConfig is MindSpeed-Core-MS r0.1.0's (same keys, same validators)
]
