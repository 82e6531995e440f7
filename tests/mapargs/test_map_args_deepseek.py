"""map-args carries DeepSeek-V3's facts both ways: multi-latent attention, group-limited routing, routed scaling,
dense first layers, shared experts, MTP and YaRN, between Megatron's flags (and MindSpeed-LLM's spellings) and
transformers' DeepseekV3Config, each side checked by its own parser / config class."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from interop import mapargs
from interop.errors import InteropError
from interop.mappings import megatron_args as M
from interop.mappings import megatron_spec as S
from helpers.mapargs_loaders import UPSTREAM, _flags, parse_megatron, run

FIXTURES = Path(__file__).parents[1] / "fixtures" / "args"
DEEPSEEK = FIXTURES / "mindspeedllm_deepseek3_671b.sh"  # MindSpeed-LLM's real DeepSeek-V3 671B launch script


def _parsed(args, dest):
    """A flag Megatron's parser left at None was not written: Megatron's default applies (the table's)."""
    value = getattr(args, dest)
    return M.ARGS[dest].default if value is None else value


def test_mindspeed_deepseek3_script_becomes_deepseek_v3s_own_config():
    """The 671B script's MLA, routing, MTP and MindSpeed-spelled YaRN flags give DeepSeek-V3's config.json values,
    and transformers' DeepseekV3Config takes the result."""
    from transformers import DeepseekV3Config

    result = mapargs.map_args(DEEPSEEK, "hf", env={"1": "/c"})
    doc = json.loads(result.text)
    assert doc["model_type"] == "deepseek_v3" and doc["architectures"] == ["DeepseekV3ForCausalLM"]
    want = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
            "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
            "rope_interleave": True, "num_key_value_heads": 128}
    assert {k: doc[k] for k in want} == want
    assert doc["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0,
                                      "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0}
    config = DeepseekV3Config(**{k: v for k, v in doc.items() if k not in ("model_type", "architectures")})
    assert (config.qk_head_dim, config.n_group, config.num_mtp_layers) == (192, 8, 1)
    lost = {e.flag for e in result.entries if e.lost}
    for flag in ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--v-head-dim",
                 "--qk-pos-emb-head-dim", "--moe-router-num-groups", "--moe-router-group-topk",
                 "--moe-router-topk-scaling-factor", "--moe-router-score-function", "--moe-router-enable-expert-bias",
                 "--mtp-num-layers", "--rope-scaling-type", "--rope-scaling-factor", "--rope-scaling-mscale",
                 "--rope-scaling-mscale-all-dim", "--rope-scaling-original-max-position-embeddings", "--beta-fast",
                 "--first-k-dense-replace", "--n-shared-experts"):
        assert flag not in lost, flag
    assert "--mtp-loss-scaling-factor" in lost  # a training weight no config.json key holds: named


def test_deepseek_v3_config_to_megatron_flags_and_back(tmp_path):
    """transformers' DeepseekV3Config -> flags core_v0.16's own parser accepts (MLA, groups, scaling, MTP, yarn)
    -> config.json again with the same model values."""
    from transformers import DeepseekV3Config

    doc = DeepseekV3Config(vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                           num_experts_per_tok=4,
                           n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}).to_dict()
    doc["model_type"] = "deepseek_v3"
    src = tmp_path / "config.json"
    src.write_text(json.dumps(doc))
    code, out, err = run(src, "--to", "megatron", "--from", "hf")
    assert code == 0, err
    assert set(_flags(out)) <= UPSTREAM
    args = parse_megatron(out)
    assert args.multi_latent_attention and args.qk_layernorm
    assert tuple(_parsed(args, d) for d in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                             "v_head_dim")) == (48, 32, 16, 8, 16)
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    assert tuple(_parsed(args, d) for d in ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")) == \
        ("yarn", 4.0, 1.0, 1.0)
    assert args.mtp_num_layers == 1 and M.moe_layer_pattern(args.moe_layer_freq, 4) == [0, 1, 1, 1]
    (tmp_path / "megatron.txt").write_text(out)
    again = json.loads(mapargs.map_args(tmp_path / "megatron.txt", "hf").text)
    for key in ("model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts",
                "num_nextn_predict_layers", "rope_parameters", "n_routed_experts", "num_experts_per_tok"):
        assert again[key] == doc[key], key


def test_megatron_args_state_every_deepseek_fact_or_refuse():
    """ModelSpec -> Megatron args -> ModelSpec is the identity for a DeepSeek-V3 spec; what megatron-core would
    compute differently (a group score other than the sum of two, MLA without its compression norms) is refused."""
    from helpers.deepseek_models import v3_config
    from interop.layout import ParallelLayout
    from interop.mappings.hf_config import spec_from_hf_config

    config = v3_config(num_experts_per_tok=4)
    spec = spec_from_hf_config({**config.to_dict(), "model_type": "deepseek_v3"})
    args = S.args_from_spec(spec, ParallelLayout.build(spec.num_layers))
    assert S.spec_from_args(M.complete(args), "args", "float32") == spec
    with pytest.raises(InteropError, match="sum of its moe_router_topk // moe_router_group_topk best"):
        S.model_args(spec.replace(moe_topk=2))
    with pytest.raises(InteropError, match="multi_latent_attention without qk_layernorm"):
        S.spec_from_args(M.complete({**args, "qk_layernorm": False}), "args", "float32")
    with pytest.raises(InteropError, match="rotates interleaved pairs"):
        S.model_args(spec.replace(rope_interleave=False))
