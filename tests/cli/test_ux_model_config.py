"""`--model-config` takes what its help says: a HF config.json, a Megatron args file or a MindSpeed /
MindFormers YAML, for the MindSpore reader as for the Megatron one (issue 14).

A bare MindSpore checkpoint (no `mindspore_model.json`) described by a MindSpeed YAML or a Megatron
args file that map-args writes from the model's config.json converts back to the source's tensors,
bit for bit."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from interop import mapargs
from interop.cli.main import main
from interop.convert import convert


@pytest.mark.parametrize("target,name", [("mindspeed", "model.yaml"), ("megatron", "args.sh"),
                                         ("hf", "config.json")])
def test_mindspore_reader_takes_any_model_description(hf_checkpoints, tmp_path, target, name):
    src = hf_checkpoints["llama"]
    convert(src, tmp_path / "ms", dst_format="mindspore", tp=2)
    (tmp_path / "ms" / "mindspore_model.json").unlink()  # a bare checkpoint, as MindSpeed saves it
    description = tmp_path / name
    # the vocabulary unpadded, as the MindSpore writer holds it (MindSpeed YAML states the padded size)
    description.write_text(mapargs.map_args(src / "config.json", target,
                                            values={"make_vocab_size_divisible_by": "1"}).text)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "ms"), str(tmp_path / "back"), "--to", "hf",
                                       "--model-config", str(description), "-q"])
    assert result.exit_code == 0, result.output
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_model_config_help_names_every_description_it_takes():
    for command in ("convert", "inspect"):
        out = CliRunner().invoke(main, [command, "--help"]).output
        assert "--model-config" in out and "MindSpeed" in out and "YAML" in out and "config.json" in out
