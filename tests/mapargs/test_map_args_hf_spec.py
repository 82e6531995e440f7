"""map-args' Hugging Face target goes through ModelSpec (issue 14, "one model description").

For every family, Megatron args -> `interop map-args --to hf` writes the config.json that the HF
writer (`hf_config_from_spec`, what `interop convert --to hf` writes) writes for the same model, but for
the training values map-args carries from the args; and `--from hf` reads it back to the same ModelSpec.
transformers' own config classes read each written file.
"""
from __future__ import annotations

import json

import pytest

from interop import mapargs
from interop.converters.megatron.args import explicit_args
from interop.layout import ParallelLayout
from interop.mappings import megatron_args as M
from interop.mappings.hf_args import TRAINING_KEYS
from interop.mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from interop.mappings.megatron_spec import args_from_spec, spec_from_args

_LLAMA = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6)
FAMILIES = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                 activation_function="gelu_new"),
    "gpt2-exact-gelu": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                            activation_function="gelu", tie_word_embeddings=False),
    "llama": dict(model_type="llama", **_LLAMA),
    "qwen2": dict(model_type="qwen2", **_LLAMA, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", **_LLAMA, head_dim=24),
    "mistral": dict(model_type="mistral", **_LLAMA, sliding_window=32),
    "llama3": dict(model_type="llama", **_LLAMA, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "mixtral": dict(model_type="mixtral", **_LLAMA, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", **_LLAMA, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                      norm_topk_prob=True),
}
# What a config.json holds that is training, not the model: map-args takes it from the args.
TRAINING = {key for rows in TRAINING_KEYS.values() for _, key in rows} | {"output_router_logits",
                                                                          "router_jitter_noise"}


def _megatron_explicit(spec) -> dict:
    """The Megatron args the Megatron writer stores for `spec`, as a launch script would give them."""
    return explicit_args(args_from_spec(spec, ParallelLayout.build(spec.num_layers)))


@pytest.mark.parametrize("family", FAMILIES)
def test_map_args_hf_is_what_the_converter_writes(family):
    spec = spec_from_hf_config(FAMILIES[family])
    _, doc, why = mapargs.to_target(_megatron_explicit(spec), "hf")
    assert why == {}
    want = hf_config_from_spec(spec)
    assert {k: v for k, v in doc.items() if k not in TRAINING} == {k: v for k, v in want.items() if k not in TRAINING}
    assert spec_from_hf_config(doc) == spec


@pytest.mark.parametrize("family", FAMILIES)
def test_map_args_from_hf_reads_the_converters_config_to_the_same_model(family, tmp_path):
    """config.json (as the HF writer writes it) -> Megatron args text -> the same ModelSpec, nothing reported;
    transformers' own AutoConfig reads the config map-args writes back."""
    transformers = pytest.importorskip("transformers")
    spec = spec_from_hf_config(FAMILIES[family])
    src = tmp_path / "config.json"
    src.write_text(json.dumps(hf_config_from_spec(spec)))
    result = mapargs.map_args(src, "megatron")
    assert [e for e in result.entries if e.lost] == []
    explicit, _, _ = mapargs.read_target(result.text, "megatron")
    assert spec_from_args(M.complete(explicit), "args").replace(padded_vocab=spec.padded_vocab) == spec
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(mapargs.to_target(explicit, "hf")[0])
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.model_type == FAMILIES[family]["model_type"]


def test_what_no_hf_class_holds_is_reported_even_when_not_given(tmp_path):
    """RMSNorm + rope with Megatron's default GeLU: HF Llama's MLP is SwiGLU; the activation the user left at
    Megatron's default is still named as lost (the round trip decides), never silently changed."""
    f = tmp_path / "args.txt"
    f.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
                 "--vocab-size 256 --normalization RMSNorm --position-embedding-type rope\n")
    result = mapargs.map_args(f, "hf")
    lost = {e.flag: e.why for e in result.entries if e.lost}
    assert "activation=gelu" in lost["activation"], lost
    with pytest.raises(Exception, match="--strict"):
        mapargs.map_args(f, "hf", strict=True)
