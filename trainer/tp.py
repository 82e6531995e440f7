"""Tensor-parallel building blocks (Megatron-style, no sequence parallelism).

Every tp rank of a stage sees the same full hidden states.  A column-parallel
linear holds a slice of the output rows, so its output is split across ranks;
a row-parallel linear holds the matching slice of input columns and all-reduces
its partial products.  Attention (split by heads) and the MLP (split by ffn
columns) therefore need exactly one all-reduce each in the forward pass and one
in the backward pass.  The word embedding and the output head are split by
vocabulary rows; the cross entropy is computed without ever gathering the logits.

With tp == 1 (group None) every communication is skipped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    """Forward: identity (every rank uses the same input).  Backward: sum the ranks' input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum the ranks' partial results.  Backward: identity (each rank's part got the same gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: join the ranks' slices of the last dimension.  Backward: each rank keeps its own slice's gradient
    (megatron-core's gather_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        part = grad.shape[-1] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[..., rank * part:(rank + 1) * part].contiguous(), None


def gather_from_tp(x, group):
    return x if group is None else _GatherFromTP.apply(x, group)


def copy_to_tp(x, group):
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r, W_r = rows [r*out/tp, (r+1)*out/tp) of the global [out, in] weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: int, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b, W_r = columns [r*in/tp, (r+1)*in/tp); the bias is replicated, added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: int, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x_split):
        y = reduce_from_tp(F.linear(x_split, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, start + V/tp) of the padded vocabulary; others' tokens look up zeros."""

    def __init__(self, padded_vocab: int, hidden: int, tp: int, tp_rank: int, group):
        super().__init__()
        self.group = group
        self.part = padded_vocab // tp
        self.start = tp_rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, hidden))

    def forward(self, tokens):
        if self.group is None:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.part)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy over tokens, from logits split by vocabulary across the tp ranks.

    loss_i = log(sum_v exp(z_iv)) - z_i,target: the max, the sum of exponentials and the
    target logit are each reduced across ranks, so the full logits never exist anywhere.
    Columns of the padded vocabulary (global index >= true vocab) are masked to -inf,
    so padding never changes the loss.  Gradient: (softmax - onehot) / n_tokens.
    """

    @staticmethod
    def forward(ctx, logits, target, start, true_vocab, group):
        ctx.dtype = logits.dtype
        logits = logits.float()
        n, part = logits.shape
        cols = torch.arange(start, start + part, device=logits.device)
        if start + part > true_vocab:
            logits = logits.masked_fill(cols >= true_vocab, float("-inf"))
        zmax = logits.max(dim=1, keepdim=True).values
        _all_reduce(zmax, group, dist.ReduceOp.MAX)
        shifted = logits - zmax
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=1, keepdim=True), group)
        local_t = target - start
        mine = (local_t >= 0) & (local_t < part)
        picked = shifted.gather(1, local_t.clamp(0, part - 1).unsqueeze(1)).squeeze(1)
        target_logit = _all_reduce(picked.masked_fill(~mine, 0.0), group)
        loss = (sum_exp.squeeze(1).log() - target_logit).mean()
        ctx.save_for_backward(exp, sum_exp, local_t, mine)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_t, mine = ctx.saved_tensors
        grad = exp / sum_exp
        rows = torch.arange(grad.shape[0], device=grad.device)[mine]
        grad[rows, local_t[mine]] -= 1.0
        grad *= grad_loss / grad.shape[0]
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, start: int, true_vocab: int, group):
    """logits [n, V/tp] (this rank's vocabulary slice), target [n] global ids -> scalar mean loss."""
    if group is None:  # one rank holds the whole vocabulary: torch's fused kernel on the true columns
        return F.cross_entropy(logits[:, :true_vocab].float(), target)
    return _VocabParallelCrossEntropy.apply(logits, target, start, true_vocab, group)
