"""Parity: the same weights and batches give the same losses at tp/pp 1x1, 2x1, 1x2, 2x2 (and dp 2),
in HF transformers and in the MindSpore model, within 1e-5 over 10 updates (fp32)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from interop.cli.main import main
from interop.trainer.config import TrainConfig
from interop.trainer.init import init_checkpoint, read_spec
from interop.workflows.parity import ParityResult, parity
from helpers.specs import GPT2, LLAMA, write_spec


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {name: init_checkpoint(read_spec(write_spec(root / f"{name}.yaml", spec)), root / name, seed=5)
            for name, spec in (("llama", LLAMA), ("gpt2", GPT2))}


def test_llama_layouts_hf_and_mindspore_agree(start):
    """GQA, untied head, padded vocabulary (120 -> 128): every layout and framework within 1e-5 for 10 steps."""
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, warmup=2)
    result = parity(start["llama"], cfg, layouts=[(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)],
                    frameworks=["torch", "hf", "mindspore"])
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "torch 1x2", "torch 2x2", "hf", "mindspore"]
    assert all(len(v) == 10 for v in result.runs.values())
    assert result.max_diff < 1e-5, result.table()
    assert result.ok
    losses = result.runs["torch 2x2"]
    assert sum(losses[-3:]) < sum(losses[:3])  # the synthetic stream is learnable: the curve goes down


def test_cli_gpt2_tied_pipeline_and_data_parallel(start, tmp_path):
    """Tied embeddings split over two stages (their gradients summed), dp 2, HF: `interop parity` prints,
    plots and exits 0."""
    png = tmp_path / "parity.png"
    result = CliRunner().invoke(main, ["parity", str(start["gpt2"]), "--steps", "10", "--layouts", "1x1,2x2,1x1x2",
                                       "--frameworks", "torch,hf", "--seq-length", "16", "--lr", "3e-3",
                                       "--plot", str(png)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "torch 1x1" in out and "torch 2x2" in out and "torch 1x1x2" in out and " hf" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 10
    worst = max(float(r[-1]) for r in rows)
    assert worst < 1e-5
    assert "OK" in out and png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_exit_codes(start, monkeypatch):
    """A difference above the tolerance exits 1; unknown or unavailable frameworks are user errors (2)."""
    import interop.workflows.parity as parity_mod

    def fake(*args, **kwargs):
        return ParityResult({"torch 1x1": [1.0, 0.9], "hf": [1.0, 0.89]}, tolerance=kwargs.get("tolerance", 1e-5))

    monkeypatch.setattr(parity_mod, "parity", lambda ckpt, cfg, layouts, frameworks, tolerance, plot: fake(
        tolerance=tolerance))
    result = CliRunner().invoke(main, ["parity", str(start["gpt2"])])
    assert result.exit_code == 1 and "FAIL" in result.stdout and "1.00e-02" in result.stdout
    monkeypatch.undo()
    result = CliRunner().invoke(main, ["parity", str(start["gpt2"]), "--frameworks", "torch,jax"])
    assert result.exit_code == 2 and "unknown framework 'jax'" in result.stderr
    result = CliRunner().invoke(main, ["parity", str(start["gpt2"]), "--layouts", "2by2"])
    assert result.exit_code == 2 and "is not TPxPP" in result.stderr


def test_megatron_core_joins_when_installed(start, tmp_path):
    """megatron-core's own GPTModel (weights via the Megatron converter) trains with the same losses.
    Megatron's loss counts vocabulary padding, so it needs an unpadded vocabulary (and says so otherwise)."""
    pytest.importorskip("megatron.core")
    spec = dict(LLAMA, vocab=128, padded_vocab=128, num_layers=2)
    ckpt = init_checkpoint(read_spec(write_spec(tmp_path / "llama128.yaml", spec)), tmp_path / "llama128", seed=5)
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, warmup=2)
    result = parity(ckpt, cfg, layouts=[(1, 1, 1)], frameworks=["torch", "megatron"])
    assert list(result.runs) == ["torch 1x1", "megatron"]
    assert result.max_diff < 1e-5, result.table()
    bad = CliRunner().invoke(main, ["parity", str(start["gpt2"]), "--frameworks", "megatron"])
    assert bad.exit_code == 2 and "padded to 256 rows" in bad.stderr and "multiple of 128" in bad.stderr


def test_uneven_pipeline_stages_train_like_one_process(start, tmp_path):
    """pp 2 with 1 layer on the first stage and 3 on the last (Megatron's decoder_first/last_pipeline_num_layers)
    follows the single-process run within 1e-5, and its checkpoint records the uneven stages."""
    from interop.store import StoreReader
    from interop.trainer.launch import train
    from interop.workflows.metrics import read_losses

    base = TrainConfig(load=str(start["llama"]), steps=6, micro_batch_size=2, global_batch_size=4, seq_length=16,
                       lr=3e-3, quiet=True)
    train(base.replace(save=str(tmp_path / "flat")))
    train(base.replace(save=str(tmp_path / "uneven"), pp=2, first_stage_layers=1, last_stage_layers=3))
    flat, uneven = read_losses(tmp_path / "flat"), read_losses(tmp_path / "uneven")
    assert len(flat) == len(uneven) == 6
    assert max(abs(a - b) for a, b in zip(flat, uneven)) < 1e-5, (flat, uneven)
    saved = sorted((tmp_path / "uneven").glob("step_*"))[-1]
    assert StoreReader(saved).layout.stages == (((0, 1),), ((1, 4),))
