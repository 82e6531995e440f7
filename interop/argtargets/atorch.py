"""An ATorch strategy script (seed 004: `load_strategy` with a ("parallel_mode", ...) entry): read only."""
from __future__ import annotations

import ast
from pathlib import Path

from ..argtable import Unmapped
from ..mappings import deepspeed as table
from . import ArgsTarget, read_text


class ATorch(ArgsTarget):
    name = "atorch"
    syntax = "python"
    markers = ("parallel_mode",)
    precedence = 10  # a strategy tuple is more specific than a CONFIG assignment
    writable = False

    def recognises(self, tree) -> bool:
        return any(isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant)
                   and node.elts[0].value == "parallel_mode" for node in ast.walk(tree))

    def load(self, path: Path, env: dict | None) -> tuple[dict, list[Unmapped], list[str]]:
        explicit, entries, warnings = table.read_strategy(read_text(path), str(path))
        return explicit, [Unmapped(*e) for e in entries], warnings


TARGET = ATorch()
