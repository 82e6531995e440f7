"""MindSpeed-Core-MS r0.1.0 YAML (`init_configs_from_yaml`), the seed tutorial's target: `mappings/mindspeed.py`."""
from __future__ import annotations

from ..mappings import mindspeed as table
from . import YamlTarget, sections

SECTIONS = {"model_config", "training_config", "parallel_config", "optimizer_config", "dataset_config"}


class MindSpeed(YamlTarget):
    name = "mindspeed"
    precedence = 40  # the plainest shape of the config-class family: asked after the MindFormers ones
    positions_from_seq_length = True
    rows = table.ROWS
    nullable = table.NULLABLE
    same_values = table.SAME_VALUES
    same_meaning = table.SAME_MEANING
    notes = table.NOTES
    unheld = table.UNHELD
    required = (("model_config.vocab_size", "vocab_size"), ("model_config.seq_length", "seq_length"))
    micro_batch_path = "dataset_config.micro_batch_num"

    def recognises(self, doc) -> bool:
        return bool(SECTIONS & sections(doc))


TARGET = MindSpeed()
