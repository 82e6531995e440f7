"""Megatron args <-> ModelSpec: what the Megatron checkpoint converter needs to know about the model.

`spec_from_megatron_args` accepts a partial dict (an args file's flags) or a
checkpoint's full args (vars(Namespace)); either way Megatron's defaults and
derived values (ffn size, kv channels, query groups, padded vocab, dtype) are
applied first, so the spec is the model Megatron actually built.
"""
from __future__ import annotations

from ..errors import InteropError
from ..spec import ModelSpec
from . import megatron_args as M

_NORM = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
_POSITION = {"learned_absolute": "learned", "rope": "rope"}
_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _known(args: dict) -> dict:
    out = {}
    for key, value in args.items():
        dest = M.CHECKPOINT_ALIASES.get(key, key)
        if dest in M.ARGS:
            text = str(value)
            out[dest] = {"torch.bfloat16": "bfloat16", "torch.float16": "float16",
                         "torch.float32": "float32"}.get(text, value)
    return out


def spec_from_megatron_args(args: dict) -> ModelSpec:
    full = M.complete(_known(args))
    missing = M.missing_required(full)
    if missing:
        raise InteropError(f"Megatron args: missing required value: {', '.join(missing)}")
    errors = M.contradictions(full, _known(args))
    if errors:
        raise InteropError(f"Megatron args: {'; '.join(errors)}")
    if full["normalization"] not in _NORM:
        raise InteropError(f"Megatron args: --normalization {full['normalization']} is not supported")
    if full["position_embedding_type"] not in _POSITION:
        raise InteropError(f"Megatron args: --position-embedding-type {full['position_embedding_type']} "
                           "is not supported (learned_absolute and rope are)")
    vocab = full["vocab_size"] or full["padded_vocab_size"]
    if not vocab:
        raise InteropError("Megatron args: the vocabulary size is unknown (give --vocab-size or --padded-vocab-size)")
    padded = full["padded_vocab_size"] or vocab
    norm, position, activation = _NORM[full["normalization"]], _POSITION[full["position_embedding_type"]], full["activation"]
    arch = "llama" if (norm, activation, position) == ("rmsnorm", "swiglu", "rope") else "gpt2"
    return ModelSpec(
        arch=arch,
        num_layers=full["num_layers"],
        hidden=full["hidden_size"],
        ffn_hidden=full["ffn_hidden_size"],
        heads=full["num_attention_heads"],
        kv_groups=full["num_query_groups"],
        head_dim=full["kv_channels"],
        vocab=vocab,
        padded_vocab=padded,
        max_positions=full["max_position_embeddings"],
        norm=norm,
        norm_eps=float(full["norm_epsilon"]),
        activation=activation,
        position=position,
        rope_base=float(full["rotary_base"]),
        tied_embeddings=not full["untie_embeddings_and_output_weights"],
        qkv_bias=bool(full["add_qkv_bias"]),
        linear_bias=bool(full["add_bias_linear"]),
        dtype=_DTYPE[full["params_dtype"]],
    )


def megatron_args_from_spec(spec: ModelSpec, tp: int = 1, pp: int = 1, **extra) -> dict:
    """A complete Megatron args dict (every dest, defaults included) that builds `spec` at tp/pp.

    The vocabulary is passed as --vocab-size with make_vocab_size_divisible_by chosen so that
    Megatron pads it to exactly `spec.padded_vocab` at this tp (1 when no multiple of 128*tp fits).
    """
    spec.check_tp(tp)
    step = 128 * tp
    divisible = 128 if spec.padded_vocab % step == 0 and spec.padded_vocab - spec.vocab < step else None
    if divisible is None:
        if spec.padded_vocab % tp:
            raise InteropError(f"padded vocab {spec.padded_vocab} is not divisible by tp={tp}")
        divisible = spec.padded_vocab // tp if spec.padded_vocab != spec.vocab else 1
    explicit = {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden,
        "ffn_hidden_size": spec.ffn_hidden,
        "num_attention_heads": spec.heads,
        "group_query_attention": spec.kv_groups != spec.heads,
        "num_query_groups": spec.kv_groups,
        "kv_channels": spec.head_dim,
        "vocab_size": spec.vocab,
        "make_vocab_size_divisible_by": divisible,
        "max_position_embeddings": spec.max_positions,
        "seq_length": spec.max_positions,
        "normalization": {v: k for k, v in _NORM.items()}[spec.norm],
        "norm_epsilon": spec.norm_eps,
        "swiglu": spec.activation == "swiglu",
        "openai_gelu": spec.activation == "gelu_tanh",
        "bias_gelu_fusion": spec.activation == "gelu_tanh" and spec.linear_bias,
        "position_embedding_type": {v: k for k, v in _POSITION.items()}[spec.position],
        "rotary_base": int(spec.rope_base) if float(spec.rope_base).is_integer() else spec.rope_base,
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "add_bias_linear": spec.linear_bias,
        "add_qkv_bias": spec.qkv_bias,
        "bf16": spec.dtype == "bfloat16",
        "fp16": spec.dtype == "float16",
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
    }
    explicit.update(extra)
    full = M.complete(explicit)
    if full["padded_vocab_size"] != spec.padded_vocab:
        raise InteropError(f"cannot make Megatron pad vocab {spec.vocab} to {spec.padded_vocab} at tp={tp}")
    return full
