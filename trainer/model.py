"""GPT2- and Llama-style decoders, cut into pipeline stages and split by tensor parallelism.

Follow one token: `Embeddings` looks it up (vocab-parallel) and, for GPT2, adds its
learned position; every `Block` applies pre-norm attention then a pre-norm MLP, each
added back to the residual stream; the last stage normalises, multiplies by the
output head (the word embedding when tied) to get this rank's slice of the
vocabulary's logits, and `vocab_parallel_cross_entropy` turns them into the loss.

A MoE layer's MLP is `moe.MoE` (router, this expert-parallel rank's experts, shared expert).

Parameter names are the canonical names of `interop.params` (`layers.3.attn.q.weight`,
global layer numbers), so the checkpoint code maps module parameters to stored
tensors one to one; each tensor holds only this rank's tensor-parallel shard.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.spec import ModelSpec

from .grid import Grid
from .mla import MLAttention, yarn_inv_freq
from .moe import MoE
from .tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp, vocab_parallel_cross_entropy


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (as HF Llama and Megatron do).

    `tp_group`: the norm runs on this rank's heads only (Qwen3's q/k norms), so each rank's weight
    gradient is partial; copy_to_tp sums them in the backward pass, keeping the copies identical.
    """

    def __init__(self, hidden: int, eps: float, tp_group=None):
        super().__init__()
        self.eps, self.tp_group = eps, tp_group
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return copy_to_tp(self.weight, self.tp_group) * x.to(dtype)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden, spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)


def rope_tables(spec: ModelSpec, seq: int, device=None):
    """cos/sin [seq, head_dim] for rotary embeddings, rotate-half convention (HF Llama, Megatron default);
    multi-latent attention rotates its qk_rope_head_dim part only, YaRN scales cos / sin by its attention factor."""
    d = spec.qk_rope_head_dim if spec.is_mla else spec.head_dim
    attention = 1.0
    if spec.rope_scaling is not None and spec.rope_scaling["type"] == "yarn":
        inv_freq, attention = yarn_inv_freq(d, spec.rope_base, spec.rope_scaling, device)
    else:
        inv_freq = 1.0 / (spec.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        if spec.rope_scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, spec.rope_scaling)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention, angles.sin() * attention


def llama3_inv_freq(inv_freq, scaling: dict):
    """Llama-3.x frequencies: long wavelengths slowed by `factor`, short ones kept, the band between blended.

    With wavelength w = 2 pi / f and the original context C: w < C / high_freq_factor keeps f;
    w > C / low_freq_factor becomes f / factor; between, s = (C / w - low) / (high - low) mixes
    (1 - s) * f / factor + s * f.
    """
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_positions"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def attention_mask(spec: ModelSpec, seq: int, device=None):
    """None for plain causal attention; with a sliding window, True where query i may see key j
    (j <= i and i - j < window, as HF Mistral's mask)."""
    if spec.sliding_window is None or spec.sliding_window >= seq:
        return None
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (i - j < spec.sliding_window)


def apply_rope(x, cos, sin):
    """x [b, heads, seq, d]: rotate each (x_i, x_{i+d/2}) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention over this rank's heads (heads/tp query heads, kv_groups/tp kv heads)."""

    def __init__(self, spec: ModelSpec, grid: Grid):
        super().__init__()
        h, d, tp, g = spec.hidden, spec.head_dim, grid.tp, grid.tp_group
        self.heads, self.groups, self.d = spec.heads // tp, spec.kv_groups // tp, d
        self.q = ColumnParallelLinear(h, spec.heads * d, spec.qkv_bias, tp, g)
        self.k = ColumnParallelLinear(h, spec.kv_groups * d, spec.qkv_bias, tp, g)
        self.v = ColumnParallelLinear(h, spec.kv_groups * d, spec.qkv_bias, tp, g)
        self.o = RowParallelLinear(spec.heads * d, h, spec.linear_bias, tp, g)
        self.window = spec.sliding_window
        if spec.qk_norm:  # Qwen3: RMSNorm over each head's d values, before the rotation
            self.q_norm = RMSNorm(d, spec.norm_eps, g)
            self.k_norm = RMSNorm(d, spec.norm_eps, g)

    def forward(self, x, rope, mask=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d)
        k = self.k(x).view(b, s, self.groups, self.d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(b, s, self.groups, self.d).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # GQA: each kv head serves heads/groups query heads (enable_gqa repeats them without a copy)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.groups != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.d))


class MLP(nn.Module):
    """down(act(up(x))), or down(silu(gate(x)) * up(x)) for SwiGLU; ffn columns split over tp.

    `ffn`/`bias` default to the dense MLP's; a MoE layer's shared expert has its own size and no biases."""

    def __init__(self, spec: ModelSpec, grid: Grid, ffn: int | None = None, bias: bool | None = None):
        super().__init__()
        h, tp, g = spec.hidden, grid.tp, grid.tp_group
        f = spec.ffn_hidden if ffn is None else ffn
        bias = spec.has_mlp_bias if bias is None else bias
        self.activation = spec.activation
        if spec.gated_mlp:
            self.gate = ColumnParallelLinear(h, f, bias, tp, g)
        self.up = ColumnParallelLinear(h, f, bias, tp, g)
        self.down = RowParallelLinear(f, h, bias, tp, g)

    def forward(self, x):
        if self.activation == "swiglu":
            y = F.silu(self.gate(x)) * self.up(x)
        elif self.activation == "gelu_tanh":
            y = F.gelu(self.up(x), approximate="tanh")
        else:
            y = F.gelu(self.up(x))
        return self.down(y)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, grid: Grid, moe: bool = False):
        super().__init__()
        self.attn_norm = make_norm(spec)
        self.attn = MLAttention(spec, grid) if spec.is_mla else Attention(spec, grid)
        self.mlp_norm = make_norm(spec)
        if moe:
            shared = spec.shared_expert_ffn_hidden
            self.mlp = MoE(spec, grid, MLP(spec, grid, shared, bias=False) if shared is not None else None)
        else:
            self.mlp = MLP(spec, grid)

    def forward(self, x, rope, mask=None):
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.mlp(self.mlp_norm(x))


class Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec, grid: Grid, with_position: bool):
        super().__init__()
        self.word = VocabParallelEmbedding(spec.padded_vocab, spec.hidden, grid.tp, grid.tp_rank, grid.tp_group)
        if with_position:
            self.position = nn.Embedding(spec.max_positions, spec.hidden)

    def forward(self, tokens):
        x = self.word(tokens)
        if hasattr(self, "position"):
            x = x + self.position.weight[: tokens.shape[1]]
        return x


class Stage(nn.Module):
    """The part of the model one pipeline stage owns.

    First stage: tokens -> hidden states.  Middle: hidden -> hidden.  Last: hidden ->
    loss.  With tied embeddings and pp > 1 the last stage keeps its own copy of
    `embed.word.weight` for the output head; the trainer sums the two copies'
    gradients so they stay identical, and only the first stage's copy is saved.
    """

    def __init__(self, spec: ModelSpec, layout: ParallelLayout, grid: Grid):
        super().__init__()
        check_model_layout(spec, layout)
        self.spec, self.grid = spec, grid
        self.first, self.last = grid.first_stage, grid.last_stage
        if self.first or (self.last and spec.tied_embeddings):
            self.embed = Embeddings(spec, grid, with_position=self.first and spec.position == "learned")
        self.layers = nn.ModuleDict({str(i): Block(spec, grid, spec.is_moe_layer(i))
                                     for i in layout.layers_of_stage(grid.pp_rank)})
        if self.last:
            self.final_norm = make_norm(spec)
            if not spec.tied_embeddings:
                self.lm_head = ColumnParallelLinear(spec.hidden, spec.padded_vocab, False, grid.tp, grid.tp_group)

    def forward(self, x, targets=None):
        """x: token ids [b, s] on the first stage, else hidden states [b, s, h] from the previous stage."""
        if self.first:
            x = self.embed(x)
        rope = rope_tables(self.spec, x.shape[1], x.device) if self.spec.position == "rope" else None
        mask = attention_mask(self.spec, x.shape[1], x.device)
        for block in self.layers.values():
            x = block(x, rope, mask)
        if not self.last:
            return x
        return self.loss(self.final_norm(x), targets)

    def loss(self, x, targets):
        weight = self.embed.word.weight if self.spec.tied_embeddings else self.lm_head.weight
        logits = F.linear(copy_to_tp(x, self.grid.tp_group), weight)
        part = weight.shape[0]
        return vocab_parallel_cross_entropy(logits.reshape(-1, part), targets.reshape(-1),
                                            self.grid.tp_rank * part, self.spec.vocab, self.grid.tp_group)

    def named_tensors(self):
        """The canonical tensors this rank holds: parameters, and the router's expert bias (a buffer)."""
        yield from self.named_parameters()
        for name, buffer in self.named_buffers():
            if name.endswith(".router.expert_bias"):
                yield name, buffer

    def owned(self, name: str) -> bool:
        """Is this rank's copy of `name` the one that is saved and counted (not the tied head's copy)?"""
        return not (name.startswith("embed.") and not self.first)


def check_model_layout(spec: ModelSpec, layout: ParallelLayout) -> None:
    """Refuse layouts the trainer cannot run, with the reason."""
    spec.check_tp(layout.tp)
    if spec.padded_vocab % layout.tp:
        raise InteropError(f"tp={layout.tp} does not divide the padded vocabulary ({spec.padded_vocab})")
    if layout.vpp != 1:
        raise InteropError("the reference trainer runs one chunk per pipeline stage (no virtual pipeline)")
    if layout.num_layers != spec.num_layers:
        raise InteropError(f"layout has {layout.num_layers} layers, the model {spec.num_layers}")
    if spec.position == "rope" and spec.head_dim % 2 and not spec.is_mla:
        raise InteropError(f"rotary embeddings need an even head_dim (got {spec.head_dim})")
    if spec.mtp_layers:
        raise InteropError(f"the reference trainer does not run multi-token prediction modules yet (the model has "
                           f"{spec.mtp_layers}): train the checkpoint without them")
    spec.check_ep(layout.ep)

