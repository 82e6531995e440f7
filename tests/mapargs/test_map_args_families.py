"""map-args of the families whose facts Megatron-LM has no flag for (OLMo 2's post norms and projection-wide q/k
norms, Gemma 2's embedding scale, GeGLU gating, soft-capping and window layers): what has a flag is written
(--apply-layernorm-1p, --openai-gelu, --qk-layernorm, --window-size), the rest is reported lost, never dropped."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from interop.cli.main import main

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind,written,lost", [
    ("olmo2", ["--qk-layernorm", "--swiglu"], ["pre_norm", "post_norm", "qk_layernorm_scope"]),
    ("gemma2", ["--apply-layernorm-1p", "--openai-gelu", "--window-size", "--window-attn-skip-freq 2"],
     ["post_norm", "gated_linear_unit", "embedding_scale", "attn_logit_softcapping",
      "final_logit_softcapping"]),
])
def test_hf_config_to_megatron_reports_what_has_no_flag(tmp_path, kind, written, lost):
    common = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, pad_token_id=None)
    config = transformers.Olmo2Config(**common) if kind == "olmo2" else transformers.Gemma2Config(**common, head_dim=16)
    config.save_pretrained(tmp_path)
    report = tmp_path / "lost.json"
    result = CliRunner().invoke(main, ["map-args", str(tmp_path / "config.json"), "--to", "megatron",
                                       "--report", str(report)])
    assert result.exit_code == 0, result.output
    for flag in written:
        assert flag in result.stdout, flag
    flags = {entry["flag"] for entry in json.loads(report.read_text())["unmapped"]}
    assert set(lost) <= flags, flags


def test_gpt_oss_config_to_megatron_and_back(tmp_path):
    """gpt-oss's facts with Megatron-LM flags (core_v0.16 arguments.py: --softmax-type learnable for the sinks,
    --quick-geglu with --activation-func-clamp-value and --glu-linear-offset for the clamped (up + 1) GeLU,
    --window-size with --window-attn-skip-freq 2 for the windows on layers 1, 3, ... (megatron-core
    is_layer_window_attention), --num-experts; the router's and experts' biases are add_bias_linear's) are written;
    its YaRN (Megatron-Bridge's yarn_* provider fields, no Megatron-LM flag) is reported lost; the args read back
    as a GptOssForCausalLM config with the same facts."""
    config = transformers.GptOssConfig(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, pad_token_id=None)
    config.save_pretrained(tmp_path)
    report = tmp_path / "lost.json"
    result = CliRunner().invoke(main, ["map-args", str(tmp_path / "config.json"), "--to", "megatron",
                                       "--report", str(report)])
    assert result.exit_code == 0, result.output
    for flag in ("--softmax-type learnable", "--quick-geglu", "--activation-func-clamp-value 7.0",
                 "--glu-linear-offset 1.0", "--window-size '(127, 0)'", "--window-attn-skip-freq 2", "--num-experts 4"):
        assert flag in result.stdout, flag
    assert "--disable-bias-linear" not in result.stdout
    lost = {entry["flag"] for entry in json.loads(report.read_text())["unmapped"]}
    assert {"yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
            "yarn_correction_range_round_to_int"} <= lost, lost
    (tmp_path / "train.sh").write_text(result.stdout)
    back = CliRunner().invoke(main, ["map-args", str(tmp_path / "train.sh"), "--to", "hf", "-o", str(tmp_path / "out")])
    assert back.exit_code == 0, back.output
    written = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert type(written).__name__ == "GptOssConfig"
    for key in ("swiglu_limit", "swiglu_alpha", "layer_types", "sliding_window", "num_local_experts",
                "num_experts_per_tok", "attention_bias", "intermediate_size"):
        assert getattr(written, key) == getattr(config, key), key
