"""HF input in every file layout: sharded safetensors with an index, pytorch_model.bin; sharded output."""
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import build
from interop.convert import convert
from interop.errors import InteropError


def all_tensors(path):
    """Every tensor of an HF checkpoint directory, whatever its file layout."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    for f in sorted(path.glob("pytorch_model*.bin")):
        out.update(torch.load(f, weights_only=True))
    return out


def test_sharded_safetensors_input_and_output(tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    convert(tmp_path / "sharded", tmp_path / "mid", dst_format="interop", tp=2, pp=2)
    convert(tmp_path / "mid", tmp_path / "out", dst_format="hf", options={"max_shard_bytes": 250_000})
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values())) and len(files) > 1
    want, got = all_tensors(tmp_path / "sharded"), all_tensors(tmp_path / "out")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    transformers = pytest.importorskip("transformers")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)


def test_pytorch_model_bin_input(tmp_path):
    model = build("gpt2")
    src = tmp_path / "bin"
    src.mkdir()
    model.config.save_pretrained(src)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # an old-style mask buffer: dropped, reported
    torch.save(state, src / "pytorch_model.bin")
    summary = convert(src, tmp_path / "mid", dst_format="interop", tp=2)
    assert any("buffers" in note and "causal-mask" in note for note in summary.notes)
    convert(tmp_path / "mid", tmp_path / "out", dst_format="hf")
    got = load_file(tmp_path / "out" / "model.safetensors")
    expect = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    assert sorted(got) == sorted(expect) and all(torch.equal(got[k], expect[k]) for k in expect)


def test_unknown_tensor_is_an_error_not_silently_dropped(tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    from safetensors.torch import save_file
    save_file(state, tmp_path / "src" / "model.safetensors")
    with pytest.raises(InteropError, match="do not belong.*mlp.extra.weight"):
        convert(tmp_path / "src", tmp_path / "out", dst_format="interop")
    assert not (tmp_path / "out").exists()


def test_shape_disagreeing_with_config(tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InteropError, match="gate_proj.weight has shape \\[96, 64\\], config.json implies \\[128, 64\\]"):
        convert(tmp_path / "src", tmp_path / "out", dst_format="interop")


def test_model_hf_cannot_express_is_refused(tmp_path):
    """A Megatron-style LayerNorm + RoPE model must not be written as a (RMSNorm) HF Llama."""
    from interop.mappings.hf_config import hf_config_from_spec
    from interop.spec import ModelSpec
    spec = ModelSpec(arch="llama", num_layers=2, hidden=64, ffn_hidden=128, heads=8, kv_groups=8, head_dim=8,
                     vocab=100, padded_vocab=100, max_positions=64, norm="layernorm", norm_eps=1e-5,
                     activation="swiglu", position="rope")
    with pytest.raises(InteropError, match="HF llama cannot hold a model with norm=layernorm"):
        hf_config_from_spec(spec)
