"""ModelSpec: the framework-neutral description of a GPT2- or Llama-style decoder.

Llama-style families differ by facts, not by code: Qwen2 is `qkv_bias` without
`linear_bias`, Qwen3 adds `qk_norm`, Llama-3.x adds `rope_scaling`, Mistral a
`sliding_window`.  Each format says which facts it can hold (`mappings/`).

Every converter reads a spec from its own config (HF config.json, Megatron args,
MindSpore YAML) and writes one back; the canonical parameter table
(`interop.params`) is derived from it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import InteropError

ARCHS = ("gpt2", "llama")
NORMS = ("layernorm", "rmsnorm")
# gelu = exact erf GeLU (HF "gelu", Megatron default); gelu_tanh = tanh approximation
# (HF "gelu_new", Megatron --openai-gelu / bias-gelu fusion); swiglu = SiLU(gate) * up.
# geglu_tanh = gelu_tanh(gate) * up (Gemma's GeGLU, HF hidden_activation "gelu_pytorch_tanh").
# quick_geglu = gate * sigmoid(1.702 * gate) * (up + glu_linear_offset), gate and up clamped by glu_clamp (gpt-oss's
# experts: HF GptOssExperts._apply_gate with swiglu_alpha 1.702; megatron-core --quick-geglu).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu_tanh", "quick_geglu")
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu (fusions/fused_bias_geglu.py) and GptOssConfig.swiglu_alpha
POSITIONS = ("learned", "rope")
DTYPES = ("float32", "bfloat16", "float16")
# Sane bounds, so that a hostile or mistyped description fails here, before anything is sized by it:
# the deepest published decoders have a few hundred layers; every size must fit a torch dimension.
MAX_LAYERS = 10_000
# Experts over all MoE layers (each 2-3 tensors, a row apiece in every table): DeepSeek-V3 has 256 x 58 =
# 14,848; a million experts in one layer would build tables of millions of rows before any file is read.
MAX_EXPERTS_IN_MODEL = 1 << 18
MAX_SIZE = 2**31 - 1
INT_FIELDS = ("num_layers", "hidden", "ffn_hidden", "heads", "kv_groups", "head_dim", "vocab", "padded_vocab",
              "max_positions")
BOOL_FIELDS = ("tied_embeddings", "qkv_bias", "linear_bias", "qk_norm", "pre_norm", "post_norm", "norm_zero_centered",
               "embed_scale", "attn_sinks", "moe_router_logit_bias")
# What one q/k norm weight covers: each head's head_dim values, shared by the heads (Qwen3, Gemma 3), or the
# whole projection, heads * head_dim values with a weight each (OLMo 2: RMS over all of a token's q or k).
QK_NORM_SCOPES = ("head", "projection")


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    num_layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_groups: int
    head_dim: int
    vocab: int  # the tokenizer's true vocabulary
    padded_vocab: int  # rows of the embedding / output matrices as stored
    max_positions: int
    norm: str
    norm_eps: float
    activation: str
    position: str
    rope_base: float = 10000.0
    # Partial rotary (GLM-4.5, Phi-3 variants; HF partial_rotary_factor, Megatron --rotary-percent): rope turns the
    # first int(head_dim * rotary_percent) values of each q/k head, in halves of that part (rotate-half), and
    # leaves the rest of the head as it is.
    rotary_percent: float = 1.0
    tied_embeddings: bool = True
    qkv_bias: bool = False  # biases on q, k, v
    linear_bias: bool = False  # biases on o, gate/up and down
    mlp_bias: bool | None = None  # gate/up and down when unlike o (HF Llama attention_bias without mlp_bias)
    dtype: str = "float32"
    qk_norm: bool = False  # RMSNorm over each q and k head (weights [head_dim], shared by the heads): Qwen3
    rope_scaling: dict | None = None  # {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    #                                    "original_max_positions"}: Llama-3.x long-context frequencies
    sliding_window: int | None = None  # every layer attends to at most this many positions (itself included)
    # Mixture of experts (absent: a dense model).  A MoE layer replaces the MLP with a router over
    # `num_experts` gated experts of `moe_ffn_hidden` (each a SwiGLU/GeLU MLP like the dense one, no biases),
    # of which each token uses `moe_topk`; optionally plus a shared expert every token uses.
    num_experts: int | None = None  # routed experts per MoE layer (Mixtral 8, Qwen2-MoE 60, DeepSeek-V3 256)
    moe_topk: int | None = None  # experts per token
    moe_ffn_hidden: int | None = None  # each routed expert's intermediate size (Mixtral: = ffn_hidden)
    moe_layers: list | None = None  # global layer numbers that are MoE (None with num_experts: every layer)
    moe_router_score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    moe_norm_topk: bool = True  # renormalise the top-k probabilities to sum to 1 (Mixtral yes, Qwen2-MoE no)
    moe_router_bias: bool = False  # DeepSeek-V3's per-expert score-correction bias (used for choice only)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight, Switch/Megatron style
    shared_expert_ffn_hidden: int | None = None  # intermediate size of the shared expert(s), summed
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert's output
    # Group-limited routing (DeepSeek-V2/V3): the experts form `moe_groups` equal groups, each token first keeps
    # the `moe_group_topk` best groups (by `moe_group_score`: "top2", the sum of a group's two best scores,
    # DeepSeek-V3 / megatron-core with topk // group_topk = 2; "max", its best score, DeepSeek-V2) and picks its
    # `moe_topk` experts among theirs.  `moe_routed_scaling` multiplies the routed experts' weights.
    moe_groups: int | None = None
    moe_group_topk: int | None = None
    moe_group_score: str | None = None
    moe_routed_scaling: float = 1.0
    # Multi-latent attention (DeepSeek-V2/V3; present when kv_lora_rank is set): q comes from a rank-`q_lora_rank`
    # compression (down, RMSNorm, up; absent = one q projection, DeepSeek-V2-Lite), k and v from a rank-
    # `kv_lora_rank` compression plus one decoupled rope key of `qk_rope_head_dim` shared by the heads.  With MLA
    # `head_dim` is the q/k head (qk_nope_head_dim + qk_rope_head_dim), `kv_groups` = heads, and each value head is
    # `v_head_dim` wide.  `rope_interleave`: the rope part rotates interleaved pairs (x0, x1), (x2, x3), ... as
    # DeepSeek's weights are laid out, instead of the two halves.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False
    # Multi-token prediction (DeepSeek-V3): `mtp_layers` modules after the decoder, module k predicting token
    # t + k + 2 from norm(embed(t + k + 1)) and the previous hidden state (enorm, hnorm, eh_proj, one decoder
    # layer like the last one, its final norm; the embedding and output head are the model's); training adds
    # `mtp_loss_weight` times their mean loss.
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.1
    # Training dropouts, carried from the source so that no target invents its framework's defaults (None: the
    # source does not say).  Not the model's identity: two specs that differ only here are equal.
    attention_dropout: float | None = dataclasses.field(default=None, compare=False)
    hidden_dropout: float | None = dataclasses.field(default=None, compare=False)
    # Where a layer's norms sit.  pre_norm: before attention and before the MLP (`attn_norm`, `mlp_norm`: GPT2,
    # Llama); post_norm: on the attention's and the MLP's output, before the residual add (`attn_post_norm`,
    # `mlp_post_norm`).  OLMo 2 has only post norms; Gemma 2/3 and the MindSpeed sandwich norm have both.
    pre_norm: bool = True
    post_norm: bool = False
    # The sandwich norm's post-norm scales (MindSpeed-Core-MS / PanGu: --attn-post-norm-scale, --ffn-post-norm-scale):
    # the value the post norms' RMSNorm weights START at (`ones(hidden) * scale`, legacy/model/norm.py get_norm; the
    # forward is the plain RMSNorm), so a checkpoint's weights already hold them.  An initialisation fact carried
    # from the source for the trainer's init and the targets' configs; not the model's identity (None: not said).
    attn_post_norm_scale: float | None = dataclasses.field(default=None, compare=False)
    mlp_post_norm_scale: float | None = dataclasses.field(default=None, compare=False)
    qk_norm_scope: str = "head"  # QK_NORM_SCOPES: what one q/k norm covers (with qk_norm)
    # Gemma's facts.  norm_zero_centered: every RMSNorm multiplies by (1 + w), w stored (Megatron's
    # --apply-layernorm-1p); embed_scale: the embedding output times sqrt(hidden), rounded to the model's dtype;
    # softmax_scale: the attention scores' factor (None: 1 / sqrt(head_dim); Gemma query_pre_attn_scalar ** -0.5);
    # attn_softcap / logit_softcap: cap * tanh(x / cap) on the attention scores / the output logits;
    # sliding_layers: the layers sliding_window applies to (None: every layer; Gemma 2 every other one).
    norm_zero_centered: bool = False
    embed_scale: bool = False
    softmax_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    sliding_layers: list | None = None
    # Gemma 3: the sliding layers' own rope base, without rope_scaling (which then applies to the other layers)
    rope_local_base: float | None = None
    # gpt-oss's facts.  attn_sinks: a learned logit per head (`layers.N.attn.sinks`) joins each row of attention
    # scores in the softmax and is dropped after it (HF `self_attn.sinks`, megatron-core softmax_type learnable);
    # moe_router_logit_bias: the router linear has a bias added to its logits (`mlp.router.bias`), unlike
    # moe_router_bias (DeepSeek's choice-only correction); glu_clamp: a gated MLP's gate clamped above at this value
    # and its up both ways; glu_linear_offset: added to up before the product.  A MoE model with MLP biases
    # (has_mlp_bias) has biases on every routed expert's gate, up and down.
    attn_sinks: bool = False
    moe_router_logit_bias: bool = False
    glu_clamp: float | None = None
    glu_linear_offset: float = 0.0

    def __post_init__(self):
        for message in _problems(self):
            raise InteropError(f"invalid model spec: {message}")

    @property
    def gated_mlp(self) -> bool:
        return self.activation in ("swiglu", "geglu_tanh", "quick_geglu")

    def is_sliding_layer(self, i: int) -> bool:
        """Whether global layer `i` attends within sliding_window."""
        return self.sliding_window is not None and (self.sliding_layers is None or i in self.sliding_layers)

    @property
    def rotary_dim(self) -> int:
        """How many values of each q/k head rope turns (MLA: its decoupled rope part)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rotary_percent)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, i: int) -> bool:
        """Whether global layer `i` holds experts instead of a dense MLP."""
        return self.is_moe and (self.moe_layers is None or i in self.moe_layers)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of each q/k head without rope (head_dim is the whole q/k head)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def attn_out_dim(self) -> int:
        """Width of the attention output before o: heads * the value head."""
        return self.heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def is_mtp_moe(self) -> bool:
        """An MTP module's decoder layer is built like the model's last layer (megatron-core, DeepSeek-V3)."""
        return self.is_moe_layer(self.num_layers - 1)

    @property
    def has_mlp_bias(self) -> bool:
        return self.linear_bias if self.mlp_bias is None else self.mlp_bias

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for key, absent in OPTIONAL_FIELDS.items():  # as before these fields existed
            if data[key] == absent:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data, where: str | None = None) -> "ModelSpec":
        """A spec from stored fields (a manifest's `spec`, a YAML); `where` names the file in errors."""
        prefix = f"{where}: " if where else ""
        if not isinstance(data, dict):
            raise InteropError(f"{prefix}invalid model spec: expected an object of fields, found {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise InteropError(f"{prefix}invalid model spec: unknown fields {unknown}")
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
        if missing:
            raise InteropError(f"{prefix}invalid model spec: missing fields {missing}")
        try:
            return cls(**data)
        except InteropError as exc:
            raise InteropError(f"{prefix}{exc}") from None

    def differences(self, other: "ModelSpec", ignore=("dtype", "padded_vocab")) -> list[tuple[str, object, object]]:
        """(field, this value, other's) where two descriptions of one model disagree; the dtype and the
        padded rows are the files' facts, not a description's."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        identity = {f.name for f in dataclasses.fields(self) if f.compare}  # not the carried training dropouts
        return [(k, v, theirs[k]) for k, v in mine.items() if k in identity and k not in ignore and theirs[k] != v]

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def check_tp(self, tp: int) -> None:
        """Tensor parallelism splits heads, kv groups and the ffn evenly: refuse what does not divide."""
        for what, n in (("attention heads", self.heads), ("kv groups", self.kv_groups), ("ffn_hidden", self.ffn_hidden)):
            if tp < 1 or n % tp:
                raise InteropError(f"tp={tp} does not divide the {what} ({n})")
        if self.is_moe and tp > 1 and self.moe_ffn_hidden % tp:
            raise InteropError(f"tp={tp} does not divide the experts' ffn_hidden ({self.moe_ffn_hidden})")

    def check_etp(self, etp: int, tp: int) -> None:
        """Expert tensor parallelism splits each routed expert's ffn evenly (megatron-core's
        --expert-tensor-parallel-size, tp by default); a dense model has no experts to split otherwise."""
        if etp == tp:
            return
        if not self.is_moe:
            raise InteropError(f"--etp {etp} needs a mixture-of-experts model; this one is dense")
        if self.moe_ffn_hidden % etp:
            raise InteropError(f"etp={etp} does not divide the experts' ffn_hidden ({self.moe_ffn_hidden})")

    def check_ep(self, ep: int) -> None:
        """Expert parallelism gives each ep rank the same number of whole experts."""
        if ep == 1:
            return
        if not self.is_moe:
            raise InteropError(f"--ep {ep} needs a mixture-of-experts model; this one is dense")
        if self.num_experts % ep:
            raise InteropError(f"ep={ep} does not divide the {self.num_experts} experts")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problems(spec: ModelSpec):
    """What is wrong with each field, first the types (so later checks can do arithmetic), then ranges."""
    choices = {"arch": ARCHS, "norm": NORMS, "activation": ACTIVATIONS, "position": POSITIONS, "dtype": DTYPES}
    for name, allowed in choices.items():
        if getattr(spec, name) not in allowed:
            yield f"{name} must be one of {allowed}, got {getattr(spec, name)!r}"
    for name in INT_FIELDS:
        value = getattr(spec, name)
        if not _is_int(value):
            yield f"{name} must be an integer, got {value!r}"
        elif not 1 <= value <= (MAX_LAYERS if name == "num_layers" else MAX_SIZE):
            yield f"{name} must be between 1 and {MAX_LAYERS if name == 'num_layers' else MAX_SIZE:,}, got {value:,}"
    for name in BOOL_FIELDS:
        if not isinstance(getattr(spec, name), bool):
            yield f"{name} must be true or false, got {getattr(spec, name)!r}"
    if spec.mlp_bias is not None and not isinstance(spec.mlp_bias, bool):
        yield f"mlp_bias must be true, false or null, got {spec.mlp_bias!r}"
    if not _is_number(spec.norm_eps) or not 0 <= spec.norm_eps < 1:
        yield f"norm_eps must be a number in [0, 1), got {spec.norm_eps!r}"
    if not _is_number(spec.rope_base) or spec.rope_base <= 0:
        yield f"rope_base must be a positive number, got {spec.rope_base!r}"
    if _is_int(spec.heads) and _is_int(spec.kv_groups) and spec.kv_groups > 0 and spec.heads % spec.kv_groups:
        yield f"heads ({spec.heads}) must be a multiple of kv_groups ({spec.kv_groups})"
    if _is_int(spec.vocab) and _is_int(spec.padded_vocab) and spec.padded_vocab < spec.vocab:
        yield f"padded_vocab ({spec.padded_vocab}) must be >= vocab ({spec.vocab})"
    if spec.sliding_window is not None and not (_is_int(spec.sliding_window) and spec.sliding_window > 0):
        yield f"sliding_window must be a positive integer or None, got {spec.sliding_window!r}"
    for name in ("attention_dropout", "hidden_dropout"):
        value = getattr(spec, name)
        if value is not None and not (_is_number(value) and 0 <= value < 1):
            yield f"{name} must be a number in [0, 1) or None, got {value!r}"
    if spec.qk_norm and spec.norm != "rmsnorm":
        yield "qk_norm is an RMSNorm: it needs norm=rmsnorm"
    if spec.qk_norm_scope not in QK_NORM_SCOPES:
        yield f"qk_norm_scope must be one of {QK_NORM_SCOPES}, got {spec.qk_norm_scope!r}"
    elif spec.qk_norm_scope != "head" and not spec.qk_norm:
        yield "qk_norm_scope needs qk_norm"
    for name in ("softmax_scale", "attn_softcap", "logit_softcap"):
        value = getattr(spec, name)
        if value is not None and not (_is_number(value) and value > 0):
            yield f"{name} must be a positive number or None, got {value!r}"
    if spec.sliding_layers is not None:
        if spec.sliding_window is None:
            yield "sliding_layers needs sliding_window"
        elif not isinstance(spec.sliding_layers, (list, tuple)) or not all(
                _is_int(i) and 0 <= i < spec.num_layers for i in spec.sliding_layers):
            yield f"sliding_layers must be a list of layer numbers below {spec.num_layers}, got {spec.sliding_layers!r}"
    if spec.rope_local_base is not None and not (_is_number(spec.rope_local_base) and spec.rope_local_base > 0):
        yield f"rope_local_base must be a positive number or None, got {spec.rope_local_base!r}"
    if not (_is_number(spec.rotary_percent) and 0 < spec.rotary_percent <= 1):
        yield f"rotary_percent must be a number in (0, 1], got {spec.rotary_percent!r}"
    elif spec.rotary_percent != 1.0:
        dim = int(spec.head_dim * spec.rotary_percent) if _is_int(spec.head_dim) else 0
        if spec.position != "rope" or spec.kv_lora_rank is not None:
            yield "rotary_percent below 1 needs position=rope without multi-latent attention"
        elif dim < 2 or dim % 2:
            yield (f"rotary_percent {spec.rotary_percent} of head_dim {spec.head_dim} turns {dim} values: rope needs "
                   "an even number of them, at least 2")
    if spec.pre_norm is False and spec.post_norm is False:
        yield "a layer needs its norms somewhere: pre_norm, post_norm or both"
    for name in ("attn_post_norm_scale", "mlp_post_norm_scale"):
        value = getattr(spec, name)
        if value is not None and not (_is_number(value) and value >= 0):
            yield f"{name} must be a non-negative number or None, got {value!r}"
        elif value is not None and not spec.post_norm:
            yield f"{name} scales the post norms' initial weights: it needs post_norm"
        elif value is not None and value != 1.0 and spec.norm != "rmsnorm":  # PanGu's get_norm refuses it too
            yield f"{name} scales an RMSNorm's initial weight: a LayerNorm takes only 1.0, got {value!r}"
    if spec.glu_clamp is not None and not (_is_number(spec.glu_clamp) and spec.glu_clamp > 0):
        yield f"glu_clamp must be a positive number or None, got {spec.glu_clamp!r}"
    if not _is_number(spec.glu_linear_offset):
        yield f"glu_linear_offset must be a number, got {spec.glu_linear_offset!r}"
    if (spec.glu_clamp is not None or spec.glu_linear_offset != 0.0) and spec.activation != "quick_geglu":
        yield "glu_clamp and glu_linear_offset need activation=quick_geglu"
    if spec.attn_sinks and spec.is_mla:
        yield "attn_sinks are per attention head of q/k/v attention, not multi-latent attention"
    yield from moe_problems(spec)
    yield from mla_problems(spec)
    yield from mtp_problems(spec)
    if spec.rope_scaling is not None:
        if spec.position != "rope":
            yield "rope_scaling needs position=rope"
        yield from rope_scaling_problems(spec.rope_scaling, int(spec.head_dim * spec.rotary_percent)
                                         if _is_int(spec.head_dim) and _is_number(spec.rotary_percent) else None)


# Fields left out of `to_dict` when they hold their "absent" value, so older descriptions stay unchanged.
OPTIONAL_FIELDS = {"mlp_bias": None, "rotary_percent": 1.0, "qk_norm": False, "rope_scaling": None, "sliding_window": None,
                   "num_experts": None, "moe_topk": None, "moe_ffn_hidden": None, "moe_layers": None,
                   "moe_router_score": "softmax", "moe_norm_topk": True, "moe_router_bias": False,
                   "moe_aux_loss_coeff": 0.0, "shared_expert_ffn_hidden": None, "shared_expert_gate": False,
                   "moe_groups": None, "moe_group_topk": None, "moe_group_score": None, "moe_routed_scaling": 1.0,
                   "q_lora_rank": None, "kv_lora_rank": None, "qk_rope_head_dim": None, "v_head_dim": None,
                   "rope_interleave": False, "mtp_layers": 0, "mtp_loss_weight": 0.1,
                   "pre_norm": True, "post_norm": False, "qk_norm_scope": "head", "norm_zero_centered": False,
                   "embed_scale": False, "softmax_scale": None, "attn_softcap": None, "logit_softcap": None,
                   "sliding_layers": None, "rope_local_base": None, "attn_sinks": False,
                   "moe_router_logit_bias": False, "glu_clamp": None, "glu_linear_offset": 0.0,
                   "attention_dropout": None, "hidden_dropout": None, "attn_post_norm_scale": None,
                   "mlp_post_norm_scale": None}
MOE_ROUTER_SCORES = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("top2", "max")


def moe_problems(spec: ModelSpec):
    """A MoE spec names its experts, top-k and expert size together; a dense spec names none of them."""
    moe_fields = ("moe_topk", "moe_ffn_hidden", "moe_layers", "shared_expert_ffn_hidden")
    if spec.num_experts is None:
        named = [f for f in moe_fields if getattr(spec, f) is not None] + \
            [f for f in ("moe_router_bias", "shared_expert_gate", "moe_router_logit_bias") if getattr(spec, f)]
        named += [f for f in ("moe_groups", "moe_group_topk", "moe_group_score") if getattr(spec, f) is not None]
        if spec.moe_routed_scaling != 1.0:
            named.append("moe_routed_scaling")
        if named:
            yield f"{named[0]} needs num_experts"
        return
    for name in ("num_experts", "moe_topk", "moe_ffn_hidden"):
        value = getattr(spec, name)
        if not _is_int(value) or not 1 <= value <= MAX_SIZE:
            yield f"{name} must be a positive integer for a MoE model, got {value!r}"
            return
    if spec.moe_topk > spec.num_experts:
        yield f"moe_topk ({spec.moe_topk}) must not exceed num_experts ({spec.num_experts})"
    if spec.moe_layers is not None and (not isinstance(spec.moe_layers, (list, tuple)) or not all(
            _is_int(i) and 0 <= i < spec.num_layers for i in spec.moe_layers)):
        yield f"moe_layers must be a list of layer numbers below {spec.num_layers}, got {spec.moe_layers!r}"
        return
    moe_layers = spec.num_layers if spec.moe_layers is None else len(set(spec.moe_layers))
    if _is_int(spec.num_layers) and spec.num_experts * moe_layers > MAX_EXPERTS_IN_MODEL:
        yield (f"num_experts {spec.num_experts:,} x {moe_layers:,} MoE layers is more than {MAX_EXPERTS_IN_MODEL:,} "
               "experts in the model (DeepSeek-V3 has 14,848)")
    if spec.shared_expert_ffn_hidden is not None and not (
            _is_int(spec.shared_expert_ffn_hidden) and 1 <= spec.shared_expert_ffn_hidden <= MAX_SIZE):
        yield f"shared_expert_ffn_hidden must be a positive integer, got {spec.shared_expert_ffn_hidden!r}"
    if spec.shared_expert_gate and spec.shared_expert_ffn_hidden is None:
        yield "shared_expert_gate needs shared_expert_ffn_hidden"
    if spec.shared_expert_ffn_hidden is not None and spec.has_mlp_bias:
        yield "a shared expert with biases is not supported (routed experts with biases are: gpt-oss)"
    if spec.moe_router_score not in MOE_ROUTER_SCORES:
        yield f"moe_router_score must be one of {MOE_ROUTER_SCORES}, got {spec.moe_router_score!r}"
    if not _is_number(spec.moe_aux_loss_coeff) or spec.moe_aux_loss_coeff < 0:
        yield f"moe_aux_loss_coeff must be a number >= 0, got {spec.moe_aux_loss_coeff!r}"
    for name in ("moe_norm_topk", "moe_router_bias", "shared_expert_gate"):
        if not isinstance(getattr(spec, name), bool):
            yield f"{name} must be true or false, got {getattr(spec, name)!r}"
    if not _is_number(spec.moe_routed_scaling) or spec.moe_routed_scaling <= 0:
        yield f"moe_routed_scaling must be a positive number, got {spec.moe_routed_scaling!r}"
    yield from group_problems(spec)


def group_problems(spec: ModelSpec):
    """Group-limited routing: groups, how many a token keeps and how a group is scored, all or none."""
    fields = ("moe_groups", "moe_group_topk", "moe_group_score")
    named = [f for f in fields if getattr(spec, f) is not None]
    if not named:
        return
    if len(named) < 3:
        yield f"group-limited routing needs {', '.join(fields)} together, got only {', '.join(named)}"
        return
    for name in fields[:2]:
        value = getattr(spec, name)
        if not _is_int(value) or not 1 <= value <= MAX_SIZE:
            yield f"{name} must be a positive integer, got {value!r}"
            return
    if spec.moe_group_score not in MOE_GROUP_SCORES:
        yield f"moe_group_score must be one of {MOE_GROUP_SCORES}, got {spec.moe_group_score!r}"
    elif spec.num_experts % spec.moe_groups:
        yield f"moe_groups ({spec.moe_groups}) must divide num_experts ({spec.num_experts})"
    elif spec.moe_group_topk > spec.moe_groups:
        yield f"moe_group_topk ({spec.moe_group_topk}) must not exceed moe_groups ({spec.moe_groups})"
    elif spec.moe_topk > spec.moe_group_topk * (spec.num_experts // spec.moe_groups):
        yield (f"moe_topk ({spec.moe_topk}) exceeds the experts of the {spec.moe_group_topk} groups a token keeps "
               f"({spec.moe_group_topk * (spec.num_experts // spec.moe_groups)})")
    elif spec.moe_group_score == "top2" and spec.num_experts // spec.moe_groups < 2:
        yield "moe_group_score top2 needs at least 2 experts per group"


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")


def mla_problems(spec: ModelSpec):
    """Multi-latent attention: its ranks and head widths together, on a Llama-style rope model."""
    if not isinstance(spec.rope_interleave, bool):
        yield f"rope_interleave must be true or false, got {spec.rope_interleave!r}"
    elif spec.rope_interleave and spec.position != "rope":
        yield "rope_interleave needs position=rope"
    if spec.kv_lora_rank is None:
        named = [f for f in MLA_FIELDS if getattr(spec, f) is not None]
        if named:
            yield f"{named[0]} needs kv_lora_rank (multi-latent attention)"
        return
    for name in MLA_FIELDS:
        value = getattr(spec, name)
        if (value is not None or name != "q_lora_rank") and not (_is_int(value) and 1 <= value <= MAX_SIZE):
            yield f"{name} must be a positive integer for multi-latent attention, got {value!r}"
            return
    if spec.arch != "llama" or spec.position != "rope" or spec.norm != "rmsnorm":
        yield "multi-latent attention needs arch=llama, position=rope and norm=rmsnorm"
    elif spec.kv_groups != spec.heads:
        yield f"multi-latent attention has one k/v per head: kv_groups ({spec.kv_groups}) must equal heads ({spec.heads})"
    elif not spec.qk_rope_head_dim < spec.head_dim:
        yield (f"multi-latent attention: head_dim ({spec.head_dim}) is qk_nope_head_dim + qk_rope_head_dim and must "
               f"exceed qk_rope_head_dim ({spec.qk_rope_head_dim})")
    elif spec.qk_rope_head_dim % 2:
        yield f"qk_rope_head_dim must be even (rope rotates pairs), got {spec.qk_rope_head_dim}"
    elif spec.qkv_bias or spec.qk_norm:
        yield "multi-latent attention has no q/k/v biases or q/k norms (its compressions are normed)"


def mtp_problems(spec: ModelSpec):
    if not _is_int(spec.mtp_layers) or not 0 <= spec.mtp_layers <= MAX_LAYERS:
        yield f"mtp_layers must be an integer between 0 and {MAX_LAYERS:,}, got {spec.mtp_layers!r}"
    elif not _is_number(spec.mtp_loss_weight) or spec.mtp_loss_weight < 0:
        yield f"mtp_loss_weight must be a number >= 0, got {spec.mtp_loss_weight!r}"
    elif spec.mtp_layers and spec.arch != "llama":
        yield "multi-token prediction needs arch=llama"


ROPE_SCALING_TYPES = ("llama3", "longrope", "linear", "yarn")
ROPE_SCALING_KEYS = ("type", "factor", "low_freq_factor", "high_freq_factor", "original_max_positions")
# LongRoPE (Phi-3): per-frequency divisors of the base frequencies, `short_factor` for sequences up to
# `original_max_positions`, `long_factor` beyond, and cos / sin multiplied by `attention_factor`.
LONGROPE_KEYS = ("type", "short_factor", "long_factor", "original_max_positions", "attention_factor")
# YaRN (DeepSeek-V2/V3 long context): frequencies interpolated between beta_fast and beta_slow rotations, the
# attention scaled by mscale / mscale_all_dim (0: not given; transformers' yarn rope and DeepSeek's yarn_get_mscale)
YARN_KEYS = ("type", "factor", "original_max_positions", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# and optionally "truncate": False (gpt-oss): the correction range's ends kept fractional instead of floor / ceil
# (transformers' rope_parameters `truncate`, megatron-core's yarn_correction_range_round_to_int); absent: truncated


def rope_scaling_problems(scaling, head_dim: int | None = None):
    if isinstance(scaling, dict) and scaling.get("type") == "longrope":
        yield from _longrope_problems(scaling, head_dim)
    elif isinstance(scaling, dict) and scaling.get("type") == "linear":  # positions divided by factor (Gemma 3)
        if sorted(scaling) != ["factor", "type"] or not (_is_number(scaling["factor"]) and scaling["factor"] > 0):
            yield f"linear rope_scaling must be {{type, factor > 0}}, got {scaling!r}"
    elif isinstance(scaling, dict) and scaling.get("type") == "yarn":
        if scaling.get("truncate", False) is not False:
            yield f"yarn rope_scaling truncate is only ever stated false (absent: truncated), got {scaling['truncate']!r}"
        elif sorted(k for k in scaling if k != "truncate") != sorted(YARN_KEYS):
            yield f"rope_scaling must have exactly the keys {list(YARN_KEYS)}, got {scaling!r}"
        elif not all(_is_number(scaling[k]) and scaling[k] > 0 for k in YARN_KEYS[1:5]):
            yield f"yarn rope_scaling factor, original_max_positions and betas must be positive numbers, got {scaling!r}"
        elif not all(_is_number(scaling[k]) and scaling[k] >= 0 for k in YARN_KEYS[5:]):
            yield f"yarn rope_scaling mscale and mscale_all_dim must be numbers >= 0, got {scaling!r}"
    elif not isinstance(scaling, dict) or sorted(scaling) != sorted(ROPE_SCALING_KEYS):
        yield f"rope_scaling must have exactly the keys {list(ROPE_SCALING_KEYS)}, got {scaling!r}"
    elif scaling["type"] not in ROPE_SCALING_TYPES:
        yield f"rope_scaling type must be one of {ROPE_SCALING_TYPES}, got {scaling['type']!r}"
    elif not all(_is_number(scaling[k]) and scaling[k] > 0 for k in ROPE_SCALING_KEYS[1:]):
        yield f"rope_scaling values must be positive numbers, got {scaling!r}"
    elif scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        yield "rope_scaling high_freq_factor must exceed low_freq_factor"


def yarn_rope_scaling(factor: float, original_max_positions: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                      mscale: float = 0.0, mscale_all_dim: float = 0.0, truncate: bool = True) -> dict:
    """A YaRN rope_scaling fact; the betas default to the paper's (and transformers') 32 and 1."""
    out = {"type": "yarn", "factor": float(factor), "original_max_positions": int(original_max_positions),
           "beta_fast": float(beta_fast), "beta_slow": float(beta_slow), "mscale": float(mscale),
           "mscale_all_dim": float(mscale_all_dim)}
    if not truncate:
        out["truncate"] = False
    return out


def _longrope_problems(scaling: dict, head_dim: int | None):
    if sorted(scaling) != sorted(LONGROPE_KEYS):
        yield f"longrope rope_scaling must have exactly the keys {list(LONGROPE_KEYS)}, got {sorted(scaling)}"
        return
    for key in ("short_factor", "long_factor"):
        factors = scaling[key]
        if not isinstance(factors, list) or not all(_is_number(f) and f > 0 for f in factors):
            yield f"longrope {key} must be a list of positive numbers"
        elif head_dim is not None and len(factors) != head_dim // 2:
            yield f"longrope {key} must have rotary_dim / 2 = {head_dim // 2} values, got {len(factors)}"
    if not (_is_int(scaling["original_max_positions"]) and scaling["original_max_positions"] > 0):
        yield f"longrope original_max_positions must be a positive integer, got {scaling['original_max_positions']!r}"
    if not (_is_number(scaling["attention_factor"]) and scaling["attention_factor"] > 0):
        yield f"longrope attention_factor must be a positive number, got {scaling['attention_factor']!r}"


def longrope_scaling(short_factor, long_factor, original_max_positions: int, attention_factor: float) -> dict:
    return {"type": "longrope", "short_factor": [float(f) for f in short_factor],
            "long_factor": [float(f) for f in long_factor], "original_max_positions": int(original_max_positions),
            "attention_factor": float(attention_factor)}


def llama3_rope_scaling(factor: float, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_positions: int = 8192) -> dict:
    """A rope_scaling fact; the defaults are Llama-3.1's (and the only values megatron-core 0.16 uses)."""
    return {"type": "llama3", "factor": float(factor), "low_freq_factor": float(low_freq_factor),
            "high_freq_factor": float(high_freq_factor), "original_max_positions": int(original_max_positions)}


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)


def padded_to_tp(spec: ModelSpec, tp: int) -> int:
    """Embedding rows where only tp must divide them (the common format, MindSpore): the source's padding
    when tp divides it, otherwise the true vocabulary rounded up to a multiple of tp."""
    if spec.padded_vocab % tp == 0:
        return spec.padded_vocab
    return -(-spec.vocab // tp) * tp


def vocab_from_rows(rows: int, vocab: int | None, stated: int | None, where: str, stated_by: str = "args",
                    override: str = "--vocab-size N") -> tuple[int, int, list[str]]:
    """(true vocabulary, padded rows, notes) of a checkpoint whose vocab matrices hold `rows` rows.

    The rows in the file are the fact; the description gives the true vocabulary (`vocab`) and the rows
    beyond it are padding, whatever padding rule made them (Megatron's multiple of 128 x tp, MindSpeed's,
    none at all as mbridge saves).  Only a padded size the description states outright (`stated`: a
    Megatron checkpoint's own `padded_vocab_size`) is checked against the rows; `override` names the
    flag that takes the file's rows instead; `where` names the file and tensor ("path: name").  Fewer rows than the vocabulary is refused: tokens would
    have no embedding."""
    notes = []
    if stated is not None and int(stated) != rows:
        raise InteropError(f"{where} holds {rows} vocab rows, {stated_by} say padded_vocab_size={stated}: "
                           f"pass {override} (the true vocabulary) to take the file's {rows} rows")
    if not vocab:
        notes.append(f"the true vocabulary size is not recorded: keeping all {rows} rows")
        vocab = rows
    if rows < int(vocab):
        raise InteropError(f"{where} holds {rows} vocab rows, fewer than the vocabulary ({vocab})")
    return int(vocab), rows, notes
