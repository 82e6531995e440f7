"""MindFormers LoRA adapters (converters/mindspore/lora.py), tp 1.

Names confirmed in the installed tools: mindformers 2.1.0 mindformers/pet/tuners/lora_adapter.py replaces a matched
Linear by mindpet 1.0.4's LoRADense, whose parameters (mindpet/delta/lora.py) are `mindpet_delta_lora_a`
[lora_rank, in] and `mindpet_delta_lora_b` [out, lora_rank], scaled by lora_alpha / lora_rank; the LoraModel keeps
the base's names (mindformers/pet/models/lora.py, auto_prefix=False): `model.layers.0.attention.wq.weight` gains
`model.layers.0.attention.wq.mindpet_delta_lora_a`.  The consumer here is mindpet's own LoRADense: loaded
strictly with interop's tensors, its output equals W x + alpha/r B A x computed in torch.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli
from interop.convert import convert
from interop.io.ms_ckpt import CkptFile

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("mflora")
    model = build("llama")
    model.save_pretrained(root / "base")
    torch.manual_seed(2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, init_lora_weights=False,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft.get_peft_model(model, lora).save_pretrained(root / "lora")
    convert(root / "lora", root / "mf", dst_format="mindspore", base=root / "base")
    return root


def test_written_as_mindformers_lora_model_names_it_and_back(adapter, tmp_path):
    with CkptFile(adapter / "mf" / "model.ckpt") as f:
        keys = set(f.keys())
        assert f.meta("model.layers.0.attention.wk.mindpet_delta_lora_b")[1] == (32, 4)  # GQA k: 4 groups x 8
        assert f.meta("model.layers.5.feed_forward.w2.mindpet_delta_lora_a")[1] == (4, 96)
    assert len(keys) == 6 * 7 * 2 and all(".mindpet_delta_lora_" in k for k in keys)
    pet = yaml.safe_load((adapter / "mf" / "pet_config.yaml").read_text())["model"]["model_config"]["pet_config"]
    assert (pet["pet_type"], pet["lora_rank"], pet["lora_alpha"], pet["lora_dropout"]) == ("lora", 4, 8, 0.05)
    assert set(pet["target_modules"].split("|")) == {".*wq", ".*wk", ".*wv", ".*wo", ".*w1", ".*w2", ".*w3"}
    convert(adapter / "mf", tmp_path / "back", dst_format="peft")
    x = load_file(adapter / "lora" / "adapter_model.safetensors")
    y = load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_mindpets_lora_dense_computes_the_adapter(adapter):
    """mindpet's LoRADense (what MindFormers' LoRA model is made of) loads wq's weight and interop's LoRA tensors
    by their names, strictly, and computes W x + alpha/r B A x."""
    ms = pytest.importorskip("mindspore")
    from mindpet.delta.lora import LoRADense

    wq = LoRADense(in_channels=64, out_channels=64, lora_rank=4, lora_alpha=8, lora_dropout=0.0, has_bias=False,
                   param_init_type=ms.float32, compute_dtype=ms.float32)
    wq.update_parameters_name("model.layers.2.attention.wq.")
    base = load_file(adapter / "base" / "model.safetensors")["model.layers.2.self_attn.q_proj.weight"]
    with CkptFile(adapter / "mf" / "model.ckpt") as f:
        a = f.read("model.layers.2.attention.wq.mindpet_delta_lora_a")
        b = f.read("model.layers.2.attention.wq.mindpet_delta_lora_b")
    params = {"model.layers.2.attention.wq.weight": ms.Parameter(ms.Tensor(base.numpy()), "w"),
              "model.layers.2.attention.wq.mindpet_delta_lora_a": ms.Parameter(ms.Tensor(a.numpy()), "a"),
              "model.layers.2.attention.wq.mindpet_delta_lora_b": ms.Parameter(ms.Tensor(b.numpy()), "b")}
    not_loaded, unused = ms.load_param_into_net(wq, params, strict_load=True)
    assert not not_loaded and not unused, (not_loaded, unused)
    x = torch.randn(3, 64)
    got = torch.from_numpy(wq(ms.Tensor(x.numpy())).asnumpy())
    want = x @ base.T + 2.0 * (x @ a.T) @ b.T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_merge_from_a_mindformers_adapter(adapter, tmp_path):
    transformers = pytest.importorskip("transformers")
    convert(adapter / "base", tmp_path / "merged", dst_format="hf", adapter=adapter / "mf", merge=True)
    tokens = torch.tensor([[5, 9, 200, 3]])
    model = transformers.AutoModelForCausalLM.from_pretrained(adapter / "base")
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(model, adapter / "lora").eval()(tokens).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_alpha_missing_from_pet_config_is_refused(adapter, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(adapter / "mf", bad)
    doc = yaml.safe_load((bad / "pet_config.yaml").read_text())
    del doc["model"]["model_config"]["pet_config"]["lora_alpha"]
    (bad / "pet_config.yaml").write_text(yaml.safe_dump(doc))
    assert_refused(cli("convert", bad, tmp_path / "out", "--to", "peft"), tmp_path / "out", "no lora_alpha",
                   "never defaulted")
    assert_refused(cli("convert", adapter / "mf", tmp_path / "out", "--to", "mindspore", "--tp", "2"), tmp_path / "out",
                   "tp 1")
