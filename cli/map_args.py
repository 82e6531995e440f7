"""`interop map-args`: a thin click layer over `interop.mapargs.map_args`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import InteropError
from ..mapargs import DEFAULT_TARGET, TARGETS, map_args as _map_args

GROUP_SHOWN = 4  # flags named on a group's count line

EXAMPLE = """
\b
Example:
  interop map-args train_llama2.sh --to mindspeed -o llama2.yaml --report lost.json
  interop map-args train.sh --to hf -e NUM_NODES=4 -e 1=/ckpt
  interop map-args llama2.yaml --to megatron       # read a written file back
  interop map-args pretrain_gpt_7B.yaml --set seq_length=4096 --set vocab_size=32000
"""


def _env(pairs, option: str = "-e") -> dict:
    env = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise InteropError(f"{option} {pair!r}: expected KEY=VALUE")
        env[name] = value
    return env


@click.command("map-args", epilog=EXAMPLE)
@click.argument("args_file", type=click.Path(path_type=Path))
@click.option("--to", "to", type=click.Choice(TARGETS), default=None,
              help=f"Target format (default: {DEFAULT_TARGET}, MindSpeed-Core-MS YAML).")
@click.option("--from", "fmt", default="auto", show_default=True,
              help="Source format (auto: told from the content): megatron (script / args file), "
                   "megatron-checkpoint, a --to format, mindspeed-nested (the `llm:` YAML) or atorch (strategy .py).")
@click.option("-e", "env", multiple=True, metavar="KEY=VALUE",
              help="Set a shell variable the file uses (wins over the file's own assignment).")
@click.option("--set", "values", multiple=True, metavar="NAME=VALUE",
              help="Give a Megatron value the file lacks or override one (e.g. --set seq_length=4096).")
@click.option("-o", "output", type=click.Path(path_type=Path), help="Write here instead of stdout.")
@click.option("--report", type=click.Path(path_type=Path), help="Write the unmapped items as JSON here.")
@click.option("--strict", is_flag=True, help="Exit 2 if any given value does not map.")
def map_args(args_file, to, fmt, env, values, output, report, strict):
    """Map a training configuration (a Megatron / MindSpeed-LLM launch script or args file, a checkpoint
    directory, a MindSpeed / MindFormers YAML, a config.json, a ColossalAI or DeepSpeed config, or a file
    this command wrote) to another framework's config, and say what did not map."""
    try:
        if to is None:
            to = DEFAULT_TARGET
            click.echo(f"target: {to} (default; --to to choose)", err=True)
        result = _map_args(args_file, to, env=_env(env), fmt=fmt, strict=strict, values=_env(values, "--set"))
        groups: dict = {}
        for entry in result.entries:
            if entry.group:
                groups.setdefault(entry.group, []).append(entry.flag)
                continue
            tag = "unmapped" if entry.lost else "note"
            value = "" if entry.value is None else f"={entry.value!r}"
            click.echo(f"{tag}: {entry.flag}{value}: {entry.why}", err=True)
        for group, flags in groups.items():  # one count: the list is in the report
            shown = ", ".join(flags[:GROUP_SHOWN]) + (", ..." if len(flags) > GROUP_SHOWN else "")
            where = f"the list: {report}" if report else "the list: --report FILE"
            click.echo(f"unmapped: {len(flags)} {group}: {shown} ({where})", err=True)
        for warning in result.warnings:
            click.echo(f"warning: {warning}", err=True)
        if report:
            _write(report, json.dumps(result.report(), indent=2, default=str) + "\n")
        if output:
            _write(output, result.text)
        else:
            click.echo(result.text, nl=False)
    except InteropError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InteropError(f"{path}: cannot write ({exc.strerror or exc})") from None
