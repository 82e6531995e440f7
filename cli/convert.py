"""`interop convert` and `interop inspect`."""
from __future__ import annotations

import json

import click

from ..formats import names as format_names
from .common import ProgressBar, user_errors

# The engine (and torch) is imported inside the commands: `interop --help` starts without it.
FORMAT_CHOICE = click.Choice(format_names())
DTYPE_CHOICES = ("keep", "fp32", "bf16", "fp16")  # interop.convert.DTYPE_CHOICES (a test keeps them equal)


@click.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--from", "src_format", type=FORMAT_CHOICE, help="Source format (detected when omitted).")
@click.option("--to", "dst_format", type=FORMAT_CHOICE, required=True, help="Target format.")
@click.option("--tp", default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", default=1, show_default=True, help="Virtual pipeline chunks per stage.")
@click.option("--ep", default=1, show_default=True, help="Target expert-parallel size (mixture-of-experts models).")
@click.option("--first-stage-layers", type=int, help="Layers on the first pipeline stage (uneven pipelines).")
@click.option("--last-stage-layers", type=int, help="Layers on the last pipeline stage (uneven pipelines).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="keep", show_default=True,
              help="Cast the weights (optimizer state keeps its dtype).")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--format", "megatron_format", type=click.Choice(["torch", "torch_dist"]),
              help="Megatron on-disk format to write (default: torch).")
@click.option("--iteration", type=int, help="Megatron iteration to read (default: the tracker's).")
@click.option("--distributed-optimizer/--no-distributed-optimizer", default=None,
              help="Megatron output: write the optimizer in the distributed optimizer's layout: torch_dist "
              "fully_reshardable (default there: as the source was saved), or the torch format's "
              "distrib_optim.pt laid out for --dp N.")
@click.option("--model-config", type=click.Path(), help="Model description for a checkpoint that carries none "
              "(HF config.json, Megatron args file or MindSpeed YAML).")
@click.option("--dialect", type=click.Choice(["mindspeed", "mindformers", "mindformers-mcore"]),
              help="MindSpore naming dialect (mindformers-mcore: MindFormers' parallel_core models, e.g. qwen3, qwen3_moe).")
@click.option("--qkv-concat", is_flag=True, default=None,
              help="MindFormers: fuse q/k/v into w_qkv and gate/up into w_gate_hidden.")
@click.option("--qkv-layout", type=click.Choice(["grouped", "plain"]),
              help="MindFormers w_qkv / w_gate_hidden: grouped (r1.5.0 and later) or plain (r1.3.x).")
@click.option("--qkv-bias-layout", type=click.Choice(["grouped", "plain"]),
              help="MindFormers w_qkv.bias when it differs from the weights (convert_weight.py: plain).")
@click.option("--src-qkv-layout", type=click.Choice(["grouped", "plain"]),
              help="MindSpore -> MindSpore: the source's w_qkv layout (--qkv-layout is then the output's).")
@click.option("--src-qkv-bias-layout", type=click.Choice(["grouped", "plain"]),
              help="MindSpore -> MindSpore: the source's w_qkv.bias layout.")
@click.option("--dp", type=int, help="MindSpeed: the run's data-parallel size (x context-parallel); numbers rank_N. "
              "Megatron torch format with --distributed-optimizer: the dp distrib_optim.pt is laid out for.")
@click.option("--tokenizer", type=click.Path(), help="HF output: a tokenizer directory, or one "
              "tokenizer file (Megatron's --tokenizer-model sentencepiece model, or a tokenizer.json). "
              "An HF source's own tokenizer is carried without it.")
@click.option("--max-shard-size", help="HF output: largest weight file, e.g. 5GB or 500MB (transformers' style); "
              "sharded output gets model.safetensors.index.json. [5GiB]")
@click.option("--verify", "then_verify", is_flag=True,
              help="Afterwards, run a fixed batch through SRC and DST (as `interop verify`); exit 1 if they differ.")
@click.option("--workers", type=int, help="Processes to split the writing over, by target files (default: the "
              "cores available; jobs under 1 GiB of source per worker, and targets of one file, use one).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@user_errors
def convert(src, dst, src_format, dst_format, tp, pp, vpp, ep, first_stage_layers, last_stage_layers, dtype, force,
            megatron_format, iteration, distributed_optimizer, model_config, dialect, qkv_concat, qkv_layout,
            qkv_bias_layout, src_qkv_layout, src_qkv_bias_layout, dp, tokenizer, max_shard_size, then_verify, workers,
            quiet):
    """Convert checkpoint SRC into DST, resharding to --tp/--pp on the way.

    \b
    Example:
      interop convert ./llama-hf ./llama-tp2pp2 --from hf --to interop --tp 2 --pp 2
      interop convert ./llama-tp2pp2 ./llama-hf-again --to hf
    """
    from ..convert import convert as run_convert
    bar = ProgressBar("converting", enabled=not quiet)
    try:
        summary = run_convert(src, dst, src_format=src_format, dst_format=dst_format, tp=tp, pp=pp, vpp=vpp, ep=ep,
                              first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                              dtype=dtype, force=force, progress=bar, workers=workers,
                              options={"format": megatron_format, "iteration": iteration,
                                       "distributed_optimizer": distributed_optimizer,
                                       "model_config": model_config, "dialect": dialect,
                                       "qkv_concat": qkv_concat, "qkv_layout": qkv_layout,
                                       "qkv_bias_layout": qkv_bias_layout, "src_qkv_layout": src_qkv_layout,
                                       "src_qkv_bias_layout": src_qkv_bias_layout, "dp": dp, "tokenizer": tokenizer,
                                       "max_shard_size": max_shard_size})
    finally:
        bar.close()
    click.echo("\n".join(summary.lines()))
    if then_verify:
        from ..workflows.verify import verify
        from .verify import report
        report(verify(src, dst, src_format=summary.src_format, dst_format=dst_format, model_config=model_config,
                      iteration=iteration))


@click.command()
@click.argument("path", type=click.Path())
@click.option("--from", "fmt", type=FORMAT_CHOICE, help="Format (detected when omitted).")
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@click.option("--no-tensors", is_flag=True, help="Leave out the per-tensor table.")
@click.option("--native", is_flag=True, help="Show each tensor's name in the checkpoint's own format next to "
              "its canonical name.")
@click.option("--model-config", type=click.Path(), help="Model description for a checkpoint that carries none "
              "(HF config.json, Megatron args file or MindSpeed YAML).")
@click.option("--iteration", type=int, help="Megatron iteration to describe (default: the tracker's).")
@user_errors
def inspect(path, fmt, as_json, no_tensors, native, model_config, iteration):
    """Describe a checkpoint: format, model, layout, tensors and totals.

    \b
    Example:
      interop inspect ./llama-tp2pp2
    """
    from ..describe import describe, render
    info = describe(path, fmt, native=native, model_config=model_config, iteration=iteration)
    click.echo(json.dumps(info.to_dict(), indent=1) if as_json
               else render(info, show_tensors=not no_tensors, native=native))
