"""Stop and resume: a run resumed from step k continues the uninterrupted run's loss curve, bit-exactly
at the same layout and within 1e-6 at another; a rank killed mid-save leaves the previous checkpoint usable."""
from __future__ import annotations

import json

import pytest
import torch

from interop.store import StoreReader
from interop.trainer.checkpoint import newest_checkpoint
from interop.trainer.config import TrainConfig
from interop.trainer.init import init_checkpoint, read_spec
from interop.trainer.launch import TrainingFailed, train
from helpers.specs import LLAMA, write_spec

STEPS, K = 6, 3


def config(**kw) -> TrainConfig:
    base = dict(steps=STEPS, save_interval=K, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3,
                warmup=2, quiet=True)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """tp 2 (GQA, untied, padded vocab), 6 updates, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("resume")
    start = init_checkpoint(read_spec(write_spec(root / "llama.yaml", LLAMA)), root / "start", seed=3)
    history = train(config(load=str(start), save=str(root / "A"), tp=2))
    return root, start, history


def losses(history, first=1):
    return {r["step"]: r["loss"] for r in history if r["step"] >= first}


def test_uninterrupted_run_saves_full_state(uninterrupted):
    root, _, history = uninterrupted
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    ckpt = newest_checkpoint(root / "A")
    assert ckpt.name == "step_000006" and (root / "A" / "step_000003").is_dir()
    reader = StoreReader(ckpt)
    state = reader.source.state
    assert state["iteration"] == 6 and state["consumed_samples"] == 24 and state["optimizer"]["step"] == 6
    assert state["rng"]["torch"] and state["scheduler"]["warmup"] == 2
    assert reader.layout.tp == 2 and "optim.exp_avg_sq.layers.3.mlp.down.weight" in reader.manifest["tensors"]
    logged = [json.loads(line)["step"] for line in (root / "A" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))


def test_resume_same_layout_is_bit_exact(uninterrupted):
    root, _, history = uninterrupted
    resumed = train(config(load=str(root / "A" / "step_000003"), save=str(root / "B"), tp=2, resume=True))
    assert losses(resumed) == losses(history, K + 1)  # exact float equality, steps 4..6
    a, b = StoreReader(root / "A" / "step_000006"), StoreReader(root / "B" / "step_000006")
    assert set(a.manifest["tensors"]) == set(b.manifest["tensors"])
    for name in a.manifest["tensors"]:
        assert torch.equal(a.read(name), b.read(name)), name


def test_resume_at_another_layout_continues_the_curve(uninterrupted):
    root, _, history = uninterrupted
    resumed = train(config(load=str(root / "A" / "step_000003"), save=str(root / "C"), tp=1, pp=2, resume=True))
    got, want = losses(resumed), losses(history, K + 1)
    assert list(got) == [4, 5, 6]
    assert max(abs(got[s] - want[s]) for s in got) < 1e-6, (got, want)


def test_killed_mid_save_leaves_previous_checkpoint_usable(uninterrupted, monkeypatch):
    root, start, history = uninterrupted
    monkeypatch.setenv("INTEROP_TRAIN_KILL_AT", f"{STEPS}:write")  # SIGKILL rank 0 halfway through its shards
    with pytest.raises(TrainingFailed, match="died"):
        train(config(load=str(start), save=str(root / "D"), tp=2))
    monkeypatch.delenv("INTEROP_TRAIN_KILL_AT")
    assert (root / "D" / f".step_{STEPS:06d}.tmp").is_dir()  # the half-written save, never a checkpoint
    assert newest_checkpoint(root / "D").name == "step_000003"
    StoreReader(root / "D" / "step_000003")  # sizes and checksums verify
    resumed = train(config(save=str(root / "D"), resume=True, save_interval=4))  # tp 1 pp 1, from D's newest
    assert sorted(p.name for p in (root / "D").iterdir()) == ["metrics.jsonl", "step_000003", "step_000004",
                                                               "step_000006"]  # the partial save is cleared
    got, want = losses(resumed), losses(history, K + 1)
    assert max(abs(got[s] - want[s]) for s in got) < 1e-6
    assert newest_checkpoint(root / "D").name == "step_000006"
    logged = [json.loads(line)["step"] for line in (root / "D" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))  # steps after the checkpoint were logged again, once
    from interop.workflows.metrics import compare_runs
    curves = compare_runs({"uninterrupted tp2": root / "A", "killed, resumed tp1": root / "D"}, 1e-6,
                          plot=root / "curves.png")
    assert curves.ok and (root / "curves.png").stat().st_size > 10_000


def test_cli_stop_and_resume(tmp_path):
    """`interop train --stop-at` then `--resume` at another layout, as in the README demo."""
    from click.testing import CliRunner
    from interop.cli.main import main
    spec = write_spec(tmp_path / "llama.yaml", LLAMA)
    common = ["--init-spec", str(spec), "--save", str(tmp_path / "run"), "--steps", "4", "--seq-length", "16",
              "--global-batch-size", "4"]
    first = CliRunner().invoke(main, ["train", *common, "--stop-at", "2"])
    assert first.exit_code == 0, first.output
    assert "Epoch: 0, Step: 2, Loss: " in first.stdout and "Step: 3" not in first.stdout
    second = CliRunner().invoke(main, ["train", *common, "--resume", "--pp", "2", "--lr", "2e-3"])
    assert second.exit_code == 0, second.output
    assert "note: resuming" in second.stderr and "scheduler.lr 0.001 -> 0.002" in second.stderr
    lines = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert newest_checkpoint(tmp_path / "run").name == "step_000004"
