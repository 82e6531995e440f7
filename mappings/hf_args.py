"""Megatron args <-> Hugging Face config.json, for GPT2 and the Llama-style families (Llama, Qwen2, Qwen3, Mistral).

The architecture is the model's: "llama" when RMSNorm + SwiGLU + RoPE, else
"gpt2". What a config.json cannot say (a GPT2 without
biases, a Llama with GeLU) is not forced: it shows up as a loss in the report.
`vocab_size` is the tokenizer's true vocabulary, as `interop convert --to hf` writes it (it strips
Megatron's padding rows); only where the source records no more than the padded size is that
written, with a warning.
"""
from __future__ import annotations

from ..errors import InteropError
from ..spec import llama3_rope_scaling
from .hf_config import GPT2_ACTIVATION_OUT, GPT2_ACTIVATIONS, GPT2_KEYS, LLAMA_KEYS
from .megatron_args import CONST, OMIT, R, Unmappable, moe_layer_pattern
from .megatron_spec import SPEC_NUMBERS


def _numbers(hf_keys) -> list:
    """R(Megatron dest, HF key) for the plain numbers: the HF key of each ModelSpec field is
    `hf_config`'s, its Megatron argument `megatron_spec`'s; neither name is written here again."""
    return [R(SPEC_NUMBERS[field], key) for field, key, _ in hf_keys if field in SPEC_NUMBERS]


def _untie(v, doc):
    return {"untie_embeddings_and_output_weights": not v}


def _gpt2_act(act):
    if act not in GPT2_ACTIVATION_OUT:
        raise Unmappable(f"GPT2 has no {act} activation")
    return GPT2_ACTIVATION_OUT[act]


def _llama_act(act):
    if act != "swiglu":
        raise Unmappable(f"Llama's MLP is SwiGLU, not {act}")
    return "silu"


def _llama_bias(qkv, linear):
    if qkv != linear:
        raise Unmappable("Llama's attention_bias covers q, k, v and o together; Megatron has qkv bias "
                         f"{qkv} with linear bias {linear}")
    return linear


def _kv_heads_back(v, doc):
    return {"num_query_groups": v, "group_query_attention": v != doc.get("num_attention_heads")}


def _dtype_back(v, doc):
    return {"params_dtype": v} if v in ("float32", "bfloat16", "float16") else {}


GPT2 = [
    CONST("model_type", "gpt2"),
    CONST("architectures", ["GPT2LMHeadModel"]),
    *_numbers(GPT2_KEYS),
    R("ffn_hidden_size", "n_inner"),
    R("activation", "activation_function", to=_gpt2_act,
      back=lambda v, doc: {"activation": GPT2_ACTIVATIONS.get(v, v)}),
    R("untie_embeddings_and_output_weights", "tie_word_embeddings", True, to=lambda v: not v, back=_untie),
    R("hidden_dropout", "resid_pdrop"),
    R("hidden_dropout", "embd_pdrop"),
    R("attention_dropout", "attn_pdrop"),
    R("init_method_std", "initializer_range"),
    R("params_dtype", "torch_dtype", back=_dtype_back),
]

# Megatron-core's --use-rope-scaling fixes these (models/common/embeddings/rotary_pos_embedding.py): spec's defaults.
_FIXED = llama3_rope_scaling(1.0)
MEGATRON_LLAMA3 = {"low_freq_factor": _FIXED["low_freq_factor"], "high_freq_factor": _FIXED["high_freq_factor"],
                   "original_max_position_embeddings": _FIXED["original_max_positions"]}


def _rope(base, scaling, factor):
    out = {"rope_theta": float(base), "rope_type": "default"}
    if scaling:
        out |= {"rope_type": "llama3", "factor": float(factor), **MEGATRON_LLAMA3}
    return out


def _rope_back(v, doc):
    """rope_parameters that normalize_doc kept (not the default type): llama3 -> --use-rope-scaling."""
    kind = v.get("rope_type", v.get("type"))
    if kind != "llama3":
        return {"_note": f"rope type {kind!r} has no Megatron equivalent"}
    out = {"use_rope_scaling": True, "rope_scaling_factor": float(v["factor"])}
    differ = {k: v.get(k) for k, want in MEGATRON_LLAMA3.items() if v.get(k) != want}
    if differ:
        out["_note"] = f"Megatron's rope scaling fixes {MEGATRON_LLAMA3}; {differ} not carried"
    return out


def _window(window):
    """Megatron --window-size (left, 0) -> HF sliding_window left + 1 (query i sees keys i - left .. i)."""
    if window in (None, "None"):
        return None
    left, right = (int(w) for w in (window.strip("()[] ").split(",") if isinstance(window, str) else window))
    if right != 0:
        raise Unmappable(f"HF's sliding_window is causal; Megatron's window {window} looks {right} ahead")
    return left + 1


def _mistral_bias(qkv, linear):
    if qkv or linear:
        raise Unmappable(f"Mistral has no biases; Megatron has qkv bias {qkv}, linear bias {linear}")
    return OMIT


def _qwen3_bias(v, doc):
    if not v:
        return {"add_qkv_bias": False}
    return {"add_qkv_bias": True, "add_bias_linear": True,
            "_note": "Megatron's --add-bias-linear also puts biases on the MLP, which Qwen3 has not"}


def _rows(model_type: str, architecture: str, family: list) -> list:
    return [CONST("model_type", model_type), CONST("architectures", [architecture])] + _LLAMA_SHAPE + family + _LLAMA_TAIL


_LLAMA_SHAPE = [
    *_numbers(LLAMA_KEYS),
    R("num_query_groups", "num_key_value_heads", back=_kv_heads_back),
    R("kv_channels", "head_dim"),
    R("rotary_base", "rope_theta", back=lambda v, doc: {"rotary_base": int(v) if float(v).is_integer() else v}),
    R(("rotary_base", "use_rope_scaling", "rope_scaling_factor"), "rope_parameters", to=_rope, back=_rope_back),
    R("activation", "hidden_act", to=_llama_act, back=lambda v, doc: {"activation": "swiglu" if v == "silu" else v}),
    R("untie_embeddings_and_output_weights", "tie_word_embeddings", False, to=lambda v: not v, back=_untie),
]
_LLAMA_TAIL = [
    R("attention_dropout", "attention_dropout"),
    R("init_method_std", "initializer_range"),
    R("params_dtype", "torch_dtype", back=_dtype_back),
]
_ATTENTION_BIAS = R(("add_qkv_bias", "add_bias_linear"), "attention_bias", to=_llama_bias,
                    back=lambda v, doc: {"add_qkv_bias": v})
def _no_window(window):
    if window not in ("", "None"):
        raise Unmappable(f"Qwen's sliding window covers only some layers; Megatron's window {window} covers all")
    return False


# Qwen's per-layer window: written off; a config that turns it on says what is lost.
_NO_WINDOW = [R("window_size", "use_sliding_window", False, to=_no_window,
                back=lambda v, doc: {"_note": "a window on some layers only has no Megatron equivalent"} if v else {})]

# ---------------------------------------------------------------- mixture of experts

def _expert_size(moe_ffn, ffn):
    return ffn if moe_ffn is None else moe_ffn  # Megatron's --moe-ffn-hidden-size defaults to --ffn-hidden-size


def _one_coeff(coeffs):
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs]
    if len(coeffs) != 1:
        raise Unmappable(f"one aux loss coefficient here, Megatron gives {len(coeffs)}: {coeffs}")
    return float(coeffs[0])


def _every_layer(freq, layers):
    pattern = moe_layer_pattern(freq, layers)
    if pattern is None or not all(pattern):
        raise Unmappable(f"Mixtral's layers are all MoE; --moe-layer-freq {freq} makes "
                         + ("an unreadable pattern" if pattern is None else f"layers {[i for i, m in enumerate(pattern) if not m]} dense"))
    return OMIT


def _mlp_only_layers(freq, layers):
    pattern = moe_layer_pattern(freq, layers)
    if pattern is None:
        raise Unmappable(f"--moe-layer-freq {freq} is not a pattern of {layers} layers")
    return [i for i, moe in enumerate(pattern) if not moe]


def _mlp_only_back(v, doc):
    """Qwen2-MoE: layer i is MoE unless listed in mlp_only_layers, and only every decoder_sparse_step-th
    ((i + 1) % step == 0, transformers' Qwen2MoeDecoderLayer)."""
    layers, step = doc.get("num_hidden_layers"), doc.get("decoder_sparse_step", 1) or 1
    if not isinstance(layers, int):
        return {}
    pattern = [0 if i in (v or []) or (i + 1) % step else 1 for i in range(layers)]
    return {"moe_layer_freq": 1 if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"}


def _shared_expert(size, gate):
    if size is None:
        raise Unmappable("Qwen2-MoE always has a shared expert; Megatron's model has none "
                         "(--moe-shared-expert-intermediate-size)")
    if not gate:
        raise Unmappable("Qwen2-MoE's shared expert is always gated; Megatron's has no --moe-shared-expert-gate")
    return size


def _softmax_router(function):
    if function != "softmax":
        raise Unmappable(f"the HF router is a softmax, not {function!r}")
    return OMIT


def _no_pre_softmax(pre):
    if pre:
        raise Unmappable("Mixtral renormalizes the top-k probabilities (Megatron's default); "
                         "--moe-router-pre-softmax does not")
    return OMIT


_EXPERTS = [
    R("moe_router_topk", "num_experts_per_tok"),
    R("moe_aux_loss_coeff", "router_aux_loss_coef", to=_one_coeff, back=lambda v, doc: {"moe_aux_loss_coeff": [v]}),
    # transformers adds the aux loss to the training loss only with output_router_logits (Megatron always does)
    R("moe_aux_loss_coeff", "output_router_logits", to=lambda c: any(x > 0 for x in (c if isinstance(c, list) else [c])),
      back=lambda v, doc: {}),
    R("moe_router_score_function", "router (softmax)", to=_softmax_router, back=lambda v, doc: {}),
]
# transformers' MixtralConfig (models/mixtral/configuration_mixtral.py): every layer a MoE of
# num_local_experts SwiGLU experts of intermediate_size, top-k renormalized, no shared expert, no biases.
MIXTRAL_ROWS = [
    R("num_experts", "num_local_experts"),
    R(("moe_ffn_hidden_size", "ffn_hidden_size"), "intermediate_size", to=_expert_size,
      back=lambda v, doc: {"ffn_hidden_size": v}),
    R(("moe_layer_freq", "num_layers"), "moe layers (all)", to=_every_layer, back=lambda v, doc: {}),
    R("moe_router_pre_softmax", "router (renormalized top-k)", to=_no_pre_softmax, back=lambda v, doc: {}),
    R("moe_input_jitter_eps", "router_jitter_noise", 0.0, back=lambda v, doc: {"moe_input_jitter_eps": v} if v else {}),
] + _EXPERTS
# transformers' Qwen2MoeConfig (models/qwen2_moe/configuration_qwen2_moe.py): q/k/v biases, a gated shared
# expert, dense layers (intermediate_size) where mlp_only_layers / decoder_sparse_step say.
QWEN2_MOE_ROWS = [
    R("num_experts", "num_experts"),
    R(("moe_ffn_hidden_size", "ffn_hidden_size"), "moe_intermediate_size", to=_expert_size,
      back=lambda v, doc: {"moe_ffn_hidden_size": v}),
    R(("moe_shared_expert_intermediate_size", "moe_shared_expert_gate"), "shared_expert_intermediate_size",
      to=_shared_expert, back=lambda v, doc: {"moe_shared_expert_intermediate_size": v}),
    R(("moe_layer_freq", "num_layers"), "mlp_only_layers", to=_mlp_only_layers, back=_mlp_only_back),
    CONST("decoder_sparse_step", 1),
    R("moe_router_pre_softmax", "norm_topk_prob", to=lambda pre: not pre,
      back=lambda v, doc: {"moe_router_pre_softmax": not v}),
    R(("add_qkv_bias", "add_bias_linear"), "qkv_bias", to=lambda qkv, linear: _qwen_moe_bias(qkv, linear),
      back=lambda v, doc: {"add_qkv_bias": v}),
] + _EXPERTS


def _qwen_moe_bias(qkv, linear):
    if linear:
        raise Unmappable("Qwen2-MoE has q/k/v biases only; Megatron's --add-bias-linear puts them on every linear")
    return bool(qkv)


# One table per HF family; which one a Megatron model is follows from its flags (family_of).
LLAMA = _rows("llama", "LlamaForCausalLM", [_ATTENTION_BIAS, R("add_bias_linear", "mlp_bias", False)])
QWEN2 = _rows("qwen2", "Qwen2ForCausalLM", _NO_WINDOW)  # q/k/v biases always, o and the MLP never (IMPLIED)
QWEN3 = _rows("qwen3", "Qwen3ForCausalLM", [
    R(("add_qkv_bias", "add_bias_linear"), "attention_bias", to=_llama_bias, back=_qwen3_bias)] + _NO_WINDOW)  # q/k norms always (IMPLIED)
MISTRAL = _rows("mistral", "MistralForCausalLM", [
    R(("add_qkv_bias", "add_bias_linear"), "attention_bias", to=_mistral_bias, back=lambda v, doc: {}),
    R("window_size", "sliding_window", to=_window,
      back=lambda v, doc: {"window_size": f"({int(v) - 1}, 0)"} if v is not None else {}),
])
MIXTRAL = _rows("mixtral", "MixtralForCausalLM", [
    R(("add_qkv_bias", "add_bias_linear"), "attention_bias", to=_mistral_bias, back=lambda v, doc: {}),
    R("window_size", "sliding_window", to=_window,
      back=lambda v, doc: {"window_size": f"({int(v) - 1}, 0)"} if v is not None else {}),
] + MIXTRAL_ROWS)
QWEN2_MOE = _rows("qwen2_moe", "Qwen2MoeForCausalLM", _NO_WINDOW + QWEN2_MOE_ROWS)
FAMILY_TABLES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL, "mixtral": MIXTRAL,
                 "qwen2_moe": QWEN2_MOE}

# What the architecture itself implies on the Megatron side when reading a config.json back.
_LLAMA_IMPLIED = {"normalization": "RMSNorm", "position_embedding_type": "rope", "add_bias_linear": False}
IMPLIED = {
    "gpt2": {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute"},
    "llama": _LLAMA_IMPLIED,
    "qwen2": _LLAMA_IMPLIED | {"add_qkv_bias": True},
    "qwen3": _LLAMA_IMPLIED | {"qk_layernorm": True},
    "mistral": _LLAMA_IMPLIED | {"add_qkv_bias": False},
    "mixtral": _LLAMA_IMPLIED | {"add_qkv_bias": False},
    "qwen2_moe": _LLAMA_IMPLIED | {"moe_shared_expert_gate": True},
}


def arch_of(full: dict) -> str:
    llama = full["normalization"] == "RMSNorm" and full["swiglu"] and full["position_embedding_type"] == "rope"
    return "llama" if llama else "gpt2"


def family_of(full: dict) -> str:
    """The HF model_type of a Llama-style Megatron model: the family whose facts its flags are."""
    if full.get("num_experts"):  # a shared expert or q/k/v biases: Qwen2-MoE; else Mixtral
        shared = full.get("moe_shared_expert_intermediate_size") or full.get("add_qkv_bias")
        return "qwen2_moe" if shared else "mixtral"
    if full.get("qk_layernorm"):
        return "qwen3"
    if full.get("add_qkv_bias") and not full.get("add_bias_linear"):
        return "qwen2"
    if full.get("window_size") not in (None, "", "None"):
        return "mistral"
    return "llama"


def rows_for(full: dict):
    return FAMILY_TABLES[family_of(full)] if full and arch_of(full) == "llama" else GPT2


def normalize_doc(doc: dict) -> dict:
    """transformers 5 writes `dtype` and `rope_parameters: {rope_theta, rope_type}`; 4.x wrote
    `torch_dtype` and `rope_theta`. Read either: the 4.x keys the rows use, filled from the 5.x ones
    (4.x's `rope_scaling` read as rope_parameters)."""
    doc = dict(doc)
    if isinstance(doc.get("rope_scaling"), dict) and not isinstance(doc.get("rope_parameters"), dict):
        doc["rope_parameters"] = doc.pop("rope_scaling")
    rope = doc.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope and doc.get("rope_theta") is None:
            doc["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            doc.pop("rope_parameters")  # said entirely by rope_theta
    if doc.get("dtype") is not None and doc.get("torch_dtype") is None:
        doc["torch_dtype"] = doc["dtype"]
    if doc.get("dtype") == doc.get("torch_dtype"):
        doc.pop("dtype", None)
    return doc


def rows_for_doc(doc: dict, where: str):
    model_type = doc.get("model_type")
    if model_type not in IMPLIED:
        raise InteropError(f"{where}: model_type {model_type!r} is not supported ({', '.join(IMPLIED)} are)")
    implied = IMPLIED[model_type]
    table = FAMILY_TABLES.get(model_type, GPT2)
    first = R((), "model_type", model_type, to=lambda: model_type, back=lambda v, d: dict(implied))
    return [first] + table[1:]


def require(full: dict) -> dict:
    """A config.json must say how many embedding rows there are: the true vocabulary, or (a checkpoint's
    args that record only Megatron's padded size) the padded one, which `_target_warnings` reports."""
    if full.get("padded_vocab_size") is None and full.get("vocab_size") is None:
        raise InteropError("hf: the vocabulary size is unknown: give --vocab-size N (or --tokenizer-type "
                           "GPT2BPETokenizer / Llama2Tokenizer)")
    return full if full.get("vocab_size") is not None else {**full, "vocab_size": full["padded_vocab_size"]}
