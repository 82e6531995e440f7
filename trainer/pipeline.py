"""The pipeline schedule: 1F1B (one forward, one backward) with send/recv between stages.

Stage p of pp first runs `pp - p - 1` warm-up forwards (so that the last stage can
start), then alternates one forward with one backward, then drains the remaining
backwards.  At most `pp - p` micro-batches' activations are alive on stage p, not all
of them as in GPipe.  Forwards send hidden states [mbs, seq, hidden] to stage p+1
(the first stage reads tokens instead, the last one computes the loss); backwards
send the gradient of the stage's input to stage p-1.  Where a stage both sends and
receives in one step it posts both at once (`batch_isend_irecv`), so two neighbours
exchanging in opposite directions never wait on each other.

Backwards run in micro-batch order, so gradients accumulate in the same order at
every pp, and each micro-batch's loss is divided by the number of micro-batches:
the summed gradients are those of the step's mean loss.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


class _P2P:
    """Point-to-point transfers with this rank's neighbours in the pipeline (no-ops at the ends)."""

    def __init__(self, grid, shape, device):
        self.grid, self.shape, self.device = grid, shape, device
        self.prev = None if grid.first_stage else grid.stage_rank(grid.pp_rank - 1)
        self.next = None if grid.last_stage else grid.stage_rank(grid.pp_rank + 1)

    def _exchange(self, send=None, send_to=None, recv_from=None):
        ops, buf = [], None
        if send is not None and send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to))
        if recv_from is not None:
            buf = torch.empty(self.shape, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, recv_from))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return buf

    def recv_forward(self):
        x = self._exchange(recv_from=self.prev)
        return x.requires_grad_() if x is not None else None

    def send_forward(self, y):
        self._exchange(send=y, send_to=self.next)

    def recv_backward(self):
        return self._exchange(recv_from=self.next)

    def send_backward(self, dx):
        self._exchange(send=dx, send_to=self.prev)

    def send_forward_recv_backward(self, y):
        return self._exchange(send=y, send_to=self.next, recv_from=self.next)

    def send_backward_recv_forward(self, dx):
        x = self._exchange(send=dx, send_to=self.prev, recv_from=self.prev)
        return x.requires_grad_() if x is not None else None


def train_step(stage, grid, micro_batches, hidden_shape, device=None) -> torch.Tensor | None:
    """Forward and backward over `micro_batches` [(tokens, targets)]; returns the mean loss on the last stage."""
    n = len(micro_batches)
    p2p = _P2P(grid, hidden_shape, device)
    inputs, outputs, losses = deque(), deque(), []

    def forward(i, x):
        tokens, targets = micro_batches[i]
        x = tokens if grid.first_stage else x
        y = stage(x, targets, tokens) if grid.last_stage else stage(x)  # the last stage's MTP modules embed tokens
        if grid.last_stage:
            losses.append(y.detach())
            y = y / n
        inputs.append(x)
        outputs.append(y)
        return y

    def backward(grad):
        x, y = inputs.popleft(), outputs.popleft()
        y.backward() if grid.last_stage else y.backward(grad)
        return None if grid.first_stage else x.grad

    warmup = min(grid.pp - grid.pp_rank - 1, n)
    for i in range(warmup):
        p2p.send_forward(forward(i, p2p.recv_forward()))
    x = p2p.recv_forward() if warmup < n else None
    for i in range(warmup, n):  # steady state: one forward, one backward
        grad = p2p.send_forward_recv_backward(forward(i, x))
        dx = backward(grad)
        if i == n - 1:
            p2p.send_backward(dx)
        else:
            x = p2p.send_backward_recv_forward(dx)
    for _ in range(warmup):  # cool-down: the backwards still owed
        p2p.send_backward(backward(p2p.recv_backward()))
    return torch.stack(losses).mean() if losses else None
