"""LoRA target modules by name in each framework: Megatron-core's, Hugging Face's (PEFT), MindFormers' cells.

A LoRA's target list names modules the way its framework's model names them.  Megatron-core fuses q, k and v
into one `linear_qkv` and gate and up into one `linear_fc1`, so one Megatron target is several HF ones:

- Megatron-core / MindSpeed-LLM (`--lora-target-modules`, mindspeed_llm/features_manager/finetune/lora.py: PEFT's
  LoraConfig on megatron-core's modules) and Megatron-Bridge (peft/lora.py `LoRA.target_modules`, default the four
  below): `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`; MindSpeed-LLM's legacy (non-mcore) models name
  them `query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`.
- Hugging Face (PEFT `target_modules`, matched against the end of each module's name): Llama-style `q_proj` ...
  `down_proj` (Llama, Mistral, Qwen2/3, Gemma, OLMo 2 and their MoE models); Phi-3's fused `qkv_proj` /
  `gate_up_proj` and GPT2's `c_attn` / `c_fc` are read too.
- MindFormers (`pet_config.target_modules`, a regular expression `re.match`ed against each cell's own name,
  mindformers/pet/tuners/lora_adapter.py in 2.1.0): written with its Llama cells `wq` / `wk` / `wv` / `wo` /
  `w1` / `w3` / `w2` (models/llama/llama_transformer.py, llama_layer.py; MindFormers' own LoRA examples,
  '.*wq|.*wk|.*wv|.*wo', and interop's MindFormers adapters use them); read also with `w_qkv` / `w_gate_hidden`
  (qkv_concat) and its mcore-style models' cells, named as Megatron-core's (parallel_core: `linear_qkv`, ...).
"""
from __future__ import annotations

# Megatron-core module -> the modules it is in each framework (written in this order).
HF = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
      "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
MINDFORMERS = {"linear_qkv": ("wq", "wk", "wv"), "linear_proj": ("wo",), "linear_fc1": ("w1", "w3"),
               "linear_fc2": ("w2",)}
MODULES = tuple(HF)  # the Megatron-core modules, in model order
# ... and the canonical modules (`interop.adapter` targets) each is; a model without a gate has linear_fc1 = mlp.up
CANONICAL = {"linear_qkv": ("attn.q", "attn.k", "attn.v"), "linear_proj": ("attn.o",),
             "linear_fc1": ("mlp.gate", "mlp.up"), "linear_fc2": ("mlp.down",)}

# Other spellings of the same modules, read (never written).
MEGATRON_ALIASES = {"query_key_value": "linear_qkv", "dense": "linear_proj", "dense_h_to_4h": "linear_fc1",
                    "dense_4h_to_h": "linear_fc2"}
HF_FUSED = {"qkv_proj": "linear_qkv", "gate_up_proj": "linear_fc1", "c_attn": "linear_qkv", "c_fc": "linear_fc1"}
MINDFORMERS_FUSED = {"w_qkv": "linear_qkv", "w_gate_hidden": "linear_fc1"}

# MindFormers' target when pet_config gives none (LoraAdapter.get_pet_model): every cell named *dense* / *linear*,
# which in its mcore-style models is the four modules above (its Llama's wq ... w3 match none of it).
MINDFORMERS_DEFAULT = r".*dense*|.*linear*"


def megatron_module(name: str) -> str | None:
    """The Megatron-core module a Megatron-side target names (its legacy spelling included), or None."""
    return name if name in HF else MEGATRON_ALIASES.get(name)


def same_targets(a, b) -> bool:
    """Two Megatron target lists adapt the same modules (order and legacy spellings aside)."""
    def norm(value):
        items = value if isinstance(value, list) else ([] if value is None else [value])
        return sorted(megatron_module(str(v)) or str(v) for v in items)
    return norm(a) == norm(b)


def from_parts(found: set, table: dict) -> tuple[list[str], list[str]]:
    """(Megatron modules whose parts are all in `found`, the modules only some of whose parts are) per `table`."""
    whole = [m for m in MODULES if set(table[m]) <= found]
    partial = [m for m in MODULES if m not in whole and set(table[m]) & found]
    return whole, partial
