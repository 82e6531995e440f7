"""Loading a checkpoint into one of MindFormers' mcore-style models strictly, as its own training would."""
from __future__ import annotations

import torch

STATISTICS = ("expert_load", "fi_accu")  # the MoE router's training counters: not weights


def strict_load(model, path) -> dict:
    """Every parameter loaded but the router's counters, nothing left over; the model's parameters by saved name."""
    import mindspore as ms
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(path)), strict_load=True)
    assert unused == [], unused
    assert all(n.endswith(STATISTICS) for n in not_loaded), not_loaded
    return {p.name: torch.from_numpy(p.asnumpy().copy()) for _, p in model.parameters_and_names()}


# the MindFormers config (deepseek3_model) of each HF model (float32 everywhere; grouped experts, its only MoE layer)
MF = dict(compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
          softmax_compute_dtype="float32", rotary_dtype="float32", seq_length=8, moe_grouped_gemm=True,
          qk_layernorm=True)


def deepseek3_model(hf_config):
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


def same_hf(a, b) -> None:
    """Two HF folders hold the same tensors, bit for bit."""
    from safetensors.torch import load_file
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y) and [k for k in x if not torch.equal(x[k], y[k])] == []


def assert_back_to_hf(ms_dir, hf_dir, tmp_path) -> None:
    """MindFormers rank files written by interop come back to the HF checkpoint bit for bit: with interop's sidecar
    (`mindspore_model.json`), and without it (the layout from the files, the model from --model-config)."""
    from helpers.hostile import run
    from interop.convert import convert
    convert(ms_dir, tmp_path / "back", dst_format="hf")
    same_hf(hf_dir, tmp_path / "back")
    (ms_dir / "mindspore_model.json").unlink()
    code, out = run("convert", ms_dir, tmp_path / "bare", "--to", "hf", "--model-config", hf_dir / "config.json", "-q")
    assert code == 0, out
    same_hf(hf_dir, tmp_path / "bare")
