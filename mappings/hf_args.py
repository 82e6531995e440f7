"""map-args' Hugging Face target: Megatron args <-> config.json, through ModelSpec.

The model is described once: Megatron args -> ModelSpec (`megatron_spec.spec_from_args`) -> config.json
(`hf_config.hf_config_from_spec`), and back through `hf_config.spec_from_hf_config` and
`megatron_spec.model_args`; so map-args writes every family (GPT2, Llama, Qwen2/3, Mistral, Llama-3
rope scaling, Mixtral, Qwen2-MoE) exactly as `interop convert --to hf` does.  What is here is only
what map-args adds around that:

- an args file may describe a model no HF class holds: each value that ModelSpec or the HF family
  cannot hold is named (Megatron dest -> why, for the report) and the config is written without it;
- a config.json also carries training values (dropouts, init std, router aux loss and jitter),
  which the converters leave at 0 and map-args takes from the args (`TRAINING_KEYS`);
- `vocab_size` is the tokenizer's true vocabulary, as `interop convert --to hf` writes it; only where
  the source records no more than Megatron's padded size is that written (`require`, with a warning).
"""
from __future__ import annotations

from ..errors import InteropError
from ..layout import ParallelLayout
from .hf_config import HF_FAMILIES, MOE_TRAINING_KEYS, config_keys, hf_config_from_spec, spec_from_hf_config
from .hf_deepseek import COMMON as DEEPSEEK_TYPES
from .megatron_args import ARGS, LISTS
from .megatron_spec import (SPEC_NUMBERS, UNSUPPORTED_ARGS, UNSUPPORTED_MOE_ARGS, args_losses, model_args, moe_args,
                            sliding_window_of, spec_from_args)

# ModelSpec field -> the Megatron argument that states it: how the report names what HF cannot hold.
FIELD_ARGS = {**SPEC_NUMBERS, "norm": "normalization", "activation": "activation",
              "position": "position_embedding_type", "qkv_bias": "add_qkv_bias", "linear_bias": "add_bias_linear",
              "mlp_bias": "add_bias_linear", "qk_norm": "qk_layernorm", "sliding_window": "window_size",
              "moe_router_score": "moe_router_score_function", "moe_router_bias": "moe_router_enable_expert_bias",
              "moe_norm_topk": "moe_router_pre_softmax", "moe_layers": "moe_layer_freq",
              "shared_expert_gate": "moe_shared_expert_gate", "q_lora_rank": "q_lora_rank",
              "kv_lora_rank": "kv_lora_rank", "qk_rope_head_dim": "qk_pos_emb_head_dim", "v_head_dim": "v_head_dim",
              "rope_interleave": "multi_latent_attention", "moe_groups": "moe_router_num_groups",
              "moe_group_topk": "moe_router_group_topk", "moe_group_score": "moe_router_group_topk",
              "moe_routed_scaling": "moe_router_topk_scaling_factor", "mtp_layers": "mtp_num_layers",
              "rope_scaling": "rope_type"}

# Training values a config.json carries beside the model: (Megatron dest, config key) per architecture.
TRAINING_KEYS = {
    "gpt2": [("hidden_dropout", "resid_pdrop"), ("hidden_dropout", "embd_pdrop"), ("attention_dropout", "attn_pdrop"),
             ("init_method_std", "initializer_range")],
    "llama": [("attention_dropout", "attention_dropout"), ("init_method_std", "initializer_range")],
}

# model_args' values that are Megatron's implementation, not the model a config.json states (Megatron
# pads the vocabulary itself; the activation is said once, as interop's derived `activation`).
NOT_IN_CONFIG = {"padded_vocab_size", "swiglu", "openai_gelu", "bias_gelu_fusion", "bias_swiglu_fusion",
                 "add_position_embedding", "use_rotary_position_embeddings", "rotary_interleaved"}
# moe_args' values that are the parallel layout, not the model.
MOE_LAYOUT = {"expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel"}
def held(full: dict) -> set:
    """The Megatron values the config.json written for these args has a field for: what it reads back
    (the others are "no hf field for it" in the report)."""
    values, _ = from_hf(to_hf(full)[0], "hf")
    return set(values) | {"params_dtype"}  # said by bf16 / fp16


def require(full: dict) -> dict:
    """A config.json must say how many embedding rows there are: the true vocabulary, or (a checkpoint's
    args that record only Megatron's padded size) the padded one, which map-args reports."""
    if full.get("padded_vocab_size") is None and full.get("vocab_size") is None:
        raise InteropError("hf: the vocabulary size is unknown: give --vocab-size N (or --tokenizer-type "
                           "GPT2BPETokenizer / Llama2Tokenizer)")
    return full if full.get("vocab_size") is not None else {**full, "vocab_size": full["padded_vocab_size"]}


# ---------------------------------------------------------------- Megatron args -> config.json

def to_hf(full: dict) -> tuple[dict, dict]:
    """(config.json, {Megatron dest: why the config does not hold its value}) for completed args."""
    full = require(full)
    describable, why = _describable(full)
    spec = spec_from_args(describable, "hf")
    cannot: list = []
    config = hf_config_from_spec(spec, cannot)
    for field, text in cannot:
        why.setdefault(FIELD_ARGS.get(field, field), text)
    arch = "gpt2" if config["model_type"] == "gpt2" else "llama"
    for dest, key in TRAINING_KEYS[arch]:
        if full.get(dest) is not None:
            config[key] = full[dest]
    if "output_router_logits" in config:  # transformers adds the aux loss only then (Megatron always does)
        coeffs = full.get("moe_aux_loss_coeff") or 0.0
        config["output_router_logits"] = any(c > 0 for c in (coeffs if isinstance(coeffs, list) else [coeffs]))
    if "router_jitter_noise" in config:
        config["router_jitter_noise"] = full.get("moe_input_jitter_eps") or 0.0
    return config, why


def _describable(full: dict) -> tuple[dict, dict]:
    """The args with each value ModelSpec has no place for put back to the one it has, and why, by dest."""
    out, why = dict(full), {}

    def drop(dest, value, text):
        why[dest] = text
        out[dest] = value

    for dest, ok in UNSUPPORTED_ARGS.items():
        if full.get(dest) not in (ok, None):
            drop(dest, ok, f"no Hugging Face model here has {dest}={full[dest]!r}")
    if full.get("qk_layernorm") and full.get("normalization") != "RMSNorm":
        drop("qk_layernorm", False, "the HF models' q/k norms are RMSNorms")
    try:
        sliding_window_of(full, "--window-size")
    except InteropError as exc:
        drop("window_size", None, f"HF's sliding_window is causal on every layer: {str(exc).split(': ', 1)[1]}")
    if full.get("num_experts"):
        for dest in UNSUPPORTED_MOE_ARGS:
            if full.get(dest) is not None:
                drop(dest, None, f"the HF routers have no {dest}")
        groups, group_topk = full.get("moe_router_num_groups"), full.get("moe_router_group_topk")
        if (groups is None) != (group_topk is None) or (
                group_topk and int(full.get("moe_router_topk") or 2) != 2 * int(group_topk)):
            for dest in ("moe_router_num_groups", "moe_router_group_topk"):
                drop(dest, None, "the HF routers score a group by the sum of its two best experts "
                                 "(megatron-core: moe_router_topk // moe_router_group_topk of them)")
        coeffs = full.get("moe_aux_loss_coeff")
        if isinstance(coeffs, list) and len(set(coeffs)) > 1:
            drop("moe_aux_loss_coeff", coeffs[:1], f"one aux loss coefficient in HF, Megatron gives {len(coeffs)}")
    return out, why


# ---------------------------------------------------------------- config.json -> Megatron args

def from_hf(doc: dict, where: str) -> tuple[dict, list[tuple]]:
    """(Megatron values, [(config key, value, why)]) from a config.json: its model through ModelSpec,
    its training values, and what Megatron cannot say or nothing reads."""
    model_type = doc.get("model_type")
    if model_type != "gpt2" and model_type not in HF_FAMILIES and model_type not in DEEPSEEK_TYPES:
        raise InteropError(f"{where}: model_type {model_type!r} is not supported "
                           f"(gpt2, {', '.join([*HF_FAMILIES, *DEEPSEEK_TYPES])} are)")
    doc, notes = _readable(doc, model_type)
    dtype = doc.get("torch_dtype") or doc.get("dtype")
    spec = spec_from_hf_config(doc, dtype if dtype in ("float32", "bfloat16", "float16") else "float32", where)
    values = {dest: v for dest, v in model_args(spec).items() if dest not in NOT_IN_CONFIG}
    values["activation"] = spec.activation
    if spec.is_moe:
        moe = {dest: v for dest, v in moe_args(spec, ParallelLayout.build(spec.num_layers)).items()
               if dest not in MOE_LAYOUT}
        freq = moe["moe_layer_freq"]
        moe["moe_layer_freq"] = freq if freq == 1 else "[" + ",".join(map(str, freq)) + "]"
        values |= moe
    if values.get("window_size"):
        values["window_size"] = "({}, {})".format(*values["window_size"])
    for note in args_losses(spec):
        notes.append(("rope_parameters", doc.get("rope_parameters") or doc.get("rope_scaling"), note))
    if spec.has_mlp_bias != spec.linear_bias:
        notes.append(("mlp_bias", spec.has_mlp_bias, f"Megatron's --add-bias-linear puts biases on the MLP too "
                                                     f"(this {model_type}'s MLP has {'' if spec.has_mlp_bias else 'no '}"
                                                     "biases)"))
    arch = "gpt2" if model_type == "gpt2" else "llama"
    for dest, key in TRAINING_KEYS[arch]:
        if doc.get(key) is not None:
            values[dest] = doc[key]
    if doc.get("router_jitter_noise"):
        values["moe_input_jitter_eps"] = doc["router_jitter_noise"]
    for dest, value in list(values.items()):
        if ARGS[dest].kind in LISTS and value is not None and not isinstance(value, list):
            values[dest] = [value]
    read = config_keys(model_type) | {key for _, key in TRAINING_KEYS[arch]} | {"architectures", "torch_dtype", "dtype"}
    read |= set(MOE_TRAINING_KEYS.get(model_type, {}))
    notes += [(key, value, "no Megatron equivalent for this hf key") for key, value in doc.items() if key not in read]
    return values, notes


def _readable(doc: dict, model_type: str) -> tuple[dict, list[tuple]]:
    """The config without what a config.json may say but Megatron (and ModelSpec) cannot: named, not refused."""
    doc, notes = dict(doc), []
    rope = doc.get("rope_parameters") if isinstance(doc.get("rope_parameters"), dict) else doc.get("rope_scaling")
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    yarn_held = model_type in DEEPSEEK_TYPES or HF_FAMILIES.get(model_type, {}).get("yarn")  # gpt_oss: Bridge's fields
    if kind not in ("default", "llama3") and not (kind == "yarn" and yarn_held):
        notes.append(("rope_parameters", rope, f"rope type {kind!r} has no Megatron equivalent"))
        doc.pop("rope_scaling", None)
        doc["rope_parameters"] = {k: v for k, v in rope.items() if k == "rope_theta"}
    family = HF_FAMILIES.get(model_type, {})
    if family.get("sliding") == "per_layer" and doc.get("use_sliding_window"):
        notes.append(("use_sliding_window", True, "a window on some layers only has no Megatron equivalent"))
        doc["use_sliding_window"] = False
    return doc, notes
