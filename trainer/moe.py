"""A mixture-of-experts MLP: router, top-k experts spread over expert-parallel ranks, shared expert.

Follow one micro-batch through `MoE.forward` (T tokens on this rank):
  1. the router scores every token against every expert and picks `moe_topk` of them
     (`route`); the T*k (token, expert) assignments are sorted by expert;
  2. expert parallelism: expert e lives on ep rank e // (E / ep), so the sorted rows are
     sent to their experts' ranks with one all-to-all (`all_to_all_single`, which gloo
     has on CPU and NCCL on GPU), after a first all-to-all of the per-expert counts;
  3. each local expert runs on its rows (a SwiGLU/GeLU MLP split over tp like the dense
     one, so one tp all-reduce covers all of them), and a second all-to-all sends the
     outputs back;
  4. each token sums its k outputs weighted by its routing probabilities, plus the
     shared expert (Qwen2-MoE: scaled by sigmoid(shared_gate(x))).
The all-to-all's backward is the reverse all-to-all, so gradients stay exact: an
expert's weight gradient sums the contributions of every token routed to it, whichever
rank the token came from.

Parameter names are the canonical ones (`mlp.router.weight`, `mlp.experts.{e}.up.weight`
with the global expert number e, `mlp.shared.*`, `mlp.shared_gate.weight`).  DeepSeek's
`router.expert_bias` is a buffer, not a parameter: used for the choice of experts only, and
moved after each update by Megatron's aux-loss-free rule (`update_expert_bias`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from interop.spec import ModelSpec

from .activations import activate
from .tp import copy_to_tp, reduce_from_tp


def route(logits: torch.Tensor, spec: ModelSpec, expert_bias: torch.Tensor | None = None):
    """Router logits [T, E] -> (weights [T, k], experts [T, k]).

    softmax: softmax over all experts, then top-k, renormalised when `moe_norm_topk`
    (Mixtral; equal to Megatron's top-k of the logits then softmax over the k) or not
    (Qwen2-MoE norm_topk_prob False).  sigmoid (DeepSeek-V3): top-k of sigmoid scores, plus
    `expert_bias` for the choice only, the chosen unbiased scores renormalised (k > 1).
    """
    k = spec.moe_topk
    if spec.moe_router_score == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if spec.moe_groups is not None:
        choice = limit_groups(choice, spec)
    experts = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(1, experts)
    if spec.moe_norm_topk and (spec.moe_router_score == "softmax" or k > 1):
        # Megatron adds 1e-20 to the sigmoid sum (a no-op in fp32 for any real sum)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.moe_routed_scaling != 1.0:  # DeepSeek's routed_scaling_factor
        weights = weights * spec.moe_routed_scaling
    return weights.to(logits.dtype), experts


def limit_groups(choice: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Group-limited routing: experts outside each token's `moe_group_topk` best groups made unchoosable.
    A group scores the sum of its two best choice scores ("top2": DeepSeek-V3, transformers' and megatron-core's
    group_limited_topk with topk / group_topk = 2) or its best ("max": DeepSeek-V2's group_limited_greedy)."""
    T, E = choice.shape
    grouped = choice.view(T, spec.moe_groups, E // spec.moe_groups)
    if spec.moe_group_score == "top2":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    kept = torch.topk(group_scores, spec.moe_group_topk, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return choice.masked_fill(~mask.repeat_interleave(E // spec.moe_groups, dim=1), float("-inf"))


def load_balancing_loss(logits: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Megatron's auxiliary load-balancing loss of one MoE layer on one micro-batch (T tokens):

        aux = coeff * E / (k * T^2) * sum_e (sum_t p_te) * n_e

    as megatron-core 0.16.1 `moe_utils.switch_load_balancing_loss_func` with the scores of
    `compute_routing_scores_for_aux_loss`: p = softmax of the logits over all E experts
    (sigmoid: sigmoid normalised over E), n_e = how many of the T tokens chose expert e in the
    top-k of p (no expert bias).  T counts this micro-batch's tokens on this rank (Megatron
    reduces the counts over tp x cp only, where each rank holds part of the sequence; here
    every tp rank holds the whole sequence, which is the same sum).  Each MoE layer adds its
    own aux to the objective, with the LM loss's 1 / micro-batches scale (Megatron's
    MoEAuxLossAutoScaler); the logged loss stays the LM loss.

    HF's differs (transformers' Mixtral / Qwen2-MoE `load_balancing_loss_func`, added as
    `router_aux_loss_coef * aux` when `output_router_logits`): it pools all layers' tokens
    into one E * sum_e f_e P_e with f_e = n_e / (L * T) not divided by k (k times Megatron's
    per-layer value for one layer) and cross-layer terms when L > 1, over the whole forward
    batch rather than per micro-batch.
    """
    E, k = spec.num_experts, spec.moe_topk
    if spec.moe_router_score == "softmax":
        p = torch.softmax(logits.float(), dim=-1)
    else:
        p = torch.sigmoid(logits.float())
        p = p / (p.sum(dim=-1, keepdim=True) + 1e-20)
    tokens = p.shape[0]
    chosen = torch.zeros_like(p).scatter(1, torch.topk(p, k, dim=-1).indices, 1.0)
    return (p.sum(0) * chosen.sum(0)).sum() * (E * spec.moe_aux_loss_coeff / (k * tokens * tokens))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activations; the backward pass also starts the aux loss's, with gradient `scale`."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class _AllToAll(torch.autograd.Function):
    """Rows split `send` ways out, `recv` ways in; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x, send: list[int], recv: list[int], group):
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class Router(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden))
        # gpt-oss: a bias on the logits (`router.bias`), for the choice and the weights alike
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.moe_router_logit_bias else None
        if spec.moe_router_bias:
            self.register_buffer("expert_bias", torch.zeros(spec.num_experts))
            # tokens each expert was chosen for since the last update (this rank's micro-batches)
            self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts), persistent=False)
        else:
            self.expert_bias = None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Expert(nn.Module):
    """One routed expert's tp shard, without the tp reduction (`MoE` does one for all experts, then adds each
    expert's down bias once: gpt-oss's experts have biases, gate / up split over tp, down's whole)."""

    def __init__(self, spec: ModelSpec, tp: int):
        super().__init__()
        h, f, bias = spec.hidden, spec.moe_ffn_hidden // tp, spec.has_mlp_bias
        self.spec = spec
        if spec.gated_mlp:
            self.gate = nn.Linear(h, f, bias=bias)
        self.up = nn.Linear(h, f, bias=bias)
        self.down = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        y = activate(self.spec, self.gate(x) if self.spec.gated_mlp else None, self.up(x))
        return F.linear(y, self.down.weight)  # down.bias: after the tp reduction (MoE._routed)


class MoE(nn.Module):
    """The MLP of a MoE layer on one rank: the router, this ep rank's experts, the shared expert."""

    def __init__(self, spec: ModelSpec, grid, shared_mlp):
        super().__init__()
        self.spec, self.tp_group, self.ep_group = spec, grid.tp_group, grid.ep_group
        self.ep = grid.ep
        per_rank = spec.num_experts // grid.ep
        self.local = range(grid.ep_rank * per_rank, (grid.ep_rank + 1) * per_rank)
        self.router = Router(spec)
        self.experts = nn.ModuleDict({str(e): Expert(spec, grid.tp) for e in self.local})
        if spec.shared_expert_ffn_hidden is not None:
            self.shared = shared_mlp
            if spec.shared_expert_gate:
                self.shared_gate = nn.Linear(spec.hidden, 1, bias=False)
        self.aux_scale = 1.0  # the LM loss's scale, 1 / micro-batches (set by the training loop)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        weights, experts = route(logits, self.spec, self.router.expert_bias)
        if self.router.expert_bias is not None and self.training and torch.is_grad_enabled():
            self.router.tokens_per_expert += torch.bincount(experts.reshape(-1), minlength=self.spec.num_experts)
        y = self._routed(x, experts)  # [T, k, h]
        out = (y * weights.unsqueeze(-1)).sum(1)
        if hasattr(self, "shared"):
            shared = self.shared(x)
            if hasattr(self, "shared_gate"):
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        if self.spec.moe_aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, load_balancing_loss(logits, self.spec), self.aux_scale)
        return out.reshape(shape)

    def _routed(self, x, experts):
        """Every token's k expert outputs [T, k, h], the experts wherever they live."""
        T, k = experts.shape
        E, P = self.spec.num_experts, self.ep
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert (so by ep rank)
        rows = x[order // k]
        counts = torch.bincount(flat, minlength=E)
        if P == 1:
            received, local_counts = rows, counts.reshape(1, E)
        else:
            # counts[r*E/P + j]: how many rows I send to expert j of rank r; receive the counts of my experts
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.ep_group)
            local_counts = got.reshape(P, E // P)  # [source rank, my expert]
            send = counts.reshape(P, E // P).sum(1).tolist()
            recv = local_counts.sum(1).tolist()
            received = _AllToAll.apply(rows, send, recv, self.ep_group)
        # received is grouped by source rank, then expert: regroup by expert for the matmuls
        by_expert = _source_major_to_expert_major(local_counts)
        inputs = copy_to_tp(received[by_expert], self.tp_group)
        sizes = local_counts.sum(0).tolist()
        outputs = [self.experts[str(e)](chunk) for e, chunk in zip(self.local, inputs.split(sizes))]
        y = reduce_from_tp(torch.cat(outputs), self.tp_group)  # one tp all-reduce for every local expert
        if self.spec.has_mlp_bias:  # each expert's down bias, once per row it computed
            y = y + torch.cat([self.experts[str(e)].down.bias.expand(n, -1) for e, n in zip(self.local, sizes)])
        y = y[torch.argsort(by_expert)]  # back to source-major order
        if P > 1:
            y = _AllToAll.apply(y, recv, send, self.ep_group)
        return y[torch.argsort(order)].reshape(T, k, -1)


def _source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """counts [sources, experts] of rows laid out source by source (each source's rows by expert) ->
    the row indices that lay them out expert by expert (each expert's rows by source)."""
    sources, experts = counts.shape
    expert_of_row = torch.arange(experts, device=counts.device).repeat(sources).repeat_interleave(counts.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


def update_expert_bias(module: nn.Module, rate: float, dp_group) -> None:
    """Megatron's aux-loss-free balancing, once per update (megatron-core 0.16.1 finalize_model_grads
    `_update_router_expert_bias` -> moe_utils `get_updated_expert_bias`): with n_e the tokens routed to
    expert e over the whole global batch, bias_e += rate * sign(mean(n) - n_e).  Megatron sums n over
    tp x dp; here the tp ranks hold the same tokens, so the dp sum gives the same signs."""
    for m in module.modules():
        if isinstance(m, Router) and m.expert_bias is not None:
            counts = m.tokens_per_expert
            if dp_group is not None:
                dist.all_reduce(counts, group=dp_group)
            with torch.no_grad():
                m.expert_bias += torch.sign(counts.mean() - counts) * rate
            counts.zero_()


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Scale the aux losses' gradients like the LM loss's (1 / micro-batches), for every MoE layer."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_scale = scale
