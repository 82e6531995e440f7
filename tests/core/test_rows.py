"""The one name-table expander (`interop.rows.expand`) and the fused-row collector every writer uses."""
import pytest
import torch

from interop.errors import InteropError
from interop.rows import RowCollector, check_placed, expand
from interop.spec import ModelSpec
from interop.transforms import Copy, GatedMLP, GroupedExperts, GroupedQKV, Stack

DENSE = dict(arch="llama", num_layers=3, hidden=16, ffn_hidden=32, heads=4, kv_groups=2, head_dim=4, vocab=61,
             padded_vocab=64, max_positions=32, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position="rope",
             tied_embeddings=False)
MOE = dict(DENSE, num_experts=4, moe_topk=2, moe_ffn_hidden=8, moe_layers=[1, 2])
QKV = ["layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"]


def test_layers_are_numbered_from_the_first_in_the_native_name_and_globally_in_the_parts():
    table = [("l.{i}.qkv", GroupedQKV, QKV), ("l.{i}.qkv.bias", GroupedQKV, [n.replace("weight", "bias") for n in QKV]),
             ("head", Copy, ["lm_head.weight"])]
    rows = expand(table, ModelSpec(**DENSE), layers=range(1, 3), first=1, stage=1, chunk=0)
    assert [(r.key, r.parts[0], r.stage) for r in rows] == [("l.0.qkv", "layers.1.attn.q.weight", 1),
                                                           ("l.1.qkv", "layers.2.attn.q.weight", 1),
                                                           ("head", "lm_head.weight", 1)]  # no biases: skipped
    assert rows[0].transform.shapes == [(16, 16), (8, 16), (8, 16)]  # bound to the row's parts


def test_the_first_row_to_claim_a_name_wins_and_keep_drops_rows():
    table = [("l.{i}.fc1", GatedMLP, ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]),
             ("l.{i}.fc1", Copy, ["layers.{i}.mlp.up.weight"])]
    spec = ModelSpec(**DENSE)
    rows = expand(table, spec, layers=[0])
    assert len(rows) == 1 and type(rows[0].transform) is GatedMLP
    rows = expand(table[1:], spec, keep=lambda key, i: i != 1)
    assert [r.key for r in rows] == ["l.0.fc1", "l.2.fc1"]


def test_experts_per_expert_with_local_numbers_and_per_ep_rank_when_one_tensor_holds_them():
    spec = ModelSpec(**MOE)
    per_expert = [("l.{i}.e.{j}.fc2", Copy, ["layers.{i}.mlp.experts.{e}.down.weight"])]
    rows = expand(per_expert, spec, ep=2)
    assert [(r.key, r.parts[0], r.ep) for r in rows[:4]] == [
        ("l.1.e.0.fc2", "layers.1.mlp.experts.0.down.weight", 0), ("l.1.e.1.fc2", "layers.1.mlp.experts.1.down.weight", 0),
        ("l.1.e.0.fc2", "layers.1.mlp.experts.2.down.weight", 1), ("l.1.e.1.fc2", "layers.1.mlp.experts.3.down.weight", 1)]
    assert len(rows) == 8  # layer 0 is dense: no expert rows there
    grouped = expand([("l.{i}.w2", GroupedExperts, ["layers.{i}.mlp.experts.{e}.down.weight"])], spec, ep=2)
    assert [(r.key, r.ep, len(r.parts)) for r in grouped] == [("l.1.w2", 0, 2), ("l.1.w2", 1, 2), ("l.2.w2", 0, 2),
                                                            ("l.2.w2", 1, 2)]
    stacked = expand([("l.{i}.w2", Stack, ["layers.{i}.mlp.experts.{e}.down.weight"])], spec)
    assert [len(r.parts) for r in stacked] == [4, 4] and stacked[0].parts[3] == "layers.1.mlp.experts.3.down.weight"


def test_a_tensor_without_a_row_is_refused_in_one_line():
    spec = ModelSpec(**DENSE)
    rows = expand([("emb", Copy, ["embed.word.weight"])], spec)
    with pytest.raises(InteropError, match=r"^X names have no place for layers\.0\.attn_norm\.weight \(why\)$"):
        check_placed(rows, spec, "X", "why")


def test_the_collector_gives_a_row_in_stored_order_once_its_last_part_arrives():
    rows = RowCollector()
    parts = ("q", "k", "v")
    assert rows.add("qkv", parts, "v", torch.ones(1)) is None
    assert rows.add("qkv", parts, "q", torch.zeros(1)) is None
    with pytest.raises(InteropError, match="incomplete input: qkv never got all its parts"):
        rows.check_done()
    got = rows.add("qkv", parts, "k", torch.full((1,), 2.0))
    assert [t.item() for t in got] == [0.0, 2.0, 1.0]
    rows.check_done()
