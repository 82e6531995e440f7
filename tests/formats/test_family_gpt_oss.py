"""gpt-oss (transformers' GptOssForCausalLM) as facts: learned attention sinks per head (`attn_sinks`), biases on q, k,
v, o (`qkv_bias`, `linear_bias`), every other layer windowed (`sliding_window`, `sliding_layers` from `layer_types`),
YaRN without truncation (`rope_scaling` yarn, `truncate` false), every layer MoE with a bias on the router's logits
(`moe_router_logit_bias`) and biased experts (`has_mlp_bias`), and the experts' clamped quick GeLU
(`activation: quick_geglu`, `glu_clamp` = swiglu_limit, `glu_linear_offset` 1: `(up + 1) * glu`).  HF stores the
experts fused and interleaved (InterleavedExperts, its own unit test in tests/core/test_interleaved_experts.py); the
public release stores them MXFP4 (`*_blocks` + `*_scales`, tests/core/test_mxfp4_transform.py against transformers'
own dequantisation; here the whole checkpoint against transformers' own loading of it).

Confirmed in the sources: transformers 5.24 models/gpt_oss/modeling_gpt_oss.py (eager_attention_forward's sinks
column, GptOssTopKRouter F.linear with bias, GptOssExperts._apply_gate, GptOssConfig layer_types / rope_parameters);
Megatron-Bridge src/megatron/bridge/models/gpt_oss/gpt_oss_bridge.py (commit 0e4d6ed6): `self_attn.sinks` ->
`decoder.layers.*.self_attention.core_attention.softmax_offset`, `mlp.router.bias` -> `decoder.layers.*.mlp.router.bias`,
experts -> `mlp.experts.linear_fc1.weight*` / `.bias*` (TEGroupedMLP) or `mlp.experts.local_experts.*.linear_fc1.weight`
/ `.bias` (SequentialMLP) with fc1 = [gate; up] de-interleaved, provider `softmax_type="learnable"`,
`activation_func=quick_gelu`, `activation_func_clamp_value`, `glu_linear_offset=1.0`, `add_bias_linear=True`,
`position_embedding_type="yarn"` with `yarn_*` fields and `yarn_correction_range_round_to_int=False`.  megatron-core
0.16.1's own GPTModel, built as that provider builds it, loads the Megatron output strictly and computes transformers'
logits (tests/helpers/mcore_gpt_oss.py); Megatron round trips are bit for bit; the reference model / trainer are
checked against transformers.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import helpers.family_models as F
from interop.convert import convert
from interop.errors import InteropError
from interop.mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from interop.mappings.megatron_spec import model_args
from interop.trainer.config import TrainConfig
from interop.workflows.parity import parity, parse_layouts
from interop.workflows.verify import reference_logits, verify

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, F.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    model = F.build("gpt_oss")
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        return root / "hf", model(TOKENS).logits


def _same_files(a_dir, b_dir):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_config_facts_and_autoconfig(gpt_oss, tmp_path):
    src, _ = gpt_oss
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    assert (spec.attn_sinks, spec.moe_router_logit_bias, spec.qkv_bias, spec.linear_bias, spec.has_mlp_bias) == \
        (True, True, True, True, True)
    assert (spec.activation, spec.glu_clamp, spec.glu_linear_offset) == ("quick_geglu", 0.5, 1.0)
    assert spec.sliding_window == F.SLIDING_WINDOW and spec.sliding_layers == [0, 2]
    assert spec.rope_scaling["type"] == "yarn" and spec.rope_scaling["truncate"] is False
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden, spec.moe_norm_topk) == (4, 2, 32, True)
    written = hf_config_from_spec(spec)
    assert written["architectures"] == ["GptOssForCausalLM"]
    assert spec_from_hf_config(json.loads(json.dumps(written))) == spec
    (tmp_path / "config.json").write_text(json.dumps(written))
    ours, theirs = transformers.AutoConfig.from_pretrained(tmp_path), transformers.AutoConfig.from_pretrained(src)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "sliding_window", "layer_types", "num_local_experts",
                "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "attention_bias", "rope_parameters",
                "tie_word_embeddings", "router_aux_loss_coef"):
        assert getattr(ours, key) == getattr(theirs, key), key


def test_hf_read_and_write_keep_transformers_logits(gpt_oss, tmp_path):
    src, logits = gpt_oss
    convert(src, tmp_path / "back", dst_format="hf")
    _same_files(src, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, logits)


@pytest.mark.parametrize("layout", [dict(tp=2, ep=2), dict(tp=2, pp=2, ep=2)])
def test_hf_megatron_round_trip_with_bridge_names(gpt_oss, tmp_path, layout):
    """HF -> Megatron torch -> torch_dist -> HF bit for bit under Megatron-Bridge's names and provider facts."""
    src, logits = gpt_oss
    convert(src, tmp_path / "torch", dst_format="megatron", **layout)
    state = torch.load(tmp_path / "torch" / "release" / ("mp_rank_01_000_001" if "pp" in layout else "mp_rank_01_001")
                       / "model_optim_rng.pt", weights_only=False)
    args = vars(state["args"])
    assert (args["softmax_type"], args["quick_geglu"], args["activation_func_clamp_value"], args["glu_linear_offset"],
            args["add_bias_linear"]) == ("learnable", True, 0.5, 1.0, True)
    assert (args["yarn_rotary_scaling_factor"], args["yarn_original_max_position_embeddings"],
            args["yarn_correction_range_round_to_int"]) == (32.0, 8, False)
    assert args["window_size"] == (F.SLIDING_WINDOW - 1, 0) and args["window_attn_skip_freq"] == 2
    model = state["model"]
    assert model["decoder.layers.0.self_attention.core_attention.softmax_offset"].shape == (4,)  # 8 heads / tp 2
    assert model["decoder.layers.0.mlp.router.bias"].shape == (4,)
    assert model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.bias"].shape == (32,)  # [gate_t; up_t]
    assert model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias"].shape == (64,)
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"}, **layout)
    convert(tmp_path / "dist", tmp_path / "back", dst_format="hf")
    _same_files(src, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, logits)


def test_megatron_core_own_model_computes_transformers_logits(gpt_oss, tmp_path):
    """The Megatron output loads strictly into megatron-core 0.16.1's own GPTModel built as Megatron-Bridge's
    GPTOSSProvider builds it (tests/helpers/mcore_gpt_oss.py, in its own process), whose logits equal transformers'."""
    src, logits = gpt_oss
    convert(src, tmp_path / "mg", dst_format="megatron")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    helper = Path(__file__).parents[1] / "helpers" / "mcore_gpt_oss.py"
    run = subprocess.run([sys.executable, str(helper), str(tmp_path / "mg"), str(tmp_path / "tokens.pt"),
                          str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (torch.load(tmp_path / "logits.pt") - logits).abs().max() < 1e-5


def test_common_format_round_trip(gpt_oss, tmp_path):
    src, _ = gpt_oss
    convert(src, tmp_path / "common", dst_format="interop", tp=2, ep=2)
    convert(tmp_path / "common", tmp_path / "back", dst_format="hf")
    _same_files(src, tmp_path / "back")


def test_mxfp4_release_reads_as_transformers_loads_it(gpt_oss, tmp_path):
    """A checkpoint laid out as the public release (experts as `*_blocks` uint8 [E, rows, G, 16] + `*_scales` uint8
    [E, rows, G], quantization_config mxfp4): interop reads it into exactly the bf16 tensors transformers' own loading
    dequantises it to (on CPU it dequantises: integrations/mxfp4.py), and writes them as an unquantised HF model."""
    src, _ = gpt_oss
    state = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):  # [E, out, in / 32, 16]
            key = f"model.layers.{i}.mlp.experts.{proj}"
            del state[key]
            state[key + "_blocks"] = torch.randint(0, 256, (4, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            state[key + "_scales"] = torch.randint(118, 124, (4, rows, cols // 32), dtype=torch.uint8, generator=g)
    mx = tmp_path / "mxfp4"
    mx.mkdir()
    save_file(state, mx / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (mx / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(mx, dtype=torch.bfloat16).eval()
    convert(mx, tmp_path / "bf16", dst_format="hf", dtype="bf16")
    ours = load_file(tmp_path / "bf16" / "model.safetensors")
    expected = theirs.state_dict()
    assert sorted(ours) == sorted(expected)
    for key, value in ours.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, expected[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, theirs(TOKENS).logits)
    (mx / "config.json").write_text(json.dumps(config))  # blocks without the config's word: refused, not guessed
    with pytest.raises(InteropError, match=r"model\.layers\.0\.mlp\.experts\.down_proj_blocks is MXFP4 but "
                                           r"config\.json has no quantization_config \(quant_method mxfp4\)"):
        convert(mx, tmp_path / "refused", dst_format="hf")
    assert not (tmp_path / "refused").exists()


def test_targets_without_the_facts_refuse(gpt_oss, tmp_path):
    src, _ = gpt_oss
    for dialect in ("mindspeed", "mindformers", "mindformers-mcore"):
        with pytest.raises(InteropError, match=rf"MindSpore {dialect} names have no place for layers\.0\.attn\.sinks: "
                                               r"the model's attn_sinks is held by hf \(gpt_oss\), megatron"):
            convert(src, tmp_path / dialect, dst_format="mindspore", options={"dialect": dialect})
        assert not (tmp_path / dialect).exists()
    spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
    with pytest.raises(InteropError, match=r"HF mixtral cannot hold attn_sinks \(gpt_oss can\)"):
        hf_config_from_spec(spec, model_type="mixtral")
    with pytest.raises(InteropError, match=r"add_bias_linear puts biases on the linears, the router's logits and the "
                                           r"experts together"):
        model_args(spec.replace(moe_router_logit_bias=False))


def test_reference_model_logits_equal_transformers_and_verify(gpt_oss, tmp_path):
    """The reference model (trainer/model.py: sinks in its eager attention, the clamped quick GeLU, the router's and
    the experts' biases, YaRN untruncated, windows on layers 0 and 2) computes transformers' logits; verify of the
    Megatron tp2/ep2 output runs it and transformers on both sides."""
    src, logits = gpt_oss
    convert(src, tmp_path / "common", dst_format="interop")
    assert (reference_logits(tmp_path / "common", TOKENS) - logits).abs().max() < 1e-5
    convert(src, tmp_path / "mg", dst_format="megatron", tp=2, ep=2)
    result = verify(src, tmp_path / "mg")
    assert result.ok, "\n".join(result.lines())


def test_trainer_parity_with_transformers(gpt_oss, tmp_path):
    """The reference trainer at 1x1 / 2x1 / 1x2 and ep 2, and transformers' GptOssForCausalLM (eager attention with
    its sinks), train alike for 10 steps (no load-balancing loss: transformers' is another objective)."""
    model = F.build("gpt_oss")
    model.config.router_aux_loss_coef = 0.0
    model.save_pretrained(tmp_path / "hf")
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=1e-3, warmup=2)
    result = parity(tmp_path / "hf", cfg, layouts=parse_layouts("1x1,2x1,1x2,1x1x2x2"), frameworks=["torch", "hf"],
                    log=None)
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "torch 1x1x2 ep2", "hf"], result.failed
    assert result.max_diff < 1e-5, result.table()
