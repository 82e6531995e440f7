"""`interop train` and `interop parity`: thin wrappers over interop.trainer.launch.train and .parity.parity."""
from __future__ import annotations

import sys

import click

from .common import user_errors

DECAY = click.Choice(["constant", "linear", "cosine"])


def _training_options(fn):
    """The options `train` and `parity` share; all default to None so a --config file's values stand."""
    options = [
        click.option("--config", "config_path", type=click.Path(), help="MindSpeed-Core-MS YAML (as map-args writes) "
                     "or Megatron args file; flags override it."),
        click.option("--steps", type=int, help="Updates in the run (the lr schedule spans them). [10]"),
        click.option("--micro-batch-size", type=int, help="Sequences per micro-batch. [2]"),
        click.option("--global-batch-size", type=int, help="Sequences per update (micro-batches x dp). [mbs x dp]"),
        click.option("--seq-length", type=int, help="Tokens per sequence. [32]"),
        click.option("--data", type=click.Path(), help=".npy or .bin file of token ids (default: synthetic stream)."),
        click.option("--seed", type=int, help="Seed of the synthetic data and of --init-spec weights. [1234]"),
        click.option("--lr", type=float, help="Peak learning rate. [1e-3]"),
        click.option("--min-lr", type=float, help="Learning rate at the end of the decay. [0]"),
        click.option("--warmup", type=int, help="Linear warmup updates. [0]"),
        click.option("--decay-steps", type=int, help="Update at which the decay ends. [--steps]"),
        click.option("--decay-style", type=DECAY, help="constant, linear or cosine. [cosine]"),
        click.option("--weight-decay", type=float, help="AdamW decoupled weight decay (matrices only). [0.01]"),
        click.option("--clip-grad", type=float, help="Global gradient-norm clip, 0 = off. [1.0]"),
        click.option("--mtp-loss-scaling-factor", type=float, help="Weight of the MTP modules' mean loss in the "
                     "objective (0: trained as without them). [the model's, 0.1 by default]"),
        click.option("--adapter", type=click.Path(), help="Train this common-format LoRA adapter (its base is the "
                     "model trained from: --load), the base frozen."),
        click.option("--lora-rank", type=int, help="Train a fresh LoRA adapter of this rank on the frozen base "
                     "(with --lora-alpha and --lora-targets; drawn from --seed)."),
        click.option("--lora-alpha", type=float, help="The fresh adapter's alpha (scaling alpha / rank)."),
        click.option("--lora-targets", help="The modules it adapts: attn.q,attn.k,attn.v,attn.o,mlp.gate,mlp.up,"
                     "mlp.down, or Megatron's linear_qkv,linear_proj,linear_fc1,linear_fc2."),
        click.option("--lora-dropout", type=float, help="Dropout on the adapter's input while training. [0]"),
        click.option("--lora-shared-a/--no-lora-shared-a", default=None, help="q, k, v (and gate, up) share one A, "
                     "as a LoRA on a fused linear has (MindSpeed-LLM's linear_qkv, PEFT on GPT2's c_attn), or have an "
                     "A each. [a resumed or given adapter: as it says; a fresh one: an A each]"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _config(config_path, **flags):
    from ..trainer.config import load_config
    return load_config(config_path, **flags)


def _failed(exc) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@click.command()
@_training_options
@click.option("--load", type=click.Path(), help="Common-format checkpoint to start from.")
@click.option("--init-spec", type=click.Path(), help="Start from fresh random weights for this ModelSpec YAML/JSON.")
@click.option("--save", type=click.Path(), help="Directory for step_NNNNNN/ checkpoints and metrics.jsonl.")
@click.option("--save-interval", type=int, help="Save every N updates (and always at the end).")
@click.option("--resume", is_flag=True, default=None, help="Continue from the newest checkpoint in --save (else --load).")
@click.option("--tp", type=int, help="Tensor-parallel size. [1]")
@click.option("--pp", type=int, help="Pipeline-parallel size. [1]")
@click.option("--dp", type=int, help="Data-parallel size. [ep, or WORLD_SIZE/(tp*pp) under torchrun]")
@click.option("--ep", type=int, help="Expert-parallel size (MoE models): experts split over ep of the dp replicas. [1]")
@click.option("--first-stage-layers", type=int, help="Layers on the first pipeline stage (uneven pipelines).")
@click.option("--last-stage-layers", type=int, help="Layers on the last pipeline stage (uneven pipelines).")
@click.option("--stop-at", type=int, help="Stop after this update (saving first), as if interrupted.")
@click.option("--log-interval", type=int, help="Print a line every N updates. [1]")
@click.option("--bf16", is_flag=True, default=None, help="Compute in bfloat16 (autocast; fp32 weights and Adam).")
@click.option("--plot", type=click.Path(), help="Write a PNG of the loss curve here.")
@user_errors
def train(config_path, plot, **flags):
    """Train with tensor/pipeline/data parallelism on torch.distributed; checkpoints in the common format.

    Launches dp x tp x pp processes itself (gloo on CPU, NCCL on GPU), or runs as one
    rank under torchrun.  One line per update; metrics.jsonl in --save.

    \b
    Example:
      interop train --init-spec spec.yaml --save run --tp 2 --pp 2 --steps 20 --global-batch-size 8 --stop-at 10
      interop train --init-spec spec.yaml --save run --tp 1 --pp 2 --steps 20 --global-batch-size 8 --resume
    """
    from ..trainer.launch import TrainingFailed, train as run_train
    try:
        metrics = run_train(_config(config_path, **flags))
    except TrainingFailed as exc:
        _failed(exc)
    if plot and metrics:
        from ..workflows.parity import plot_training
        click.echo(f"loss curve: {plot_training(metrics, plot)}")


@click.command()
@click.argument("ckpt", type=click.Path())
@_training_options
@click.option("--layouts", default="1x1,2x1,1x2,2x2", show_default=True,
              help="Reference-trainer layouts TPxPP[xDP[xEP]], comma separated (EP: expert parallelism, "
                   "carved out of DP).")
@click.option("--frameworks", default="torch,hf", show_default=True,
              help="Comma separated: torch (the reference trainer at each layout), hf, mindspore, "
                   "megatron (megatron-core, when installed; megatron:epN: a MoE model's experts over N processes).")
@click.option("--tolerance", type=float, default=1e-5, show_default=True, help="Largest allowed loss difference.")
@click.option("--plot", type=click.Path(), help="Write a PNG of the loss curves here.")
@user_errors
def parity(ckpt, config_path, layouts, frameworks, tolerance, plot, **flags):
    """Train the same weights on the same batches at several layouts and in other frameworks; compare losses.

    CKPT is a common-format checkpoint (anything else `interop convert` reads is converted
    first).  Exits 1 when two runs' losses differ by more than --tolerance.

    \b
    Example:
      interop parity ckpt --steps 10 --layouts 1x1,2x1,1x2,2x2 --frameworks torch,hf,mindspore --plot parity.png
    """
    from ..workflows.parity import parity as run_parity, parse_layouts
    cfg = _config(config_path, **flags)
    result = run_parity(ckpt, cfg, parse_layouts(layouts), [f.strip() for f in frameworks.split(",") if f.strip()],
                        tolerance, plot)
    click.echo(result.table())
    if result.plot:
        click.echo(f"loss curves: {result.plot}")
    if not result.ok:
        sys.exit(1)
