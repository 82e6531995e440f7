"""GPT2- and Llama-style decoders, cut into pipeline stages and split by tensor parallelism.

Follow one token: `Embeddings` looks it up (vocab-parallel) and, for GPT2, adds its
learned position; every `Block` applies pre-norm attention then a pre-norm MLP, each
added back to the residual stream; the last stage normalises, multiplies by the
output head (the word embedding when tied) to get this rank's slice of the
vocabulary's logits, and `vocab_parallel_cross_entropy` turns them into the loss.

A MoE layer's MLP is `moe.MoE` (router, this expert-parallel rank's experts, shared expert).

Multi-token prediction (DeepSeek-V3, `spec.mtp_layers`): the last stage also runs the MTP modules
(`MTPModule`) on the final-normed hidden states and adds `mtp_loss_weight` times their mean loss to the
objective, as megatron-core 0.16.1 does (gpt_model.py `_postprocess`); the loss it reports is the LM loss.

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

from .activations import activate
from .grid import Grid
from .mla import MLAttention, yarn_inv_freq
from .moe import MoE
from .tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp, gather_from_tp,
                 reduce_from_tp, vocab_parallel_cross_entropy)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (as HF Llama and Megatron do).

    `tp_group`: the norm runs on this rank's heads only (Qwen3's q/k norms), so each rank's weight
    gradient is partial; copy_to_tp sums them in the backward pass, keeping the copies identical.
    """

    def __init__(self, hidden: int, eps: float, tp_group=None, zero_centered: bool = False):
        super().__init__()
        self.eps, self.tp_group, self.zero_centered = eps, tp_group, zero_centered
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = copy_to_tp(self.weight, self.tp_group)
        if self.zero_centered:  # Gemma: (1 + w) in fp32, then the model's dtype (Gemma2RMSNorm)
            return (x * (1.0 + weight.float())).to(dtype)
        return weight * x.to(dtype)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection that tensor parallelism splits by heads (OLMo 2's q/k norms,
    `qk_norm_scope` "projection"): this rank holds its heads' values and their weights; the mean of squares
    is over all `size` values, so the ranks' sums of squares are added (forward and backward)."""

    def __init__(self, size: int, eps: float, tp: int, tp_group=None):
        super().__init__()
        self.size, self.eps, self.tp_group = size, eps, tp_group
        self.weight = nn.Parameter(torch.ones(size // tp))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        squares = copy_to_tp(reduce_from_tp(x.pow(2).sum(-1, keepdim=True), self.tp_group), self.tp_group)
        return self.weight * (x * torch.rsqrt(squares / self.size + self.eps)).to(dtype)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden, spec.norm_eps, zero_centered=spec.norm_zero_centered)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)


def rope_tables(spec: ModelSpec, seq: int, device=None):
    """cos/sin [seq, rotary_dim] for rotary embeddings, rotate-half convention (HF Llama, Megatron default);
    multi-latent attention rotates its qk_rope_head_dim part only, partial rotary its first rotary_dim values;
    YaRN scales cos / sin by its attention factor."""
    d = spec.rotary_dim
    scaling = spec.rope_scaling
    if scaling is not None and scaling["type"] == "longrope":
        return longrope_tables(spec, seq, device)
    attention = 1.0
    if scaling is not None and scaling["type"] == "yarn":
        inv_freq, attention = yarn_inv_freq(d, spec.rope_base, scaling, device)
    else:
        inv_freq = 1.0 / (spec.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        if scaling is not None and scaling["type"] == "linear":  # Gemma 3's global layers: positions / factor
            inv_freq = inv_freq / scaling["factor"]
        elif scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention, angles.sin() * attention


def longrope_tables(spec: ModelSpec, seq: int, device=None):
    """LongRoPE (Phi-3): each base frequency divided by its short factor (sequences up to the original context)
    or long factor (longer ones), cos and sin multiplied by the attention factor (transformers' longrope)."""
    d, scaling = spec.rotary_dim, spec.rope_scaling
    factors = scaling["long_factor"] if seq > scaling["original_max_positions"] else scaling["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (ext * spec.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scaling["attention_factor"], angles.sin() * scaling["attention_factor"]


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
    """x [b, heads, seq, d]: rotate each (x_i, x_{i+r/2}) pair of the first r = cos.shape[-1] values by its
    position's angle; the rest of the head (partial rotary) passes unchanged."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = r // 2
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
        self.scale, self.softcap = spec.softmax_scale, spec.attn_softcap
        if spec.attn_sinks:  # gpt-oss: one learned logit per head of this rank (`attn.sinks`, split with the heads)
            self.sinks = nn.Parameter(torch.zeros(self.heads))
        # q/k norms, before the rotation: over each head's d values (Qwen3), applied to [.., heads, d]; or over
        # the whole projection (OLMo 2), applied to [.., heads * d] before it is cut into heads
        self.qk_norm_scope = spec.qk_norm_scope if spec.qk_norm else None
        if self.qk_norm_scope == "head":
            self.q_norm = RMSNorm(d, spec.norm_eps, g, spec.norm_zero_centered)
            self.k_norm = RMSNorm(d, spec.norm_eps, g, spec.norm_zero_centered)
        elif self.qk_norm_scope == "projection":
            self.q_norm = ProjectionRMSNorm(spec.heads * d, spec.norm_eps, tp, g)
            self.k_norm = ProjectionRMSNorm(spec.kv_groups * d, spec.norm_eps, tp, g)

    def forward(self, x, rope, mask=None):
        b, s, _ = x.shape
        q, k = self.q(x), self.k(x)
        if self.qk_norm_scope == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, self.heads, self.d), k.view(b, s, self.groups, self.d)
        if self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(b, s, self.groups, self.d).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.softcap is not None or hasattr(self, "sinks"):
            y = eager_attention(q, k, v, mask, self.scale, self.softcap, getattr(self, "sinks", None))
        else:  # GQA: each kv head serves heads/groups query heads (enable_gqa repeats them without a copy)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=self.groups != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.d))


def eager_attention(q, k, v, mask, scale, cap=None, sinks=None):
    """Attention computed step by step, for what SDPA has no option for: scores capped (Gemma 2's
    attn_logit_softcapping: cap * tanh(q k^T * scale / cap)) as transformers' eager Gemma 2 attention, and / or a
    learned sink logit per head joined to each row of scores for the softmax and dropped after it (gpt-oss, as
    transformers' eager GptOssAttention: the row's max subtracted first); the causal (or window) mask, softmax in fp32."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    seq = q.shape[2]
    allowed = mask if mask is not None else torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype), v)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class MLP(nn.Module):
    """down(act(up(x))), or down(silu(gate(x)) * up(x)) for SwiGLU; ffn columns split over tp.

    `ffn`/`bias` default to the dense MLP's; a MoE layer's shared expert has its own size and no biases."""

    def __init__(self, spec: ModelSpec, grid: Grid, ffn: int | None = None, bias: bool | None = None):
        super().__init__()
        h, tp, g = spec.hidden, grid.tp, grid.tp_group
        f = spec.ffn_hidden if ffn is None else ffn
        bias = spec.has_mlp_bias if bias is None else bias
        self.spec = spec
        if spec.gated_mlp:
            self.gate = ColumnParallelLinear(h, f, bias, tp, g)
        self.up = ColumnParallelLinear(h, f, bias, tp, g)
        self.down = RowParallelLinear(f, h, bias, tp, g)

    def forward(self, x):
        return self.down(activate(self.spec, self.gate(x) if self.spec.gated_mlp else None, self.up(x)))


class Block(nn.Module):
    """x + post(attn(pre(x))), then the same around the MLP; each of pre and post is a norm where the spec has
    it (`pre_norm`: GPT2, Llama; `post_norm`: OLMo 2 alone, Gemma's sandwich with both), else the identity."""

    def __init__(self, spec: ModelSpec, grid: Grid, moe: bool = False):
        super().__init__()
        identity = nn.Identity()
        self.attn_norm = make_norm(spec) if spec.pre_norm else identity
        self.attn = MLAttention(spec, grid) if spec.is_mla else Attention(spec, grid)
        self.attn_post_norm = make_norm(spec) if spec.post_norm else identity
        self.mlp_norm = make_norm(spec) if spec.pre_norm else identity
        self.mlp_post_norm = make_norm(spec) if spec.post_norm else identity
        if moe:
            shared = spec.shared_expert_ffn_hidden
            self.mlp = MoE(spec, grid, MLP(spec, grid, shared, bias=False) if shared is not None else None)
        else:
            self.mlp = MLP(spec, grid)

    def forward(self, x, rope, mask=None):
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope, mask))
        return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


class MTPModule(nn.Module):
    """Multi-token prediction module k (megatron-core's MultiTokenPredictionLayer): the embedding of the tokens
    k + 1 ahead normed by `enorm`, the previous hidden state (the decoder's final-normed output, or module k-1's
    output) by `hnorm`, joined in that order and projected by `eh_proj` (column-parallel, its output gathered over
    tp), a decoder layer built like the model's last one, and this module's `final_norm`."""

    def __init__(self, spec: ModelSpec, grid: Grid):
        super().__init__()
        self.group = grid.tp_group
        self.enorm, self.hnorm = make_norm(spec), make_norm(spec)
        self.eh_proj = ColumnParallelLinear(2 * spec.hidden, spec.hidden, False, grid.tp, grid.tp_group)
        self.layer = Block(spec, grid, spec.is_mtp_moe())
        self.final_norm = make_norm(spec)

    def forward(self, hidden, embedded, rope, mask=None):
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = gather_from_tp(self.eh_proj(x), self.group)
        return self.final_norm(self.layer(x, rope, mask))


def shift_left(tokens):
    """Each row moved one position left, the last filled with token 0 (megatron-core's roll_tensor)."""
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)


class Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec, grid: Grid, with_position: bool):
        super().__init__()
        self.word = VocabParallelEmbedding(spec.padded_vocab, spec.hidden, grid.tp, grid.tp_rank, grid.tp_group)
        self.scale = spec.hidden ** 0.5 if spec.embed_scale else None
        if with_position:
            self.position = nn.Embedding(spec.max_positions, spec.hidden)

    def forward(self, tokens):
        x = self.word(tokens)
        if self.scale is not None:  # Gemma: sqrt(hidden) rounded to the model's dtype first
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if hasattr(self, "position"):
            x = x + self.position.weight[: tokens.shape[1]]
        return x


class Stage(nn.Module):
    """The part of the model one pipeline stage owns.

    First stage: tokens -> hidden states.  Middle: hidden -> hidden.  Last: hidden ->
    loss.  With tied embeddings (the output head) or MTP modules (their input) and pp > 1
    the last stage keeps its own copy of `embed.word.weight`; the trainer sums the two
    copies' gradients so they stay identical (megatron-core's embedding group), and only
    the first stage's copy is saved.
    """

    def __init__(self, spec: ModelSpec, layout: ParallelLayout, grid: Grid):
        super().__init__()
        check_model_layout(spec, layout)
        self.spec, self.grid = spec, grid
        self.first, self.last = grid.first_stage, grid.last_stage
        if self.first or (self.last and (spec.tied_embeddings or spec.mtp_layers)):
            self.embed = Embeddings(spec, grid, with_position=self.first and spec.position == "learned")
        self.layers = nn.ModuleDict({str(i): Block(spec, grid, spec.is_moe_layer(i))
                                     for i in layout.layers_of_stage(grid.pp_rank)})
        if self.last:
            self.final_norm = make_norm(spec)
            if not spec.tied_embeddings:
                self.lm_head = ColumnParallelLinear(spec.hidden, spec.padded_vocab, False, grid.tp, grid.tp_group)
            if spec.mtp_layers:
                self.mtp = nn.ModuleDict({str(k): MTPModule(spec, grid) for k in range(spec.mtp_layers)})
        self.mtp_log: list = []  # per forward since the training loop last took them: each MTP module's loss [K]

    def forward(self, x, targets=None, tokens=None):
        """x: token ids [b, s] on the first stage, else hidden states [b, s, h] from the previous stage;
        `tokens`: the input ids, which the last stage's MTP modules embed (on the first stage: x)."""
        if self.first:
            tokens = x
            x = self.embed(x)
        x = self.blocks(x)
        if not self.last:
            return x
        x = self.final_norm(x)
        loss = self.loss(x, targets)
        if not self.spec.mtp_layers:
            return loss
        extra = self.mtp_objective(x, tokens, targets)
        return loss + (extra - extra.detach())  # the LM loss's value, the MTP losses' gradients too

    def layer_inputs(self, seq: int, device) -> dict:
        """(rope, mask) of each kind of layer: {sliding: (its rope, its window mask), not sliding: (rope, None)}."""
        spec = self.spec
        rope = rope_tables(spec, seq, device) if spec.position == "rope" else None
        local = rope  # Gemma 3: the sliding layers' rope has its own base and no scaling
        if spec.rope_local_base is not None:
            local = rope_tables(spec.replace(rope_base=spec.rope_local_base, rope_scaling=None), seq, device)
        return {True: (local, attention_mask(spec, seq, device)), False: (rope, None)}

    def blocks(self, x):
        """This stage's layers on hidden states [b, s, h], each with its mask (a window on sliding layers)."""
        inputs = self.layer_inputs(x.shape[1], x.device)
        for i, block in self.layers.items():
            x = block(x, *inputs[self.spec.is_sliding_layer(int(i))])
        return x

    def mtp_objective(self, hidden, tokens, targets):
        """mtp_loss_weight / K * sum_k L_k (megatron-core gpt_model.py `_postprocess`, mtp_loss_scaling_factor /
        mtp_num_layers).  L_k is the mean cross entropy of module k's output against the targets k + 1 ahead, over
        the s - k - 1 positions that have one (megatron-core's rolled loss_mask)."""
        spec, losses = self.spec, []
        for k, out in enumerate(self.mtp_hidden(hidden, tokens)):
            keep = out.shape[1] - k - 1
            losses.append(self.loss(out[:, :keep], targets[:, k + 1:]))
        self.mtp_log.append(torch.stack(losses).detach())
        return torch.stack(losses).sum() * (spec.mtp_loss_weight / spec.mtp_layers)

    def mtp_hidden(self, hidden, tokens) -> list:
        """Each MTP module's final-normed output [b, s, h] from the decoder's final-normed `hidden`: module k embeds
        the tokens k + 1 ahead (zero-filled at the end, as megatron-core rolls input_ids) and runs like the last
        decoder layer; its logits predict the tokens k + 2 ahead."""
        spec, seq = self.spec, hidden.shape[1]
        rope, mask = self.layer_inputs(seq, hidden.device)[spec.is_sliding_layer(spec.num_layers - 1)]
        outputs = []
        for module in self.mtp.values():
            tokens = shift_left(tokens)
            hidden = module(hidden, self.embed(tokens), rope, mask)
            outputs.append(hidden)
        return outputs

    def logits(self, x):
        """This rank's vocabulary shard of the logits of final-normed hidden states (soft-capped where the model is)."""
        weight = self.embed.word.weight if self.spec.tied_embeddings else self.lm_head.weight
        logits = F.linear(copy_to_tp(x, self.grid.tp_group), weight)
        if self.spec.logit_softcap is not None:  # Gemma 2's final_logit_softcapping (element-wise: any vocab shard)
            logits = torch.tanh(logits / self.spec.logit_softcap) * self.spec.logit_softcap
        return logits

    def loss(self, x, targets):
        logits = self.logits(x)
        part = logits.shape[-1]
        return vocab_parallel_cross_entropy(logits.reshape(-1, part), targets.reshape(-1),
                                            self.grid.tp_rank * part, self.spec.vocab, self.grid.tp_group)

    def named_tensors(self):
        """The canonical tensors this rank holds: parameters (a LoRA A shared by a fused module's parts under each
        part's name), and the router's expert bias (a buffer)."""
        yield from self.named_parameters(remove_duplicate=False)
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
    spec.check_ep(layout.ep)

