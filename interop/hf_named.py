"""Tensors stored under Hugging Face names, in any container, -> canonical tensors.

Many training systems save the HF model's own state dict in their own files: DeepSpeed's engine
(`module`, or ZeRO's fp32 partitions), accelerate's FSDP DCP (`model.<HF name>`), FSDP's full state
dict, ColossalAI's `model.pt`.  Their readers differ only in how they fetch one HF-named tensor; the
name table (`mappings/hf_names.py`) and its checks live here once.
"""
from __future__ import annotations

import abc
from typing import Callable

import torch

from .contract import BaseReader
from .errors import InteropError
from .mappings.hf_config import hf_family
from .mappings.hf_names import IGNORED_SUFFIXES, STACKED_TABLES, TABLES
from .params import TensorKey, param_table
from .rows import Row, check_placed, expand
from .spec import ModelSpec
from .tensors import TensorMeta

def hf_table(spec: ModelSpec, model_type: str | None = None) -> str:
    """Which name table holds the model: its HF family's (`model_type`, else the one its facts pick) where the
    family has its own names, else its architecture's (a Llama-style family without a table has Llama's names)."""
    family = "gpt2" if spec.arch == "gpt2" else model_type or hf_family(spec)
    return family if family in TABLES else spec.arch


def hf_rows(spec: ModelSpec, stacked: bool = False, model_type: str | None = None) -> list[Row]:
    """The HF name table of the model's family expanded for this model (`interop.rows.expand`).
    `stacked`: transformers 5's in-memory expert layout (read only) instead of the hub's."""
    table = hf_table(spec, model_type)
    return named_rows((STACKED_TABLES if stacked else TABLES)[table], spec, f"HF {table}")


def named_rows(table: list, spec: ModelSpec, what: str) -> list[Row]:
    """Any name table's rows for this model, every canonical tensor placed (else one line)."""
    rows = expand(table, spec)
    check_placed(rows, spec, what)
    return rows


class HFNamedState:
    """The canonical tensors of a model whose container keys are HF names (or another name table's:
    `rows` from `named_rows`, `tied_head` the name a tied model's head copy has there).

    keys: {HF name: (dtype, shape)} of what the container holds (weights).  fetch(kind, HF name)
    returns the whole tensor: kind "" the weight, else an optimizer moment (`exp_avg`, `exp_avg_sq`,
    `fp32_param`) of the same shape, fp32.  moments: the kinds the container holds (none, or all three)."""

    def __init__(self, spec: ModelSpec, keys: dict, fetch: Callable[[str, str], torch.Tensor], where: str,
                 moments: tuple[str, ...] = (), rows: list | None = None, tied_head: str = "lm_head.weight"):
        self.spec, self.fetch, self.moments = spec, fetch, moments
        self.notes: list[str] = []
        keys = dict(keys)
        ignored = {k: why for k in keys for suffix, why in IGNORED_SUFFIXES.items() if k.endswith(suffix)}
        for k in ignored:
            del keys[k]
        if ignored:
            self.notes.append(f"dropped {len(ignored)} buffers that are not parameters "
                              f"({'; '.join(sorted(set(ignored.values())))})")
        self.part_of: dict[str, tuple] = {}
        for row in (hf_rows(spec) if rows is None else rows):
            hf_key, transform, parts = row.key, row.transform, list(row.parts)
            if hf_key not in keys:
                raise InteropError(f"{where}: tensor {hf_key} is missing (the config describes a {spec.arch} "
                                   f"model with {spec.num_layers} layers)")
            got, want = tuple(keys.pop(hf_key)[1]), transform.rank_shape()
            if got != want:
                raise InteropError(f"{where}: {hf_key} has shape {list(got)}, the config implies {list(want)}")
            for i, p in enumerate(parts):
                self.part_of[p] = (hf_key, transform, parts, i)
        if spec.tied_embeddings and tied_head in keys:
            del keys[tied_head]
            self.notes.append(f"dropped {tied_head}: the model ties it to the input embedding")
        if keys:
            raise InteropError(f"{where}: {len(keys)} tensors do not belong to a {spec.arch} model, "
                               f"e.g. {sorted(keys)[0]}")
        self._cached: dict[tuple[str, str], list[torch.Tensor]] = {}

    def metas(self, dtype_of: Callable[[str], torch.dtype]) -> list[TensorMeta]:
        """Weights (dtype_of(HF name)) then each moment kind's fp32 tensors, in canonical order."""
        table = param_table(self.spec)
        out = [TensorMeta(p.name, dtype_of(self.part_of[p.name][0]), p.shape) for p in table]
        for kind in self.moments:
            out += [TensorMeta(str(TensorKey(p.name, kind)), torch.float32, p.shape) for p in table]
        return out

    def read(self, name: str) -> torch.Tensor:
        key = TensorKey.parse(name)
        kind = key.kind or ""
        hf_key, transform, parts, i = self.part_of[key.param]
        if len(parts) == 1:
            return transform.split(self.fetch(kind, hf_key))[0].contiguous()
        if (kind, hf_key) not in self._cached:  # q, k and v from one fused tensor: read it once
            while len(self._cached) >= 2:
                del self._cached[next(iter(self._cached))]
            self._cached[(kind, hf_key)] = transform.split(self.fetch(kind, hf_key))
        return self._cached[(kind, hf_key)][i].contiguous()

    def native_name(self, name: str) -> str:
        hf_key, _, parts, i = self.part_of[TensorKey.parse(name).param]
        return hf_key if len(parts) == 1 else f"{hf_key} [part {i + 1}/{len(parts)}]"

    def close(self) -> None:
        self._cached.clear()


class HFNamedReader(BaseReader):
    """A reader of a container keyed by HF names (a DCP folder, a DeepSpeed engine file, a torch.save dict):
    its `state_names` (an HFNamedState, set by __init__) answers for the canonical tensors; the subclass
    says only how a key's dtype is found and (through the HFNamedState's fetch) its bytes."""

    state_names: HFNamedState

    @abc.abstractmethod
    def dtype_of(self, key: str) -> torch.dtype:
        """The stored dtype of the weight under container key `key`."""

    def metas(self) -> list[TensorMeta]:
        return self.state_names.metas(self.dtype_of)

    def read(self, name: str) -> torch.Tensor:
        return self.state_names.read(name)

    def native_name(self, name: str) -> str:
        return self.state_names.native_name(name)

    def close(self) -> None:
        self.state_names.close()
