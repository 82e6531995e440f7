"""`interop verify` / `convert --verify`: the fixed batch through source and destination, in the reference
model and in each checkpoint's own framework (transformers, mindspore, megatron-core), exit 1 over tolerance."""
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from interop.cli.main import main
from interop.convert import convert
from interop.workflows.verify import TOLERANCE, verify


def cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def test_convert_verify_to_mindspore(hf_checkpoints, tmp_path):
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "ms", "--to", "mindspore", "--tp", 2, "--pp", 2,
                 "--verify", "-q")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "reference model, converted (mindspore)" in out and "transformers, source (hf)" in out
    assert "interop's model in mindspore ops, converted (mindspore)" in out  # mindspore loaded the files
    assert "tolerance 1e-05): OK" in out


def test_verify_mindspeed_files_without_interop_sidecar(hf_checkpoints, tmp_path):
    """Real MindSpeed output carries no mindspore_model.json: verify takes the model from --dst-model-config."""
    convert(hf_checkpoints["llama"], tmp_path / "ms", dst_format="mindspore", tp=2)
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    result = cli("verify", hf_checkpoints["llama"], tmp_path / "ms", "--dst-model-config",
                 hf_checkpoints["llama"] / "config.json")
    assert result.exit_code == 0, result.output
    assert "interop's model in mindspore ops, converted (mindspore)" in result.output and "OK" in result.output


def test_mindformers_mcore_runs_in_the_mindspore_ops_model(hf_checkpoints, tmp_path):
    """The ops model takes its tensors by the dialect's own name table: mindformers-mcore's grouped linear_qkv and
    interleaved linear_fc1 run as MindSpeed's do (was: a note that only mindspeed and mindformers ran)."""
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "mfm", "--to", "mindspore", "--dialect",
                 "mindformers-mcore", "--verify", "-q")
    assert result.exit_code == 0, result.output
    assert "interop's model in mindspore ops, converted (mindspore)" in result.output and "OK" in result.output
    assert "reference model only" not in result.output


def test_qwen3_qk_norms_run_in_the_mindspore_ops_model(tmp_path):
    from helpers.family_models import build
    build("qwen3").save_pretrained(tmp_path / "qwen3")
    result = cli("convert", tmp_path / "qwen3", tmp_path / "mfm", "--to", "mindspore", "--dialect",
                 "mindformers-mcore", "--verify", "-q")
    assert result.exit_code == 0, result.output
    assert "interop's model in mindspore ops, converted (mindspore)" in result.output and "OK" in result.output


def test_a_model_the_mindspore_ops_model_cannot_run_is_a_note(tmp_path):
    """A mixture of experts is not computed by the ops model: a note saying so, the reference model's comparison
    standing."""
    from helpers.moe_models import hf_model
    hf_model("mixtral").save_pretrained(tmp_path / "mixtral")
    result = cli("convert", tmp_path / "mixtral", tmp_path / "ms", "--to", "mindspore", "--verify", "-q")
    assert result.exit_code == 0, result.output
    assert "does not compute this model's mixture of experts; the MindSpore checkpoint ran in the reference " \
           "model only" in result.output
    assert "reference model, converted (mindspore)" in result.output and "OK" in result.output


def test_verify_megatron_in_megatron_core(hf_checkpoints, tmp_path):
    pytest.importorskip("megatron.core")
    convert(hf_checkpoints["gpt2"], tmp_path / "meg", dst_format="megatron", tp=2, pp=2)
    result = verify(hf_checkpoints["gpt2"], tmp_path / "meg")
    labels = [c.label for c in result.checks]
    assert "megatron-core, converted (megatron)" in labels and result.ok
    losses = {c.loss for c in result.checks}
    assert max(losses) - min(losses) < 1e-5 and result.max_diff < 1e-5
    assert result.checks[1].max_diff == 0.0  # the reference model on both: bit-identical weights


def test_bf16_cast_gets_the_bf16_tolerance(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "bf", dst_format="hf", dtype="bf16")
    result = verify(hf_checkpoints["llama"], tmp_path / "bf", frameworks=False)
    assert result.tolerance == TOLERANCE["bfloat16"] and result.ok
    assert 0 < result.max_diff  # the rounding shows, within the stated tolerance
    assert "tolerance 5e-02" in result.lines()[-1]


def test_corrupted_destination_fails(hf_checkpoints, tmp_path):
    """A destination whose weights differ (one matrix scaled) exits 1 and says FAIL."""
    convert(hf_checkpoints["llama"], tmp_path / "hf", dst_format="hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.2.mlp.down_proj.weight"] *= 1.5
    save_file(tensors, path, metadata={"format": "pt"})
    run = subprocess.run([sys.executable, "-m", "interop", "verify", str(hf_checkpoints["llama"]), str(tmp_path / "hf")],
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAIL" in run.stdout and "transformers, converted (hf)" in run.stdout
    last = run.stdout.strip().splitlines()[-1]
    assert float(last.split("largest logit difference ")[1].split()[0]) > 1e-3


def test_another_model_is_an_error(hf_checkpoints, tmp_path):
    result = cli("verify", hf_checkpoints["llama"], hf_checkpoints["gpt2"], "--reference-only")
    assert result.exit_code == 2 and "describes another model" in result.output and "arch llama vs gpt2" in result.output


def test_common_format_needs_no_framework(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["gpt2"], tmp_path / "c", dst_format="interop", tp=2, pp=3)
    result = verify(tmp_path / "c", hf_checkpoints["gpt2"], frameworks=True)
    assert [c.label for c in result.checks] == ["reference model, source (interop)", "reference model, converted (hf)",
                                                "transformers, converted (hf)"]
    assert result.ok and torch.isfinite(torch.tensor([c.loss for c in result.checks])).all()
