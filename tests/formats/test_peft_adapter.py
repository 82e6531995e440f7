"""HF PEFT LoRA adapters in and out (converters/peft.py), and merging one into its base (interop.merge).

The adapters are saved by peft itself (0.21.2, `get_peft_model(...).save_pretrained`, init_lora_weights=False so
that B is not zero), on tiny models built here: Llama with GQA (8 heads, 4 KV groups, vocab 250) adapted on
q, k, v, o, gate, up, down, and GPT2 adapted on its fused, transposed c_attn / c_proj (peft's Conv1D LoRA,
fan_in_fan_out).  What interop writes is loaded by `peft.PeftModel.from_pretrained`, and its logits are compared
with interop's own application of the adapter, W + alpha/r B A put into the base's weights by this test from
interop's canonical tensors.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import VOCAB, build
from helpers.hostile import assert_refused, cli
from interop.adapter import AdapterSpec, lora_names
from interop.convert import convert
from interop.layout import ParallelLayout
from interop.store import StoreReader, StoreWriter
from interop.tensors import TensorMeta

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.tensor([[1, 17, 33, 249, 5, 88, 120, 7]])


def _peft_adapter(kind, path, targets, seed=1, **config):
    model = build(kind)
    model.save_pretrained(path / "base")
    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=targets, task_type="CAUSAL_LM",
                           init_lora_weights=False, **config)
    peft.get_peft_model(model, lora).save_pretrained(path / "lora")
    return path / "base", path / "lora"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _peft_adapter("llama", tmp_path_factory.mktemp("llama"), LLAMA_TARGETS)


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def _peft_logits(base, adapter):
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return _logits(peft.PeftModel.from_pretrained(model, adapter).eval())


def _reference_logits(base, store):
    """interop's application of the adapter, computed apart from peft: the base HF model with each adapted
    weight W replaced by W + alpha/r B A, A and B read from interop's canonical tensors (common format)."""
    reader = StoreReader(store)
    adapter, names = reader.source.adapter, {m.name for m in reader.metas()}
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    hf = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
          "attn.o": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for target, module in hf.items():
                a, b = lora_names(f"layers.{i}.{target}.weight")
                if a in names:
                    linear = layer.get_submodule(module)
                    linear.weight += adapter.scaling * (reader.read(b).double() @ reader.read(a).double()).float()
    reader.close()
    return _logits(model)


def test_a_peft_saved_adapter_round_trips_through_the_common_format_at_tp2_pp2(llama, tmp_path):
    base, lora = llama
    convert(lora, tmp_path / "i", dst_format="interop", base=base, tp=2, pp=2)
    reader = StoreReader(tmp_path / "i")
    adapter = reader.source.adapter
    assert (adapter.rank, adapter.alpha, adapter.dropout, adapter.layers) == (4, 8, 0.05, None)
    assert adapter.shared_a is False  # q_proj, k_proj, v_proj: an A each
    assert adapter.targets == ("attn.k", "attn.o", "attn.q", "attn.v", "mlp.down", "mlp.gate", "mlp.up")
    assert reader.spec.kv_groups == 4 and reader.spec.vocab == VOCAB
    shards = reader.manifest["tensors"]
    assert len(shards["layers.0.attn.k.lora_b"]["shards"]) == 2 and len(shards["layers.0.attn.k.lora_a"]["shards"]) == 1
    assert len(shards["layers.5.mlp.down.lora_a"]["shards"]) == 2 and len(shards["layers.5.mlp.down.lora_b"]["shards"]) == 1
    reader.close()
    convert(tmp_path / "i", tmp_path / "back", dst_format="peft")
    x, y = load_file(lora / "adapter_model.safetensors"), load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.05)
    assert sorted(config["target_modules"]) == sorted(LLAMA_TARGETS)


def test_peft_loads_interops_adapter_and_computes_interops_logits(llama, tmp_path):
    base, lora = llama
    convert(lora, tmp_path / "i", dst_format="interop", base=base)
    convert(tmp_path / "i", tmp_path / "p", dst_format="peft")
    reference = _reference_logits(base, tmp_path / "i")
    plain = _logits(transformers.AutoModelForCausalLM.from_pretrained(base).eval())
    assert not torch.allclose(plain, reference, atol=1e-3)  # the adapter changes the output
    torch.testing.assert_close(_peft_logits(base, tmp_path / "p"), reference, atol=1e-5, rtol=1e-5)


def test_an_adapter_made_by_interop_loads_in_peft(tmp_path):
    """Not from peft at all: an AdapterSpec on q and v of layers 1 and 4, written to the common format at tp 2,
    then to PEFT (layers_to_transform)."""
    model = build("llama")
    model.save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "base-i", dst_format="interop")
    spec = StoreReader(tmp_path / "base-i").spec
    adapter = AdapterSpec(rank=2, alpha=3, targets=("attn.q", "attn.v"), layers=(1, 4))
    params = adapter.params(spec)
    layout = ParallelLayout.build(spec.num_layers, tp=2)
    (tmp_path / "a").mkdir()
    writer = StoreWriter(tmp_path / "a", spec, layout, [TensorMeta(p.name, torch.float32, p.shape) for p in params],
                         adapter=adapter)
    torch.manual_seed(3)
    for p in params:
        writer.write(p.name, torch.randn(p.shape) * 0.1)
    writer.finish({})
    convert(tmp_path / "a", tmp_path / "p", dst_format="peft")
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1, 4] and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    torch.testing.assert_close(_peft_logits(tmp_path / "base", tmp_path / "p"),
                               _reference_logits(tmp_path / "base", tmp_path / "a"), atol=1e-5, rtol=1e-5)


def test_merge_equals_base_plus_adapter(llama, tmp_path):
    base, lora = llama
    summary = convert(base, tmp_path / "merged", dst_format="hf", adapter=lora, merge=True)
    assert any("merged the LoRA adapter" in n for n in summary.notes)
    merged = _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval())
    torch.testing.assert_close(merged, _peft_logits(base, lora), atol=1e-5, rtol=1e-5)
    # the merged weights are exactly W + alpha/r B A in fp32
    w = load_file(base / "model.safetensors")["model.layers.2.self_attn.k_proj.weight"]
    ab = load_file(lora / "adapter_model.safetensors")
    key = "base_model.model.model.layers.2.self_attn.k_proj."
    want = torch.addmm(w, ab[key + "lora_B.weight"], ab[key + "lora_A.weight"], alpha=2.0)
    assert torch.equal(load_file(tmp_path / "merged" / "model.safetensors")["model.layers.2.self_attn.k_proj.weight"], want)


def test_merge_into_megatron_at_tp2_cast_once_to_bf16(llama, tmp_path):
    base, lora = llama
    convert(base, tmp_path / "m", dst_format="megatron", tp=2, adapter=lora, merge=True, dtype="bf16")
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.3.mlp.down_proj.weight"]
    w = load_file(base / "model.safetensors")["model.layers.3.mlp.down_proj.weight"]
    ab = load_file(lora / "adapter_model.safetensors")
    key = "base_model.model.model.layers.3.mlp.down_proj."
    assert torch.equal(got, torch.addmm(w, ab[key + "lora_B.weight"], ab[key + "lora_A.weight"], alpha=2.0).bfloat16())


def test_gpt2_fused_c_attn_one_a_for_q_k_v(tmp_path):
    """peft's LoRA on GPT2's Conv1D c_attn (q, k, v fused, stored [in, out]): one A [r, h], one B [3h, r]; read as
    three canonical adapters sharing A, written back as peft wrote it, and merged like peft merges it."""
    base, lora = _peft_adapter("gpt2", tmp_path, ["c_attn", "c_proj"], fan_in_fan_out=True)
    convert(lora, tmp_path / "i", dst_format="interop", base=base, tp=2)
    reader = StoreReader(tmp_path / "i")
    a = [reader.read(f"layers.0.attn.{x}.lora_a") for x in "qkv"]
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])
    assert reader.source.adapter.targets == ("attn.k", "attn.o", "attn.q", "attn.v", "mlp.down")  # c_proj: both
    assert reader.source.adapter.shared_a is True  # one A for the fused c_attn, stated in interop.json
    reader.close()
    code, err, out = cli("inspect", tmp_path / "i", "--no-tensors")
    assert code == 0 and "one A per fused module" in out, err
    convert(tmp_path / "i", tmp_path / "back", dst_format="peft")
    x, y = load_file(lora / "adapter_model.safetensors"), load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    assert json.loads((tmp_path / "back" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    convert(base, tmp_path / "merged", dst_format="hf", adapter=tmp_path / "i", merge=True)
    merged = _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval())
    torch.testing.assert_close(merged, _peft_logits(base, lora), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written

def test_rank_or_alpha_missing_is_refused(llama, tmp_path):
    base, lora = llama
    for key in ("r", "lora_alpha"):
        bad = tmp_path / f"no-{key}"
        shutil.copytree(lora, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        del config[key]
        (bad / "adapter_config.json").write_text(json.dumps(config))
        assert_refused(cli("convert", bad, tmp_path / "out", "--base", base, "--to", "interop"), tmp_path / "out",
                       f"no {key}", "never defaulted")


def test_an_adapter_for_another_base_names_the_first_mismatch(llama, tmp_path):
    base, lora = llama
    gpt2 = tmp_path / "gpt2"
    build("gpt2").save_pretrained(gpt2)
    assert_refused(cli("convert", lora, tmp_path / "out", "--base", gpt2, "--to", "interop"), tmp_path / "out",
                   "model.layers.0.mlp.down_proj", "not a weight of the base model")
    wider = tmp_path / "wider"
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,  # MHA: k, v wider
                                      num_hidden_layers=6, intermediate_size=96, vocab_size=VOCAB)
    transformers.LlamaForCausalLM(config).save_pretrained(wider)
    assert_refused(cli("convert", lora, tmp_path / "out", "--base", wider, "--to", "interop"), tmp_path / "out",
                   "self_attn.k_proj.lora_B.weight has shape [32, 4]", "need [64, 4]")
    assert_refused(cli("convert", wider, tmp_path / "out", "--adapter", lora, "--merge", "--to", "hf"),
                   tmp_path / "out", "k_proj.lora_B.weight has shape [32, 4]")
    assert_refused(cli("convert", lora, tmp_path / "out", "--to", "interop"), tmp_path / "out", "--base BASE")
    assert_refused(cli("convert", base, tmp_path / "out", "--adapter", lora, "--to", "hf"), tmp_path / "out",
                   "needs --merge")
    assert_refused(cli("convert", lora, tmp_path / "out", "--base", base, "--to", "dcp"), tmp_path / "out",
                   "cannot hold a LoRA adapter yet (interop, megatron, mindspore, peft can)")


def test_a_store_adapter_on_another_base_is_refused_at_merge(llama, tmp_path):
    base, lora = llama
    convert(lora, tmp_path / "i", dst_format="interop", base=base)
    gpt2 = tmp_path / "gpt2"
    build("gpt2").save_pretrained(gpt2)
    assert_refused(cli("convert", gpt2, tmp_path / "out", "--adapter", tmp_path / "i", "--merge", "--to", "hf"),
                   tmp_path / "out", "LoRA target module mlp.gate is not in the base model")


def test_inspect_describes_a_peft_adapter_on_its_base(llama):
    base, lora = llama
    code, err, out = cli("inspect", lora, "--base", base, "--no-tensors")
    assert code == 0, err
    assert "peft checkpoint" in out and "a LoRA adapter (rank 4, alpha 8, targets attn.k" in out and "84 tensors" in out
    assert_refused(cli("inspect", lora), None, "--base BASE")


def test_verify_shows_the_merge_equals_base_plus_adapter(llama, tmp_path):
    """`interop verify BASE MERGED --adapter A`: the source run is base + adapter (merged in the source's copy);
    a merge into bf16 Megatron passes within bf16's tolerance, the base alone (no merge) fails."""
    from interop.workflows.verify import verify
    base, lora = llama
    convert(base, tmp_path / "m", dst_format="megatron", tp=2, adapter=lora, merge=True, dtype="bf16")
    result = verify(base, tmp_path / "m", adapter=lora, frameworks=False)
    assert result.ok, "\n".join(result.lines())
    assert all(c.max_diff <= 5e-2 for c in result.checks)
    convert(base, tmp_path / "exact", dst_format="hf", adapter=lora, merge=True)
    result = verify(base, tmp_path / "exact", adapter=lora, frameworks=False)
    assert result.ok and max(c.max_diff for c in result.checks) == 0.0, "\n".join(result.lines())
    convert(base, tmp_path / "plain", dst_format="hf")
    assert not verify(base, tmp_path / "plain", adapter=lora, frameworks=False).ok


def test_an_adapters_optimizer_state_is_kept_in_the_common_format_and_noted_elsewhere(tmp_path):
    """A trained adapter's Adam moments (the trainer's optim.exp_avg.* of lora_a / lora_b) reshard with it in the
    common format; PEFT, Megatron and MindFormers adapters are written without them, each with a note."""
    build("llama").save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "base-i", dst_format="interop")
    spec = StoreReader(tmp_path / "base-i").spec
    adapter = AdapterSpec(rank=2, alpha=4, targets=("attn.o", "mlp.down"))
    params = adapter.params(spec)
    names = [p.name for p in params] + [f"optim.{k}.{p.name}" for k in ("exp_avg", "exp_avg_sq") for p in params]
    shapes = {p.name: p.shape for p in params}
    (tmp_path / "a").mkdir()
    metas = [TensorMeta(n, torch.float32, shapes[n.split(".", 2)[-1] if n.startswith("optim.") else n]) for n in names]
    writer = StoreWriter(tmp_path / "a", spec, ParallelLayout.build(spec.num_layers), metas, adapter=adapter)
    for m in metas:
        writer.write(m.name, torch.rand(m.shape))
    writer.finish({"iteration": 10})
    convert(tmp_path / "a", tmp_path / "tp2", dst_format="interop", tp=2, pp=3)
    kept = StoreReader(tmp_path / "tp2")
    for n in names:
        assert torch.equal(kept.read(n), StoreReader(tmp_path / "a").read(n)), n
    for fmt in ("peft", "megatron", "mindspore"):
        notes = convert(tmp_path / "tp2", tmp_path / fmt, dst_format=fmt).notes
        assert any("optimizer state not written (exp_avg, exp_avg_sq)" in n for n in notes), (fmt, notes)


def test_lora_on_the_output_head_is_refused_in_one_line(tmp_path):
    """peft 0.21 saves lm_head's base weight beside its LoRA (`lm_head.base_layer.weight`): the first key met is
    named; either way one line, nothing written."""
    base, lora = _peft_adapter("llama", tmp_path, ["q_proj", "lm_head"])
    assert_refused(cli("convert", lora, tmp_path / "out", "--base", base, "--to", "interop"), tmp_path / "out",
                   "base_model.model.lm_head.")
