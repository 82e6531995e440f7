"""Phi-3 (transformers' Phi3ForCausalLM): Llama's facts stored with q, k, v fused in `qkv_proj` [q; k; v] and gate,
up in `gate_up_proj` [gate; up], a window on every layer when `sliding_window` is set, and LongRoPE
(`rope_type` "longrope": short / long factors, attention factor) where the config has it.

Layouts confirmed in the sources: transformers 5.24 models/phi3/modeling_phi3.py (Phi3Attention slices qkv_proj's
output at heads * head_dim and + kv_heads * head_dim; Phi3MLP `gate, up_states = up_states.chunk(2, dim=-1)`),
modeling_rope_utils.py `_compute_longrope_parameters` / `longrope_frequency_update` (long factors when the sequence
exceeds original_max_position_embeddings; attention factor sqrt(1 + ln f / ln original)).  The fused layouts are
PlainConcat's and GatedMLP's at tp 1 (interop/transforms/concat.py, tests/core/test_transforms.py).
Megatron-Bridge src/megatron/bridge/models/phi/phi3_causal_bridge.py maps the same tensors onto megatron-core's
linear_qkv (QKVMapping) and linear_fc1 (GatedMLPMapping), Llama's Megatron names: interop's Megatron rows.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import helpers.family_models as F
from interop.convert import convert
from interop.errors import InteropError
from interop.mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from interop.trainer.config import TrainConfig
from interop.workflows.parity import parity
from interop.workflows.verify import verify

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, F.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    out = {}
    for kind in ("phi3", "phi3-longrope"):
        model = F.build(kind)
        model.save_pretrained(root / kind)
        with torch.no_grad():
            out[kind] = (root / kind, model(TOKENS).logits)
    return out


def hf_spec(path):
    return spec_from_hf_config(json.loads((path / "config.json").read_text()))


def test_config_facts_and_autoconfig(phi3, tmp_path):
    window, longrope = hf_spec(phi3["phi3"][0]), hf_spec(phi3["phi3-longrope"][0])
    assert window.sliding_window == F.SLIDING_WINDOW and window.rope_scaling is None
    assert not (window.qkv_bias or window.linear_bias or window.has_mlp_bias)
    scaling = longrope.rope_scaling
    assert scaling["type"] == "longrope" and scaling["original_max_positions"] == 8
    assert scaling["short_factor"] == [1.0, 1.1, 1.2, 1.3] and scaling["long_factor"] == [2.0, 2.5, 3.0, 3.5]
    assert abs(scaling["attention_factor"] - (1 + torch.log(torch.tensor(64 * 1024 / 8)) / torch.log(
        torch.tensor(8.0))).sqrt().item()) < 1e-6  # max_position_embeddings / original, as transformers
    for spec, src in ((window, phi3["phi3"][0]), (longrope, phi3["phi3-longrope"][0])):
        written = hf_config_from_spec(spec, model_type="phi3")
        assert written["architectures"] == ["Phi3ForCausalLM"]
        assert spec_from_hf_config(json.loads(json.dumps(written))) == spec
        (tmp_path / "config.json").write_text(json.dumps(written))
        ours, theirs = transformers.AutoConfig.from_pretrained(tmp_path), transformers.AutoConfig.from_pretrained(src)
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "num_key_value_heads", "vocab_size", "rms_norm_eps", "sliding_window", "pad_token_id"):
            assert getattr(ours, key) == getattr(theirs, key), key
    # without --family the facts pick the class that holds them: Mistral (a window), Phi-3 (longrope)
    assert hf_config_from_spec(window)["model_type"] == "mistral"
    assert hf_config_from_spec(longrope)["model_type"] == "phi3"
    with pytest.raises(InteropError, match="HF llama cannot hold longrope scaling \\(phi3 can: --family phi3\\)"):
        hf_config_from_spec(longrope, model_type="llama")


def test_megatron_round_trip_is_bit_exact(phi3, tmp_path):
    """HF Phi-3 -> Megatron torch tp2/pp2 -> torch_dist tp2/pp2 -> HF --family phi3: the same tensors bit for
    bit; without --family it is written as the Mistral it is, with the same logits."""
    src, logits = phi3["phi3"]
    convert(src, tmp_path / "torch", dst_format="megatron", tp=2, pp=2)
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", tp=2, pp=2, options={"format": "torch_dist"})
    convert(tmp_path / "dist", tmp_path / "back", dst_format="hf", options={"family": "phi3"})
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and "model.layers.0.self_attn.qkv_proj.weight" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    convert(tmp_path / "dist", tmp_path / "mistral", dst_format="hf")
    for path, cls in ((tmp_path / "back", "Phi3ForCausalLM"), (tmp_path / "mistral", "MistralForCausalLM")):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        assert type(model).__name__ == cls
        with torch.no_grad():
            assert torch.equal(model(TOKENS).logits, logits)


def test_longrope_through_interop_and_its_megatron_note(phi3, tmp_path):
    """LongRoPE survives the interop format (long factors: 12 tokens > the original 8); Megatron's args cannot
    say it, which the summary notes."""
    src, logits = phi3["phi3-longrope"]
    convert(src, tmp_path / "io", dst_format="interop", tp=2)
    convert(tmp_path / "io", tmp_path / "back", dst_format="hf", options={"family": "phi3"})
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, logits)
        assert torch.equal(model(TOKENS[:, :6]).logits, F.build("phi3-longrope")(TOKENS[:, :6]).logits)  # short
    assert verify(src, tmp_path / "io").ok
    summary = convert(src, tmp_path / "meg", dst_format="megatron", tp=1, pp=1)
    assert any("no longrope scaling" in note for note in summary.notes), summary.notes


def test_trainer_parity_with_transformers(phi3, tmp_path):
    """The reference trainer (longrope's long factors: 16 tokens > 8) at 1x1 / 2x1 / 1x2 and transformers'
    Phi3ForCausalLM train alike for 10 steps."""
    src, _ = phi3["phi3-longrope"]
    convert(src, tmp_path / "common", dst_format="interop")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=1e-3, warmup=2)
    result = parity(tmp_path / "common", cfg, layouts=[(1, 1, 1), (2, 1, 1), (1, 2, 1)], frameworks=["torch", "hf"])
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "hf"]
    assert result.max_diff < 1e-5, result.table()


def test_family_option_refuses_what_it_cannot_hold(phi3, tmp_path):
    """`--family` names a family interop writes and one that holds the model, else one line, nothing written."""
    src, _ = phi3["phi3"]
    with pytest.raises(InteropError, match="HF family 'phi4' is not one interop writes"):
        convert(src, tmp_path / "a", dst_format="hf", options={"family": "phi4"})
    spec = hf_spec(src).replace(qkv_bias=True)
    with pytest.raises(InteropError, match="HF phi3 has no biases"):
        hf_config_from_spec(spec, model_type="phi3")
    assert not (tmp_path / "a").exists()


def test_partial_rotary_phi3_through_megatron_and_mindspore(tmp_path):
    """Phi-3 with partial_rotary_factor 0.5 (Phi3RotaryEmbedding / apply_rotary_pos_emb: rotate-half on the first
    head_dim * factor values, GLM-4.5's fact): Megatron's --rotary-percent and the MindSpore store keep it; verify
    checks transformers, megatron-core's GPTModel (rotary_percent) and interop's model in MindSpore ops."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(**{**F.COMMON, "head_dim": 16}, tie_word_embeddings=False, pad_token_id=None,
                                     partial_rotary_factor=0.5)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path / "src")
    assert hf_spec(tmp_path / "src").rotary_dim == 8
    convert(tmp_path / "src", tmp_path / "meg", dst_format="megatron", tp=2)
    convert(tmp_path / "meg", tmp_path / "back", dst_format="hf", options={"family": "phi3"})
    a, b = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]["partial_rotary_factor"] == 0.5
    convert(tmp_path / "src", tmp_path / "ms", dst_format="mindspore", options={"dialect": "mindspeed"})
    for out, label in (("meg", "megatron-core, converted (megatron)"),
                       ("ms", "interop's model in mindspore ops, converted (mindspore)")):
        result = verify(tmp_path / "src", tmp_path / out)
        assert result.ok and label in [c.label for c in result.checks], result.lines()
