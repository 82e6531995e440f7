"""Make tests/fixtures/deepspeed_zero/: HF-Trainer-style DeepSpeed ZeRO 1/2/3 checkpoints, fp32 and bf16.

Run (each variant: 2 CPU processes over gloo; deepspeed 0.19.8, transformers, DS_ACCELERATOR=cpu):

    DS_ACCELERATOR=cpu .venv/bin/python scripts/make_zero_trainer_fixtures.py tests/fixtures/deepspeed_zero

A tiny HF Llama (vocab 250, hidden 32, 4 heads over 2 KV groups, 2 layers, ffn 64) trained 2 steps by
DeepSpeed's own engine at data parallelism 2, saved as the HF Trainer saves a DeepSpeed run
(transformers/trainer.py `_save_checkpoint`: `model_wrapped.save_checkpoint(checkpoint-N)`, then
`save_model`: config.json and, at ZeRO 1/2, the module's `model.safetensors`; at ZeRO 3 with the default
`stage3_gather_16bit_weights_on_model_save=false`, no weights file).  The Trainer itself does not start on a
CPU-only machine with DeepSpeed (accelerate counts one process), so this script drives the engine the way
the Trainer does (its two parameter groups: weight decay on matrices only); the files are the engine's own.  Variants: stage 1/2/3 x fp32/bf16, tied and untied.

Each variant's `expected.pt` holds DeepSpeed's own consolidation (`get_fp32_state_dict_from_zero_checkpoint`,
what `zero_to_fp32.py` writes), and the ZeRO-2 fp32 variant records the losses of DeepSpeed's own resumed run
(load_checkpoint, then steps 3 and 4) in `resume.json`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {"z1_fp32": (1, "fp32", False), "z2_fp32": (2, "fp32", True), "z3_fp32": (3, "fp32", False),
            "z1_bf16": (1, "bf16", True), "z2_bf16": (2, "bf16", False), "z3_bf16": (3, "bf16", True)}
TAG_STEP = 2


def batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 + step * 2 + rank)
    return torch.randint(0, 250, (2, 16), generator=g)


def ds_config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.01, "torch_adam": True}}}


def engine_for(stage: int, dtype: str, tied: bool):
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, torch_dtype="bfloat16" if dtype == "bf16" else "float32")
    model = LlamaForCausalLM(cfg)
    # the HF Trainer's two groups (trainer.py get_decay_parameter_names: no decay for biases and norm weights)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(stage, dtype))
    return cfg, engine


def worker(name: str, out: Path) -> None:
    import deepspeed
    import torch
    stage, dtype, tied = VARIANTS[name]
    deepspeed.init_distributed("gloo")
    rank = int(os.environ["RANK"])
    cfg, engine = engine_for(stage, dtype, tied)
    for step in range(TAG_STEP):
        ids = batch(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    folder = out / f"checkpoint-{TAG_STEP}"
    engine.save_checkpoint(str(folder))
    if stage < 3:  # Trainer.save_model: save_pretrained of the gathered state (ZeRO 1/2 hold whole weights)
        state = engine.module.state_dict()
        if rank == 0:
            engine.module.save_pretrained(str(folder), state_dict=state)
    elif rank == 0:
        cfg.save_pretrained(str(folder))
    torch.distributed.barrier()
    if name == "z2_fp32":  # DeepSpeed's own resumed run: a fresh engine loads the checkpoint and goes on
        _, again = engine_for(stage, dtype, tied)
        again.load_checkpoint(str(folder))
        losses = []
        for step in (TAG_STEP, TAG_STEP + 1):
            ids = batch(step, rank)
            loss = again(input_ids=ids, labels=ids).loss
            again.backward(loss)
            again.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / 2)
        if rank == 0:
            (out / "resume.json").write_text(json.dumps({"steps": [TAG_STEP + 1, TAG_STEP + 2], "mean_loss": losses,
                                                         "batches": "batch(step, rank) in this script"}) + "\n")


def main(root: Path) -> None:
    import deepspeed
    import torch
    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for port, name in enumerate(VARIANTS):
        out = root / name
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(29650 + port), __file__, "--worker", name, str(out)], check=True, env=env)
        expected = get_fp32_state_dict_from_zero_checkpoint(str(out / f"checkpoint-{TAG_STEP}"))
        torch.save({k: v.clone() for k, v in expected.items()}, out / "expected.pt")
        for junk in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copied scripts: not data
            (out / f"checkpoint-{TAG_STEP}" / junk).unlink(missing_ok=True)
    (root / "PROVENANCE").write_text(
        f"tool: deepspeed {deepspeed.__version__} (DS_ACCELERATOR=cpu, gloo, 2 processes), transformers "
        f"{transformers.__version__}, torch {torch.__version__}\n"
        f"command: DS_ACCELERATOR=cpu .venv/bin/python scripts/make_zero_trainer_fixtures.py {root}\n"
        "expected.pt: deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint-2)\n"
        "variants: " + ", ".join(f"{n}: stage {s} {d} {'tied' if t else 'untied'}" for n, (s, d, t) in VARIANTS.items())
        + "\nremoved: the zero_to_fp32.py / zero_to_torch.py copies DeepSpeed puts beside the checkpoint\n")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
    else:
        main(Path(sys.argv[1]))
