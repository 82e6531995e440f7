"""OLMo 2 (transformers' Olmo2ForCausalLM) as facts: no pre-norms and RMSNorm on the attention's and the MLP's
output (`pre_norm` False, `post_norm` True), q/k RMSNorm over the whole q / k projection (`qk_norm_scope`
"projection"), through HF, Megatron torch / torch_dist at tp 2 / pp 2 and the reference trainer.

Names confirmed in the sources:
- transformers 5.24 models/olmo2/modeling_olmo2.py: Olmo2Attention `q_norm = Olmo2RMSNorm(num_attention_heads *
  head_dim)` applied to `q_proj(x)` before the heads are cut, `k_norm` likewise over num_key_value_heads * head_dim;
  Olmo2DecoderLayer `post_attention_layernorm` / `post_feedforward_layernorm` on each sub-block's output.
- Megatron-Bridge src/megatron/bridge/models/olmo2/olmo2_bridge.py (+ olmo2_provider.py olmo2_layer_spec):
  `decoder.layers.*.self_attention.linear_proj.post_layernorm.weight` <- post_attention_layernorm,
  `decoder.layers.*.mlp.linear_fc2.post_layernorm.weight` <- post_feedforward_layernorm, q/k norms in
  `self_attention.q_layernorm` / `k_layernorm`, IdentityOp input_layernorm / pre_mlp_layernorm (no weights).
megatron-core 0.16.1 is not an oracle here: its SelfAttention builds q_layernorm over one head
(transformer/attention.py: `hidden_size=self.hidden_size_per_attention_head`), so it cannot compute OLMo 2's
projection-wide norm; the Megatron files hold each tp rank's heads' share of the [heads * head_dim] weight.
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

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, F.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo2")
    model = F.build("olmo2")
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        logits = model(TOKENS).logits
    return root / "hf", logits


def test_config_reads_as_facts_and_loads_in_autoconfig(olmo2, tmp_path):
    src, _ = olmo2
    config = json.loads((src / "config.json").read_text())
    spec = spec_from_hf_config(config)
    assert (spec.pre_norm, spec.post_norm, spec.qk_norm, spec.qk_norm_scope) == (False, True, True, "projection")
    written = hf_config_from_spec(spec)
    assert written["model_type"] == "olmo2" and written["architectures"] == ["Olmo2ForCausalLM"]
    assert spec_from_hf_config(json.loads(json.dumps(written))) == spec
    (tmp_path / "config.json").write_text(json.dumps(written))
    ours, theirs = (transformers.AutoConfig.from_pretrained(p) for p in (tmp_path, src))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "max_position_embeddings",
                "pad_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]


def test_hf_megatron_round_trip_is_bit_exact(olmo2, tmp_path):
    """HF -> Megatron torch tp2/pp2 -> torch_dist tp2/pp2 -> interop pp2 -> HF: every tensor bit for bit and
    transformers' own Olmo2ForCausalLM gives the source's logits."""
    src, logits = olmo2
    convert(src, tmp_path / "torch", dst_format="megatron", tp=2, pp=2)
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", tp=2, pp=2, options={"format": "torch_dist"})
    convert(tmp_path / "dist", tmp_path / "io", dst_format="interop", tp=1, pp=2)
    convert(tmp_path / "io", tmp_path / "back", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Olmo2ForCausalLM"
    with torch.no_grad():
        assert (back(TOKENS).logits - logits).abs().max() <= 1e-5


def test_megatron_names_and_args(olmo2, tmp_path):
    """Megatron-Bridge's names; no pre-norm weights; each tp rank holds its heads' part of the q/k norms; the
    args say the layer-spec facts (megatron-core has no flag for them)."""
    src, _ = olmo2
    convert(src, tmp_path / "meg", dst_format="megatron", tp=2, pp=1)
    hf = load_file(src / "model.safetensors")
    for t in range(2):
        state = torch.load(tmp_path / "meg" / "release" / f"mp_rank_0{t}" / "model_optim_rng.pt", weights_only=False)
        model = state["model"]
        assert torch.equal(model["decoder.layers.0.self_attention.linear_proj.post_layernorm.weight"],
                           hf["model.layers.0.post_attention_layernorm.weight"])
        assert torch.equal(model["decoder.layers.1.mlp.linear_fc2.post_layernorm.weight"],
                           hf["model.layers.1.post_feedforward_layernorm.weight"])
        q, k = hf["model.layers.0.self_attn.q_norm.weight"], hf["model.layers.0.self_attn.k_norm.weight"]
        assert torch.equal(model["decoder.layers.0.self_attention.q_layernorm.weight"], q.chunk(2)[t])
        assert torch.equal(model["decoder.layers.0.self_attention.k_layernorm.weight"], k.chunk(2)[t])
        assert not [key for key in model if "input_layernorm" in key or "pre_mlp_layernorm" in key]
        args = vars(state["args"])
        assert (args["pre_norm"], args["post_norm"], args["qk_layernorm_scope"], args["qk_layernorm"]) == \
            (False, True, "projection", True)


def test_formats_without_the_facts_refuse_in_one_line(olmo2, tmp_path):
    src, _ = olmo2
    for dialect in ("mindspeed", "mindformers", "mindformers-mcore"):
        with pytest.raises(InteropError, match=r"no place for layers\.0\.(attn\.q_norm|attn_post_norm)\.weight: the "
                                               r"model's (qk_norm|post_norm) is held by hf \(.*olmo2.*\)"):
            convert(src, tmp_path / dialect, dst_format="mindspore", options={"dialect": dialect})
        assert not (tmp_path / dialect).exists()
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    with pytest.raises(InteropError, match="HF gemma3_text always has norm_zero_centered; this model has not"):
        hf_config_from_spec(spec.replace(pre_norm=True, post_norm=True))  # sandwich norms with q/k norms: Gemma 3
    with pytest.raises(InteropError, match=r"HF llama cannot hold norms after attention and MLP \(olmo2 can\)"):
        hf_config_from_spec(spec, model_type="llama")


def test_trainer_parity_with_transformers(olmo2, tmp_path):
    """The reference trainer at 1x1 / 2x1 / 1x2 and transformers' Olmo2ForCausalLM train alike for 10 steps
    (the q/k norms' sums of squares added over the tp ranks).  lr 1e-3: at 3e-3 the fp32 rounding differences
    of the two attention kernels (eager in transformers, SDPA here; equal losses at step 2) grow to 1.4e-5 by
    step 10 through the post-norm stack."""
    src, _ = olmo2
    convert(src, tmp_path / "common", dst_format="interop")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=1e-3, warmup=2)
    result = parity(tmp_path / "common", cfg, layouts=[(1, 1, 1), (2, 1, 1), (1, 2, 1)], frameworks=["torch", "hf"])
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "hf"]
    assert all(len(v) == 10 for v in result.runs.values())
    assert result.max_diff < 1e-5, result.table()
