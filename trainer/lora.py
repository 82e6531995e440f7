"""LoRA on a frozen base: the adapted linears, a fresh adapter, and which tensors train.

An adapted linear computes W x + s B (A x), s = alpha / rank, with A and B cut by tensor parallelism like the
weight they adapt (`interop.adapter.SPLITS`), so each rank does its part with the base linear's one all-reduce:

- column-parallel W (q, k, v, gate, up): A [r, in] on every rank, B_t [out/tp, r].  Rank t outputs
  W_t x + s B_t (A x).  Each rank's gradient of A is its part (through B_t): `copy_to_tp(A)` sums them in the
  backward pass, so the replicated copies stay equal.
- row-parallel W (o, down): A_t [r, in/tp], B [out, r] on every rank.  Rank t adds s B (A_t x_t) to its partial
  W_t x_t before the all-reduce (the sum over t is s B (A x)); `copy_to_tp(B)` sums B's partial gradients.

Everything else is frozen (requires_grad False): only the adapter's tensors get gradients, AdamW state and
checkpoints.  A fresh adapter is drawn once, whole, from a seed (A as PEFT's kaiming-uniform, B zero), so every
layout and framework starts from the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from interop.adapter import AdapterSpec, target_of
from interop.atomic import atomic_directory
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.mappings.lora_modules import CANONICAL, megatron_module
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreWriter
from interop.tensors import TensorMeta

from .tp import ColumnParallelLinear, RowParallelLinear, copy_to_tp, reduce_from_tp

# The modules of the trainer's dense decoder layer that hold a tensor-parallel linear (the targets it adapts).
TARGETS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
# The modules other frameworks fuse into one linear (Megatron-core's linear_qkv / linear_fc1, GPT2's c_attn): with
# `shared_a` their adapters share one A, as a LoRA on the fused linear has (MindSpeed-LLM's, PEFT's on GPT2).
FUSED = (("attn.q", "attn.k", "attn.v"), ("mlp.gate", "mlp.up"))


class _LoRALinear(nn.Module):
    """The base linear's weight and bias (frozen, same Parameters, same names) plus this rank's A and B."""

    def __init__(self, base: nn.Module, a_shape, b_shape, adapter: AdapterSpec):
        super().__init__()
        self.group, self.weight, self.bias = base.group, base.weight, base.bias
        self.lora_a = nn.Parameter(torch.zeros(a_shape))
        self.lora_b = nn.Parameter(torch.zeros(b_shape))
        self.scaling = adapter.scaling
        self.dropout = nn.Dropout(adapter.dropout) if adapter.dropout else nn.Identity()


class LoRAColumnParallelLinear(_LoRALinear):
    def __init__(self, base: ColumnParallelLinear, adapter: AdapterSpec):
        rows, cols = base.weight.shape
        super().__init__(base, (adapter.rank, cols), (rows, adapter.rank), adapter)

    def forward(self, x):
        x = copy_to_tp(x, self.group)
        a = copy_to_tp(self.lora_a, self.group)
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(F.linear(self.dropout(x), a), self.lora_b)


class LoRARowParallelLinear(_LoRALinear):
    def __init__(self, base: RowParallelLinear, adapter: AdapterSpec):
        rows, cols = base.weight.shape
        super().__init__(base, (adapter.rank, cols), (rows, adapter.rank), adapter)

    def forward(self, x_split):
        b = copy_to_tp(self.lora_b, self.group)
        lora = F.linear(F.linear(self.dropout(x_split), self.lora_a), b)
        partial = F.linear(x_split, self.weight) + self.scaling * lora
        y = reduce_from_tp(partial, self.group)
        return y if self.bias is None else y + self.bias


def lora_targets(text: str, spec: ModelSpec) -> tuple[str, ...]:
    """--lora-targets: canonical modules (`attn.q,attn.v`) or Megatron-core's (`linear_qkv,linear_fc1`, each the
    canonical modules it fuses; linear_fc1 of a model without a gate is mlp.up)."""
    out = []
    for name in filter(None, (t.strip() for t in str(text).split(","))):
        module = megatron_module(name)
        parts = CANONICAL[module] if module else (name,)
        out += [p for p in parts if not (module and p == "mlp.gate" and not spec.gated_mlp)]
    if not out:
        raise InteropError("--lora-targets names no module (e.g. attn.q,attn.v or linear_qkv,linear_proj)")
    return tuple(out)


def shared_groups(spec: ModelSpec, adapter: AdapterSpec) -> list[tuple[str, ...]]:
    """The fused modules' parts the adapter adapts (those the base has), for one A each; a fused module adapted
    in part is refused (one A for q alone is no fused LoRA)."""
    have = {found[1] for found in map(target_of, (p.name for p in param_table(spec))) if found}
    groups = []
    for group in FUSED:
        present = tuple(t for t in group if t in have)
        adapted = tuple(t for t in present if t in adapter.targets)
        if adapted and adapted != present:
            raise InteropError(f"--lora-shared-a: {', '.join(present)} are one fused linear with one A; the adapter "
                               f"adapts only {', '.join(adapted)} (adapt all of them, or drop --lora-shared-a)")
        if len(adapted) > 1:
            groups.append(adapted)
    return groups


def settle_shared_a(adapter: AdapterSpec, spec: ModelSpec, read_a, flag: bool | None, where) -> AdapterSpec:
    """The adapter with its `shared_a` fact settled: as it states (a --lora-shared-a / --no-lora-shared-a `flag`
    saying otherwise is refused, naming both); an older adapter that does not state it has an A per projection
    where some fused group's A's differ (`read_a(name)` reads one A whole), else (all equal) the flag must say."""
    stated = adapter.shared_a
    option = "--lora-shared-a" if flag else "--no-lora-shared-a"
    if stated is None:
        groups = adapter.fused_a(spec)
        differ = next(((g[0], n) for g in groups for n in g[1:] if not torch.equal(read_a(g[0]), read_a(n))), None)
        if not groups:
            stated = bool(flag)  # nothing to share: the fact is moot
        elif differ is not None:
            stated = False
            if flag:
                raise InteropError(f"--lora-shared-a contradicts {where}: its {differ[1]} differs from {differ[0]}, "
                                   "so its A's are separate (drop --lora-shared-a)")
        elif flag is None:
            raise InteropError(f"{where}: the adapter does not say whether q, k, v (gate, up) share one A, and its "
                               "A's are equal: give --lora-shared-a (one A, as a fused linear's LoRA) or "
                               "--no-lora-shared-a (an A each)")
        else:
            stated = flag
    elif flag is not None and flag != stated:
        raise InteropError(f"{option} contradicts {where}: its adapter states shared_a {str(stated).lower()} "
                           f"({'one A per fused module' if stated else 'an A per projection'}); drop {option}")
    return replace(adapter, shared_a=stated)


def check_trainable(spec: ModelSpec, adapter: AdapterSpec, layout: ParallelLayout) -> None:
    """Refuse, in one line, an adapter the trainer cannot train on this base and layout."""
    adapter.check_base(spec)
    if adapter.shared_a:
        shared_groups(spec, adapter)
    if spec.is_moe or spec.is_mla:
        raise InteropError("the reference trainer trains LoRA adapters on dense models with multi-head attention "
                           f"(this {spec.arch} model has {'experts' if spec.is_moe else 'multi-latent attention'})")
    other = [t for t in adapter.targets if t not in TARGETS]
    if other:
        raise InteropError(f"the reference trainer adapts {', '.join(TARGETS)}; not {', '.join(other)}")
    if adapter.layers is not None and not set(adapter.layers) & set(layout.layers_of_stage(0)):
        raise InteropError(f"LoRA adapts no layer of the first pipeline stage (layers {layout.layers_of_stage(0)}): "
                           "a frozen first stage has nothing to train; adapt one of its layers or use fewer stages")


def attach(stage: nn.Module, adapter: AdapterSpec) -> list[str]:
    """Swap the stage's adapted linears for LoRA ones and freeze everything else; returns the adapter's tensor
    names on this stage (its trainable parameters, in the stage's parameter order; with `adapter.shared_a` the parts of a
    fused module name one A Parameter)."""
    for name, module in list(stage.named_modules()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or not adapter.adapts(name + ".weight"):
            continue
        kind = LoRAColumnParallelLinear if isinstance(module, ColumnParallelLinear) else LoRARowParallelLinear
        parent, _, child = name.rpartition(".")
        setattr(stage.get_submodule(parent), child, kind(module, adapter))
    for group in shared_groups(stage.spec, adapter) if adapter.shared_a else ():
        for i in stage.layers:
            first, *others = (stage.get_submodule(f"layers.{i}.{t}") for t in group)
            for module in others:
                module.lora_a = first.lora_a
    trainable = set()
    for name in adapter.index(stage.spec):
        if name.startswith(tuple(f"layers.{i}." for i in stage.layers)):
            trainable.add(name)
    names = []
    for name, p in stage.named_parameters(remove_duplicate=False):
        p.requires_grad_(name in trainable)
        if name in trainable:
            names.append(name)
    if len(names) != len(trainable):
        missing = sorted(trainable - set(names))[0]
        raise InteropError(f"LoRA tensor {missing}: the trainer's model has no linear it adapts")
    return names


def fresh_tensors(spec: ModelSpec, adapter: AdapterSpec, seed: int) -> dict[str, torch.Tensor]:
    """A new adapter, drawn whole in canonical order from `seed`: A uniform in +-1/sqrt(in) (PEFT's
    kaiming_uniform_(a=sqrt(5))), B zero (the adapted model starts equal to the base); with `adapter.shared_a` a fused
    module's parts take its first part's A."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for p in adapter.params(spec):
        if p.name.endswith(".lora_a"):
            bound = 1.0 / math.sqrt(p.shape[1])
            out[p.name] = (torch.rand(p.shape, generator=gen) * 2 - 1) * bound
        else:
            out[p.name] = torch.zeros(p.shape)
    for group in shared_groups(spec, adapter) if adapter.shared_a else ():
        for i in range(spec.num_layers):
            first = f"layers.{i}.{group[0]}.lora_a"
            for t in group[1:] if first in out else ():
                out[f"layers.{i}.{t}.lora_a"] = out[first].clone()
    return out


def init_adapter(spec: ModelSpec, adapter: AdapterSpec, dst, seed: int = 1234) -> Path:
    """Write a fresh adapter (`fresh_tensors`) for base `spec` as a common-format adapter at tp 1, pp 1."""
    layout = ParallelLayout.build(spec.num_layers)
    tensors = fresh_tensors(spec, adapter, seed)
    metas = [TensorMeta(name, torch.float32, tuple(t.shape)) for name, t in tensors.items()]
    with atomic_directory(dst) as tmp:
        writer = StoreWriter(tmp, spec, layout, metas, adapter=adapter)
        try:
            for name, tensor in tensors.items():
                writer.write(name, tensor)
            writer.finish({"init": {"seed": seed}})
        except BaseException:
            writer.abort()
            raise
    return Path(dst)

