"""ModelSpec: the framework-neutral description of a GPT2- or Llama-style decoder.

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
        ]
        for ok, message in checks:
            if not ok:
                raise InteropError(f"invalid model spec: {message}")

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "swiglu"

    @property
    def has_mlp_bias(self) -> bool:
        return self.linear_bias if self.mlp_bias is None else self.mlp_bias

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if data["mlp_bias"] is None:  # as before the field existed
            del data["mlp_bias"]
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


def padded_vocab_size(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)
