"""map-args: LoRA settings (issue 28) between MindSpeed-LLM's --lora-* flags, Hugging Face PEFT's adapter_config.json
and MindFormers' pet_config, each written file loaded by its framework's own config class."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from interop import mapargs
from interop.mappings import lora_modules
from helpers.mapargs_loaders import mindformer_config, run

SCRIPT = """torchrun --nproc_per_node 8 posttrain_gpt.py \\
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 --seq-length 512 \\
  --max-position-embeddings 512 --swiglu --vocab-size 1000 \\
  --lora-r 8 --lora-alpha 16 --lora-target-modules {targets} --lr 1e-4
"""
ALL = "linear_qkv linear_proj linear_fc1 linear_fc2"
# MindFormers 2.1.0's Llama cells (models/llama/llama_transformer.py self.wq / wk / wv / wo, llama_layer.py
# FeedForward self.w1 / w2 / w3) and others of the same model
MINDFORMERS_CELLS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3", "attention_norm", "ffn_norm", "tok_embeddings",
                     "lm_head"]


def _script(tmp_path, targets=ALL, extra=""):
    path = tmp_path / "finetune.sh"
    path.write_text(SCRIPT.format(targets=targets).replace("--lr 1e-4", f"--lr 1e-4 {extra}"))
    return path


def _lost(result):
    return {e.flag: e.why for e in result.entries if e.lost}


def test_lora_flags_to_peft_load_in_peft_on_the_modules_they_name(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    result = mapargs.map_args(_script(tmp_path, "linear_qkv linear_fc2", "--lora-dropout 0.05"), to="peft")
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text(result.text)
    config = peft.LoraConfig.from_pretrained(out)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.05)
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "down_proj"}
    assert not {f for f in _lost(result) if f.startswith("--lora")}  # every LoRA value held
    tiny = transformers.LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(tiny), config)
    adapted = {name.split(".")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")
               and len(getattr(module, "lora_A")) > 0}
    assert adapted == {"q_proj", "k_proj", "v_proj", "down_proj"}


def test_a_peft_saved_adapter_config_comes_back_as_mindspeed_llm_flags(tmp_path):
    peft = pytest.importorskip("peft")
    peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, task_type="CAUSAL_LM",
                    target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]).save_pretrained(tmp_path)
    result = mapargs.map_args(tmp_path / "adapter_config.json", to="mindspeed-llm")
    assert result.source.format == "peft"  # told by its content
    assert "--lora-r 4" in result.text and "--lora-alpha 8" in result.text
    assert "--lora-target-modules linear_qkv linear_fc1" in result.text
    # MindSpeed-LLM fixes the dropout at 0.0 (--lora-dropout is MindSpeed-MM's): reported, not dropped silently
    assert "MindSpeed-MM" in _lost(result)["--lora-dropout"]
    assert set(_lost(result)) == {"--lora-dropout"}  # PEFT's other fields at their plain-LoRA values say nothing
    back = mapargs.read_target(result.text, "megatron")[0]
    assert (back["lora_r"], back["lora_alpha"], back["lora_target_modules"]) == (4, 8, ["linear_qkv", "linear_fc1"])


def test_part_of_a_fused_module_is_reported_never_widened_silently(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_rslora": True}))
    result = mapargs.map_args(tmp_path / "adapter_config.json", to="mindspeed-llm")
    lost = _lost(result)
    assert "without k_proj" in lost["target_modules"] and "linear_qkv" in lost["target_modules"]
    assert "alpha / sqrt(r)" in lost["use_rslora"]
    assert "--lora-target-modules linear_qkv" in result.text


def test_pet_config_loads_in_mindformers_and_matches_its_cells(tmp_path):
    result = mapargs.map_args(_script(tmp_path, "linear_qkv linear_proj", "--lora-dropout 0.05"),
                              to="mindformers-legacy")
    out = tmp_path / "run_lora.yaml"
    out.write_text(result.text)
    pet = mindformer_config(out).model.model_config.pet_config  # MindFormerConfig: raises on a key it does not know
    assert (pet.pet_type, pet.lora_rank, pet.lora_alpha, pet.lora_dropout) == ("lora", 8, 16, 0.05)
    matched = [name for name in MINDFORMERS_CELLS if re.match(pet.target_modules, name)]  # LoraAdapter's own test
    assert matched == ["wq", "wk", "wv", "wo"]
    assert not {f for f in _lost(result) if f.startswith("--lora")}
    # MindFormers' own LoraConfig takes the section (mindformers/pet/pet_config.py, built by get_pet_model)
    code = ("import json,sys; from mindformers.pet.pet_config import LoraConfig; d=json.load(sys.stdin); "
            "d.pop('pet_type'); c=LoraConfig(**d); print(json.dumps([c.pet_type, c.lora_rank, c.target_modules]))")
    env = {**os.environ, "LOCAL_DEFAULT_PATH": str(tmp_path / "log")}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(dict(pet)), capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    if done.returncode and "No module named" in done.stderr:
        pytest.skip(f"mindformers cannot be imported here: {done.stderr.strip().splitlines()[-1]}")
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["lora", 8, pet.target_modules]


def test_pet_config_in_mindformers_legacy_cell_names_and_its_defaults(tmp_path):
    doc = {"model": {"model_config": {"type": "LlamaConfig", "num_layers": 2, "pet_config": {
        "pet_type": "lora", "lora_alpha": 32, "target_modules": ".*wq|.*wk|.*wv|.*wo|.*w2", "lora_a_init": "normal"}}}}
    back, entries, _ = mapargs.read_target(yaml.safe_dump(doc), "mindformers-legacy")
    assert back["lora_target_modules"] == ["linear_qkv", "linear_proj", "linear_fc2"]
    assert (back["lora_r"], back["lora_alpha"], back["lora_dropout"]) == (8, 32, 0.01)  # MindFormers' defaults
    assert not [e for e in entries if "pet_config" in e.flag]
    doc["model"]["model_config"]["pet_config"]["target_modules"] = ".*linear_qkv|.*w1|.*mapping"  # mcore cells too
    back, _, _ = mapargs.read_target(yaml.safe_dump(doc), "mindformers-legacy")
    assert back["lora_target_modules"] == ["linear_qkv", "linear_fc1"]
    _, entries, _ = mapargs.read_target(yaml.safe_dump(doc), "mindformers-legacy")
    [note] = [e for e in entries if e.flag.endswith("target_modules")]
    assert note.lost and "w1 without w3" in note.why and "mapping: no Megatron-core module" in note.why


def test_peft_to_pet_config_and_back_keeps_the_adapter(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
         "target_modules": ["o_proj", "down_proj", "gate_proj", "up_proj"]}))
    code, out, err = run(tmp_path / "adapter_config.json", "--to", "mindformers-legacy", "-o", tmp_path / "m.yaml")
    assert code == 0, err
    pet = yaml.safe_load((tmp_path / "m.yaml").read_text())["model"]["model_config"]["pet_config"]
    assert pet == {"pet_type": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                   "target_modules": ".*wo|.*w1|.*w3|.*w2"}
    code, out, err = run(tmp_path / "m.yaml", "--to", "peft", "-o", tmp_path / "again.json")
    assert code == 0, err
    again = json.loads((tmp_path / "again.json").read_text())
    assert (again["r"], again["lora_alpha"], again["lora_dropout"]) == (16, 32, 0.0)
    assert set(again["target_modules"]) == {"o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_target_with_no_counterpart_is_reported_with_the_reason(tmp_path):
    result = mapargs.map_args(_script(tmp_path, "linear_qkv output_layer"), to="peft")
    assert "'output_layer': not a module interop maps" in _lost(result)["--lora-target-modules"]
    result = mapargs.map_args(_script(tmp_path, "query_key_value dense"), to="peft")  # MindSpeed-LLM legacy names
    assert set(json.loads(result.text)["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not _lost(result).get("--lora-target-modules")  # the same modules, spelled the mcore way
    assert lora_modules.same_targets(["dense", "query_key_value"], ["linear_qkv", "linear_proj"])


def test_upstream_megatron_names_the_lora_flags_and_no_targets_warns(tmp_path):
    result = mapargs.map_args(_script(tmp_path), to="megatron")
    assert "--lora" not in result.text and "a MindSpeed-LLM argument" in _lost(result)["--lora-r"]
    plain = tmp_path / "plain.sh"
    plain.write_text("python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                     "--max-position-embeddings 128 --seq-length 128\n")
    result = mapargs.map_args(plain, to="peft")
    assert "target_modules" not in json.loads(result.text)
    assert any("names no LoRA target" in w for w in result.warnings)
