"""Honest: MindSpeed training-state scalars that are NaN, Inf or fractional where a count belongs, and a weight
stored as a string, are one `error:` line naming the file and the scalar, with nothing written (they were
`ValueError` / `OverflowError` tracebacks from `int()`, or a NaN learning rate carried on, exit 0).  Rank files
whose scalars say an optimizer ran but that hold no moments are read as weights with a note saying so."""
import json
import shutil

import pytest
import torch

from helpers.hostile import assert_refused, cli, run
from interop.io.ms_ckpt import CkptFile, save_ckpt


@pytest.fixture(scope="module")
def mindspeed(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("scalars") / "ms"
    code, out = run("convert", hf_checkpoints["llama"], root, "--to", "mindspore", "--tp", "2")
    assert code == 0, out
    return root


def _rewrite(src, tmp_path, tag, value):
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    for path in sorted(dst.glob("rank_*/network.ckpt")):
        f = CkptFile(path)
        tensors = {k: f.read(k) for k in f.keys()}
        f.close()
        assert tag in tensors or tag in ("state_step", "max_lr", "num_steps", "lr_decay_style"), sorted(tensors)
        tensors[tag] = value
        save_ckpt(path, tensors)
    return dst


@pytest.mark.parametrize("tag,value,words", [
    ("step_num", torch.tensor(float("nan")), ["step_num is nan", "not a finite number"]),
    ("epoch_num", torch.tensor(float("inf")), ["epoch_num is inf", "not a finite number"]),
    ("state_step", torch.tensor([float("nan")]), ["state_step is [nan]"]),
    ("num_steps", torch.tensor(float("nan")), ["num_steps is nan"]),
    ("lr_decay_style", torch.tensor(float("-inf")), ["lr_decay_style is -inf"]),
    ("max_lr", torch.tensor(float("nan"), dtype=torch.float64), ["max_lr is nan"]),
    ("step_num", torch.tensor(2.5), ["step_num is 2.5", "not a whole number"]),
])
def test_scalar_that_is_not_a_finite_count(mindspeed, tmp_path, tag, value, words):
    src = _rewrite(mindspeed, tmp_path, tag, value)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "interop"), tmp_path / "out",
                   "rank_0/network.ckpt", "the training state is damaged", *words)


def test_weight_stored_as_a_string(mindspeed, tmp_path):
    tag = "language_model.embedding.word_embeddings.weight"
    src = _rewrite(mindspeed, tmp_path, tag, "hello")
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "interop"), tmp_path / "out", tag)


def test_finite_scalars_still_read(mindspeed, tmp_path):
    src = _rewrite(mindspeed, tmp_path, "step_num", torch.tensor(7.0))  # a whole float: read as 7
    code, out = run("convert", src, tmp_path / "out", "--to", "interop")
    assert code == 0, out
    assert json.loads((tmp_path / "out" / "interop.json").read_text())["state"]["iteration"] == 7


def test_moments_absent_while_scalars_say_an_optimizer_ran(mindspeed, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(mindspeed, dst)
    for path in sorted(dst.glob("rank_*/network.ckpt")):  # what MindSpeed's optimizer leaves beside the weights
        f = CkptFile(path)
        tensors = {k: f.read(k) for k in f.keys()}
        f.close()
        assert not any(k.startswith("exp_avg") for k in tensors)
        save_ckpt(path, dict(tensors, state_step=torch.tensor([3.0]), lr_group_0=torch.tensor(1e-4)))
    code, out = run("convert", dst, tmp_path / "out", "--to", "interop")
    assert code == 0, out
    assert "no optimizer moments (exp_avg.*, exp_avg_sq.*)" in out and "(step 3): weights only" in out, out
