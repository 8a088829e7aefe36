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

Peer credentials (SO_PEERCRED) are checked: anyone may read (`hello`,
`query`); changes need root or the admin group. The `gpu_*` ops are open to
every process, but act only on the instance whose cgroup holds the caller.
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
        # Every op of every family: name -> (privileged?, handler). A new op is a
        # method and a row in its family's OPS.
        self.ops: dict[str, tuple[bool, Callable[[dict, Peer], Any]]] = {
            name: (privileged, getattr(self, name))
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
                        resp = control.handle(await control.load(req, peer), peer)
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
