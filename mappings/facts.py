"""Which ModelSpec fact brings a canonical tensor, and which formats can hold that fact: the one line a
format says when its names have no place for a tensor (`no_place`).

Kept as data beside the name tables it summarises; a fact added to `interop.spec` with tensors of its own adds
one row here.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

# the post norms: HF's OLMo 2 / Gemma, megatron-core's (Megatron-Bridge) names, and MindSpeed's sandwich norm with
# the pre norms (Megatron legacy names as MindSpeed patches them; MindSpeed-Core-MS)
_POST_NORM_W = ("hf (olmo2, gemma2), megatron (megatron-core names; legacy names as a sandwich with the pre norms), "
                "mindspore --dialect mindspeed (sandwich with the pre norms), interop")
_POST_NORM_B = ("megatron (megatron-core names; legacy names as a sandwich with the pre norms), mindspore --dialect "
                "mindspeed (sandwich with the pre norms), interop")
# canonical name suffix (`*` matches any part: an expert's number) -> (ModelSpec fact, the formats holding its tensors)
FACT_OF_TENSOR = {
    ".attn_post_norm.weight": ("post_norm", _POST_NORM_W),
    ".attn_post_norm.bias": ("post_norm", _POST_NORM_B),
    ".mlp_post_norm.weight": ("post_norm", _POST_NORM_W),
    ".mlp_post_norm.bias": ("post_norm", _POST_NORM_B),
    ".attn.q_norm.weight": ("qk_norm", "hf (qwen3, qwen3_moe, olmo2), megatron (megatron-core names), "
                                       "mindspore --dialect mindformers-mcore, interop"),
    ".attn.k_norm.weight": ("qk_norm", "hf (qwen3, qwen3_moe, olmo2), megatron (megatron-core names), "
                                       "mindspore --dialect mindformers-mcore, interop"),
    ".attn.sinks": ("attn_sinks", "hf (gpt_oss), megatron (megatron-core names), interop"),
    ".mlp.router.bias": ("moe_router_logit_bias", "hf (gpt_oss), megatron (megatron-core names), interop"),
    ".mlp.experts.*.bias": ("has_mlp_bias (biased experts)", "hf (gpt_oss), megatron (megatron-core names, "
                                                             "sequential or te_grouped experts), interop"),
}
# multi-latent attention and MTP modules (DeepSeek-V2 / V3)
_MLA = ("multi-latent attention (kv_lora_rank)", "hf (deepseek_v3, deepseek_v2), megatron (megatron-core names), "
        "mindspore --dialect mindformers-mcore, interop")
FACT_OF_TENSOR |= {suffix: _MLA for suffix in (".attn.q_down.weight", ".attn.q_down_norm.weight", ".attn.q_up.weight",
                                               ".attn.kv_down.weight", ".attn.kv_down_norm.weight", ".attn.kv_up.weight")}
FACT_OF_TENSOR |= {suffix: ("mtp_layers", "hf (deepseek_v3), megatron (megatron-core names), mindspore --dialect "
                                          "mindformers-mcore, interop")
                   for suffix in (".enorm.weight", ".hnorm.weight", ".eh_proj.weight")}


def no_place(where: str, name: str) -> str | None:
    """`where` (e.g. "MindSpore mindspeed names") has no row for canonical tensor `name`: the line that says the
    fact and its holders, or None for a tensor no fact here brings."""
    for suffix, (fact, holders) in FACT_OF_TENSOR.items():
        if fnmatchcase(name, "*" + suffix):
            return f"{where} have no place for {name}: the model's {fact} is held by {holders}"
    return None
