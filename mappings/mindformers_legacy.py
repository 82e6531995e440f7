"""Megatron args -> the older MindFormers run_*.yaml (seed 002: GPT2 on MindSpore's static graph).

Seed 002 shows `context`, `parallel`, `recompute_config` and `parallel_config`
(data_parallel / model_parallel / pipeline_stage / micro_batch_num /
optimizer_shard / vocab_emb_dp / gradient_aggregation_group); the model,
runner, optimizer, lr_schedule and loss-scale keys are those of the same
r0.3-era GPT2 configs. Only the GPT2 model_config shape is written, in MindFormers r0.3's own
GPT2Config keys (mindformers/models/gpt2/gpt2_config.py at r0.3): embedding_size, num_heads,
expand_ratio, seq_length (the position table's size: there is no max_position_embeddings),
dropout_prob / hidden_dropout_prob / attention_probs_dropout_prob, initializer_range.
"""
from __future__ import annotations

from .key_mapping import CONST, OMIT, KeyMapping, R, Unmappable, rename
from .lora_args import PET_ROWS
from .mindspeed import moe_row, one_value

RELEASE = "MindFormers r0.3"
HEADER = (f"# {RELEASE} run_gpt2*.yaml (GPT2Config keys of {RELEASE}), written by `interop map-args`.\n")

# Given values this release has no key for, and why (map-args reports them as lost).
_EVEN = (f"no {RELEASE} GPT2Config or parallel_config key gives a pipeline stage its own layer count: the run "
         "would split the layers over pipeline_stage its own way, not as given")
UNHELD = {"vocab_size": "model.model_config.vocab_size holds Megatron's padded size (the embedding's rows); the "
                        "tokenizer's own vocabulary has no key",
          "num_layer_list": _EVEN, "decoder_first_pipeline_num_layers": _EVEN, "decoder_last_pipeline_num_layers": _EVEN}

ADAM = {"adam": "AdamWeightDecay"}
# The lr_schedule aliases MindFormers registers (mindformers/core/lr/build_lr.py register_mf_lr, r0.3 era and
# 2.1.0): constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial -- no bare "constant".
# ConstantWarmUpLR warms up, then holds learning_rate: Megatron's constant style.
LR_STYLE = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def _expand_ratio(ffn, hidden):
    if ffn is None or hidden is None:  # a source that describes no model (an adapter's settings)
        return OMIT
    if ffn % hidden:
        raise Unmappable(f"expand_ratio holds ffn/hidden as an integer, {ffn}/{hidden} is not one")
    return ffn // hidden


def _positions(seq, positions):
    """r0.3's GPT2 sizes its position table by seq_length: a longer Megatron table does not carry over."""
    if seq is not None and positions is not None and positions != seq:
        raise Unmappable(f"{RELEASE} GPT2 has seq_length position embeddings only ({seq}), not {positions}")
    return seq if seq is not None else positions


def complete_read(values: dict, doc: dict) -> tuple[dict, list[str]]:
    """The values r0.3's YAML implies (GPT2: LayerNorm, learned positions, GeLU), and what it cannot say."""
    model = (doc.get("model") or {}).get("model_config") or {}
    warnings = []
    if "hidden_size" in model and "embedding_size" not in model:
        warnings.append(f"model.model_config.hidden_size is not a {RELEASE} GPT2Config key (embedding_size is); "
                        "read as the hidden size")
        values.setdefault("hidden_size", model["hidden_size"])
    return values, warnings


# r0.3's `polynomial` is PolynomialWithWarmUpLR (registered under that alias; mindformers/core/lr/lr_schedule.py,
# also in 2.1.0): after the warmup, lr_end + (lr - lr_end) * (1 - t / decay_steps) ** power, power 1.0 by
# default.  With power 1 that is Megatron's `linear` decay from --lr to --min-lr, the same schedule; another
# power has no Megatron style (nor a MindSpeed-Core-MS one): read as `linear`, with a note saying so.
POLYNOMIAL = "polynomial"


def _lr_style(style):
    if style not in LR_STYLE:
        raise Unmappable(f"no MindFormers schedule for {style!r} (it knows {', '.join(LR_STYLE)})")
    return LR_STYLE[style]


def _lr_style_back(value, doc):
    if value != POLYNOMIAL:
        return {"lr_decay_style": {v: k for k, v in LR_STYLE.items()}.get(value, value)}  # "constant" reads as itself
    power = (doc.get("lr_schedule") or {}).get("power", 1.0)
    if isinstance(power, (int, float)) and not isinstance(power, bool) and float(power) == 1.0:
        return {"lr_decay_style": "linear",  # the same schedule: a polynomial of power 1 is linear decay
                "_said": "PolynomialWithWarmUpLR of power 1.0 decays linearly from learning_rate to lr_end after "
                         "the warmup: Megatron's (and MindSpeed-Core-MS's) 'linear'"}
    return {"lr_decay_style": "linear",
            "_note": f"polynomial decay of power {power!r} has no Megatron (or MindSpeed-Core-MS) style: read as "
                     "'linear' (power 1); the decay curve differs"}


def _recompute(granularity):
    if granularity == "selective":
        raise Unmappable("recompute is all-or-nothing here, 'selective' has no equivalent")
    return granularity == "full"


def _shared_experts(shared_size, expert_size, ffn_size):
    """Megatron gives the shared experts' total hidden size, MindFormers their number (each of the expert size)."""
    if shared_size is None:
        return OMIT
    expert_size = expert_size or ffn_size
    if not expert_size or shared_size % expert_size:
        raise Unmappable(f"shared_expert_num counts experts of moe_intermediate_size {expert_size}; "
                         f"Megatron's shared expert size {shared_size} is not a multiple of it")
    return shared_size // expert_size


def _shared_back(v, doc):
    size = ((doc.get("moe_config") or {}).get("moe_intermediate_size"))
    return {"moe_shared_expert_intermediate_size": v * size} if v and size else {}


def _moe(convert):
    """A converter of several Megatron values (the last: --num-experts) written for a MoE model only."""
    def to(*values):
        return convert(*values[:-1]) if values[-1] else OMIT
    return to


def _dispatcher(kind):
    if kind not in ("allgather", "alltoall"):
        raise Unmappable(f"MindFormers dispatches by all-to-all or (use_allgather_dispatcher) all-gather, not {kind!r}")
    return kind == "allgather"


# MindFormers' static-graph MoEConfig, the run_*.yaml `moe_config` section (mindformers/modules/transformer/moe.py;
# expert_num / num_experts_chosen / aux_loss_factor / capacity_factor since r0.3, the rest as MindFormers 2.1.0's
# MindFormerConfig template, mindformers/tools/register/template.py, lists them).  Written for a MoE model only.
MOE_ROWS = [
    moe_row("num_experts", "moe_config.expert_num"),
    moe_row("expert_model_parallel_size", "parallel_config.expert_parallel"),
    moe_row("moe_router_topk", "moe_config.num_experts_chosen"),
    moe_row("moe_aux_loss_coeff", "moe_config.aux_loss_factor", one_value("aux loss coefficient"), listed=True),
    moe_row("moe_expert_capacity_factor", "moe_config.capacity_factor"),
    moe_row("moe_grouped_gemm", "moe_config.use_gmm"),
    # Megatron's expert size defaults to --ffn-hidden-size; MindFormers' to 1407: always said
    R(("moe_ffn_hidden_size", "ffn_hidden_size", "num_experts"), "moe_config.moe_intermediate_size",
      to=_moe(lambda size, ffn: ffn if size is None else size), back=lambda v, doc: {"moe_ffn_hidden_size": v}),
    R(("moe_shared_expert_intermediate_size", "moe_ffn_hidden_size", "ffn_hidden_size", "num_experts"),
      "moe_config.shared_expert_num",
      to=_moe(_shared_experts), back=_shared_back),
    moe_row("moe_shared_expert_gate", "moe_config.use_shared_expert_gating"),
    R(("moe_router_score_function", "num_experts"), "moe_config.use_gating_sigmoid",
      to=_moe(lambda f: f == "sigmoid"), back=lambda v, doc: {"moe_router_score_function": "sigmoid" if v else "softmax"}),
    moe_row("moe_router_enable_expert_bias", "moe_config.balance_via_topk_bias"),
    moe_row("moe_router_bias_update_rate", "moe_config.topk_bias_update_rate"),
    moe_row("moe_z_loss_coeff", "moe_config.z_loss_factor"),
    moe_row("moe_router_topk_scaling_factor", "moe_config.routed_scaling_factor"),
    moe_row("moe_router_num_groups", "moe_config.n_group"),
    moe_row("moe_router_group_topk", "moe_config.topk_group"),
    R(("moe_token_dispatcher_type", "num_experts"), "moe_config.use_allgather_dispatcher", to=_moe(_dispatcher),
      back=lambda v, doc: {"moe_token_dispatcher_type": "allgather" if v else "alltoall"}),
]

ROWS = [
    CONST("run_mode", "train"),  # MindFormerConfig applies its training template (sections it checks) for it
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
    R("seq_length", "model.model_config.seq_length",
      back=lambda v, doc: {"seq_length": v, "max_position_embeddings": v}),
    R("padded_vocab_size", "model.model_config.vocab_size"),
    R("hidden_size", "model.model_config.embedding_size"),
    R("num_layers", "model.model_config.num_layers"),
    R("num_attention_heads", "model.model_config.num_heads"),
    R(("ffn_hidden_size", "hidden_size"), "model.model_config.expand_ratio", to=_expand_ratio,
      back=lambda v, doc: {"ffn_hidden_size": v * doc["model"]["model_config"]["embedding_size"]}
      if "embedding_size" in doc["model"]["model_config"] else {}),
    R("hidden_dropout", "model.model_config.dropout_prob"),
    R("hidden_dropout", "model.model_config.hidden_dropout_prob"),
    R("attention_dropout", "model.model_config.attention_probs_dropout_prob"),
    R(("seq_length", "max_position_embeddings"), "model.model_config.seq_length", to=_positions,
      back=lambda v, doc: {}),
    R("init_method_std", "model.model_config.initializer_range"),
    R("params_dtype", "model.model_config.param_init_type", "float32"),
    R("compute_dtype", "model.model_config.compute_dtype", "float16"),
    rename("optimizer", "optimizer.type", ADAM, "AdamWeightDecay"),
    R("adam_beta1", "optimizer.beta1"),
    R("adam_beta2", "optimizer.beta2"),
    R("adam_eps", "optimizer.eps"),
    R("weight_decay", "optimizer.weight_decay"),
    R("lr_decay_style", "lr_schedule.type", to=_lr_style, back=_lr_style_back),
    KeyMapping((), "lr_schedule.power", None, lambda: OMIT, lambda v, doc: {}),  # read with lr_schedule.type
    R("lr", "lr_schedule.learning_rate"),
    R("min_lr", "lr_schedule.lr_end"),
    R("lr_warmup_iters", "lr_schedule.warmup_steps"),
    # total_steps -1: "the whole run" (MindFormers fills in the dataset's steps), Megatron's unset --lr-decay-iters.
    R("lr_decay_iters", "lr_schedule.total_steps", -1, unset=True),
    CONST("runner_wrapper.type", "MFTrainOneStepCell"),
    CONST("runner_wrapper.scale_sense.type", "DynamicLossScaleUpdateCell"),
    R("initial_loss_scale", "runner_wrapper.scale_sense.loss_scale_value"),
    R("loss_scale_window", "runner_wrapper.scale_sense.scale_window"),
    *MOE_ROWS,
    *PET_ROWS,  # MindFormers' LoRA (model.model_config.pet_config, as 2.1.0 reads it): written for a LoRA run only
]
