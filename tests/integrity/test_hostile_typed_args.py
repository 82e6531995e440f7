"""Honest: a Megatron checkpoint whose stored args hold values of the wrong type (a string where an integer
belongs, a list for a size) is one `error:` line naming the flag, for `map-args` (it was a TypeError traceback)
and for `convert`, with nothing written."""
import shutil

import pytest
import torch

from helpers.hostile import assert_refused, cli, run


@pytest.fixture(scope="module")
def megatron(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("typed") / "m"
    code, out = run("convert", hf_checkpoints["llama"], root, "--to", "megatron")
    assert code == 0, out
    return root


def _with_arg(src, tmp_path, name, value):
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    for f in dst.rglob("model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)  # a file this test wrote
        setattr(obj["args"], name, value)
        torch.save(obj, f)
    return dst


@pytest.mark.parametrize("name,value,flag,want", [
    ("num_layers", "6", "--num-layers", "an integer"),
    ("ffn_hidden_size", [96], "--ffn-hidden-size", "an integer"),
    ("micro_batch_size", "a", "--micro-batch-size", "an integer"),
    ("lr", "x", "--lr", "a number"),
])
def test_map_args_on_checkpoint_args_of_the_wrong_type(megatron, tmp_path, name, value, flag, want):
    src = _with_arg(megatron, tmp_path, name, value)
    result = cli("map-args", src, "--to", "mindspeed", "-o", tmp_path / "out.yaml")
    assert_refused(result, tmp_path / "out.yaml", "model_optim_rng.pt", f"{flag} expects {want}")


@pytest.mark.parametrize("name,value", [("num_layers", "6"), ("ffn_hidden_size", [96]), ("hidden_size", 64.0)])
def test_convert_checkpoint_args_of_the_wrong_type(megatron, tmp_path, name, value):
    src = _with_arg(megatron, tmp_path, name, value)
    assert_refused(cli("convert", src, tmp_path / "out", "--to", "hf"), tmp_path / "out",
                   f"args.{name} is {value!r}, not an integer")
