"""MindFormers LoRA adapters (converters/mindspore/lora.py), tp 1 (tp > 1: test_mindformers_lora_tp.py): the legacy models' (mindpet) and the mcore-style
models' (parallel_core lora_layers.py) names.

Names confirmed in the installed tools: mindformers 2.1.0 mindformers/pet/tuners/lora_adapter.py replaces a matched
Linear by mindpet 1.0.4's LoRADense, whose parameters (mindpet/delta/lora.py) are `mindpet_delta_lora_a`
[lora_rank, in] and `mindpet_delta_lora_b` [out, lora_rank], scaled by lora_alpha / lora_rank; the LoraModel keeps
the base's names (mindformers/pet/models/lora.py, auto_prefix=False): `model.layers.0.attention.wq.weight` gains
`model.layers.0.attention.wq.mindpet_delta_lora_a`.  The consumer here is mindpet's own LoRADense: loaded
strictly with interop's tensors, its output equals W x + alpha/r B A x computed in torch.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli, run
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


def test_mindpets_lora_dense_computes_the_adapter(adapter, tmp_path, monkeypatch):
    """mindpet's LoRADense (what MindFormers' LoRA model is made of) loads wq's weight and interop's LoRA tensors
    by their names, strictly, and computes W x + alpha/r B A x."""
    monkeypatch.chdir(tmp_path)  # mindpet imports MindFormers, which writes ./output/log
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
    assert_refused(cli("convert", adapter / "mf", tmp_path / "out", "--to", "mindspore", "--pp", "2", "--vpp", "3"),
                   tmp_path / "out", "--vpp 1")


MCORE_BASE = dict(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=8, kv_groups=4, head_dim=8, vocab=250,
                  padded_vocab=250, max_positions=64, norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
                  position="rope", tied_embeddings=False, qk_norm=True)
QWEN3 = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, max_position_embeddings=64, compute_dtype="float32",
             params_dtype="float32", layernorm_compute_dtype="float32", softmax_compute_dtype="float32",
             rotary_dtype="float32", seq_length=8)


def test_mcore_style_lora_strict_loads_into_mindformers_lora_model(tmp_path, mcore):
    """--dialect mindformers-mcore: MindFormers' LoraModel around its TrainingQwen3ForCausalLM (parallel_core's
    ColumnParallelLinearWithLoRA / RowParallelLinearWithLoRA, built on CPU) loads the base written by interop and
    the adapter written by interop together, strictly: `<module>.lora_A.weight` / `.lora_B.weight`, B of
    linear_qkv grouped per KV group and of linear_fc1 interleaved like the weights; and it reads back."""
    ms = pytest.importorskip("mindspore")
    from helpers.ms_moe_store import moe_store
    from interop.adapter import AdapterSpec
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    from interop.tensors import TensorMeta
    base_path, spec, _ = moe_store(tmp_path / "base", base=MCORE_BASE, seed=3)
    adapter = AdapterSpec(rank=4, alpha=8, targets=("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up",
                                                    "mlp.down"))
    params = adapter.params(spec)
    torch.manual_seed(9)
    tensors = {p.name: torch.randn(p.shape) for p in params}
    for i in range(spec.num_layers):
        for group in (("attn.q", "attn.k", "attn.v"), ("mlp.gate", "mlp.up")):
            for t in group[1:]:
                tensors[f"layers.{i}.{t}.lora_a"] = tensors[f"layers.{i}.{group[0]}.lora_a"]
    (tmp_path / "a").mkdir()
    writer = StoreWriter(tmp_path / "a", spec, ParallelLayout.build(spec.num_layers),
                         [TensorMeta(p.name, torch.float32, p.shape) for p in params], adapter=adapter)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({})
    convert(base_path, tmp_path / "base-ms", dst_format="mindspore", dialect="mindformers-mcore")
    convert(tmp_path / "a", tmp_path / "lora-ms", dst_format="mindspore", dialect="mindformers-mcore")
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
    from mindformers.pet.models.lora import LoraModel
    from mindformers.pet.pet_config import LoraConfig
    pet = yaml.safe_load((tmp_path / "lora-ms" / "pet_config.yaml").read_text())["model"]["model_config"]["pet_config"]
    config = LoraConfig(lora_rank=pet["lora_rank"], lora_alpha=pet["lora_alpha"], lora_dropout=0.0,
                        target_modules=pet["target_modules"])
    model = LoraModel(config, TrainingQwen3ForCausalLM(Qwen3Config(**QWEN3)))
    saved = {**ms.load_checkpoint(str(tmp_path / "base-ms" / "model.ckpt")),
             **ms.load_checkpoint(str(tmp_path / "lora-ms" / "model.ckpt"))}
    not_loaded, unused = ms.load_param_into_net(model, saved, strict_load=True)
    assert not not_loaded and not unused, (not_loaded, unused)
    with CkptFile(tmp_path / "lora-ms" / "model.ckpt") as f:
        assert f.meta("decoder.layers.1.self_attention.linear_qkv.lora_B.weight")[1] == (128, 4)
        assert f.meta("decoder.layers.1.mlp.linear_fc1.lora_B.weight")[1] == (192, 4)
    convert(tmp_path / "lora-ms", tmp_path / "back", dst_format="interop")
    back = StoreReader(tmp_path / "back")
    assert back.source.adapter == dataclasses.replace(adapter, shared_a=True)  # one A per fused linear, stated
    for name, t in tensors.items():
        assert torch.equal(back.read(name), t), name


def test_a_runs_adapter_reads_with_the_runs_yaml(adapter, tmp_path):
    """A MindFormers run's `.ckpt` of LoRA tensors alone, described by the run's YAML (`--model-config`: its
    model_config and pet_config; written here by `interop map-args` from the base's config.json)."""
    code, out = run("map-args", adapter / "base" / "config.json", "--to", "mindformers", "-o", tmp_path / "run.yaml")
    assert code == 0, out
    doc = yaml.safe_load((tmp_path / "run.yaml").read_text())
    doc["model_config"]["pet_config"] = {"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.05,
                                         "target_modules": ".*wq|.*wk|.*wv|.*wo|.*w1|.*w2|.*w3"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "run").mkdir()
    shutil.copy(adapter / "mf" / "model.ckpt", tmp_path / "run" / "model.ckpt")
    convert(tmp_path / "run", tmp_path / "back", dst_format="peft", model_config=tmp_path / "run.yaml")
    x = load_file(adapter / "lora" / "adapter_model.safetensors")
    y = load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
