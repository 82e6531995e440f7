"""Multi-latent attention (DeepSeek-V2/V3) over this rank's heads, with its YaRN rope.

Follow one token (h wide) through `MLAttention.forward`:
  1. q: `q_down` (h -> q_lora_rank, replicated), its RMSNorm, `q_up` (-> heads x (nope + rope), split by heads);
     without q compression one `q` projection (split by heads);
  2. k/v: `kv_down` (h -> kv_lora_rank + rope, replicated): the latent, RMSNorm'd, goes through `kv_up`
     (-> heads x (nope + v), split by heads); the rope part is one key shared by every head;
  3. the rope parts of q and k rotate (pairs (x0, x1), (x2, x3), ... with `rope_interleave`, as DeepSeek's
     weights are laid out; else the two halves), then each head attends with q = [nope; rope],
     k = [k_nope; shared rope key], scaled by 1/sqrt(nope + rope) times YaRN's mscale(mscale_all_dim)^2;
  4. `o` (heads x v -> h, split by heads, reduced over tp).
The replicated compressions get their full gradient on every tp rank: `q_up` / `kv_up` sum their input
gradients over tp (ColumnParallelLinear), and the shared rope key's is summed by `copy_to_tp`.
The same computation as transformers 5.24's DeepseekV3Attention / DeepseekV2Attention (eager).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from interop.spec import ModelSpec

from .tp import ColumnParallelLinear, RowParallelLinear, copy_to_tp


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn_get_mscale (transformers' get_mscale): 0.1 * mscale * ln(scale) + 1 above scale 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, scaling: dict, device=None):
    """(inverse frequencies, attention factor on cos / sin) of YaRN, as transformers' _compute_yarn_parameters
    (correction range truncated to whole dimensions unless `truncate` is false: gpt-oss): frequencies below beta_slow rotations over the original context are
    interpolated by `factor`, above beta_fast kept, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_positions"]
    mscale, mscale_all = scaling["mscale"], scaling["mscale_all_dim"]
    attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all \
        else yarn_mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
                       / ((high + 0.001 if low == high else high) - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention


def softmax_scale(spec: ModelSpec) -> float:
    """1/sqrt(q/k head), times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = spec.head_dim ** -0.5
    scaling = spec.rope_scaling
    if scaling is not None and scaling["type"] == "yarn" and scaling["mscale_all_dim"]:
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def rotate(x, cos, sin, interleaved: bool):
    """Rope on x [b, heads, s, d] with cos / sin [s, d] (each frequency twice, halves layout).
    interleaved: pairs (x0, x1), (x2, x3), ... rotate, the output in halves (transformers'
    apply_rotary_pos_emb_interleave; DeepSeek-V2's complex rotation); else rotate-half."""
    if interleaved:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LatentRMSNorm(nn.Module):
    """RMSNorm of a compression (q or kv latent), replicated: eps 1e-6 as transformers' DeepseekV3RMSNorm default
    (its q_a_layernorm / kv_a_layernorm are built without the config's rms_norm_eps)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)


class MLAttention(nn.Module):
    """Causal multi-latent attention over this rank's heads (heads / tp)."""

    def __init__(self, spec: ModelSpec, grid):
        super().__init__()
        h, tp, g = spec.hidden, grid.tp, grid.tp_group
        self.spec, self.tp_group = spec, g
        self.heads, self.nope, self.rope_dim, self.v = spec.heads // tp, spec.qk_nope_head_dim, \
            spec.qk_rope_head_dim, spec.v_head_dim
        self.latent = spec.kv_lora_rank
        qk = spec.heads * spec.head_dim
        if spec.q_lora_rank is None:
            self.q = ColumnParallelLinear(h, qk, False, tp, g)
        else:
            self.q_down = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_down_norm = LatentRMSNorm(spec.q_lora_rank)
            self.q_up = ColumnParallelLinear(spec.q_lora_rank, qk, False, tp, g)
        self.kv_down = nn.Linear(h, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=False)
        self.kv_down_norm = LatentRMSNorm(spec.kv_lora_rank)
        self.kv_up = ColumnParallelLinear(spec.kv_lora_rank, spec.heads * (self.nope + self.v), False, tp, g)
        self.o = RowParallelLinear(spec.heads * self.v, h, spec.linear_bias, tp, g)
        self.scale = softmax_scale(spec)

    def forward(self, x, rope, mask=None):
        b, s, _ = x.shape
        q = self.q(x) if self.spec.q_lora_rank is None else self.q_up(self.q_down_norm(self.q_down(x)))
        q = q.view(b, s, self.heads, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_down(x).split([self.latent, self.rope_dim], dim=-1)
        kv = self.kv_up(self.kv_down_norm(latent)).view(b, s, self.heads, self.nope + self.v).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        k_rope = copy_to_tp(k_rope, self.tp_group).view(b, 1, s, self.rope_dim)  # every rank's heads use it
        cos, sin = rope
        q_rope = rotate(q_rope, cos, sin, self.spec.rope_interleave)
        k_rope = rotate(k_rope, cos, sin, self.spec.rope_interleave)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.heads, -1, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.v))
