"""HF PEFT's LoRA files, names and config keys (peft 0.21.2: peft/utils/save_and_load.py
get_peft_model_state_dict drops the adapter name `default`; peft/tuners/lora/config.py LoraConfig)."""
from __future__ import annotations

from ..adapter import AdapterSpec, LoraNames

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# `base_model.model.` (PeftModelForCausalLM.base_model = LoraModel, whose .model is the HF model) + the HF
# module + `.lora_A.weight` (lora.Linear.lora_A["default"] is an nn.Linear [r, in]) / `.lora_B.weight` [out, r]
LORA_NAMES = LoraNames(".lora_A.weight", ".lora_B.weight", "base_model.model.")

# LoraConfig fields whose non-default value changes what the adapter computes beyond W + alpha/r B A: refused
REFUSED = {
    "use_rslora": "rank-stabilised scaling (alpha / sqrt(r)) is not held by interop's adapters",
    "use_dora": "DoRA's magnitude vectors are not held by interop's adapters",
    "rank_pattern": "a rank per module is not held by interop's adapters (one rank)",
    "alpha_pattern": "an alpha per module is not held by interop's adapters (one alpha)",
    "modules_to_save": "fully trained modules beside the LoRA are not held by interop's adapters",
    "bias": "trained biases beside the LoRA are not held by interop's adapters",
    "lora_bias": "a bias on lora_B is not held by interop's adapters",
    "layer_replication": "replicated layers are not held by interop's adapters",
    "target_parameters": "LoRA on parameters (not modules) is not held by interop's adapters",
    "trainable_token_indices": "trained token embeddings are not held by interop's adapters",
    "use_qalora": "QALoRA is not held by interop's adapters",
}


def config_of(adapter: AdapterSpec, modules: list[str], fan_in_fan_out: bool) -> dict:
    """adapter_config.json for `adapter` adapting HF modules named `modules` (`q_proj`, ...)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": adapter.base_name,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
        "target_modules": modules, "fan_in_fan_out": fan_in_fan_out, "bias": "none", "inference_mode": True,
        "layers_to_transform": None if adapter.layers is None else list(adapter.layers),
        "layers_pattern": None if adapter.layers is None else "layers",
        "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
        "init_lora_weights": True,
    }
