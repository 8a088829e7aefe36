"""The control socket: one protocol for `cgpu run`, the container hook,
`cgpu-smi` and tests. Documented in docs/control.md.

Unix stream socket, JSON lines: one request object per line, one response per
request, in order. A request is `{"op": NAME, ...arguments}`; a response is
`{"ok": true, "result": …}` or `{"ok": false, "error": "EINVAL", "message": "…"}`
(the error is an errno name, the message one line for a person).

Peer credentials (SO_PEERCRED) are checked: anyone may read (`hello`,
`query`); changes need root or the admin group. The `gpu_*` ops are open to
every process, but act only on the instance whose cgroup holds the caller
(docs/memory.md): allocations belong to the connection and are returned when
it closes, as a CUDA context's memory is when its process dies.
"""
from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import trio

from fusefs.mount import _unescape

from cgpud import __version__
from cgpud.containers.cgroups import CgroupError, InstanceGroups
from cgpud.state.durable import Durable
from cgpud.core.model import Instance, ModelError, NotFound, Node, OutOfMemory, check_name, quoted
from cgpud.tree import ERRNOS

log = logging.getLogger("cgpud")

MAX_LINE = 64 * 1024  # the longest request line; a longer one is answered EINVAL and the connection closed
TOO_LONG = {"ok": False, "error": "EINVAL", "message": f"request line too long (over {MAX_LINE} bytes); connection closed"}


class Refused(Exception):
    """A request refused with an errno and one line of reason."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    conn: int = 0  # which connection: registrations made with cgroup=true belong to it
    # Supplementary groups as the kernel recorded them at connect (SO_PEERGROUPS);
    # None: unknown, read from /proc (racy: the pid may be another process by now).
    supplementary: frozenset[int] | None = None

    def groups(self) -> set[int]:
        if self.supplementary is not None:
            return set(self.supplementary) | {self.gid}
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        return {int(g) for g in line.split()[1:]} | {self.gid}
        except OSError:
            pass
        return {self.gid}


@dataclass(frozen=True)
class Held:
    """Simulated GPU memory one connection allocated: returned when it closes."""

    conn: int
    pid: int
    gpu: int
    name: str
    nbytes: int


class Streamed:
    """A result given as JSON text in pieces (a large answer: `trace`): the
    server sends it whole, but lets the schedulers run between pieces."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self.pieces = pieces

    def text(self) -> str:
        return "".join(self.pieces)


async def encoded(resp: dict) -> bytes:
    """A response as its line; a Streamed result a piece at a time, the
    schedulers running in between."""
    if not isinstance(resp.get("result"), Streamed):
        return json.dumps(resp).encode() + b"\n"
    parts = ['{"ok": true, "result": ']
    for piece in resp["result"].pieces:
        parts.append(piece)
        await trio.sleep(0)
    return ("".join(parts) + "}\n").encode()


def _cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, fstype, super options) per cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((_unescape(fields[4]), _unescape(fields[3]), rfields[0], set(rfields[2].split(","))))
    return out


def _hierarchy_path(target: dict, mounts) -> tuple[str, str] | None:
    """A cgroup target as (hierarchy, path inside it) — `("", "/cgpud/x")` for
    cgroup2, `("freezer", …)` for a v1 freezer group — comparable with the
    lines of /proc/<pid>/cgroup. None when no mount holds it."""
    kind, path = target.get("kind"), target.get("path")
    if not isinstance(path, str):
        return None
    best = None
    for mnt, root, fstype, opts in mounts:
        if kind == "cgroup2" and fstype != "cgroup2":
            continue
        if kind == "cgroup1-freezer" and not (fstype == "cgroup" and "freezer" in opts):
            continue
        if path == mnt or path.startswith(mnt.rstrip("/") + "/"):
            if best is None or len(mnt) > len(best[0]):
                best = (mnt, root)
    if best is None:
        return None
    mnt, root = best
    rel = path[len(mnt.rstrip("/")):]
    inside = (root.rstrip("/") + rel) or "/"
    return ("" if kind == "cgroup2" else "freezer", inside)


def _proc_cgroups(pid: int) -> dict[str, str]:
    """/proc/<pid>/cgroup as {hierarchy: path}: "" for cgroup2, each v1 controller by name."""
    out: dict[str, str] = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _contains(group: str, path: str) -> bool:
    return path == group or path.startswith(group.rstrip("/") + "/")


def decode_line(line: bytes) -> Any:
    """One request line -> the request, or Refused: not UTF-8, not JSON,
    nested too deep for the parser (a line of 100,000 `[`), numbers too long."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return Refused(errno.EINVAL, "not a JSON line")


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def peer_of(sock: socket.socket) -> Peer:
    """The peer's credentials as of its connect(): pid, uid, gid and its
    supplementary groups, all recorded by the kernel then."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    supplementary = None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # (CPython allows 1024 bytes: 256 groups)
        supplementary = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass  # an older kernel, or more than 256 groups (ERANGE): groups() reads /proc
    return Peer(pid, uid, gid, supplementary=supplementary)


def snapshot(node: Node) -> dict:
    """Everything a client may want to see, as plain data."""
    return {
        "version": __version__,
        "default_memsize": node.default_memsize,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.info.uuid,
                "name": g.info.name,
                "memory": g.info.memory,
                "policy": g.policy,
                "max_inst": g.max_inst,
                "prio_ratio": g.prio_ratio,
                "free_weight": g.free_weight,
                "instances": [
                    {**i.settings(), "used": i.used, "procs": {str(p): n for p, n in sorted(i.procs.items())}}
                    for i in g.instances.values()
                ],
            }
            for g in node.gpus
        ],
    }


def _arg(req: dict, name: str, kind: type | tuple, default: Any = ..., *, allow_none: bool = False) -> Any:
    if name not in req:
        if default is ...:
            raise Refused(errno.EINVAL, f"missing argument {name!r}")
        return default
    v = req[name]
    if v is None and allow_none:
        return None
    if isinstance(v, bool) and kind is not bool and (not isinstance(kind, tuple) or bool not in kind):
        raise Refused(errno.EINVAL, f"argument {name!r} has the wrong type")
    if not isinstance(v, kind):
        raise Refused(errno.EINVAL, f"argument {name!r} has the wrong type")
    return v


class Control:
    """Request handlers. Synchronous: each runs whole between two awaits."""

    def __init__(
        self,
        durable: Durable,
        admin_gid: int | None = None,
        groups: InstanceGroups | None = None,
        devices: list[str] | None = None,
        stats: Callable[[], list[dict]] | None = None,
        strategy: str = "binpack",
        mode: str = "cgpu",
        client_env: Callable[[str], dict] | None = None,
    ) -> None:
        self.durable = durable
        self.client_env = client_env  # mps mode: the environment an instance's processes need (cgpud/mps.py)
        self.watchdog = None  # real GPUs: the memory watchdog (cgpud/memwatch.py), set by the daemon
        self._stats = stats
        self.tracer: Callable[[float, int | None], list[dict]] | None = None  # Scheduling.trace (trace.collect)
        self.strategy, self.mode = strategy, mode  # placement: how the container hook picks GPUs
        self.devices = devices or []
        self.admin_gid = admin_gid
        self.groups = groups
        # name -> the connection that made its cgroup (absent: the connection is gone)
        self.owners: dict[str, int] = {}
        self.live_conns: set[int] = set()
        # Our cgroups of deregistered instances that still held processes: the reaper removes them.
        self.pending_groups: set[str] = set()
        # Simulated GPU memory by connection, then by handle. Not durable state:
        # it goes with the connection (the process), never into state.json.
        self.held: dict[int, dict[int, Held]] = {}
        self._handles = itertools.count(1)
        # Out-of-memory events by (gpu, instance name), for the metrics: refused
        # allocations here; whatever else sees one (a memory watchdog) adds to it.
        self.oom_refusals: Counter[tuple[int, str]] = Counter()
        durable.listeners.append(self._forget_gone)
        durable.listeners.append(self._orphaned_groups)
        self._our_paths: set[str] = set()
        # A hot upgrade (cgpud.daemon.upgrade): serve() hands the connections on instead of closing them.
        self.handing_over = False
        self.handed: list = []
        self.serve_scope: trio.CancelScope | None = None
        self.listen_fd = -1
        self.ops: dict[str, tuple[bool, Callable[[dict, Peer], Any]]] = {
            "hello": (False, self.hello),
            "query": (False, self.query),
            "stats": (False, self.stats),
            "trace": (False, self.trace),
            "register": (True, self.register),
            "deregister": (True, self.deregister),
            "hook": (True, self.hook),  # the OCI hook's forwarders (cgpud/hookd.py)
            # open to all; each acts only on the caller's own instance
            "gpu_alloc": (False, self.gpu_alloc),
            "gpu_free": (False, self.gpu_free),
            "gpu_meminfo": (False, self.gpu_meminfo),
        }

    @property
    def node(self) -> Node:
        return self.durable.node

    def privileged(self, peer: Peer) -> bool:
        return peer.uid == 0 or (self.admin_gid is not None and self.admin_gid in peer.groups())

    def handle(self, req: Any, peer: Peer) -> dict:
        try:
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise Refused(errno.EINVAL, 'a request is a JSON object with a string "op"')
            entry = self.ops.get(req["op"])
            if entry is None:
                raise Refused(errno.EINVAL, f"unknown op {quoted(req['op'])}; known: {', '.join(sorted(self.ops))}")
            needs_priv, fn = entry
            if needs_priv and not self.privileged(peer):
                raise Refused(errno.EACCES, f"{req['op']} needs root or the admin group")
            return {"ok": True, "result": fn(req, peer)}
        except Refused as exc:
            return {"ok": False, "error": errno.errorcode[exc.code], "message": str(exc)}
        except ModelError as exc:
            code = next(c for cls, c in ERRNOS.items() if isinstance(exc, cls))
            return {"ok": False, "error": errno.errorcode[code], "message": str(exc)}
        except OSError as exc:
            code = exc.errno or errno.EIO
            return {"ok": False, "error": errno.errorcode.get(code, "EIO"), "message": exc.strerror or str(exc)}
        except Exception:  # a bug must cost one request, never the daemon
            log.exception("control request %.200r failed", req)
            return {"ok": False, "error": "EIO", "message": "internal error; see the daemon's log"}

    # ---- ops ---------------------------------------------------------------

    def hello(self, req: dict, peer: Peer) -> dict:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "gpus": len(self.node.gpus),
            "devices": self.devices,
            "privileged": self.privileged(peer),
        }

    def query(self, req: dict, peer: Peer) -> dict:
        return {**snapshot(self.node), "strategy": self.strategy, "mode": self.mode}

    def stats(self, req: dict, peer: Peer) -> list[dict]:
        """The scheduler's telemetry per GPU (empty when it does not run)."""
        return self._stats() if self._stats else []

    def trace(self, req: dict, peer: Peer) -> dict:
        """The slices of the last `seconds` (default 10, at most the ring's
        60 s), of every GPU or of `gpu`: who had each GPU when (cgpu trace)."""
        from cgpud.observe.trace import HORIZON, encode

        seconds = _arg(req, "seconds", (int, float), 10.0)
        if not 0 < seconds <= HORIZON:
            raise Refused(errno.EINVAL, f"seconds must be more than 0 and at most {HORIZON:g} "
                                        f"(the daemon keeps the last {HORIZON:g} s of slices), not {seconds}")
        gpu = self._gpu_arg(req)
        if gpu is not None and gpu >= len(self.node.gpus):
            raise Refused(errno.EINVAL, f"no GPU {gpu} on this node (it has {len(self.node.gpus)})")
        if self.tracer is None:
            raise Refused(errno.EOPNOTSUPP, "this daemon runs no scheduler: there are no slices to show")
        return Streamed(encode(self.tracer(float(seconds), gpu), seconds, time.time()))

    def register(self, req: dict, peer: Peer) -> dict:
        """Create the instances of one container: `name` on each of `gpus`.

        memsize: bytes, one for every GPU or a list GPU by GPU; None or absent
        = default_memsize. All are created, or none.
        """
        name = check_name(_arg(req, "name", str))
        gpus = _arg(req, "gpus", list)
        if not gpus or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus) or len(set(gpus)) != len(gpus):
            raise Refused(errno.EINVAL, "gpus must be a non-empty list of distinct GPU indices")
        for g in gpus:
            if not 0 <= g < len(self.node.gpus):
                raise Refused(errno.EINVAL, f"no GPU {g} on this node (it has {len(self.node.gpus)})")
        mem = _arg(req, "memsize", (int, list), None, allow_none=True)
        mems = mem if isinstance(mem, list) else [mem] * len(gpus)
        if len(mems) != len(gpus) or not all(m is None or (isinstance(m, int) and not isinstance(m, bool)) for m in mems):
            raise Refused(errno.EINVAL, "memsize must be bytes, or a list of bytes per GPU")
        weight = _arg(req, "weight", int, 1)
        highprio = _arg(req, "highprio", bool, False)
        want_group = _arg(req, "cgroup", bool, False)
        policy = _arg(req, "policy", int, None, allow_none=True)
        given = _arg(req, "target", dict, None, allow_none=True)
        target = None
        if given is not None:
            if want_group:
                raise Refused(errno.EINVAL, "give cgroup: true or a target, not both")
            target = self._check_target(given)
        if want_group:
            if self.groups is None:
                raise Refused(errno.EOPNOTSUPP, "this daemon runs without cgroups; cgpu run cannot place processes")
            if self.node.instances_named(name):
                raise Refused(errno.EEXIST, f"{name} is already registered")
            try:
                target = {"kind": self.groups.kind, "path": self.groups.create(name)}
            except (CgroupError, OSError) as exc:
                raise Refused(errno.EBUSY, f"cannot make a cgroup for {name}: {exc}") from None

        def create(n: Node):
            made = [n.create_instance(g, name, memsize=m, weight=weight, highprio=highprio) for g, m in zip(gpus, mems)]
            if target is not None:
                n.attach(name, target)
            if policy is not None:
                for g in gpus:
                    n.set_policy(g, policy)
            return made

        try:
            made = self.durable.apply(create)
        except BaseException:
            if want_group and target is not None:
                self.groups.remove(target["path"])
            raise
        if target is not None:
            self.owners[name] = peer.conn
        log.info("registered %s on GPU %s (pid %d)", name, ",".join(map(str, gpus)), peer.pid)
        return {
            "name": name,
            "instances": [{"gpu": i.gpu, "id": i.id, "memsize": i.memsize, "weight": i.weight} for i in made],
            "target": target,
            **({"env": self.client_env(name)} if self.client_env is not None else {}),
        }

    @staticmethod
    def _check_target(given: dict) -> dict:
        """A target a client names (the container hook: the container's own
        cgroup): a group of a mounted cgroup2 or v1 freezer hierarchy, never
        its root, never one that holds the daemon or a process it protects
        (the same checks as the scheduler's). `container` (optional) is kept
        with it: the container ID that owns the instance."""
        from cgpud.sched.enforce import EnforceError, freezer_from_spec

        kind, path, container = given.get("kind"), given.get("path"), given.get("container")
        if kind not in ("cgroup2", "cgroup1-freezer") or not isinstance(path, str) or not path.startswith("/"):
            raise Refused(errno.EINVAL, 'a target is {"kind": "cgroup2" or "cgroup1-freezer", "path": "/abs/dir"}')
        if container is not None and (not isinstance(container, str) or not container or len(container) > 1024):
            raise Refused(errno.EINVAL, "a target's container is a non-empty string")
        if set(given) - {"kind", "path", "container"}:
            raise Refused(errno.EINVAL, f"unknown target keys: {', '.join(sorted(set(given) - {'kind', 'path', 'container'}))}")
        try:
            freezer_from_spec({"kind": kind, "path": path}).close()
        except EnforceError as exc:
            raise Refused(errno.EPERM, f"target {path}: {exc}") from None
        return {k: v for k, v in (("kind", kind), ("path", os.path.realpath(path)), ("container", container))
                if v is not None}

    def deregister(self, req: dict, peer: Peer) -> dict:
        name = check_name(_arg(req, "name", str))
        container = _arg(req, "container", str, None, allow_none=True)
        if container is not None:
            # Only the instances this container registered (a poststop hook of
            # a container whose start failed must not remove another's).
            mine = self.node.instances_named(name)
            if not mine or (mine[0].target or {}).get("container") != container:
                raise Refused(errno.ENOENT, f"no instance {name} of container {container}")
        gone = self.durable.apply(lambda n: n.destroy(name))
        self._drop_group(name, gone[0].target)
        log.info("deregistered %s (pid %d)", name, peer.pid)
        return {"name": name, "gpus": [i.gpu for i in gone]}

    def hook(self, req: dict, peer: Peer) -> dict:
        """A container's OCI hook stage, done here (cgpud/hookd.py)."""
        from cgpud.containers import hookd

        try:
            return hookd.run(self, req, peer)
        except hookd.HookError as exc:
            log.info("container hook (%s, pid %d) refused: %s", req.get("stage"), peer.pid, exc)
            raise Refused(exc.code, str(exc)) from None

    async def prepare(self, req: Any, peer: Peer) -> Any:
        """Before `handle`, in the serving task: the blocking part of a request
        (the hook's config.json read, in a worker thread with a time limit)."""
        if isinstance(req, dict) and req.get("op") == "hook" and self.privileged(peer):
            from cgpud.containers import hookd

            return await hookd.load(req, peer)
        return req

    # ---- simulated GPU memory (docs/memory.md) -------------------------------

    def instance_of(self, pid: int, gpu: int | None) -> Instance:
        """The instance of `pid` on `gpu` (None: its lowest GPU): the one whose
        target cgroup holds the process (the deepest, if targets nest). A
        process in no instance, or whose instance is not on `gpu`: EPERM."""
        if pid <= 0:  # SO_PEERCRED says 0 for a process outside our pid namespace
            raise Refused(errno.EPERM, "the calling process is not visible from the daemon's pid namespace")
        try:
            cgroups = _proc_cgroups(pid)
        except (OSError, ValueError):
            raise Refused(errno.EPERM, f"pid {pid} is gone; GPU memory belongs to a live process") from None
        mounts = None
        best: tuple[int, str] | None = None
        for inst in self.node.instances():
            t = inst.target
            if not t:
                continue
            if t.get("kind") == "pgid":
                try:
                    inside = os.getpgid(pid) == t.get("pgid")
                except OSError:
                    inside = False
                depth = 0
            else:
                if mounts is None:
                    mounts = _cgroup_mounts()
                where = _hierarchy_path(t, mounts)
                inside = where is not None and where[0] in cgroups and _contains(where[1], cgroups[where[0]])
                depth = len(where[1]) if where is not None else 0
            if inside and (best is None or depth > best[0]):
                best = (depth, inst.name)
        if best is None:
            where = cgroups.get("") or cgroups.get("freezer") or "?"
            raise Refused(
                errno.EPERM,
                f"pid {pid} is in no cgpud instance (cgroup {where}): only processes inside an instance "
                "(cgpu run, or a managed container) have simulated GPU memory",
            )
        name = best[1]
        mine = self.node.instances_named(name)
        if gpu is None:
            return mine[0]
        for inst in mine:
            if inst.gpu == gpu:
                return inst
        raise Refused(
            errno.EPERM,
            f"pid {pid} is in instance {name}, which has no share of GPU {gpu} "
            f"(its GPUs: {','.join(str(i.gpu) for i in mine)})",
        )

    @staticmethod
    def _gpu_arg(req: dict) -> int | None:
        gpu = _arg(req, "gpu", int, None, allow_none=True)
        if gpu is not None and gpu < 0:
            raise Refused(errno.EINVAL, f"no GPU {gpu}")
        return gpu

    def gpu_alloc(self, req: dict, peer: Peer) -> dict:
        """Allocate `bytes` of the caller's instance on `gpu`; ENOMEM past memsize."""
        gpu = self._gpu_arg(req)
        nbytes = _arg(req, "bytes", int)
        if nbytes <= 0:
            raise Refused(errno.EINVAL, f"bytes must be a positive number of bytes, not {nbytes}")
        inst = self.instance_of(peer.pid, gpu)
        try:
            self.node.alloc(inst.gpu, inst.name, peer.pid, nbytes)  # OutOfMemory: nothing changed
        except OutOfMemory:
            self.oom_refusals[(inst.gpu, inst.name)] += 1
            raise
        handle = next(self._handles)
        self.held.setdefault(peer.conn, {})[handle] = Held(peer.conn, peer.pid, inst.gpu, inst.name, nbytes)
        log.debug("pid %d allocated %d bytes of %s on GPU %d (handle %d)", peer.pid, nbytes, inst.name, inst.gpu, handle)
        return {"handle": handle, "gpu": inst.gpu, "instance": inst.name, "bytes": nbytes,
                "free": inst.free, "total": inst.memsize}

    def gpu_free(self, req: dict, peer: Peer) -> dict:
        """Return one allocation this connection made."""
        gpu = self._gpu_arg(req)
        handle = _arg(req, "handle", int)
        h = self.held.get(peer.conn, {}).get(handle)
        if h is None or (gpu is not None and gpu != h.gpu):
            on = f" on GPU {gpu}" if gpu is not None else ""
            raise Refused(errno.ENOENT, f"no allocation {handle}{on} made on this connection")
        self._release(handle, h)
        try:
            inst = self.node.instance(h.gpu, h.name)
        except NotFound:
            return {"gpu": h.gpu, "free": 0, "total": 0}
        return {"gpu": h.gpu, "free": inst.free, "total": inst.memsize}

    def gpu_meminfo(self, req: dict, peer: Peer) -> dict:
        """What the caller's instance sees of its GPU: memsize as the total."""
        inst = self.instance_of(peer.pid, self._gpu_arg(req))
        return {"gpu": inst.gpu, "instance": inst.name, "free": inst.free, "total": inst.memsize, "used": inst.used}

    def _release(self, handle: int, h: Held) -> None:
        mine = self.held.get(h.conn, {})
        mine.pop(handle, None)
        if not mine:
            self.held.pop(h.conn, None)
        try:
            self.node.free(h.gpu, h.name, h.pid, h.nbytes)
        except NotFound:  # the instance is gone, and its memory with it
            pass

    def disconnected(self, conn: int) -> int:
        """A connection closed (its process exited, was killed, or closed its
        client): everything it allocated is returned. The bytes returned."""
        total = 0
        for handle, h in list(self.held.get(conn, {}).items()):
            self._release(handle, h)
            total += h.nbytes
        if total:
            log.debug("connection %d closed: %d bytes of GPU memory returned", conn, total)
        return total

    def _forget_gone(self) -> None:
        """After any change: allocations of instances that no longer exist are
        forgotten (a new instance of the same name must start empty), and so
        are their out-of-memory counts."""
        for key in [k for k in self.oom_refusals if k[1] not in self.node.gpus[k[0]].instances]:
            del self.oom_refusals[key]
        if not self.held:
            return
        for conn, mine in list(self.held.items()):
            for handle, h in list(mine.items()):
                try:
                    self.node.instance(h.gpu, h.name)
                except NotFound:
                    mine.pop(handle)
            if not mine:
                self.held.pop(conn)

    def _orphaned_groups(self) -> None:
        """After any change (inst_ctl on the tree included): a cgroup we made
        whose instance is gone waits for its processes to go, then is removed."""
        if self.groups is None:
            return
        base = self.groups.base + os.sep
        now = {i.target["path"] for i in self.node.instances()
               if i.target and i.target.get("path", "").startswith(base)}
        self.pending_groups |= self._our_paths - now
        self._our_paths = now

    def node_uses(self, path: str) -> bool:
        """Whether some instance (again) has `path` as its target."""
        return any(i.target and i.target.get("path") == path for i in self.node.instances())

    def _drop_group(self, name: str, target: dict | None) -> None:
        self.owners.pop(name, None)
        if self.groups is not None and target and target.get("path", "").startswith(self.groups.base + os.sep):
            # (still populated: _orphaned_groups has marked it; the reaper removes it once empty)
            if not self.groups.remove(target["path"]):
                log.info("cgroup %s still holds processes; removing it when they are gone", target["path"])

    def close(self) -> None:
        """At shutdown: a last try at the cgroups still waiting for their processes to go."""
        for path in list(self.pending_groups):
            try:
                if self.groups is not None and not self.node_uses(path) and not self.groups.remove(path):
                    log.info("cgroup %s still holds processes at shutdown; left in place", path)
            except (OSError, CgroupError):
                pass
        self.pending_groups.clear()

    def reap(self) -> list[str]:
        """Deregister instances whose cgroup (made by us) is empty and whose
        registering connection is gone: `cgpu run` or its command died. Also
        a container's instances (target with `container`, from the hook) whose
        cgroup is gone: the runtime removed the container without its poststop."""
        for path in list(self.pending_groups):  # ours, deregistered while still populated
            try:
                done = self.node_uses(path) or self.groups is None or self.groups.remove(path)
            except (OSError, CgroupError) as exc:
                log.warning("cannot remove cgroup %s (%s); leaving it", path, exc)
                done = True
            if done:
                self.pending_groups.discard(path)
        gone = []
        for inst in list(self.node.instances()):
            t = inst.target
            if t and t.get("container") and inst.name not in gone and not os.path.isdir(t.get("path", "")):
                try:
                    self.durable.apply(lambda n, name=inst.name: n.destroy(name))
                except ModelError:
                    continue
                gone.append(inst.name)
                log.info("%s: the cgroup of container %s is gone; deregistered", inst.name, t["container"])
                continue
            if self.groups is None:
                continue
            if not t or not t.get("path", "").startswith(self.groups.base + os.sep):
                continue
            if self.owners.get(inst.name) in self.live_conns or inst.name in gone:
                continue
            if not self.groups.populated(t["path"]):
                try:
                    self.durable.apply(lambda n, name=inst.name: n.destroy(name))
                except ModelError:
                    continue
                self._drop_group(inst.name, t)
                gone.append(inst.name)
                log.info("%s: its processes are gone; deregistered", inst.name)
        return gone


async def reaper(control: Control, after, interval: float = 0.5, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    while True:
        if control.reap():
            await after()
        await trio.sleep(interval)


async def _nothing() -> None:
    return None


@dataclass
class Adopted:
    """A client connection handed over by the previous daemon (cgpud.daemon.upgrade)."""

    fd: int
    conn: int
    pid: int
    uid: int
    gid: int
    buf: bytes = b""
    groups: list[int] | None = None  # the kernel's record of its supplementary groups (SO_PEERGROUPS)


class _Pending:
    """Bytes of a connection not yet ending in a newline."""

    def __init__(self, buf: bytes = b"") -> None:
        self.buf = buf


async def serve(path: str, control: Control, after=_nothing, *, listen_fd: int | None = None,
                adopted: list[Adopted] = (), task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on `path` until cancelled. `after()` is awaited after each
    request (the tree drops vanished directories from the kernel's cache).

    A hot upgrade (cgpud.daemon.upgrade) gives the listening socket (`listen_fd`)
    and the open connections (`adopted`) of the daemon before. To hand them
    on, it sets `control.handing_over` and cancels `control.serve_scope`:
    each connection stops between two requests (a request received is
    answered first), leaving what it had read but not yet answered in
    `control.handed`, and nothing is returned or unlinked."""
    if listen_fd is None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # a socket left by a daemon that is gone
            else:
                raise OSError(errno.EADDRINUSE, f"another daemon answers on {path}: stop it, or choose another --socket")
            finally:
                probe.close()
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, 0o666)  # anyone may query; changes are checked by credentials
        sock.listen(64)
    else:
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=listen_fd))
    control.listen_fd = sock.fileno()
    listener = trio.SocketListener(sock)

    conn_ids = iter(range(max([a.conn for a in adopted], default=0) + 1, 1 << 62))

    async def connection(stream: trio.SocketStream, peer: Peer | None = None, buf: bytes = b"") -> None:
        if peer is None:
            try:
                p = peer_of(stream.socket)  # type: ignore[arg-type]
            except OSError:  # gone before we looked
                await stream.aclose()
                return
            peer = Peer(p.pid, p.uid, p.gid, next(conn_ids), p.supplementary)
        control.live_conns.add(peer.conn)
        pending = _Pending(buf)
        try:
            async with stream:
                try:
                    await _lines(stream, peer, pending)
                except Exception:  # one connection's failure must never stop the daemon
                    log.exception("control connection %d (pid %d) failed; closed", peer.conn, peer.pid)
                finally:
                    if control.handing_over:
                        # (before the stream closes: the copy keeps the client connected)
                        fd = os.dup(stream.socket.fileno())
                        groups = sorted(peer.supplementary) if peer.supplementary is not None else None
                        control.handed.append(Adopted(fd, peer.conn, peer.pid, peer.uid, peer.gid, pending.buf, groups))
                    else:
                        # Before the close: a client that waits for EOF knows its memory is back.
                        control.disconnected(peer.conn)
        finally:
            if not control.handing_over:
                control.live_conns.discard(peer.conn)

    async def _lines(stream: trio.SocketStream, peer: Peer, pending: _Pending) -> None:
        while True:
            if b"\n" not in pending.buf:  # between two requests: where a handover may stop us
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                pending.buf += data
            with trio.CancelScope(shield=True):  # a request read is answered
                overlong = False
                while b"\n" in pending.buf:
                    line, pending.buf = pending.buf.split(b"\n", 1)
                    if len(line) > MAX_LINE:
                        overlong = True
                        break
                    if not line.strip():
                        continue
                    req = decode_line(line)
                    if isinstance(req, Refused):
                        resp = {"ok": False, "error": errno.errorcode[req.code], "message": str(req)}
                    else:
                        resp = control.handle(await control.prepare(req, peer), peer)
                        await after()
                    try:
                        with trio.move_on_after(10):
                            await stream.send_all(await encoded(resp))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                if overlong or len(pending.buf) > MAX_LINE:
                    try:  # (the rest of an overlong line cannot be told from the next request: close)
                        await stream.send_all(json.dumps(TOO_LONG).encode() + b"\n")
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    return

    control.serve_scope = trio.CancelScope()
    try:
        with control.serve_scope:
            async with trio.open_nursery() as nursery:
                for a in adopted:
                    s = trio.socket.from_stdlib_socket(socket.socket(fileno=a.fd))
                    nursery.start_soon(connection, trio.SocketStream(s), Peer(a.pid, a.uid, a.gid, a.conn,
                                                                      None if a.groups is None else frozenset(a.groups)), a.buf)
                task_status.started()
                await trio.serve_listeners(connection, [listener], handler_nursery=nursery)
    finally:
        if not control.handing_over:
            try:
                os.unlink(path)
            except OSError:
                pass
