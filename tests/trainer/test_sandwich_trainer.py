"""The reference trainer on MindSpeed's sandwich norm (the PanGu 38B of the MindSpeed-Core-MS GPT guide): its
forward equals one written here from MindSpeed-Core-MS's equations, its fresh weights start the post norms at
their scales, and it trains (uneven pipeline).

The equations, from Ascend/MindSpeed-Core-MS at 3a86578b82b2790176178a54e4f104e1ee583a68:
- mindspeed_ms/legacy/model/transformer.py ParallelTransformerLayer.construct (apply_residual_connection_post_norm
  False, no biases, dropout 0): n = input_norm(x); out = attn_post_norm(attention(n)); x1 = x + out;
  n = post_attention_norm(x1); out = ffn_post_norm(mlp(n)); y = x1 + out.
- mindspeed_ms/legacy/model/norm.py RMSNorm.construct: cast to fp32, x * rsqrt(mean(x^2) + eps), cast back, times
  weight; get_norm(config, scale): weight = ones(hidden) * scale (the initial value only).
- Attention: Megatron's GQA with rotate-half rope (inv_freq = base^(-2i/d)), causal softmax(q k^T / sqrt(d));
  the MLP with swiglu: down(silu(gate(n)) * up(n)).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreReader, StoreWriter
from interop.tensors import TensorMeta
from interop.trainer.config import TrainConfig
from interop.trainer.grid import Grid
from interop.trainer.init import init_checkpoint
from interop.trainer.launch import train
from interop.trainer.model import Stage

SPEC = dict(arch="llama", num_layers=4, hidden=32, ffn_hidden=64, heads=4, kv_groups=2, head_dim=8, vocab=250,
            padded_vocab=256, max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu", position="rope",
            rope_base=10000.0, tied_embeddings=False, pre_norm=True, post_norm=True, attn_post_norm_scale=0.0447,
            mlp_post_norm_scale=0.0825)


def random_checkpoint(spec: ModelSpec, dst):
    """Every tensor random, the norms around 1 (each unlike the others, so a swapped norm shows)."""
    dst.mkdir()
    gen = torch.Generator().manual_seed(5)
    table = param_table(spec)
    writer = StoreWriter(dst, spec, ParallelLayout.build(spec.num_layers),
                         [TensorMeta(p.name, torch.float32, p.shape) for p in table])
    for p in table:
        noise = torch.randn(p.shape, generator=gen)
        writer.write(p.name, 1 + 0.3 * noise if "norm" in p.name else 0.2 * noise)
    writer.finish({})
    return dst


def rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate(x, base):
    """Rotate-half rope over the last axis of [b, heads, s, d]."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_logits(t: dict, spec: ModelSpec, tokens):
    """MindSpeed-Core-MS's sandwich-norm GPT, from its equations (module docstring), on canonical tensors `t`."""
    b, s = tokens.shape
    d, hq, hk, eps = spec.head_dim, spec.heads, spec.kv_groups, spec.norm_eps
    x = t["embed.word.weight"][tokens]
    causal = torch.full((s, s), float("-inf")).triu(1)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        n = rms(x, t[p + "attn_norm.weight"], eps)
        q = (n @ t[p + "attn.q.weight"].T).view(b, s, hq, d).transpose(1, 2)
        k = (n @ t[p + "attn.k.weight"].T).view(b, s, hk, d).transpose(1, 2)
        v = (n @ t[p + "attn.v.weight"].T).view(b, s, hk, d).transpose(1, 2)
        q, k = rotate(q, spec.rope_base), rotate(k, spec.rope_base)
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + causal
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, hq * d) @ t[p + "attn.o.weight"].T
        x = x + rms(attn, t[p + "attn_post_norm.weight"], eps)
        n = rms(x, t[p + "mlp_norm.weight"], eps)
        mlp = (F.silu(n @ t[p + "mlp.gate.weight"].T) * (n @ t[p + "mlp.up.weight"].T)) @ t[p + "mlp.down.weight"].T
        x = x + rms(mlp, t[p + "mlp_post_norm.weight"], eps)
    return rms(x, t["final_norm.weight"], eps) @ t["lm_head.weight"].T


def test_trainer_forward_equals_the_sandwich_equations(tmp_path):
    spec = ModelSpec(**SPEC)
    store = StoreReader(random_checkpoint(spec, tmp_path / "ckpt"))
    tensors = {p.name: store.read(p.name) for p in param_table(spec)}
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    with torch.no_grad():
        for name, value in stage.named_tensors():
            value.copy_(tensors[name])
        tokens = torch.randint(0, spec.vocab, (2, 12), generator=torch.Generator().manual_seed(1))
        ours = F.linear(stage.final_norm(stage.blocks(stage.embed(tokens))), stage.lm_head.weight)
        theirs = reference_logits(tensors, spec, tokens)
    assert (ours - theirs).abs().max() < 1e-5
    # the post norms matter: without them (the plain pre-norm model) the logits are another model's
    plain = {**tensors, **{n: torch.ones(spec.hidden) for n in tensors if "post_norm" in n}}
    assert (reference_logits(plain, spec, tokens) - theirs).abs().max() > 1e-2


def test_fresh_weights_start_the_post_norms_at_their_scales(tmp_path):
    spec = ModelSpec(**SPEC)
    store = StoreReader(init_checkpoint(spec, tmp_path / "init"))
    assert store.source.spec.attn_post_norm_scale == 0.0447 and store.source.spec.mlp_post_norm_scale == 0.0825
    for i in range(spec.num_layers):
        assert torch.equal(store.read(f"layers.{i}.attn_post_norm.weight"), torch.full((spec.hidden,), 0.0447))
        assert torch.equal(store.read(f"layers.{i}.mlp_post_norm.weight"), torch.full((spec.hidden,), 0.0825))
        assert torch.equal(store.read(f"layers.{i}.attn_norm.weight"), torch.ones(spec.hidden))


def test_trains_from_a_spec_on_an_uneven_pipeline(tmp_path):
    """From the YAML spec (scales included): pp 2 with stages of 3 and 1 layers, 10 steps on one batch; the loss falls
    and the saved checkpoint keeps the scales."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    np.save(tmp_path / "batch.npy", np.random.default_rng(0).integers(0, SPEC["vocab"], (4, 17)))  # one batch, again
    cfg = TrainConfig(init_spec=str(tmp_path / "spec.yaml"), save=str(tmp_path / "run"), pp=2, first_stage_layers=3,
                      steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, data=str(tmp_path / "batch.npy"),
                      lr=1e-2, quiet=True)
    losses = [r["loss"] for r in train(cfg)]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    saved = sorted((tmp_path / "run").glob("step_*"))[-1]
    spec = StoreReader(saved).source.spec
    assert (spec.attn_post_norm_scale, spec.mlp_post_norm_scale) == (0.0447, 0.0825)
