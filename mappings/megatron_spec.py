"""ModelSpec <-> Megatron args (and the tp/pp/vpp layout they state): decided once, here.

Used by the Megatron converter (a checkpoint's stored args, `--model-config`), by map-args (its
HF table's number rows, `hf_args`) and by the trainer (the model a config file describes).  The
plain numbers are a table (`SPEC_NUMBERS`, which `args_from_spec` writes); how each is read back,
with the defaults and fallbacks checkpoints from other tools need, and the facts that need a rule
(norm, activation, positions, biases, rope scaling, sliding window) are the functions below.
"""
from __future__ import annotations

import math

from ..errors import InteropError
from ..layout import ParallelLayout
from ..spec import ModelSpec, llama3_rope_scaling, yarn_rope_scaling
from . import megatron_args as M
from . import megatron_deepseek as DS

# ModelSpec field -> Megatron argument (dest), for the numbers that carry over as they are.
SPEC_NUMBERS = {
    "num_layers": "num_layers", "hidden": "hidden_size", "ffn_hidden": "ffn_hidden_size",
    "heads": "num_attention_heads", "kv_groups": "num_query_groups", "head_dim": "kv_channels",
    "vocab": "vocab_size", "padded_vocab": "padded_vocab_size", "max_positions": "max_position_embeddings",
    "norm_eps": "norm_epsilon",
}

# The numbers a reader builds the model and its layout from: checked at the door (`check_args`).
MODEL_NUMBERS = {**dict.fromkeys(
    ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
     "vocab_size", "padded_vocab_size", "max_position_embeddings", "seq_length", "make_vocab_size_divisible_by",
     "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
     "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "data_parallel_size",
     "global_batch_size", "consumed_train_samples", "ddp_bucket_size", "num_experts", "moe_router_topk",
     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "expert_model_parallel_size",
     "expert_tensor_parallel_size"), M.INT),
    **dict.fromkeys(("norm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor"), M.FLOAT)}


def explicit_args(stored: dict) -> dict:
    """Stored checkpoint args in the shared table's terms (plain values, known dests only)."""
    from ..io.safe_pickle import to_plain  # torch: map-args imports this module and must start without it
    out = {}
    for key, value in stored.items():
        dest = M.CHECKPOINT_ALIASES.get(key, key)
        if (dest in M.ARGS or dest == CARRIED_ROPE_SCALING) and value is not None:  # and interop's own carry
            out[dest] = to_plain(value)
    return out


def check_args(stored: dict | None, where) -> None:
    """One line for a stored args value that is not what Megatron's parser makes of its flag (a number that
    is a string, a 5,000-digit integer, a list where a number belongs): never a traceback further on."""
    for key, value in (stored or {}).items():
        kind = MODEL_NUMBERS.get(M.CHECKPOINT_ALIASES.get(key, key))
        if kind is None or value is None:
            continue
        if kind == M.INT:
            ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2 ** 63
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            if isinstance(value, int) and value.bit_length() > 64:  # repr() of a huge int is itself refused
                shown = f"an integer of {value.bit_length()} bits"
            else:
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise InteropError(f"{where}: args.{key} is {shown}, not {'an integer' if kind == M.INT else 'a number'}")


UNSUPPORTED_ARGS = {  # dest: the value our ModelSpec can describe
    "rotary_interleaved": False,
    "apply_residual_connection_post_layernorm": False, "squared_relu": False,
}


UNSUPPORTED_MOE_ARGS = ("moe_latent_size",)  # set (not None): a router our ModelSpec cannot describe


# A checkpoint's args attribute (Megatron ignores one it does not know) holding the model's whole Llama-3 rope
# scaling where megatron-core's --use-rope-scaling cannot state it (it fixes low / high frequency factors 1 / 4 and
# the original context 8192): interop reads it back, so a round trip never changes the model.
CARRIED_ROPE_SCALING = "interop_rope_scaling"

NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
NORMS_OUT = {v: k for k, v in NORMS.items()}


def noop_positions(full: dict, where: str) -> list[int]:
    """MindSpeed's `noop_layers` (a "2,7" string, a list or one number): positions among `num_layers` that are
    identity layers without weights (MindSpeed-Core-MS br_master training/arguments.py 547-555 refuses one outside
    0..num_layers-1; legacy/model/transformer.py 1633 builds NoopTransformerLayer there), so the model's real
    layers are num_layers minus them."""
    value = full.get("noop_layers")
    if value in (None, "", [], ()):
        return []
    try:
        items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple, set)) \
            else [value]
        positions = sorted({int(x) for x in items})
    except (TypeError, ValueError):
        raise InteropError(f"{where}: noop_layers={value!r} is not a list of layer numbers") from None
    if positions[0] < 0 or positions[-1] >= int(full["num_layers"]) or len(positions) >= int(full["num_layers"]):
        raise InteropError(f"{where}: noop_layers={value!r} are not positions among num_layers="
                           f"{full['num_layers']} that leave a real layer")
    return positions


def spec_from_args(full: dict, where: str, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec from completed Megatron args (`megatron_args.complete`).  MindSpeed's noop layers are not in it:
    the canonical model holds the real layers (num_layers counts the noop positions too)."""
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not full.get(k)]
    if missing:
        raise InteropError(f"{where}: the model description lacks {', '.join(missing)}")
    noop = noop_positions(full, where)
    if noop:
        per_layer = [k for k in ("moe_layer_freq", "window_attn_skip_freq", "first_k_dense_replace")
                     if full.get(k) not in (None, 1, 0, "1", "0")]
        if per_layer:
            raise InteropError(f"{where}: noop_layers with a per-layer pattern ({per_layer[0]}) is not read (the "
                               "pattern counts the noop positions): pass --model-config without noop_layers")
        full = dict(full, num_layers=int(full["num_layers"]) - len(noop))
    for dest, ok in UNSUPPORTED_ARGS.items():
        if full.get(dest, ok) not in (ok, None) and full.get(dest) != ok:
            raise InteropError(f"{where}: {dest}={full[dest]!r} is not supported")
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
    activation = full.get("activation") or ("swiglu" if full.get("swiglu") else
                                            "quick_geglu" if full.get("quick_geglu") else "gelu")
    softmax = full.get("softmax_type") or "vanilla"
    if softmax not in ("vanilla", "learnable"):
        raise InteropError(f"{where}: softmax_type={softmax!r} is not supported (vanilla, and learnable: attention "
                           "sinks, are)")
    padded = full.get("padded_vocab_size") or full.get("vocab_size")
    vocab = full.get("vocab_size") or padded
    if not padded:
        raise InteropError(f"{where}: the vocabulary size is unknown (no padded_vocab_size or vocab_size)")
    linear_bias = bool(full.get("add_bias_linear", True))
    # with multi-latent attention --qk-layernorm builds the q / kv compression norms (gpt_layer_specs.py)
    qk_norm = bool(full.get("qk_layernorm")) and not full.get("multi_latent_attention")
    if full.get("multi_latent_attention") and not full.get("qk_layernorm"):
        raise InteropError(f"{where}: multi_latent_attention without qk_layernorm has no q / kv compression norms "
                           "(megatron-core builds IdentityOp); the model description has DeepSeek's, which have them")
    if qk_norm and norm != "rmsnorm":
        raise InteropError(f"{where}: qk_layernorm with normalization={full.get('normalization')!r} is not supported "
                           "(RMSNorm is)")
    sliding_window = sliding_window_of(full, where)
    pre_norm, post_norm = bool(full.get("pre_norm", True)), bool(full.get("post_norm"))
    if full.get("use_sandwich_norm"):  # MindSpeed's: a norm before and after attention and MLP
        pre_norm, post_norm = True, True
    rope_scaling = (DS.yarn_from_args(full, where) or gpt_yarn_from_args(full, where)) if position == "rope" else None
    linear = _optional_float(full, "rope_linear_factor", where)
    if linear is not None and position == "rope":
        rope_scaling = {"type": "linear", "factor": linear}
    elif full.get("use_rope_scaling") and position == "rope":
        factor = float(full.get("rope_scaling_factor") or 8.0)
        carried = full.get(CARRIED_ROPE_SCALING)  # what interop wrote beside core's flags
        rope_scaling = (dict(carried) if isinstance(carried, dict) and carried.get("type") == "llama3"
                        and carried.get("factor") == factor else llama3_rope_scaling(factor))  # else core's 1 / 4 / 8192
    deepseek = {**DS.mla_from_args(full, where), **DS.mtp_from_args(full)}  # MLA: head_dim, kv_groups its own
    arch = "gpt2" if (norm == "layernorm" and position == "learned" and activation != "swiglu") else "llama"
    plain = dict(kv_groups=groups, head_dim=int(full.get("kv_channels") or hidden // heads))
    return ModelSpec(
        arch=arch, num_layers=int(full["num_layers"]), hidden=hidden,
        ffn_hidden=int(full.get("ffn_hidden_size") or 4 * hidden), heads=heads, **{**plain, **deepseek},
        vocab=int(vocab), padded_vocab=int(padded),
        max_positions=int(full.get("max_position_embeddings") or full.get("seq_length") or 0) or 2048,
        norm=norm, norm_eps=float(full.get("norm_epsilon") or 1e-5), activation=activation, position=position,
        rope_base=float(full.get("rotary_base") or 10000),
        rotary_percent=float(full.get("rotary_percent") or 1.0) if position == "rope" else 1.0,
        tied_embeddings=not full.get("untie_embeddings_and_output_weights"),
        qkv_bias=bool(linear_bias or full.get("add_qkv_bias")), linear_bias=linear_bias,
        qk_norm=qk_norm, rope_scaling=rope_scaling, sliding_window=sliding_window,
        attention_dropout=_float_or_none(full.get("attention_dropout")),
        hidden_dropout=_float_or_none(full.get("hidden_dropout")),
        pre_norm=pre_norm, post_norm=post_norm,
        attn_post_norm_scale=_optional_float(full, "attn_post_norm_scale", where) if post_norm else None,
        mlp_post_norm_scale=_optional_float(full, "ffn_post_norm_scale", where) if post_norm else None,
        qk_norm_scope=full.get("qk_layernorm_scope") or "head",
        norm_zero_centered=bool(full.get("layernorm_zero_centered_gamma")), embed_scale=bool(full.get("embedding_scale")),
        softmax_scale=_optional_float(full, "softmax_scale", where),
        attn_softcap=_optional_float(full, "attn_logit_softcapping", where),
        logit_softcap=_optional_float(full, "final_logit_softcapping", where),
        sliding_layers=_sliding_layers(full, sliding_window, where),
        rope_local_base=_optional_float(full, "rotary_base_local", where),
        attn_sinks=softmax == "learnable", glu_clamp=_optional_float(full, "activation_func_clamp_value", where),
        glu_linear_offset=_optional_float(full, "glu_linear_offset", where) or 0.0,
        dtype=dtype or full.get("params_dtype") or "float32", **moe_from_args(full, where))


# ModelSpec's sandwich-norm scales -> MindSpeed's Megatron arguments (the seed-001 table: attn_post_norm_scale,
# ffn_post_norm_scale; mindspeed_ms/core/config.py ARGS_MAP at MindSpeed-Core-MS 3a86578).
POST_NORM_SCALES = {"attn_post_norm_scale": "attn_post_norm_scale", "mlp_post_norm_scale": "ffn_post_norm_scale"}


def _optional_float(full: dict, key: str, where: str) -> float | None:
    value = full.get(key)
    if value in (None, "", "None"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InteropError(f"{where}: {key}={value!r} is not a number") from None


def _sliding_layers(full: dict, window, where: str) -> list | None:
    """The layers --window-size applies to (None: all): --window-attn-skip-freq (megatron-core transformer/utils.py
    is_layer_window_attention: an int k windows the layers whose 1-based number is not a multiple of k, a 0/1 list
    names them), or `sliding_window_layers` ("0,2,4" or a list), what interop wrote before it used the flag."""
    if window is None:
        return None
    skip = full.get("window_attn_skip_freq")
    if skip not in (None, "", "None"):
        return _skip_freq_layers(skip, int(full["num_layers"]), where)
    value = full.get("sliding_window_layers")
    if value in (None, "", "None"):
        return None
    items = value.split(",") if isinstance(value, str) else value
    try:
        return [int(i) for i in items]
    except (TypeError, ValueError):
        raise InteropError(f"{where}: sliding_window_layers={value!r} is not a list of layer numbers") from None


def _skip_freq_layers(skip, num_layers: int, where: str) -> list | None:
    if isinstance(skip, str) and skip.strip().lstrip("-").isdigit():
        skip = int(skip)
    if isinstance(skip, int) and not isinstance(skip, bool) and skip > 0:
        windowed = [(i + 1) % skip != 0 for i in range(num_layers)]
    else:
        windowed = M.moe_layer_pattern(skip, num_layers) if not isinstance(skip, int) else None
        if windowed is None:
            raise InteropError(f"{where}: window_attn_skip_freq={skip!r} is not an integer or a 0/1 list of "
                               f"{num_layers} layers")
    layers = [i for i, w in enumerate(windowed) if w]
    return None if len(layers) == num_layers else layers


def window_skip_freq(spec: ModelSpec):
    """--window-attn-skip-freq for spec.sliding_layers: k where the window skips every k-th layer, else the 0/1 list."""
    if spec.sliding_window is None or spec.sliding_layers is None:
        return None
    for k in range(2, spec.num_layers + 1):
        if [i for i in range(spec.num_layers) if (i + 1) % k] == list(spec.sliding_layers):
            return k
    return [int(spec.is_sliding_layer(i)) for i in range(spec.num_layers)]


def _float_or_none(value):
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return value  # ModelSpec names what is wrong with it


def moe_from_args(full: dict, where: str) -> dict:
    """ModelSpec's mixture-of-experts fields from Megatron's MoE args ({} for a dense model).

    Top-k normalisation as megatron-core's router computes it (transformer/moe/moe_utils.py
    topk_routing_with_score_function): softmax after the top-k (the default) sums to 1, softmax before it
    (--moe-router-pre-softmax) does not; sigmoid scores are renormalised whenever top-k > 1."""
    experts = full.get("num_experts")
    if not experts:
        return {}
    score = full.get("moe_router_score_function") or "softmax"
    topk = int(full.get("moe_router_topk") or 2)
    norm = (not full.get("moe_router_pre_softmax")) if score == "softmax" else topk > 1
    for dest in UNSUPPORTED_MOE_ARGS:
        if full.get(dest) is not None:
            raise InteropError(f"{where}: {dest}={full[dest]!r} is not supported (the model description has no place "
                               "for it)")
    coeff = full.get("moe_aux_loss_coeff") or 0.0
    if isinstance(coeff, (list, tuple)):
        if len(set(coeff)) > 1:
            raise InteropError(f"{where}: moe_aux_loss_coeff={coeff!r} (one per loss type) is not supported")
        coeff = coeff[0] if coeff else 0.0
    shared = full.get("moe_shared_expert_intermediate_size")
    return dict(num_experts=int(experts), moe_topk=topk, **DS.routing_from_args(full, topk, where),
                moe_ffn_hidden=int(full.get("moe_ffn_hidden_size") or full.get("ffn_hidden_size") or 4 * int(full["hidden_size"])),
                moe_layers=_moe_layers(full.get("moe_layer_freq", 1), int(full["num_layers"]), where),
                moe_router_score=score, moe_norm_topk=bool(norm),
                moe_router_bias=bool(full.get("moe_router_enable_expert_bias")),
                # megatron-core's TopKRouter has a bias on its logits exactly with add_bias_linear (router.py)
                moe_router_logit_bias=bool(full.get("add_bias_linear", True)),
                moe_aux_loss_coeff=float(coeff), shared_expert_ffn_hidden=int(shared) if shared else None,
                shared_expert_gate=bool(shared and full.get("moe_shared_expert_gate")))


def _moe_layers(freq, num_layers: int, where: str) -> list | None:
    """--moe-layer-freq (megatron_args.moe_layer_pattern reads Megatron's forms: an int k, every k-th layer
    from 0, or a 0/1 list such as "[1,0,1,0]" or "([0]+[1]*3)") -> ModelSpec.moe_layers (None: every layer)."""
    pattern = M.moe_layer_pattern(freq, num_layers)
    if pattern is None:
        raise InteropError(f"{where}: moe_layer_freq={freq!r} is not an integer or a 0/1 list of {num_layers} layers")
    return None if all(pattern) else [i for i, f in enumerate(pattern) if f]


def moe_args(spec: ModelSpec, layout: ParallelLayout) -> dict:
    """Megatron's MoE args for `spec` at `layout` (the dense defaults for a dense model)."""
    if not spec.is_moe:
        return {"num_experts": None, "expert_model_parallel_size": 1}
    if spec.moe_router_score == "sigmoid" and spec.moe_norm_topk != (spec.moe_topk > 1):
        raise InteropError("megatron-core renormalises sigmoid router scores exactly when top-k > 1; this model "
                           f"has top-k {spec.moe_topk} with moe_norm_topk={spec.moe_norm_topk}")
    layers = spec.moe_layers
    return {
        "num_experts": spec.num_experts, "moe_router_topk": spec.moe_topk, "moe_ffn_hidden_size": spec.moe_ffn_hidden,
        "moe_layer_freq": 1 if layers is None else [int(i in layers) for i in range(spec.num_layers)],
        "moe_router_score_function": spec.moe_router_score,
        "moe_router_pre_softmax": spec.moe_router_score == "softmax" and not spec.moe_norm_topk,
        "moe_router_enable_expert_bias": spec.moe_router_bias, "moe_aux_loss_coeff": spec.moe_aux_loss_coeff,
        "moe_shared_expert_intermediate_size": spec.shared_expert_ffn_hidden,
        "moe_shared_expert_gate": spec.shared_expert_gate, **DS.routing_args(spec),
        "expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.etp,
        # Megatron-LM's arguments.py: MoE with tensor parallelism requires sequence parallelism
        **({"sequence_parallel": True} if layout.tp > 1 else {}),
    }


# Megatron-Bridge's yarn fields (GPTModelProvider; models/gpt_oss/gpt_oss_bridge.py) <- ModelSpec yarn keys
GPT_YARN = {"yarn_rotary_scaling_factor": "factor", "yarn_original_max_position_embeddings": "original_max_positions",
            "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale",
            "yarn_mscale_all_dim": "mscale_all_dim"}


def gpt_yarn_from_args(full: dict, where: str):
    """ModelSpec.rope_scaling of a GPT model's YaRN (Megatron-Bridge's yarn_* provider fields), else None."""
    if full.get("yarn_rotary_scaling_factor") in (None, "", "None"):
        return None
    values = {ours: _optional_float(full, dest, where) for dest, ours in GPT_YARN.items()}
    if values["original_max_positions"] is None:
        raise InteropError(f"{where}: yarn_rotary_scaling_factor without yarn_original_max_position_embeddings")
    return yarn_rope_scaling(values["factor"], int(values["original_max_positions"]), values["beta_fast"] or 32.0,
                             values["beta_slow"] or 1.0, values["mscale"] or 0.0, values["mscale_all_dim"] or 0.0,
                             truncate=full.get("yarn_correction_range_round_to_int", True) is not False)


def sliding_window_of(full: dict, where: str) -> int | None:
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
    if right != 0 or left < 0:
        raise InteropError(f"{where}: window_size={full['window_size']!r} is not supported (a causal window, "
                           "(left, 0), is)")
    return left + 1


def refuse_unstated(spec: ModelSpec) -> None:
    """One line for a model Megatron's args cannot state (megatron-core would compute another model): the
    writers ask before writing a file, `model_args` before stating it."""
    if spec.qkv_bias != spec.linear_bias and not (spec.qkv_bias and not spec.linear_bias):
        raise InteropError("Megatron cannot describe biases on the output/MLP linears without q/k/v biases")
    for why in DS.refusals(spec):
        raise InteropError(why)
    if spec.is_moe and not (spec.moe_router_logit_bias == spec.has_mlp_bias == spec.linear_bias):
        raise InteropError("Megatron's add_bias_linear puts biases on the linears, the router's logits and the experts "
                           f"together; this model has linear biases {spec.linear_bias}, a router logit bias "
                           f"{spec.moe_router_logit_bias} and expert biases {spec.has_mlp_bias}")


def model_args(spec: ModelSpec) -> dict:
    """The Megatron arguments that state `spec`'s model (no layout, no training): what a config.json says.

    Torch-free: map-args writes a config.json's model through here."""
    refuse_unstated(spec)
    model = {dest: getattr(spec, field) for field, dest in SPEC_NUMBERS.items()}
    llama3 = spec.rope_scaling is not None and spec.rope_scaling["type"] == "llama3"  # the only one Megatron has
    model |= {
        "group_query_attention": spec.kv_groups != spec.heads, "normalization": NORMS_OUT[spec.norm],
        "swiglu": spec.activation == "swiglu", "quick_geglu": spec.activation == "quick_geglu",
        "activation_func_clamp_value": spec.glu_clamp, "glu_linear_offset": spec.glu_linear_offset,
        "softmax_type": "learnable" if spec.attn_sinks else "vanilla",
        "openai_gelu": spec.activation in ("gelu_tanh", "geglu_tanh"),
        "layernorm_zero_centered_gamma": spec.norm_zero_centered,
        # the fused bias-GeLU is the tanh form: on only when that is the model's GeLU
        "bias_gelu_fusion": spec.activation == "gelu_tanh" and spec.linear_bias,
        "bias_swiglu_fusion": spec.activation == "swiglu",
        "position_embedding_type": "rope" if spec.position == "rope" else "learned_absolute",
        "add_position_embedding": spec.position == "learned", "use_rotary_position_embeddings": spec.position == "rope",
        "rotary_base": int(spec.rope_base) if float(spec.rope_base).is_integer() else spec.rope_base,
        "rotary_percent": spec.rotary_percent, "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "add_bias_linear": spec.linear_bias, "add_qkv_bias": spec.qkv_bias, "qk_layernorm": spec.qk_norm or spec.is_mla,
        "use_rope_scaling": llama3,
        "rope_scaling_factor": spec.rope_scaling["factor"] if llama3 else 8.0,
        "window_size": (spec.sliding_window - 1, 0) if spec.sliding_window else None, "window_attn_skip_freq": window_skip_freq(spec),
        "bf16": spec.dtype == "bfloat16", "fp16": spec.dtype == "float16",
        **DS.deepseek_args(spec),
    }
    if _bridge_facts(spec):  # no Megatron-LM flag: said only when so
        model |= layer_spec_args(spec)
    scaling = spec.rope_scaling
    if scaling is not None and scaling["type"] == "yarn" and not spec.is_mla:  # Megatron-Bridge's provider fields
        model |= {dest: scaling[ours] for dest, ours in GPT_YARN.items()}
        model["yarn_correction_range_round_to_int"] = scaling.get("truncate", True)
    return model


def layer_spec_args(spec: ModelSpec) -> dict:
    """The facts megatron-core states by a layer spec or a Megatron-Bridge provider field, not an argument
    (megatron_args' origin "bridge" rows)."""
    return {"pre_norm": spec.pre_norm, "post_norm": spec.post_norm, "qk_layernorm_scope": spec.qk_norm_scope,
            "gated_linear_unit": spec.activation == "geglu_tanh", "embedding_scale": spec.embed_scale,
            "softmax_scale": spec.softmax_scale, "attn_logit_softcapping": spec.attn_softcap,
            "final_logit_softcapping": spec.logit_softcap,
            "rotary_base_local": spec.rope_local_base,
            "rope_linear_factor": spec.rope_scaling["factor"] if spec.rope_scaling is not None
            and spec.rope_scaling["type"] == "linear" else None}


def _bridge_facts(spec: ModelSpec) -> bool:
    """Whether the model has a fact only `layer_spec_args` can say (map-args then says them too)."""
    return (not spec.pre_norm or spec.post_norm or spec.qk_norm_scope != "head" or spec.activation == "geglu_tanh"
            or spec.embed_scale or spec.softmax_scale is not None or spec.attn_softcap is not None
            or spec.logit_softcap is not None or spec.rope_local_base is not None
            or (spec.rope_scaling is not None and spec.rope_scaling["type"] == "linear"))


def args_from_spec(spec: ModelSpec, layout: ParallelLayout, base: dict | None = None,
                   divisible_by: int = 128) -> dict:
    """Megatron args for `spec` at `layout`, on top of `base` (a source's args) or Megatron's defaults."""
    first = layout.stages[0][0]
    per_stage = [sum(b - a for a, b in chunks) for chunks in layout.stages]
    uneven = layout.vpp == 1 and layout.stages != _even_stages(spec.num_layers, layout)
    model = model_args(spec)
    model |= {
        "make_vocab_size_divisible_by": divisible_by,
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
        "num_layers_per_virtual_pipeline_stage": (first[1] - first[0]) if layout.vpp > 1 else None,
        "decoder_first_pipeline_num_layers": per_stage[0] if uneven else None,
        "decoder_last_pipeline_num_layers": per_stage[-1] if uneven else None,
        "transformer_impl": "local", "use_legacy_models": False, "use_mcore_models": True,
        **moe_args(spec, layout),
    }
    args = M.complete({}) if base is None else dict(base)
    args.update(model)
    for field in ("attention_dropout", "hidden_dropout"):  # the source's, not Megatron's default 0.1
        if getattr(spec, field) is not None:
            args[field] = getattr(spec, field)
    args.pop(CARRIED_ROPE_SCALING, None)
    if spec.rope_scaling is not None and spec.rope_scaling["type"] == "llama3" \
            and spec.rope_scaling != llama3_rope_scaling(spec.rope_scaling["factor"]):
        args[CARRIED_ROPE_SCALING] = dict(spec.rope_scaling)
    args.update(layer_spec_args(spec))  # a checkpoint's args always say them (a base may hold another model's)
    args.pop("use_sandwich_norm", None)  # MindSpeed's spelling of pre + post norms: post_norm says it here
    for field, dest in POST_NORM_SCALES.items():  # MindSpeed's initial post-norm weights, where the source said them
        if getattr(spec, field) is None:
            args.pop(dest, None)
        else:
            args[dest] = getattr(spec, field)
    args.pop("activation", None)  # derived by interop's table, not a Megatron argument
    args.pop("hidden_act", None)
    args.pop("compute_dtype", None)
    if args.get("noop_layers"):  # a source's noop positions: the layers written are the real ones, numbered 0..n-1
        args["noop_layers"] = None
    from ..tensors import DTYPE_NAMES  # torch: map-args imports this module and must start without it
    args["params_dtype"] = DTYPE_NAMES[spec.dtype]
    return args


def args_losses(spec: ModelSpec) -> list[str]:
    """What Megatron args cannot say about `spec`: summary notes, so the loss is never silent."""
    notes = []
    if spec.rope_scaling is not None and spec.rope_scaling["type"] == "linear":
        pass  # rope_linear_factor (Megatron-Bridge's Gemma 3) carries it
    elif spec.rope_scaling is not None and spec.rope_scaling["type"] == "longrope":
        notes.append("Megatron's args have no longrope scaling (llama3's --use-rope-scaling only): this model's "
                     "short / long factors and attention factor are not in the args (the interop format keeps them)")
    elif spec.rope_scaling is not None and spec.rope_scaling["type"] == "llama3" and \
            spec.rope_scaling != llama3_rope_scaling(spec.rope_scaling["factor"]):
        notes.append(f"rope scaling {spec.rope_scaling} kept in the args as {CARRIED_ROPE_SCALING} for interop; "
                     "megatron-core's --use-rope-scaling itself computes with low_freq_factor 1, high_freq_factor 4, "
                     "original_max_position_embeddings 8192")
    return notes + DS.losses(spec)


def layout_from_args(full: dict, num_layers: int) -> ParallelLayout:
    """The tp/pp/vpp layout the args say the checkpoint was saved at (tp 1 / pp 1 when they don't say)."""
    try:
        return ParallelLayout.build(
            num_layers, int(full.get("tensor_model_parallel_size") or 1), int(full.get("pipeline_model_parallel_size") or 1),
            int(full.get("virtual_pipeline_model_parallel_size") or 1), full.get("decoder_first_pipeline_num_layers"),
            full.get("decoder_last_pipeline_num_layers"),
            ep=int(full.get("expert_model_parallel_size") or 1) if full.get("num_experts") else 1,
            etp=int(full.get("expert_tensor_parallel_size") or full.get("tensor_model_parallel_size") or 1)
            if full.get("num_experts") else None)
    except (InteropError, TypeError, ValueError):
        return ParallelLayout.build(num_layers)


def _even_stages(num_layers: int, layout: ParallelLayout):
    try:
        return ParallelLayout.build(num_layers, layout.tp, layout.pp, layout.vpp).stages
    except InteropError:
        return None
