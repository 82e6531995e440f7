"""`interop train` refuses bad input with one line on stderr and exit code 2, before starting any rank."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from interop.cli.main import main
from interop.trainer.init import init_checkpoint, read_spec
from helpers.specs import LLAMA, write_spec


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    return write_spec(tmp_path_factory.mktemp("spec") / "llama.yaml", LLAMA)


def run(args, env=None):
    result = CliRunner().invoke(main, ["train", *map(str, args)], env=env)
    return result


def assert_user_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_world_size_must_equal_dp_tp_pp(spec_file, monkeypatch):
    monkeypatch.delenv("INTEROP_SPAWNED", raising=False)
    result = run(["--init-spec", spec_file, "--tp", 2, "--dp", 1], env={"RANK": "0", "WORLD_SIZE": "3"})
    assert_user_error(result, "world size 3 is not dp*tp*pp = 1*2*1")
    result = run(["--init-spec", spec_file, "--tp", 2], env={"RANK": "0", "WORLD_SIZE": "3"})
    assert_user_error(result, "world size 3")


def test_tp_must_divide_heads(spec_file):
    assert_user_error(run(["--init-spec", spec_file, "--tp", 3]), "tp=3 does not divide the attention heads (4)")


def test_pp_must_divide_layers(spec_file):
    assert_user_error(run(["--init-spec", spec_file, "--pp", 3]), "4 layers cannot be split evenly over pp=3")


def test_resume_needs_a_complete_checkpoint(tmp_path, spec_file):
    assert_user_error(run(["--resume", "--save", tmp_path / "empty"]), "--resume: no complete checkpoint in")
    half = tmp_path / "run" / "step_000004"  # a directory a killed save could leave: shards, no manifest
    half.mkdir(parents=True)
    (half / "model-tp00-pp00.safetensors").write_bytes(b"\0" * 64)
    assert_user_error(run(["--resume", "--save", tmp_path / "run"]), "no complete checkpoint")
    assert_user_error(run(["--load", half]), "not a complete interop checkpoint (no interop.json)")
    assert_user_error(run(["--load", tmp_path / "nowhere"]), "checkpoint not found")


def test_truncated_checkpoint_is_refused(tmp_path, spec_file):
    ckpt = init_checkpoint(read_spec(spec_file), tmp_path / "ckpt")
    shard = ckpt / "model-tp00-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_user_error(run(["--load", ckpt]), "model-tp00-pp00.safetensors", "truncated")


def test_resume_from_weights_only_checkpoint_is_refused(tmp_path, spec_file):
    ckpt = init_checkpoint(read_spec(spec_file), tmp_path / "ckpt")
    assert_user_error(run(["--resume", "--load", ckpt]), "no training state to resume from")


def test_save_directory_with_checkpoints_needs_resume(tmp_path, spec_file):
    init_checkpoint(read_spec(spec_file), tmp_path / "run" / "step_000002")
    assert_user_error(run(["--init-spec", spec_file, "--save", tmp_path / "run"]), "already holds checkpoints",
                      "--resume")


def test_nothing_to_train_and_bad_batch(spec_file):
    assert_user_error(run(["--steps", 2]), "nothing to train")
    assert_user_error(run(["--init-spec", spec_file, "--micro-batch-size", 3, "--global-batch-size", 4]),
                      "global batch 4 is not a multiple of micro batch 3 x dp 1")


def test_bad_data_file(tmp_path, spec_file):
    (tmp_path / "ids.txt").write_text("1 2 3")
    assert_user_error(run(["--init-spec", spec_file, "--data", tmp_path / "ids.txt"]), "must be a .npy or .bin")
