"""RopePairs (q / k stored for interleaved rope, torchtitan's and Meta Llama's layout) on its own.

Source of the layout: torchtitan 0.3.0 models/llama3/state_dict_adapter.py (`_reverse_permute`: HF ->
torchtitan, `_permute`: back); its meaning: torchtitan applies rope to adjacent pairs (complex multiply,
models/common/rope.py), HF to the two halves of a head (transformers `rotate_half`).
"""
import torch

from interop.shards import shard_box
from interop.transforms import RopePairs

HEADS, HEAD_DIM, HIDDEN = 4, 8, 16


def test_inverts_and_pins_the_row_order():
    q = torch.randn(HEADS * HEAD_DIM, HIDDEN)
    t = RopePairs([tuple(q.shape)], 0, HEAD_DIM)
    stored = t.fuse([q])
    half = HEAD_DIM // 2
    for h in range(HEADS):
        for i in range(half):  # stored pair i of head h = canonical rows i and i + d/2 of that head
            assert torch.equal(stored[h * HEAD_DIM + 2 * i], q[h * HEAD_DIM + i])
            assert torch.equal(stored[h * HEAD_DIM + 2 * i + 1], q[h * HEAD_DIM + half + i])
    assert torch.equal(t.split(stored)[0], q)


def test_tp_ranks_hold_their_heads_permuted():
    q = torch.randn(HEADS * HEAD_DIM, HIDDEN)
    t = RopePairs([tuple(q.shape)], 0, HEAD_DIM)
    ranks = [t.to_rank([q], r, 2) for r in range(2)]
    for r in range(2):
        shard = q[shard_box(tuple(q.shape), 0, r, 2).slices()].contiguous()
        assert torch.equal(ranks[r], RopePairs([tuple(shard.shape)], 0, HEAD_DIM).fuse([shard]))
    assert torch.equal(t.from_ranks(ranks)[0], q)


def _rope_halves(x, pos):  # HF: rotate_half over the two halves of each head
    half = HEAD_DIM // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos[:, None] * freq[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _rope_pairs(x, pos):  # Meta / torchtitan: adjacent pairs as complex numbers
    half = HEAD_DIM // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], half, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(pos[:, None] * freq), pos[:, None] * freq)).flatten(-2)


def test_same_attention_scores_under_each_frameworks_rope():
    """q.k after rope is the same number whether HF's weights meet HF's rope or the stored weights meet
    torchtitan's: the layout is the one that makes the two models compute alike."""
    torch.manual_seed(0)
    wq, wk = torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64), torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
    x, pos = torch.randn(6, HIDDEN, dtype=torch.float64), torch.arange(6, dtype=torch.float64)
    t = RopePairs([tuple(wq.shape)], 0, HEAD_DIM)
    scores = []
    for (q_w, k_w), rope in (((wq, wk), _rope_halves), ((t.fuse([wq]), t.fuse([wk])), _rope_pairs)):
        q = rope((x @ q_w.T).view(6, HEADS, HEAD_DIM).transpose(0, 1), pos)
        k = rope((x @ k_w.T).view(6, HEADS, HEAD_DIM).transpose(0, 1), pos)
        scores.append(q @ k.transpose(-1, -2))
    assert torch.allclose(scores[0], scores[1], atol=1e-10)
    assert not torch.allclose(scores[0], (lambda q, k: q @ k.transpose(-1, -2))(  # the unpermuted weights differ
        _rope_pairs((x @ wq.T).view(6, HEADS, HEAD_DIM).transpose(0, 1), pos),
        _rope_pairs((x @ wk.T).view(6, HEADS, HEAD_DIM).transpose(0, 1), pos)), atol=1e-3)
