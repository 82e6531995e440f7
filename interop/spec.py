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
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
POSITIONS = ("learned", "rope")
DTYPES = ("float32", "bfloat16", "float16")


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
    tied_embeddings: bool = True
    qkv_bias: bool = False  # biases on q, k, v
    linear_bias: bool = False  # biases on o, gate/up and down
    mlp_bias: bool | None = None  # gate/up and down when unlike o (HF Llama attention_bias without mlp_bias)
    dtype: str = "float32"
    qk_norm: bool = False  # RMSNorm over each q and k head (weights [head_dim], shared by the heads): Qwen3
    rope_scaling: dict | None = None  # {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    #                                    "original_max_positions"}: Llama-3.x long-context frequencies
    sliding_window: int | None = None  # every layer attends to at most this many positions (itself included)

    def __post_init__(self):
        checks = [
            (self.arch in ARCHS, f"arch must be one of {ARCHS}, got {self.arch!r}"),
            (self.norm in NORMS, f"norm must be one of {NORMS}, got {self.norm!r}"),
            (self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}"),
            (self.position in POSITIONS, f"position must be one of {POSITIONS}, got {self.position!r}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.num_layers > 0 and self.hidden > 0 and self.heads > 0, "num_layers, hidden and heads must be positive"),
            (self.kv_groups > 0 and self.heads % self.kv_groups == 0,
             f"heads ({self.heads}) must be a multiple of kv_groups ({self.kv_groups})"),
            (self.padded_vocab >= self.vocab > 0,
             f"padded_vocab ({self.padded_vocab}) must be >= vocab ({self.vocab}) > 0"),
            (self.sliding_window is None or (isinstance(self.sliding_window, int)
                                             and not isinstance(self.sliding_window, bool) and self.sliding_window > 0),
             f"sliding_window must be a positive integer or None, got {self.sliding_window!r}"),
            (not self.qk_norm or self.norm == "rmsnorm", "qk_norm is an RMSNorm: it needs norm=rmsnorm"),
            (self.rope_scaling is None or self.position == "rope", "rope_scaling needs position=rope"),
        ]
        for ok, message in checks:
            if not ok:
                raise InteropError(f"invalid model spec: {message}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "swiglu"

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
    def from_dict(cls, data: dict) -> "ModelSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InteropError(f"invalid model spec: unknown fields {unknown}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise InteropError(f"invalid model spec: {exc}") from None

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def check_tp(self, tp: int) -> None:
        """Tensor parallelism splits heads, kv groups and the ffn evenly: refuse what does not divide."""
        for what, n in (("attention heads", self.heads), ("kv groups", self.kv_groups), ("ffn_hidden", self.ffn_hidden)):
            if tp < 1 or n % tp:
                raise InteropError(f"tp={tp} does not divide the {what} ({n})")


# Fields left out of `to_dict` when they hold their "absent" value, so older descriptions stay unchanged.
OPTIONAL_FIELDS = {"mlp_bias": None, "qk_norm": False, "rope_scaling": None, "sliding_window": None}
ROPE_SCALING_TYPES = ("llama3",)
ROPE_SCALING_KEYS = ("type", "factor", "low_freq_factor", "high_freq_factor", "original_max_positions")


def check_rope_scaling(scaling) -> None:
    if not isinstance(scaling, dict) or sorted(scaling) != sorted(ROPE_SCALING_KEYS):
        raise InteropError(f"invalid model spec: rope_scaling must have exactly the keys {list(ROPE_SCALING_KEYS)}, "
                           f"got {scaling!r}")
    if scaling["type"] not in ROPE_SCALING_TYPES:
        raise InteropError(f"invalid model spec: rope_scaling type must be one of {ROPE_SCALING_TYPES}, "
                           f"got {scaling['type']!r}")
    numbers = [scaling[k] for k in ROPE_SCALING_KEYS[1:]]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in numbers):
        raise InteropError(f"invalid model spec: rope_scaling values must be positive numbers, got {scaling!r}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise InteropError("invalid model spec: rope_scaling high_freq_factor must exceed low_freq_factor")


def llama3_rope_scaling(factor: float, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_positions: int = 8192) -> dict:
    """A rope_scaling fact; the defaults are Llama-3.1's (and the only values megatron-core 0.16 uses)."""
    return {"type": "llama3", "factor": float(factor), "low_freq_factor": float(low_freq_factor),
            "high_freq_factor": float(high_freq_factor), "original_max_positions": int(original_max_positions)}


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)
