"""The canonical parameter table: every tensor of a model, its global shape and how TP splits it.

Names are framework neutral with GLOBAL layer numbers; orientation is torch Linear
([out, in]); fused tensors (QKV, gate/up) are stored unfused.  Splitting q by heads
and k/v by groups keeps each TP rank's q, k and v consistent with Megatron's fused QKV.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import ModelSpec

# How tensor parallelism cuts a tensor: the axis, or None when every rank holds all of it.
SPLIT_AXIS = {"column": 0, "vocab": 0, "row": 1, "replicated": None}


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    split: str  # column | row | vocab | replicated
    layer: int | None  # global layer number, None for embeddings / final norm / head
    expert: int | None = None  # routed expert number (global) for MoE expert tensors: expert parallelism
    #                            gives expert e to EP rank e // (num_experts // ep)

    @property
    def axis(self) -> int | None:
        return SPLIT_AXIS[self.split]


def layer_params(spec: ModelSpec, i: int, prefix: str | None = None, layer: int | None = -1) -> list[Param]:
    """Layer `i`'s tensors, named `layers.{i}.` (or `prefix`: an MTP module's layer), its `layer` number global
    `i` unless given (None: outside the pipeline's decoder layers, on the last stage)."""
    h, d = spec.hidden, spec.head_dim
    q_rows, kv_rows, ffn = spec.heads * d, spec.kv_groups * d, spec.ffn_hidden
    p = prefix if prefix is not None else f"layers.{i}."
    layer = i if layer == -1 else layer
    has_norm_bias = spec.norm == "layernorm"
    pre, post = spec.pre_norm, spec.post_norm
    # q/k norms: [head_dim] shared by the heads (whole on every TP rank), or one weight per value of the whole
    # projection (split like the projection's rows: a TP rank holds its heads' weights)
    if spec.qk_norm_scope == "projection":
        q_norm, k_norm, qk_split = (q_rows,), (kv_rows,), "column"
    else:
        q_norm, k_norm, qk_split = (d,), (d,), "replicated"
    rows = [
        (p + "attn_norm.weight", (h,), "replicated", pre),
        (p + "attn_norm.bias", (h,), "replicated", pre and has_norm_bias),
    ]
    if spec.is_mla:
        rows += mla_rows(spec, p)
    else:
        rows += [
            (p + "attn.q.weight", (q_rows, h), "column", True),
            (p + "attn.q.bias", (q_rows,), "column", spec.qkv_bias),
            (p + "attn.k.weight", (kv_rows, h), "column", True),
            (p + "attn.k.bias", (kv_rows,), "column", spec.qkv_bias),
            (p + "attn.v.weight", (kv_rows, h), "column", True),
            (p + "attn.v.bias", (kv_rows,), "column", spec.qkv_bias),
            (p + "attn.q_norm.weight", q_norm, qk_split, spec.qk_norm),
            (p + "attn.k_norm.weight", k_norm, qk_split, spec.qk_norm),
            (p + "attn.sinks", (spec.heads,), "column", spec.attn_sinks),  # one logit per head: split with them
        ]
    rows += [
        (p + "attn.o.weight", (h, spec.attn_out_dim), "row", True),
        (p + "attn.o.bias", (h,), "replicated", spec.linear_bias),
        (p + "attn_post_norm.weight", (h,), "replicated", post),  # on the attention's output (post_norm)
        (p + "attn_post_norm.bias", (h,), "replicated", post and has_norm_bias),
        (p + "mlp_norm.weight", (h,), "replicated", pre),
        (p + "mlp_norm.bias", (h,), "replicated", pre and has_norm_bias),
    ]
    post_mlp = [(p + "mlp_post_norm.weight", (h,), "replicated", post),  # on the MLP's output (post_norm)
                (p + "mlp_post_norm.bias", (h,), "replicated", post and has_norm_bias)]
    moe = spec.is_moe_layer(i) if prefix is None else spec.is_mtp_moe()
    if moe:
        return [Param(name, shape, split, layer) for name, shape, split, present in rows if present] + \
            moe_params(spec, layer, p) + \
            [Param(name, shape, split, layer) for name, shape, split, present in post_mlp if present]
    rows += [
        (p + "mlp.gate.weight", (ffn, h), "column", spec.gated_mlp),
        (p + "mlp.gate.bias", (ffn,), "column", spec.gated_mlp and spec.has_mlp_bias),
        (p + "mlp.up.weight", (ffn, h), "column", True),
        (p + "mlp.up.bias", (ffn,), "column", spec.has_mlp_bias),
        (p + "mlp.down.weight", (h, ffn), "row", True),
        (p + "mlp.down.bias", (h,), "replicated", spec.has_mlp_bias),
        *post_mlp,
    ]
    return [Param(name, shape, split, layer) for name, shape, split, present in rows if present]


def mla_rows(spec: ModelSpec, p: str) -> list[tuple]:
    """Multi-latent attention (DeepSeek-V2/V3), torch Linear orientation:
    `attn.q.weight` [heads * head_dim, h] without q compression, else `attn.q_down.weight` [q_lora_rank, h],
    its RMSNorm `attn.q_down_norm.weight` and `attn.q_up.weight` [heads * head_dim, q_lora_rank]; each head's
    rows are its qk_nope part then its qk_rope part.  `attn.kv_down.weight` [kv_lora_rank + qk_rope_head_dim, h]
    (the latent, then the one rope key shared by the heads), `attn.kv_down_norm.weight` [kv_lora_rank] (the
    latent's RMSNorm) and `attn.kv_up.weight` [heads * (qk_nope + v_head_dim), kv_lora_rank] (each head's k_nope
    rows then its v rows).  TP splits the per-head projections by heads; the compressions are replicated
    (megatron-core multi_latent_attention.py: linear_q_down_proj / linear_kv_down_proj are not split)."""
    h, heads, rank = spec.hidden, spec.heads, spec.q_lora_rank
    q_rows = heads * spec.head_dim
    compressed = rank is not None
    return [
        (p + "attn.q.weight", (q_rows, h), "column", not compressed),
        (p + "attn.q_down.weight", (rank, h), "replicated", compressed),
        (p + "attn.q_down_norm.weight", (rank,), "replicated", compressed),
        (p + "attn.q_up.weight", (q_rows, rank), "column", compressed),
        (p + "attn.kv_down.weight", (spec.kv_lora_rank + spec.qk_rope_head_dim, h), "replicated", True),
        (p + "attn.kv_down_norm.weight", (spec.kv_lora_rank,), "replicated", True),
        (p + "attn.kv_up.weight", (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank), "column",
         True),
    ]


def mtp_params(spec: ModelSpec, k: int) -> list[Param]:
    """Multi-token prediction module k (DeepSeek-V3, megatron-core's MultiTokenPredictionLayer), on the last
    pipeline stage: `mtp.{k}.enorm.weight` (the next token's embedding norm), `mtp.{k}.hnorm.weight` (the hidden
    state's), `mtp.{k}.eh_proj.weight` [h, 2h] (over [enorm(embedding); hnorm(hidden)]), a decoder layer named
    `mtp.{k}.layer.*` as `layers.{i}.*`, and `mtp.{k}.final_norm.weight` (DeepSeek's shared_head.norm).  The
    embedding and the output head are the model's own."""
    h, p = spec.hidden, f"mtp.{k}."
    out = [Param(p + "enorm.weight", (h,), "replicated", None), Param(p + "hnorm.weight", (h,), "replicated", None),
           Param(p + "eh_proj.weight", (h, 2 * h), "column", None)]
    out += layer_params(spec, spec.num_layers + k, prefix=p + "layer.", layer=None)
    out.append(Param(p + "final_norm.weight", (h,), "replicated", None))
    return out


def moe_params(spec: ModelSpec, i: int | None, p: str | None = None) -> list[Param]:
    """A MoE layer's MLP: the router, each routed expert's MLP (no biases), the shared expert and its gate.

    Names: `layers.{i}.mlp.router.weight` [E, h] (and `router.bias` [E], added to its logits; `router.expert_bias`
    [E], DeepSeek's choice-only correction), `layers.{i}.mlp.experts.{e}.{gate,up,down}.weight` (and `.bias` with MLP
    biases: gpt-oss), `layers.{i}.mlp.shared.{gate,up,down}.weight`, `layers.{i}.mlp.shared_gate.weight` [1, h].
    Within an expert TP splits like a dense MLP.
    """
    h, ffn = spec.hidden, spec.moe_ffn_hidden
    p = f"layers.{i}.mlp." if p is None else p + "mlp."
    out = [Param(p + "router.weight", (spec.num_experts, h), "replicated", i)]
    if spec.moe_router_logit_bias:
        out.append(Param(p + "router.bias", (spec.num_experts,), "replicated", i))
    if spec.moe_router_bias:
        out.append(Param(p + "router.expert_bias", (spec.num_experts,), "replicated", i))
    bias = spec.has_mlp_bias
    for e in range(spec.num_experts):
        if spec.gated_mlp:
            out.append(Param(f"{p}experts.{e}.gate.weight", (ffn, h), "column", i, e))
            if bias:
                out.append(Param(f"{p}experts.{e}.gate.bias", (ffn,), "column", i, e))
        out.append(Param(f"{p}experts.{e}.up.weight", (ffn, h), "column", i, e))
        if bias:
            out.append(Param(f"{p}experts.{e}.up.bias", (ffn,), "column", i, e))
        out.append(Param(f"{p}experts.{e}.down.weight", (h, ffn), "row", i, e))
        if bias:
            out.append(Param(f"{p}experts.{e}.down.bias", (h,), "replicated", i, e))
    if spec.shared_expert_ffn_hidden is not None:
        s = spec.shared_expert_ffn_hidden
        if spec.gated_mlp:
            out.append(Param(p + "shared.gate.weight", (s, h), "column", i))
        out.append(Param(p + "shared.up.weight", (s, h), "column", i))
        out.append(Param(p + "shared.down.weight", (h, s), "row", i))
        if spec.shared_expert_gate:
            out.append(Param(p + "shared_gate.weight", (1, h), "replicated", i))
    return out


def param_table(spec: ModelSpec) -> list[Param]:
    """All parameters in a fixed order: embeddings, layers 0..L-1, final norm, head, MTP modules."""
    h, v = spec.hidden, spec.padded_vocab
    table = [Param("embed.word.weight", (v, h), "vocab", None)]
    if spec.position == "learned":
        table.append(Param("embed.position.weight", (spec.max_positions, h), "replicated", None))
    for i in range(spec.num_layers):
        table.extend(layer_params(spec, i))
    table.append(Param("final_norm.weight", (h,), "replicated", None))
    if spec.norm == "layernorm":
        table.append(Param("final_norm.bias", (h,), "replicated", None))
    if not spec.tied_embeddings:
        table.append(Param("lm_head.weight", (v, h), "vocab", None))
    for k in range(spec.mtp_layers):
        table.extend(mtp_params(spec, k))
    return table


def param_index(spec: ModelSpec) -> dict[str, Param]:
    return {p.name: p for p in param_table(spec)}


# Optimizer state rides along under prefixed names (`optim.<kind>.<parameter>`), with its parameter's shape
# and split: Adam's two moments and the fp32 master copy of a low-precision weight.
OPTIM_KINDS = ("exp_avg", "exp_avg_sq", "fp32_param")
MASTER = "fp32_param"
OPTIM_PREFIXES = tuple(f"optim.{kind}." for kind in OPTIM_KINDS)


@dataclass(frozen=True)
class TensorKey:
    """A canonical tensor's name as a type: the weight of parameter `param`, or one `kind` of optimizer
    state of it (`str(key)` is the name: `layers.0.attn.q.weight`, `optim.exp_avg.layers.0.attn.q.weight`)."""

    param: str
    kind: str | None = None  # None: the weight; else one of OPTIM_KINDS

    @classmethod
    def parse(cls, name: str) -> "TensorKey":
        if name.startswith("optim."):
            kind, _, param = name[len("optim."):].partition(".")
            if kind in OPTIM_KINDS:
                return cls(param, kind)
        return cls(name)

    @property
    def is_optim(self) -> bool:
        """Optimizer state (a moment or the master copy), not the weight."""
        return self.kind is not None

    @property
    def is_master(self) -> bool:
        """The optimizer's fp32 master copy of the weight."""
        return self.kind == MASTER

    @property
    def prefix(self) -> str:
        """What the name adds to its parameter's: "" for the weight, `optim.<kind>.` for its state."""
        return "" if self.kind is None else f"optim.{self.kind}."

    def of(self, param: str) -> "TensorKey":
        """The same kind of tensor of another parameter (a fused row's other parts)."""
        return TensorKey(param, self.kind)

    def __str__(self) -> str:
        return self.prefix + self.param


def base_param_name(name: str) -> str:
    """`optim.exp_avg.layers.0.attn.q.weight` -> `layers.0.attn.q.weight`."""
    return TensorKey.parse(name).param
