"""Hugging Face config.json <-> ModelSpec, for GPT2 and the Llama-style families (Llama, Qwen2, Qwen3, Mistral)
and the mixture-of-experts ones built on them (Mixtral, Qwen2-MoE).

Each architecture is a table of (spec field, config key, default when the key is
absent); the few values that need a rule (activation names, biases, rope) are
small functions beside it.
"""
from __future__ import annotations

import math

from ..errors import InteropError
from ..spec import QUICK_GELU_ALPHA, ModelSpec, llama3_rope_scaling, longrope_scaling
from . import hf_deepseek

# (spec field, config key, default)
GPT2_KEYS = [
    ("num_layers", "n_layer", 12),
    ("hidden", "n_embd", 768),
    ("heads", "n_head", 12),
    ("vocab", "vocab_size", 50257),
    ("max_positions", "n_positions", 1024),
    ("norm_eps", "layer_norm_epsilon", 1e-5),
    ("tied_embeddings", "tie_word_embeddings", True),
]
LLAMA_KEYS = [
    ("num_layers", "num_hidden_layers", 32),
    ("hidden", "hidden_size", 4096),
    ("ffn_hidden", "intermediate_size", 11008),
    ("heads", "num_attention_heads", 32),
    ("vocab", "vocab_size", 32000),
    ("max_positions", "max_position_embeddings", 2048),
    ("norm_eps", "rms_norm_eps", 1e-6),
    ("tied_embeddings", "tie_word_embeddings", False),
]
# HF activation names <-> ours (GPT2's "gelu_new", "gelu_pytorch_tanh" and "gelu_fast" are the tanh form).
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
GPT2_ACTIVATION_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
# GPT2 options whose model our spec cannot describe: refuse rather than convert into a different model.
GPT2_UNSUPPORTED = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "scale_attn_weights": True,
                    "add_cross_attention": False}


def _read_table(config: dict, table, where: str) -> dict:
    """The table's values, defaults filled in; a number that is not one is refused here, naming its key,
    before any arithmetic on it (a string hidden_size would otherwise multiply as a string)."""
    out = {}
    for field, key, default in table:
        value = config.get(key) if config.get(key) is not None else default
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            kind = "true or false" if isinstance(default, bool) else "a positive integer" if isinstance(default, int) \
                else "a number"
            raise InteropError(f"{where}: {key} must be {kind}, got {value!r}")
        out[field] = value
    return out


def _optional_int(config: dict, key: str, where: str):
    value = config.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InteropError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _head_dim(config: dict, f: dict, where: str) -> int:
    given = _optional_int(config, "head_dim", where)
    if given:
        return given
    if f["hidden"] % f["heads"]:
        raise InteropError(f"{where}: the hidden size ({f['hidden']}) is not a multiple of the attention heads "
                           f"({f['heads']})")
    return f["hidden"] // f["heads"]


def _spec(where: str, **fields) -> ModelSpec:
    try:
        return ModelSpec(**fields)
    except InteropError as exc:
        raise InteropError(f"{where}: {exc}") from None


# Llama-style HF families: what each model_type holds beyond Llama's keys.
#   biases      "attention_bias": q, k, v and o follow config["attention_bias"] (mlp: "mlp_bias");
#               "qkv": q, k, v always biased, o and the MLP never (Qwen2); "none": no biases (Mistral)
#   qk_norm     the model always has q/k RMSNorm per head (Qwen3)
#   sliding     "model": config["sliding_window"] applies to every layer (Mistral);
#               "per_layer": only with use_sliding_window, on some layers (Qwen): refused when on
#   defaults    the config class's defaults where they differ from LLAMA_KEYS'
#   moe         the family's mixture-of-experts keys (MOE_KEYS), absent for a dense family
#   rope_theta  the config class's rope_theta when config.json names none (LLAMA's 10000 otherwise)
#   norms       where the layer norms sit (absent: "pre", Llama's): "post" (OLMo 2: after attention and MLP only)
#   qk_norm_scope  what one q/k norm covers when qk_norm (absent: "head", Qwen3's): "projection" (OLMo 2)
#   qk_norm_key the config key that says whether the model has q/k norms (GLM-4.5's use_qk_norm), else qk_norm holds
#   partial_rotary  the family's class applies partial_rotary_factor (rope on part of each head): its default
#   holds       DeepSeek's facts the family's class holds too (GLM-4.5: MTP modules, groups, routed scaling)
#   unset       keys written as null unless the source says them: the config class's default would change the model
#               (Olmo2Config's pad_token_id 1 makes embedding row 1 a padding row, whose gradient is zero)
HF_FAMILIES = {
    "llama": {"architecture": "LlamaForCausalLM", "biases": "attention_bias", "qk_norm": False, "sliding": None,
              "defaults": {}},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "biases": "qkv", "qk_norm": False, "sliding": "per_layer",
              "defaults": {"vocab": 151936, "ffn_hidden": 22016, "max_positions": 32768}},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "biases": "attention_bias", "qk_norm": True, "sliding": "per_layer",
              "defaults": {"vocab": 151936, "ffn_hidden": 22016, "max_positions": 32768}},
    "mistral": {"architecture": "MistralForCausalLM", "biases": "none", "qk_norm": False, "sliding": "model",
                "defaults": {"ffn_hidden": 14336, "max_positions": 4096 * 32}},
    # transformers 5.23 models/mixtral/configuration_mixtral.py (MixtralConfig, default_theta 1e6)
    "mixtral": {"architecture": "MixtralForCausalLM", "biases": "none", "qk_norm": False, "sliding": "model",
                "defaults": {"ffn_hidden": 14336, "max_positions": 4096 * 32, "norm_eps": 1e-5, "kv_groups": 8},
                "moe": "mixtral", "rope_theta": 1e6},
    # transformers 5.23 models/qwen2_moe/configuration_qwen2_moe.py (Qwen2MoeConfig): q/k/v biased by `qkv_bias`
    "qwen2_moe": {"architecture": "Qwen2MoeForCausalLM", "biases": "qkv_key", "qk_norm": False, "sliding": "per_layer",
                  "defaults": {"vocab": 151936, "hidden": 2048, "ffn_hidden": 5632, "num_layers": 24, "heads": 16,
                               "max_positions": 32768, "kv_groups": 16}, "moe": "qwen2_moe"},
    # transformers 5.23 models/qwen3_moe/configuration_qwen3_moe.py (Qwen3MoeConfig): Qwen3's q/k norms, routed
    # experts only (no shared expert), dense layers by mlp_only_layers / decoder_sparse_step as Qwen2-MoE
    "qwen3_moe": {"architecture": "Qwen3MoeForCausalLM", "biases": "attention_bias", "qk_norm": True,
                  "sliding": "per_layer", "defaults": {"vocab": 151936, "hidden": 2048, "ffn_hidden": 6144,
                                                       "num_layers": 24, "heads": 32, "max_positions": 32768,
                                                       "kv_groups": 4}, "moe": "qwen3_moe"},
    # transformers 5.24 models/olmo2 (Olmo2Config, Olmo2Attention, Olmo2DecoderLayer): no pre-norms, RMSNorm on the
    # attention's and the MLP's output, q/k RMSNorm over the whole q / k projection, attention_bias on q, k, v, o
    "olmo2": {"architecture": "Olmo2ForCausalLM", "biases": "attention_bias", "qk_norm": True, "sliding": None,
              "defaults": {"vocab": 50304, "norm_eps": 1e-5}, "norms": "post", "qk_norm_scope": "projection",
              "unset": {"pad_token_id": None}},
    # transformers 5.24 models/phi3 (Phi3Config): Llama's facts without biases, a window on every layer when
    # sliding_window is set (Phi3Model: create_sliding_window_causal_mask); q/k/v and gate/up fused in the files
    # only (hf_names.PHI3).  It holds no fact Llama / Mistral lack, so it is written when asked (`--family phi3`,
    # or an HF phi3 source) and read always.  pad_token_id's default 32000 would make a padding row: unset.
    "phi3": {"architecture": "Phi3ForCausalLM", "biases": "none", "qk_norm": False, "sliding": "model",
             "partial_rotary": 1.0,
             "defaults": {"vocab": 32064, "hidden": 3072, "ffn_hidden": 8192, "max_positions": 4096, "norm_eps": 1e-5},
             "unset": {"pad_token_id": None}},
    # transformers 5.24 models/glm4_moe (Glm4MoeConfig, Glm4MoeAttention, Glm4MoeTopkRouter, Glm4MoeMoE): q, k, v
    # biased by attention_bias (o_proj never), q/k RMSNorm per head when use_qk_norm, partial rotary (rope on the
    # first head_dim * partial_rotary_factor values, rotate-half; 0.5 when the config names none), DeepSeek-V3's
    # sigmoid router with the correction bias and groups, shared experts, dense first layers, MTP modules
    "glm4_moe": {"architecture": "Glm4MoeForCausalLM", "biases": "qkv_attention_bias", "qk_norm": False,
                 "qk_norm_key": "use_qk_norm", "sliding": None, "partial_rotary": 0.5,
                 "defaults": {"vocab": 151552, "hidden": 4096, "ffn_hidden": 10944, "num_layers": 46, "heads": 96,
                              "kv_groups": 8, "max_positions": 131072, "norm_eps": 1e-5},
                 "moe": "glm4_moe", "holds": ("mtp_layers", "moe_groups", "moe_routed_scaling")},
    # transformers 5.24 models/gemma2 (Gemma2Config, Gemma2RMSNorm (1 + w), Gemma2Model's sqrt(hidden) normalizer,
    # Gemma2Attention query_pre_attn_scalar ** -0.5 and attn_logit_softcapping, final_logit_softcapping,
    # layer_types): the sandwich of four norms per layer, GeGLU with tanh GeLU (hidden_activation)
    "gemma2": {"architecture": "Gemma2ForCausalLM", "biases": "attention_bias", "qk_norm": False, "sliding": "layer_types",
               "defaults": {"vocab": 256000, "hidden": 2304, "ffn_hidden": 9216, "num_layers": 26, "heads": 8,
                            "kv_groups": 4, "max_positions": 8192, "norm_eps": 1e-6, "tied_embeddings": True},
               "norms": "sandwich", "gemma": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
               "unset": {"pad_token_id": None}},
    # transformers 5.24 models/gemma3 (Gemma3TextConfig, Gemma3ForCausalLM): Gemma 2's facts without soft-capping
    # by default, q/k RMSNorm per head as (1 + w), five sliding layers to one full, rope_parameters per layer type
    # (full_attention: rope_theta with its scaling, linear on the larger models; sliding_attention: the local base)
    "gemma3_text": {"architecture": "Gemma3ForCausalLM", "biases": "attention_bias", "qk_norm": True,
                    "sliding": "layer_types", "defaults": {"vocab": 262208, "hidden": 2304, "ffn_hidden": 9216,
                                                           "num_layers": 26, "heads": 8, "kv_groups": 4,
                                                           "max_positions": 131072, "norm_eps": 1e-6,
                                                           "tied_embeddings": True},
                    "norms": "sandwich", "gemma": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
                    "rope_per_layer_type": True, "unset": {"pad_token_id": None}},
    # transformers 5.24 models/gpt_oss (GptOssConfig, GptOssAttention's `sinks` joined to the softmax, GptOssTopKRouter
    # F.linear with bias then softmax over the top-k logits, GptOssExperts with biases and _apply_gate's clamped
    # quick GeLU, `layer_types`, yarn rope_parameters): every layer MoE, q/k/v/o biased by attention_bias (default true)
    "gpt_oss": {"architecture": "GptOssForCausalLM", "biases": "attention_bias", "qk_norm": False,
                "sliding": "layer_types", "defaults": {"vocab": 201088, "hidden": 2880, "ffn_hidden": 2880,
                                                       "num_layers": 36, "heads": 64, "kv_groups": 8,
                                                       "max_positions": 131072, "norm_eps": 1e-5},
                "moe": "gpt_oss", "rope_theta": 150000.0, "attention_bias": True, "expert_bias": True,
                "sinks": True, "clamped_glu": True, "yarn": True, "window": 128},
}
# Where the norms sit, per HF_FAMILIES "norms": ModelSpec (pre_norm, post_norm).
NORM_PLACES = {"pre": (True, False), "post": (False, True), "sandwich": (True, True)}
# Gemma's config keys (families with "gemma"): ModelSpec field <- config key.  query_pre_attn_scalar s is
# softmax_scale s ** -0.5; the activation is hidden_activation's tanh GeLU gating.
GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_tanh": "geglu_tanh"}
# Mixture-of-experts config keys: (spec field, config key, default) per family.  Mixtral's experts are
# `intermediate_size` wide (its only MLP); Qwen2-MoE's are `moe_intermediate_size`, its dense layers
# (`mlp_only_layers`, `decoder_sparse_step`) `intermediate_size`, its shared expert always gated.
MOE_KEYS = {
    "mixtral": [("num_experts", "num_local_experts", 8), ("moe_topk", "num_experts_per_tok", 2),
                ("moe_aux_loss_coeff", "router_aux_loss_coef", 0.001)],
    "qwen2_moe": [("num_experts", "num_experts", 60), ("moe_topk", "num_experts_per_tok", 4),
                  ("moe_ffn_hidden", "moe_intermediate_size", 1408),
                  ("shared_expert_ffn_hidden", "shared_expert_intermediate_size", 5632),
                  ("moe_norm_topk", "norm_topk_prob", False), ("moe_aux_loss_coeff", "router_aux_loss_coef", 0.001)],
    "glm4_moe": [("num_experts", "n_routed_experts", 128), ("moe_topk", "num_experts_per_tok", 8),
                 ("moe_ffn_hidden", "moe_intermediate_size", 1408), ("moe_routed_scaling", "routed_scaling_factor", 1.0),
                 ("moe_norm_topk", "norm_topk_prob", True)],
    "qwen3_moe": [("num_experts", "num_experts", 128), ("moe_topk", "num_experts_per_tok", 8),
                  ("moe_ffn_hidden", "moe_intermediate_size", 768), ("moe_norm_topk", "norm_topk_prob", False),
                  ("moe_aux_loss_coeff", "router_aux_loss_coef", 0.001)],
    "gpt_oss": [("num_experts", "num_local_experts", 128), ("moe_topk", "num_experts_per_tok", 4),
                ("moe_aux_loss_coeff", "router_aux_loss_coef", 0.001)],
}
# MoE config keys that describe training, not the model: kept for HF output (Reader.carried), named otherwise.
MOE_TRAINING_KEYS = {"mixtral": {"output_router_logits": False, "router_jitter_noise": 0.0},
                     "gpt_oss": {"output_router_logits": False},
                     "qwen2_moe": {"output_router_logits": False}, "qwen3_moe": {"output_router_logits": False},
                     "glm4_moe": {"output_router_logits": False},
                     **{model_type: hf_deepseek.TRAINING_KEYS for model_type in hf_deepseek.COMMON}}
# HF rope_parameters keys of the llama3 rope type <-> ModelSpec.rope_scaling keys.
LLAMA3_ROPE_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                    "original_max_position_embeddings": "original_max_positions"}


# config.json keys spec_from_hf_config reads beyond the tables above (map-args names every other key as unread).
GPT2_READS = ("model_type", "n_inner", "activation_function", *GPT2_UNSUPPORTED)
LLAMA_READS = ("model_type", "hidden_act", "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters",
               "rope_scaling", "attention_bias", "mlp_bias", "qkv_bias", "sliding_window", "use_sliding_window",
               "decoder_sparse_step", "mlp_only_layers", "layer_types", "swiglu_alpha", "swiglu_limit")


def config_keys(model_type: str) -> set:
    """Every config.json key that `spec_from_hf_config` reads for this model_type."""
    if model_type == "gpt2":
        return {key for _, key, _ in GPT2_KEYS} | set(GPT2_READS)
    if model_type in hf_deepseek.COMMON:
        return hf_deepseek.config_keys(model_type)
    family = HF_FAMILIES[model_type]
    moe = MOE_KEYS.get(family.get("moe"), [])
    extra = set(hf_deepseek.SIGMOID_ROUTING_READS) if family.get("holds") else set()
    extra |= {family["qk_norm_key"]} if family.get("qk_norm_key") else set()
    extra |= {"partial_rotary_factor"} if family.get("partial_rotary") is not None else set()
    return {key for _, key, _ in LLAMA_KEYS + moe} | set(LLAMA_READS) | extra


def spec_from_hf_config(config: dict, dtype: str = "float32", where: str = "config.json") -> ModelSpec:
    model_type = config.get("model_type")
    if model_type == "gpt2":
        return _gpt2_spec(config, dtype, where)
    if model_type in HF_FAMILIES:
        return _llama_spec(config, model_type, dtype, where)
    if model_type in hf_deepseek.COMMON:
        return hf_deepseek.spec_from_config(config, dtype, where, _read_table, _rope_scaling)
    raise InteropError(f"{where}: model_type {model_type!r} is not supported "
                       f"(gpt2, {', '.join([*HF_FAMILIES, *hf_deepseek.COMMON])} are)")


def _gpt2_spec(config: dict, dtype: str, where: str) -> ModelSpec:
    for key, ok in GPT2_UNSUPPORTED.items():
        if config.get(key, ok) != ok:
            raise InteropError(f"{where}: {key}={config[key]!r} is not supported")
    f = _read_table(config, GPT2_KEYS, where)
    act = config.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise InteropError(f"{where}: activation_function {act!r} is not supported")
    return _spec(
        where, arch="gpt2", ffn_hidden=_optional_int(config, "n_inner", where) or 4 * f["hidden"], kv_groups=f["heads"],
        head_dim=_head_dim({}, f, where), padded_vocab=f["vocab"], norm="layernorm",
        activation=GPT2_ACTIVATIONS[act], position="learned", qkv_bias=True, linear_bias=True, dtype=dtype,
        attention_dropout=config.get("attn_pdrop", 0.1), hidden_dropout=config.get("resid_pdrop", 0.1), **f)


def _rope_scaling(config: dict, rope: dict, where: str):
    """ModelSpec.rope_scaling from rope_parameters (transformers 5) or rope_scaling (older configs)."""
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) and \
        "full_attention" not in config["rope_scaling"] else rope
    if not isinstance(scaling, dict):
        raise InteropError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "yarn" and (config.get("model_type") in hf_deepseek.COMMON
                           or HF_FAMILIES.get(config.get("model_type"), {}).get("yarn")):
        return hf_deepseek.yarn_from_config(scaling, where)
    if kind == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise InteropError(f"{where}: linear rope scaling factor must be a positive number, got {factor!r}")
        return {"type": "linear", "factor": float(factor)}
    if kind in ("longrope", "su"):  # "su": older Phi-3 configs' name for it (Phi3Config renames it)
        return _longrope(config, scaling, where)
    if kind != "llama3":
        raise InteropError(f"{where}: rope type {kind!r} is not supported (default, linear, llama3 and longrope are; yarn for DeepSeek)")
    missing = [k for k in LLAMA3_ROPE_KEYS if scaling.get(k) is None]
    if missing:
        raise InteropError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    bad = [k for k in LLAMA3_ROPE_KEYS if not isinstance(scaling[k], (int, float)) or isinstance(scaling[k], bool)]
    if bad:
        raise InteropError(f"{where}: llama3 rope scaling {bad[0]} must be a number, got {scaling[bad[0]]!r}")
    return llama3_rope_scaling(**{ours: scaling[hf] for hf, ours in LLAMA3_ROPE_KEYS.items()})


def _gemma_fields(config: dict, f: dict, where: str, defaults: dict) -> dict:
    """Gemma 2's facts from its config: (1 + w) norms, the embedding scale, the GeGLU, the attention scale and
    soft-capping, the window on the layers `layer_types` names "sliding_attention"."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise InteropError(f"{where}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    scalar = config.get("query_pre_attn_scalar", 256)
    caps = {}
    for field, key in (("attn_softcap", "attn_logit_softcapping"), ("logit_softcap", "final_logit_softcapping")):
        value = config.get(key, defaults[key])
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
            raise InteropError(f"{where}: {key} must be a positive number or null, got {value!r}")
        caps[field] = None if value is None else float(value)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise InteropError(f"{where}: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    return dict(activation=GEMMA_ACTIVATIONS[act], norm_zero_centered=True, embed_scale=True,
                softmax_scale=float(scalar) ** -0.5, **_layer_windows(config, f, where, 4096), **caps)


def _layer_windows(config: dict, f: dict, where: str, default_window: int) -> dict:
    """sliding_window on the layers `layer_types` names "sliding_attention" (the config classes' default: every
    other layer from the first, Gemma2Config's and GptOssConfig's)."""
    window = _optional_int(config, "sliding_window", where) if "sliding_window" in config else default_window
    types = config.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(f["num_layers"])]
    if not isinstance(types, list) or len(types) != f["num_layers"] or not set(types) <= {"sliding_attention",
                                                                                          "full_attention"}:
        raise InteropError(f"{where}: layer_types must list sliding_attention / full_attention per layer, got {types!r}")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if window is None or not sliding:
        window, sliding = None, None
    elif len(sliding) == len(types):
        sliding = None
    return dict(sliding_window=window, sliding_layers=sliding)


def _clamped_glu_fields(config: dict, where: str) -> dict:
    """gpt-oss's experts' activation: swiglu_alpha (transformers' _apply_gate gain; megatron-core's quick_gelu fixes
    1.702) and swiglu_limit (the clamp), with up + 1 (glu_linear_offset)."""
    alpha, limit = config.get("swiglu_alpha", QUICK_GELU_ALPHA), config.get("swiglu_limit", 7.0)
    if alpha != QUICK_GELU_ALPHA:
        raise InteropError(f"{where}: swiglu_alpha={alpha!r} is not supported ({QUICK_GELU_ALPHA}, quick GeLU's gain "
                           "as megatron-core fixes it, is)")
    if limit is not None and (not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0):
        raise InteropError(f"{where}: swiglu_limit must be a positive number or null, got {limit!r}")
    return dict(activation="quick_geglu", glu_clamp=None if limit is None else float(limit), glu_linear_offset=1.0)


def _gemma_config(spec: ModelSpec) -> dict:
    """The Gemma 2 keys of a config.json (the inverse of `_gemma_fields`)."""
    scale = spec.softmax_scale if spec.softmax_scale is not None else spec.head_dim ** -0.5
    scalar = 1.0 / (scale * scale)
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": int(round(scalar))
            if abs(scalar - round(scalar)) < 1e-9 else scalar, "attn_logit_softcapping": spec.attn_softcap,
            "final_logit_softcapping": spec.logit_softcap, "sliding_window": spec.sliding_window,
            "layer_types": ["sliding_attention" if spec.is_sliding_layer(i) else "full_attention"
                            for i in range(spec.num_layers)]}


def _longrope(config: dict, scaling: dict, where: str) -> dict:
    """LongRoPE as transformers 5.24 computes it (modeling_rope_utils.py _compute_longrope_parameters): the
    attention factor given, else sqrt(1 + ln(f) / ln(original)) for f = `factor` or max_position_embeddings /
    original_max_position_embeddings when f > 1, else 1."""
    original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise InteropError(f"{where}: longrope needs original_max_position_embeddings, got {original!r}")
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise InteropError(f"{where}: longrope {key} must be a list of numbers, got {scaling.get(key)!r}")
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling.get("factor") or config.get("max_position_embeddings", 4096) / original
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return longrope_scaling(scaling["short_factor"], scaling["long_factor"], original, attention)


def _sliding_window(config: dict, family: dict, where: str):
    window = config.get("sliding_window")
    if family["sliding"] == "model":
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise InteropError(f"{where}: sliding_window must be a positive integer, got {window!r}")
        return window
    if family["sliding"] == "per_layer" and config.get("use_sliding_window"):
        raise InteropError(f"{where}: use_sliding_window (a window on some layers only) is not supported")
    return None


def _llama_spec(config: dict, model_type: str, dtype: str, where: str) -> ModelSpec:
    family = HF_FAMILIES[model_type]
    table = [(field, key, family["defaults"].get(field, default)) for field, key, default in LLAMA_KEYS]
    f = _read_table(config, table, where)
    if family.get("gemma"):
        gemma = _gemma_fields(config, f, where, family["gemma"])
    elif config.get("hidden_act", "silu") != "silu":
        raise InteropError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (silu is)")
    elif family.get("clamped_glu"):  # gpt-oss: the sliding layers, the sinks and the experts' clamped GeLU
        gemma = {**_clamped_glu_fields(config, where), **_layer_windows(config, f, where, family["window"]),
                 "attn_sinks": True}
    else:
        gemma = {}
    moe = _moe_fields(config, family, f, where) if family.get("moe") else {}
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InteropError(f"{where}: rope_parameters must be an object, got {rope!r}")
    local_base = None
    if family.get("rope_per_layer_type") and "full_attention" in rope:  # Gemma 3: one rope per layer type
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise InteropError(f"{where}: sliding_attention rope type {local.get('rope_type')!r} is not supported "
                               "(default is)")
        local_base = local.get("rope_theta", config.get("rope_local_base_freq", 10000.0))
        rope = rope["full_attention"]
        if not isinstance(rope, dict) or not isinstance(local_base, (int, float)) or isinstance(local_base, bool):
            raise InteropError(f"{where}: rope_parameters per layer type must be objects with numeric rope_theta")
    if family["biases"] == "qkv":
        qkv_bias, linear_bias, mlp_bias = True, False, None
    elif family["biases"] == "qkv_key":
        qkv_bias = config.get("qkv_bias", True)
        if not isinstance(qkv_bias, bool):
            raise InteropError(f"{where}: qkv_bias must be true or false, got {qkv_bias!r}")
        linear_bias, mlp_bias = False, None
    elif family["biases"] == "none":
        qkv_bias, linear_bias, mlp_bias = False, False, None
    elif family["biases"] == "qkv_attention_bias":
        qkv_bias, linear_bias, mlp_bias = _bool(config, "attention_bias", where), False, None
    else:
        attention_bias = bool(config.get("attention_bias", family.get("attention_bias", False)))
        mlp = bool(config.get("mlp_bias", family.get("expert_bias", False)))
        qkv_bias, linear_bias = attention_bias, attention_bias  # attention_bias is q, k, v and o
        mlp_bias = None if mlp == attention_bias else mlp
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is None:
        partial = family.get("partial_rotary", 1.0)
    if family.get("partial_rotary") is None and partial not in (1, 1.0):
        holders = ", ".join(t for t, fam in HF_FAMILIES.items() if fam.get("partial_rotary") is not None)
        raise InteropError(f"{where}: partial_rotary_factor={partial!r}: transformers' {model_type} rotates the whole "
                           f"head ({holders} apply it)")
    if not isinstance(partial, (int, float)) or isinstance(partial, bool):
        raise InteropError(f"{where}: partial_rotary_factor must be a number, got {partial!r}")
    qk_norm = _bool(config, family["qk_norm_key"], where) if family.get("qk_norm_key") else family["qk_norm"]
    heads = f["heads"]
    rope_base = rope.get("rope_theta", config.get("rope_theta", family.get("rope_theta", 10000.0)))
    if not isinstance(rope_base, (int, float)) or isinstance(rope_base, bool):
        raise InteropError(f"{where}: rope_theta must be a number, got {rope_base!r}")
    return _spec(
        where, arch="llama",
        kv_groups=_optional_int(config, "num_key_value_heads", where) or family["defaults"].get("kv_groups", heads),
        head_dim=_head_dim(config, f, where), padded_vocab=f["vocab"], norm="rmsnorm",
        activation=gemma.pop("activation", "swiglu"), position="rope", rope_base=float(rope_base),
        qkv_bias=qkv_bias, linear_bias=linear_bias, mlp_bias=mlp_bias, qk_norm=qk_norm, rotary_percent=float(partial),
        qk_norm_scope=family.get("qk_norm_scope", "head"),
        **dict(zip(("pre_norm", "post_norm"), NORM_PLACES[family.get("norms", "pre")])),
        rope_scaling=_rope_scaling(config, rope, where),
        rope_local_base=None if local_base is None else float(local_base),
        **({} if family["sliding"] == "layer_types" else {"sliding_window": _sliding_window(config, family, where)}),
        attention_dropout=config.get("attention_dropout", 0.0), hidden_dropout=0.0,  # no other dropout in these
        dtype=dtype, **f, **moe, **gemma)


def _bool(config: dict, key: str, where: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise InteropError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _dropout(value: float | None) -> float:
    """A dropout the source stated, else 0.0 (the value for inference, as interop wrote before carrying them)."""
    return 0.0 if value is None else value


def _moe_fields(config: dict, family: dict, f: dict, where: str) -> dict:
    """The ModelSpec MoE fields of a Mixtral or Qwen2-MoE config.json."""
    kind = family["moe"]
    if kind == "qwen3_moe" and "num_experts" not in config and "num_local_experts" in config:
        # transformers 5's Qwen3MoeConfig saves num_experts under its attribute_map target (and reads either)
        config = {**config, "num_experts": config["num_local_experts"]}
    out = _read_table(config, MOE_KEYS[kind], where)
    if family.get("holds"):  # GLM-4.5: DeepSeek-V3's routing facts, read by the one reader of them
        return {**out, **hf_deepseek.sigmoid_routing({**config, "model_type": config.get("model_type")}, {**f, **out},
                                                     where, hf_deepseek.SIGMOID_ROUTING_DEFAULTS[kind])}
    if out["moe_aux_loss_coeff"] < 0:
        raise InteropError(f"{where}: router_aux_loss_coef must be >= 0, got {out['moe_aux_loss_coeff']!r}")
    out["moe_aux_loss_coeff"] = float(out["moe_aux_loss_coeff"])
    if kind in ("mixtral", "gpt_oss"):  # every layer is MoE; the router always renormalises its top-k
        out["moe_ffn_hidden"] = f["ffn_hidden"]
        if kind == "gpt_oss":  # GptOssTopKRouter: F.linear(x, weight, bias)
            out["moe_router_logit_bias"] = True
        return out
    if kind == "qwen2_moe":
        out["shared_expert_gate"] = True  # Qwen2MoeSparseMoeBlock always has shared_expert_gate [1, hidden]
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise InteropError(f"{where}: decoder_sparse_step must be a positive integer, got {step!r}")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise InteropError(f"{where}: mlp_only_layers must be a list of layer numbers, got {dense!r}")
    # Qwen2MoeDecoderLayer: MoE unless listed in mlp_only_layers, on every decoder_sparse_step-th layer
    layers = [i for i in range(f["num_layers"]) if i not in dense and (i + 1) % step == 0]
    if not layers:
        raise InteropError(f"{where}: no layer is mixture-of-experts (mlp_only_layers / decoder_sparse_step): "
                           "convert it as the dense qwen2 model it is")
    out["moe_layers"] = None if len(layers) == f["num_layers"] else layers
    return out


def hf_family(spec: ModelSpec) -> str:
    """The HF model_type that holds this Llama-style model: the one whose facts match it."""
    if spec.is_mla:
        return hf_deepseek.family(spec)
    if spec.attn_sinks or spec.moe_router_logit_bias or spec.activation == "quick_geglu":
        return "gpt_oss"
    if spec.is_moe:
        if spec.moe_router_score == "sigmoid" or spec.moe_router_bias or spec.mtp_layers:
            return "glm4_moe"  # DeepSeek-V3's routing without multi-latent attention
        if spec.shared_expert_ffn_hidden is not None:
            return "qwen2_moe"
        # q/k norms without Mixtral's every-layer sliding window: Qwen3-MoE; otherwise Mixtral says what it lacks
        return "qwen3_moe" if spec.qk_norm and spec.sliding_window is None else "mixtral"
    if spec.post_norm and not spec.pre_norm:
        return "olmo2"
    if spec.norm_zero_centered or spec.embed_scale or spec.post_norm:
        return "gemma3_text" if spec.qk_norm or spec.rope_local_base is not None else "gemma2"
    if spec.rope_scaling is not None and spec.rope_scaling["type"] == "longrope":
        return "phi3"
    if spec.qk_norm:
        return "qwen3"
    if spec.qkv_bias and not spec.linear_bias and not spec.has_mlp_bias:
        return "qwen2"
    if spec.sliding_window is not None:
        return "mistral"
    return "llama"


# What each HF architecture can express; a spec outside it would load as a different model.
HF_SHAPES = {
    "gpt2": {"norm": ("layernorm",), "position": ("learned",), "activation": ("gelu", "gelu_tanh")},
    "llama": {"norm": ("rmsnorm",), "position": ("rope",), "activation": ("swiglu", "geglu_tanh", "quick_geglu")},
}


def hf_config_from_spec(spec: ModelSpec, cannot: list | None = None, model_type: str | None = None) -> dict:
    """A config.json that `AutoModelForCausalLM.from_pretrained` builds the same model from.

    What the HF class cannot hold is refused; with `cannot` (a list) it is appended there instead as
    (ModelSpec field, why) and the nearest config is written: map-args reports it and goes on."""
    def refuse(field: str, why: str) -> None:
        if cannot is None:
            raise InteropError(why)
        cannot.append((field, why))

    for field, allowed in HF_SHAPES[spec.arch].items():
        if getattr(spec, field) not in allowed:
            refuse(field, f"HF {spec.arch} cannot hold a model with {field}={getattr(spec, field)} "
                          f"(it has {' or '.join(allowed)})")
    if model_type is not None and model_type not in HF_FAMILIES:
        raise InteropError(f"HF family {model_type!r} is not one interop writes ({', '.join(HF_FAMILIES)} are)")
    if model_type is not None and spec.arch == "gpt2":
        raise InteropError(f"HF {model_type} cannot hold a GPT2 model (learned positions, LayerNorm)")
    if model_type is not None and spec.is_moe != bool(HF_FAMILIES[model_type].get("moe")):
        refuse("num_experts", f"HF {model_type} cannot hold a {'mixture-of-experts' if spec.is_moe else 'dense'} model")
    _check_family_norms(spec, "gpt2" if spec.arch == "gpt2" else model_type or hf_family(spec), refuse)
    if spec.arch == "gpt2":
        if spec.kv_groups != spec.heads or spec.head_dim * spec.heads != spec.hidden:
            refuse("kv_groups" if spec.kv_groups != spec.heads else "head_dim",
                   "HF GPT2 needs multi-head attention with head_dim * heads == hidden")
        if not (spec.qkv_bias and spec.linear_bias):
            refuse("linear_bias", "HF GPT2 has biases on every linear layer; this model has none")
        config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_inner": spec.ffn_hidden,
                  "activation_function": GPT2_ACTIVATION_OUT.get(spec.activation, "gelu_new"),
                  "resid_pdrop": _dropout(spec.hidden_dropout), "embd_pdrop": _dropout(spec.hidden_dropout),
                  "attn_pdrop": _dropout(spec.attention_dropout)}
        table = GPT2_KEYS
    elif spec.is_mla:
        config, table = hf_deepseek.config_from_spec(spec, refuse), []
    else:
        model_type = model_type or hf_family(spec)
        family = HF_FAMILIES[model_type]
        for field, absent in (("mtp_layers", 0), ("moe_groups", None), ("moe_routed_scaling", 1.0),
                              ("rope_interleave", False)):  # DeepSeek's facts, held by its classes (and GLM-4.5's)
            if getattr(spec, field) != absent and field not in family.get("holds", ()):
                refuse(field, f"HF {model_type} cannot hold {field}={getattr(spec, field)}")
        if spec.rope_scaling is not None and spec.rope_scaling["type"] == "yarn" and not family.get("yarn"):
            refuse("rope_scaling", f"HF {model_type} cannot hold yarn rope scaling (DeepSeek's classes and "
                                   f"{', '.join(t for t, f in HF_FAMILIES.items() if f.get('yarn'))} do)")
        config = {**family.get("unset", {}), "architectures": [family["architecture"]], "model_type": model_type,
                  "hidden_act": "silu",
                  "num_key_value_heads": spec.kv_groups, "head_dim": spec.head_dim,
                  "rope_theta": spec.rope_base, "rope_parameters": _rope_parameters(spec),
                  "attention_dropout": _dropout(spec.attention_dropout)}
        if family["biases"] == "attention_bias":
            if spec.qkv_bias != spec.linear_bias:
                refuse("linear_bias", f"HF {model_type}'s attention_bias puts biases on q, k, v and o together; "
                                      "this model has them on only some")
            config["attention_bias"] = spec.qkv_bias
            if model_type == "llama":
                config["mlp_bias"] = spec.has_mlp_bias
            elif family.get("expert_bias") and not spec.has_mlp_bias:
                refuse("mlp_bias", f"HF {model_type}'s experts always have biases; this model's have none")
            elif spec.has_mlp_bias and not family.get("expert_bias"):
                refuse("mlp_bias", f"HF {model_type} has no MLP biases; this model has them")
        elif family["biases"] == "none" and (spec.qkv_bias or spec.linear_bias or spec.has_mlp_bias):
            refuse("qkv_bias" if spec.qkv_bias else "linear_bias", f"HF {model_type} has no biases; this model has them")
        elif family["biases"] == "qkv_attention_bias":
            if spec.linear_bias or spec.has_mlp_bias:
                refuse("linear_bias", f"HF {model_type} has biases on q, k and v only; this model has others")
            config["attention_bias"] = spec.qkv_bias
        elif family["biases"] == "qkv_key":
            if spec.linear_bias or spec.has_mlp_bias:
                refuse("linear_bias", f"HF {model_type} has biases on q, k and v only; this model has others")
            config["qkv_bias"] = spec.qkv_bias
        if family.get("qk_norm_key"):
            config[family["qk_norm_key"]] = spec.qk_norm
        if family.get("partial_rotary") is not None:
            config["rope_parameters"]["partial_rotary_factor"] = spec.rotary_percent
        elif spec.rotary_percent != 1.0:
            holders = ", ".join(t for t, fam in HF_FAMILIES.items() if fam.get("partial_rotary") is not None)
            refuse("rotary_percent", f"HF {model_type} cannot hold partial rotary (rotary_percent="
                                     f"{spec.rotary_percent}: {holders} can)")
        if family.get("holds"):
            config.update(_sigmoid_moe_config(spec, model_type, refuse))
        elif family.get("moe"):
            config.update(_moe_config(spec, model_type, refuse))
        if family.get("gemma"):
            del config["hidden_act"]
            config.update(_gemma_config(spec))
        if family.get("rope_per_layer_type"):
            config["rope_parameters"] = {"full_attention": config["rope_parameters"], "sliding_attention": {
                "rope_type": "default", "rope_theta": spec.rope_local_base if spec.rope_local_base is not None
                else spec.rope_base}}
        elif spec.rope_local_base is not None:
            refuse("rope_local_base", f"HF {model_type} cannot hold a rope base of its own for sliding layers "
                                      "(gemma3_text can)")
        if spec.rope_scaling is not None and spec.rope_scaling["type"] == "linear" and \
                not family.get("rope_per_layer_type"):
            refuse("rope_scaling", f"HF {model_type}: interop writes linear rope scaling for gemma3_text only")
        if family.get("clamped_glu"):
            config.update(swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=spec.glu_clamp)
            if spec.glu_linear_offset != 1.0:
                refuse("glu_linear_offset", f"HF {model_type} adds 1 to up (glu_linear_offset 1.0); this model adds "
                                            f"{spec.glu_linear_offset}")
        if family["sliding"] == "layer_types" and not family.get("gemma"):
            config["sliding_window"] = spec.sliding_window
            config["layer_types"] = ["sliding_attention" if spec.is_sliding_layer(i) else "full_attention"
                                     for i in range(spec.num_layers)]
        if family["sliding"] == "model":
            config["sliding_window"] = spec.sliding_window
        elif family["sliding"] == "per_layer":
            config["use_sliding_window"] = False
            config["sliding_window"] = None
        if spec.sliding_window is not None and family["sliding"] not in ("model", "layer_types"):
            refuse("sliding_window", f"HF {model_type} cannot hold a sliding window on every layer "
                                     f"(sliding_window={spec.sliding_window})")
        table = LLAMA_KEYS
    for field, key, _ in table:
        config[key] = getattr(spec, field)
    if spec.rope_scaling is not None and spec.rope_scaling["type"] == "longrope":
        if config.get("model_type") != "phi3":
            refuse("rope_scaling", f"HF {config.get('model_type')} cannot hold longrope scaling (phi3 can: --family phi3)")
        config["original_max_position_embeddings"] = spec.rope_scaling["original_max_positions"]
    if config.get("model_type") in ("mixtral", "gpt_oss"):  # its experts are its MLP: intermediate_size is their width
        config["intermediate_size"] = spec.moe_ffn_hidden
    config["torch_dtype"] = spec.dtype
    return config


def _check_family_norms(spec: ModelSpec, model_type: str, refuse) -> None:
    """Refuse a model whose norms sit elsewhere than the HF family's (it would load as another model)."""
    family = HF_FAMILIES.get(model_type, {})
    holders = [t for t, f in HF_FAMILIES.items()
               if NORM_PLACES[f.get("norms", "pre")] == (spec.pre_norm, spec.post_norm)]
    if NORM_PLACES[family.get("norms", "pre")] != (spec.pre_norm, spec.post_norm):
        where = {(True, False): "before", (False, True): "after", (True, True): "before and after"}
        refuse("post_norm", f"HF {model_type} cannot hold norms {where[(spec.pre_norm, spec.post_norm)]} attention "
                            f"and MLP ({', '.join(holders) or 'no HF family here'} can)")
    holders = [t for t, f in HF_FAMILIES.items() if f.get("sinks")]  # gpt_oss: its three facts come together
    for fact, has in (("attn_sinks", spec.attn_sinks), ("activation", spec.activation == "quick_geglu"),
                      ("moe_router_logit_bias", spec.moe_router_logit_bias)):
        what = "activation=quick_geglu" if fact == "activation" else fact
        if has and not family.get("sinks"):
            refuse(fact, f"HF {model_type} cannot hold {what} ({', '.join(holders)} can)")
        elif family.get("sinks") and not has:
            refuse(fact, f"HF {model_type} always has {what}; this model has not")
    gemma = bool(family.get("gemma"))
    gemma_facts = {"norm_zero_centered": spec.norm_zero_centered, "embed_scale": spec.embed_scale,
                   "activation": spec.activation == "geglu_tanh"}
    for fact, has in gemma_facts.items():
        what = f"{fact}=geglu_tanh" if fact == "activation" else fact
        if has and not gemma:
            refuse(fact, f"HF {model_type} cannot hold {what} (gemma2, gemma3_text can)")
        elif gemma and not has:
            refuse(fact, f"HF {model_type} always has {what}; this model has not")
    if not gemma:
        for fact in ("softmax_scale", "attn_softcap", "logit_softcap", "sliding_layers"):
            if fact == "sliding_layers" and family.get("sliding") == "layer_types":
                continue
            if getattr(spec, fact) is not None:
                refuse(fact, f"HF {model_type} cannot hold {fact}={getattr(spec, fact)} (gemma2, gemma3_text can)")
    scope = family.get("qk_norm_scope", "head")
    if spec.qk_norm and spec.qk_norm_scope != scope:
        holders = [t for t, f in HF_FAMILIES.items() if f["qk_norm"] and f.get("qk_norm_scope", "head") == spec.qk_norm_scope]
        refuse("qk_norm_scope", f"HF {model_type} cannot hold q/k norms over each {spec.qk_norm_scope} "
                                f"({', '.join(holders)} can)")
    if family.get("qk_norm") and not spec.qk_norm:
        refuse("qk_norm", f"HF {model_type} always has q/k norms; this model has none")


def _sigmoid_moe_config(spec: ModelSpec, model_type: str, refuse) -> dict:
    """GLM-4.5's MoE keys: its table's and DeepSeek-V3's routing facts (hf_deepseek.sigmoid_routing_config)."""
    def cannot(field: str, what: str) -> None:
        refuse(field, f"HF {model_type} cannot hold this mixture-of-experts model: it has {what}")

    out = hf_deepseek.sigmoid_routing_config(spec, cannot)
    out.update({key: getattr(spec, field) for field, key, _ in MOE_KEYS[model_type]})
    out.update(MOE_TRAINING_KEYS[model_type])
    return out


def _moe_config(spec: ModelSpec, model_type: str, refuse) -> dict:
    """The MoE keys of a Mixtral / Qwen2-MoE config.json; what the family's model cannot run is refused."""
    def cannot(field: str, what: str) -> None:
        refuse(field, f"HF {model_type} cannot hold this mixture-of-experts model: it has {what}")

    if spec.moe_router_score != "softmax":
        cannot("moe_router_score", f"a {spec.moe_router_score} router (HF's is a softmax)")
    if spec.moe_router_bias:
        cannot("moe_router_bias", "a router expert bias")
    if spec.qk_norm != HF_FAMILIES[model_type]["qk_norm"]:
        cannot("qk_norm", "q/k norms" if spec.qk_norm else "no q/k norms")
    if model_type == "mixtral":
        if not spec.moe_norm_topk:
            cannot("moe_norm_topk", "top-k probabilities left unnormalised (Mixtral always renormalises them; no HF "
                                    "class without a shared expert or q/k norms keeps them: interop convert "
                                    "--renormalize-topk writes HF Mixtral anyway, with a note of the changed rule)")
        if spec.moe_layers is not None:
            cannot("moe_layers", f"dense layers (only {spec.moe_layers} are MoE)")
    elif model_type == "gpt_oss":  # GptOssTopKRouter: softmax of the top-k logits; every layer MoE, no shared one
        if not spec.moe_norm_topk:
            cannot("moe_norm_topk", "top-k probabilities left unnormalised (gpt-oss's router takes the softmax of "
                                    "the top-k logits)")
        if spec.moe_layers is not None:
            cannot("moe_layers", f"dense layers (only {spec.moe_layers} are MoE)")
        if spec.shared_expert_ffn_hidden is not None:
            cannot("shared_expert_ffn_hidden", "a shared expert")
    elif model_type == "qwen3_moe":
        if spec.shared_expert_ffn_hidden is not None:
            cannot("shared_expert_ffn_hidden", "a shared expert")
    elif not spec.shared_expert_gate:
        cannot("shared_expert_gate", "a shared expert without its sigmoid gate")
    out = {key: getattr(spec, field) for field, key, _ in MOE_KEYS[model_type]}
    out.update(MOE_TRAINING_KEYS[model_type])
    if model_type in ("qwen2_moe", "qwen3_moe"):
        moe_layers = range(spec.num_layers) if spec.moe_layers is None else spec.moe_layers
        out.update(decoder_sparse_step=1, mlp_only_layers=[i for i in range(spec.num_layers) if i not in moe_layers])
    return out


def _rope_parameters(spec: ModelSpec) -> dict:
    if spec.rope_scaling is None:
        return {"rope_theta": spec.rope_base, "rope_type": "default"}
    if spec.rope_scaling["type"] == "yarn":  # written for the families that hold it (gpt_oss)
        return hf_deepseek.rope_parameters(spec)
    if spec.rope_scaling["type"] == "linear":
        return {"rope_theta": spec.rope_base, "rope_type": "linear", "factor": spec.rope_scaling["factor"]}
    if spec.rope_scaling["type"] == "longrope":
        r = spec.rope_scaling
        return {"rope_theta": spec.rope_base, "rope_type": "longrope", "short_factor": r["short_factor"],
                "long_factor": r["long_factor"], "original_max_position_embeddings": r["original_max_positions"],
                "attention_factor": r["attention_factor"]}
    out = {"rope_theta": spec.rope_base, "rope_type": "llama3"}
    out.update({hf: spec.rope_scaling[ours] for hf, ours in LLAMA3_ROPE_KEYS.items()})
    return out
