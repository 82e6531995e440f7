"""The decoder in MindSpore ops (PyNative, CPU), over a converted MindSpore checkpoint, to prove conversions.

`load` reads a converted single-file `.ckpt` with `mindspore.load_checkpoint` itself (so mindspore, not our
reader, decides what the file holds) and the `mindspore_model.json` beside it.  The weights stay in their
MindSpore layout: `canonical` takes each canonical tensor out of them by the dialect's own name table
(converters/mindspore/dialects.py, the one place for the names) with mindspore ops (a fused tensor's parts
gathered by the rows its transform puts them in, a transposed one transposed back), so that mindspore's
autodiff reaches the stored tensors.  `lm_loss` is the mean next-token cross entropy over the true vocabulary,
as HF computes it.  `cannot_run` says which model facts this forward does not compute.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..converters.mindspore.dialects import dialect_named
from ..errors import InteropError
from ..io.small_files import read_json_object
from ..spec import ModelSpec
from .model_facts import uncomputed


@dataclass
class MsModel:
    spec: ModelSpec
    rows: list  # the dialect's rows (interop.rows.Row) for this model: MindSpore name, transform, canonical parts
    weights: dict  # MindSpore name -> mindspore.Tensor (float32)


# what this forward computes beyond the plain decoder (interop.workflows.model_facts)
COMPUTES = frozenset({"post_norm", "qk_norm", "rope_scaling llama3", "rope_scaling longrope"})


def cannot_run(spec: ModelSpec) -> str | None:
    """Why this forward cannot compute `spec`, or None."""
    missing = uncomputed(spec, COMPUTES)
    return f"interop's model in mindspore ops does not compute this model's {', '.join(missing)}" if missing else None


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
    spec = ModelSpec.from_dict(desc["spec"])
    rows = dialect_named(desc["dialect"]).rows(spec, bool(desc.get("qkv_concat")), desc.get("qkv_layout") or "grouped",
                                               desc.get("qkv_bias_layout"))
    return MsModel(spec, rows, weights)


def _training_scalar(name: str, value) -> bool:
    """MindSpeed's step / epoch / optimizer / scheduler values beside the weights (not parameters)."""
    return value.ndim == 0 or name == "state_step" or re.match(r".+_group_\d+$", name) is not None


def canonical(m: MsModel) -> dict:
    """Every canonical tensor (interop's names, torch Linear orientation) out of the MindSpore tensors."""
    import mindspore as ms
    import mindspore.ops as ops
    out = {}
    for row in m.rows:
        if row.key not in m.weights:
            if row.transform.reads_back:  # (a tied head's copy is written, never read)
                raise InteropError(f"MindSpore checkpoint: no {row.key}")
            continue
        stored = m.weights[row.key]
        if not row.transform.keeps_rows:  # stored [in, out]: the parts' [out, in] joined on rows, transposed
            stored, at = stored.T, 0
            for part, shape in zip(row.parts, row.transform.shapes):
                out[part], at = stored[at:at + shape[0]], at + shape[0]
        elif len(row.parts) == 1:
            out[row.parts[0]] = stored
        else:
            for part, rows in zip(row.parts, row.transform.row_order()):
                out[part] = ops.gather(stored, ms.Tensor(np.array(rows, dtype=np.int32)), 0)
    return out


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
    s, w = m.spec, canonical(m)
    b, t = tokens.shape
    ids = ms.Tensor(np.asarray(tokens, dtype=np.int32))
    x = ops.gather(w["embed.word.weight"], ids, 0)
    if s.position == "learned":
        x = x + w["embed.position.weight"][:t]
    blocked = np.triu(np.ones((t, t), dtype=bool), k=1)
    if s.sliding_window is not None:  # Mistral: keys W or more positions back are out of sight
        blocked |= np.tril(np.ones((t, t), dtype=bool), k=-s.sliding_window)
    mask = ms.Tensor(np.where(blocked, -np.inf, 0.0).astype(np.float32))
    rep = s.heads // s.kv_groups

    def post(norm: str, y):  # the sandwich's norm on a branch's output (MindSpeed's use_sandwich_norm)
        return _norm(s, y, w[norm + ".weight"], w.get(norm + ".bias")) if s.post_norm else y

    for i in range(s.num_layers):
        c = f"layers.{i}."
        h = _norm(s, x, w[c + "attn_norm.weight"], w.get(c + "attn_norm.bias"))
        q, k, v = (_linear(h, w[f"{c}attn.{p}.weight"], w.get(f"{c}attn.{p}.bias"))
                   .reshape(b, t, n, s.head_dim).transpose(0, 2, 1, 3)
                   for p, n in (("q", s.heads), ("k", s.kv_groups), ("v", s.kv_groups)))
        if s.qk_norm:  # Qwen3: RMSNorm over each head, one weight [head_dim] shared by the heads
            q, k = _norm(s, q, w[c + "attn.q_norm.weight"]), _norm(s, k, w[c + "attn.k_norm.weight"])
        if s.position == "rope":
            q, k = _rope(s, q, t), _rope(s, k, t)
        if rep > 1:
            k, v = ops.repeat_interleave(k, rep, 1), ops.repeat_interleave(v, rep, 1)
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(s.head_dim) + mask
        a = ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(b, t, s.heads * s.head_dim)
        x = x + post(c + "attn_post_norm", _linear(a, w[c + "attn.o.weight"], w.get(c + "attn.o.bias")))
        h = _norm(s, x, w[c + "mlp_norm.weight"], w.get(c + "mlp_norm.bias"))
        up = _linear(h, w[c + "mlp.up.weight"], w.get(c + "mlp.up.bias"))
        if s.gated_mlp:
            inner = ops.silu(_linear(h, w[c + "mlp.gate.weight"], w.get(c + "mlp.gate.bias"))) * up
        else:
            inner = ops.gelu(up, approximate="tanh" if s.activation == "gelu_tanh" else "none")
        x = x + post(c + "mlp_post_norm", _linear(inner, w[c + "mlp.down.weight"], w.get(c + "mlp.down.bias")))
    x = _norm(s, x, w["final_norm.weight"], w.get("final_norm.bias"))
    head = w.get("lm_head.weight", w["embed.word.weight"])  # tied: the embedding
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
