"""Gemma 2 (transformers' Gemma2ForCausalLM) as facts: four norms per layer (`pre_norm` and `post_norm`: the
sandwich), RMSNorm as (1 + w) (`norm_zero_centered`), the embedding times sqrt(hidden) in the model's dtype
(`embed_scale`), GeGLU with tanh GeLU (`activation: geglu_tanh`), query_pre_attn_scalar (`softmax_scale`),
attention and final logit soft-capping (`attn_softcap`, `logit_softcap`), the window on every other layer
(`sliding_layers`), tied embeddings.

Confirmed in the sources: transformers 5.24 models/gemma2/modeling_gemma2.py (Gemma2RMSNorm `output * (1.0 +
self.weight.float())`, Gemma2Model `normalizer = torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)`,
eager_attention_forward's `tanh(scores / softcap) * softcap`, Gemma2ForCausalLM's final_logit_softcapping,
`layer_types`); Megatron-Bridge src/megatron/bridge/models/gemma/gemma2_bridge.py: the norms after attention and MLP
are `self_attention.linear_proj.post_layernorm.weight` / `mlp.linear_fc2.post_layernorm.weight`, and
`layernorm_zero_centered_gamma: True` (megatron-core's --apply-layernorm-1p) stores the same w as HF;
query_pre_attn_scalar, attn_logit_softcapping and final_logit_softcapping are provider fields
(gemma2_provider.py), which interop's Megatron args carry under the same names. megatron-core 0.16.1's own
GPTModel cannot compute soft-capping or post norms without the bridge's modules: no megatron-core oracle here.
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
def gemma2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    model = F.build("gemma2")
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        return root / "hf", model(TOKENS).logits


def test_config_facts_and_autoconfig(gemma2, tmp_path):
    src, _ = gemma2
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    assert (spec.pre_norm, spec.post_norm, spec.norm_zero_centered, spec.embed_scale, spec.tied_embeddings) == \
        (True, True, True, True, True)
    assert spec.activation == "geglu_tanh" and spec.softmax_scale == 24 ** -0.5
    assert (spec.attn_softcap, spec.logit_softcap) == (3.0, 5.0)
    assert spec.sliding_window == F.SLIDING_WINDOW and spec.sliding_layers == [0, 2]
    written = hf_config_from_spec(spec)
    assert written["architectures"] == ["Gemma2ForCausalLM"]
    assert spec_from_hf_config(json.loads(json.dumps(written))) == spec
    (tmp_path / "config.json").write_text(json.dumps(written))
    ours, theirs = transformers.AutoConfig.from_pretrained(tmp_path), transformers.AutoConfig.from_pretrained(src)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "hidden_activation", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types",
                "tie_word_embeddings", "pad_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key


def test_hf_megatron_round_trip_and_reference_model(gemma2, tmp_path):
    """HF -> Megatron torch tp2/pp2 -> torch_dist tp2/pp2 -> HF bit for bit, the same logits in transformers, and
    the reference model's logits equal transformers' (verify)."""
    src, logits = gemma2
    convert(src, tmp_path / "torch", dst_format="megatron", tp=2, pp=2)
    state = torch.load(tmp_path / "torch" / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    args = vars(state["args"])
    assert (args["layernorm_zero_centered_gamma"], args["gated_linear_unit"], args["openai_gelu"]) == (True, True, True)
    assert (args["attn_logit_softcapping"], args["final_logit_softcapping"], args["embedding_scale"]) == (3.0, 5.0, True)
    assert args["window_size"] == (F.SLIDING_WINDOW - 1, 0) and args["window_attn_skip_freq"] == 2
    assert "decoder.layers.1.self_attention.linear_proj.post_layernorm.weight" in state["model"]
    assert "decoder.layers.1.mlp.linear_fc2.post_layernorm.weight" in state["model"]
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", tp=2, pp=2, options={"format": "torch_dist"})
    convert(tmp_path / "dist", tmp_path / "back", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Gemma2ForCausalLM"
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, logits)
    result = verify(src, tmp_path / "dist")
    assert result.ok, "\n".join(result.lines())


def test_targets_without_the_facts_refuse(gemma2, tmp_path):
    src, _ = gemma2
    # MindSpeed holds the sandwich's four norms (use_sandwich_norm), not Gemma's (1 + w) RMSNorm
    with pytest.raises(InteropError, match=r"mindspeed names hold no norm_zero_centered=True \(its model computes "
                                           r"norm_zero_centered=False\); the formats holding it: hf"):
        convert(src, tmp_path / "ms", dst_format="mindspore")
    assert not (tmp_path / "ms").exists()
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    with pytest.raises(InteropError,
                       match=r"HF llama cannot hold norms before and after attention and MLP \(gemma2, gemma3_text can\)"):
        hf_config_from_spec(spec, model_type="llama")
    with pytest.raises(InteropError, match=r"HF llama cannot hold attn_softcap=3.0 \(gemma2, gemma3_text can\)"):
        hf_config_from_spec(spec.replace(pre_norm=True, post_norm=False, norm_zero_centered=False, embed_scale=False,
                                         activation="swiglu", softmax_scale=None, logit_softcap=None,
                                         sliding_layers=None, sliding_window=None))


def test_trainer_parity_with_transformers(gemma2, tmp_path):
    """The reference trainer at 1x1 / 2x1 / 1x2 and transformers' Gemma2ForCausalLM (eager attention, soft-capped)
    train alike for 10 steps (the tied head over two stages at 1x2)."""
    src, _ = gemma2
    convert(src, tmp_path / "common", dst_format="interop")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=1e-3, warmup=2)
    result = parity(tmp_path / "common", cfg, layouts=[(1, 1, 1), (2, 1, 1), (1, 2, 1)], frameworks=["torch", "hf"])
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "hf"]
    assert result.max_diff < 1e-5, result.table()
