"""`MergedReader`: a base model's reader with a LoRA adapter merged into its weights as they are read.

Each adapted weight is W + alpha/r * B A, computed in fp32 and cast once to the output dtype
(`interop.adapter.merged`); every other tensor passes through from the base's reader as it is (byte ranges,
fused rows and all).  The base's optimizer state belongs to the unmerged weights: left out, said so.
"""
from __future__ import annotations

import torch

from .adapter import lora_names, merged
from .contract import BaseReader
from .errors import InteropError
from .params import TensorKey
from .tensors import Source, TensorMeta


class MergedReader(BaseReader):
    """`base` (a model's reader) with `lora` (an adapter's reader on the same base model) merged in; `dtype`:
    the merged weights' dtype (None: each weight's own)."""

    def __init__(self, base: BaseReader, lora: BaseReader, dtype: torch.dtype | None = None, where: str = ""):
        adapter = lora.source.adapter
        spec = base.source.spec
        adapter.check_tensors(spec, {m.name: m.shape for m in lora.metas()}, f"{where}: " if where else "")
        self.base, self.lora, self.adapter, self.dtype = base, lora, adapter, dtype
        metas = base.metas()
        self.adapted = {m.name for m in metas if not TensorKey.parse(m.name).is_optim and adapter.adapts(m.name)}
        dropped = [m for m in metas if TensorKey.parse(m.name).is_optim]
        notes = list(base.source.notes)
        notes.append(f"merged the LoRA adapter {where} (rank {adapter.rank}, alpha {adapter.alpha:g}, "
                     f"{', '.join(adapter.targets)}) into {len(self.adapted)} weights: W + alpha/r B A in fp32, "
                     "cast once")
        if dropped:
            notes.append(f"left out the base's optimizer state ({len(dropped)} tensors): it belongs to the "
                         "unmerged weights")
        self._metas = [TensorMeta(m.name, dtype or m.dtype, m.shape) if m.name in self.adapted else m
                       for m in metas if not TensorKey.parse(m.name).is_optim]
        self.source = Source(spec, base.source.layout, base.source.state, notes)
        self.carried = base.carried

    def metas(self) -> list[TensorMeta]:
        return self._metas

    def read(self, name: str) -> torch.Tensor:
        weight = self.base.read(name)
        if name not in self.adapted:
            return weight
        a, b = (self.lora.read(n) for n in lora_names(name))
        return merged(weight, a, b, self.adapter.scaling, self.dtype)

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        return name not in self.adapted and self.base.read_into(name, out)

    def byte_ranges(self, name: str):
        return None if name in self.adapted else self.base.byte_ranges(name)

    def fused_row(self, name: str):
        found = self.base.fused_row(name)
        if found is None or any(n in self.adapted for n in found[1]):
            return None
        return found

    def read_fused(self, name: str) -> torch.Tensor:
        return self.base.read_fused(name)

    def native_name(self, name: str) -> str | None:
        return self.base.native_name(name)

    def confirm(self) -> None:
        self.base.confirm()
        self.lora.confirm()

    def close(self) -> None:
        self.base.close()
        self.lora.close()


def check_merge_args(adapter, merge: bool, base) -> None:
    """--adapter and --merge come together; --base names an adapter source's base (not with --merge)."""
    if adapter is not None and not merge:
        raise InteropError(f"--adapter {adapter} needs --merge (W + alpha/r B A written into the base's weights); "
                           f"to convert the adapter alone: interop convert {adapter} DST --base BASE --to FORMAT")
    if merge and adapter is None:
        raise InteropError("--merge needs --adapter ADAPTER (the LoRA adapter to merge into SRC)")
    if merge and base is not None:
        raise InteropError("--base names an adapter source's base model; with --merge SRC is the base")
