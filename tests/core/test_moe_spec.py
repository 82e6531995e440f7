"""The mixture-of-experts facts in ModelSpec, the expert tensors in the canonical table and `ep` in the layout."""
import pytest

from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.params import param_index
from interop.spec import ModelSpec

DENSE = dict(arch="llama", num_layers=2, hidden=16, ffn_hidden=32, heads=4, kv_groups=2, head_dim=4, vocab=64,
             padded_vocab=64, max_positions=32, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position="rope")
MOE = dict(DENSE, num_experts=4, moe_topk=2, moe_ffn_hidden=8)


def test_dense_spec_dict_is_unchanged_by_the_moe_fields():
    assert not any(k.startswith(("moe", "num_experts", "shared")) for k in ModelSpec(**DENSE).to_dict())


def test_moe_spec_round_trips_and_lists_each_experts_tensors():
    spec = ModelSpec(**MOE, shared_expert_ffn_hidden=16, shared_expert_gate=True, moe_layers=[1])
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    index = param_index(spec)
    assert "layers.0.mlp.up.weight" in index and "layers.1.mlp.up.weight" not in index  # layer 0 stays dense
    assert index["layers.1.mlp.router.weight"].shape == (4, 16)
    assert index["layers.1.mlp.experts.3.down.weight"].shape == (16, 8)
    assert index["layers.1.mlp.experts.3.down.weight"].expert == 3
    assert index["layers.1.mlp.shared.gate.weight"].expert is None
    assert index["layers.1.mlp.shared_gate.weight"].shape == (1, 16)


@pytest.mark.parametrize("changes, message", [
    (dict(DENSE, moe_topk=2), "moe_topk needs num_experts"),
    (dict(MOE, moe_topk=5), "must not exceed num_experts"),
    (dict(MOE, moe_ffn_hidden=None), "moe_ffn_hidden must be a positive integer"),
    (dict(MOE, moe_layers=[2]), "moe_layers must be a list of layer numbers below 2"),
    (dict(MOE, shared_expert_gate=True), "shared_expert_gate needs shared_expert_ffn_hidden"),
    (dict(MOE, moe_router_score="tanh"), "moe_router_score must be one of"),
])
def test_inconsistent_moe_facts_are_refused(changes, message):
    with pytest.raises(InteropError, match=message):
        ModelSpec(**changes)


def test_expert_parallel_layout_gives_each_rank_whole_experts():
    spec = ModelSpec(**MOE)
    layout = ParallelLayout.build(2, ep=2)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout and "ep=2" in layout.describe()
    assert "ep" not in ParallelLayout.build(2).to_dict()
    index = param_index(spec)
    ranks = [layout.ep_rank_of(index[f"layers.0.mlp.experts.{e}.up.weight"], spec.num_experts) for e in range(4)]
    assert ranks == [0, 0, 1, 1]
    assert layout.ep_rank_of(index["layers.0.mlp.router.weight"], spec.num_experts) is None
    with pytest.raises(InteropError, match="ep=3 does not divide the 4 experts"):
        spec.check_ep(3)
    with pytest.raises(InteropError, match="needs a mixture-of-experts model"):
        ModelSpec(**DENSE).check_ep(2)
    with pytest.raises(InteropError, match="--ep must be a positive integer"):
        ParallelLayout.build(2, ep=0)
