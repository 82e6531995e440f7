"""Each transform on its own: both directions invert exactly, TP rank t stores the fusion of each part's
rank-t shard (the frameworks' rule) at tp 1, 2 and 4, and hand-written layouts pin the element order.

Layout sources: Megatron grouped QKV, megatron/core/transformer/attention.py
(SelfAttention.get_query_key_value_tensors: view [groups, (heads/groups + 2) * head_dim]); swiglu fc1,
megatron/core/transformer/mlp.py (`glu`: torch.chunk(x, 2, dim=-1) on each rank's output);
MindFormers r1.5+ w_qkv / w_gate_hidden, mindformers/models/utils/convert_utils.py (qkv_concat_hf2mg,
ffn_concat_hf2mg); MindFormers r1.3 w_qkv = np.concatenate([q, k, v]) (mindformers/models/llama/convert_weight.py);
HF GPT2 Conv1D stores [in, out] (transformers/pytorch_utils.py Conv1D: x @ weight).
"""
import pytest
import torch

from interop.params import param_index
from interop.shards import shard_box
from interop.spec import ModelSpec
from interop.transforms import (Copy, GatedMLP, RowsSplit, GroupedQKV, Interleave, PlainConcat, Stack, Tied, Transpose,
                               WholeConcat, WholeCopy, WholeInterleave)
from interop.transforms.expert_rows import ExpertRows


def _parts(shapes):
    """Distinct values everywhere, so any misplaced element shows."""
    out, at = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(torch.arange(at, at + n, dtype=torch.float32).view(s))
        at += n
    return out


def _rule(transform, parts, t, tp):
    """The frameworks' rule for what rank t stores: the fusion of each part's rank-t shard, built with
    a fresh transform at the shard shapes (tp 1), never with the split under test."""
    shards = [x[shard_box(tuple(x.shape), transform.axis, t, tp).slices()].contiguous() for x in parts]
    shard_shapes = [tuple(s.shape) for s in shards]
    kwargs = {"groups": transform.groups // tp} if isinstance(transform, GroupedQKV) else \
        {"per": transform.per} if isinstance(transform, Stack) else {}
    return type(transform)(shard_shapes, transform.axis, **kwargs).fuse(shards)


CASES = {
    "copy column": lambda: Copy([(8, 6)], 0),
    "copy row": lambda: Copy([(6, 8)], 1),
    "copy replicated": lambda: Copy([(6,)], None),
    "rows split": lambda: RowsSplit([(8, 6)], 0),
    "tied": lambda: Tied([(8, 6)], 0),
    "transpose row": lambda: Transpose([(6, 8)], 1),
    "transpose column": lambda: Transpose([(8, 6)], 0),
    "transpose joined": lambda: Transpose([(8, 6), (4, 6), (4, 6)], 0),
    "plain concat": lambda: PlainConcat([(8, 6), (4, 6), (4, 6)], 0),
    "plain concat bias": lambda: PlainConcat([(8,), (4,), (4,)], 0),
    "plain concat replicated": lambda: PlainConcat([(6, 8), (5, 8)], None),
    # MindSpeed-LLM's MLA linear_qkv: [q_a or q; kv_a] whole on every tp rank
    "whole concat": lambda: WholeConcat([(6, 8), (5, 8)], None),
    # MindFormers' SequenceParallelLinear: the shared experts' linear_fc1 / linear_fc2, MTP's eh_proj
    "whole copy": lambda: WholeCopy([(8, 6)], None),
    "whole interleave": lambda: WholeInterleave([(8, 6), (8, 6)], None),
    "gated mlp": lambda: GatedMLP([(8, 6), (8, 6)], 0),
    "grouped qkv": lambda: GroupedQKV([(16, 6), (8, 6), (8, 6)], 0, groups=4),
    "grouped qkv bias": lambda: GroupedQKV([(16,), (8,), (8,)], 0, groups=4),
    "interleave": lambda: Interleave([(8, 6), (8, 6)], 0),
    "stack": lambda: Stack([(8, 6)] * 3, 0),
    "stack row": lambda: Stack([(6, 8)] * 3, 1),
    "stack gate up": lambda: Stack([(8, 6)] * 4, 0, per=2),
}


@pytest.mark.parametrize("case", CASES)
def test_both_directions_invert_exactly(case):
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    stored = transform.fuse(parts)
    assert tuple(stored.shape) == transform.rank_shape()
    back = transform.split(stored.clone())
    assert len(back) == len(parts)
    for got, want in zip(back, parts):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_rank_t_stores_the_fusion_of_its_shards(case, tp):
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    shards = []
    for t in range(tp):
        want = _rule(transform, parts, t, tp)
        got = transform.to_rank(parts, t, tp)
        assert tuple(got.shape) == transform.rank_shape(t, tp) == tuple(want.shape)
        assert torch.equal(got, want), (case, t, tp)
        built = torch.full(transform.rank_shape(t, tp), -1.0)
        assert torch.equal(transform.to_rank(parts, t, tp, out=built), want)
        shards.append(got.clone())
    back = transform.from_ranks(shards)
    assert all(torch.equal(g, w) for g, w in zip(back, parts))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_runs_read_a_rank_file_straight_into_the_parts(case, tp):
    """`runs` lists element ranges of the parts in the order rank t stores them: reading rank t's
    stored bytes into them one after another rebuilds the parts (the Megatron reader's fast path)."""
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    out = [torch.full_like(x, -1.0) for x in parts]
    for t in range(tp):
        runs = transform.runs(out, t, tp)
        if runs is None:
            assert isinstance(transform, (Transpose, Interleave)) or transform.axis == 1
            return
        stored = transform.to_rank(parts, t, tp).reshape(-1)
        at = 0
        for target, start, stop in runs:
            target.view(-1)[start:stop] = stored[at:at + stop - start]
            at += stop - start
        assert at == stored.numel()
    assert all(torch.equal(g, w) for g, w in zip(out, parts))


def _blocks(stored, rows):
    """A stored tensor's first column as the labels of its blocks of `rows` rows."""
    return [int(stored[i, 0]) // 100 for i in range(0, stored.shape[0], rows)]


def test_grouped_qkv_pins_megatrons_order():
    """heads 4, groups 2, head_dim 2: stored [q0 q1 k0 v0 | q2 q3 k1 v1]; tp 2 cuts it between groups."""
    d, h = 2, 3
    head = lambda label: torch.full((d, h), float(label * 100))  # noqa: E731
    q = torch.cat([head(10 + i) for i in range(4)])  # q heads 0..3 labelled 10..13
    k = torch.cat([head(20 + i) for i in range(2)])  # k heads 20, 21
    v = torch.cat([head(30 + i) for i in range(2)])  # v heads 30, 31
    qkv = GroupedQKV([q.shape, k.shape, v.shape], 0, groups=2)
    assert _blocks(qkv.fuse([q, k, v]), d) == [10, 11, 20, 30, 12, 13, 21, 31]
    assert _blocks(qkv.to_rank([q, k, v], 0, 2), d) == [10, 11, 20, 30]
    assert _blocks(qkv.to_rank([q, k, v], 1, 2), d) == [12, 13, 21, 31]
    bias = GroupedQKV([(8,), (4,), (4,)], 0, groups=2)
    qb, kb, vb = torch.arange(8.0), torch.arange(100, 104.0), torch.arange(200, 204.0)
    assert bias.fuse([qb, kb, vb]).tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_grouped_qkv_binds_groups_from_the_spec():
    spec = ModelSpec(arch="llama", num_layers=1, hidden=8, ffn_hidden=16, heads=4, kv_groups=2, head_dim=2,
                     vocab=16, padded_vocab=16, max_positions=8, norm="rmsnorm", norm_eps=1e-5,
                     activation="swiglu", position="rope")
    index = param_index(spec)
    qkv = GroupedQKV.bind(spec, [index[f"layers.0.attn.{x}.weight"] for x in "qkv"])
    assert qkv.groups == 2 and qkv.shapes == [(8, 8), (4, 8), (4, 8)] and qkv.rank_shape(1, 2) == (8, 8)


def test_gated_mlp_at_tp_2_holds_gate_then_up_per_rank():
    gate, up = torch.arange(4.0).view(4, 1), torch.arange(10, 14.0).view(4, 1)
    fc1 = GatedMLP([(4, 1), (4, 1)], 0)
    assert fc1.fuse([gate, up]).flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert fc1.to_rank([gate, up], 0, 2).flatten().tolist() == [0, 1, 10, 11]
    assert fc1.to_rank([gate, up], 1, 2).flatten().tolist() == [2, 3, 12, 13]


def test_plain_concat_joins_whole_parts():
    q, k, v = torch.arange(4.0), torch.arange(10, 12.0), torch.arange(20, 22.0)
    plain = PlainConcat([(4,), (2,), (2,)], 0)
    assert plain.fuse([q, k, v]).tolist() == [0, 1, 2, 3, 10, 11, 20, 21]
    assert plain.to_rank([q, k, v], 1, 2).tolist() == [2, 3, 11, 21]


def test_interleave_alternates_rows():
    gate, up = torch.arange(4.0).view(4, 1), torch.arange(10, 14.0).view(4, 1)
    inter = Interleave([(4, 1), (4, 1)], 0)
    assert inter.fuse([gate, up]).flatten().tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
    assert inter.to_rank([gate, up], 1, 2).flatten().tolist() == [2, 12, 3, 13]


def test_transpose_swaps_axes():
    o = torch.arange(6.0).view(2, 3)  # canonical [out, in], row-parallel: TP cuts axis 1
    t = Transpose([(2, 3)], 1)
    assert torch.equal(t.fuse([o]), o.t()) and t.native_axis == 0 and t.rank_shape(0, 3) == (1, 2)
    assert Copy([(2, 3)], 1).native_axis == 1 and Copy([(3,)], None).native_axis is None
    joined = Transpose([(2, 3), (1, 3)], 0)
    k = torch.arange(10, 13.0).view(1, 3)
    assert torch.equal(joined.fuse([o, k]), torch.cat([o, k]).t())


def test_stack_puts_each_expert_in_its_own_slice():
    e0, e1 = torch.arange(4.0).view(2, 2), torch.arange(10, 14.0).view(2, 2)
    assert torch.equal(Stack([(2, 2)] * 2, 0).fuse([e0, e1]), torch.stack([e0, e1]))
    assert Stack([(2, 2)] * 2, 0).native_axis == 1 and Stack([(2, 2)] * 2, 1).native_axis == 2
    g0, u0, g1, u1 = (torch.full((2, 1), float(x)) for x in (1, 2, 3, 4))
    gate_up = Stack([(2, 1)] * 4, 0, per=2)
    assert gate_up.fuse([g0, u0, g1, u1]).flatten().tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert gate_up.to_rank([g0, u0, g1, u1], 1, 2).flatten().tolist() == [1, 2, 3, 4]


def test_stack_binds_parts_per_expert_from_the_spec():
    spec = ModelSpec(arch="llama", num_layers=1, hidden=8, ffn_hidden=16, heads=4, kv_groups=2, head_dim=2,
                     vocab=16, padded_vocab=16, max_positions=8, norm="rmsnorm", norm_eps=1e-5,
                     activation="swiglu", position="rope", num_experts=2, moe_topk=1, moe_ffn_hidden=4)
    index = param_index(spec)
    names = [f"layers.0.mlp.experts.{e}.{x}.weight" for e in range(2) for x in ("gate", "up")]
    assert Stack.bind(spec, [index[n] for n in names]).rank_shape() == (2, 8, 8)
    gates = [index[f"layers.0.mlp.experts.{e}.gate.weight"] for e in range(2)]
    assert Stack.bind(spec, gates).per == 1 and Stack.bind(spec, gates).rank_shape(1, 2) == (2, 2, 8)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith(("transpose", "stack"))])
def test_row_order_gathers_the_parts(case):
    """Gathering the stored tensor's rows in `row_order` (as the MindSpore model does, differentiably) gives
    each part."""
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    stored = transform.fuse(parts)
    for rows, want in zip(transform.row_order(), parts):
        assert torch.equal(stored[torch.tensor(rows)], want)


def test_tied_is_a_copy_never_read_back():
    assert not Tied([(4, 2)], 0).reads_back and Copy([(4, 2)], 0).reads_back


def test_a_view_stays_a_view():
    """A rank's slice that is contiguous in the canonical tensor is handed out without a copy."""
    x = torch.arange(8.0).view(4, 2)
    assert Copy([(4, 2)], 0).to_rank([x], 1, 2).data_ptr() == x[2:].data_ptr()
    assert Copy([(4, 2)], 0).split(x)[0] is x


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError):
        GroupedQKV([(6, 2), (4, 2), (4, 2)], 0, groups=4)
    with pytest.raises(ValueError):
        GatedMLP([(4, 2)], 0)
    with pytest.raises(ValueError):
        Copy([(4, 2), (4, 2)], 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_rank_from_fused_is_what_rank_t_stores(case, tp):
    """Re-slicing the whole stored tensor (`rank_from_fused`) gives rank t's stored tensor exactly, and
    `fused_from_ranks` puts the ranks' tensors back into the whole one: a fused row moves between two formats
    that store it alike without its canonical parts.  Transforms whose ranks do not store whole rows of the
    whole tensor (transposed, stacked, cut on columns) say None."""
    transform = CASES[case]()
    parts = _parts(transform.shapes)
    whole = transform.fuse(parts)
    if transform.fused_rows(0, tp) is None:
        assert isinstance(transform, (Transpose, Stack)) or transform.axis == 1
        return
    ranks = []
    for t in range(tp):
        got = transform.rank_from_fused(whole, t, tp)
        assert torch.equal(got, transform.to_rank(parts, t, tp)), (case, t, tp)
        out = torch.full(transform.rank_shape(t, tp), -1.0)
        assert torch.equal(transform.rank_from_fused(whole, t, tp, out=out), got)
        ranks.append(got.clone())
    assert torch.equal(transform.fused_from_ranks(ranks), whole)
    if not transform.replicated:  # every row of the whole on exactly one rank
        rows = [r for t in range(tp) for a, b in transform.fused_rows(t, tp) for r in range(a, b)]
        assert sorted(rows) == list(range(whole.shape[0]))


def test_fused_rows_pin_the_frameworks_cuts():
    """GroupedQKV: a rank holds whole groups, one range of rows; GatedMLP: [gate_t; up_t], two ranges;
    Interleave: one range (pairs stay together); replicated: every row on every rank."""
    qkv = GroupedQKV([(16, 6), (8, 6), (8, 6)], 0, groups=4)  # 8 rows per group
    assert [qkv.fused_rows(t, 2) for t in range(2)] == [((0, 16),), ((16, 32),)]
    assert qkv.fused_rows(3, 4) == ((24, 32),)
    mlp = GatedMLP([(8, 6), (8, 6)], 0)
    assert [mlp.fused_rows(t, 2) for t in range(2)] == [((0, 4), (8, 12)), ((4, 8), (12, 16))]
    assert Interleave([(8, 6), (8, 6)], 0).fused_rows(1, 4) == ((4, 8),)
    assert PlainConcat([(4,), (2,)], None).fused_rows(1, 2) == ((0, 6),)
    whole = torch.zeros(32, 6)
    assert qkv.rank_from_fused(whole, 1, 2).data_ptr() == whole[16].data_ptr()  # one range: a view, no copy


def test_equal_transforms_are_the_same_class_with_the_same_parameters():
    """The engine moves a row whole only between equal transforms (`==`, usable as dict keys)."""
    qkv = GroupedQKV([(16, 6), (8, 6), (8, 6)], 0, groups=4)
    assert qkv == GroupedQKV([(16, 6), (8, 6), (8, 6)], 0, groups=4)
    assert hash(qkv) == hash(GroupedQKV([(16, 6), (8, 6), (8, 6)], 0, groups=4))
    assert qkv != GroupedQKV([(16, 6), (8, 6), (8, 6)], 0, groups=2)  # other groups
    assert qkv != GroupedQKV([(16, 6), (8, 6), (8, 6)], None, groups=4)  # other split
    assert GatedMLP([(8, 6), (8, 6)], 0) != PlainConcat([(8, 6), (8, 6)], 0)  # same layout at tp 1, not per rank
    assert GatedMLP([(8, 6), (8, 6)], 0) != Interleave([(8, 6), (8, 6)], 0)
    assert GatedMLP([(8, 6), (8, 6)], 0) != GatedMLP([(8, 4), (8, 4)], 0)
    assert Stack([(8, 6)] * 4, 0, per=2) != Stack([(8, 6)] * 4, 0, per=1)


def test_rows_split_cuts_rows_whatever_the_canonical_split():
    """megatron-core's local-spec MLA down projections: replicated canonically, stored as column-parallel
    linears (rank t holds rows t*n/tp ..)."""
    from interop.params import Param
    x = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    t = RowsSplit.bind(None, [Param("layers.0.attn.kv_down.weight", (8, 3), "replicated", 0)])
    assert t.axis == 0 and t.rank_shape(1, 2) == (4, 3)
    assert torch.equal(t.to_rank([x], 1, 2), x[4:]) and t != Copy([(8, 3)], 0)


def test_whole_concat_holds_every_part_whole_on_every_rank():
    """MindSpeed-LLM's MLA linear_qkv (convert_hf2mg.py set_model_layer_attn): [q; kv_a] cloned to each tp rank, even
    where q is column-parallel canonically (DeepSeek-V2-Lite's q_proj); read back from any rank's copy."""
    from interop.params import Param
    q, kv = torch.randn(8, 3), torch.randn(5, 3)
    t = WholeConcat.bind(None, [Param("layers.0.attn.q.weight", (8, 3), "column", 0),
                                Param("layers.0.attn.kv_down.weight", (5, 3), "replicated", None)])
    assert t.replicated and t.rank_shape(1, 2) == (13, 3)
    whole = torch.cat([q, kv])
    assert all(torch.equal(t.to_rank([q, kv], r, 2), whole) for r in range(2))
    back = t.split(t.to_rank([q, kv], 1, 2))
    assert torch.equal(back[0], q) and torch.equal(back[1], kv)
    assert t.fused_rows(1, 2) == ((0, 13),) and t != PlainConcat([(8, 3), (5, 3)], None)


def test_whole_copy_and_interleave_keep_a_cut_tensor_whole_on_every_rank():
    """MindFormers' SequenceParallelLinear (parallel_core/training_graph/tensor_parallel/layers.py: axis_fragmentations
    (1, 1)) holds what the canonical model cuts (eh_proj by rows, the shared expert's gate / up / down) whole."""
    from interop.params import Param
    x, gate, up = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    copy = WholeCopy.bind(None, [Param("mtp.0.eh_proj.weight", (8, 3), "column", None)])
    assert copy.replicated and copy.native_axis is None and copy.rank_shape(1, 2) == (8, 3)
    assert all(torch.equal(copy.to_rank([x], r, 2), x) for r in range(2)) and copy != Copy([(8, 3)], 0)
    inter = WholeInterleave.bind(None, [Param("layers.0.mlp.shared.gate.weight", (4, 3), "column", 0),
                                        Param("layers.0.mlp.shared.up.weight", (4, 3), "column", 0)])
    whole = Interleave([(4, 3), (4, 3)], None).fuse([gate, up])
    assert inter.replicated and all(torch.equal(inter.to_rank([gate, up], r, 2), whole) for r in range(2))
    back = inter.split(inter.to_rank([gate, up], 1, 2))
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


@pytest.mark.parametrize("axis", [0, 1])
def test_expert_rows_are_whole_on_every_tp_rank(axis):
    """MindFormers' FFNGroupedGEMM weight1 / weight2 (moe/ffn.py: placed by ep only, axis_fragmentations (ep, 1)):
    every tp rank stores all of it; the parts come back from any rank's copy."""
    shapes = [(4, 6)] * 4 if axis == 0 else [(6, 4)] * 2  # fc1: gate, up of 2 experts; fc2: down of 2 experts
    parts = _parts(shapes)
    t = ExpertRows(shapes, axis, experts=2)
    whole = t.fuse(parts)
    assert t.replicated and t.native_axis is None and t.rank_shape(1, 2) == tuple(whole.shape)
    assert torch.equal(t.to_rank(parts, 1, 2), whole)
    back = t.from_ranks([whole, whole])
    assert all(torch.equal(a, b) for a, b in zip(back, parts))
