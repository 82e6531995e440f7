"""Seed 001's nested MindSpeed-Core-MS config (`model_config.llm`, `accelerate_config`, `train_config`): read only."""
from __future__ import annotations

from ..mappings import mindspeed as table
from . import ArgsTarget, YamlTarget, section, sections


class MindSpeedNested(YamlTarget):
    name = "mindspeed-nested"
    precedence = 10  # `llm:` inside model_config: the most specific YAML shape
    writable = False
    positions_from_seq_length = True
    rows = table.NESTED_ROWS

    def recognises(self, doc) -> bool:
        return "llm" in section(doc, "model_config") or bool({"accelerate_config", "train_config"} & sections(doc))

    write = ArgsTarget.write  # a source only: writing says so in one line


TARGET = MindSpeedNested()
