"""Gemma 3 (transformers' Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's facts (tests/formats/
test_family_gemma2.py) plus q/k norms per head as (1 + w), the sliding layers' own rope base (`rope_local_base`)
and linear rope scaling on the full-attention layers (`rope_scaling: {type: linear, factor}`), with soft-capping
off by default.  One new fact each; the names and the post norms are Gemma 2's / OLMo 2's rows.

Confirmed in the sources: transformers 5.24 models/gemma3/modeling_gemma3.py (Gemma3Attention q_norm / k_norm
Gemma3RMSNorm(head_dim); Gemma3RotaryEmbedding one inv_freq per layer type from rope_parameters
{full_attention, sliding_attention}; `_compute_linear_scaling_rope_parameters` inv_freq / factor);
Megatron-Bridge src/megatron/bridge/models/gemma/gemma3_bridge.py (`rotary_base = (rope_local_base_freq,
rope_theta)`, `rope_scaling_factor`, `q_layernorm` / `k_layernorm`, the post_layernorm names), kept in interop's
Megatron args as `rotary_base_local` / `rope_linear_factor`.
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
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    model = F.build("gemma3")
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        return root / "hf", model(TOKENS).logits


def test_config_facts_and_autoconfig(gemma3, tmp_path):
    src, _ = gemma3
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    assert spec.qk_norm and spec.norm_zero_centered and spec.embed_scale and spec.post_norm and spec.pre_norm
    assert spec.rope_base == 1e6 and spec.rope_local_base == 7000.0
    assert spec.rope_scaling == {"type": "linear", "factor": 8.0}
    assert spec.sliding_layers == [0, 1, 2, 3, 4] and spec.attn_softcap is None and spec.logit_softcap is None
    written = hf_config_from_spec(spec)
    assert written["model_type"] == "gemma3_text" and written["architectures"] == ["Gemma3ForCausalLM"]
    assert spec_from_hf_config(json.loads(json.dumps(written))) == spec
    (tmp_path / "config.json").write_text(json.dumps(written))
    ours, theirs = transformers.AutoConfig.from_pretrained(tmp_path), transformers.AutoConfig.from_pretrained(src)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "sliding_window", "layer_types", "tie_word_embeddings", "rope_parameters"):
        assert getattr(ours, key) == getattr(theirs, key), key


def test_megatron_round_trip_and_reference_model(gemma3, tmp_path):
    src, logits = gemma3
    convert(src, tmp_path / "torch", dst_format="megatron", tp=2, pp=2)
    args = vars(torch.load(tmp_path / "torch" / "release" / "mp_rank_00_000" / "model_optim_rng.pt",
                           weights_only=False)["args"])
    assert (args["rotary_base"], args["rotary_base_local"], args["rope_linear_factor"]) == (1000000, 7000.0, 8.0)
    assert args["qk_layernorm"] and args["layernorm_zero_centered_gamma"] and not args["use_rope_scaling"]
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", tp=2, pp=2, options={"format": "torch_dist"})
    convert(tmp_path / "dist", tmp_path / "back", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, logits)
    result = verify(src, tmp_path / "dist")
    assert result.ok, "\n".join(result.lines())


def test_families_without_the_facts_refuse(gemma3):
    src, _ = gemma3
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    with pytest.raises(InteropError, match="HF gemma2 cannot hold a rope base of its own for sliding layers"):
        hf_config_from_spec(spec, model_type="gemma2")


def test_trainer_parity_with_transformers(gemma3, tmp_path):
    src, _ = gemma3
    convert(src, tmp_path / "common", dst_format="interop")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=1e-3, warmup=2)
    result = parity(tmp_path / "common", cfg, layouts=[(1, 1, 1), (2, 1, 1), (1, 2, 1)], frameworks=["torch", "hf"])
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "hf"]
    assert result.max_diff < 1e-5, result.table()
