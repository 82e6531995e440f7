"""The reference trainer's parts, in this process (no ranks spawned): the update rule, the
vocab-parallel cross entropy, config files, data, and tp=1 pp=1 training against HF transformers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from interop.trainer.config import TrainConfig, load_config
from interop.trainer.data import TokenData
from interop.trainer.optim import OptimConfig, clip_grad_norm, lr_at
from interop.trainer.tp import vocab_parallel_cross_entropy
from helpers.specs import LLAMA, write_spec





def test_lr_schedule_warmup_then_decay():
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup=2, decay_style="cosine")
    assert [lr_at(cos, s, 10) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(cos, 6, 10) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert lr_at(cos, 10, 10) == 0.1
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup=0, decay_style="linear", decay_steps=4)
    assert [lr_at(lin, s, 10) for s in (1, 2, 4, 9)] == [0.75, 0.5, 0.0, 0.0]
    assert lr_at(OptimConfig(lr=0.3, decay_style="constant"), 7, 10) == 0.3


def test_clip_grad_norm_counts_shared_gradients_once():
    a, b = torch.full((4,), 3.0), torch.full((4,), 3.0)
    norm = clip_grad_norm([(a, True), (b, False)], max_norm=1.0)
    assert norm == pytest.approx(6.0)
    assert torch.allclose(a, torch.full((4,), 3.0 / (6.0 + 1e-6)))


@pytest.mark.parametrize("fused", [True, False], ids=["tp1-fused", "split-kernel"])
def test_vocab_parallel_cross_entropy_ignores_padded_vocab(fused):
    """Both paths (torch's kernel at tp 1, the split-vocabulary autograd function used at tp > 1)."""
    from interop.trainer.tp import _VocabParallelCrossEntropy
    torch.manual_seed(0)
    logits = torch.randn(10, 16, requires_grad=True)
    target = torch.randint(0, 12, (10,))
    if fused:
        loss = vocab_parallel_cross_entropy(logits, target, 0, 12, None)  # columns 12..15 are padding
    else:
        loss = _VocabParallelCrossEntropy.apply(logits, target, 0, 12, None)
    ref_logits = logits.detach()[:, :12].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), abs=1e-6)
    loss.backward()
    ref.backward()
    assert torch.allclose(logits.grad[:, :12], ref_logits.grad, atol=1e-7)
    assert torch.all(logits.grad[:, 12:] == 0)


def test_config_from_mindspeed_yaml_and_megatron_args(tmp_path):
    cfg_yaml = tmp_path / "run.yaml"
    cfg_yaml.write_text(yaml.safe_dump({
        "training_config": {"seed": 7, "training_iters": 30, "save_interval": 5, "output_dir": "out", "bf16": False},
        "optimizer_config": {"learning_rate": 3e-4, "min_lr": 3e-5, "lr_warmup_iters": 3, "lr_decay_style": "linear",
                             "weight_decay": 0.1, "betas": [0.9, 0.99], "eps": 1e-6, "clip_grad": 0.5},
        "parallel_config": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        "dataset_config": {"batch_size": 2, "micro_batch_num": 4},
        "model_config": {"seq_length": 16}}))
    cfg = load_config(cfg_yaml, steps=12)  # a flag overrides the file
    assert (cfg.tp, cfg.pp, cfg.steps, cfg.seed, cfg.save_interval, cfg.save) == (2, 2, 12, 7, 5, "out")
    assert (cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_style, cfg.weight_decay) == (3e-4, 3e-5, 3, "linear", 0.1)
    assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.clip_grad) == (0.9, 0.99, 1e-6, 0.5)
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.seq_length) == (2, 8, 16)

    args = tmp_path / "args.txt"
    args.write_text("--num-layers 2 --hidden-size 64 \\\n  --tensor-model-parallel-size 2 --micro-batch-size 1 "
                    "--global-batch-size 4 --train-iters 9 --lr 1e-4 --lr-decay-style cosine --bf16\n"
                    "# a comment\n--clip-grad 0.0 --seed 3\n")
    cfg = load_config(args)
    assert (cfg.tp, cfg.micro_batch_size, cfg.global_batch_size, cfg.steps, cfg.lr, cfg.bf16, cfg.clip_grad, cfg.seed) \
        == (2, 1, 4, 9, 1e-4, True, 0.0, 3)


def test_data_is_deterministic_and_reads_files(tmp_path):
    a, b = TokenData(100, 8, seed=1), TokenData(100, 8, seed=1)
    x, y = a.batch(5, 3)
    assert x.shape == (3, 8) and torch.equal(x, b.batch(5, 3)[0]) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, TokenData(100, 8, seed=2).batch(5, 3)[0])
    stream = np.arange(41, dtype=np.uint16) % 50
    stream.tofile(tmp_path / "t.bin")
    x, y = TokenData(50, 8, path=tmp_path / "t.bin").batch(0, 2)
    assert x[1].tolist() == list(range(8, 16)) and y[1].tolist() == list(range(9, 17))
    rows = np.random.default_rng(0).integers(0, 50, (3, 9))
    np.save(tmp_path / "rows.npy", rows)
    x, y = TokenData(50, 8, path=tmp_path / "rows.npy").batch(1, 2)
    assert x.tolist() == rows[1:3, :-1].tolist() and y.tolist() == rows[1:3, 1:].tolist()


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied"])
def test_tp1_pp1_trains_like_hf_transformers(kind, hf_checkpoints):
    """HF checkpoint -> common format; 10 updates in the trainer and in transformers: same losses within 1e-5."""
    from interop.workflows.parity import parity
    cfg = TrainConfig(steps=10, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=3e-3, warmup=2)
    result = parity(hf_checkpoints[kind], cfg, layouts=[(1, 1, 1)], frameworks=["torch", "hf"])
    assert list(result.runs) == ["torch 1x1", "hf"]
    assert result.max_diff < 1e-5, result.table()
    losses = result.runs["torch 1x1"]
    assert len(losses) == 10 and len(set(losses)) > 1  # the weights really move


def test_map_args_yaml_drives_the_trainer(tmp_path):
    """Megatron launch script -> `interop map-args --to mindspeed` -> TrainConfig: the same run."""
    from click.testing import CliRunner
    from interop.cli.main import main
    script = tmp_path / "train.sh"
    script.write_text("TP=2\nARGS=\"--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                      "--max-position-embeddings 64 --tensor-model-parallel-size $TP --pipeline-model-parallel-size 2 "
                      "--micro-batch-size 2 --train-iters 7 --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 2 "
                      "--lr-decay-style cosine --weight-decay 0.1 --clip-grad 0.5 --seed 11 --save-interval 3\"\n"
                      "torchrun --nproc_per_node 4 pretrain_gpt.py $ARGS\n")
    result = CliRunner().invoke(main, ["map-args", str(script), "--to", "mindspeed", "-o", str(tmp_path / "run.yaml")])
    assert result.exit_code == 0, result.output
    from_yaml, from_script = load_config(tmp_path / "run.yaml"), load_config(script)
    for cfg in (from_yaml, from_script):
        assert (cfg.tp, cfg.pp, cfg.micro_batch_size, cfg.steps, cfg.seq_length, cfg.seed) == (2, 2, 2, 7, 16, 11)
        assert (cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_style, cfg.weight_decay, cfg.clip_grad, cfg.save_interval) \
            == (2e-4, 2e-5, 2, "cosine", 0.1, 0.5, 3)


def test_bf16_tracks_fp32(tmp_path):
    """bf16 autocast (fp32 weights and Adam) stays within bf16 rounding of the fp32 run."""
    from interop.trainer.launch import train
    spec = write_spec(tmp_path / "llama.yaml", LLAMA)
    base = TrainConfig(init_spec=str(spec), steps=4, global_batch_size=4, seq_length=16, quiet=True)
    fp32 = [r["loss"] for r in train(base)]
    bf16 = [r["loss"] for r in train(base.replace(bf16=True))]
    assert fp32 != bf16 and max(abs(a - b) for a, b in zip(fp32, bf16)) < 2e-2


def test_megatron_indexed_dataset_prefix(tmp_path):
    """A Megatron `--data-path` prefix (PREFIX.idx + PREFIX.bin, written by megatron-core) reads as one stream."""
    pytest.importorskip("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    builder.add_document(torch.arange(20), [20])
    builder.add_document(torch.arange(20, 41), [21])
    builder.finalize(get_idx_path(prefix))
    x, y = TokenData(50, 8, path=prefix).batch(1, 2)
    assert x.tolist() == [list(range(8, 16)), list(range(16, 24))] and y[1].tolist() == list(range(17, 25))
