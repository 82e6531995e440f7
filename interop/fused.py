"""Fused tensor layouts and their inverses, as small pure functions.

Converters store canonical tensors unfused; these functions build and undo the
fused forms foreign formats use.  Each works on weights ([rows, in]) and on 1-D
biases alike, and on one TP rank's slice as well as on the whole tensor (a TP rank
holds whole query groups, so its fused block is the fusion of its own q, k, v).
"""
from __future__ import annotations

import torch


def fuse_qkv_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's fused QKV: per query group, that group's q heads, then its k head, then its v head."""
    rest = q.shape[1:]
    qg = q.reshape(groups, -1, *rest)
    kg = k.reshape(groups, -1, *rest)
    vg = v.reshape(groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv_grouped(fused: torch.Tensor, groups: int, heads: int, head_dim: int):
    """Inverse of `fuse_qkv_grouped`: (q, k, v) from the per-group fused rows."""
    rest = fused.shape[1:]
    per_group_q = heads // groups * head_dim
    g = fused.reshape(groups, per_group_q + 2 * head_dim, *rest)
    q = g[:, :per_group_q].reshape(-1, *rest)
    k = g[:, per_group_q:per_group_q + head_dim].reshape(-1, *rest)
    v = g[:, per_group_q + head_dim:].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_concat(*parts: torch.Tensor) -> torch.Tensor:
    """Plain concatenation along the output axis (HF GPT2 c_attn [q|k|v], Megatron fc1 [gate; up])."""
    return torch.cat(parts, dim=0)


def split_concat(fused: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Inverse of `fuse_concat` given each part's number of rows."""
    return [p.contiguous() for p in torch.split(fused, sizes, dim=0)]


def interleave_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows a0, b0, a1, b1, ... (MindFormers' w_gate_hidden with gate and up interleaved)."""
    return torch.stack([a, b], dim=1).reshape(-1, *a.shape[1:])


def deinterleave_rows(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_rows`."""
    pairs = fused.reshape(-1, 2, *fused.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
