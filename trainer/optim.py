"""The update rule: AdamW, a warmup + decay learning-rate schedule, global-norm gradient clipping.

Written once and used by every framework in a parity run (the reference trainer at
any layout and the single-process HF run), so that differences in losses come from
the models, never from two readings of "the same" optimizer.

- AdamW is `torch.optim.AdamW` (decoupled weight decay, state `exp_avg` /
  `exp_avg_sq` / `step`).  Matrices (weights, embeddings) are decayed; vectors
  (biases, norm weights) are not, as in Megatron.  AdamW is element-wise, so a
  tensor-parallel shard's update equals the same slice of the full tensor's update.
- `lr_at(step)` is the rate for update number `step` (1-based): linear warmup from
  lr/warmup to lr over `warmup` updates, then linear or cosine decay to `min_lr`
  at `decay_steps`, constant after.
- Clipping scales every gradient by min(1, clip / (norm + 1e-6)), with the norm
  taken over the whole model (like `torch.nn.utils.clip_grad_norm_`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interop.errors import InteropError

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 0
    decay_steps: int | None = None  # None: decay over the whole run
    decay_style: str = "cosine"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise InteropError(f"lr decay style must be one of {DECAY_STYLES}, got {self.decay_style!r}")
        if self.lr < 0 or self.min_lr < 0 or self.warmup < 0:
            raise InteropError("lr, min_lr and warmup must be >= 0")


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of update number `step` (1-based)."""
    if cfg.warmup and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    if cfg.decay_style == "constant":
        return cfg.lr
    end = cfg.decay_steps or total_steps
    if step >= end or end <= cfg.warmup:
        return cfg.min_lr
    ratio = (step - cfg.warmup) / (end - cfg.warmup)
    if cfg.decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def make_adamw(named_params, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for _, p in named_params:
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(grads: list[tuple[torch.Tensor, bool]], max_norm: float, reduce_groups=(), device=None) -> float:
    """Clip in place; returns the global norm before clipping.

    `grads` is (gradient, counted) pairs: a gradient held by several ranks (a replicated
    tensor on every tp rank, the tied head's copy of the embedding) is counted on one.
    `reduce_groups` are the process groups whose partial sums make up the whole model.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, counted in grads:
        if counted:
            total += g.double().pow(2).sum()
    for group in reduce_groups:
        if group is not None:
            dist.all_reduce(total, group=group)
    norm = float(total.sqrt())
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for g, _ in grads:
                g.mul_(coef)
    return norm
