"""`interop verify SRC DST`: a thin click layer over `interop.workflows.verify.verify`."""
from __future__ import annotations

import sys

import click

from ..formats import names as format_names
from .common import user_errors

FORMAT_CHOICE = click.Choice(format_names())


def report(result, kept: str | None = None) -> None:
    """Print a verification's lines; exit 1 when it failed (`kept`: the conversion's output, which stays)."""
    click.echo("\n".join(result.lines()))
    if not result.ok:
        if kept:
            click.echo(f"error: verification failed; the converted output is kept at {kept} "
                       "(delete it, or convert again with --force)", err=True)
        sys.exit(1)


def progress_line(line: str) -> None:
    """A stage of the verification, on stderr as soon as it ends (stdout keeps the result)."""
    click.echo(line, err=True)
    sys.stderr.flush()


@click.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--from", "src_format", type=FORMAT_CHOICE, help="Format of SRC (detected when omitted).")
@click.option("--dst-from", "dst_format", type=FORMAT_CHOICE, help="Format of DST (detected when omitted).")
@click.option("--model-config", type=click.Path(), help="Model description for a SRC that carries none.")
@click.option("--dst-model-config", type=click.Path(), help="Model description for a DST that carries none "
              "(e.g. MindSpeed rank_N/ files).")
@click.option("--iteration", type=int, help="Megatron iteration of SRC to read (default: the tracker's).")
@click.option("--tolerance", type=float, help="Largest allowed |logit difference| [1e-5; after a cast to fp16 1e-2, to bf16 5e-2].")
@click.option("--reference-only", is_flag=True, help="Skip the checkpoints' own frameworks (transformers, "
              "mindspore, megatron-core); run the reference model only.")
@click.option("--adapter", type=click.Path(), help="A LoRA adapter on SRC: DST must hold SRC + adapter (a merge).")
@user_errors
def verify(src, dst, src_format, dst_format, model_config, dst_model_config, iteration, tolerance, reference_only,
           adapter):
    """Prove DST holds the model SRC holds: their weights compared tensor by tensor (bit-identical where the
    dtype is the same), then one fixed batch through both, in the reference model and in each checkpoint's
    own framework where installed.  Prints the losses and the largest logit difference (the stages, with
    their times, on stderr); exits 1 when a weight differs or a difference is over the tolerance.

    \b
    Example:
      interop verify ./llama-hf ./llama-ms
      interop convert ./llama-hf ./llama-ms --to mindspore --tp 2 --verify   # the same, after converting
      interop verify ./llama-hf ./llama-merged --adapter ./lora-peft         # DST = SRC + adapter
    """
    from ..workflows.verify import verify as run_verify
    report(run_verify(src, dst, src_format=src_format, dst_format=dst_format, tolerance=tolerance,
                      frameworks=not reference_only, dst_model_config=dst_model_config, model_config=model_config,
                      iteration=iteration, log=progress_line, adapter=adapter))
