"""`StackedReader`: an adapter whose fused projections' A's differ, made into an equal adapter that shares them.

Megatron's fused `linear_qkv` (and `linear_fc1`) holds one LoRA A for q, k and v, and one rank for the whole
adapter; an HF PEFT adapter has an A per projection.  With `--lora-stack-ranks` the adapter is rewritten exactly
(never approximated) at rank k * r, k the largest group of projections that read the same input (q, k, v: 3;
gate, up: 2):

    A' = [A_q; A_k; A_v]                 one [k r, in] for every projection of the group (zero rows pad a
                                         smaller group, and a lone projection: [A; 0; 0])
    B'_q = [B_q, 0, 0], B'_k = [0, B_k, 0], B'_v = [0, 0, B_v]      [out, k r]
    alpha' = k alpha                     so alpha' / r' = alpha / r and B'_q A' = B_q A_q exactly

A projection of a group the adapter leaves out (k and v of an adapter on q alone) gets B' = 0: its delta stays
zero.  The result is a rank-k r adapter (its training would differ from the original's; its output does not).
"""
from __future__ import annotations

import torch

from .adapter import INPUT_GROUPS, AdapterSpec, lora_names, target_of, weight_of
from .contract import BaseReader
from .errors import InteropError
from .params import TensorKey, param_index
from .tensors import Source, TensorMeta


class StackedReader(BaseReader):
    """`lora` (an adapter's reader) as the stacked adapter the module docstring draws."""

    def __init__(self, lora: BaseReader):
        adapter, spec = lora.source.adapter, lora.source.spec
        if adapter is None:
            raise InteropError("--lora-stack-ranks applies to a LoRA adapter source")
        base = param_index(spec)
        groups = {}  # target -> its group (the targets of the model that read the same input)
        for group in INPUT_GROUPS:
            if any(t in adapter.targets for t in group):
                for t in group:
                    groups[t] = group
        k = max((len(g) for g in groups.values()), default=1)
        targets = tuple(sorted(set(adapter.targets) | {t for t in groups}))
        self.adapter = AdapterSpec(adapter.rank * k, adapter.alpha * k, targets, adapter.dropout, adapter.layers,
                                   adapter.base_name, shared_a=True)  # one stacked A per group
        self.adapter.check_base(spec)  # a group member the model lacks: one line
        self.lora, self.r, self.groups = lora, adapter.rank, groups
        self.held = {m.name: m for m in lora.metas() if not TensorKey.parse(m.name).is_optim}
        self.base = base
        notes = list(lora.source.notes) + [
            f"--lora-stack-ranks: the adapter written at rank {self.adapter.rank} (alpha {self.adapter.alpha:g}): "
            f"the A's of q, k, v (gate, up) stacked into one, each B padded with zero columns; the same output"]
        if any(TensorKey.parse(m.name).is_optim for m in lora.metas()):
            notes.append("--lora-stack-ranks: the adapter's optimizer state left out (it is the rank-"
                         f"{self.r} adapter's)")
        self.source = Source(spec, lora.source.layout, lora.source.state, notes, adapter=self.adapter)
        dtype = next(iter(self.held.values())).dtype
        self._metas = [TensorMeta(p.name, dtype, p.shape) for p in self.adapter.params(spec)]

    def metas(self) -> list[TensorMeta]:
        return self._metas

    def _part(self, name: str) -> torch.Tensor | None:
        return self.lora.read(name) if name in self.held else None

    def read(self, name: str) -> torch.Tensor:
        weight = weight_of(name)
        layer, target = target_of(weight)
        group = self.groups.get(target, (target,))
        out_rows, in_cols = self.base[weight].shape
        r, k = self.r, self.adapter.rank // self.r
        dtype = self._metas[0].dtype
        if name.endswith(".lora_a"):
            stacked = torch.zeros(k * r, in_cols, dtype=dtype)
            for j, t in enumerate(group):
                a = self._part(lora_names(f"layers.{layer}.{t}.weight")[0])
                if a is not None:
                    stacked[j * r:(j + 1) * r] = a
            return stacked
        b = self._part(name)
        stacked = torch.zeros(out_rows, k * r, dtype=dtype)
        if b is not None:
            j = group.index(target)
            stacked[:, j * r:(j + 1) * r] = b
        return stacked

    def confirm(self) -> None:
        self.lora.confirm()

    def close(self) -> None:
        self.lora.close()
