"""The distributed optimizer's torch_dist state saved by megatron-core at tp/pp > 1 (0.16.1's `dp_reshardable`
buckets, 0.15.3's `fully_sharded_model_space`), read into per-parameter Adam state and resumed by megatron-core
0.16.1 at another layout (and written to the torch format's distrib_optim.pt at another tp).

Facts (megatron-core 0.16.1, megatron/core/optimizer/distrib_optimizer.py `sharded_param_state_dp_reshardable`,
optimizer/__init__.py, distributed/param_and_grad_buffer.py): every tp x pp rank saves its own buffers under
`optimizer.distributed.dp_group_idx_<pp rank * tp + tp rank>.gbuf_idx_<model chunk>...bucket_idx_<b>.<kind>`, one
flat tensor per bucket holding that rank's tp shards of its stage's parameters in reverse `parameters()` order, each
parameter piece (and each gap) of each dp rank a DCP chunk of its own.  The fixtures are real runs
(tests/fixtures/distopt/PROVENANCE, made by tests/helpers/mcore_distopt.py); `state_tp<t>_pp<p>.safetensors` is what the
live optimizer held, never interop's reading.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from interop.convert import convert
from interop.converters.megatron import Reader as MegatronReader
from interop.converters.megatron.rows import expand_rows
from interop.converters.megatron.torch_dist import Reader
from interop.layout import ParallelLayout
from interop.io.megatron_dist import DistCheckpoint

HERE = Path(__file__).parents[1]
FIXTURES = HERE / "fixtures" / "distopt"
CASES = {"tp2dp2": (2, 1), "tp2pp2dp1": (2, 2), "mcore0.15-tp2pp2dp1": (2, 2)}  # fixture -> (tp, pp) it was saved at
PER_STAGE = 1  # 2 layers over pp 2


def _live_state(fixture: str, tp: int, pp: int) -> dict[tuple[int, str], torch.Tensor]:
    """{(tp rank, kind/name with GLOBAL layer numbers): tensor} of the saved run's live optimizer."""
    out = {}
    for t in range(tp):
        for p in range(pp):
            for key, value in load_file(str(FIXTURES / fixture / f"state_tp{t}_pp{p}.safetensors")).items():
                key = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + p * PER_STAGE}.", key)
                out[(t, key)] = value
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("fixture", sorted(CASES))
def test_distributed_optimizer_at_tp_and_pp_is_read_exactly(fixture, fmt):
    """Each canonical `optim.*` tensor, cut back into rank t's shard, is the live optimizer's element for element:
    `distrib_optim.pt` files (one per tp x pp rank), 0.16.1's `dp_reshardable` buckets and 0.15.3's per-parameter
    `fully_sharded_model_space` (its Megatron-LM's default), saved at tp 2 and pp 2 (and 0.16.1's at dp 2)."""
    tp, pp = CASES[fixture]
    reader = MegatronReader(FIXTURES / fixture / fmt)
    how = ("from distrib_optim.pt" if fmt == "torch" else "fully_sharded_model_space" if fixture.startswith("mcore0.15")
           else f"buckets (dp_reshardable, saved at tp {tp}, pp {pp}, dp {2 if pp == 1 else 1}, local layer spec)")
    assert any(how in n for n in reader.source.notes), reader.source.notes
    live = _live_state(fixture, tp, pp)
    checked = set()
    for row in expand_rows("mcore", reader.spec, ParallelLayout.build(reader.spec.num_layers, tp, pp)):
        key = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + row.stage * PER_STAGE}.", row.key)
        for kind in ("fp32_param", "exp_avg", "exp_avg_sq"):
            parts = [reader.read(f"optim.{kind}.{part}") for part in row.parts]
            for t in range(tp):
                assert torch.equal(row.transform.to_rank(parts, t, tp), live[(t, f"{kind}/{key}")]), (kind, key, t)
                checked.add((t, f"{kind}/{key}"))
    assert checked == set(live)  # every parameter of every rank, all three kinds
    assert reader.source.state["optimizer"]["step"] == 2


def _with_args(tmp_path, **changes) -> Path:
    """The tp2dp2 fixture with its common.pt args changed (`None` deletes the arg)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tp2dp2" / "torch_dist", root)
    common_pt = root / "iter_0000002" / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    args = vars(common["args"])
    for k, v in changes.items():
        args.pop(k) if v is None else args.__setitem__(k, v)
    common["args"] = argparse.Namespace(**args)
    torch.save(common, common_pt)
    return root


def test_layer_spec_unsaid_is_taken_from_the_chunk_boundaries(tmp_path):
    """Without --transformer-impl in the args, the local and TE specs' parameter orders are both candidates: the
    one whose parameter boundaries the DCP chunks show is taken (said in the note)."""
    reader = Reader(_with_args(tmp_path, transformer_impl=None))
    assert any("dp 2, local layer spec" in n for n in reader.source.notes), reader.source.notes
    assert "optim.exp_avg.layers.1.mlp.down.weight" in {m.name for m in reader.metas()}


def test_wrong_layer_spec_is_noted_not_guessed(tmp_path):
    """Args naming the TE spec for buckets laid out in the local spec's order: the boundaries disagree, so the
    state is not converted (a note saying why); the weights are."""
    reader = Reader(_with_args(tmp_path, transformer_impl="transformer_engine"))
    note = next(n for n in reader.source.notes if n.startswith("optimizer state not converted"))
    assert "not megatron-core's mcore_te layout" in note and note.endswith("weights converted")
    assert not any(m.name.startswith("optim.") for m in reader.metas())


def test_bucket_count_of_another_layout_is_noted(tmp_path):
    """Args claiming tp 1 for a tp 2 run's buckets (two ranks' buffers): one line, no crash, weights kept."""
    reader = Reader(_with_args(tmp_path, tensor_model_parallel_size=1))
    note = next(n for n in reader.source.notes if n.startswith("optimizer state not converted"))
    assert "buffers, tp 1 x pp 1 x vpp 1 make 1" in note


def _resume(ckpt: Path, out: Path, tp: int, dp: int, sharding: str) -> tuple[list[float], dict]:
    """megatron-core 0.16.1 at tp x dp loads `ckpt` (an iteration folder), dumps its optimizer state, trains 2 updates."""
    run = subprocess.run([sys.executable, str(HERE / "helpers" / "mcore_distopt.py"), "resume", str(ckpt), str(out), "--tp", str(tp),
                          "--dp", str(dp), "--sharding", sharding], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    state = {(t, k): v for t in range(tp) for k, v in load_file(str(out / f"state_tp{t}_pp0.safetensors")).items()}
    return json.loads((out / "losses.json").read_text()), state


def _assert_same_state(got: dict, live: dict) -> None:
    assert got.keys() == live.keys()
    for key in live:
        assert torch.equal(got[key], live[key]), key


def test_tp2_dp2_resumes_at_dp1_as_from_megatron_cores_own(tmp_path):
    """tp 2, dp 2 buckets -> interop -> torch_dist with --distributed-optimizer (`fully_reshardable`) -> megatron-core
    at tp 2, dp 1: it holds the saved run's masters and moments element for element, and trains the next two updates
    with exactly the losses it trains from megatron-core's own checkpoint (loaded at dp 1 as `dp_reshardable`)."""
    pytest.importorskip("megatron.core")
    convert(FIXTURES / "tp2dp2" / "torch_dist", tmp_path / "ours", dst_format="megatron",
            options={"format": "torch_dist", "distributed_optimizer": True})
    assert DistCheckpoint(tmp_path / "ours" / "iter_0000002").common["content_metadata"][
        "distrib_optim_sharding_type"] == "fully_reshardable"
    ours, state = _resume(tmp_path / "ours" / "iter_0000002", tmp_path / "r-ours", 2, 1, "fully_reshardable")
    _assert_same_state(state, _live_state("tp2dp2", 2, 1))
    own, _ = _resume(FIXTURES / "tp2dp2" / "torch_dist" / "iter_0000002", tmp_path / "r-own", 2, 1, "dp_reshardable")
    assert ours == own


def test_tp2_pp2_resumes_at_pp1(tmp_path):
    """tp 2, pp 2 buckets (two stages' buffers per tp rank) -> interop -> torch_dist -> megatron-core at tp 2, pp 1:
    both stages' masters and moments land on the one stage, element for element (megatron-core cannot reshard its
    own dp_reshardable checkpoint over pp, so there is no own run to compare losses with)."""
    pytest.importorskip("megatron.core")
    convert(FIXTURES / "tp2pp2dp1" / "torch_dist", tmp_path / "ours", dst_format="megatron",
            options={"format": "torch_dist", "distributed_optimizer": True})
    losses, state = _resume(tmp_path / "ours" / "iter_0000002", tmp_path / "r-ours", 2, 1, "fully_reshardable")
    _assert_same_state(state, _live_state("tp2pp2dp1", 2, 2))
    assert len(losses) == 2 and all(loss == loss for loss in losses)


def test_tp2_buckets_to_the_torch_format_at_tp1(tmp_path):
    """tp 2, dp 2 buckets -> the torch format at tp 1 with `--distributed-optimizer --dp 2` (rank file +
    distrib_optim.pt): megatron-core at tp 1, dp 2 (`load_parameter_state`, as Megatron-LM's load_checkpoint does)
    trains the next two updates with exactly the losses it trains from interop's torch_dist of the same checkpoint
    (`fully_reshardable`), both holding the same masters and moments."""
    pytest.importorskip("megatron.core")
    src = FIXTURES / "tp2dp2" / "torch_dist"
    summary = convert(src, tmp_path / "pt", dst_format="megatron", tp=1,
                      options={"format": "torch", "distributed_optimizer": True, "dp": 2})
    assert any("distrib_optim.pt) for dp 2" in n for n in summary.notes), summary.notes
    convert(src, tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist", "distributed_optimizer": True})
    via_pt, state_pt = _resume(tmp_path / "pt" / "iter_0000002", tmp_path / "r-pt", 1, 2, "fully_reshardable")
    via_dist, state_dist = _resume(tmp_path / "dist" / "iter_0000002", tmp_path / "r-dist", 1, 2, "fully_reshardable")
    _assert_same_state(state_pt, state_dist)
    assert via_pt == via_dist


@pytest.mark.parametrize("fixture", ["tp2dp2", "tp2pp2dp1"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_distrib_optim_pt_at_tp_and_pp_equals_megatron_cores_own(fixture, fmt, tmp_path):
    """The run at tp 2 (pp 2), read from either format, -> the torch format at the same tp / pp / dp with
    `--distributed-optimizer`: every rank's distrib_optim.pt equals the one megatron-core's own
    `save_parameter_state` wrote (keys, dtype key, every element of the coalesced buffers)."""
    tp, pp = CASES[fixture]
    dp = 2 if pp == 1 else 1
    convert(FIXTURES / fixture / fmt, tmp_path / "pt", dst_format="megatron", tp=tp, pp=pp,
            options={"format": "torch", "distributed_optimizer": True, "dp": dp})
    ranks = sorted(p.name for p in (FIXTURES / fixture / "torch" / "iter_0000002").iterdir())
    assert sorted(p.name for p in (tmp_path / "pt" / "iter_0000002").iterdir()) == ranks and len(ranks) == tp * pp
    for rank in ranks:
        ours, theirs = (torch.load(root / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True)
                        for root in (tmp_path / "pt", FIXTURES / fixture / "torch"))
        assert ours.keys() == theirs.keys() == {"buckets_coalesced", 0}
        assert ours[0].keys() == theirs[0].keys() == {(torch.bfloat16, torch.float32)}
        for dtypes, entry in theirs[0].items():
            assert ours[0][dtypes]["numel_unpadded"] == entry["numel_unpadded"]
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours[0][dtypes][k], entry[k]), (rank, k)
