"""The control socket's server: one protocol for `cgpu run`, the container
hook, `cgpu-smi` and tests (docs/control.md).

The protocol (framing, peer credentials, the errno of each refusal) is
control.protocol. The ops come in families, one module each, mixed into
`Control` (each family's `OPS` says which of its methods are ops and whether
they are privileged): control.views (hello, query, stats, trace),
control.instances (register, deregister, the reaper), control.hook (the OCI
hook), control.runtime (cgpu-runtime's prepare), control.memory (simulated
GPU memory). Here: the state they share,
dispatch, and `serve`, the listening loop (with a hot upgrade's handover).

Who may call an op is decided here, once (`admit`), from what the kernel
says of the caller (control.callers: host or container, and the instance
whose cgroup holds it), never by uid alone (SPEC §9, docs/security.md):
- a host process: the views (`hello`, `query`, `stats`, `trace`) and its own
  instance's memory (`gpu_*`); changes (register, deregister, hook, prepare)
  need root or the admin group, on the daemon's own socket;
- a process in a container (root in it or not): only CONTAINER_OPS, each on
  the instance whose cgroup holds it and answering about that one only; in no
  instance, nothing — except, on the daemon's own socket (which only a
  hostPath mount of its directory reaches: the node's own plugins), the views.
The containers are given another socket (`<socket dir>/tenant/`, TENANT_DIR),
whose callers are containers whatever they are.

Connections are bounded on both sockets together, per caller and in all, the
trusted callers in a pool of their own (control.doors). A request read is
answered, one at a time: a stop or a hot upgrade stops a connection between two
requests (what it sent beyond is handed on, or dropped), and a client that does
not read its answer within SEND_S is closed — so neither waits on a connection
longer than one request and SEND_S, whatever it sends.
"""
from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import trio

from cgpud.containers.cgroups import InstanceGroups
from cgpud.containers.spec import DEFAULT_HOOK_PATH
from cgpud.control.callers import TENANT_DIR, Who, classify, host_namespaces
from cgpud.control.doors import BACKLOG, LINGER_S, MAX_CALLER_CONNS, SEND_S, Doors, refuse, send_and_drain
from cgpud.control.hook import Hooks
from cgpud.control.instances import Instances
from cgpud.control.memory import Held, Memory
from cgpud.control.runtime import Runtime
from cgpud.control.protocol import MAX_LINE, TOO_LONG, Peer, Refused, decode_line, encoded, error_response, peer_of
from cgpud.control.views import Views
from cgpud.core.model import Node, quoted
from cgpud.state.durable import Durable

log = logging.getLogger("cgpud")


FAMILIES = (Views, Instances, Hooks, Runtime, Memory)

# What a process in a container may call: each acts on, and answers about, its own instance only.
CONTAINER_OPS = ("hello", "query", "stats", "gpu_alloc", "gpu_free", "gpu_meminfo")
# What the node's own components in containers (a hostPath mount of the socket's directory) may read.
VIEW_OPS = ("hello", "query", "stats", "trace")
MAX_CONTAINER_CONNS = MAX_CALLER_CONNS  # (the name the tests and the bench knew it by)


class Control(Views, Instances, Hooks, Runtime, Memory):
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
        hook_path: str = DEFAULT_HOOK_PATH,
        socket_path: str | None = None,
        library: str | None = None,
        pages_dir: str | None = None,
        gate: bool = False,
    ) -> None:
        self.durable = durable
        # cgpu-runtime's `prepare` writes these into a container's hooks (containers.spec)
        self.hook_path, self.socket_path = hook_path, socket_path
        # the in-container library it puts in prepared containers (if the file is there), and where
        # each container's pages are kept (docs/isolation.md)
        self.library = library
        # whether the instances whose processes carry it are gated at their launches (cgpud.sched.gate)
        # instead of frozen (`cgpud serve --compute`)
        self.gate = gate
        self.pages_dir = pages_dir or os.path.join(os.path.dirname(socket_path or "/run/cgpud/cgpud.sock"), "pages")
        self.client_env = client_env  # mps mode: the environment an instance's processes need (cgpud/gpus/mps.py)
        self.watchdog = None  # real GPUs: the memory watchdog (cgpud/gpus/memwatch.py), set by the daemon
        self._stats = stats
        self.tracer: Callable[[float, int | None], list[dict]] | None = None  # Scheduling.trace (trace.collect)
        self.strategy, self.mode = strategy, mode  # placement: how the container hook picks GPUs
        self.devices = devices or []
        self.admin_gid = admin_gid
        self.groups = groups
        self.hosts = host_namespaces()  # (pid, mount) namespaces that are the host's (control.callers)
        self.asking: str | None = None  # the instance of the container whose request runs now (admit)
        # bench/attacks.py only (the environment of the daemon, which only the host sets): the uid rule
        # of before, no classification, to measure what the checks cost in the same run
        self.old_classes = os.environ.get("CGPUD_BENCH_UID_ONLY") == "1"
        # name -> the connection that made its cgroup (absent: the connection is gone)
        self.owners: dict[str, int] = {}
        self.live_conns: set[int] = set()
        # Our cgroups of deregistered instances that still held processes: the reaper removes them.
        self.pending_groups: set[str] = set()
        # Simulated GPU memory by connection, then by handle. Not durable state:
        # it goes with the connection (the process), never into state.json.
        self.held: dict[int, dict[int, Held]] = {}
        self.held_count: Counter[str] = Counter()  # allocations held, by instance (control.memory's bounds)
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
        # Every op of every family: name -> (privileged?, handler). A new op is a
        # method and a row in its family's OPS.
        self.ops: dict[str, tuple[bool, Callable[[dict, Peer], Any]]] = {
            name: (privileged, getattr(self, getattr(family, "METHODS", {}).get(name, name)))
            for family in FAMILIES for name, privileged in family.OPS.items()
        }
        # Ops whose blocking part (files) runs first, in the serving task: name -> its loader
        self.loaders = {name: getattr(self, method) for family in FAMILIES
                        for name, method in getattr(family, "LOADERS", {}).items()}

    async def load(self, req: Any, peer: Peer) -> Any:
        """Before `handle`, in the serving task: the blocking part of a
        privileged request (a bundle's config.json read or written, in a
        worker thread with a time limit), by its family's loader."""
        if isinstance(req, dict) and isinstance(req.get("op"), str) and req["op"] in self.loaders \
                and self.privileged(peer):
            return await self.loaders[req["op"]](req, peer)
        return req

    @property
    def node(self) -> Node:
        return self.durable.node

    def privileged(self, peer: Peer) -> bool:
        """Root or the admin group, on the host, on the daemon's own socket."""
        if self.old_classes:
            return peer.uid == 0 or (self.admin_gid is not None and self.admin_gid in peer.groups())
        return not peer.who.container and peer.socket == "host" and (
            peer.uid == 0 or (self.admin_gid is not None and self.admin_gid in peer.groups()))

    def in_container_group(self, pid: int) -> bool:
        """Whether `pid` is inside the cgroup of a container cgpud manages (control.callers)."""
        return self.instance_named_by_cgroup(pid, containers_only=True) is not None

    def own_instance(self, peer: Peer) -> str | None:
        """The instance whose cgroup holds a container's caller (None: none); EPERM
        when the process that connected is gone (its pid may be another's by now)."""
        try:
            name = self.instance_named_by_cgroup(peer.pid) if peer.pid > 0 else None
        except (OSError, ValueError):
            name = None
        if peer.who.pidfd >= 0 and not peer.who.alive():
            raise Refused(errno.EPERM, f"pid {peer.pid}, which connected, is gone: "
                                       "a container asks from the process that connected")
        return name

    def admit(self, op: str, needs_priv: bool, peer: Peer) -> str | None:
        """Whether `peer` may call `op`: the one place it is decided (SPEC §9).
        For a container, the instance it may act on and see (None: the node's
        own components, which see the node)."""
        if self.old_classes:
            if needs_priv and not self.privileged(peer):
                raise Refused(errno.EACCES, f"{op} needs root or the admin group")
            return None
        who = peer.who
        if who.container:
            mine = self.own_instance(peer)
            if mine is None:
                if peer.socket == "host" and op in VIEW_OPS:
                    return None  # the node's own components (a hostPath mount): the views, read only
                raise Refused(errno.EPERM, f"{who.why}, in no cgpud instance: a container that cgpud does not "
                                           "manage may do nothing on this socket")
            if op not in CONTAINER_OPS:
                raise Refused(errno.EACCES, f"{op} is for the host only ({who.why}): a container may call only "
                                            f"{', '.join(CONTAINER_OPS)}, each on its own instance")
            return mine
        if needs_priv and not self.privileged(peer):
            where = "" if peer.socket == "host" else " (and never on the containers' socket)"
            raise Refused(errno.EACCES, f"{op} needs root or the admin group{where}")
        return None

    def handle(self, req: Any, peer: Peer) -> dict:
        try:
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise Refused(errno.EINVAL, 'a request is a JSON object with a string "op"')
            entry = self.ops.get(req["op"])
            if entry is None:
                raise Refused(errno.EINVAL, f"unknown op {quoted(req['op'])}; known: {', '.join(sorted(self.ops))}")
            needs_priv, fn = entry
            # (read by the views: a container sees its own instance only; handlers run whole, synchronously)
            self.asking = self.admit(req["op"], needs_priv, peer)
            try:
                return {"ok": True, "result": fn(req, peer)}
            finally:
                self.asking = None
        except Exception as exc:  # a bug must cost one request, never the daemon
            return error_response(exc, req)



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
        sock.listen(BACKLOG)
    else:
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=listen_fd))
    control.listen_fd = sock.fileno()
    listener = trio.SocketListener(sock)
    # The containers' socket: a directory of its own beside ours, all that Allocate / CDI mount into a
    # container (read-only, at our directory's path). Made anew by each daemon (a hot upgrade's too:
    # the directory is mounted, not the file, so containers see the new one).
    tenant_path = tenant_socket(path)
    tenant = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listeners = [listener]
    try:
        os.makedirs(os.path.dirname(tenant_path), mode=0o755, exist_ok=True)
        try:
            os.unlink(tenant_path)
        except FileNotFoundError:
            pass
        await tenant.bind(tenant_path)
        os.chmod(tenant_path, 0o666)
        tenant.listen(BACKLOG)
        listeners.append(trio.SocketListener(tenant))
    except OSError as exc:  # (a path too long for a socket, a read-only directory: containers get no socket)
        log.warning("cannot make the containers' socket %s (%s); containers given it cannot reach the daemon",
                    tenant_path, exc.strerror or exc)
    doors = Doors()  # both sockets' connections, counted together (control.doors)

    conn_ids = iter(range(max([a.conn for a in adopted], default=0) + 1, 1 << 62))

    def peer_on(s: socket.socket, conn: int) -> Peer:
        p = peer_of(s)
        try:
            on = "tenant" if s.getsockname() == tenant_path else "host"
        except OSError:
            on = "tenant"
        if control.old_classes:
            return Peer(p.pid, p.uid, p.gid, conn, p.supplementary, socket=on)
        who = classify(s, p.pid, control.hosts, control.in_container_group)
        if on == "tenant" and not who.container:  # (whoever comes on the containers' socket is one)
            who = Who(True, f"pid {p.pid} connected on the containers' socket", who.pidfd)
        return Peer(p.pid, p.uid, p.gid, conn, p.supplementary, who, on)

    async def connection(stream: trio.SocketStream, peer: Peer | None = None, buf: bytes = b"") -> None:
        try:
            peer = peer_on(stream.socket, peer.conn if peer is not None else next(conn_ids))  # type: ignore[arg-type]
        except OSError:  # gone before we looked
            await stream.aclose()
            return
        trusted = control.privileged(peer)
        key = peer.who.key if peer.who.container and peer.who.key is not None else ("uid", peer.uid)
        ticket, why = doors.enter(trusted, key, "this container" if peer.who.container else f"uid {peer.uid}")
        try:
            if why is not None:
                refuse(stream.socket.fileno(), why)
                if doors.may_linger():
                    try:  # (its client's request, if it comes soon: the close after it, control.doors)
                        with trio.move_on_after(LINGER_S):
                            await trio.lowlevel.wait_readable(stream.socket)
                        send_and_drain(stream.socket.fileno())
                    finally:
                        doors.lingered()
                await stream.aclose()
                return
            await _connection(stream, peer, buf)
        finally:
            doors.leave(ticket)
            peer.who.close()

    async def _connection(stream: trio.SocketStream, peer: Peer, buf: bytes) -> None:
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
            if b"\n" not in pending.buf:  # between two requests: where a stop or a handover may stop us
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                pending.buf += data
            else:  # (another request already read: a stop still comes first)
                await trio.lowlevel.checkpoint_if_cancelled()
            end = pending.buf.find(b"\n")
            if end > MAX_LINE or (end < 0 and len(pending.buf) > MAX_LINE):
                try:  # (the rest of an overlong line cannot be told from the next request: close)
                    with trio.move_on_after(SEND_S):
                        await stream.send_all(json.dumps(TOO_LONG).encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                return
            if end < 0:
                continue
            line, pending.buf = pending.buf[:end], pending.buf[end + 1:]
            if not line.strip():
                continue
            with trio.CancelScope(shield=True):  # a request read is answered (one: the next waits its turn)
                req = decode_line(line)
                if isinstance(req, Refused):
                    resp = {"ok": False, "error": errno.errorcode[req.code], "message": str(req)}
                else:
                    resp = control.handle(await control.load(req, peer), peer)
                    await after()
                try:
                    with trio.fail_after(SEND_S):
                        await stream.send_all(await encoded(resp))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                except trio.TooSlowError:  # it does not read what it asked for: its answers stop here
                    log.info("control connection %d (pid %d) read no answer in %.0f s; closed", peer.conn,
                             peer.pid, SEND_S)
                    pending.buf = b""
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
                await trio.serve_listeners(connection, listeners, handler_nursery=nursery)
    finally:
        tenant.close()
        if not control.handing_over:
            for p in (path, tenant_path):
                try:
                    os.unlink(p)
                except OSError:
                    pass


def tenant_socket(path: str) -> str:
    """The containers' socket of the daemon whose socket is `path`: `<dir>/tenant/<same name>`
    (mounted at `<dir>` in a container, it is where a client there looks: `path`)."""
    return os.path.join(os.path.dirname(path) or ".", TENANT_DIR, os.path.basename(path))
