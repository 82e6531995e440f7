"""Benchmark: training tokens/s of the reference trainer (tp 1, pp 1) vs HF transformers on this CPU.

Both train the same Llama-style model from the same weights on the same batches with
the same update rule (`interop.trainer.optim`: AdamW, schedule, clipping), one process
each, measured side by side: the two are run alternately `--rounds` times, each round
giving the median step time after `--warmup` steps, and each side's best round is
compared (on a shared, busy machine the best round is the one least disturbed).
Target: trainer / HF >= 1.0.  HF uses its default attention (sdpa).

With `--demo`, also times the training half of the README demo (parity across four
layouts and three frameworks, then train, stop, resume at another layout) as CLI runs.

    .venv/bin/python benchmarks/bench_trainer.py [--steps 12] [--rounds 3] [--demo]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from interop.spec import ModelSpec
from interop.trainer.config import TrainConfig
from interop.trainer.data import TokenData
from interop.trainer.init import init_checkpoint
from interop.trainer.launch import train
from interop.trainer.optim import clip_grad_norm, lr_at, make_adamw, set_lr

SPEC = ModelSpec(arch="llama", num_layers=4, hidden=256, ffn_hidden=688, heads=8, kv_groups=4, head_dim=32,
                 vocab=4096, padded_vocab=4096, max_positions=256, norm="rmsnorm", norm_eps=1e-5,
                 activation="swiglu", position="rope", tied_embeddings=False)


def trainer_step_times(ckpt, cfg: TrainConfig) -> tuple[list[float], list[float]]:
    history = train(cfg.replace(load=str(ckpt)))
    return [r["time_ms"] / 1000 for r in history], [r["loss"] for r in history]


def hf_step_times(ckpt, cfg: TrainConfig, work: Path) -> tuple[list[float], list[float]]:
    import transformers
    from interop.convert import convert
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf_dir = work / "hf"
    if not hf_dir.exists():
        convert(ckpt, hf_dir, src_format="interop", dst_format="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()  # no dropout, as the reference trainer
    optimizer = make_adamw(model.named_parameters(), cfg.optim())
    params = list(model.parameters())
    data = TokenData(SPEC.vocab, cfg.seq_length, cfg.seed)
    times, losses = [], []
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        tokens, targets = data.batch((step - 1) * cfg.global_batch_size, cfg.global_batch_size)
        optimizer.zero_grad(set_to_none=False)
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, SPEC.vocab), targets.reshape(-1))
        loss.backward()
        clip_grad_norm([(p.grad, True) for p in params], cfg.clip_grad)
        set_lr(optimizer, lr_at(cfg.optim(), step, cfg.steps))
        optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return times, losses


def demo_wall_time(work: Path) -> float:
    """The training/parity commands of the README demo, on a tiny Llama, timed end to end as CLI runs."""
    exe = str(Path(sys.executable).with_name("interop"))
    tiny = SPEC.replace(num_layers=4, hidden=64, ffn_hidden=128, heads=8, kv_groups=4, head_dim=8, vocab=1000,
                        padded_vocab=1024, max_positions=128)
    ckpt = init_checkpoint(tiny, work / "tiny", seed=0)
    common = ["--load", str(ckpt), "--save", str(work / "run"), "--steps", "20", "--global-batch-size", "8",
              "--lr", "3e-3", "--warmup", "2", "--save-interval", "5"]
    commands = [
        [exe, "parity", str(ckpt), "--steps", "10", "--layouts", "1x1,2x1,1x2,2x2", "--frameworks",
         "torch,hf,mindspore", "--plot", str(work / "parity.png")],
        [exe, "train", *common, "--tp", "2", "--pp", "2", "--stop-at", "10"],
        [exe, "train", *common, "--tp", "1", "--pp", "2", "--resume"],
    ]
    t0 = time.perf_counter()
    for cmd in commands:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--demo", action="store_true", help="also time the README demo's training part")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="interop-bench-trainer-"))
    try:
        ckpt = init_checkpoint(SPEC, work / "ckpt", seed=0)
        cfg = TrainConfig(steps=args.steps, micro_batch_size=args.batch, global_batch_size=args.batch,
                          seq_length=args.seq, lr=1e-3, warmup=2, quiet=True)
        tokens_per_step = args.batch * args.seq
        ours, theirs = [], []
        for r in range(args.rounds):
            t, loss_ours = trainer_step_times(ckpt, cfg)
            ours.append(statistics.median(t[args.warmup:]))
            t, loss_hf = hf_step_times(ckpt, cfg, work)
            theirs.append(statistics.median(t[args.warmup:]))
            diff = max(abs(a - b) for a, b in zip(loss_ours, loss_hf))
            print(f"round {r + 1}: trainer {tokens_per_step / ours[-1]:,.0f} tok/s, "
                  f"HF {tokens_per_step / theirs[-1]:,.0f} tok/s, largest loss difference {diff:.1e}", flush=True)
        a, b = tokens_per_step / min(ours), tokens_per_step / min(theirs)
        print(f"model: llama {SPEC.num_layers} layers, hidden {SPEC.hidden}, vocab {SPEC.vocab}; "
              f"batch {args.batch} x seq {args.seq}, fp32, {torch.get_num_threads()} threads")
        print(f"reference trainer (tp 1, pp 1): {a:,.0f} tokens/s")
        print(f"HF transformers:                {b:,.0f} tokens/s")
        print(f"ratio trainer / HF: {a / b:.2f} (target >= 1.0)")
        if args.demo:
            print(f"README demo, training part (parity 4 layouts x torch/hf/mindspore, train, stop, resume): "
                  f"{demo_wall_time(work):.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
