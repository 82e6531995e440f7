"""The part every LoRA adapter writer shares: an adapter target holds weights only, and each stored tensor is one
row of the adapter's table, whose parts (A or B of each projection it fuses) arrive one by one."""
from __future__ import annotations

import abc

import torch

from .adapter import optimizer_dropped_notes
from .contract import BaseWriter
from .params import TensorKey
from .rows import Row, RowCollector


class AdapterWriter(BaseWriter):
    """A LoRA adapter target: `use_rows` in __init__; `place(row, parts)` stores a row once all its parts came."""

    holds_adapter = True

    def use_rows(self, rows: list[Row], metas, why_no_optimizer: str) -> None:
        """Write `rows`; the optimizer moments in `metas` are left out, and a note says so and why."""
        self.rows = rows
        self.row_of = {n: row for row in rows for n in row.parts}
        self.collector = RowCollector()
        self.notes = [*self.notes, *optimizer_dropped_notes(metas, why_no_optimizer)]  # after any set before

    def wants(self, name: str) -> bool:
        return not TensorKey.parse(name).is_optim

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if TensorKey.parse(name).is_optim:  # weights only (a note says so)
            return
        row = self.row_of[name]
        parts = self.collector.add(row.key, row.parts, name, tensor)
        if parts is not None:
            self.place(row, parts)

    @abc.abstractmethod
    def place(self, row: Row, parts: list[torch.Tensor]) -> None:
        """Store `row` from its parts (canonical tensors, in `row.parts` order)."""
