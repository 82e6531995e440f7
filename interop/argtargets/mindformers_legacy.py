"""MindFormers r0.3 run_*.yaml (static graph, seed 002's GPT2): `mappings/mindformers_legacy.py`."""
from __future__ import annotations

from ..mappings import mindformers_legacy as table
from ..mappings import mindspeed
from . import YamlTarget, section, sections


class MindFormersLegacy(YamlTarget):
    name = "mindformers-legacy"
    precedence = 20  # `model:` / `runner_config` / parallel_config.data_parallel: before the config-class shapes
    positions_from_seq_length = True
    header = table.HEADER
    rows = table.ROWS
    unheld = table.UNHELD
    same_meaning = mindspeed.SAME_MEANING  # the same padded model.model_config.vocab_size
    required = (("model.model_config.vocab_size", "vocab_size"), ("model.model_config.seq_length", "seq_length"))
    micro_batch_path = "parallel_config.micro_batch_num"

    def recognises(self, doc) -> bool:
        return ("model" in sections(doc) or "data_parallel" in section(doc, "parallel_config")
                or bool({"runner_config", "context", "lr_schedule"} & sections(doc)))

    def complete(self, values: dict, doc: dict) -> tuple[dict, list[str]]:
        return table.complete_read(values, doc)


TARGET = MindFormersLegacy()
