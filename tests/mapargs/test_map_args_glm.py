"""map-args carries GLM-4.5's facts both ways between transformers' Glm4MoeConfig and Megatron's flags (checked by
Megatron-LM core_v0.16.1's own parser): --rotary-percent (partial_rotary_factor), --add-qkv-bias without
--add-bias-linear (attention_bias on q, k, v only), --qk-layernorm (use_qk_norm), DeepSeek-V3's routing flags
(sigmoid, expert bias, groups, scaling), shared experts, dense first layers (--moe-layer-freq), --mtp-num-layers."""
from __future__ import annotations

import json

import pytest

from interop import mapargs
from interop.mappings import megatron_args as M
from helpers.mapargs_loaders import UPSTREAM, _flags, parse_megatron, run

transformers = pytest.importorskip("transformers")
KEYS = ("model_type", "hidden_size", "num_key_value_heads", "head_dim", "attention_bias", "use_qk_norm", "n_group",
        "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "num_nextn_predict_layers",
        "rope_parameters", "vocab_size")


@pytest.mark.parametrize("factor,qk_norm,groups,topk", [(0.5, True, 2, 2), (0.25, False, 1, 4)])
def test_glm45_config_to_megatron_flags_and_back(tmp_path, factor, qk_norm, groups, topk):
    """Two groups of which a token keeps one (megatron-core sums a group's topk // group_topk = 2 best, as
    transformers), and GLM-4.5's own one group (the group scores choose nothing)."""
    doc = transformers.Glm4MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=topk,
        n_group=groups, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=qk_norm, attention_bias=True,
        first_k_dense_replace=1, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}).to_dict()
    src = tmp_path / "config.json"
    src.write_text(json.dumps(doc))
    code, out, err = run(src, "--to", "megatron", "--from", "hf")
    assert code == 0, err
    assert set(_flags(out)) <= UPSTREAM
    args = parse_megatron(out)
    assert args.rotary_percent == factor and args.add_qkv_bias and not args.add_bias_linear
    assert bool(args.qk_layernorm) == qk_norm and args.mtp_num_layers == 1
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == \
        (groups, 1, 2.5)
    assert args.moe_shared_expert_intermediate_size == 32 and (args.moe_router_topk or 2) == topk
    assert M.moe_layer_pattern(args.moe_layer_freq, 4) == [0, 1, 1, 1]
    (tmp_path / "megatron.txt").write_text(out)
    again = json.loads(mapargs.map_args(tmp_path / "megatron.txt", "hf").text)
    for key in KEYS:
        assert again[key] == doc[key], key


def test_rotary_percent_to_a_family_without_it_is_reported(tmp_path):
    """A dense Llama with --rotary-percent 0.5: no HF class interop writes for those facts rotates part of the
    head except phi3 / glm4_moe, so the written config says what it could not hold, and map-args reports it."""
    script = tmp_path / "train.sh"
    script.write_text("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                      "--ffn-hidden-size 96 --normalization RMSNorm --swiglu --position-embedding-type rope "
                      "--disable-bias-linear --rotary-percent 0.5 --vocab-size 1000 --add-qkv-bias "
                      "--max-position-embeddings 256 --seq-length 128\n")
    code, out, err = run(script, "--to", "hf")
    assert code == 0, err
    assert "rotary_percent" in out + err and "phi3, glm4_moe" in out + err
