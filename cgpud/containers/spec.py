"""What `cgpu-runtime` asks the daemon to do to a container's OCI spec before
the real runtime creates it (docs/containers.md, "Docker and containerd").
Pure and synchronous: a spec (config.json as a dict) in, the changed spec out.

As NVIDIA's container runtime does it, the work is a chain of small
modifiers, each one job, each idempotent (a spec prepared twice is the same
as once):

- `add_hooks`: cgpud's OCI hook at createRuntime (join) and poststop (leave),
  with the daemon's socket in its environment: the container then joins
  exactly as one started by runc or podman with hooks.d does.

- `add_library`: the in-container library (docs/isolation.md) and the
  container's pages: the library read-only at LIB_IN_CONTAINER, preloaded
  (LD_PRELOAD), the pages' directory at PAGES_IN_CONTAINER with its `limits`
  file mounted again read-only over it (only `usage` is writable), a file
  naming the library over /etc/ld.so.preload (a process that clears its
  environment loads it still, and finds the pages where they always are), and
  CGPU_PAGE_DIR naming them — only when the daemon has a library to give.

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


DEFAULT_LIBCGPU = "/usr/local/lib/cgpu/libcgpu.so"  # where make install-hooks puts it
LIB_IN_CONTAINER = "/run/cgpu-lib/libcgpu.so"  # (under /run: a mount point any image can take)
PAGES_IN_CONTAINER = "/run/cgpu"
PRELOAD = "/etc/ld.so.preload"  # naming the library: loaded also into processes that clear their environment


@dataclass(frozen=True)
class Hooks:
    path: str = DEFAULT_HOOK_PATH
    socket: str | None = None  # the daemon's control socket, for the hook's environment
    library: str | None = None  # libcgpu.so on the host (None: no in-container library)
    pages: str | None = None  # this container's pages directory on the host


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


def _env_set(env: list, name: str, value: str) -> list:
    return [e for e in env if not (isinstance(e, str) and e.startswith(name + "="))] + [f"{name}={value}"]


def add_library(spec: dict, hooks: Hooks) -> dict:
    """libcgpu and the container's pages, when the daemon has them; once."""
    if not hooks.library or not hooks.pages:
        return spec
    out = dict(spec)
    mounts = [m for m in spec.get("mounts") or [] if not (isinstance(m, dict) and m.get("destination") in
                                                          (LIB_IN_CONTAINER, PAGES_IN_CONTAINER,
                                                           PAGES_IN_CONTAINER + "/limits", PRELOAD))]
    out["mounts"] = mounts + [
        {"destination": LIB_IN_CONTAINER, "type": "bind", "source": hooks.library, "options": ["rbind", "ro"]},
        {"destination": PAGES_IN_CONTAINER, "type": "bind", "source": hooks.pages, "options": ["rbind", "rw"]},
        {"destination": PAGES_IN_CONTAINER + "/limits", "type": "bind", "source": hooks.pages + "/limits",
         "options": ["bind", "ro"]},
        {"destination": PRELOAD, "type": "bind", "source": hooks.pages + "/ld.so.preload", "options": ["bind", "ro"]},
    ]
    process = dict(spec.get("process") or {})
    env = list(process.get("env") or [])
    preload = next((e.partition("=")[2] for e in env if isinstance(e, str) and e.startswith("LD_PRELOAD=")), "")
    if LIB_IN_CONTAINER not in preload.split():
        env = _env_set(env, "LD_PRELOAD", f"{LIB_IN_CONTAINER} {preload}".strip())
    process["env"] = _env_set(env, "CGPU_PAGE_DIR", PAGES_IN_CONTAINER)
    out["process"] = process
    return out


MODIFIERS = (add_hooks, add_library)


def prepare(spec: dict, hooks: Hooks) -> dict:
    """The spec with every modifier applied (a deep copy: `spec` is untouched)."""
    if not isinstance(spec, dict):
        raise SpecError("config.json is not a JSON object")
    out = copy.deepcopy(spec)
    for modify in MODIFIERS:
        out = modify(out, hooks)
    return out
