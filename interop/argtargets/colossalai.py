"""A ColossalAI hybrid-parallel CONFIG module (seed 003), read with `ast`, never run: `mappings/colossalai.py`."""
from __future__ import annotations

import ast

from ..mappings import colossalai as table
from . import TableTarget


class ColossalAI(TableTarget):
    name = "colossalai"
    syntax = "python"
    markers = ("CONFIG",)
    precedence = 20
    rows = table.ROWS

    def recognises(self, tree) -> bool:
        return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CONFIG" for t in n.targets)
                   for n in tree.body)

    def render(self, doc: dict, explicit: dict) -> str:
        return table.render(doc)

    def parse(self, text: str, where: str) -> dict:
        return table.parse(text)


TARGET = ColossalAI()
