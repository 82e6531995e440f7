"""A run moves from ATorch FSDP to Megatron and resumes: the tiny HF Llama trained 2 steps by torch FSDP at dp 3
and saved by ATorch 0.2.5's streaming savers (tests/fixtures/atorch_fsdp/fp32_dp3, AdamW with ATorch's Llama 2
example's decay / no-decay groups, no clipping) is converted to Megatron with its fp32 weights as masters and
its Adam moments, from there to the common format, and resumed by the reference trainer at dp 3 on the same
next batches: its losses at updates 3 and 4 equal those of the FSDP run that went on from the saved state
(`resume.json`) within 1e-5.  The second loss comes after one AdamW update, so it holds only if the moments and
the step came across.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from interop.convert import convert
from interop.store import StoreReader
from interop.trainer.config import TrainConfig
from interop.trainer.launch import train

FIXTURE = Path(__file__).parents[1] / "fixtures" / "atorch_fsdp" / "fp32_dp3"
TOL = 1e-5
DP = 3


def fsdp_rows() -> np.ndarray:
    """Every sample the FSDP run saw, in the trainer's order (update s, dp rank r, row j -> s*6 + r*2 + j):
    scripts/make_atorch_fsdp_fixtures.py `batch(step, rank)`."""
    rows = []
    for step in range(4):
        for rank in range(DP):
            g = torch.Generator().manual_seed(1000 + step * 7 + rank)
            rows.append(torch.randint(0, 250, (2, 12), generator=g))
    return torch.cat(rows).numpy()


def test_atorch_fsdp_to_megatron_resumes_with_the_fsdp_runs_losses(tmp_path):
    expected = json.loads((FIXTURE / "resume.json").read_text())["mean_loss"]
    convert(FIXTURE, tmp_path / "megatron", src_format="atorch", dst_format="megatron",
            options={"dp": DP, "distributed_optimizer": True})
    convert(tmp_path / "megatron", tmp_path / "ckpt", src_format="megatron", dst_format="interop")
    # ATorch's streaming save keeps no iteration and no data position (its trainer keeps them in trainer_state.json
    # beside, which this fixture does not have): the user's knowledge, 2 updates of 6 samples, is written in.
    manifest = json.loads((tmp_path / "ckpt" / "interop.json").read_text())
    manifest["state"].update(iteration=2, consumed_samples=2 * 2 * DP)
    (tmp_path / "ckpt" / "interop.json").write_text(json.dumps(manifest))
    np.save(tmp_path / "rows.npy", fsdp_rows())
    opt = StoreReader(tmp_path / "ckpt").source.state["optimizer"]
    assert (opt["step"], opt["betas"], opt["eps"], opt["weight_decay"]) == (2, [0.9, 0.95], 1e-8, 0.1)
    cfg = TrainConfig(load=str(tmp_path / "ckpt"), resume=True, steps=4, dp=DP, micro_batch_size=2,
                      global_batch_size=2 * DP, seq_length=11, data=str(tmp_path / "rows.npy"), lr=1e-2,
                      decay_style="constant", weight_decay=opt["weight_decay"], beta1=opt["betas"][0],
                      beta2=opt["betas"][1], eps=opt["eps"], clip_grad=0.0, quiet=True)
    results = train(cfg)
    assert [r["step"] for r in results] == [3, 4]
    losses = [r["loss"] for r in results]
    assert abs(losses[0] - expected[0]) < TOL, (losses, expected)
    assert abs(losses[1] - expected[1]) < TOL, (losses, expected)
