"""MindFormers 2.1.0's deepseek3 (mcore-style, `--dialect mindformers-mcore`): multi-latent attention and MTP.

The oracle is MindFormers' own TrainingDeepseekV3ForCausalLM built on CPU (models/deepseek3/
modeling_deepseek_v3_train.py; parallel_core/training_graph/transformer/multi_latent_attention.py
MLASelfAttentionConcatenated, its default mla_qkv_concat=True: `linear_qkv` = [q_down; kv_down] split as
(q_lora_rank, kv_lora_rank, qk_pos_emb_head_dim), `linear_qb` = q_up, `linear_kvb` = kv_up, `q_layernorm` /
`k_layernorm` the compression norms; MTP as `mtp.layers.K.{enorm, hnorm, eh_proj, transformer_layer.*,
final_layernorm}`).  What interop writes from a transformers-made DeepSeek loads into it strictly with the HF
values; what MindFormers saves reads back to the HF tensors bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.deepseek_models import save, v2_config, v3_config
from helpers.hostile import assert_one_error, run
from helpers.mindformers_mcore import strict_load
from interop.convert import convert
from interop.io.ms_ckpt import load_ckpt

ms = pytest.importorskip("mindspore")

# the MindFormers config of each HF model (float32 everywhere; grouped experts, its only MoE layer)
MF = dict(compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
          softmax_compute_dtype="float32", rotary_dtype="float32", seq_length=8, moe_grouped_gemm=True,
          qk_layernorm=True)
KINDS = {"v3-mtp": (lambda: v3_config(num_hidden_layers=3), True),
         "v2-lite": (lambda: v2_config(num_hidden_layers=3, topk_method="greedy"), False)}


def mindformers_model(hf_config):
    """TrainingDeepseekV3ForCausalLM for the same model (MindFormers' DeepseekV3Config takes HF's keys)."""
    from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config
    from mindformers.models.deepseek3.modeling_deepseek_v3_train import TrainingDeepseekV3ForCausalLM
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "num_experts_per_tok",
            "first_k_dense_replace", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    values = {k: getattr(hf_config, k) for k in keys}
    greedy = getattr(hf_config, "topk_method", None) == "greedy"  # no groups (MindFormers' default is 8)
    values.update(n_group=1 if greedy else hf_config.n_group, topk_group=1 if greedy else hf_config.topk_group)
    if hf_config.model_type == "deepseek_v2":  # softmax scores, no score-correction bias
        values.update(moe_router_enable_expert_bias=False, moe_router_score_function="softmax")
    return TrainingDeepseekV3ForCausalLM(DeepseekV3Config(
        **values, num_nextn_predict_layers=getattr(hf_config, "num_nextn_predict_layers", 0) or 0, **MF))



@pytest.mark.parametrize("kind", list(KINDS))
def test_mindformers_deepseek3_loads_interops_output_with_the_hf_values(tmp_path, mcore, kind):
    config, mtp = KINDS[kind]
    hf = save(config(), tmp_path / "hf", mtp=mtp)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    held = strict_load(mindformers_model(hf.config), tmp_path / "ms" / "model.ckpt")
    src = load_file(tmp_path / "hf" / "model.safetensors")
    attn = "decoder.layers.1.self_attention."
    down = ["model.layers.1.self_attn.q_a_proj.weight"] if hf.config.q_lora_rank else \
        ["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(held[attn + "linear_qkv.weight"],
                       torch.cat([src[down[0]], src["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]]))
    assert torch.equal(held[attn + "linear_kvb.weight"], src["model.layers.1.self_attn.kv_b_proj.weight"])
    assert torch.equal(held[attn + "k_layernorm.weight"], src["model.layers.1.self_attn.kv_a_layernorm.weight"])
    if hf.config.q_lora_rank:
        assert torch.equal(held[attn + "linear_qb.weight"], src["model.layers.1.self_attn.q_b_proj.weight"])
        assert torch.equal(held[attn + "q_layernorm.weight"], src["model.layers.1.self_attn.q_a_layernorm.weight"])
    if mtp:
        assert torch.equal(held["mtp.layers.0.eh_proj.weight"], src["model.layers.3.eh_proj.weight"])
        assert torch.equal(held["mtp.layers.0.final_layernorm.weight"], src["model.layers.3.shared_head.norm.weight"])
        assert torch.equal(held["mtp.layers.0.transformer_layer.self_attention.linear_kvb.weight"],
                           src["model.layers.3.self_attn.kv_b_proj.weight"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_checkpoint_mindformers_saved_reads_back_to_the_hf_tensors(tmp_path, mcore, kind):
    config, mtp = KINDS[kind]
    hf = save(config(), tmp_path / "hf", mtp=mtp)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    model = mindformers_model(hf.config)
    strict_load(model, tmp_path / "ms" / "model.ckpt")
    (tmp_path / "saved").mkdir()
    ms.save_checkpoint(model, str(tmp_path / "saved" / "model.ckpt"))  # MindFormers' own file, no sidecar
    summary = convert(tmp_path / "saved", tmp_path / "back", dst_format="hf",
                      options={"model_config": str(tmp_path / "hf" / "config.json")})
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert any("mla_qkv_concat=True" in n for n in summary.notes), summary.notes


def test_mla_at_tp2_and_the_unconcatenated_layout_are_refused_in_one_line(tmp_path):
    save(v3_config(num_hidden_layers=2), tmp_path / "hf")
    assert_one_error(*run("convert", tmp_path / "hf", tmp_path / "out", "--to", "mindspore", "--dialect",
                          "mindformers-mcore", "--tp", "2"), "not tp=2")
    assert not (tmp_path / "out").exists()


def test_pipeline_stages_keep_the_mtp_module_on_the_last(tmp_path):
    """pp 2: MindFormers' rank files per stage (strategy files beside them); the MTP module on the last stage."""
    save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", pp=2, options={"dialect": "mindformers-mcore"})
    first, last = (load_ckpt(tmp_path / "ms" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in (0, 1))
    assert "mtp.layers.0.eh_proj.weight" in last and not any(k.startswith("mtp.") for k in first)
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
