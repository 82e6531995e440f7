"""Model facts by name, for the forwards that compute only some of them (megatron-core's GPT model with its local
layer spec, interop's model in mindspore ops): each says which it computes, `uncomputed` names the others a model
has, for the note that says why that framework did not run.  Every forward computes the plain decoder (pre-norm,
rope or learned positions, GQA, biases, SwiGLU or GeLU, a window on every layer) and is not asked about it."""
from __future__ import annotations

from ..spec import ModelSpec

PLAIN_ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")


def facts(spec: ModelSpec) -> list[str]:
    """The facts `spec` has beyond the plain decoder, by name."""
    scaling = spec.rope_scaling["type"] if spec.rope_scaling is not None else None
    has = {"mixture of experts": spec.is_moe, "multi-latent attention": spec.is_mla,
           "MTP modules": spec.mtp_layers > 0,
           "post_norm": spec.post_norm and spec.pre_norm,  # the sandwich: norms before and after each block
           "post_norm without pre_norm": not spec.pre_norm,
           "qk_norm": spec.qk_norm and spec.qk_norm_scope == "head",
           f"qk_norm_scope {spec.qk_norm_scope}": spec.qk_norm and spec.qk_norm_scope != "head",
           f"activation {spec.activation}": spec.activation not in PLAIN_ACTIVATIONS,
           "embed_scale": spec.embed_scale, "norm_zero_centered": spec.norm_zero_centered,
           "attn_softcap": spec.attn_softcap is not None, "logit_softcap": spec.logit_softcap is not None,
           "softmax_scale": spec.softmax_scale is not None, "sliding_layers": spec.sliding_layers is not None,
           "rope_local_base": spec.rope_local_base is not None, f"rope_scaling {scaling}": scaling is not None,
           "attn_sinks": spec.attn_sinks}
    return [name for name, present in has.items() if present]


def uncomputed(spec: ModelSpec, computes: frozenset) -> list[str]:
    """The facts of `spec` a forward that computes `computes` does not."""
    return [name for name in facts(spec) if name not in computes]
