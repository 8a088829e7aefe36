"""The OCI runtime hook: a container's ALIYUN_COM_GPU_* environment becomes
instances on this node (SPEC §2; docs/containers.md).

    cgpu hook createRuntime   (or prestart)   the OCI state JSON on stdin
    cgpu hook poststop
    cgpu hook auto            either, by the state's status (one hooks.d file)
    python3 -S -m cgpud.hook STAGE   the same without the `cgpu` CLI's start-up
                              (PYTHONPATH = where cgpud is installed)

createRuntime: read the state (`id`, `pid`, `bundle`), `<bundle>/config.json`
(`process.env`), parse the environment (`envspec.parse_env`) against the
daemon's GPUs (the control socket's `query`), let placement pick GPUs when the
container names none (`placement.resolve`), find the container's OWN cgroup
from its init pid (cgroup2 if it may be frozen there, else the v1 freezer
group; never a root, never a group holding this hook or the daemon), and
register the instances in one step: name, GPUs, memsizes, weight, high
priority, the cgroup as the scheduler's target, and policy 2 on the GPUs when
the weight is above 1. Nothing is registered unless all of it is.

poststop: deregister the container's instances; an unknown container is fine.

A container without a memory request (or with CGPU_DISABLE) is left alone and
the daemon is not even asked. A bad value: exit 1 with one line on stderr,
`cgpu hook: VARIABLE=value: why`; the runtime fails the start with it.

Settings, from the hook's own environment (not the container's):
  CGPUD_SOCKET            the daemon's control socket (or `cgpu --socket`)
  CGPU_HOOK_PASSTHROUGH=1 daemon down: let the container start unmanaged
                          (one warning line) instead of failing it
  CGPU_HOOK_TIMEOUT       seconds to wait for the daemon (default 5)

Instance name: the first 12 characters of the container ID (what `docker ps`
shows) when they are 12 of [0-9A-Za-z_.-]; otherwise (a shorter ID, or other
characters in the first 12) `x` + the first 11 hex digits of the ID's SHA-256
— deterministic, so poststop finds it again. The full ID is kept with the
instance's target: poststop removes only instances its own container made.
"""
from __future__ import annotations

# Imports are kept to the minimum a container without GPU variables needs (the
# hook runs for every container when hooks.d says `always`): the control
# client, hashlib, envspec and the cgroup code are imported where used.
import json
import os
import sys
TYPE_CHECKING = False  # not `from typing import …`: importing typing alone costs ~20 ms here
if TYPE_CHECKING:  # pragma: no cover
    from typing import IO, Mapping

    from .client import Client

STAGES_ADD = ("createRuntime", "prestart")
STAGES_REMOVE = ("poststop",)
STAGE_AUTO = "auto"  # one hooks.d entry for both stages: the state's status says which
STAGES = STAGES_ADD + STAGES_REMOVE + (STAGE_AUTO,)

PASSTHROUGH = "CGPU_HOOK_PASSTHROUGH"
TIMEOUT = "CGPU_HOOK_TIMEOUT"
DEFAULT_TIMEOUT = 5.0

_NAME_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_.-")


class HookError(Exception):
    """The container must not start: str() is the one line to show."""


def short_name(container_id: str) -> str:
    """The instance name of a container: its 12-character short ID, or a
    deterministic stand-in when the ID does not give one (module docstring)."""
    head = container_id[:12]
    if len(head) == 12 and _NAME_CHARS.issuperset(head):
        return head
    import hashlib

    return "x" + hashlib.sha256(container_id.encode("utf-8", "surrogateescape")).hexdigest()[:11]


def read_state(stream: IO[str]) -> dict:
    try:
        state = json.load(stream)
    except ValueError as exc:
        raise HookError(f"the OCI state on stdin is not JSON ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("id"), str) or not state["id"]:
        raise HookError('the OCI state on stdin has no "id"')
    return state


def container_env(state: dict) -> dict[str, str]:
    """process.env of `<bundle>/config.json` as a mapping (later entries win)."""
    bundle = state.get("bundle")
    if not isinstance(bundle, str) or not bundle:
        raise HookError(f'container {state["id"]}: the OCI state has no "bundle"')
    path = os.path.join(bundle, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as exc:
        raise HookError(f"container {state['id']}: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise HookError(f"container {state['id']}: {path} is not JSON ({exc})") from None
    env: dict[str, str] = {}
    entries = ((config.get("process") or {}).get("env") or []) if isinstance(config, dict) else []
    for entry in entries:
        if isinstance(entry, str):
            k, sep, v = entry.partition("=")
            if sep:
                env[k] = v
    return env


def wants_gpu(env: Mapping[str, str]) -> bool:
    """Whether the container asks cgpud for anything. False for no memory
    request, 0, or CGPU_DISABLE: then the daemon is not asked at all. A
    malformed value counts as asking (the full parse reports it)."""
    if not (env.get("ALIYUN_COM_GPU_MEM_CONTAINER") or "").strip():
        return False  # unset or empty: not managed, whatever else is set (the common case: no import)
    from .envspec import EnvError, parse_env

    try:
        return parse_env(env, []).managed
    except EnvError:
        return True


def may_have_registered(env: Mapping[str, str]) -> bool:
    """For poststop, without parsing everything (envspec's import alone is a
    good part of the hook's time): False only where createRuntime certainly
    registered nothing — no memory request, all zeros, or CGPU_DISABLE. When
    in doubt the daemon is asked; an unknown container is fine there."""
    mem = (env.get("ALIYUN_COM_GPU_MEM_CONTAINER") or "").strip()
    if not mem:
        return False
    if (env.get("CGPU_DISABLE") or "").strip().lower() in ("true", "1"):
        return False
    parts = [p.strip() for p in mem.split(",")]
    return not all(p and p.isascii() and p.isdigit() and int(p) == 0 for p in parts)


def own_cgroup(pid: int) -> dict:
    """The container's own group, from its init pid: cgroup2 if it can be
    frozen there, else its v1 freezer group. Never a root, never a group that
    holds this hook (the runtime's group, or a parent of the container's)."""
    from .sched.enforce import KIND_CGROUP2, KIND_FREEZER, EnforceError, freezer_from_spec, proc_cgroups

    try:
        pc = proc_cgroups(pid)
    except EnforceError:
        raise HookError(f"no process {pid}: the container's init is gone") from None
    reasons = []
    for kind, path in ((KIND_CGROUP2, pc.v2), (KIND_FREEZER, pc.freezer)):
        if path is None:
            reasons.append(f"no {kind} group")
            continue
        try:
            freezer_from_spec({"kind": kind, "path": path}).close()
        except (EnforceError, OSError) as exc:
            reasons.append(str(exc))
            continue
        return {"kind": kind, "path": path}
    raise HookError(f"pid {pid} has no cgroup of its own to schedule: " + "; ".join(reasons))


def _client(socket: str | None) -> "Client":
    from .client import Client

    try:
        timeout = float(os.environ.get(TIMEOUT) or DEFAULT_TIMEOUT)
    except ValueError:
        timeout = DEFAULT_TIMEOUT
    return Client(socket, timeout=timeout)


def _passthrough() -> bool:
    return (os.environ.get(PASSTHROUGH) or "").strip().lower() in ("1", "true", "yes")


def add(state: dict, socket: str | None = None) -> dict | None:
    """createRuntime/prestart. Returns the register result, or None when the
    container is left alone. Raises HookError; registers nothing then."""
    cid = state["id"]
    env = container_env(state)
    if not wants_gpu(env):
        return None
    from .client import ControlError
    from .envspec import MEM_CONTAINER, EnvError, parse_env
    from .model import GpuInfo
    from .placement import DEFAULT_MODE, DEFAULT_STRATEGY, PlacementError, resolve, states_from_snapshot, unit_for

    pid = state.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise HookError(f"container {cid}: the OCI state has no init pid (is this hook in createRuntime or prestart?)")
    with _client(socket) as c:
        snap = c.call("query")
        mode = snap.get("mode", DEFAULT_MODE)
        strategy = snap.get("strategy", DEFAULT_STRATEGY)
        gpus = [GpuInfo(int(g["index"]), str(g["uuid"]), str(g["name"]), int(g["memory"])) for g in snap["gpus"]]
        try:
            req = parse_env(env, gpus, max_inst=[int(g["max_inst"]) for g in snap["gpus"]], unit=unit_for(mode))
        except EnvError as exc:
            raise HookError(str(exc)) from None
        if not req.managed:
            return None
        try:
            plan = resolve(req, states_from_snapshot(snap), strategy=strategy, mode=mode)
        except PlacementError as exc:
            raise HookError(f"{MEM_CONTAINER}={env.get(MEM_CONTAINER, '').strip()}: {exc}") from None
        target = own_cgroup(pid)
        target["container"] = cid
        name = short_name(cid)
        try:
            return c.call("register", name=name, gpus=[g for g, _ in plan], memsize=[m for _, m in plan],
                          weight=req.weight, highprio=req.highprio, target=target,
                          policy=2 if req.policy2 else None)
        except ControlError as exc:
            raise HookError(f"cannot register {name} on GPU {','.join(str(g) for g, _ in plan)}: {exc} ({exc.error})") from None


def remove(state: dict, socket: str | None = None) -> dict | None:
    """poststop: the container's instances removed; None when it had none."""
    cid = state["id"]
    try:
        env = container_env(state)
    except HookError:
        env = None  # the bundle is gone: ask the daemon anyway
    if env is not None and not may_have_registered(env):
        return None
    from .client import ControlError

    with _client(socket) as c:
        try:
            return c.call("deregister", name=short_name(cid), container=cid)
        except ControlError as exc:
            if exc.error == "ENOENT":
                return None
            raise HookError(f"cannot deregister {short_name(cid)}: {exc} ({exc.error})") from None


def main(stage: str, stdin: IO[str] | None = None, socket: str | None = None) -> int:
    """Run one stage; returns the exit status, having printed at most one line."""
    if stage not in STAGES:
        print(f"cgpu hook: unknown stage {stage!r}; one of {', '.join(STAGES)}", file=sys.stderr)
        return 2
    try:
        state = read_state(stdin or sys.stdin)
        if stage == STAGE_AUTO:
            status = state.get("status")
            if status in ("creating", "created"):
                stage = STAGES_ADD[0]
            elif status == "stopped":
                stage = STAGES_REMOVE[0]
            else:
                raise HookError(f"container {state['id']}: status {status!r}; `cgpu hook auto` runs at "
                                "createRuntime (creating/created) or poststop (stopped)")
        if stage in STAGES_ADD:
            add(state, socket)
        else:
            remove(state, socket)
        return 0
    except HookError as exc:
        print(f"cgpu hook: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the client's errors; it is imported only when the daemon is asked
        client = sys.modules.get(f"{__package__}.client")
        if client is not None and isinstance(exc, client.ControlError):
            print(f"cgpu hook: cgpud refused: {exc} ({exc.error})", file=sys.stderr)
            return 1
        if not isinstance(exc, OSError) and not (client is not None and isinstance(exc, client.DaemonUnavailable)):
            print(f"cgpu hook: internal error: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
            return 1
        if isinstance(exc, OSError):
            exc = f"cannot reach cgpud: {exc.strerror or exc}"
        if _passthrough():
            print(f"cgpu hook: {exc}; {PASSTHROUGH}=1: container left unmanaged", file=sys.stderr)
            return 0
        print(f"cgpu hook: {exc} (set {PASSTHROUGH}=1 in the hook's env to start containers unmanaged then)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # python3 -S -m cgpud.hook STAGE: the fastest start (docs/containers.md)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "", sys.stdin, os.environ.get("CGPUD_SOCKET")))
