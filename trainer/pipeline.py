"""The pipeline schedule: GPipe (all forwards, then all backwards) with send/recv between stages.

For each micro-batch, stage p receives the hidden states [mbs, seq, hidden] from stage
p-1 (the first stage reads tokens instead), runs its layers and sends the result to
stage p+1; the last stage computes the loss.  Then, micro-batch by micro-batch in the
same order, the last stage back-propagates its loss and every stage sends the gradient
of its input back to the previous one.  Sends and receives are matched in order on
both sides, so the blocking point-to-point calls cannot deadlock.

Each micro-batch's loss is divided by the number of micro-batches, so the gradients
summed over micro-batches are those of the mean loss over the step's batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def train_step(stage, grid, micro_batches, hidden_shape, device=None) -> torch.Tensor | None:
    """Forward and backward over `micro_batches` [(tokens, targets)]; returns the mean loss on the last stage."""
    prev = grid.stage_rank(grid.pp_rank - 1) if not grid.first_stage else None
    nxt = grid.stage_rank(grid.pp_rank + 1) if not grid.last_stage else None
    n = len(micro_batches)
    inputs, outputs, losses = [], [], []
    for tokens, targets in micro_batches:
        if grid.first_stage:
            x = tokens
        else:
            x = torch.empty(hidden_shape, device=device)
            dist.recv(x, src=prev)
            x.requires_grad_()
        y = stage(x, targets if grid.last_stage else None)
        if grid.last_stage:
            losses.append(y.detach())
            y = y / n
        else:
            dist.send(y.detach().contiguous(), dst=nxt)
        inputs.append(x)
        outputs.append(y)
    for x, y in zip(inputs, outputs):
        if grid.last_stage:
            y.backward()
        else:
            grad = torch.empty(hidden_shape, device=device)
            dist.recv(grad, src=nxt)
            y.backward(grad)
        if not grid.first_stage:
            dist.send(x.grad.contiguous(), dst=prev)
    return torch.stack(losses).mean() if losses else None
