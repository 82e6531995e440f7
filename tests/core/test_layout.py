"""Pipeline layouts, shard boxes and the parameter table."""
import pytest
import torch

from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.shards import Box, assemble, intersect, shard_box
from interop.spec import ModelSpec, padded_vocab_size


def test_virtual_pipeline_assignment_matches_megatron():
    layout = ParallelLayout.build(8, tp=1, pp=2, vpp=2)
    assert layout.stages == (((0, 2), (4, 6)), ((2, 4), (6, 8)))
    assert layout.layers_of_stage(0) == [0, 1, 4, 5]
    assert layout.chunk_of_layer(6) == (1, 1, 0)
    assert layout.vpp == 2 and layout.num_layers == 8


def test_uneven_first_and_last_stages():
    layout = ParallelLayout.build(10, pp=4, first_stage_layers=1, last_stage_layers=3)
    assert [layout.layers_of_stage(p) for p in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(InteropError, match="do not fit"):
        ParallelLayout.build(10, pp=4, first_stage_layers=2, last_stage_layers=3)
    with pytest.raises(InteropError, match="cannot be combined"):
        ParallelLayout.build(8, pp=2, vpp=2, first_stage_layers=2)


def test_layout_round_trips_through_json():
    layout = ParallelLayout.build(12, tp=2, pp=3, vpp=2)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout


def test_padded_vocab_follows_megatron_rule():
    assert [padded_vocab_size(50257, tp) for tp in (1, 2, 4)] == [50304, 50432, 50688]


def test_shard_boxes_and_assembly():
    assert shard_box((8, 4), 1, 1, 2) == Box((0, 2), (8, 2))
    assert intersect(Box((0, 0), (4, 4)), Box((2, 2), (4, 4))) == Box((2, 2), (2, 2))
    full = torch.arange(32.).reshape(8, 4)
    def reader(b, out=None):
        return full[b.slices()] if out is None else out.copy_(full[b.slices()])

    pieces = [(shard_box((8, 4), 0, r, 4), reader) for r in range(4)]
    want = Box((3, 1), (4, 2))
    assert torch.equal(assemble(want, pieces, torch.float32), full[want.slices()])
    with pytest.raises(InteropError, match="cover"):
        assemble(Box.whole((8, 4)), pieces[:3], torch.float32)


def test_param_table_llama_gqa():
    spec = ModelSpec(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=8, kv_groups=2, head_dim=8,
                     vocab=100, padded_vocab=128, max_positions=64, norm="rmsnorm", norm_eps=1e-5,
                     activation="swiglu", position="rope", tied_embeddings=False)
    table = {p.name: p for p in param_table(spec)}
    assert table["layers.1.attn.k.weight"].shape == (16, 64) and table["layers.1.attn.k.weight"].split == "column"
    assert table["layers.0.mlp.down.weight"].split == "row" and table["lm_head.weight"].shape == (128, 64)
    assert "layers.0.attn_norm.bias" not in table and "embed.position.weight" not in table
    with pytest.raises(InteropError, match="kv groups"):
        spec.check_tp(4)
