"""ModelSpec <-> Megatron args (and the tp/pp/vpp layout they state): decided once, here.

Used by the Megatron converter (a checkpoint's stored args, `--model-config`), by map-args (its
HF table's number rows, `hf_args`) and by the trainer (the model a config file describes).  The
plain numbers are a table (`SPEC_NUMBERS`, which `args_from_spec` writes); how each is read back,
with the defaults and fallbacks checkpoints from other tools need, and the facts that need a rule
(norm, activation, positions, biases, rope scaling, sliding window) are the functions below.
"""
from __future__ import annotations

from ..errors import InteropError
from ..layout import ParallelLayout
from ..spec import ModelSpec, llama3_rope_scaling
from . import megatron_args as M

# ModelSpec field -> Megatron argument (dest), for the numbers that carry over as they are.
SPEC_NUMBERS = {
    "num_layers": "num_layers", "hidden": "hidden_size", "ffn_hidden": "ffn_hidden_size",
    "heads": "num_attention_heads", "kv_groups": "num_query_groups", "head_dim": "kv_channels",
    "vocab": "vocab_size", "padded_vocab": "padded_vocab_size", "max_positions": "max_position_embeddings",
    "norm_eps": "norm_epsilon",
}

UNSUPPORTED_ARGS = {  # dest: the value our ModelSpec can describe
    "num_experts": None, "rotary_interleaved": False, "multi_latent_attention": False,
    "apply_residual_connection_post_layernorm": False, "squared_relu": False,
}


NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
NORMS_OUT = {v: k for k, v in NORMS.items()}


def spec_from_args(full: dict, where: str, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec from completed Megatron args (`megatron_args.complete`)."""
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not full.get(k)]
    if missing:
        raise InteropError(f"{where}: the model description lacks {', '.join(missing)}")
    for dest, ok in UNSUPPORTED_ARGS.items():
        if full.get(dest, ok) not in (ok, None) and full.get(dest) != ok:
            raise InteropError(f"{where}: {dest}={full[dest]!r} is not supported")
    if full.get("rotary_percent", 1.0) not in (None, 1.0):
        raise InteropError(f"{where}: rotary_percent={full['rotary_percent']} is not supported (1.0 is)")
    norm = NORMS.get(full.get("normalization") or "LayerNorm")
    if norm is None:
        raise InteropError(f"{where}: normalization={full['normalization']!r} is not supported")
    pos_type = full.get("position_embedding_type") or "learned_absolute"
    if full.get("use_rotary_position_embeddings"):
        pos_type = "rope"
    if pos_type not in ("learned_absolute", "rope"):
        raise InteropError(f"{where}: position_embedding_type={pos_type!r} is not supported")
    position = "rope" if pos_type == "rope" else "learned"
    heads, hidden = int(full["num_attention_heads"]), int(full["hidden_size"])
    groups = int(full.get("num_query_groups") or heads) if full.get("group_query_attention") else heads
    activation = full.get("activation") or ("swiglu" if full.get("swiglu") else "gelu")
    padded = full.get("padded_vocab_size") or full.get("vocab_size")
    vocab = full.get("vocab_size") or padded
    if not padded:
        raise InteropError(f"{where}: the vocabulary size is unknown (no padded_vocab_size or vocab_size)")
    linear_bias = bool(full.get("add_bias_linear", True))
    qk_norm = bool(full.get("qk_layernorm"))
    if qk_norm and norm != "rmsnorm":
        raise InteropError(f"{where}: qk_layernorm with normalization={full.get('normalization')!r} is not supported "
                           "(RMSNorm is)")
    sliding_window = _sliding_window(full, where)
    rope_scaling = None
    if full.get("use_rope_scaling") and position == "rope":
        rope_scaling = llama3_rope_scaling(float(full.get("rope_scaling_factor") or 8.0))  # core's fixed 1 / 4 / 8192
    arch = "gpt2" if (norm == "layernorm" and position == "learned" and activation != "swiglu") else "llama"
    return ModelSpec(
        arch=arch, num_layers=int(full["num_layers"]), hidden=hidden,
        ffn_hidden=int(full.get("ffn_hidden_size") or 4 * hidden), heads=heads, kv_groups=groups,
        head_dim=int(full.get("kv_channels") or hidden // heads), vocab=int(vocab), padded_vocab=int(padded),
        max_positions=int(full.get("max_position_embeddings") or full.get("seq_length") or 0) or 2048,
        norm=norm, norm_eps=float(full.get("norm_epsilon") or 1e-5), activation=activation, position=position,
        rope_base=float(full.get("rotary_base") or 10000), tied_embeddings=not full.get("untie_embeddings_and_output_weights"),
        qkv_bias=bool(linear_bias or full.get("add_qkv_bias")), linear_bias=linear_bias,
        qk_norm=qk_norm, rope_scaling=rope_scaling, sliding_window=sliding_window,
        dtype=dtype or full.get("params_dtype") or "float32")


def _sliding_window(full: dict, where: str) -> int | None:
    """--window-size (left, right) on every layer -> ModelSpec.sliding_window.

    megatron-core lets query i see keys i - left .. i + right (transformer/utils.py
    get_sliding_window_causal_mask); HF Mistral's window W lets it see i - W + 1 .. i: W = left + 1, right 0.
    """
    window = full.get("window_size")
    if window in (None, "", "None"):
        return None
    if isinstance(window, str):
        window = [w.strip() for w in window.strip("()[] ").split(",")]
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise InteropError(f"{where}: window_size={full['window_size']!r} is not a (left, right) pair") from None
    if right != 0 or left < 0 or full.get("window_attn_skip_freq") not in (None, "", "None"):
        raise InteropError(f"{where}: window_size={full['window_size']!r} with window_attn_skip_freq="
                           f"{full.get('window_attn_skip_freq')!r} is not supported (a causal window on every layer is)")
    return left + 1


def args_from_spec(spec: ModelSpec, layout: ParallelLayout, base: dict | None = None,
                   divisible_by: int = 128) -> dict:
    """Megatron args for `spec` at `layout`, on top of `base` (a source's args) or Megatron's defaults."""
    if spec.qkv_bias and not spec.linear_bias:
        add_qkv_bias = True
    else:
        add_qkv_bias = spec.qkv_bias
    if spec.qkv_bias != spec.linear_bias and not (spec.qkv_bias and not spec.linear_bias):
        raise InteropError("Megatron cannot describe biases on the output/MLP linears without q/k/v biases")
    first = layout.stages[0][0]
    per_stage = [sum(b - a for a, b in chunks) for chunks in layout.stages]
    uneven = layout.vpp == 1 and layout.stages != _even_stages(spec.num_layers, layout)
    model = {dest: getattr(spec, field) for field, dest in SPEC_NUMBERS.items()}
    model |= {
        "group_query_attention": spec.kv_groups != spec.heads, "normalization": NORMS_OUT[spec.norm],
        "swiglu": spec.activation == "swiglu",
        "openai_gelu": spec.activation == "gelu_tanh",
        # the fused bias-GeLU is the tanh form: on only when that is the model's GeLU
        "bias_gelu_fusion": spec.activation == "gelu_tanh" and spec.linear_bias,
        "bias_swiglu_fusion": spec.activation == "swiglu",
        "position_embedding_type": "rope" if spec.position == "rope" else "learned_absolute",
        "add_position_embedding": spec.position == "learned", "use_rotary_position_embeddings": spec.position == "rope",
        "rotary_base": int(spec.rope_base) if float(spec.rope_base).is_integer() else spec.rope_base,
        "rotary_percent": 1.0, "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "add_bias_linear": spec.linear_bias, "add_qkv_bias": add_qkv_bias, "qk_layernorm": spec.qk_norm,
        "use_rope_scaling": spec.rope_scaling is not None,
        "rope_scaling_factor": spec.rope_scaling["factor"] if spec.rope_scaling else 8.0,
        "window_size": (spec.sliding_window - 1, 0) if spec.sliding_window else None, "window_attn_skip_freq": None,
        "make_vocab_size_divisible_by": divisible_by,
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "num_layers_per_virtual_pipeline_stage": (first[1] - first[0]) if layout.vpp > 1 else None,
        "decoder_first_pipeline_num_layers": per_stage[0] if uneven else None,
        "decoder_last_pipeline_num_layers": per_stage[-1] if uneven else None,
        "bf16": spec.dtype == "bfloat16", "fp16": spec.dtype == "float16",
        "transformer_impl": "local", "use_legacy_models": False, "use_mcore_models": True,
    }
    args = M.complete({}) if base is None else dict(base)
    args.update(model)
    args.pop("activation", None)  # derived by interop's table, not a Megatron argument
    args.pop("hidden_act", None)
    args.pop("compute_dtype", None)
    from ..tensors import DTYPE_NAMES  # torch: map-args imports this module and must start without it
    args["params_dtype"] = DTYPE_NAMES[spec.dtype]
    return args


def args_losses(spec: ModelSpec) -> list[str]:
    """What Megatron args cannot say about `spec`: summary notes, so the loss is never silent."""
    notes = []
    if spec.rope_scaling is not None and spec.rope_scaling != llama3_rope_scaling(spec.rope_scaling["factor"]):
        notes.append(f"Megatron's --use-rope-scaling fixes low_freq_factor 1, high_freq_factor 4 and "
                     f"original_max_position_embeddings 8192; this model's {spec.rope_scaling} is not in the args")
    return notes


def layout_from_args(full: dict, num_layers: int) -> ParallelLayout:
    """The tp/pp/vpp layout the args say the checkpoint was saved at (tp 1 / pp 1 when they don't say)."""
    try:
        return ParallelLayout.build(
            num_layers, int(full.get("tensor_model_parallel_size") or 1), int(full.get("pipeline_model_parallel_size") or 1),
            int(full.get("virtual_pipeline_model_parallel_size") or 1), full.get("decoder_first_pipeline_num_layers"),
            full.get("decoder_last_pipeline_num_layers"))
    except (InteropError, TypeError, ValueError):
        return ParallelLayout.build(num_layers)


def _even_stages(num_layers: int, layout: ParallelLayout):
    try:
        return ParallelLayout.build(num_layers, layout.tp, layout.pp, layout.vpp).stages
    except InteropError:
        return None
