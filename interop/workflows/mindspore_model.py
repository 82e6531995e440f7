"""GPT2 and Llama forward passes in MindSpore ops (PyNative, CPU), to prove conversions.

`load` reads a converted single-file `.ckpt` with `mindspore.load_checkpoint` itself
(so mindspore, not our reader, decides what the file holds) and the
`mindspore_model.json` beside it; the weights are used in their MindSpore layout:
fused QKV split per KV group, fc1 / w_gate_hidden split (by the same `interop.transforms`
objects the converters name: one implementation of each layout), MindFormers GPT2's
[in, out] linears transposed with mindspore ops.  `lm_loss` is the mean
next-token cross entropy over the true vocabulary, as HF computes it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InteropError
from ..params import param_index
from ..spec import ModelSpec
from ..transforms import GatedMLP, GroupedQKV, Interleave
from ..io.small_files import read_json_object


RUNS_DIALECTS = ("mindspeed", "mindformers")  # the names `_layer` and `_globals` know


@dataclass
class MsModel:
    spec: ModelSpec
    dialect: str
    qkv_concat: bool
    weights: dict  # MindSpore name -> mindspore.Tensor (float32)


def load(path) -> MsModel:
    """A converted tp=1, pp=1 checkpoint directory (or its .ckpt file) as MindSpore tensors."""
    import mindspore as ms
    path = Path(path)
    root = path.parent if path.is_file() else path
    desc = read_json_object(root / "mindspore_model.json", "MindSpore model description")
    layout = desc.get("layout")
    if not isinstance(layout, dict) or layout.get("tp") != 1 or layout.get("pp") != 1:
        raise InteropError(f"{root}: the MindSpore model runs tp=1 pp=1 checkpoints; convert with --tp 1 --pp 1")
    if path.is_file():
        ckpt = path
    else:
        found = sorted(root.glob("*.ckpt")) or sorted(root.glob("rank_0/*.ckpt")) or sorted(root.glob("*/mp_rank_00/*.ckpt"))
        if len(found) != 1:
            raise InteropError(f"{root}: expected one .ckpt file, found {len(found)}")
        ckpt = found[0]
    params = ms.load_checkpoint(str(ckpt))
    weights = {k: ms.Tensor(v.asnumpy().astype(np.float32)) for k, v in params.items()
               if not isinstance(v, str) and not _training_scalar(k, v)}
    return MsModel(ModelSpec.from_dict(desc["spec"]), desc["dialect"], bool(desc.get("qkv_concat")), weights)


def _training_scalar(name: str, value) -> bool:
    """MindSpeed's step / epoch / optimizer / scheduler values beside the weights (not parameters)."""
    return value.ndim == 0 or name == "state_step" or re.match(r".+_group_\d+$", name) is not None


# ---------------------------------------------------------------- weights in canonical orientation

def _unfuse(m: MsModel, transform, fused, names: list[str]) -> list:
    """The canonical tensors `names` held by one fused MindSpore tensor: the transform's row order,
    gathered with mindspore ops (so that mindspore's autodiff reaches the fused weight)."""
    import mindspore as ms
    import mindspore.ops as ops
    index = param_index(m.spec)
    bound = transform.bind(m.spec, [index[n] for n in names])
    return [ops.gather(fused, ms.Tensor(np.array(rows, dtype=np.int32)), 0) for rows in bound.row_order()]


def _layer(m: MsModel, i: int) -> dict:
    """One layer's q, k, v, o, gate, up, down ([out, in]), biases and norms, from MindSpore names."""
    w, s = m.weights, m.spec
    c = f"layers.{i}."  # canonical names
    qkv = lambda fused, leaf: _unfuse(m, GroupedQKV, fused, [f"{c}attn.{x}.{leaf}" for x in "qkv"])  # noqa: E731
    gate_up = lambda transform, fused, leaf: _unfuse(m, transform, fused, [f"{c}mlp.gate.{leaf}", f"{c}mlp.up.{leaf}"])  # noqa: E731
    out = {}
    if m.dialect == "mindspeed":
        p = f"language_model.encoder.layers.{i}."
        out["q"], out["k"], out["v"] = qkv(w[p + "attention.qkv_proj.weight"], "weight")
        if p + "attention.qkv_proj.bias" in w:
            out["bq"], out["bk"], out["bv"] = qkv(w[p + "attention.qkv_proj.bias"], "bias")
        out["o"], out["bo"] = w[p + "attention.out_proj.weight"], w.get(p + "attention.out_proj.bias")
        fc1, b1 = w[p + "mlp.mapping.weight"], w.get(p + "mlp.mapping.bias")
        if s.gated_mlp:  # [gate; up] at tp 1
            out["gate"], out["up"] = gate_up(GatedMLP, fc1, "weight")
            if b1 is not None:
                out["bgate"], out["bup"] = gate_up(GatedMLP, b1, "bias")
        else:
            out["up"], out["bup"] = fc1, b1
        out["down"], out["bdown"] = w[p + "mlp.projection.weight"], w.get(p + "mlp.projection.bias")
        out["n1"], out["bn1"] = w[p + "input_norm.weight"], w.get(p + "input_norm.bias")
        out["n2"], out["bn2"] = w[p + "post_attention_norm.weight"], w.get(p + "post_attention_norm.bias")
        if s.post_norm:  # use_sandwich_norm: legacy/model/transformer.py's attn_post_norm / ffn_post_norm
            out["pn1"], out["bpn1"] = w[p + "attn_post_norm.weight"], w.get(p + "attn_post_norm.bias")
            out["pn2"], out["bpn2"] = w[p + "ffn_post_norm.weight"], w.get(p + "ffn_post_norm.bias")
    elif s.arch == "llama":
        p = f"model.layers.{i}."
        if m.qkv_concat:
            out["q"], out["k"], out["v"] = qkv(w[p + "attention.w_qkv.weight"], "weight")
            if p + "attention.w_qkv.bias" in w:
                out["bq"], out["bk"], out["bv"] = qkv(w[p + "attention.w_qkv.bias"], "bias")
            out["gate"], out["up"] = gate_up(Interleave, w[p + "feed_forward.w_gate_hidden.weight"], "weight")
        else:
            for key, name in (("q", "wq"), ("k", "wk"), ("v", "wv")):
                out[key], out["b" + key] = w[p + f"attention.{name}.weight"], w.get(p + f"attention.{name}.bias")
            out["gate"], out["up"] = w[p + "feed_forward.w1.weight"], w[p + "feed_forward.w3.weight"]
        out["o"], out["bo"] = w[p + "attention.wo.weight"], w.get(p + "attention.wo.bias")
        out["down"], out["bdown"] = w[p + "feed_forward.w2.weight"], w.get(p + "feed_forward.w2.bias")
        out["n1"], out["n2"] = w[p + "attention_norm.weight"], w[p + "ffn_norm.weight"]
    else:  # MindFormers GPT2
        p = f"backbone.blocks.{i}."
        for key, name in (("q", "dense1"), ("k", "dense2"), ("v", "dense3")):
            out[key], out["b" + key] = w[p + f"attention.{name}.weight"], w.get(p + f"attention.{name}.bias")
        out["o"], out["bo"] = w[p + "attention.projection.weight"].T, w.get(p + "attention.projection.bias")
        out["up"], out["bup"] = w[p + "output.mapping.weight"].T, w.get(p + "output.mapping.bias")
        out["down"], out["bdown"] = w[p + "output.projection.weight"].T, w.get(p + "output.projection.bias")
        out["n1"], out["bn1"] = w[p + "layernorm1.gamma"], w[p + "layernorm1.beta"]
        out["n2"], out["bn2"] = w[p + "layernorm2.gamma"], w[p + "layernorm2.beta"]
    return out


def _globals(m: MsModel) -> dict:
    w = m.weights
    if m.dialect == "mindspeed":
        return {"embed": w["language_model.embedding.word_embeddings.weight"],
                "pos": w.get("language_model.embedding.position_embeddings.weight"),
                "norm": w["language_model.encoder.final_norm.weight"],
                "bnorm": w.get("language_model.encoder.final_norm.bias"),
                "head": w.get("language_model.output_layer.weight")}
    if m.spec.arch == "llama":
        return {"embed": w["model.tok_embeddings.embedding_weight"], "pos": None,
                "norm": w["model.norm_out.weight"], "bnorm": None, "head": w.get("lm_head.weight")}
    return {"embed": w["backbone.embedding.word_embedding.embedding_table"],
            "pos": w["backbone.embedding.position_embedding.embedding_table"],
            "norm": w["backbone.layernorm.gamma"], "bnorm": w["backbone.layernorm.beta"], "head": w.get("head.weight")}


# ---------------------------------------------------------------- forward

def _linear(x, weight, bias=None):
    import mindspore.ops as ops
    y = ops.matmul(x, weight.T)
    return y if bias is None else y + bias


def _norm(spec: ModelSpec, x, weight, bias=None):
    import mindspore.ops as ops
    if spec.norm == "rmsnorm":
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + spec.norm_eps) * weight
    mean = x.mean(-1, keep_dims=True)
    var = ((x - mean) ** 2).mean(-1, keep_dims=True)
    y = (x - mean) * ops.rsqrt(var + spec.norm_eps) * weight
    return y if bias is None else y + bias


def _rope(spec: ModelSpec, x, seq: int):
    """HF Llama's rotate_half RoPE (Megatron's default, non-interleaved), on the first rotary_dim values of each
    head (partial rotary: the rest passes unchanged)."""
    import mindspore as ms
    import mindspore.ops as ops
    d = spec.rotary_dim
    inv = 1.0 / (spec.rope_base ** (np.arange(0, d, 2, dtype=np.float32) / d))
    scale = 1.0
    if spec.rope_scaling is not None and spec.rope_scaling["type"] == "longrope":  # trainer/model.py longrope_tables
        r = spec.rope_scaling
        ext = np.array(r["long_factor"] if seq > r["original_max_positions"] else r["short_factor"], dtype=np.float32)
        inv, scale = (inv / ext).astype(np.float32), r["attention_factor"]
    elif spec.rope_scaling is not None:  # Llama-3.x: the same rule as trainer/model.py llama3_inv_freq
        r = spec.rope_scaling
        context, low, high, factor = r["original_max_positions"], r["low_freq_factor"], r["high_freq_factor"], r["factor"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > context / low, inv / factor, inv)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        inv = np.where((wavelen >= context / high) & (wavelen <= context / low), blended, scaled).astype(np.float32)
    freqs = np.outer(np.arange(seq, dtype=np.float32), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = ms.Tensor(np.cos(emb) * scale), ms.Tensor(np.sin(emb) * scale)
    x, rest = (x[..., :d], x[..., d:]) if d < spec.head_dim else (x, None)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    out = x * cos + ops.cat([-x2, x1], axis=-1) * sin
    return out if rest is None else ops.cat([out, rest], axis=-1)


def logits(m: MsModel, tokens: np.ndarray):
    """[batch, seq, vocab] logits over the true vocabulary for int token ids [batch, seq]."""
    import mindspore as ms
    import mindspore.ops as ops
    s = m.spec
    b, t = tokens.shape
    glob = _globals(m)
    ids = ms.Tensor(np.asarray(tokens, dtype=np.int32))
    x = ops.gather(glob["embed"], ids, 0)
    if s.position == "learned":
        x = x + glob["pos"][:t]
    blocked = np.triu(np.ones((t, t), dtype=bool), k=1)
    if s.sliding_window is not None:  # Mistral: keys W or more positions back are out of sight
        blocked |= np.tril(np.ones((t, t), dtype=bool), k=-s.sliding_window)
    mask = ms.Tensor(np.where(blocked, -np.inf, 0.0).astype(np.float32))
    rep = s.heads // s.kv_groups
    for i in range(s.num_layers):
        L = _layer(m, i)
        h = _norm(s, x, L["n1"], L.get("bn1"))
        q = _linear(h, L["q"], L.get("bq")).reshape(b, t, s.heads, s.head_dim).transpose(0, 2, 1, 3)
        k = _linear(h, L["k"], L.get("bk")).reshape(b, t, s.kv_groups, s.head_dim).transpose(0, 2, 1, 3)
        v = _linear(h, L["v"], L.get("bv")).reshape(b, t, s.kv_groups, s.head_dim).transpose(0, 2, 1, 3)
        if s.position == "rope":
            q, k = _rope(s, q, t), _rope(s, k, t)
        if rep > 1:
            k, v = ops.repeat_interleave(k, rep, 1), ops.repeat_interleave(v, rep, 1)
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(s.head_dim) + mask
        a = ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(b, t, s.heads * s.head_dim)
        a = _linear(a, L["o"], L.get("bo"))
        x = x + (_norm(s, a, L["pn1"], L.get("bpn1")) if "pn1" in L else a)  # the sandwich's post norms
        h = _norm(s, x, L["n2"], L.get("bn2"))
        if s.gated_mlp:
            inner = ops.silu(_linear(h, L["gate"], L.get("bgate"))) * _linear(h, L["up"], L.get("bup"))
        else:
            approx = "tanh" if s.activation == "gelu_tanh" else "none"
            inner = ops.gelu(_linear(h, L["up"], L.get("bup")), approximate=approx)
        inner = _linear(inner, L["down"], L.get("bdown"))
        x = x + (_norm(s, inner, L["pn2"], L.get("bpn2")) if "pn2" in L else inner)
    x = _norm(s, x, glob["norm"], glob["bnorm"])
    head = glob["head"] if glob["head"] is not None else glob["embed"]
    return ops.matmul(x, head[: s.vocab].T)


def lm_loss(m: MsModel, tokens: np.ndarray) -> float:
    """Mean cross entropy of predicting token t+1 from tokens <= t."""
    import mindspore as ms
    import mindspore.ops as ops
    out = logits(m, tokens)[:, :-1]
    labels = ms.Tensor(np.asarray(tokens[:, 1:], dtype=np.int32)).reshape(-1)
    logp = ops.log_softmax(out.reshape(-1, out.shape[-1]), -1)
    picked = ops.gather_elements(logp, 1, labels.reshape(-1, 1))
    return float(-picked.mean().asnumpy())
