"""HeadRows: a band of every head's rows of one canonical tensor, cut by heads over tp, as MindSpeed-LLM's
--mla-mm-split stores multi-latent attention's up projections (Ascend/MindSpeed-LLM
mindspeed_llm/tasks/checkpoint/convert_hf2mg.py set_model_layer_attn at c77308a1: q_b_proj reshaped
[heads, qk_head_dim + qk_pos_emb_head_dim, -1], torch.split on dim 1, each reshaped [heads * band, -1], torch.chunk
over tp on dim 0; kv_b_proj alike with [qk_head_dim, v_head_dim])."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from interop.transforms import HeadRows, KVNopeRows, QNopeRows, QRopeRows, VRows

HEADS, NOPE, ROPE, V, RANK = 4, 3, 2, 5, 7


def mindspeed_llm_split(x: torch.Tensor, bands: list[int], tp: int) -> list[list[torch.Tensor]]:
    """Its converter's cut, written out as it is: per band, the tp ranks' tensors."""
    per_head = sum(bands)
    parts = torch.split(x.reshape(HEADS, per_head, -1), bands, dim=1)
    return [list(torch.chunk(p.reshape(HEADS * b, -1), tp, dim=0)) for p, b in zip(parts, bands)]


def bands(cls_bounds, per_head):
    return [HeadRows([(HEADS * per_head, RANK)], 0, HEADS, per_head, lo, hi) for lo, hi in cls_bounds]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("widths", [(NOPE, ROPE), (NOPE, V)])
def test_each_band_on_each_rank_is_what_its_converter_stores_and_the_bands_read_back_whole(widths, tp):
    a, b = widths
    x = torch.randn(HEADS * (a + b), RANK)
    transforms = bands([(0, a), (a, a + b)], a + b)
    theirs = mindspeed_llm_split(x, [a, b], tp)
    for transform, ranks in zip(transforms, theirs):
        for t in range(tp):
            assert transform.rank_shape(t, tp) == tuple(ranks[t].shape)
            assert torch.equal(transform.to_rank([x], t, tp), ranks[t])
    out = [torch.full_like(x, float("nan"))]  # every band read into the same canonical tensor fills all of it
    for transform, ranks in zip(transforms, theirs):
        out = transform.from_ranks(ranks, out)
    assert torch.equal(out[0], x)


def test_one_band_alone_leaves_the_rest_of_the_canonical_tensor_untouched():
    x = torch.randn(HEADS * (NOPE + ROPE), RANK)
    nope, _ = bands([(0, NOPE), (NOPE, NOPE + ROPE)], NOPE + ROPE)
    out = nope.from_ranks([nope.to_rank([x], 0, 1)], [torch.zeros_like(x)])[0].view(HEADS, NOPE + ROPE, RANK)
    assert torch.equal(out[:, :NOPE], x.view(HEADS, NOPE + ROPE, RANK)[:, :NOPE])
    assert not out[:, NOPE:].any()


def test_the_four_bands_bind_from_the_spec():
    spec = SimpleNamespace(heads=HEADS, head_dim=NOPE + ROPE, qk_nope_head_dim=NOPE, v_head_dim=V)
    q, kv = SimpleNamespace(shape=(HEADS * (NOPE + ROPE), RANK), axis=0), SimpleNamespace(shape=(HEADS * (NOPE + V), RANK), axis=0)
    got = [(c.bind(spec, [p]).per_head, c.bind(spec, [p]).lo, c.bind(spec, [p]).hi)
           for c, p in ((QNopeRows, q), (QRopeRows, q), (KVNopeRows, kv), (VRows, kv))]
    assert got == [(NOPE + ROPE, 0, NOPE), (NOPE + ROPE, NOPE, NOPE + ROPE), (NOPE + V, 0, NOPE), (NOPE + V, NOPE, NOPE + V)]
    assert not QNopeRows.covers_part and QNopeRows.bind(spec, [q]).fused_rows(0, 2) is None


def test_shapes_that_do_not_fit_are_refused():
    for shape, axis, lo, hi in (((HEADS * 5 + 1, RANK), 0, 0, 3), ((HEADS * 5, RANK), 1, 0, 3),
                                ((HEADS * 5, RANK), 0, 3, 6), ((HEADS * 5, RANK), 0, 2, 2)):
        with pytest.raises(ValueError):
            HeadRows([shape], axis, HEADS, 5, lo, hi)
    with pytest.raises(ValueError):
        bands([(0, NOPE)], NOPE + ROPE)[0].rank_shape(0, 3)  # 4 heads over tp 3
