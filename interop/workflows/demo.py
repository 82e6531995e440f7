"""The README demo on tiny models, end to end:

  HF Llama -> Megatron tp 2 / pp 2 -> MindSpore tp 4 -> common format (and back to HF, identical)
  -> parity across layouts and frameworks -> train, stop, resume at another layout -> the curve continues.

Run with `interop demo [--workdir DIR]`.  Builds its own tiny HF Llama (GQA, untied), so
nothing is downloaded.  Each step prints the command a user would type for it.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import click

# torch and the engine are imported where tensors are touched: `interop --help` needs neither.

# vocab 1024 has no Megatron padding at tp <= 8, so megatron-core can join parity
# (it counts padded vocabulary entries in its loss).
TINY_LLAMA = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                  intermediate_size=128, vocab_size=1024, max_position_embeddings=128, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0)


def quiet_transformers():
    import transformers  # a verification extra: the converters themselves never need it

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def build_tiny_llama(path: Path, seed: int = 0) -> None:
    import torch
    transformers = quiet_transformers()
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).save_pretrained(path)


def same_tensors(a: Path, b: Path) -> tuple[int, list[str]]:
    """(tensors compared, names that differ) between two HF model.safetensors files."""
    import torch
    from ..io.safetensors import SafetensorsFile
    x, y = SafetensorsFile(a / "model.safetensors"), SafetensorsFile(b / "model.safetensors")
    differ = sorted(set(x.keys()) ^ set(y.keys()))
    differ += [k for k in sorted(set(x.keys()) & set(y.keys())) if not torch.equal(x.read(k), y.read(k))]
    return len(x.keys()), differ


def logits_difference(a: Path, b: Path) -> float:
    import torch
    transformers = quiet_transformers()
    tokens = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    outs = []
    for path in (a, b):
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            outs.append(model(tokens).logits)
    return float((outs[0] - outs[1]).abs().max())


def interop_cli(*args, echo=click.echo, cwd: Path | None = None) -> None:
    """Run one `interop` command in a child process (training spawns its own ranks), echoing it.
    With `cwd`, paths under it are given relative to it, as a user working there would type them."""
    shown = [_relative(a, cwd) for a in args]
    echo("$ interop " + " ".join(shown))
    proc = subprocess.run([sys.executable, "-m", "interop", *shown], text=True, cwd=cwd)
    if proc.returncode:
        raise click.ClickException(f"`interop {args[0]}` failed with exit code {proc.returncode}")


def _relative(arg, cwd: Path | None) -> str:
    if cwd is not None and isinstance(arg, Path) and arg.is_relative_to(cwd):
        return str(arg.relative_to(cwd))
    return str(arg)


def step(echo, title: str, summary=None, work: Path | None = None) -> None:
    echo(f"\n== {title}")
    if summary is not None:
        lines = summary.lines()
        if work is not None:  # paths as seen from the work directory (it may be deleted afterwards)
            lines = [line.replace(f"{work}/", "") for line in lines]
        echo("\n".join(lines))


def run_demo(work: Path, echo=click.echo, keep: bool = True) -> bool:
    """The demo in `work`; `keep=False` (--clean): the directory goes afterwards, so no path in it is printed."""
    from ..convert import convert
    hf, megatron, mindspore = work / "llama-hf", work / "megatron-tp2pp2", work / "mindspore-tp4"
    common, back = work / "common", work / "llama-hf-again"
    step(echo, "1. a tiny HF Llama (GQA 8 heads / 4 groups, untied, vocab 1024)" + (f" in {hf}" if keep else ""))
    build_tiny_llama(hf)
    step(echo, "2. interop convert llama-hf megatron-tp2pp2 --to megatron --tp 2 --pp 2",
         convert(hf, megatron, dst_format="megatron", tp=2, pp=2, force=True), work)
    step(echo, "3. interop convert megatron-tp2pp2 mindspore-tp4 --from megatron --to mindspore --tp 4",
         convert(megatron, mindspore, src_format="megatron", dst_format="mindspore", tp=4, force=True), work)
    step(echo, "4. interop convert mindspore-tp4 common --to interop",
         convert(mindspore, common, dst_format="interop", force=True), work)
    step(echo, "5. interop convert common llama-hf-again --to hf  (proof: nothing changed on the way)",
         convert(common, back, dst_format="hf", force=True), work)
    count, differ = same_tensors(hf, back)
    logits = logits_difference(hf, back)
    identical = not differ and logits == 0.0
    echo(f"   {count} tensors compared, {len(differ)} differ; max |logit difference| = {logits:g}"
         f" -> {'IDENTICAL' if identical else 'MISMATCH'}")

    frameworks = "torch,hf,mindspore" + (",megatron" if importlib.util.find_spec("megatron.core") else "")
    step(echo, "6. parity: the same weights and batches at four layouts and in other frameworks")
    interop_cli("parity", common, "--steps", 10, "--layouts", "1x1,2x1,1x2,2x2", "--frameworks", frameworks,
                "--plot", work / "parity.png", echo=echo, cwd=work)

    step(echo, "7. train 30 steps at tp 2 / pp 2, stop at step 15, resume at tp 1 / pp 2")
    common_args = ["--load", common, "--steps", 30, "--global-batch-size", 8, "--lr", "1e-2", "--warmup", 3,
                   "--save-interval", 5, "--log-interval", 5]
    interop_cli("train", *common_args, "--save", work / "run", "--tp", 2, "--pp", 2, "--stop-at", 15, echo=echo, cwd=work)
    interop_cli("train", *common_args, "--save", work / "run", "--tp", 1, "--pp", 2, "--resume", echo=echo, cwd=work)
    interop_cli("train", *common_args, "--save", work / "straight", "--tp", 2, "--pp", 2, echo=echo, cwd=work)
    from .metrics import compare_runs

    result = compare_runs({"uninterrupted 2x2": work / "straight", "stop 15, resume 1x2": work / "run"},
                          plot=work / "resume.png",
                          marks={15: "stopped after step 15 (tp 2 / pp 2)", 15.5: "resumed at step 16 (tp 1 / pp 2)"})
    echo(result.table())
    plots = f"plots: {work / 'parity.png'}, {work / 'resume.png'}" if keep else "outputs removed (--clean)"
    echo(f"\n== done: round trip {'identical' if identical else 'MISMATCH'}; resumed curve "
         f"{'continues' if result.ok else 'DIVERGES'} (largest difference {result.max_diff:.1e}); {plots}")
    return identical and result.ok


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to leave the demo's checkpoints and plots (default: ./demo-out).")
@click.option("--clean", is_flag=True, help="Remove the work directory afterwards.")
def demo(workdir, clean):
    """Run the end-to-end demo on tiny models (a few minutes on 2 CPU cores).

    \b
    Example:
      interop demo --workdir ./demo-out
    """
    workdir = workdir or Path("demo-out")
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    try:
        ok = run_demo(workdir, keep=not clean)
    finally:
        if clean:
            shutil.rmtree(workdir, ignore_errors=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    demo()
