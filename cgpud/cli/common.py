"""What the `cgpu` commands share: the context with the daemon's socket."""
from __future__ import annotations

import click

from cgpud.client import Client, DaemonUnavailable


class Ctx:
    def __init__(self, socket: str | None) -> None:
        self.socket = socket

    def client(self) -> Client:
        try:
            return Client(self.socket)
        except DaemonUnavailable as exc:
            raise click.ClickException(str(exc)) from None


pass_ctx = click.make_pass_decorator(Ctx)
