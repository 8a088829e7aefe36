"""The daemon's side of the OCI runtime hook: the control socket's `hook` op
(docs/containers.md, SPEC §2).

Here is what needs no control socket: reading and checking the request and
config.json, and `plan`, which turns them into a `register` request; the op
itself (control.hook) registers or deregisters.

The hook process the runtime starts — the compiled `cgpu-hook`
(native/hook/cgpu-hook.c), `cgpu hook` or `python3 -S -m cgpud.containers.hook` — only
forwards the OCI state it got on stdin:

    {"op": "hook", "stage": "createRuntime"|"prestart"|"poststop"|"auto", "state": {…}}

and prints the error's message as its one line. Everything else happens
here, in the daemon, with no process start-up to pay:

createRuntime/prestart: read `<bundle>/config.json` (`process.env`), parse
the environment (`envspec.parse_env`) against this node's GPUs, let
placement pick GPUs when the container names none, find the container's own
cgroup from its init pid, and register the instances in one step (the
`register` op's own code and checks): name, GPUs, memsizes, weight, high
priority, the cgroup as target (with the container ID), policy 2 on the GPUs
when the weight is above 1. Nothing is registered unless all of it is.

poststop: deregister the container's instances (only those its own ID
registered); an unknown container is fine.

The op is privileged (root or the admin group, by SO_PEERCRED): it makes the
daemon read a file the caller names. Checked: the state is an object with an
`id`, an absolute `bundle` without `..`, and (adding) a live `pid` that is not
the caller, the daemon or init; config.json is a regular file of at most
MAX_CONFIG bytes, read in a worker thread within CONFIG_TIMEOUT (a bundle on
a hung file system cannot stall the daemon).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
from typing import Any

import trio

from cgpud.containers import allotted
from cgpud.containers.envspec import CORE, CORE_STEP, MEM_CONTAINER, EnvError, parse_env
from cgpud.containers.placement import PlacementError, resolve, states_from_node, unit_for
from cgpud.core.model import ModelError
from cgpud.sched.cgroupfs import KIND_CGROUP2, KIND_FREEZER, EnforceError, proc_cgroups
from cgpud.sched.enforce import freezer_from_spec


STAGES_ADD = ("createRuntime", "prestart")
STAGES_REMOVE = ("poststop",)
STAGE_AUTO = "auto"  # one hooks.d entry for both stages: the state's status says which
STAGES = STAGES_ADD + STAGES_REMOVE + (STAGE_AUTO,)

MAX_CONFIG = 4 << 20  # bytes of config.json read at most (runtimes' specs are tens of KiB)
CONFIG_TIMEOUT = 3.0  # seconds to read it
MAX_ID = 1024

# The request key under which `load` leaves config.json's environment for
# `run`: not a string, so no JSON request can carry it.
ENV_KEY = object()
CONFIG_KEY = object()  # (and config.json itself, for what else the daemon reads from it: containers.inject)

_NAME_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_.-")


class HookError(Exception):
    """The container must not start (or be removed): str() is the one line the
    hook prints after `cgpu hook: `."""

    def __init__(self, message: str, code: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.code = code


def short_name(container_id: str) -> str:
    """The instance name of a container: the first 12 characters of its ID
    (`docker ps`'s short ID) when they are 12 of [0-9A-Za-z_.-]; otherwise `x`
    + the first 11 hex digits of the ID's SHA-256 (deterministic, so poststop
    finds it again)."""
    head = container_id[:12]
    if len(head) == 12 and _NAME_CHARS.issuperset(head):
        return head
    return "x" + hashlib.sha256(container_id.encode("utf-8", "surrogateescape")).hexdigest()[:11]


def stage_of(stage: Any, state: dict) -> str:
    """createRuntime/prestart → "add", poststop → "remove"; `auto` by the state's status."""
    if stage in STAGES_ADD:
        return "add"
    if stage in STAGES_REMOVE:
        return "remove"
    if stage == STAGE_AUTO:
        status = state.get("status")
        if status in ("creating", "created"):
            return "add"
        if status == "stopped":
            return "remove"
        raise HookError(f"container {state['id']}: status {status!r}; the `auto` stage runs at "
                        "createRuntime (creating/created) or poststop (stopped)")
    raise HookError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")


def check_request(req: dict) -> tuple[str, dict]:
    """(add|remove, state) of a `hook` request, or HookError."""
    state = req.get("state")
    if not isinstance(state, dict):
        raise HookError("the OCI state must be a JSON object")
    cid = state.get("id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_ID or "\0" in cid:
        raise HookError('the OCI state has no "id" (a non-empty string)')
    return stage_of(req.get("stage"), state), state


def config_path(state: dict) -> str:
    bundle = state.get("bundle")
    if not isinstance(bundle, str) or not bundle:
        raise HookError(f'container {state["id"]}: the OCI state has no "bundle"')
    if not os.path.isabs(bundle) or "\0" in bundle or ".." in bundle.split("/"):
        raise HookError(f"container {state['id']}: bundle {bundle!r} is not an absolute path")
    return os.path.join(bundle, "config.json")


def as_seen_by(path: str, pid: int) -> str:
    """A path named by a process of the host (the runtime, the hook: containerd's shims' mount
    namespace): a daemon in another mount namespace (the DaemonSet's container, hostPID) reaches it
    through that process's root, /proc/<pid>/root. Where the path is there in the daemon's own
    view, that is used."""
    if pid <= 0 or os.path.exists(path):
        return path
    theirs = f"/proc/{pid}/root{path}"
    return theirs if os.path.exists(theirs) else path


def read_config(cid: str, path: str) -> dict:
    """A config.json, whole (a regular file of at most MAX_CONFIG bytes, a JSON
    object). Blocking: callers in the daemon run it in a worker thread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise HookError(f"container {cid}: cannot read {path}: {exc.strerror}", exc.errno or errno.EIO) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HookError(f"container {cid}: {path} is not a regular file")
        chunks, size = [], 0
        while size <= MAX_CONFIG:
            chunk = os.read(fd, MAX_CONFIG + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_CONFIG:
            raise HookError(f"container {cid}: {path} is larger than {MAX_CONFIG} bytes", errno.EFBIG)
    except OSError as exc:
        raise HookError(f"container {cid}: cannot read {path}: {exc.strerror}", exc.errno or errno.EIO) from None
    finally:
        os.close(fd)
    try:
        config = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise HookError(f"container {cid}: {path} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise HookError(f"container {cid}: {path} is not a JSON object")
    return config


def env_of(config: dict) -> dict[str, str]:
    """process.env of a spec as a mapping (later entries win)."""
    env: dict[str, str] = {}
    process = config.get("process")
    entries = process.get("env") if isinstance(process, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str):
            k, sep, v = entry.partition("=")
            if sep:
                env[k] = v
    return env


def read_env(cid: str, path: str, claim_mount: str | None = None) -> dict[str, str]:
    """The environment the hook reads of a config.json (hook_env). Blocking: `load` runs it in a
    worker thread."""
    return hook_env(read_config(cid, path), claim_mount)


def contract_env(config: dict, claim_mount: str | None = None) -> tuple[dict[str, str], str | None]:
    """The environment a spec asks with, as allotted.contract_env reads it (on Kubernetes, the
    kubelet's allocation; a claim's container known by its bind of `claim_mount`, the daemon's
    tenant directory), and the NVIDIA_VISIBLE_DEVICES it must carry (None: it does); HookError."""
    try:
        return allotted.contract_env(env_of(config), config, claim_mount)
    except allotted.AllotError as exc:
        raise HookError(str(exc)) from None


def hook_env(config: dict, claim_mount: str | None = None) -> dict[str, str]:
    """contract_env's environment, at the hook: a spec whose NVIDIA_VISIBLE_DEVICES names other GPUs
    than the allotted ones is refused (too late to change it; cgpu-runtime's `prepare` does)."""
    env, nvidia = contract_env(config, claim_mount)
    if nvidia is not None:
        raise HookError(f"{allotted.NVIDIA}={env_of(config).get(allotted.NVIDIA, '')!r} is set by the pod's spec or "
                        f"image, and on Kubernetes the container sees the GPUs the kubelet allotted ({nvidia}): "
                        "start it through the cgpu runtime, which narrows it")
    return env


def write_config(cid: str, path: str, config: dict) -> None:
    """Replace a config.json atomically: the whole new text in a file beside
    it (same mode and owner), synced, renamed over it, the directory synced.
    Whoever reads it sees the old spec or the new one, never a part.
    Blocking: run in a worker thread."""
    data = json.dumps(config, separators=(",", ":")).encode()
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".config.json.cgpud-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        st = os.stat(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, stat.S_IMODE(st.st_mode))
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise HookError(f"container {cid}: cannot write {path}: {exc.strerror}", exc.errno or errno.EIO) from None


async def load(req: dict, peer_pid: int = 0, claim_mount: str | None = None) -> dict:
    """Before `run` (the serving loop awaits this for `hook` requests of
    privileged callers): config.json, read in a worker thread with a time
    limit, left as its environment (ENV_KEY) and whole (CONFIG_KEY). A failure
    is left for `run` to report."""
    try:
        kind, state = check_request(req)
        if kind != "add":
            return req
        path = as_seen_by(config_path(state), peer_pid)
        config: Any = HookError(f"container {state['id']}: reading {path} took more than {CONFIG_TIMEOUT:g} s",
                                errno.ETIMEDOUT)
        with trio.move_on_after(CONFIG_TIMEOUT):
            config = await trio.to_thread.run_sync(catching, read_config, state["id"], path, abandon_on_cancel=True)
    except HookError as exc:
        config = exc
    if isinstance(config, HookError):
        return {**req, ENV_KEY: config}
    return {**req, ENV_KEY: catching(hook_env, config, claim_mount), CONFIG_KEY: config}


def catching(fn, *args):
    try:
        return fn(*args)
    except HookError as exc:
        return exc


def container_pid(state: dict, hook_pid: int) -> int:
    pid = state.get("pid")
    cid = state["id"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise HookError(f"container {cid}: the OCI state has no init pid (is the hook in createRuntime or prestart?)")
    if pid in (1, os.getpid(), hook_pid):
        raise HookError(f"container {cid}: pid {pid} is not a container's init (it is "
                        f"{'init' if pid == 1 else 'cgpud' if pid == os.getpid() else 'the hook itself'})")
    if not os.path.isdir(f"/proc/{pid}"):
        raise HookError(f"container {cid}: no process {pid} (the container's init is gone, or the hook runs in "
                        "another pid namespace than cgpud)", errno.ESRCH)
    return pid


def own_cgroup(pid: int, hook_pid: int) -> dict:
    """The container's own group, from its init pid: cgroup2 if it can be
    frozen there, else its v1 freezer group. Never a root, never a group that
    holds the daemon, a process it protects, or the hook (the runtime's group,
    or a parent of the container's)."""
    try:
        pc = proc_cgroups(pid)
    except EnforceError:
        raise HookError(f"no process {pid}: the container's init is gone", errno.ESRCH) from None
    try:
        hook = proc_cgroups(hook_pid) if hook_pid > 0 else None
    except EnforceError:
        hook = None  # the hook is gone already: nothing of it to protect
    reasons = []
    for kind, path, hook_path in ((KIND_CGROUP2, pc.v2, hook and hook.v2), (KIND_FREEZER, pc.freezer, hook and hook.freezer)):
        if path is None:
            reasons.append(f"no {kind} group")
            continue
        if hook_path is not None and (hook_path == path or hook_path.startswith(path.rstrip("/") + "/")):
            reasons.append(f"{path} holds the hook process {hook_pid} too: the container has no {kind} group of its own")
            continue
        try:
            freezer_from_spec({"kind": kind, "path": path}).close()
        except (EnforceError, OSError) as exc:
            reasons.append(str(exc))
            continue
        return {"kind": kind, "path": path}
    raise HookError(f"pid {pid} has no cgroup of its own to schedule: " + "; ".join(reasons), errno.EPERM)


def plan(state: dict, env: dict[str, str], node, *, strategy: str, mode: str, hook_pid: int) -> dict:
    """What a joining container gets: `{"action": "left alone", …}`, or the
    `register` request that makes its instances (name, GPUs, memsizes,
    weight, priority, its own cgroup as target, policy 2 when the weight is
    above 1). Raises HookError; changes nothing."""
    cid = state["id"]
    name = short_name(cid)
    try:
        request = parse_env(env, [g.info for g in node.gpus], max_inst=[g.max_inst for g in node.gpus],
                            unit=unit_for(mode))
    except EnvError as exc:
        raise HookError(str(exc)) from None
    if not request.managed:
        return {"action": "left alone", "name": name, "reason": request.reason}
    core_mode_rule(request, mode)
    pid = container_pid(state, hook_pid)
    try:
        placed = resolve(request, states_from_node(node), strategy=strategy, mode=mode)
    except PlacementError as exc:
        raise HookError(f"{MEM_CONTAINER}={env.get(MEM_CONTAINER, '').strip()}: {exc}", errno.ENOSPC) from None
    except ModelError as exc:  # UnevenSplit and other invalid requests
        raise HookError(f"{MEM_CONTAINER}={env.get(MEM_CONTAINER, '').strip()}: {exc}") from None
    target = {**own_cgroup(pid, hook_pid), "container": cid}
    if request.percentage is not None:  # core_mem: policy 3, 20 slots of 5 %: weight = percentage / 5
        return {"name": name, "gpus": [g for g, _ in placed], "memsize": [m for _, m in placed],
                "weight": request.percentage // CORE_STEP, "highprio": request.highprio, "target": target,
                "policy": 3, "core": True}
    return {"name": name, "gpus": [g for g, _ in placed], "memsize": [m for _, m in placed],
            "weight": request.weight, "highprio": request.highprio, "target": target,
            "policy": 2 if request.policy2 else None}


def core_mode_rule(request, mode: str) -> None:
    """core_mem (docs/scheduler.md): on a core_mem node every managed container asks a compute
    percentage, and only there; memory-only and percentage containers never share a node."""
    if mode == "core_mem" and request.percentage is None:
        raise HookError(f"this node runs in mode core_mem: a container asks a compute percentage too ({CORE}, "
                        "from aliyun.com/gpu-core.percentage), not GPU memory alone")
    if mode != "core_mem" and request.percentage is not None:
        raise HookError(f"{CORE}={request.percentage}: this node runs in mode {mode}, not core_mem: compute "
                        "percentages are for core_mem nodes (ack.node.gpu.schedule=core_mem)")
