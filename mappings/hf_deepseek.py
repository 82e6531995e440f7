"""Hugging Face DeepSeek-V3 / DeepSeek-V2 config.json <-> ModelSpec (multi-latent attention, group-limited
routing, shared experts, dense first layers, MTP modules, YaRN).

Facts from transformers 5.24 models/deepseek_v3 and deepseek_v2 (configuration_*.py, modeling_*.py):
- V3's router: sigmoid scores plus `e_score_correction_bias` for the choice, groups scored by the sum of their
  two best, `norm_topk_prob`, times `routed_scaling_factor`; V2's: softmax, `topk_method` greedy or
  group_limited_greedy (a group's best score), never renormalised (transformers' V2 ignores norm_topk_prob);
- layers `first_k_dense_replace` and on are MoE; the shared expert is `n_shared_experts * moe_intermediate_size`;
- V3's rope part is interleaved when `rope_interleave` (default true); V2's always is (complex rotation);
- `head_dim` in their config is the rope part (set by the config class): ours is qk_nope + qk_rope.
"""
from __future__ import annotations

from ..errors import InteropError
from ..spec import ModelSpec, yarn_rope_scaling

# (spec field, config key, default) per model type: the config classes' defaults.
COMMON = {
    "deepseek_v3": [("num_layers", "num_hidden_layers", 61), ("hidden", "hidden_size", 7168),
                    ("ffn_hidden", "intermediate_size", 18432), ("heads", "num_attention_heads", 128),
                    ("vocab", "vocab_size", 129280), ("max_positions", "max_position_embeddings", 4096),
                    ("norm_eps", "rms_norm_eps", 1e-6), ("tied_embeddings", "tie_word_embeddings", False),
                    ("moe_ffn_hidden", "moe_intermediate_size", 2048), ("num_experts", "n_routed_experts", 256),
                    ("moe_topk", "num_experts_per_tok", 8), ("moe_routed_scaling", "routed_scaling_factor", 2.5),
                    ("kv_lora_rank", "kv_lora_rank", 512), ("qk_rope_head_dim", "qk_rope_head_dim", 64),
                    ("v_head_dim", "v_head_dim", 128), ("moe_norm_topk", "norm_topk_prob", True),
                    ("rope_interleave", "rope_interleave", True)],
    "deepseek_v2": [("num_layers", "num_hidden_layers", 32), ("hidden", "hidden_size", 4096),
                    ("ffn_hidden", "intermediate_size", 11008), ("heads", "num_attention_heads", 32),
                    ("vocab", "vocab_size", 102400), ("max_positions", "max_position_embeddings", 2048),
                    ("norm_eps", "rms_norm_eps", 1e-6), ("tied_embeddings", "tie_word_embeddings", False),
                    ("moe_ffn_hidden", "moe_intermediate_size", 1407), ("num_experts", "n_routed_experts", 64),
                    ("moe_routed_scaling", "routed_scaling_factor", 1.0), ("kv_lora_rank", "kv_lora_rank", 512),
                    ("qk_rope_head_dim", "qk_rope_head_dim", 64), ("v_head_dim", "v_head_dim", 128)],
}
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
# Config keys read beyond COMMON (map-args names every other key as unread).
READS = ("model_type", "hidden_act", "num_key_value_heads", "head_dim", "qk_nope_head_dim", "q_lora_rank",
         "n_shared_experts", "n_group", "topk_group", "topk_method", "first_k_dense_replace", "rope_theta",
         "rope_parameters", "rope_scaling", "attention_bias", "num_nextn_predict_layers", "num_mtp_layers",
         "scoring_func", "moe_layer_freq", "aux_loss_alpha", "num_experts_per_tok", "norm_topk_prob")
# Router training settings: not the model, carried to HF output when not the default (Reader.carried).
TRAINING_KEYS = {"output_router_logits": False, "seq_aux": None}
YARN_KEYS = {"factor": "factor", "original_max_position_embeddings": "original_max_positions",
             "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}


def config_keys(model_type: str) -> set:
    return {key for _, key, _ in COMMON[model_type]} | set(READS) | set(TRAINING_KEYS)


def _int(config: dict, key: str, default, where: str, positive: bool = True):
    value = config.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
        raise InteropError(f"{where}: {key} must be a {'positive' if positive else 'non-negative'} integer, "
                           f"got {value!r}")
    return value


def spec_from_config(config: dict, dtype: str, where: str, read_table, rope_scaling) -> ModelSpec:
    """`read_table` / `rope_scaling`: hf_config's table reader and rope reader (one rule for every family)."""
    model_type = config["model_type"]
    f = read_table(config, COMMON[model_type], where)
    if config.get("hidden_act", "silu") != "silu":
        raise InteropError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (silu is)")
    if config.get("attention_bias"):
        raise InteropError(f"{where}: attention_bias=true (biases on the MLA projections) is not supported")
    heads = f["heads"]
    kv_heads = _int(config, "num_key_value_heads", heads, where)
    if kv_heads != heads:
        raise InteropError(f"{where}: num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}): "
                           "multi-latent attention has one k/v per head")
    nope = _int(config, "qk_nope_head_dim", 128, where)
    q_rank = _int(config, "q_lora_rank", 1536, where)
    fields = dict(f)
    if model_type == "deepseek_v3":
        fields.update(sigmoid_routing(config, f, where, SIGMOID_ROUTING_DEFAULTS[model_type]))
    else:
        fields.update(shared_and_dense(config, f, where, 2, 0))
        fields["moe_topk"] = _int(config, "num_experts_per_tok", None, where)
        if fields["moe_topk"] is None:
            raise InteropError(f"{where}: num_experts_per_tok is missing (DeepSeek-V2 has no default)")
        method = config.get("topk_method", "greedy")
        if method == "group_limited_greedy":
            fields.update(moe_groups=_int(config, "n_group", None, where),
                          moe_group_topk=_int(config, "topk_group", None, where), moe_group_score="max")
        elif method != "greedy":
            raise InteropError(f"{where}: topk_method {method!r} is not supported (greedy and "
                               "group_limited_greedy are, as transformers' DeepSeek-V2)")
        fields.update(moe_router_score="softmax", moe_norm_topk=False, rope_interleave=True)
    aux = config.get("aux_loss_alpha", 0.0)
    if not isinstance(aux, (int, float)) or isinstance(aux, bool) or aux < 0:
        raise InteropError(f"{where}: aux_loss_alpha must be a number >= 0, got {aux!r}")
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InteropError(f"{where}: rope_parameters must be an object, got {rope!r}")
    rope_base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(rope_base, (int, float)) or isinstance(rope_base, bool):
        raise InteropError(f"{where}: rope_theta must be a number, got {rope_base!r}")
    try:
        return ModelSpec(
            arch="llama", kv_groups=heads, head_dim=nope + fields["qk_rope_head_dim"], padded_vocab=f["vocab"],
            norm="rmsnorm", activation="swiglu", position="rope", rope_base=float(rope_base),
            rope_scaling=rope_scaling(config, rope, where), q_lora_rank=q_rank, moe_aux_loss_coeff=float(aux),
            dtype=dtype, **fields)
    except InteropError as exc:
        raise InteropError(f"{where}: {exc}") from None


# The config classes' defaults of the sigmoid routing keys: (n_shared_experts, first_k_dense_replace, n_group,
# topk_group, MTP layers).  transformers 5.24 DeepseekV3Config, Glm4MoeConfig.
SIGMOID_ROUTING_DEFAULTS = {"deepseek_v3": (1, 3, 8, 4, 1), "glm4_moe": (1, 1, 1, 1, 1)}
# Config keys of the sigmoid routing (read by sigmoid_routing, written by sigmoid_routing_config).
SIGMOID_ROUTING_READS = ("n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "scoring_func", "n_group",
                         "topk_group", "num_nextn_predict_layers", "num_mtp_layers", "topk_method")


def shared_and_dense(config: dict, f: dict, where: str, shared_default: int, dense_default: int) -> dict:
    """Shared experts (n_shared_experts whole experts in one MLP) and dense first layers (first_k_dense_replace):
    DeepSeek-V2 / V3's and GLM-4.5's MoE."""
    shared = _int(config, "n_shared_experts", shared_default, where, positive=False)
    dense = _int(config, "first_k_dense_replace", dense_default, where, positive=False)
    if _int(config, "moe_layer_freq", 1, where) != 1:
        raise InteropError(f"{where}: moe_layer_freq={config['moe_layer_freq']} is not supported (transformers' "
                           "classes make every layer from first_k_dense_replace on MoE)")
    if dense >= f["num_layers"]:
        raise InteropError(f"{where}: first_k_dense_replace ({dense}) leaves no MoE layer")
    if not shared:
        raise InteropError(f"{where}: n_shared_experts=0 is not supported (this family's MoE has shared experts)")
    return {"moe_layers": None if dense == 0 else list(range(dense, f["num_layers"])),
            "shared_expert_ffn_hidden": shared * f["moe_ffn_hidden"]}


def sigmoid_routing(config: dict, f: dict, where: str, defaults: tuple) -> dict:
    """DeepSeek-V3's and GLM-4.5's router (sigmoid scores, `e_score_correction_bias` for the choice, n_group groups
    scored by their two best, topk_group kept), shared experts, dense first layers and MTP modules."""
    shared, dense, groups, group_topk, mtp = defaults
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise InteropError(f"{where}: scoring_func {config['scoring_func']!r} is not supported "
                           f"(transformers' {config['model_type']} router is a sigmoid)")
    return {**shared_and_dense(config, f, where, shared, dense), "moe_router_score": "sigmoid",
            "moe_router_bias": True, "moe_groups": _int(config, "n_group", groups, where),
            "moe_group_topk": _int(config, "topk_group", group_topk, where), "moe_group_score": "top2",
            "mtp_layers": _int(config, "num_nextn_predict_layers", config.get("num_mtp_layers", mtp), where,
                               positive=False)}


def shared_and_dense_config(spec: ModelSpec, cannot) -> dict:
    """n_shared_experts and first_k_dense_replace for a spec; `cannot(field, what)` for what they cannot say."""
    moe_layers = list(range(spec.num_layers)) if spec.moe_layers is None else list(spec.moe_layers)
    dense = spec.num_layers - len(moe_layers)
    if moe_layers != list(range(dense, spec.num_layers)):
        cannot("moe_layers", f"MoE layers {moe_layers} (its MoE layers are every layer from first_k_dense_replace on)")
    shared = spec.shared_expert_ffn_hidden
    if shared is None or shared % spec.moe_ffn_hidden or spec.shared_expert_gate:
        cannot("shared_expert_ffn_hidden", f"shared experts of {shared} (its shared experts are n_shared_experts "
                                           f"whole ungated experts of {spec.moe_ffn_hidden})")
    return {"n_shared_experts": (shared or spec.moe_ffn_hidden) // spec.moe_ffn_hidden, "first_k_dense_replace": dense}


def sigmoid_routing_config(spec: ModelSpec, cannot) -> dict:
    """The config keys of sigmoid_routing's facts."""
    if spec.moe_router_score != "sigmoid":
        cannot("moe_router_score", f"a {spec.moe_router_score} router (its router is a sigmoid)")
    if not spec.moe_router_bias:
        cannot("moe_router_bias", "a sigmoid router without the score-correction bias")
    if spec.moe_groups is not None and spec.moe_group_score != "top2":
        cannot("moe_group_score", f"groups scored by their {spec.moe_group_score} (it sums the two best)")
    if spec.moe_groups is None and spec.num_experts < 2:
        cannot("num_experts", "a single expert (a group is scored by its two best)")
    return {**shared_and_dense_config(spec, cannot), "n_group": spec.moe_groups or 1,
            "topk_group": spec.moe_group_topk or 1, "num_nextn_predict_layers": spec.mtp_layers,
            "routed_scaling_factor": spec.moe_routed_scaling, "norm_topk_prob": spec.moe_norm_topk}


def yarn_from_config(scaling: dict, where: str) -> dict:
    """ModelSpec.rope_scaling from a yarn rope_parameters / rope_scaling object."""
    if scaling.get("attention_factor") is not None:
        raise InteropError(f"{where}: yarn attention_factor is not supported (it is derived from mscale)")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise InteropError(f"{where}: yarn truncate must be true or false, got {truncate!r}")
    if scaling.get("factor") is None or scaling.get("original_max_position_embeddings") is None:
        raise InteropError(f"{where}: yarn rope scaling needs factor and original_max_position_embeddings")
    values = {ours: scaling.get(hf) if scaling.get(hf) is not None else YARN_DEFAULTS.get(ours)
              for hf, ours in YARN_KEYS.items()}
    bad = [k for k, v in values.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
    if bad:
        raise InteropError(f"{where}: yarn rope scaling {bad[0]} must be a number, got {values[bad[0]]!r}")
    return yarn_rope_scaling(**values, truncate=truncate)


def rope_parameters(spec: ModelSpec) -> dict:
    """transformers 5's rope_parameters for a DeepSeek spec (default or yarn)."""
    out = {"rope_theta": spec.rope_base, "rope_type": "default"}
    scaling = spec.rope_scaling
    if scaling is not None:
        out["rope_type"] = scaling["type"]
        out.update({hf: scaling[ours] for hf, ours in YARN_KEYS.items()
                    if not (ours in ("mscale", "mscale_all_dim") and scaling[ours] == 0)})
        if "truncate" in scaling:
            out["truncate"] = scaling["truncate"]
    return out


def family(spec: ModelSpec) -> str:
    """V3 for a sigmoid router (with its correction bias), V2 for a softmax one."""
    return "deepseek_v3" if spec.moe_router_score == "sigmoid" else "deepseek_v2"


def config_from_spec(spec: ModelSpec, refuse) -> dict:
    """config.json for a multi-latent-attention spec; `refuse(field, why)` for what the class cannot hold."""
    model_type = family(spec)

    def cannot(field: str, what: str) -> None:
        refuse(field, f"HF {model_type} cannot hold this model: it has {what}")

    if not spec.is_moe:
        cannot("num_experts", "no experts (HF DeepSeek's layers from first_k_dense_replace on are MoE)")
        return {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
    if spec.rope_scaling is not None and spec.rope_scaling["type"] != "yarn":
        cannot("rope_scaling", f"{spec.rope_scaling['type']} rope scaling (DeepSeek's is yarn)")
    if spec.has_mlp_bias or spec.linear_bias:
        cannot("linear_bias", "biases")
    if model_type == "deepseek_v3":
        routing = sigmoid_routing_config(spec, cannot)
    else:
        routing = {**shared_and_dense_config(spec, cannot), "n_group": spec.moe_groups or 1,
                   "topk_group": spec.moe_group_topk or 1}
        if spec.moe_router_bias:
            cannot("moe_router_bias", "a router expert bias")
        if spec.moe_norm_topk:
            cannot("moe_norm_topk", "renormalised top-k weights (transformers' V2 never renormalises)")
        if spec.moe_groups is not None and spec.moe_group_score != "max":
            cannot("moe_group_score", f"groups scored by their {spec.moe_group_score} (V2 takes the best)")
        if not spec.rope_interleave:
            cannot("rope_interleave", "a rope part in halves (V2 rotates interleaved pairs)")
        if spec.mtp_layers:
            cannot("mtp_layers", "MTP modules (V2 has none)")
    config = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "hidden_act": "silu",
        "num_key_value_heads": spec.heads, "q_lora_rank": spec.q_lora_rank, "qk_nope_head_dim": spec.qk_nope_head_dim,
        **routing, "rope_theta": spec.rope_base,
        "rope_parameters": rope_parameters(spec), "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": spec.moe_aux_loss_coeff, "num_experts_per_tok": spec.moe_topk}
    if model_type != "deepseek_v3":
        config["topk_method"] = "greedy" if spec.moe_groups is None else "group_limited_greedy"
        config["norm_topk_prob"] = False
        if spec.moe_groups is None:  # greedy routing reads no groups (the class default)
            config.update(n_group=None, topk_group=None)
    for field, key, _ in COMMON[model_type]:
        config[key] = getattr(spec, field)
    return config
