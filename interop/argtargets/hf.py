"""A Hugging Face config.json, through ModelSpec as `interop convert --to hf` writes it: `mappings/hf_args.py`."""
from __future__ import annotations

import json

from ..argtable import Unmapped, typed
from ..mappings import hf_args
from ..mappings import megatron_args as M
from . import TableTarget


class HuggingFace(TableTarget):
    name = "hf"
    syntax = "json"
    precedence = 10  # model_type / architectures: nothing else has them
    unheld_group = "training values a Hugging Face config.json has no field for (it describes the model only)"

    def recognises(self, doc) -> bool:
        return "model_type" in doc or "architectures" in doc

    def write(self, explicit: dict) -> tuple[str, dict, dict, list[str]]:
        full = M.complete(explicit)
        doc, why = hf_args.to_hf(full)
        warnings = []
        if full.get("vocab_size") is None and full.get("padded_vocab_size"):
            warnings.append(f"vocab_size: written as Megatron's padded {full['padded_vocab_size']}: the source does "
                            "not give the tokenizer's true vocabulary (give it with --set vocab_size=N)")
        return self.render(doc, explicit), doc, why, warnings

    def render(self, doc: dict, explicit: dict) -> str:
        return json.dumps(doc, indent=2) + "\n"

    def parse(self, text: str, where: str) -> dict:
        return json.loads(text)

    def read(self, text: str, where: str) -> tuple[dict, list[Unmapped], list[str]]:
        values, notes = hf_args.from_hf(self.document(text, where), where)
        values = {dest: typed(dest, value, where) for dest, value in values.items()}
        return M.normalize(values), [Unmapped(*note) for note in notes], []

    def held(self, before: dict) -> set:
        return hf_args.held(before)


TARGET = HuggingFace()
