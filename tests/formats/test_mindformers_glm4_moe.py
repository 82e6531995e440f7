"""GLM-4.5 (transformers' Glm4MoeForCausalLM, with its MTP module) in MindFormers 2.1.0's mcore-style names
(`--dialect mindformers-mcore`).

MindFormers 2.1.0 ships glm4_moe for inference only (models/glm4_moe/modeling_glm4_moe.py: `Glm4MoeForCausalLM`
raises "Train mode is not supported" outside RUN_MODE=predict, and its inference model reads HF safetensors), and its
`Glm4MoeConfigConverter` (models/glm4_moe/config_converter_glm4_moe.py) maps no `num_nextn_predict_layers`.  The
oracle is therefore what its training models are made of: the training-graph `GPTModel` (parallel_core/
training_graph/base_models/gpt/gpt_model.py) built from `Glm4MoeConfig.convert_to_transformer_config()`, with
`get_gpt_decoder_block_spec` and `get_gpt_mtp_block_spec` and mtp_num_layers set, exactly as
models/deepseek3/modeling_deepseek_v3_train.py builds DeepSeek-V3 (q/k/v biases, q/k norms, sigmoid routing with the
expert bias, shared experts, dense first layer, the MTP module `mtp.layers.0.*`).  What interop writes loads into it
strictly; what that model saves reads back to the HF tensors bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import helpers.glm_models as G
from helpers.mindformers_mcore import strict_load
from interop.convert import convert

ms = pytest.importorskip("mindspore")

MF = dict(compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
          softmax_compute_dtype="float32", rotary_dtype="float32", seq_length=8, moe_grouped_gemm=True)
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
        "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
        "use_qk_norm")


def mindformers_model(hf_config):
    from mindformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_mtp_block_spec)
    from mindformers.parallel_core.training_graph.base_models.gpt.gpt_model import GPTModel
    rope = hf_config.rope_parameters
    config = Glm4MoeConfig(**{k: getattr(hf_config, k) for k in KEYS},
                           partial_rotary_factor=rope["partial_rotary_factor"], **MF).convert_to_transformer_config()
    config.mtp_num_layers = hf_config.num_nextn_predict_layers  # as DeepseekV3ConfigConverter maps it
    spec = get_gpt_decoder_block_spec(config)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=config.vocab_size,
                    max_sequence_length=config.max_position_embeddings,
                    position_embedding_type=config.position_embedding_type,
                    rotary_percent=rope["partial_rotary_factor"], rotary_base=rope["rope_theta"],
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec))



def test_mindformers_gpt_model_of_glm45_loads_interops_output_and_saves_it_back(tmp_path, mcore):
    hf = G.save(G.config(), tmp_path / "hf", mtp=True)
    convert(tmp_path / "hf", tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindformers-mcore"})
    model = mindformers_model(hf.config)
    held = strict_load(model, tmp_path / "ms" / "model.ckpt")
    src = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(held["decoder.layers.1.self_attention.q_layernorm.weight"],
                       src["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(held["decoder.layers.2.mlp.router.expert_bias"],
                       src["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert torch.equal(held["mtp.layers.0.eh_proj.weight"], src["model.layers.4.eh_proj.weight"])
    assert torch.equal(held["mtp.layers.0.transformer_layer.self_attention.linear_proj.weight"],
                       src["model.layers.4.self_attn.o_proj.weight"])
    (tmp_path / "saved").mkdir()
    ms.save_checkpoint(model, str(tmp_path / "saved" / "model.ckpt"))  # MindFormers' own file, no sidecar
    convert(tmp_path / "saved", tmp_path / "back", dst_format="hf",
            options={"model_config": str(tmp_path / "hf" / "config.json")})
    a, b = src, load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
