"""Megatron LoRA adapters (converters/megatron/lora.py): the torch format as MindSpeed-LLM saves them, any tp / pp.

Names and TP cuts confirmed in the tools' sources (Ascend/MindSpeed-LLM c77308a, peft 0.21.2):
- peft/tuners/lora/tp_layer.py LoraParallelLinear: around a ColumnParallelLinear, lora_A is an nn.Linear (whole
  on every rank) and lora_B a ColumnParallelLinear (rows cut); around a RowParallelLinear, lora_A is a
  RowParallelLinear (columns cut) and lora_B an nn.Linear;
- mindspeed_llm/tasks/checkpoint/convert_mg2hf.py: keys `decoder.layers.{i}.<module>.lora_A.default.weight`;
  `set_model_layer_mlp_lora` takes fc1's A from tp rank 0 for both gate_proj and up_proj, gathers fc1's B over
  tp and splits each rank's rows into gate and up, gathers fc2's A over tp (columns), takes fc2's B from rank 0;
- mindspeed_llm/features_manager/finetune/lora.py: --lora-r, --lora-alpha, --lora-target-modules (the args).
Megatron-Bridge (src/megatron/bridge/peft/utils.py ParallelLinearAdapter, adapter_wrapper.py) names the same
tensors `<module>.adapter.linear_in.weight` / `.adapter.linear_out.weight` and cuts every one of them over tp
(linear_in of a column-parallel module on its rank dimension, linear_out of a row-parallel one on its rows), in
torch_dist checkpoints: tests/formats/test_bridge_lora_dist.py.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import build
from helpers.hostile import assert_refused, cli
from interop.adapter import AdapterSpec
from interop.convert import convert
from interop.io.torch_file import LazyTorchFile
from interop.layout import ParallelLayout
from interop.store import StoreReader, StoreWriter
from interop.tensors import TensorMeta

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")


@pytest.fixture(scope="module")
def shared_a(tmp_path_factory):
    """A tiny Llama (GQA: 8 heads, 4 KV groups; vocab 250; 6 layers) and a common-format adapter on it whose q, k,
    v share one A and gate, up another (the form megatron-core's fused linears hold)."""
    root = tmp_path_factory.mktemp("mlora")
    build("llama").save_pretrained(root / "base")
    convert(root / "base", root / "base-i", dst_format="interop")
    spec = StoreReader(root / "base-i").spec
    adapter = AdapterSpec(rank=4, alpha=8, targets=ALL, dropout=0.1)
    params = adapter.params(spec)
    torch.manual_seed(5)
    tensors = {p.name: torch.randn(p.shape) * 0.1 for p in params}
    for i in range(spec.num_layers):
        for group in (("attn.q", "attn.k", "attn.v"), ("mlp.gate", "mlp.up")):
            for t in group[1:]:
                tensors[f"layers.{i}.{t}.lora_a"] = tensors[f"layers.{i}.{group[0]}.lora_a"]
    (root / "a").mkdir()
    writer = StoreWriter(root / "a", spec, ParallelLayout.build(spec.num_layers),
                         [TensorMeta(p.name, torch.float32, p.shape) for p in params], adapter=adapter)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({})
    return root, tensors


def _rank(root, t, p):
    folder = next(p for p in root.iterdir() if p.is_dir())  # iter_NNNNNNN or release
    name = f"mp_rank_{t:02d}_{p:03d}" if (folder / f"mp_rank_{t:02d}_{p:03d}").is_dir() else f"mp_rank_{t:02d}"
    return LazyTorchFile(folder / name / "model_optim_rng.pt")


@pytest.mark.parametrize("tp,pp,vpp", [(2, 2, 1), (1, 3, 1), (4, 1, 1), (2, 3, 2)])
def test_round_trip_at_any_tp_pp(shared_a, tmp_path, tp, pp, vpp):
    root, tensors = shared_a
    convert(root / "a", tmp_path / "m", dst_format="megatron", tp=tp, pp=pp, vpp=vpp)
    obj = _rank(tmp_path / "m", 0, pp - 1).obj
    assert sorted(k for k in obj if k.startswith("model")) == (["model"] if vpp == 1 else ["model0", "model1"])
    convert(tmp_path / "m", tmp_path / "back", dst_format="interop")
    reader = StoreReader(tmp_path / "back")
    # megatron-core's fused linears hold one A: the adapter read from them states it (shared_a)
    assert reader.source.adapter == AdapterSpec(rank=4, alpha=8, targets=ALL, dropout=0.1, shared_a=True)
    for name, t in tensors.items():
        assert torch.equal(reader.read(name), t), name
    reader.close()


def test_rank_files_are_cut_as_mindspeed_llm_reads_them(shared_a, tmp_path):
    """The rank files at tp 2 read by MindSpeed-LLM's own rule (convert_mg2hf.py, applied here by hand) give the
    canonical adapter back; shapes are peft tp_layer's."""
    root, tensors = shared_a
    convert(root / "a", tmp_path / "m", dst_format="megatron", tp=2, pp=2)
    r0, r1 = _rank(tmp_path / "m", 0, 1), _rank(tmp_path / "m", 1, 1)
    m0, m1 = r0.obj["model"], r1.obj["model"]
    args = r0.obj["args"]
    assert (args.lora_r, args.lora_alpha, args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (4, 8, 2, 2)
    assert args.lora_target_modules == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    key = "decoder.layers.{}.mlp.linear_fc{}.lora_{}.default.weight"
    local, layer = 1, 4  # stage 1 holds layers 3-5
    fc1_a = r0.read(m0[key.format(local, 1, "A")])
    assert torch.equal(fc1_a, r1.read(m1[key.format(local, 1, "A")]))  # replicated [r, h]
    b = [r.read(m[key.format(local, 1, "B")]) for r, m in ((r0, m0), (r1, m1))]
    gate = torch.cat([x.chunk(2)[0] for x in b])  # each rank [gate_t; up_t]
    up = torch.cat([x.chunk(2)[1] for x in b])
    fc2_a = torch.cat([r0.read(m0[key.format(local, 2, "A")]), r1.read(m1[key.format(local, 2, "A")])], dim=1)
    fc2_b = r0.read(m0[key.format(local, 2, "B")])
    assert torch.equal(fc1_a, tensors[f"layers.{layer}.mlp.gate.lora_a"])
    assert torch.equal(gate, tensors[f"layers.{layer}.mlp.gate.lora_b"]) and torch.equal(up, tensors[f"layers.{layer}.mlp.up.lora_b"])
    assert torch.equal(fc2_a, tensors[f"layers.{layer}.mlp.down.lora_a"])
    assert torch.equal(fc2_b, tensors[f"layers.{layer}.mlp.down.lora_b"])
    qkv_b = r0.read(m0[f"decoder.layers.{local}.self_attention.linear_qkv.lora_B.default.weight"])
    assert qkv_b.shape == (128 // 2, 4)  # (8 heads + 2 * 4 groups) * head_dim 8 / tp 2 rows, grouped
    assert torch.equal(qkv_b[:16], tensors[f"layers.{layer}.attn.q.lora_b"][:16])  # group 0: q heads 0, 1
    assert torch.equal(qkv_b[16:24], tensors[f"layers.{layer}.attn.k.lora_b"][:8])  # then k_0, v_0
    assert torch.equal(qkv_b[24:32], tensors[f"layers.{layer}.attn.v.lora_b"][:8])


def test_megatron_adapter_to_peft_loads_with_the_same_logits_as_merged(shared_a, tmp_path):
    root, _ = shared_a
    convert(root / "a", tmp_path / "m", dst_format="megatron", tp=2)
    convert(tmp_path / "m", tmp_path / "p", dst_format="peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 249]])
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(model, tmp_path / "p").eval()(tokens).logits
    convert(root / "base", tmp_path / "merged", dst_format="hf", adapter=tmp_path / "m", merge=True)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_distinct_q_k_v_a_has_no_megatron_form(tmp_path):
    """peft's adapter on q_proj, k_proj, v_proj has three A's; megatron-core's linear_qkv holds one: refused, the
    merge named, nothing written."""
    model = build("llama")
    model.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(tmp_path / "lora")
    assert_refused(cli("convert", tmp_path / "lora", tmp_path / "out", "--base", tmp_path / "base", "--to",
                       "megatron", "--tp", "2"), tmp_path / "out", "linear_qkv", "--lora-stack-ranks", "--merge")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(build("llama"), lora).save_pretrained(tmp_path / "q-only")
    assert_refused(cli("convert", tmp_path / "q-only", tmp_path / "out", "--base", tmp_path / "base", "--to",
                       "megatron"), tmp_path / "out", "no place for LoRA tensor layers.0.attn.q.lora_a",
                   "--lora-stack-ranks")


def test_rank_missing_from_the_args_is_refused(shared_a, tmp_path):
    root, _ = shared_a
    convert(root / "a", tmp_path / "m", dst_format="megatron")
    path = next((tmp_path / "m").glob("*/mp_rank_00/model_optim_rng.pt"))
    obj = torch.load(path, weights_only=False)
    del obj["args"].lora_r
    torch.save(obj, path)
    assert_refused(cli("convert", tmp_path / "m", tmp_path / "out", "--to", "peft"), tmp_path / "out",
                   "no lora_r", "never defaulted")


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj"]])
def test_stacked_ranks_write_a_peft_adapter_to_megatron_exactly(tmp_path, targets):
    """--lora-stack-ranks: peft's adapter (an A per projection; or q and v only) becomes one A per fused module
    at rank 3r, alpha 3 alpha, zero B blocks; back in peft it computes the original adapter's logits."""
    model = build("llama")
    model.save_pretrained(tmp_path / "base")
    torch.manual_seed(4)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(tmp_path / "lora")
    summary = convert(tmp_path / "lora", tmp_path / "m", dst_format="megatron", base=tmp_path / "base", tp=2, pp=2,
                      lora_stack_ranks=True)
    assert any("rank 12 (alpha 24)" in n for n in summary.notes), summary.notes
    args = _rank(tmp_path / "m", 0, 0).obj["args"]
    assert (args.lora_r, args.lora_alpha) == (12, 24)
    convert(tmp_path / "m", tmp_path / "p", dst_format="peft")
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 249]])
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                              tmp_path / "lora").eval()(tokens).logits
        got = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                             tmp_path / "p").eval()(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
