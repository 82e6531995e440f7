"""MindFormers r1.3 dynamic-graph (parallel_core pynative) YAML, the shape of seed 000: `mappings/mindformers.py`."""
from __future__ import annotations

from ..mappings import mindformers as table
from ..mappings import mindspeed
from . import YamlTarget, section


class MindFormers(YamlTarget):
    name = "mindformers"
    precedence = 30  # its own keys (grad_clip_kwargs, ...) tell it from MindSpeed-Core-MS's same sections
    positions_from_seq_length = True
    rows = table.ROWS
    nullable = table.NULLABLE
    same_values = mindspeed.SAME_VALUES
    same_meaning = mindspeed.SAME_MEANING
    notes = mindspeed.NOTES
    unheld = mindspeed.UNHELD
    required = (("model_config.vocab_size", "vocab_size"), ("model_config.seq_length", "seq_length"))
    micro_batch_path = "dataset_config.micro_batch_num"

    def recognises(self, doc) -> bool:
        return ("grad_clip_kwargs" in section(doc, "training_config")
                or "learning_rate_scheduler_kwargs" in section(doc, "optimizer_config")
                or "dataset_dir" in section(doc, "dataset_config"))


TARGET = MindFormers()
