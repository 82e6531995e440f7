"""Honest, bounded and checked at the door: each bad value or oversized file is one `error:` line (exit 2),
within seconds, before any work and with nothing left behind; the limit is named in the line.

Limits (README "What you can rely on"): tracker and DeepSpeed `latest` files 4,096 bytes, a torch_dist
`metadata.json` 1 MiB, `interop.json` 64 MiB, args files and configs 1 MiB, `train --seq-length` 16,384.
"""
import os
import time

import pytest

from helpers.hostile import assert_one_line_error, assert_refused, cli, run
from helpers.specs import LLAMA, write_spec

SECONDS = 20  # every refusal here must come well within this (the CPU is shared; the work itself is ~0.1 s)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    return write_spec(tmp_path_factory.mktemp("spec") / "llama.yaml", LLAMA)


def timed(*args):
    start = time.monotonic()
    result = cli(*args)
    elapsed = time.monotonic() - start
    assert elapsed < SECONDS, f"took {elapsed:.1f} s, over the {SECONDS} s bound"
    return result


@pytest.mark.parametrize("flag,value,words", [
    ("--steps", "0", ["--steps must be a positive integer, got 0"]),
    ("--global-batch-size", "0", ["--global-batch-size must be a positive integer, got 0"]),
    ("--micro-batch-size", "0", ["--micro-batch-size must be a positive integer"]),
    ("--stop-at", "-1", ["--stop-at must be a positive integer, got -1"]),
    ("--clip-grad", "-1", ["--clip-grad must be a finite number >= 0.0, got -1.0"]),
    ("--lr", "nan", ["--lr must be a finite number", "got nan"]),
    ("--lr", "inf", ["--lr must be a finite number", "got inf"]),
    ("--weight-decay", "-0.5", ["--weight-decay must be"]),
    ("--seq-length", "100000", ["seq-length 100000", "16,384"]),
])
def test_train_values_checked_at_the_door(spec_file, tmp_path, flag, value, words):
    result = timed("train", "--init-spec", spec_file, "--save", tmp_path / "run", flag, value)
    assert_refused(result, tmp_path / "run", *words)


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_verify_tolerance_checked_at_the_door(hf_checkpoints, tmp_path, value):
    result = timed("verify", hf_checkpoints["llama"], hf_checkpoints["llama"], "--tolerance", value)
    assert_one_line_error(result[0], result[1], 2, "--tolerance", "finite number >= 0")


def test_superscript_digit_in_the_tracker_is_one_line(hf_checkpoints, tmp_path):
    """'²'.isdigit() is True and int('²') raises: digits are ASCII digits."""
    src = tmp_path / "meg"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "megatron")[0] == 0
    (src / "latest_checkpointed_iteration.txt").write_text("²\n")
    result = timed("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "expected an iteration number")


def test_superscript_digit_in_map_args_set_is_one_line(tmp_path):
    args = tmp_path / "a.sh"
    args.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4\n")
    result = timed("map-args", args, "--to", "megatron", "--set", "world_size=²", "-o", tmp_path / "out.sh")
    assert_one_line_error(result[0], result[1], 2, "world_size", "integer")
    assert not (tmp_path / "out.sh").exists()


def _sparse(path, size=3 << 30):
    """A `size`-byte sparse file (a few KB on disk): read whole, it would take `size` of memory."""
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("name,words", [
    ("latest_checkpointed_iteration.txt", ["tracker file", "4,096"]),
    ("interop.json", ["manifest", "67,108,864"]),
])
def test_sparse_small_files_are_refused_by_size(hf_checkpoints, tmp_path, name, words):
    fmt = "megatron" if name.startswith("latest") else "interop"
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", fmt)[0] == 0
    _sparse(src / name)
    result = timed("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", *words)


def test_sparse_dist_metadata_json_is_refused_by_size(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "megatron", "--format", "torch_dist")[0] == 0
    meta = next(src.rglob("metadata.json"))
    _sparse(meta)
    result = timed("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "metadata.json", "1,048,576")


def test_deeply_nested_dist_metadata_json_is_one_line(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "megatron", "--format", "torch_dist")[0] == 0
    meta = next(src.rglob("metadata.json"))
    meta.write_text("[" * 100_000 + "]" * 100_000)
    result = timed("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(result, tmp_path / "out", "nested too deeply")


@pytest.mark.parametrize("kind", ["sparse", "fifo", "dev_zero"])
def test_map_args_input_is_bounded(tmp_path, kind):
    if kind == "sparse":
        src = tmp_path / "args.sh"
        _sparse(src)
        words = ["1,048,576"]
    elif kind == "fifo":
        src = tmp_path / "args.fifo"
        os.mkfifo(src)  # no writer: a plain open would wait for ever
        words = ["FIFO"]
    else:
        src = "/dev/zero"
        words = ["character device"]
    result = timed("map-args", src, "--to", "megatron", "-o", tmp_path / "out.sh")
    assert_one_line_error(result[0], result[1], 2, *words)
    assert not (tmp_path / "out.sh").exists()


def test_tokenizer_dev_zero_is_refused(hf_checkpoints, tmp_path):
    result = timed("convert", hf_checkpoints["llama"], tmp_path / "out", "--to", "hf", "--tokenizer", "/dev/zero")
    assert_refused(result, tmp_path / "out", "/dev/zero")


def test_map_args_output_onto_its_own_input_is_refused(tmp_path):
    args = tmp_path / "a.sh"
    text = "--num-layers 2 --hidden-size 64 --num-attention-heads 4\n"
    args.write_text(text)
    for flag in ("-o", "--report"):
        result = timed("map-args", args, "--to", "megatron", flag, args)
        assert_one_line_error(result[0], result[1], 2, "is the input", "overwritten")
        assert args.read_text() == text


def test_destination_inside_the_source_is_refused(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "hf")[0] == 0
    before = sorted(p.name for p in src.iterdir())
    result = timed("convert", src, src / "out", "--to", "interop")
    assert_refused(result, src / "out", "inside the input", "written into the source")
    assert sorted(p.name for p in src.iterdir()) == before
