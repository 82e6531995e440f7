"""Checkpoints converted from Megatron (saved by real megatron-core) and from MindSpore train under the
reference trainer, and the first update's loss equals the source framework's loss on the same batch."""
from __future__ import annotations

import numpy as np
import pytest

from interop.convert import convert
from interop.trainer.config import TrainConfig
from interop.trainer.launch import train

TOL = 1e-5


def first_two_losses(ckpt, rows_file, seq, tp, pp):
    """Two updates on the same batch (the .npy's rows, mbs 1: two micro-batches through the pipeline)."""
    rows = np.load(rows_file)
    cfg = TrainConfig(load=str(ckpt), steps=2, micro_batch_size=1, global_batch_size=len(rows), seq_length=seq,
                      data=str(rows_file), tp=tp, pp=pp, lr=1e-3, quiet=True)
    return [r["loss"] for r in train(cfg)]


@pytest.mark.parametrize("kind,tp,pp", [("gpt2", 2, 2), ("llama", 1, 2)])
def test_megatron_checkpoint_trains_from_mcore_loss(kind, tp, pp, tmp_path, tmp_path_factory):
    pytest.importorskip("megatron.core")
    import helpers.megatron_ref as R
    root, results = R.reference_once(tmp_path_factory)
    convert(R.legacy_dir(root, kind, 2), tmp_path / "ckpt", src_format="megatron", dst_format="interop")
    np.save(tmp_path / "batch.npy", R.batch().numpy())
    first, second = first_two_losses(tmp_path / "ckpt", tmp_path / "batch.npy", R.SEQ, tp, pp)
    mcore = results[f"{kind}-tp2"]["loss"]
    assert abs(first - mcore) < TOL, f"{kind}: trainer {first} vs megatron-core {mcore}"
    assert second < first  # it trains: the same batch again, after one AdamW step


def test_mindspore_checkpoint_trains_from_mindspore_loss(tmp_path):
    pytest.importorskip("mindspore")
    import helpers.hf_models as hf_models
    from interop.workflows import mindspore_model
    hf_models.save("llama", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ms", src_format="hf", dst_format="mindspore")
    rows = np.random.default_rng(0).integers(0, hf_models.VOCAB, (2, 17))
    np.save(tmp_path / "batch.npy", rows)
    ms_loss = mindspore_model.lm_loss(mindspore_model.load(tmp_path / "ms"), rows)
    convert(tmp_path / "ms", tmp_path / "ckpt", src_format="mindspore", dst_format="interop")
    first, second = first_two_losses(tmp_path / "ckpt", tmp_path / "batch.npy", 16, tp=2, pp=1)
    assert abs(first - ms_loss) < TOL, f"trainer {first} vs MindSpore {ms_loss}"
    assert second < first
