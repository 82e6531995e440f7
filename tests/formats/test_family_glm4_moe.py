"""GLM-4.5 (transformers' Glm4MoeForCausalLM): partial rotary (rope on the first head_dim * partial_rotary_factor
values of each head, rotate-half within that part: transformers 5.24 models/glm4_moe/modeling_glm4_moe.py
apply_rotary_pos_emb, megatron-core's --rotary-percent in models/common/embeddings/rotary_pos_embedding.py and
rope_utils.py, the same split), q/k/v biases (o_proj never), optional q/k norms (use_qk_norm), DeepSeek-V3's sigmoid
group-limited routing with the correction bias, shared experts, dense first layers and MTP modules, kept both ways.

Megatron names as Megatron-Bridge maps GLM-4.5 (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/glm/
glm45_bridge.py: linear_qkv weight and bias (QKVMapping), q_layernorm / k_layernorm, router.weight /
router.expert_bias <- mlp.gate.weight / e_score_correction_bias, shared_experts.linear_fc1 (GatedMLPMapping), the MTP
module `mtp.layers.{k}.{enorm, hnorm, eh_proj, final_layernorm}` and `mtp.layers.{k}.transformer_layer.*` <-
model.layers.{num_layers + k}.*; its provider sets rotary_percent from partial_rotary_factor, sigmoid scoring with
expert bias, moe_layer_freq [0] * first_k_dense_replace + [1] * the rest, mtp_num_layers).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import helpers.glm_models as G
from interop.convert import convert
from interop.errors import InteropError
from interop.mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from interop.store import StoreReader

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, G.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    out = {}
    for kind, cfg, mtp in (("glm-mtp", G.config(), True), ("glm-air", G.config(use_qk_norm=False, n_group=1,
                                                                               topk_group=1, attention_bias=False,
                                                                               routed_scaling_factor=1.0), False)):
        model = G.save(cfg, root / kind, mtp=mtp)
        with torch.no_grad():
            out[kind] = (root / kind, model(TOKENS).logits)
    return out


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def assert_same_tensors(a, b):
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for key in x:
        assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


def test_config_facts_and_autoconfig(glm, tmp_path):
    src, _ = glm["glm-mtp"]
    given = json.loads((src / "config.json").read_text())
    spec = spec_from_hf_config(given)
    assert spec.rotary_percent == 0.5 and spec.rotary_dim == 8 and spec.qkv_bias and not spec.linear_bias
    assert spec.qk_norm and spec.kv_groups == 2 and spec.moe_router_score == "sigmoid" and spec.moe_router_bias
    assert (spec.moe_groups, spec.moe_group_topk, spec.moe_group_score, spec.moe_routed_scaling) == (2, 1, "top2", 2.5)
    assert spec.moe_layers == [1, 2, 3] and spec.shared_expert_ffn_hidden == 32 and spec.mtp_layers == 1
    written = hf_config_from_spec(spec)
    assert written["architectures"] == ["Glm4MoeForCausalLM"] and spec_from_hf_config(written) == spec
    (tmp_path / "config.json").write_text(json.dumps(written))
    ours, theirs = transformers.AutoConfig.from_pretrained(tmp_path), transformers.AutoConfig.from_pretrained(src)
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "attention_bias", "use_qk_norm", "n_group",
                "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "num_nextn_predict_layers",
                "rope_parameters"):
        assert getattr(ours, key) == getattr(theirs, key), key
    # a config naming no partial_rotary_factor is Glm4MoeConfig's 0.5
    del given["rope_parameters"]["partial_rotary_factor"]
    assert spec_from_hf_config(given).rotary_percent == 0.5


def test_hf_to_interop_to_hf_is_byte_exact_with_transformers_logits(glm, tmp_path):
    for kind, (src, logits) in glm.items():
        convert(src, tmp_path / kind / "store", dst_format="interop", tp=2)
        convert(tmp_path / kind / "store", tmp_path / kind / "hf", dst_format="hf")
        assert_same_tensors(src, tmp_path / kind / "hf")
        assert torch.equal(hf_logits(tmp_path / kind / "hf"), logits)
    store = StoreReader(tmp_path / "glm-mtp" / "store")
    names = {m.name for m in store.metas()}
    assert {"mtp.0.eh_proj.weight", "mtp.0.layer.attn.q.bias", "mtp.0.layer.attn.k_norm.weight",
            "mtp.0.layer.mlp.router.expert_bias", "mtp.0.layer.mlp.shared.down.weight"} <= names


def test_megatron_tp2_ep2_round_trip_is_bit_exact_with_bridge_names(glm, tmp_path):
    """HF -> Megatron torch tp2/ep2 -> torch_dist tp2/pp2/ep2 -> HF: the same tensors bit for bit, MTP included,
    under megatron-core's / Megatron-Bridge's names, with the facts in Megatron's args."""
    src, logits = glm["glm-mtp"]
    convert(src, tmp_path / "torch", dst_format="megatron", tp=2, ep=2)
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", tp=2, pp=2, ep=2,
            options={"format": "torch_dist"})
    convert(tmp_path / "dist", tmp_path / "back", dst_format="hf")
    assert_same_tensors(src, tmp_path / "back")
    assert torch.equal(hf_logits(tmp_path / "back"), logits)
    saved = torch.load(next((tmp_path / "torch").glob("*/mp_rank_01_001/model_optim_rng.pt")), weights_only=False)
    args, keys = saved["args"], set(saved["model"])
    assert (args.rotary_percent, args.mtp_num_layers, args.moe_router_score_function) == (0.5, 1, "sigmoid")
    assert args.moe_router_enable_expert_bias and args.add_qkv_bias and args.qk_layernorm and not args.add_bias_linear
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert args.moe_layer_freq == [0, 1, 1, 1] and args.moe_shared_expert_intermediate_size == 32
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.self_attention.linear_qkv.bias",
            "mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
            "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight",
            "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight"} <= keys
    assert saved["model"]["mtp.layers.0.eh_proj.weight"].shape == (32, 128)  # column-parallel over tp 2


def test_partial_rotary_refused_where_the_class_rotates_the_whole_head(glm):
    spec = spec_from_hf_config(json.loads((glm["glm-air"][0] / "config.json").read_text()))
    dense = spec.replace(num_experts=None, moe_topk=None, moe_ffn_hidden=None, moe_layers=None,
                         shared_expert_ffn_hidden=None, moe_router_score="softmax", moe_router_bias=False,
                         moe_groups=None, moe_group_topk=None, moe_group_score=None, mtp_layers=0)
    with pytest.raises(InteropError, match=r"HF qwen2 cannot hold partial rotary \(rotary_percent=0.5: phi3, glm4_moe"):
        hf_config_from_spec(dense.replace(qkv_bias=True))
    assert hf_config_from_spec(dense, model_type="phi3")["rope_parameters"]["partial_rotary_factor"] == 0.5
    with pytest.raises(InteropError, match="partial_rotary_factor=0.25: transformers' llama rotates the whole head"):
        spec_from_hf_config({**hf_config_from_spec(dense.replace(rotary_percent=1.0)),
                             "partial_rotary_factor": 0.25})
    with pytest.raises(InteropError, match="rope needs an even number of them"):
        spec.replace(rotary_percent=0.2)  # 3 values of 16


def test_verify_megatron_core_builds_and_loads_it_strictly(glm, tmp_path):
    """verify: the reference model, transformers and megatron-core's own GPTModel (rotary_percent 0.5, sigmoid
    routing in groups with expert bias and scaling, its MultiTokenPredictionBlock loaded strictly from the MTP
    rows) give the same logits, and the MTP modules compare tensor by tensor and by their own heads' logits."""
    from interop.workflows.verify import verify
    src, _ = glm["glm-mtp"]
    convert(src, tmp_path / "meg", dst_format="megatron", tp=2, ep=2)
    result = verify(src, tmp_path / "meg")
    assert result.ok, result.lines()
    labels = [c.label for c in result.checks]
    assert "megatron-core, converted (megatron)" in labels
    assert labels[-1] == "reference model, converted: MTP module 1 (tokens 2 ahead)" and result.checks[-1].max_diff == 0
    assert result.max_diff < 1e-5


def test_megatron_te_names_place_the_mtp_layer_like_a_moe_layer_on_the_last_stage(glm):
    """Transformer Engine's spec (read): the MTP module's layer is built like the last (MoE) layer, so it keeps
    its pre-MLP norm apart (`pre_mlp_layernorm`, not a fused `linear_fc1.layer_norm_weight`), its input norm fused
    into linear_qkv; every MTP row lives on the last pipeline stage."""
    from interop.converters.megatron.rows import expand_rows
    from interop.layout import ParallelLayout
    spec = spec_from_hf_config(json.loads((glm["glm-mtp"][0] / "config.json").read_text()))
    rows = expand_rows("mcore_te", spec, ParallelLayout.build(spec.num_layers, tp=2, pp=2, ep=2), moe_norm_apart=True)
    mtp = {row.key: row for row in rows if row.key.startswith("mtp.")}
    assert {"mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight"} <= set(mtp)
    assert "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight" not in mtp
    assert {row.stage for row in mtp.values()} == {1}
    assert sum(1 for row in rows for part in row.parts if part == "mtp.0.layer.mlp_norm.weight") == 1


def test_transformers_in_memory_stacked_experts_are_read(tmp_path):
    """save_pretrained(save_original_format=False) stores experts as transformers 5 holds them
    (`mlp.experts.gate_up_proj` [E, 2F, h], `down_proj`): read, and written back as the hub's per-expert names."""
    model = G.build(G.config(num_nextn_predict_layers=0))
    model.save_pretrained(tmp_path / "src", save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "src" / "model.safetensors")
    convert(tmp_path / "src", tmp_path / "hf", dst_format="hf")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(hf_logits(tmp_path / "hf"), model(TOKENS).logits)
