"""What readers and writers exchange: a tensor's description (`TensorMeta`) and a source's (`Source`).

A Reader announces its tensors (`metas`) before reading any, so a Writer can lay out
its files up front; the conversion then moves one global tensor at a time.  The methods
each side speaks are `interop.contract`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adapter import AdapterSpec
from .layout import ParallelLayout
from .spec import ModelSpec

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAME_OF_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class Source:
    """What a Reader knows besides tensors: the spec, its layout, training state and notes."""
    spec: ModelSpec
    layout: ParallelLayout | None = None
    state: dict = field(default_factory=dict)  # iteration, scheduler, rng, ... (JSON-able)
    notes: list[str] = field(default_factory=list)  # what was dropped or could not be mapped, and why
    adapter: AdapterSpec | None = None  # a LoRA adapter source: its tensors adapt `spec`, the base model's
    unchecked: str | None = None  # which of its files hold tensor bytes no checksum covers ("HF safetensors files")
