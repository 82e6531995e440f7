"""ATorch / DeepSpeed 3D parallel JSON (seed 004): `parallel_mode` and `ds_config`, `mappings/deepspeed.py`."""
from __future__ import annotations

from ..mappings import deepspeed as table
from . import JsonTarget

KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
        "fp16", "bf16", "gradient_clipping", "steps_per_print", "ds_config", "parallel_mode", "optimizer", "scheduler"}


class DeepSpeed(JsonTarget):
    name = "deepspeed"
    precedence = 20  # after a Hugging Face config.json (model_type), which may also say fp16 / bf16
    rows = table.ROWS

    def recognises(self, doc) -> bool:
        return bool(KEYS & set(doc))

    def parse(self, text: str, where: str) -> dict:
        doc = super().parse(text, where)
        if isinstance(doc, dict) and "ds_config" not in doc and "parallel_mode" not in doc:
            return {"ds_config": doc}  # a plain DeepSpeed config, as DeepSpeed and ATorch read it
        return doc


TARGET = DeepSpeed()
