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
from helpers.mindformers_mcore import deepseek3_model as mindformers_model, strict_load
from interop.convert import convert
from interop.io.ms_ckpt import load_ckpt

ms = pytest.importorskip("mindspore")

KINDS = {"v3-mtp": (lambda: v3_config(num_hidden_layers=3), True),
         "v2-lite": (lambda: v2_config(num_hidden_layers=3, topk_method="greedy"), False)}


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


def test_pipeline_stages_keep_the_mtp_module_on_the_last(tmp_path):
    """pp 2: MindFormers' rank files per stage (strategy files beside them); the MTP module on the last stage."""
    save(v3_config(num_hidden_layers=4), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", pp=2, options={"dialect": "mindformers-mcore"})
    first, last = (load_ckpt(tmp_path / "ms" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in (0, 1))
    assert "mtp.layers.0.eh_proj.weight" in last and not any(k.startswith("mtp.") for k in first)
    convert(tmp_path / "ms", tmp_path / "back", dst_format="hf")
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
