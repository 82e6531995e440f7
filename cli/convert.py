"""`interop convert` and `interop inspect`."""
from __future__ import annotations

import json
import sys

import click

from ..formats import names as format_names
from ..formats import target_names
from ..formats import options as declared_options
from .common import VERBOSE, ProgressBar, user_errors

# The engine (and torch) is imported inside the commands: `interop --help` starts without it.
FORMAT_CHOICE = click.Choice(format_names())
# --to offers only the formats interop writes; naming a source-only one (deepspeed) still gets its one error line
TARGETS_METAVAR = f"[{'|'.join(target_names())}]"
DTYPE_CHOICES = ("keep", "fp32", "bf16", "fp16", "fp8")  # interop.convert.DTYPE_CHOICES (a test keeps them equal)
CLICK_TYPES = {"int": int, "path": click.Path()}


def format_options(command: str):
    """The click options of each format's own options (`--dialect`, `--tokenizer`, ...), as the formats
    declare them (`interop.formats.options`); the command gets them as keywords, None when not given."""
    def decorate(fn):
        for option in reversed(declared_options(command)):
            help_text = option.helps[command]
            if option.kind == "switch":
                flags = [f"{option.flag}/--no-{option.flag[2:]}", option.name]
                fn = click.option(*flags, default=None, help=help_text)(fn)
            elif option.kind == "flag":
                fn = click.option(option.flag, option.name, is_flag=True, default=None, help=help_text)(fn)
            else:
                kind = click.Choice(option.choices) if option.choices else CLICK_TYPES.get(option.kind, str)
                fn = click.option(option.flag, option.name, type=kind, help=help_text)(fn)
        return fn
    return decorate


@click.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--from", "src_format", type=FORMAT_CHOICE, help="Source format (detected when omitted).")
@click.option("--to", "dst_format", type=FORMAT_CHOICE, metavar=TARGETS_METAVAR, required=True, help="Target format.")
@click.option("--tp", default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", default=1, show_default=True, help="Virtual pipeline chunks per stage.")
@click.option("--ep", default=1, show_default=True, help="Target expert-parallel size (mixture-of-experts models).")
@click.option("--etp", type=int, default=None, help="Target expert tensor-parallel size (default: --tp, as megatron-core's).")
@click.option("--first-stage-layers", type=int, help="Layers on the first pipeline stage (uneven pipelines).")
@click.option("--last-stage-layers", type=int, help="Layers on the last pipeline stage (uneven pipelines).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="keep", show_default=True,
              help="Cast the weights (optimizer state keeps its dtype); fp8: block-scaled FP8 projections (hf).")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--base", type=click.Path(), help="A LoRA adapter source's base model checkpoint (a PEFT adapter "
              "needs it; default: the base the adapter names, when that is a folder here).")
@click.option("--adapter", type=click.Path(), help="A LoRA adapter (PEFT folder or interop adapter) to merge into "
              "SRC's weights (with --merge).")
@click.option("--merge", is_flag=True, help="Write SRC with --adapter merged in: W + alpha/r B A in fp32, cast once.")
@click.option("--lora-stack-ranks", is_flag=True, help="A LoRA adapter SRC rewritten exactly with one A for q, k, v "
              "(gate, up) at a higher rank, for targets that fuse them (Megatron's linear_qkv).")
@format_options("convert")
@click.option("--verify", "then_verify", is_flag=True,
              help="Afterwards, run a fixed batch through SRC and DST (as `interop verify`); exit 1 if they differ.")
@click.option("--workers", type=int, help="Processes to split the writing over, by target files (default: the "
              "cores available; jobs under 1 GiB of source per worker, and targets of one file, use one).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@user_errors
def convert(src, dst, src_format, dst_format, tp, pp, vpp, ep, etp, first_stage_layers, last_stage_layers, dtype, force,
            base, adapter, merge, lora_stack_ranks, then_verify, workers, quiet, **options):
    """Convert checkpoint SRC into DST, resharding to --tp/--pp on the way.

    The options from --tokenizer to --src-qkv-bias-layout are the formats' own (each format declares
    them): one applies where its format is the source or the target, and is refused elsewhere.

    \b
    Example:
      interop convert ./llama-hf ./llama-tp2pp2 --from hf --to interop --tp 2 --pp 2
      interop convert ./llama-tp2pp2 ./llama-hf-again --to hf
      interop convert ./llama-hf ./llama-mf --to mindspore --dialect mindformers --qkv-concat
      interop convert ./lora-peft ./lora-tp2 --base ./llama-hf --to interop --tp 2
      interop convert ./llama-hf ./llama-merged --adapter ./lora-peft --merge --to hf
    """
    from ..convert import convert as run_convert
    bar = ProgressBar("converting", enabled=not quiet)
    try:
        summary = run_convert(src, dst, src_format=src_format, dst_format=dst_format, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                              first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                              dtype=dtype, force=force, progress=bar, workers=workers, base=base, adapter=adapter,
                              merge=merge, lora_stack_ranks=lora_stack_ranks, options=options)
    finally:
        bar.close()
    click.echo("\n".join(summary.lines(verbose=VERBOSE["level"] > 0)))
    if then_verify and summary.rank == 0:  # under torchrun rank 0 verifies the job's output, once
        from ..errors import InteropError
        from ..workflows.verify import verify
        from .verify import progress_line, report
        try:
            result = verify(src, dst, src_format=summary.src_format, dst_format=dst_format,
                            model_config=options.get("model_config"), iteration=options.get("iteration"),
                            log=progress_line, adapter=adapter if merge else None)
        except InteropError as exc:  # the conversion is done and stays; its check failed: exit 1, as a FAIL does
            click.echo(f"error: verification failed: {exc}; the converted output is kept at {dst} "
                       "(delete it, or convert again with --force)", err=True)
            sys.exit(1)
        report(result, kept=str(dst))


@click.command()
@click.argument("path", type=click.Path())
@click.option("--from", "fmt", type=FORMAT_CHOICE, help="Format (detected when omitted).")
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@click.option("--no-tensors", is_flag=True, help="Leave out the per-tensor table.")
@click.option("--native", is_flag=True, help="Show each tensor's name in the checkpoint's own format next to "
              "its canonical name.")
@click.option("--base", type=click.Path(), help="A PEFT adapter's base model checkpoint (default: the base the "
              "adapter names, when that is a folder here).")
@format_options("inspect")
@user_errors
def inspect(path, fmt, as_json, no_tensors, native, base, **options):
    """Describe a checkpoint: format, model, layout, tensors and totals.

    \b
    Example:
      interop inspect ./llama-tp2pp2
    """
    from ..describe import describe, render
    info = describe(path, fmt, native=native, base=base, **options)
    click.echo(json.dumps(info.to_dict(), indent=1) if as_json
               else render(info, show_tensors=not no_tensors, native=native))
