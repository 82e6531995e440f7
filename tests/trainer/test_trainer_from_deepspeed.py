"""A run moves from DeepSpeed to Megatron and resumes: the tiny HF Llama trained 2 steps by DeepSpeed ZeRO-2
(tests/fixtures/deepspeed_zero/z2_fp32, dp 2, AdamW with the HF Trainer's decay / no-decay groups) is
converted to Megatron with its ZeRO fp32 masters and Adam moments, from there to the common format, and
resumed by the reference trainer at dp 2 on DeepSpeed's own next batches: its losses at updates 3 and 4
equal those of DeepSpeed's own resumed run (`resume.json`: load_checkpoint, then steps 3 and 4) within 1e-5.
The second loss comes after one AdamW update, so it holds only if the moments and the step came across.
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

FIXTURE = Path(__file__).parents[1] / "fixtures" / "deepspeed_zero" / "z2_fp32"
TOL = 1e-5


def deepspeed_rows() -> np.ndarray:
    """Every sample DeepSpeed's run saw, in the trainer's order (update s, dp rank r, row j -> s*4 + r*2 + j):
    scripts/make_zero_trainer_fixtures.py `batch(step, rank)`."""
    rows = []
    for step in range(4):
        for rank in range(2):
            g = torch.Generator().manual_seed(1000 + step * 2 + rank)
            rows.append(torch.randint(0, 250, (2, 16), generator=g))
    return torch.cat(rows).numpy()


def test_deepspeed_zero2_to_megatron_resumes_with_deepspeeds_losses(tmp_path):
    expected = json.loads((FIXTURE / "resume.json").read_text())["mean_loss"]
    convert(FIXTURE / "checkpoint-2", tmp_path / "megatron", src_format="deepspeed", dst_format="megatron",
            options={"dp": 2, "distributed_optimizer": True})
    convert(tmp_path / "megatron", tmp_path / "ckpt", src_format="megatron", dst_format="interop")
    np.save(tmp_path / "rows.npy", deepspeed_rows())
    # the update rule as the checkpoint states it (DeepSpeed clips at 1.0 when ds_config names no clipping)
    opt = StoreReader(tmp_path / "ckpt").source.state["optimizer"]
    assert (opt["step"], opt["betas"], opt["eps"], opt["weight_decay"], opt["clip_grad"]) == (2, [0.9, 0.95], 1e-8, 0.01, 1.0)
    cfg = TrainConfig(load=str(tmp_path / "ckpt"), resume=True, steps=4, dp=2, micro_batch_size=2, global_batch_size=4,
                      seq_length=15, data=str(tmp_path / "rows.npy"), lr=1e-2, decay_style="constant",
                      weight_decay=opt["weight_decay"], beta1=opt["betas"][0], beta2=opt["betas"][1], eps=opt["eps"],
                      clip_grad=opt["clip_grad"], quiet=True)
    results = train(cfg)
    assert [r["step"] for r in results] == [3, 4]
    losses = [r["loss"] for r in results]
    assert abs(losses[0] - expected[0]) < TOL, (losses, expected)
    assert abs(losses[1] - expected[1]) < TOL, (losses, expected)
