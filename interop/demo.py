"""The README demo on tiny models: convert, reshard, convert back, and prove nothing changed.

Run with `interop demo` (or `python -m interop.demo`).  Builds its own tiny HF Llama
(GQA, untied), so nothing is downloaded.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import click
import torch

from .convert import convert
from .inspect import describe, render
from .io.safetensors import SafetensorsFile


def quiet_transformers():
    import transformers  # a verification extra: the converters themselves never need it

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def build_tiny_llama(path: Path, seed: int = 0) -> None:
    transformers = quiet_transformers()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=4, intermediate_size=128, vocab_size=1000,
                                      max_position_embeddings=128, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def same_tensors(a: Path, b: Path) -> tuple[int, list[str]]:
    """(tensors compared, names that differ) between two HF model.safetensors files."""
    x, y = SafetensorsFile(a / "model.safetensors"), SafetensorsFile(b / "model.safetensors")
    differ = sorted(set(x.keys()) ^ set(y.keys()))
    differ += [k for k in sorted(set(x.keys()) & set(y.keys())) if not torch.equal(x.read(k), y.read(k))]
    return len(x.keys()), differ


def logits_match(a: Path, b: Path) -> float:
    transformers = quiet_transformers()

    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    outs = []
    for path in (a, b):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            outs.append(model(tokens).logits)
    return float((outs[0] - outs[1]).abs().max())


def run_demo(workdir: Path, echo=click.echo) -> bool:
    hf = workdir / "llama-hf"
    common = workdir / "llama-interop-tp2pp2"
    back = workdir / "llama-hf-again"
    echo(f"== 1. a tiny HF Llama (GQA 8 heads / 4 groups, untied) in {hf}")
    build_tiny_llama(hf)
    echo("== 2. HF -> common format at tp 2 / pp 2")
    echo("\n".join(convert(hf, common, dst_format="interop", tp=2, pp=2, force=True).lines()))
    echo(render(describe(common), show_tensors=False))
    echo("== 3. common format -> HF")
    echo("\n".join(convert(common, back, dst_format="hf", force=True).lines()))
    count, differ = same_tensors(hf, back)
    max_diff = logits_match(hf, back)
    ok = not differ and max_diff == 0.0
    echo(f"== result: {count} tensors compared, {len(differ)} differ; max |logit difference| = {max_diff:g}"
         f" -> {'IDENTICAL' if ok else 'MISMATCH'}")
    return ok


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to leave the demo's checkpoints (default: a temporary directory, removed after).")
def demo(workdir):
    """Run the end-to-end demo on tiny models.

    \b
    Example:
      interop demo --workdir ./demo-out
    """
    keep = workdir is not None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="interop-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        ok = run_demo(workdir)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    demo()
