"""User mistakes: one line on stderr, exit code 2, and nothing left at the destination."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from interop.cli.main import main


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def assert_clean_failure(code, output, dst, *words):
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for word in words:
        assert word in lines[0], (word, output)
    assert "Traceback" not in output
    assert not dst.exists()
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert leftovers == [], leftovers


@pytest.fixture
def interop_ckpt(hf_checkpoints, tmp_path):
    code, out = run("convert", hf_checkpoints["llama"], tmp_path / "ckpt", "--to", "interop", "--tp", "2", "--pp", "2")
    assert code == 0, out
    return tmp_path / "ckpt"


def test_missing_source(tmp_path):
    assert_clean_failure(*run("convert", tmp_path / "nope", tmp_path / "out", "--to", "interop"),
                         tmp_path / "out", "nope", "no such file")


def test_unknown_format(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.txt").write_text("hello")
    assert_clean_failure(*run("convert", tmp_path / "src", tmp_path / "out", "--to", "interop"),
                         tmp_path / "out", "cannot tell its format")


def test_tp_not_dividing_heads(hf_checkpoints, tmp_path):
    assert_clean_failure(*run("convert", hf_checkpoints["llama"], tmp_path / "out", "--to", "interop", "--tp", "3"),
                         tmp_path / "out", "tp=3", "attention heads (8)")


def test_pp_not_dividing_layers(hf_checkpoints, tmp_path):
    assert_clean_failure(*run("convert", hf_checkpoints["llama"], tmp_path / "out", "--to", "interop", "--pp", "4"),
                         tmp_path / "out", "6 layers", "pp=4")


def test_truncated_safetensors(hf_checkpoints, tmp_path):
    import shutil
    src = tmp_path / "broken"
    shutil.copytree(hf_checkpoints["gpt2"], src)
    weights = src / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert_clean_failure(*run("convert", src, tmp_path / "out", "--to", "interop"),
                         tmp_path / "out", "model.safetensors", "truncated")


def test_manifest_names_missing_file(interop_ckpt, tmp_path):
    (interop_ckpt / "model-tp01-pp01.safetensors").unlink()
    assert_clean_failure(*run("convert", interop_ckpt, tmp_path / "out", "--to", "hf"),
                         tmp_path / "out", "model-tp01-pp01.safetensors", "missing")


def test_checksum_mismatch(interop_ckpt, tmp_path):
    path = interop_ckpt / "model-tp00-pp01.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # same size, one byte of tensor data flipped
    path.write_bytes(bytes(data))
    assert_clean_failure(*run("convert", interop_ckpt, tmp_path / "out", "--to", "hf"),
                         tmp_path / "out", "model-tp00-pp01.safetensors", "checksum mismatch")


def test_corrupt_manifest(interop_ckpt, tmp_path):
    (interop_ckpt / "interop.json").write_text("{not json")
    assert_clean_failure(*run("inspect", interop_ckpt), tmp_path / "nothing", "interop.json", "unreadable")


def test_existing_destination_needs_force(hf_checkpoints, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    code, output = run("convert", hf_checkpoints["llama"], dst, "--to", "interop")
    assert code == 2 and "already exists" in output and "--force" in output
    assert (dst / "keep.txt").read_text() == "precious"
    code, output = run("convert", hf_checkpoints["llama"], dst, "--to", "interop", "--force")
    assert code == 0, output
    assert not (dst / "keep.txt").exists() and (dst / "interop.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failure_midway_leaves_no_output(hf_checkpoints, tmp_path, monkeypatch):
    """An error after some files were written removes the temporary directory."""
    from interop import store
    calls = {"n": 0}
    original = store.StoreWriter.write

    def failing_write(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError("disk full")
        return original(self, name, tensor)

    monkeypatch.setattr(store.StoreWriter, "write", failing_write)
    from interop.convert import convert
    with pytest.raises(OSError):
        convert(hf_checkpoints["llama"], tmp_path / "out", dst_format="interop", tp=2)
    assert list(tmp_path.iterdir()) == []


def test_console_script_exit_code(tmp_path):
    """The installed `interop` entry point itself exits 2 with one line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "interop", "convert", str(tmp_path / "missing"), str(tmp_path / "o"),
                           "--to", "hf"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr


def test_inspect_and_summary(hf_checkpoints, tmp_path):
    code, output = run("convert", hf_checkpoints["gpt2"], tmp_path / "ckpt", "--to", "interop", "--tp", "2", "--pp", "3")
    assert code == 0
    assert "100 tensors" in output and "MB/s" in output and str(tmp_path / "ckpt") in output
    code, output = run("inspect", tmp_path / "ckpt")
    assert code == 0
    assert "interop checkpoint" in output and "tp=2 pp=3" in output
    assert "layers.5.attn.q.weight" in output and "total: 100 tensors" in output
    code, output = run("inspect", tmp_path / "ckpt", "--json")
    info = json.loads(output)
    assert info["format"] == "interop" and info["spec"]["arch"] == "gpt2" and info["total"]["tensors"] == 100
    code, output = run("inspect", hf_checkpoints["gpt2"], "--no-tensors")
    assert code == 0 and "hf checkpoint" in output and "unsharded" in output
