"""Where things live by default: system paths for root, per-user ones otherwise."""
from __future__ import annotations

import os

FSNAME = "cgpu_km"


def default_mount() -> str:
    if os.geteuid() == 0:
        return "/run/cgpu_km"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK):
        return os.path.join(runtime, "cgpu_km")
    return f"/tmp/cgpu_km-{os.geteuid()}"


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/cgpud"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "cgpud")


def default_socket() -> str:
    if os.geteuid() == 0:
        return "/run/cgpud/cgpud.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK):
        return os.path.join(runtime, "cgpud.sock")
    return f"/tmp/cgpud-{os.geteuid()}.sock"
