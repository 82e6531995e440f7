"""map-args of MindSpeed's sandwich norm (the PanGu 38B of the MindSpeed-Core-MS GPT guide,
tests/fixtures/mindspeed_gpt_guide_pangu.md): --use-sandwich-norm, --attn-post-norm-scale, --ffn-post-norm-scale
(spelled as mindspeed_ms/core/config.py's ARGS_MAP keys at MindSpeed-Core-MS 3a86578: use_sandwich_norm,
attn_post_norm_scale, ffn_post_norm_scale) and --num-layer-list 16,16,16,14 go to the MindSpeed-Core-MS YAML
(model_config.use_sandwich_norm / attn_post_norm_scale / ffn_post_norm_scale, parallel_config.num_layer_list) and
back; the targets without them (upstream Megatron-LM's flags, an HF config.json) report each, never drop it."""
from __future__ import annotations

import json

import yaml
from click.testing import CliRunner

from interop.cli.main import main

SCRIPT = ("torchrun pretrain_gpt.py --num-layers 62 --hidden-size 6144 --ffn-hidden-size 27648 "
          "--num-attention-heads 48 --group-query-attention --num-query-groups 8 --seq-length 4096 "
          "--max-position-embeddings 4096 --position-embedding-type rope --normalization RMSNorm --swiglu "
          "--disable-bias-linear --untie-embeddings-and-output-weights --use-sandwich-norm --attn-post-norm-scale 0.0447 "
          "--ffn-post-norm-scale 0.0825 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 "
          "--num-layer-list 16,16,16,14 --micro-batch-size 1 --vocab-size 165664 --bf16\n")
FLAGS = ("--use-sandwich-norm", "--attn-post-norm-scale", "--ffn-post-norm-scale")


def map_args(*argv):
    result = CliRunner().invoke(main, ["map-args", *map(str, argv)])
    assert result.exit_code == 0, result.output
    return result


def test_to_mindspeed_and_back(tmp_path):
    (tmp_path / "pangu.sh").write_text(SCRIPT)
    map_args(tmp_path / "pangu.sh", "--to", "mindspeed", "-o", tmp_path / "pangu.yaml", "--report", tmp_path / "a.json")
    doc = yaml.safe_load((tmp_path / "pangu.yaml").read_text())
    model = doc["model_config"]
    assert (model["use_sandwich_norm"], model["attn_post_norm_scale"], model["ffn_post_norm_scale"]) == \
        (True, 0.0447, 0.0825)
    assert str(doc["parallel_config"]["num_layer_list"]).replace(" ", "").strip("[]") == "16,16,16,14"
    lost = {e["flag"] for e in json.loads((tmp_path / "a.json").read_text())["unmapped"]}
    assert not lost & set(FLAGS), lost
    map_args(tmp_path / "pangu.yaml", "--to", "mindspeed", "-o", tmp_path / "again.yaml")  # read back, written again
    again = yaml.safe_load((tmp_path / "again.yaml").read_text())
    assert again["model_config"] == model and again["parallel_config"] == doc["parallel_config"]
    # upstream Megatron-LM's flags: the split as first / last stage sizes, the sandwich reported (no such flag)
    back = map_args(tmp_path / "pangu.yaml", "--to", "megatron", "--report", tmp_path / "b.json").stdout
    assert "--decoder-first-pipeline-num-layers 16" in back and "--decoder-last-pipeline-num-layers 14" in back
    lost = {e["flag"] for e in json.loads((tmp_path / "b.json").read_text())["unmapped"]}
    assert set(FLAGS) <= lost, lost


def test_targets_without_the_flags_report_them(tmp_path):
    (tmp_path / "pangu.sh").write_text(SCRIPT)
    for target in ("megatron", "hf"):
        report = tmp_path / f"{target}.json"
        map_args(tmp_path / "pangu.sh", "--to", target, "-o", tmp_path / f"out.{target}", "--report", report)
        lost = {e["flag"] for e in json.loads(report.read_text())["unmapped"]}
        assert set(FLAGS) <= lost, (target, lost)
