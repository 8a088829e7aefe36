"""Hot upgrade: hand the running daemon to the code installed on disk, with
the mount, the control socket, the client connections, the instances and
the settings kept (SPEC §7, docs/upgrade.md).

    echo 1 > /run/cgpu_km/upgrade

1. The old daemon starts the new one (the same command line, from disk),
   joined by a socketpair (`CGPUD_HANDOVER_FD`). The new one loads, builds its
   tree and makes a FUSE session ready to take the connection over
   (fusefs.handover), then says `ready`. Until then the old one serves as
   usual; if the new one fails to get ready, the write fails (EIO), reading
   `upgrade` says why, and nothing changed.
2. The write returns. The old daemon then stops between two requests: the
   control socket (each connection between two requests), the reaper, the
   scheduler (which thaws everything and stops its guard), then FUSE
   (requests that arrive now wait in the kernel).
3. `go`: the old daemon sends its tables (inode and file-handle numbers,
   connection owners, simulated GPU memory) and passes the /dev/fuse
   descriptor, the listening socket and every open client connection.
4. The new daemon reloads state.json (now final), takes all of it over,
   starts its scheduler (which freezes again by the policy), serves, and
   says `serving`. The old one exits without unmounting; under systemd it
   first names the new main PID.

If the new daemon does not say `serving` in time, the old one kills it and
serves again with everything it still holds (a rollback).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

import trio

from fusefs.handover import FuseServer, HandoverError

from cgpud import __version__
from cgpud.control.memory import Held
from cgpud.control.server import Adopted, Control
from cgpud.daemon import handconns
from cgpud.daemon.sdnotify import notify
from cgpud.state.lock import LOCK_ENV

log = logging.getLogger("cgpud")

ENV = "CGPUD_HANDOVER_FD"
READY_TIMEOUT = 30.0    # the new daemon's start-up: imports, state, tree, session
SERVING_TIMEOUT = 10.0  # from `go` to `serving`
MAX_MSG = 4 << 20


class UpgradeError(Exception):
    """The handover failed; the message is one line for a person."""


# ---- the socketpair between the two daemons ------------------------------------------------


async def send(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    while True:
        try:
            socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
            return
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock.fileno())


async def receive(sock: socket.socket, timeout: float) -> tuple[dict, list[int]]:
    with trio.fail_after(timeout):
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 512)
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock.fileno())
    if not data:
        raise UpgradeError("the other daemon closed the handover socket")
    return json.loads(data), list(fds)


# ---- what a handover carries besides the descriptors -------------------------------------------


def control_state(ctl: Control) -> dict:
    return {
        "owners": ctl.owners,
        "live_conns": sorted(ctl.live_conns),
        "pending_groups": sorted(ctl.pending_groups),
        "our_paths": sorted(ctl._our_paths),
        "held": [[h, asdict(x)] for conn in ctl.held.values() for h, x in conn.items()],
        "next_handle": next(ctl._handles),
    }


def restore_control(ctl: Control, st: dict) -> None:
    """Ownership and memory as the old daemon had them: a `cgpu run` whose
    connection came over keeps its instance; memory stays allocated."""
    import itertools

    ctl.owners.update({k: int(v) for k, v in st["owners"].items()})
    ctl.live_conns.update(st["live_conns"])
    ctl.pending_groups.update(st["pending_groups"])
    ctl._our_paths = set(st["our_paths"])
    for handle, h in st["held"]:
        held = Held(**h)
        try:
            ctl.node.alloc(held.gpu, held.name, held.pid, held.nbytes)
        except Exception as exc:  # noqa: BLE001 - the instance went meanwhile: its memory with it
            log.warning("allocation %d of %s not carried over (%s)", handle, held.name, exc)
            continue
        ctl.hold(int(handle), held)
    ctl._handles = itertools.count(st["next_handle"])


# ---- the state of the last upgrade, as `upgrade` reads ---------------------------------------------


class Status:
    def __init__(self, text: str = "none") -> None:
        self.text = text

    def done(self, version: str) -> None:
        self.text = f"done {version} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"

    def failed(self, reason: str) -> None:
        self.text = "failed: " + " ".join(reason.split())


# ---- the old daemon's side ---------------------------------------------------------------------------


class Upgrader:
    """Answers `echo 1 > upgrade`. The daemon sets `services`, `fuse` and
    `nursery` once they exist; `on_handed_over` is called when the new
    daemon serves (the old one then ends without unmounting)."""

    def __init__(self, status: Status) -> None:
        self.successor: int | None = None  # the new daemon's pid, once it serves
        self.lock_fd: int | None = None  # the state directory's lock (cgpud.state.lock), passed on
        self.status = status
        self.services: Any = None
        self.fuse: FuseServer | None = None
        self.nursery: trio.Nursery | None = None
        self.on_handed_over: Callable[[], None] = lambda: None
        self.busy = False
        self.handed_over = False

    async def request(self) -> None:
        """Start the new daemon and wait until it is ready; the switch
        itself runs after this returns (and the write with it)."""
        if self.busy:
            raise OSError(errno.EBUSY, "an upgrade is in progress")
        if self.fuse is None or self.nursery is None:
            raise OSError(errno.EAGAIN, "the daemon is still starting")
        self.busy = True
        self.status.text = "in progress"
        try:
            proc, sock = await self._start_new()
        except UpgradeError as exc:
            self.busy = False
            self.status.failed(str(exc))
            log.error("hot upgrade failed: %s; still serving with version %s", exc, __version__)
            raise OSError(errno.EIO, str(exc)) from None
        self.nursery.start_soon(self._switch, proc, sock)

    async def _start_new(self) -> tuple[subprocess.Popen, socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        env = dict(os.environ, **{ENV: str(theirs.fileno())})
        fds = [theirs.fileno()]
        if self.lock_fd is not None:  # the state directory's lock goes with the rest (cgpud.state.lock)
            env[LOCK_ENV] = str(self.lock_fd)
            fds.append(self.lock_fd)
        argv = list(sys.orig_argv)
        log.info("hot upgrade: starting %s", " ".join(argv))
        try:
            proc = subprocess.Popen(argv, env=env, pass_fds=fds, stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise UpgradeError(f"cannot start {argv[0]}: {exc.strerror}") from None
        finally:
            theirs.close()
        try:
            msg, _ = await receive(ours, READY_TIMEOUT)
        except (UpgradeError, trio.TooSlowError, ValueError) as exc:
            _kill(proc)
            ours.close()
            why = "it took too long" if isinstance(exc, trio.TooSlowError) else str(exc)
            raise UpgradeError(f"the new daemon did not get ready ({why}; exit status {proc.poll()}); see its log") from None
        if msg.get("op") != "ready":
            _kill(proc)
            ours.close()
            raise UpgradeError(f"the new daemon refused: {msg.get('error', msg)}")
        log.info("hot upgrade: the new daemon (pid %d, version %s) is ready; handing over", proc.pid, msg.get("version"))
        return proc, ours

    async def _switch(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        fuse, services = self.fuse, self.services
        assert fuse is not None
        t0 = time.monotonic()
        keep_listen = services.listen_dup()
        # The control socket first, while FUSE still serves: a request that removed
        # an instance invalidates the kernel's dentry, which may need a lookup answered.
        await services.stop(handing_over=True)
        t1 = time.monotonic()
        await fuse.pause()
        t2 = time.monotonic()
        log.info("hot upgrade: services stopped in %.0f ms, FUSE paused in %.0f ms", (t1 - t0) * 1000, (t2 - t1) * 1000)
        try:
            fds = [fuse.fd, keep_listen if keep_listen >= 0 else fuse.fd]
            conns, _ = handconns.batches(services.handed())  # (after `go`: cgpud.daemon.handconns)
            payload = {"op": "go", "ops": fuse.ops.export_state(), "control": services.control_state(),
                       "from_version": __version__, "from_pid": os.getpid(), "conn_batches": len(conns)}
            await send(sock, payload, fds)
            for metas, conn_fds in conns:
                await send(sock, {"op": "conns", "conns": metas}, conn_fds)
            msg, _ = await receive(sock, SERVING_TIMEOUT)
            if msg.get("op") != "serving":
                raise UpgradeError(f"the new daemon failed: {msg.get('error', msg)}")
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, this daemon serves again
            if isinstance(exc, trio.TooSlowError):
                why = "the new daemon did not answer in time"
            elif isinstance(exc, (UpgradeError, OSError)):
                why = str(exc)
            else:
                why = f"internal error ({exc!r})"
                log.exception("hot upgrade")
            _kill(proc)
            sock.close()
            log.error("hot upgrade failed after the switch began (%s): serving again with version %s", why, __version__)
            self.status.failed(why)
            await services.start_again(keep_listen)
            fuse.resume()
            self.busy = False
            return
        sock.close()
        os.close(keep_listen)
        log.info("hot upgrade: pid %d serves now (switch took %.0f ms); this daemon (version %s) ends",
                 proc.pid, (time.monotonic() - t0) * 1000, __version__)
        notify(f"MAINPID={proc.pid}")
        self.successor = proc.pid
        self.handed_over = True
        fuse.handed_over = True
        self.on_handed_over()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


# ---- the new daemon's side ---------------------------------------------------------------------------


class Takeover:
    """The new daemon, started by an old one: `prepare` gets a FUSE session
    ready, says `ready` and waits for `go`; `serving` ends the exchange."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.go: dict = {}
        self.fuse_fd = -1
        self.listen_fd = -1
        self.adopted: list[Adopted] = []
        self.state_dir: str | None = None  # set when this daemon schedules: its guard starts ahead
        self.guard = None

    @classmethod
    def from_env(cls) -> "Takeover | None":
        raw = os.environ.pop(ENV, None)
        if raw is None:
            return None
        try:
            return cls(int(raw))
        except (ValueError, OSError) as exc:
            raise UpgradeError(f"{ENV}={raw!r} is not a usable socket ({exc})") from None

    async def prepare(self, fuse: FuseServer) -> None:
        try:
            await fuse.prepare_takeover()
        except (HandoverError, trio.TooSlowError) as exc:
            await send(self.sock, {"op": "refused", "error": str(exc)})
            raise UpgradeError(str(exc)) from None
        if self.state_dir is not None:
            # Our guard, ready before the switch (starting a process is the slowest step).
            # Should we die before `go`, it thaws what the old daemon froze: a glitch in
            # its schedule, never a container left frozen.
            from cgpud.sched.guard import Guard, GuardError, registry_path

            try:
                self.guard = Guard.start(registry_path(self.state_dir))
            except (GuardError, OSError) as exc:
                log.warning("the guard did not start ahead (%s): starting it after the switch", exc)
        await send(self.sock, {"op": "ready", "version": __version__, "pid": os.getpid()})
        # No limit: the old daemon decides when (it has already returned the write).
        msg, fds = await receive(self.sock, float("inf"))
        if msg.get("op") != "go" or len(fds) < 2:
            raise UpgradeError(f"unexpected message from the old daemon: {msg.get('op')!r}")
        self.go = msg
        self.fuse_fd, self.listen_fd = fds[0], fds[1]
        # (a daemon of before issue 44 sends its connections in `go` itself; ours in batches after it)
        self.adopted = [Adopted(fd=fd, **{**c, "buf": c["buf"].encode("latin-1")})
                        for fd, c in zip(fds[2:], msg["control"].get("conns") or ())]
        for _ in range(msg.get("conn_batches", 0)):  # (the connections, in batches: cgpud.daemon.handconns)
            more, conn_fds = await receive(self.sock, SERVING_TIMEOUT)
            if more.get("op") != "conns" or len(conn_fds) != len(more["conns"]):
                raise UpgradeError(f"unexpected message from the old daemon: {more.get('op')!r}")
            self.adopted += [Adopted(fd=fd, **{**c, "buf": c["buf"].encode("latin-1")})
                             for fd, c in zip(conn_fds, more["conns"])]
        log.info("hot upgrade: taking over from pid %d (version %s)", msg["from_pid"], msg["from_version"])

    def service_args(self) -> dict:
        return {"listen_fd": self.listen_fd, "adopted": self.adopted, "guard": self.guard}

    async def serving(self) -> None:
        try:
            await send(self.sock, {"op": "serving", "pid": os.getpid()})
        except OSError as exc:  # the old daemon is gone: we serve on, it cannot
            log.warning("hot upgrade: could not tell the old daemon (%s); serving anyway", exc.strerror)
        self.sock.close()
        notify(f"MAINPID={os.getpid()}")  # (the old daemon says so too: whichever systemd accepts)

    async def failed(self, reason: str) -> None:
        try:
            await send(self.sock, {"op": "failed", "error": reason})
        except OSError:
            pass


async def take_over(t: Takeover, fuse: FuseServer, services, ops, store, status: Status,
                    state_dir: str | None) -> None:
    """The new daemon: get ready, wait for `go`, then take the old daemon's
    state: state.json (final now), inode and handle numbers, connection
    owners and simulated memory. `state_dir`: where the guard's registry is
    (None: this daemon does not schedule)."""
    t.state_dir = state_dir
    await t.prepare(fuse)
    state = store.load()
    if state is not None:
        services.durable.node.load_state(state)
    ops.import_state(t.go["ops"])
    if services.ctl is not None:
        restore_control(services.ctl, t.go["control"])
    elif t.listen_fd >= 0:
        os.close(t.listen_fd)
        t.listen_fd = -1
    status.done(__version__)


# ---- cold upgrade ------------------------------------------------------------------------------------

COLD_EXIT = 75  # EX_TEMPFAIL: the service manager starts the daemon again, with the code on disk


def cold_op(ctl: Control, stop: Callable[[], None]):
    """The control op `cold_upgrade` (root or the admin group): refused with
    EBUSY while any instance exists, as the product's upgrade.sh refuses;
    otherwise the daemon stops (its exit status COLD_EXIT) so that the
    service manager restarts it with the installed code."""
    from cgpud.control.protocol import Refused

    def op(req: dict, peer) -> dict:
        names = sorted({i.name for i in ctl.node.instances()})
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise Refused(errno.EBUSY, f"{len(names)} instance(s) exist ({shown}): stop their containers first, "
                                       "or upgrade hot with `cgpud upgrade` (echo 1 > upgrade), which keeps them")
        log.info("cold upgrade asked by pid %d: no instances; stopping so that the service manager starts "
                 "the installed code (exit status %d)", peer.pid, COLD_EXIT)
        stop()
        return {"pid": os.getpid(), "version": __version__, "exit_status": COLD_EXIT}

    return op


# ---- the command line's side (cgpud upgrade) -----------------------------------------------------------


def hot_upgrade(mountpoint: str) -> str:
    """Write `1` to the tree's `upgrade`; the line to print. ClickException
    (one line) when it fails."""
    import click

    path = os.path.join(mountpoint, "upgrade")
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"1\n")
        finally:
            os.close(fd)
    except OSError as exc:
        try:
            with open(path) as f:
                said = f.read().strip()
        except OSError:
            said = ""
        detail = f" ({said})" if said.startswith("failed") else ""
        raise click.ClickException(f"hot upgrade through {path} failed: {exc.strerror}{detail}") from None
    return f"hot upgrade started: the new daemon is ready and takes over now (cat {path} to follow)"


def cold_upgrade(socket_path: str) -> str:
    import click

    from cgpud.client import Client, ControlError, DaemonUnavailable

    try:
        with Client(socket_path) as c:
            r = c.call("cold_upgrade")
    except (DaemonUnavailable, ControlError) as exc:
        raise click.ClickException(f"cold upgrade refused: {exc}") from None
    return (f"cgpud {r['version']} (pid {r['pid']}) is stopping (exit status {r['exit_status']}); "
            "the service manager starts the installed code")
