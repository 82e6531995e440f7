"""A MindSpeed-LLM launch: Megatron-LM's flags and MindSpeed-LLM's LoRA flags (`--lora-r`, `--lora-alpha`,
`--lora-target-modules`, ...), so a PEFT adapter_config.json or a MindFormers pet_config comes back as the flags
that fine-tune the same adapter.  Read like any Megatron launch script (the `megatron` format reads these flags);
MindSpeed-LLM's other flags are named in the report, as `--to megatron` names them."""
from __future__ import annotations

from .megatron import MegatronArgs


class MindSpeedLLMArgs(MegatronArgs):
    name = "mindspeed-llm"
    precedence = 40  # asked before `megatron`, which reads every other args file
    forks = ("mindspeed-llm",)
    header = ("# Megatron-LM (core_v0.16) arguments and MindSpeed-LLM's LoRA arguments written by `interop map-args`;"
              " read them with `interop map-args FILE`.")

    def recognises(self, doc) -> bool:
        return doc.startswith(self.header)  # its own output; a user's launch script reads as `megatron` (same flags)


TARGET = MindSpeedLLMArgs()
