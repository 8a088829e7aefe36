"""What `cgpu-runtime` asks the daemon to do to a container's OCI spec before
the real runtime creates it (docs/containers.md, "Docker and containerd").
Pure and synchronous: a spec (config.json as a dict) in, the changed spec out.

As NVIDIA's container runtime does it, the work is a chain of small
modifiers, each one job, each idempotent (a spec prepared twice is the same
as once):

- `add_hooks`: cgpud's OCI hook at createRuntime (join) and poststop (leave),
  with the daemon's socket in its environment: the container then joins
  exactly as one started by runc or podman with hooks.d does.

The in-container library (issue 12) will be one more modifier here: its
mounts and environment.

`Hooks` says where the hook is and which socket it talks to; the daemon's
`--hook-path` and `--socket` (docs/containers.md).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

DEFAULT_HOOK_PATH = "/usr/local/libexec/cgpu-hook"  # where scripts/install-service.sh puts it, as hooks.d names it
HOOK_STAGES = ("createRuntime", "poststop")


class SpecError(ValueError):
    """The spec cannot be prepared; str() is one line."""


@dataclass(frozen=True)
class Hooks:
    path: str = DEFAULT_HOOK_PATH
    socket: str | None = None  # the daemon's control socket, for the hook's environment


def _entry(hooks: Hooks, stage: str) -> dict:
    entry: dict = {"path": hooks.path, "args": ["cgpu-hook", stage], "timeout": 10}
    if hooks.socket:
        entry["env"] = [f"CGPUD_SOCKET={hooks.socket}"]
    return entry


def add_hooks(spec: dict, hooks: Hooks) -> dict:
    """cgpud's hook at createRuntime and poststop, unless an entry with the same
    path and stage is there already. Other hooks stay as they are, in order."""
    have = spec.get("hooks")
    if have is None:
        have = {}
    if not isinstance(have, dict):
        raise SpecError('config.json\'s "hooks" is not an object')
    out = dict(spec)
    out["hooks"] = dict(have)
    for stage in HOOK_STAGES:
        entries = have.get(stage, [])
        if not isinstance(entries, list):
            raise SpecError(f'config.json\'s hooks.{stage} is not a list')
        mine = any(isinstance(e, dict) and e.get("path") == hooks.path and stage in (e.get("args") or [])
                   for e in entries)
        out["hooks"][stage] = list(entries) if mine else [*entries, _entry(hooks, stage)]
    return out


MODIFIERS = (add_hooks,)


def prepare(spec: dict, hooks: Hooks) -> dict:
    """The spec with every modifier applied (a deep copy: `spec` is untouched)."""
    if not isinstance(spec, dict):
        raise SpecError("config.json is not a JSON object")
    out = copy.deepcopy(spec)
    for modify in MODIFIERS:
        out = modify(out, hooks)
    return out
