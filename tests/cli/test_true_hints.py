"""Hints that are true (issue 27, items 6-9): each mistake a new user made, its exit code and its one line."""
import json
import shutil

from click.testing import CliRunner

from helpers.family_models import build
from interop.cli.main import main
from interop.convert import convert


def cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_wrong_from_says_what_the_files_look_like(hf_checkpoints, tmp_path):
    """Item 6: `--from mindspore` on a Megatron tp 2 / pp 2 checkpoint said a rank file was missing."""
    src = tmp_path / "llama-meg-t2p2"
    convert(hf_checkpoints["llama"], src, dst_format="megatron", tp=2, pp=2)
    result = cli("convert", src, tmp_path / "x", "--from", "mindspore", "--to", "hf")
    assert result.exit_code == 2
    assert _errors(result) == [f"error: {src}: not a mindspore checkpoint; it looks like a megatron checkpoint "
                               "(latest_checkpointed_iteration.txt, release/): pass --from megatron, or leave --from out"]
    assert not (tmp_path / "x").exists()
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "y", "--from", "megatron", "--to", "interop")
    assert result.exit_code == 2 and "not a megatron checkpoint; it looks like an hf checkpoint (config.json" in result.stderr


def test_qwen3_to_the_default_dialect_names_the_one_that_holds_it(tmp_path):
    """Item 7: Qwen3's q/k norms have no place in MindSpeed's names; the line names --dialect mindformers-mcore."""
    build("qwen3").save_pretrained(tmp_path / "qwen3")
    result = cli("convert", tmp_path / "qwen3", tmp_path / "ms", "--to", "mindspore")
    assert result.exit_code == 2
    [line] = _errors(result)
    assert line.startswith("error: MindSpore mindspeed names have no place for layers.0.attn.q_norm.weight")
    assert "mindspore --dialect mindformers-mcore" in line
    ok = cli("convert", tmp_path / "qwen3", tmp_path / "ms", "--to", "mindspore", "--dialect", "mindformers-mcore", "-q")
    assert ok.exit_code == 0, ok.output


def test_model_config_of_another_model_lists_the_fields(hf_checkpoints, tmp_path):
    """Item 8: a --model-config for another model used to fail on `padded_vocab (256) must be >= vocab (32000)`."""
    convert(hf_checkpoints["llama"], tmp_path / "meg", dst_format="megatron", tp=2)
    config = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    config.update(vocab_size=32000, hidden_size=128, num_hidden_layers=4)
    (tmp_path / "other.json").write_text(json.dumps(config))
    for fmt in ("torch", "torch_dist"):
        src = tmp_path / f"meg-{fmt}"
        convert(tmp_path / "meg", src, dst_format="megatron", format=fmt)
        result = cli("convert", src, tmp_path / "x", "--to", "hf", "--model-config", tmp_path / "other.json")
        assert result.exit_code == 2, result.output
        [line] = _errors(result)
        assert line.startswith(f"error: --model-config {tmp_path / 'other.json'} describes another model than {src}/")
        assert line.endswith("(--model-config vs checkpoint): num_layers 4 vs 6, hidden_size 128 vs 64, "
                             "vocab_size 32000 vs the checkpoint's padded_vocab_size 256"), line
    same = cli("convert", tmp_path / "meg-torch", tmp_path / "x", "--to", "hf", "-q",
               "--model-config", hf_checkpoints["llama"] / "config.json")
    assert same.exit_code == 0, same.output


def test_model_config_of_another_model_lists_every_field_for_mindspore(hf_checkpoints, tmp_path):
    """Item 8 for MindSpore: beside MindSpeed's pt_meta/, interop's mindspore_model.json or nothing (a bare
    .ckpt, whose tensors are the only facts), the one line names every field or tensor that differs."""
    config = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    config.update(vocab_size=32000, hidden_size=128, num_hidden_layers=4)
    (tmp_path / "other.json").write_text(json.dumps(config))
    convert(hf_checkpoints["llama"], tmp_path / "mindspeed", dst_format="mindspore")
    convert(hf_checkpoints["llama"], tmp_path / "mindformers", dst_format="mindspore", dialect="mindformers")
    (tmp_path / "bare").mkdir()
    shutil.copy(tmp_path / "mindformers" / "model.ckpt", tmp_path / "bare" / "model.ckpt")
    fields = "num_layers 4 vs 6, hidden 128 vs 64, vocab 32000 vs 250"
    for src, described_by in (("mindspeed", "pt_meta/args_tp00_pp000.pt"), ("mindformers", "mindspore_model.json")):
        result = cli("convert", tmp_path / src, tmp_path / "x", "--to", "hf", "--model-config", tmp_path / "other.json")
        assert result.exit_code == 2, result.output
        [line] = _errors(result)
        assert line.startswith(f"error: --model-config {tmp_path / 'other.json'} and {tmp_path / src / described_by} "
                               f"describe different models: {fields};"), line
    result = cli("convert", tmp_path / "bare" / "model.ckpt", tmp_path / "x", "--to", "hf",
                 "--model-config", tmp_path / "other.json")
    assert result.exit_code == 2, result.output
    [line] = _errors(result)
    assert line.startswith(f"error: --model-config {tmp_path / 'other.json'} describes another model than "
                           f"{tmp_path / 'bare' / 'model.ckpt'} (--model-config vs checkpoint, tp rank 0): "
                           "num_layers 4 vs 6, model.tok_embeddings.embedding_weight [32000, 128] vs [250, 64], "
                           "model.layers.N.attention_norm.weight [128] vs [64], "), line
    for tensor in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                   "feed_forward.w2", "feed_forward.w3", "ffn_norm", "norm_out", "lm_head"):
        assert tensor + ".weight [" in line, tensor
    assert not (tmp_path / "x").exists()
    ok = cli("convert", tmp_path / "bare" / "model.ckpt", tmp_path / "x", "--to", "hf", "-q",
             "--model-config", hf_checkpoints["llama"] / "config.json")
    assert ok.exit_code == 0, ok.output


def test_to_offers_no_source_only_format(hf_checkpoints, tmp_path):
    """Item 9: deepspeed is read, never written: `--to` does not offer it."""
    help_text = cli("convert", "--help").output
    to_line = next(line for line in help_text.splitlines() if line.strip().startswith("--to "))
    assert "deepspeed" not in to_line and "megatron" in to_line
    from_line = next(line for line in help_text.splitlines() if line.strip().startswith("--from "))
    assert "deepspeed" in from_line
    from interop.errors import InteropError
    from interop.formats import names, target_names, writer_of
    writable = []
    for name in names():
        try:
            writer_of(name)
            writable.append(name)
        except InteropError:
            pass
    assert target_names() == tuple(writable)  # pyproject's source_only_formats lists exactly the formats without one
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "x", "--to", "deepspeed")
    assert result.exit_code == 2 and not (tmp_path / "x").exists()
    assert _errors(result) == ["error: interop reads deepspeed checkpoints but does not write them: choose another --to"]


def test_workers_reduced_to_one_process_says_why(hf_checkpoints, tmp_path):
    """Item 9: `--workers 2` on a small job runs in one process and says so, with the reason."""
    result = cli("convert", hf_checkpoints["llama"], tmp_path / "m", "--to", "megatron", "--tp", 2, "--workers", 2, "-q")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if "--workers" in line]
    assert notes == ["  note: --workers 2: converted in one process (1 MiB of source, under the 1024 MiB per worker "
                     "that pays for a worker's start)"]
    one = cli("convert", hf_checkpoints["llama"], tmp_path / "h", "--to", "megatron", "--workers", 2, "-q")
    assert "--workers 2: converted in one process" in one.stdout
    quiet = cli("convert", hf_checkpoints["llama"], tmp_path / "q", "--to", "megatron", "-q")
    assert "--workers" not in quiet.stdout  # the default (the cores) needs no word
