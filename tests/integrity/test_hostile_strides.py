"""Exact: `_rebuild_tensor_v2` records with a stride of 0 (an `expand`ed tensor) or overlapping rows
(`as_strided`), as `torch.save` keeps them, are read exactly as `torch.load` materialises them, in HF
`pytorch_model.bin` and in Megatron rank files (never their storage's bytes taken as if contiguous)."""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers.hostile import run


def _strided(values: dict, keys) -> dict:
    """`values` with keys[0] a stride-0 expansion of its first row and keys[1] rows overlapping by half."""
    out = dict(values)
    a, b = keys
    out[a] = values[a][:1].clone().expand(values[a].shape)
    rows, cols = values[b].shape
    base = torch.randn(rows * cols // 2 + cols, dtype=values[b].dtype)
    out[b] = base.as_strided((rows, cols), (cols // 2, 1))
    assert out[a].stride()[0] == 0 and not out[b].is_contiguous()
    return out


def test_bin_with_stride_tricks_reads_as_torch_load(hf_checkpoints, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(hf_checkpoints["llama"] / "config.json", src)
    weights = load_file(hf_checkpoints["llama"] / "model.safetensors")
    keys = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    torch.save(_strided(weights, keys), src / "pytorch_model.bin")
    code, out = run("convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0, out
    want = torch.load(src / "pytorch_model.bin", weights_only=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    for key in keys + ["lm_head.weight"]:
        assert torch.equal(got[key], want[key].contiguous()), key


@pytest.mark.parametrize("to", ["hf", "interop"])
def test_megatron_rank_file_with_stride_tricks_reads_as_torch_load(hf_checkpoints, tmp_path, to):
    src = tmp_path / "src"
    assert run("convert", hf_checkpoints["llama"], src, "--to", "megatron")[0] == 0
    rank = next(src.rglob("model_optim_rng.pt"))
    obj = torch.load(rank, weights_only=False)  # a file this test wrote
    keys = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc1.weight"]
    obj["model"] = _strided(obj["model"], keys)
    torch.save(obj, rank)
    want = torch.load(rank, weights_only=False)["model"]
    code, out = run("convert", src, tmp_path / "out", "--to", to)
    assert code == 0, out
    code, out = run("convert", tmp_path / "out", tmp_path / "back", "--to", "megatron")
    assert code == 0, out
    back = torch.load(next((tmp_path / "back").rglob("model_optim_rng.pt")), weights_only=False)["model"]
    for key in keys:
        assert torch.equal(back[key], want[key].contiguous()), key
