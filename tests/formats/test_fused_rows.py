"""Fused rows moved whole (`interop.engine.fused_plan`): when the source and the target store a row with
an equal transform (Megatron's and MindSpeed's grouped QKV and gated fc1 / mapping, MindFormers' grouped
w_qkv), the engine hands the whole stored tensor to the writer, which re-slices it for its own TP ranks.

Each case converts twice, along the fast path and along the per-tensor path (the plan emptied), and the
outputs must be the same files byte for byte (torch.save's random serialization id and DCP's save id
aside, as in test_workers.py).  The tp changes cut 4 KV groups 2 -> 4, 2 -> 1, 4 -> 2 and 1 -> 4 per rank.
A counter on the transforms' split and merge (`from_ranks` / `to_rank` of a row with several parts)
proves the fast path ran: a fused row that moves whole is never split into canonical tensors.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import interop.engine as engine
import interop.workers as parallel
from interop.convert import convert
from interop.transforms import GatedMLP, GroupedQKV, Transform

from helpers.hf_models import save as save_hf
from helpers.same_output import _write_hf, assert_same_output

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron" / "0.16.1"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    _write_hf(root / "hf")  # Llama, bf16, 8 heads in 4 KV groups, swiglu
    _write_hf(root / "mixtral", experts=4)
    save_hf("gpt2", root / "gpt2")  # q/k/v and fc1 biases, 8 groups of one head
    convert(root / "hf", root / "megatron", dst_format="megatron", tp=2, pp=2)
    convert(root / "hf", root / "dist", dst_format="megatron", format="torch_dist")
    convert(root / "hf", root / "mindspeed", dst_format="mindspore", tp=4)
    convert(root / "gpt2", root / "gpt2-megatron", dst_format="megatron", tp=2)
    convert(root / "mixtral", root / "moe-megatron", dst_format="megatron", tp=2, ep=2)
    return root


CASES = {  # name: (source, convert options, whether some fused row still has to be split and rebuilt)
    "megatron-tp2pp2-mindspeed-tp4pp2": ("megatron", dict(dst_format="mindspore", tp=4, pp=2), False),
    "megatron-tp2pp2-mindspeed-tp1-fp32": ("megatron", dict(dst_format="mindspore", dtype="fp32"), False),
    "megatron-tp2pp2-megatron-tp4": ("megatron", dict(dst_format="megatron", tp=4), False),
    "megatron-tp2pp2-torch_dist": ("megatron", dict(dst_format="megatron", format="torch_dist"), False),
    "torch_dist-mindspeed-tp2pp2": ("dist", dict(dst_format="mindspore", tp=2, pp=2), False),
    "torch_dist-megatron-tp4": ("dist", dict(dst_format="megatron", tp=4), False),
    "mindspeed-tp4-mindspeed-tp2": ("mindspeed", dict(dst_format="mindspore", tp=2), False),
    "mindspeed-tp4-megatron-tp1pp2": ("mindspeed", dict(dst_format="megatron", pp=2), False),
    "mindspeed-tp4-torch_dist-bf16": ("mindspeed", dict(dst_format="megatron", format="torch_dist", dtype="bf16"),
                                      False),
    # MindFormers' w_qkv is grouped like Megatron's (moves whole); its w_gate_hidden is interleaved (split)
    "mindspeed-tp4-mindformers-concat-tp2": ("mindspeed", dict(dst_format="mindspore", dialect="mindformers",
                                                                qkv_concat=True, tp=2), True),
    "gpt2-megatron-tp2-mindspeed-tp4": ("gpt2-megatron", dict(dst_format="mindspore", tp=4), False),
    "moe-megatron-tp2ep2-mindspeed-tp2ep2": ("moe-megatron", dict(dst_format="mindspore", tp=2, ep=2), False),
    "moe-megatron-tp2ep2-megatron-tp1ep4": ("moe-megatron", dict(dst_format="megatron", ep=4), False),
    # real megatron-core 0.16.1 checkpoints with optimizer state (tests/fixtures/megatron/PROVENANCE): the Adam
    # moments move whole like their weights; MindSpeed writes the fp32 masters as the weights
    "mcore-fp16opt-torch-mindspeed-tp2": (FIXTURES / "fp16opt/torch", dict(dst_format="mindspore", tp=2), False),
    "mcore-fp16opt-torch-megatron-tp2": (FIXTURES / "fp16opt/torch", dict(dst_format="megatron", tp=2), False),
    "mcore-fp16opt-torch_dist-megatron-tp2pp2": (FIXTURES / "fp16opt/torch_dist",
                                                 dict(dst_format="megatron", tp=2, pp=2), False),
    "mcore-distopt-torch-torch_dist": (FIXTURES / "distopt/torch", dict(dst_format="megatron", format="torch_dist"),
                                       False),
    # the distributed optimizer's torch_dist buckets are flat: their moments take the per-tensor path
    "mcore-distopt-torch_dist-megatron-tp2": (FIXTURES / "distopt/torch_dist", dict(dst_format="megatron", tp=2),
                                              True),
}


@pytest.fixture
def splits(monkeypatch):
    """Counts the fused rows split into or rebuilt from canonical tensors (weights, not the integer probe
    `Transform.fused_rows` runs), and the rows moved whole."""
    counts = {"split": 0, "moved": 0}
    to_rank, from_ranks, move = Transform.to_rank, Transform.from_ranks, engine._move_fused

    def counting_to_rank(self, parts, *args, **kwargs):
        if len(self.shapes) > 1 and parts[0].is_floating_point():
            counts["split"] += 1
        return to_rank(self, parts, *args, **kwargs)

    def counting_from_ranks(self, shards, *args, **kwargs):
        if len(self.shapes) > 1 and shards[0].is_floating_point():
            counts["split"] += 1
        return from_ranks(self, shards, *args, **kwargs)

    def counting_move(*args, **kwargs):
        counts["moved"] += 1
        return move(*args, **kwargs)

    monkeypatch.setattr(Transform, "to_rank", counting_to_rank)
    monkeypatch.setattr(Transform, "from_ranks", counting_from_ranks)
    monkeypatch.setattr(engine, "_move_fused", counting_move)
    return counts


def _per_tensor_path(monkeypatch):
    monkeypatch.setattr(engine, "fused_plan", lambda *args: {})


@pytest.mark.parametrize("case", list(CASES))
def test_fused_rows_move_whole_and_write_the_same_bytes(sources, splits, monkeypatch, tmp_path, case):
    src, options, some_split = CASES[case]
    seen = []
    fast = convert(sources / src, tmp_path / "fast", progress=lambda done, total: seen.append((done, total)),
                   **options)
    assert splits["moved"] > 0
    assert (splits["split"] > 0) == some_split, splits
    assert seen[-1][0] == seen[-1][1] > 0  # progress still reaches the total
    moved = splits["moved"]
    _per_tensor_path(monkeypatch)
    slow = convert(sources / src, tmp_path / "slow", **options)
    assert splits["moved"] == moved and splits["split"] > 0
    assert_same_output(tmp_path / "fast", tmp_path / "slow")
    assert (fast.tensors, fast.bytes, fast.notes) == (slow.tensors, slow.bytes, slow.notes)


def test_every_layers_attention_and_mlp_move_whole(sources, splits, tmp_path):
    """Megatron -> MindSpeed: per layer, linear_qkv -> qkv_proj and linear_fc1 -> mapping, nothing split."""
    convert(sources / "megatron", tmp_path / "out", dst_format="mindspore", tp=4, pp=2)
    assert splits == {"moved": 2 * 4, "split": 0}  # 4 layers, 2 fused rows each


def test_workers_take_the_fast_path_and_write_the_same_bytes(sources, monkeypatch, tmp_path):
    """--workers 2: each worker moves the fused rows of its units whole; the files equal one process's
    per-tensor output."""
    monkeypatch.setattr(parallel, "MIN_BYTES_PER_WORKER", 1)
    started = []
    real = parallel.run
    monkeypatch.setattr(parallel, "run", lambda tasks, *a, **k: started.append(len(tasks)) or real(tasks, *a, **k))
    convert(sources / "megatron", tmp_path / "two", dst_format="mindspore", tp=4, pp=2, workers=2)
    assert started == [2]
    _per_tensor_path(monkeypatch)
    convert(sources / "megatron", tmp_path / "one", dst_format="mindspore", tp=4, pp=2, workers=1)
    assert_same_output(tmp_path / "one", tmp_path / "two")


def test_the_megatron_reader_serves_a_fused_row_as_its_parts_fused(sources):
    """`fused_row` names the row's transform and parts; `read_fused` is the fusion of what `read` gives."""
    reader_cls = __import__("interop.formats", fromlist=["reader_of"]).reader_of("megatron")
    reader = reader_cls(sources / "megatron")
    try:
        transform, names = reader.fused_row("layers.0.attn.k.weight")
        assert isinstance(transform, GroupedQKV) and names == [f"layers.0.attn.{x}.weight" for x in "qkv"]
        assert isinstance(reader.fused_row("layers.0.mlp.up.weight")[0], GatedMLP)
        assert reader.fused_row("layers.0.attn.o.weight") is None
        whole = reader.read_fused("layers.0.attn.q.weight")
        assert torch.equal(whole, transform.fuse([reader.read(n) for n in names]))
    finally:
        reader.close()


def test_a_row_of_the_wrong_shape_is_refused(sources, monkeypatch, tmp_path):
    """The fused tensor a reader serves is checked against the transform's shape, like a canonical one."""
    from interop.converters.megatron import torch_format
    real = torch_format.Reader.read_fused
    monkeypatch.setattr(torch_format.Reader, "read_fused", lambda self, name: real(self, name)[1:])
    with pytest.raises(engine.InteropError, match="has shape"):
        convert(sources / "megatron", tmp_path / "out", dst_format="mindspore")
    assert not Path(tmp_path / "out").exists()
