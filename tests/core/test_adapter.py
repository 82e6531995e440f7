"""The common-format LoRA adapter (interop/adapter.py): names, TP split, the base check, the store round trip."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.specs import GPT2, LLAMA
from interop.adapter import AdapterSpec, lora_names, merged, target_of, weight_of
from interop.describe import describe
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.spec import ModelSpec
from interop.store import StoreReader, StoreWriter
from interop.tensors import TensorMeta

BASE = ModelSpec(**LLAMA)  # GQA: q [32, 32], k / v [16, 32]; 4 layers
ALL = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")


def test_names():
    assert lora_names("layers.3.attn.q.weight") == ("layers.3.attn.q.lora_a", "layers.3.attn.q.lora_b")
    assert weight_of("layers.3.attn.q.lora_b") == "layers.3.attn.q.weight"
    assert target_of("layers.1.mlp.experts.5.up.weight") == (1, "mlp.experts.*.up")
    assert target_of("embed.word.weight") is None


def test_params_are_split_like_the_weight_they_adapt():
    adapter = AdapterSpec(rank=4, alpha=8, targets=ALL)
    index = adapter.index(BASE)
    assert len(index) == 2 * len(ALL) * BASE.num_layers
    assert adapter.scaling == 2.0
    # column-parallel weight: A replicated [r, in], B split on its rows [out, r]
    assert (index["layers.0.attn.k.lora_a"].shape, index["layers.0.attn.k.lora_a"].split) == ((4, 32), "replicated")
    assert (index["layers.0.attn.k.lora_b"].shape, index["layers.0.attn.k.lora_b"].split) == ((16, 4), "column")
    # row-parallel weight: A split on its input columns, B replicated
    assert (index["layers.2.mlp.down.lora_a"].shape, index["layers.2.mlp.down.lora_a"].split) == ((4, 64), "row")
    assert (index["layers.2.mlp.down.lora_b"].shape, index["layers.2.mlp.down.lora_b"].split) == ((32, 4), "replicated")
    assert index["layers.2.mlp.down.lora_a"].layer == 2
    only = AdapterSpec(rank=2, alpha=2, targets=("attn.q", "attn.v"), layers=(1,))
    assert sorted(only.index(BASE)) == ["layers.1.attn.q.lora_a", "layers.1.attn.q.lora_b",
                                        "layers.1.attn.v.lora_a", "layers.1.attn.v.lora_b"]


def test_rank_and_alpha_are_required_never_defaulted():
    for missing in ("rank", "alpha"):
        data = AdapterSpec(4, 8, ("attn.q",)).to_dict()
        del data[missing]
        with pytest.raises(InteropError, match=f"does not state its {missing}"):
            AdapterSpec.from_dict(data, "x/interop.json")
    with pytest.raises(InteropError, match="rank must be a positive integer"):
        AdapterSpec(0, 8, ("attn.q",))
    with pytest.raises(InteropError, match="layers must be layer numbers"):
        AdapterSpec(4, 8, ("attn.q",), layers=("1",))
    assert AdapterSpec.from_dict(AdapterSpec(4, 8.5, ("attn.q",), 0.1, (0, 2), "base").to_dict()) == \
        AdapterSpec(4, 8.5, ("attn.q",), 0.1, (0, 2), "base")


def test_a_base_without_the_target_or_with_other_shapes_is_named():
    with pytest.raises(InteropError, match="target module mlp.gate is not in the base model"):
        AdapterSpec(4, 8, ("attn.q", "mlp.gate")).check_base(ModelSpec(**GPT2))  # GPT2: no gate
    adapter = AdapterSpec(4, 8, ("attn.k",))
    shapes = {n: p.shape for n, p in adapter.index(BASE).items()}
    adapter.check_tensors(BASE, shapes)
    shapes["layers.1.attn.k.lora_b"] = (32, 4)  # k of an MHA model, not this GQA one
    with pytest.raises(InteropError, match=r"layers.1.attn.k.lora_b has shape \[32, 4\].*need \[16, 4\]"):
        adapter.check_tensors(BASE, shapes)
    del shapes["layers.1.attn.k.lora_b"]
    with pytest.raises(InteropError, match="layers.1.attn.k.lora_b is missing"):
        adapter.check_tensors(BASE, shapes)


def test_merge_is_fp32_cast_once():
    torch.manual_seed(0)
    w, a, b = torch.randn(16, 32).bfloat16(), torch.randn(4, 32), torch.randn(16, 4)
    got = merged(w, a, b, 2.0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w.double() + 2.0 * (b.double() @ a.double())).float().bfloat16())


def test_store_round_trip_sharded_like_the_weights(tmp_path):
    adapter = AdapterSpec(rank=4, alpha=8, targets=ALL, dropout=0.05, base_name="tiny-llama")
    params = adapter.params(BASE)
    torch.manual_seed(1)
    tensors = {p.name: torch.randn(p.shape) for p in params}
    layout = ParallelLayout.build(BASE.num_layers, tp=2, pp=2)
    metas = [TensorMeta(p.name, torch.float32, p.shape) for p in params]
    (tmp_path / "a").mkdir()
    writer = StoreWriter(tmp_path / "a", BASE, layout, metas, adapter=adapter)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({"iteration": 3})
    manifest = json.loads((tmp_path / "a" / "interop.json").read_text())
    assert manifest["adapter"]["rank"] == 4 and manifest["spec"]["num_layers"] == 4
    shards = {n: [(s["file"], s["offset"], s["shape"]) for s in t["shards"]] for n, t in manifest["tensors"].items()}
    assert shards["layers.0.attn.q.lora_a"] == [("model-tp00-pp00.safetensors", [0, 0], [4, 32])]
    assert shards["layers.0.attn.q.lora_b"] == [("model-tp00-pp00.safetensors", [0, 0], [16, 4]),
                                                ("model-tp01-pp00.safetensors", [16, 0], [16, 4])]
    assert shards["layers.3.attn.o.lora_a"] == [("model-tp00-pp01.safetensors", [0, 0], [4, 16]),
                                                ("model-tp01-pp01.safetensors", [0, 16], [4, 16])]
    assert len(shards["layers.3.attn.o.lora_b"]) == 1
    reader = StoreReader(tmp_path / "a")
    assert reader.source.adapter == adapter and reader.spec == BASE
    assert {m.name for m in reader.metas()} == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(reader.read(name), t), name
    reader.close()
    assert any("LoRA adapter (rank 4" in n for n in describe(tmp_path / "a").notes)


def test_a_store_missing_an_adapter_tensor_is_refused(tmp_path):
    adapter = AdapterSpec(rank=2, alpha=4, targets=("attn.q",))
    layout = ParallelLayout.build(BASE.num_layers)
    metas = [TensorMeta(p.name, torch.float32, p.shape) for p in adapter.params(BASE)]
    (tmp_path / "a").mkdir()
    writer = StoreWriter(tmp_path / "a", BASE, layout, metas, adapter=adapter)
    for m in metas:
        writer.write(m.name, torch.zeros(m.shape))
    writer.finish({})
    path = tmp_path / "a" / "interop.json"
    manifest = json.loads(path.read_text())
    del manifest["tensors"]["layers.2.attn.q.lora_b"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(InteropError, match="'layers.2.attn.q.lora_b' is missing"):
        StoreReader(tmp_path / "a", verify=False)
    manifest["adapter"]["targets"] = ["attn.qq"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(InteropError, match="target module attn.qq is not in the base model"):
        StoreReader(tmp_path / "a", verify=False)


def test_shared_input_one_a_for_a_fused_weight():
    from interop.transforms import SharedInput
    t = SharedInput([(4, 32)] * 3, None)
    a = torch.randn(4, 32)
    assert torch.equal(t.fuse([a, a.clone(), a.clone()]), a)
    assert all(torch.equal(x, a) for x in t.split(a))
    assert t.rank_shape(1, 2) == (4, 32) and torch.equal(t.to_rank([a] * 3, 1, 2), a)  # replicated
    with pytest.raises(InteropError, match="LoRA A of part 2 differs"):
        t.fuse([a, a, a + 1])
    row = SharedInput([(4, 32)], 1)  # one part of a row-parallel weight: cut on columns like a Copy
    assert torch.equal(row.to_rank([a], 1, 2), a[:, 16:])
    assert torch.equal(row.from_ranks([a[:, :16], a[:, 16:]])[0], a)


def test_adapter_rows_follow_the_weight_rows():
    """Megatron's fused linear_qkv (GroupedQKV) gives one shared A and a grouped B; q alone has no place there."""
    from interop.adapter import LoraNames, adapter_rows
    from interop.mappings.megatron_names import MCORE
    from interop.transforms import GroupedQKV, SharedInput
    names = LoraNames(".adapter.linear_in.weight", ".adapter.linear_out.weight")
    rows = adapter_rows(MCORE, names, BASE, AdapterSpec(4, 8, ("attn.q", "attn.k", "attn.v")), "Megatron")
    by_key = {r.key: r for r in rows}
    a = by_key["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"]
    b = by_key["decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"]
    assert isinstance(a.transform, SharedInput) and isinstance(b.transform, GroupedQKV)
    assert b.transform.rank_shape(0, 2) == (32, 4) and a.transform.rank_shape(0, 2) == (4, 32)
    with pytest.raises(InteropError, match="no place for LoRA tensor layers.0.attn.q.lora_a"):
        adapter_rows(MCORE, names, BASE, AdapterSpec(4, 8, ("attn.q",)), "Megatron")


def test_shared_a_is_a_fact_of_the_adapter():
    """Whether q, k, v (gate, up) share one A: stated by the rows a format stores (one SharedInput A: shared),
    carried by the common format's description, absent (None) in an older one, anything but a bool refused."""
    from interop.adapter import LoraNames, adapter_rows, stated_shared_a
    from interop.mappings.megatron_names import MCORE
    names = LoraNames(".adapter.linear_in.weight", ".adapter.linear_out.weight")
    qkv = AdapterSpec(4, 8, ("attn.q", "attn.k", "attn.v", "attn.o"))
    assert stated_shared_a(adapter_rows(MCORE, names, BASE, qkv, "Megatron"), BASE, qkv) is True
    alone = AdapterSpec(4, 8, ("attn.o",))  # no fused group adapted: nothing shared
    assert stated_shared_a(adapter_rows(MCORE, names, BASE, alone, "Megatron"), BASE, alone) is False
    assert qkv.fused_a(BASE)[0] == ("layers.0.attn.q.lora_a", "layers.0.attn.k.lora_a", "layers.0.attn.v.lora_a")
    for fact in (True, False, None):
        spec = AdapterSpec(4, 8, ("attn.q",), shared_a=fact)
        assert AdapterSpec.from_dict(spec.to_dict()) == spec
    older = {k: v for k, v in qkv.to_dict().items() if k != "shared_a"}
    assert AdapterSpec.from_dict(older).shared_a is None
    with pytest.raises(InteropError, match="shared_a must be true, false or absent, got 'yes'"):
        AdapterSpec.from_dict(dict(older, shared_a="yes"))


def test_stacked_ranks_share_one_a_and_keep_every_delta(tmp_path):
    from interop.lora_stack import StackedReader
    adapter = AdapterSpec(rank=2, alpha=3, targets=("attn.q", "attn.k", "mlp.down"))  # v left out: a zero B
    params = adapter.params(BASE)
    torch.manual_seed(7)
    tensors = {p.name: torch.randn(p.shape) for p in params}
    (tmp_path / "a").mkdir()
    writer = StoreWriter(tmp_path / "a", BASE, ParallelLayout.build(BASE.num_layers),
                         [TensorMeta(p.name, torch.float32, p.shape) for p in params], adapter=adapter)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.finish({})
    stacked = StackedReader(StoreReader(tmp_path / "a"))
    new = stacked.source.adapter
    assert (new.rank, new.alpha, new.targets) == (6, 9, ("attn.k", "attn.q", "attn.v", "mlp.down"))
    assert new.shared_a is True  # one stacked A per group
    assert {m.name for m in stacked.metas()} == set(new.index(BASE))
    a = [stacked.read(f"layers.1.attn.{x}.lora_a") for x in "qkv"]
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2]) and a[0].shape == (6, 32)
    for x in "qk":
        want = adapter.scaling * tensors[f"layers.1.attn.{x}.lora_b"] @ tensors[f"layers.1.attn.{x}.lora_a"]
        got = new.scaling * stacked.read(f"layers.1.attn.{x}.lora_b") @ a[0]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not stacked.read("layers.1.attn.v.lora_b").any()
    down_a = stacked.read("layers.3.mlp.down.lora_a")  # a lone projection: [A; 0; 0]
    assert torch.equal(down_a[:2], tensors["layers.3.mlp.down.lora_a"]) and not down_a[2:].any()
    stacked.close()
