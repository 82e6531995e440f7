"""InterleavedExperts (interop/transforms/interleaved_experts.py) on its own: HF gpt-oss's fused experts as
transformers 5.24's GptOssExperts reads them (models/gpt_oss/modeling_gpt_oss.py: `x @ gate_up_proj[e] +
gate_up_proj_bias[e]`, gate = `[..., ::2]`, up = `[..., 1::2]`; `x @ down_proj[e] + down_proj_bias[e]`); both
directions invert; TP rank t stores the fusion of each part's rank-t shard at tp 1, 2 and 4."""
import pytest
import torch

from interop.shards import shard_box
from interop.transforms import InterleavedExperts

E, F, H = 3, 4, 6


def _parts(shapes):
    out, at = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(torch.arange(at, at + n, dtype=torch.float32).view(s))
        at += n
    return out


CASES = {
    "gate_up_proj": lambda: InterleavedExperts([(F, H)] * (2 * E), 0, per=2),
    "gate_up_proj_bias": lambda: InterleavedExperts([(F,)] * (2 * E), 0, per=2),
    "down_proj": lambda: InterleavedExperts([(H, F)] * E, 1, per=1),
    "down_proj_bias": lambda: InterleavedExperts([(H,)] * E, None, per=1),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_and_rank_rule(case, tp):
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    back = transform.split(transform.fuse(parts))
    assert all(torch.equal(a, b) for a, b in zip(parts, back))
    ranks = [transform.to_rank(parts, t, tp) for t in range(tp)]
    for t, stored in enumerate(ranks):
        assert tuple(stored.shape) == transform.rank_shape(t, tp)
        shards = [x[shard_box(tuple(x.shape), transform.axis, t, tp).slices()].contiguous() for x in parts]
        rule = InterleavedExperts([tuple(s.shape) for s in shards], transform.axis, transform.per).fuse(shards)
        assert torch.equal(stored, rule)
    assert all(torch.equal(a, b) for a, b in zip(parts, transform.from_ranks(ranks)))
    if transform.axis is not None:  # the stored axis TP cuts: rank shapes differ only there
        axis = transform.native_axis
        assert sum(r.shape[axis] for r in ranks) == transform.rank_shape()[axis]


def test_layout_is_what_gpt_oss_experts_compute_with():
    """gate_up_proj[e] = interleave(gate_e, up_e) columns, transposed: x @ stored[e] gives gate at even columns."""
    g = torch.Generator().manual_seed(0)
    gates = [torch.randn(F, H, generator=g) for _ in range(E)]
    ups = [torch.randn(F, H, generator=g) for _ in range(E)]
    downs = [torch.randn(H, F, generator=g) for _ in range(E)]
    parts = [x for e in range(E) for x in (gates[e], ups[e])]
    gate_up = InterleavedExperts([(F, H)] * (2 * E), 0, per=2).fuse(parts)
    down = InterleavedExperts([(H, F)] * E, 1).fuse(downs)
    assert gate_up.shape == (E, H, 2 * F) and down.shape == (E, F, H)
    x = torch.randn(5, H, generator=g)
    for e in range(E):
        fused = x @ gate_up[e]
        assert torch.allclose(fused[..., ::2], x @ gates[e].T) and torch.allclose(fused[..., 1::2], x @ ups[e].T)
        assert torch.equal(down[e], downs[e].T)
    bias = InterleavedExperts([(F,)] * (2 * E), 0, per=2).fuse([torch.full((F,), float(k)) for k in range(2 * E)])
    assert bias.shape == (E, 2 * F) and bias[1].tolist() == [2.0, 3.0] * F  # expert 1: gate 2, up 3 alternating


def test_binds_per_expert_from_the_model_params():
    from interop.params import param_index
    from interop.spec import ModelSpec
    spec = ModelSpec(arch="llama", num_layers=1, hidden=H, ffn_hidden=F, heads=2, kv_groups=1, head_dim=3, vocab=10,
                     padded_vocab=10, max_positions=8, norm="rmsnorm", norm_eps=1e-5, activation="quick_geglu",
                     position="rope", qkv_bias=True, linear_bias=True, num_experts=E, moe_topk=2, moe_ffn_hidden=F)
    index = param_index(spec)
    names = [f"layers.0.mlp.experts.{e}.{w}.bias" for e in range(E) for w in ("gate", "up")]
    bound = InterleavedExperts.bind(spec, [index[n] for n in names])
    assert bound.per == 2 and bound.rank_shape() == (E, 2 * F) and bound.rank_shape(1, 2) == (E, F)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_to_rank_places_what_pieces_place(case, tp):
    """The expert-by-expert stack-and-transpose `to_rank` puts every value where the generic `pieces` copy does."""
    from interop.transforms.base import Transform
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    for t in range(tp):
        assert torch.equal(transform.to_rank(parts, t, tp), Transform.to_rank(transform, parts, t, tp))


@pytest.mark.parametrize("case", CASES)
def test_one_expert_slice_splits_into_that_experts_parts(case):
    """`expert_slice`: stored[e:e + 1] split alone gives expert e's parts (how the HF reader reads one expert)."""
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    stored = transform.fuse(parts)
    one = transform.expert_slice()
    assert one.rank_shape() == (1, *stored.shape[1:])
    for e in range(E):
        mine = one.split(stored[e:e + 1])
        assert all(torch.equal(a, b) for a, b in zip(mine, parts[e * transform.per:(e + 1) * transform.per]))
