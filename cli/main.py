"""The `interop` command: a click group whose commands are thin wrappers over the Python API."""
from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="interop")
def main():
    """Convert checkpoints and configs between Megatron-LM, MindSpore and Hugging Face."""


from .convert import convert, inspect  # noqa: E402

main.add_command(convert)
main.add_command(inspect)

from .verify import verify  # noqa: E402

main.add_command(verify)

from ..demo import demo  # noqa: E402

main.add_command(demo)

from .map_args import map_args  # noqa: E402

main.add_command(map_args)

from .train import parity, train  # noqa: E402

main.add_command(train)
main.add_command(parity)
