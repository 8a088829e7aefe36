"""Where things live by default: system paths for root, per-user ones otherwise."""
from __future__ import annotations

import os

FSNAME = "cgpu_km"


def _user_runtime(name: str) -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK):
        return os.path.join(runtime, name)
    return f"/tmp/{name}-{os.geteuid()}"


def default_mount() -> str:
    return "/run/cgpu_km" if os.geteuid() == 0 else _user_runtime("cgpu_km")


def default_socket() -> str:
    return "/run/cgpud/cgpud.sock" if os.geteuid() == 0 else _user_runtime("cgpud.sock")


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/cgpud"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "cgpud")


def default_dev_dir() -> str:
    """Where the daemon puts one device file per simulated GPU."""
    return "/run/cgpud/dev" if os.geteuid() == 0 else _user_runtime("cgpud-dev")
