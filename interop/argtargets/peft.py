"""A Hugging Face PEFT adapter_config.json (LoRA): `mappings/lora_args.py` PEFT_ROWS.

It describes the adapter, not the model: read as a source it gives the LoRA settings alone (map-args asks for no
model sizes), and written it holds the LoRA settings of the run (its model goes to `--to hf`'s config.json)."""
from __future__ import annotations

from ..argtable import Unmapped
from ..mappings import lora_args
from . import JsonTarget


class Peft(JsonTarget):
    name = "peft"
    precedence = 5  # peft_type: nothing else has it
    describes_model = False
    nullable = frozenset()  # a value Megatron leaves unset is left out (PEFT's default stands)
    rows = lora_args.PEFT_ROWS
    unheld_group = "values an adapter_config.json has no field for (it describes the LoRA adapter only)"

    def recognises(self, doc) -> bool:
        return "peft_type" in doc

    def document(self, text: str, where: str) -> dict:
        """PEFT writes every LoraConfig field; those at the value that means plain LoRA on every layer say nothing."""
        doc = super().document(text, where)
        return {k: v for k, v in doc.items() if not (k in lora_args.PEFT_PLAIN and v == lora_args.PEFT_PLAIN[k])}

    def warnings(self, full: dict, doc: dict) -> list[str]:
        if full.get("lora_target_modules"):
            return []
        return ["target_modules not written: the source names no LoRA target (--lora-target-modules), so it trains "
                "no adapter; PEFT would pick its own default modules for the model type"]


TARGET = Peft()
