"""`cgpu`: the user's tool."""
from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cgpu")
def main() -> None:
    """cgpu: work with a cgpud node."""
