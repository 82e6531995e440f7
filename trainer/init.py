"""A fresh, randomly initialised checkpoint in the common format, for a ModelSpec and a seed.

GPT-2's scheme: matrices ~ N(0, 0.02), the residual projections (attn.o, mlp.down, the experts' down)
scaled by 1/sqrt(2 * layers), norm weights 1 (the sandwich's post norms: their ModelSpec scale), biases 0, vocabulary padding rows 0.  Tensors are drawn one at a
time from one generator in the canonical table's order, so the same spec and seed
give the same weights on any machine, independent of any later layout.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import yaml

from interop.atomic import atomic_directory
from interop.errors import InteropError
from interop.io import bounded_yaml
from interop.io.small_files import read_small_text
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreWriter
from interop.tensors import TensorMeta


def read_spec(path) -> ModelSpec:
    """A ModelSpec from a YAML or JSON file holding its fields (arch, num_layers, hidden, ...)."""
    path = Path(path)
    try:
        data = bounded_yaml.safe_load(read_small_text(path, "model spec"))
    except (yaml.YAMLError, RecursionError) as exc:
        raise InteropError(f"{path}: cannot read the model spec ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a mapping of ModelSpec fields")
    return ModelSpec.from_dict(data, where=str(path))


def init_tensor(name: str, shape, spec: ModelSpec, gen: torch.Generator) -> torch.Tensor:
    if name.endswith((".bias", ".expert_bias")):  # the router's expert bias starts at 0, as in Megatron
        return torch.zeros(shape)
    if "norm" in name:  # the sandwich's post norms start at their scale (MindSpeed's get_norm: ones * scale)
        scale = {"attn_post_norm": spec.attn_post_norm_scale, "mlp_post_norm": spec.mlp_post_norm_scale}.get(
            name.split(".")[-2])
        return torch.ones(shape) * (1.0 if scale is None else scale)
    std = 0.02
    if name.endswith(("attn.o.weight", "down.weight")):  # residual projections: the MLP's, experts', shared expert's
        std /= math.sqrt(2 * spec.num_layers)
    out = torch.randn(shape, generator=gen) * std
    if name in ("embed.word.weight", "lm_head.weight"):
        out[spec.vocab:] = 0.0  # padding rows: never looked up, masked out of the loss
    return out


def init_checkpoint(spec: ModelSpec, dst, seed: int = 1234, force: bool = False) -> Path:
    """Write a fresh checkpoint of `spec` to `dst` (atomically) at tp=1, pp=1."""
    layout = ParallelLayout.build(spec.num_layers)
    gen = torch.Generator().manual_seed(seed)
    metas = [TensorMeta(p.name, torch.float32, p.shape) for p in param_table(spec)]
    with atomic_directory(dst, force=force) as tmp:
        writer = StoreWriter(tmp, spec, layout, metas)
        try:
            for p in param_table(spec):
                writer.write(p.name, init_tensor(p.name, p.shape, spec, gen))
            writer.finish({"init": {"seed": seed}})
        except BaseException:
            writer.abort()
            raise
    return Path(dst)
