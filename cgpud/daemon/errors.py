"""The daemon's start-up error, shared by the wiring (daemon.main) and the
services it starts (daemon.services)."""


class StartError(Exception):
    """The daemon cannot start; the message is one line for a person."""
