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
    ("gemma2", ["--apply-layernorm-1p", "--openai-gelu", "--window-size"],
     ["post_norm", "gated_linear_unit", "embedding_scale", "sliding_window_layers", "attn_logit_softcapping",
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
