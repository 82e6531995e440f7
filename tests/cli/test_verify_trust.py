"""A verify you can trust and watch (issue 27, items 1-4): weights of one dtype compared bit for bit, NaN / Inf
a failure, a line per stage on stderr after an estimate, `convert --verify` failing exits 1 and keeps the output,
and every row names what actually ran."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from interop.cli.main import main
from interop.convert import convert
from interop.workflows.verify import TOLERANCE, verify


def cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _tamper_megatron(path, key: str, delta: float):
    """Add `delta` to the first element of `key` in a tp 1 / pp 1 Megatron torch checkpoint, as a user would."""
    rank_file = path / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(rank_file, weights_only=False)
    state["model"][key][0, 0] += delta
    torch.save(state, rank_file)


def test_half_an_element_in_bf16_fails(hf_checkpoints, tmp_path):
    """Issue 27 item 1: HF -> megatron --dtype bf16, +0.5 on one element of layer 1's up/gate rows: the logits move
    less than the bf16 tolerance, but no dtype changed between the two, so the tensors must be identical."""
    honest = tmp_path / "llama-bf16"
    convert(hf_checkpoints["llama"], honest, dst_format="megatron", dtype="bf16")
    tampered = tmp_path / "tamper-bf16"
    shutil.copytree(honest, tampered)
    _tamper_megatron(tampered, "decoder.layers.1.mlp.linear_fc1.weight", 0.5)
    result = cli("verify", honest, tampered, "--reference-only")
    assert result.exit_code == 1, result.output
    assert "weights: 1 of 57 tensors of one dtype differ: layers.1.mlp.gate.weight (max |diff| 5.0" in result.stdout
    assert "(tolerance 1e-05): FAIL" in result.stdout  # no cast between the two: the fp32 tolerance

    same = cli("verify", honest, honest, "--reference-only")
    assert same.exit_code == 0 and "weights: 57 tensors of one dtype bit-identical" in same.stdout
    assert "largest logit difference 0.00e+00 (tolerance 1e-05): OK" in same.stdout


def test_a_real_cast_keeps_the_dtype_tolerance(hf_checkpoints, tmp_path):
    convert(hf_checkpoints["llama"], tmp_path / "bf", dst_format="megatron", dtype="bf16")
    result = verify(hf_checkpoints["llama"], tmp_path / "bf", frameworks=False)
    assert result.ok and result.tolerance == TOLERANCE["bfloat16"] and 0 < result.max_diff < 5e-2
    assert result.tensors.cast == 57 and result.tensors.exact == 0
    assert "57 cast (compared by their logits)" in "\n".join(result.lines())


def test_nan_in_a_weight_fails(hf_checkpoints, tmp_path):
    """Issue 27 item 1: a NaN anywhere is a failure, never a pass (max() over NaN used to skip it)."""
    convert(hf_checkpoints["llama"], tmp_path / "hf", dst_format="hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.3.self_attn.o_proj.weight"][2, 5] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    result = cli("verify", hf_checkpoints["llama"], tmp_path / "hf", "--reference-only")
    assert result.exit_code == 1, result.output
    assert "weights: NaN or Inf in layers.3.attn.o.weight (converted)" in result.stdout
    assert "largest logit difference nan" in result.stdout and result.stdout.rstrip().endswith("FAIL")


def test_stages_are_reported_as_they_end(hf_checkpoints, tmp_path):
    """Issue 27 item 2: an estimate of time and memory before the models run, then a line per stage with its time,
    on stderr (stdout keeps the result)."""
    convert(hf_checkpoints["llama"], tmp_path / "meg", dst_format="megatron", tp=2)
    result = cli("verify", hf_checkpoints["llama"], tmp_path / "meg", "--reference-only")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("verify: 2 runs of the model in fp32 (")  # first, before anything is read or run
    assert "estimated" in lines[0] and "peak memory about" in lines[0]
    stages = [line.strip().rsplit(": ", 1)[0] for line in lines[1:]]
    assert stages == ["read the source (hf) into a common-format copy",
                      "read the converted (megatron) into a common-format copy", "compared the weights tensor by tensor",
                      "reference model, source", "reference model, converted"]
    assert all(line.endswith(" s") for line in lines[1:])
    assert "verify:" not in result.stdout and "reference model, source (hf)" in result.stdout


def test_failed_convert_verify_exits_1_and_keeps_the_output(tmp_path):
    """Issue 27 item 3: a weight beyond fp16's range becomes Inf in `--dtype fp16`: the conversion finishes, its
    verification fails, exit 1, and the one error line says where the output is kept."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                      intermediate_size=64, vocab_size=1000, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e6
    model.save_pretrained(tmp_path / "src")
    result = cli("convert", tmp_path / "src", tmp_path / "out", "--to", "hf", "--dtype", "fp16", "--verify", "-q")
    assert result.exit_code == 1, result.output
    assert "weights: NaN or Inf in layers.0.mlp.down.weight (converted)" in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: verification failed; the converted output is kept at {tmp_path / 'out'} "
                      "(delete it, or convert again with --force)"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_another_model_after_convert_exits_1_and_keeps_the_output(hf_checkpoints, tmp_path, monkeypatch):
    """Issue 27 item 3: a verification that cannot even compare (the output describes another model) is a failed
    verification too: exit 1, not 2, and the output stays where the line says."""
    from interop.workflows import verify as verify_module
    convert(hf_checkpoints["gpt2"], tmp_path / "other", dst_format="interop")
    real = verify_module.verify
    monkeypatch.setattr(verify_module, "verify", lambda src, dst, **kw: real(src, tmp_path / "other", **kw))
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "out", "--to", "interop", "--verify", "-q")
    assert result.exit_code == 1, result.output
    assert "describes another model" in result.stderr
    assert f"the converted output is kept at {tmp_path / 'out'}" in result.stderr
    assert json.loads((tmp_path / "out" / "interop.json").read_text())["spec"]["arch"] == "llama"


def test_rows_name_what_ran(hf_checkpoints, tmp_path):
    """Issue 27 item 4: a MindSpore checkpoint (MindSpeed or MindFormers files) runs in interop's model written in
    MindSpore ops, not in MindFormers: the row says so."""
    pytest.importorskip("mindspore")
    convert(hf_checkpoints["llama"], tmp_path / "mf", dst_format="mindspore", dialect="mindformers")
    result = verify(hf_checkpoints["llama"], tmp_path / "mf")
    labels = [c.label for c in result.checks]
    assert "interop's model in mindspore ops, converted (mindspore)" in labels, labels
    assert not any(label.startswith("mindspore,") for label in labels)
    assert "transformers, source (hf)" in labels and result.ok
