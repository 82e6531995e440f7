"""Megatron args <-> Hugging Face config.json, for GPT2 and Llama.

The architecture is the model's: "llama" when RMSNorm + SwiGLU + RoPE, else
"gpt2". What a config.json cannot say (a GPT2 without
biases, a Llama with GeLU) is not forced: it shows up as a loss in the report.
`vocab_size` is the padded vocabulary, the rows the weights really have.
"""
from __future__ import annotations

from ..errors import InteropError
from .megatron_args import CONST, R, Unmappable

GPT2_ACT = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
GPT2_ACT_BACK = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


def _untie(v, doc):
    return {"untie_embeddings_and_output_weights": not v}


def _gpt2_act(act):
    if act not in GPT2_ACT:
        raise Unmappable(f"GPT2 has no {act} activation")
    return GPT2_ACT[act]


def _llama_act(act):
    if act != "swiglu":
        raise Unmappable(f"Llama's MLP is SwiGLU, not {act}")
    return "silu"


def _llama_bias(qkv, linear):
    if qkv != linear:
        raise Unmappable("Llama's attention_bias covers q, k, v and o together; Megatron has qkv bias "
                         f"{qkv} with linear bias {linear}")
    return linear


def _kv_heads_back(v, doc):
    return {"num_query_groups": v, "group_query_attention": v != doc.get("num_attention_heads")}


def _dtype_back(v, doc):
    return {"params_dtype": v} if v in ("float32", "bfloat16", "float16") else {}


GPT2 = [
    CONST("model_type", "gpt2"),
    CONST("architectures", ["GPT2LMHeadModel"]),
    R("num_layers", "n_layer"),
    R("hidden_size", "n_embd"),
    R("num_attention_heads", "n_head"),
    R("ffn_hidden_size", "n_inner"),
    R("max_position_embeddings", "n_positions"),
    R("padded_vocab_size", "vocab_size"),
    R("norm_epsilon", "layer_norm_epsilon"),
    R("activation", "activation_function", to=_gpt2_act,
      back=lambda v, doc: {"activation": GPT2_ACT_BACK.get(v, v)}),
    R("untie_embeddings_and_output_weights", "tie_word_embeddings", True, to=lambda v: not v, back=_untie),
    R("hidden_dropout", "resid_pdrop"),
    R("hidden_dropout", "embd_pdrop"),
    R("attention_dropout", "attn_pdrop"),
    R("init_method_std", "initializer_range"),
    R("params_dtype", "torch_dtype", back=_dtype_back),
]

LLAMA = [
    CONST("model_type", "llama"),
    CONST("architectures", ["LlamaForCausalLM"]),
    R("num_layers", "num_hidden_layers"),
    R("hidden_size", "hidden_size"),
    R("ffn_hidden_size", "intermediate_size"),
    R("num_attention_heads", "num_attention_heads"),
    R("num_query_groups", "num_key_value_heads", back=_kv_heads_back),
    R("kv_channels", "head_dim"),
    R("max_position_embeddings", "max_position_embeddings"),
    R("padded_vocab_size", "vocab_size"),
    R("norm_epsilon", "rms_norm_eps"),
    R("rotary_base", "rope_theta", back=lambda v, doc: {"rotary_base": int(v) if float(v).is_integer() else v}),
    R("rotary_base", "rope_parameters", to=lambda base: {"rope_theta": float(base), "rope_type": "default"},
      back=lambda v, doc: {}),
    R("activation", "hidden_act", to=_llama_act, back=lambda v, doc: {"activation": "swiglu" if v == "silu" else v}),
    R("untie_embeddings_and_output_weights", "tie_word_embeddings", False, to=lambda v: not v, back=_untie),
    R(("add_qkv_bias", "add_bias_linear"), "attention_bias", to=_llama_bias,
      back=lambda v, doc: {"add_qkv_bias": v}),
    R("add_bias_linear", "mlp_bias", False),
    R("attention_dropout", "attention_dropout"),
    R("init_method_std", "initializer_range"),
    R("params_dtype", "torch_dtype", back=_dtype_back),
]

# What the architecture itself implies on the Megatron side when reading a config.json back.
IMPLIED = {
    "gpt2": {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute"},
    "llama": {"normalization": "RMSNorm", "position_embedding_type": "rope", "add_bias_linear": False},
}


def arch_of(full: dict) -> str:
    llama = full["normalization"] == "RMSNorm" and full["swiglu"] and full["position_embedding_type"] == "rope"
    return "llama" if llama else "gpt2"


def rows_for(full: dict):
    return LLAMA if full and arch_of(full) == "llama" else GPT2


def normalize_doc(doc: dict) -> dict:
    """transformers 5 writes `dtype` and `rope_parameters: {rope_theta, rope_type}`; 4.x wrote
    `torch_dtype` and `rope_theta`. Read either: the 4.x keys the rows use, filled from the 5.x ones."""
    doc = dict(doc)
    rope = doc.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope and doc.get("rope_theta") is None:
            doc["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") == "default":
            doc.pop("rope_parameters")  # said entirely by rope_theta
    if doc.get("dtype") is not None and doc.get("torch_dtype") is None:
        doc["torch_dtype"] = doc["dtype"]
    if doc.get("dtype") == doc.get("torch_dtype"):
        doc.pop("dtype", None)
    return doc


def rows_for_doc(doc: dict, where: str):
    model_type = doc.get("model_type")
    if model_type not in IMPLIED:
        raise InteropError(f"{where}: model_type {model_type!r} is not supported (gpt2 and llama are)")
    implied = IMPLIED[model_type]
    table = LLAMA if model_type == "llama" else GPT2
    first = R((), "model_type", model_type, to=lambda: model_type, back=lambda v, d: dict(implied))
    return [first] + table[1:]


def require(full: dict) -> None:
    """A config.json must say how many embedding rows there are."""
    if full.get("padded_vocab_size") is None:
        raise InteropError("hf: the vocabulary size is unknown: give --vocab-size N (or --tokenizer-type "
                           "GPT2BPETokenizer / Llama2Tokenizer)")
