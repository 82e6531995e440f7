"""The `interop` command: a click group whose commands are thin wrappers over the Python API."""
from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="interop")
@click.option("-v", "--verbose", count=True, help="Tracebacks behind error lines and INFO logging (-vv: DEBUG).")
def main(verbose):
    """Convert checkpoints and configs between Megatron-LM, MindSpore and Hugging Face.

    Shell completion (bash): eval "$(_INTEROP_COMPLETE=bash_source interop)"; zsh_source / fish_source likewise.
    """
    from .common import set_verbose
    set_verbose(verbose)


from .convert import convert, inspect  # noqa: E402

main.add_command(convert)
main.add_command(inspect)

from .verify import verify  # noqa: E402

main.add_command(verify)

from ..workflows.demo import demo  # noqa: E402

main.add_command(demo)

from .map_args import map_args  # noqa: E402

main.add_command(map_args)

from .train import parity, train  # noqa: E402

main.add_command(train)
main.add_command(parity)
