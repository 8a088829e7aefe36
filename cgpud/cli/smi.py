"""`cgpu-smi`: per GPU and per instance, what is given and what is used."""
from __future__ import annotations

import click

from .. import __version__


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cgpu-smi")
def main() -> None:
    """Show the GPUs of this node and their instances."""
