"""Serving a FUSE connection that can be paused, resumed and handed to
another process without unmounting (docs/upgrade.md).

libfuse lets a process serve a connection it did not mount: give
`/dev/fd/N` as the mount point and it serves the open `/dev/fuse` descriptor
N. The catch is the handshake: the kernel sends FUSE_INIT once per
connection, to whoever mounted it, and a libfuse session that has not seen
FUSE_INIT answers every other request with EIO (`se->got_init`). So a process
that takes over a live connection first runs its session on one end of a
socketpair, feeds it a FUSE_INIT made here (the reply goes back into the
socketpair and is dropped), pauses it, and only then puts the real
`/dev/fuse` descriptor under the same number (dup2). From then on it answers
the kernel's requests as the old process did.

Pausing must never drop a request: `pyfuse3.main` is never cancelled while a
handler holds a request. `FuseServer.pause` waits until no handler is in
flight (the Operations count them), then wakes the loop's readers with
`notify_closing`, which makes them return without reading; a reader that
already took a request finishes it first. The session itself stays open
(unlike `pyfuse3.terminate`), so `resume` serves again: a failed handover
rolls back.

Both processes must agree on inode and file-handle numbers: the kernel keeps
them. `Operations.export_state` / `import_state` carry them over.
"""
from __future__ import annotations

import logging
import os
import socket
import struct

import pyfuse3
import trio

from . import mount

log = logging.getLogger("fusefs")

FUSE_INIT = 26
# What we tell the new session the kernel offers. The kernel already agreed
# on the connection's features with the process that mounted it; the session
# only needs a protocol at least as new as the one in use (reply layouts are
# the same from 7.23 on) and READDIRPLUS (pyfuse3 refuses a kernel without it).
INIT_MINOR = 31
# ASYNC_READ ATOMIC_O_TRUNC BIG_WRITES DO_READDIRPLUS PARALLEL_DIROPS MAX_PAGES: without MAX_PAGES libfuse
# would size its buffer for 128 KiB writes, and the kernel refuses reads into a buffer
# smaller than the max_write it agreed on at mount (EINVAL).
INIT_FLAGS = (1 << 0) | (1 << 3) | (1 << 5) | (1 << 13) | (1 << 18) | (1 << 22)
_IN_HEADER = struct.Struct("<IIQQIIIHH")
_INIT_IN = struct.Struct("<IIII" + "I" * 12)


class HandoverError(Exception):
    """A connection could not be taken over; the message says why."""


def init_request(unique: int = 1) -> bytes:
    """A FUSE_INIT request as the kernel would send it."""
    body = _INIT_IN.pack(7, INIT_MINOR, 128 * 1024, INIT_FLAGS, *([0] * 12))
    return _IN_HEADER.pack(_IN_HEADER.size + len(body), FUSE_INIT, unique, 0, 0, 0, 0, 0, 0) + body


def find_fuse_fd() -> int:
    """This process's open /dev/fuse descriptor (pyfuse3 serves one)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                return int(name)
        except OSError:
            continue
    raise HandoverError("this process holds no /dev/fuse descriptor")


class FuseServer:
    """pyfuse3's one session: mount (or take over) and serve, pause and
    resume, hand over. `ops` must count its handlers in flight
    (`ops.in_flight`, as fusefs.operations.Operations does)."""

    def __init__(self, ops: pyfuse3.Operations, mountpoint: str) -> None:
        self.ops = ops
        self.mountpoint = mountpoint
        self.fd = -1
        self.mounted = False  # by mount() (not by a takeover)
        self.adopted = False      # we took the connection over: libfuse does not know the mount point
        self.handed_over = False  # another process serves it now: leave the mount alone at the end
        self._stopped = trio.Event()  # pyfuse3.main is not running
        self._stopped.set()
        self._resume = trio.Event()
        self._pause_wanted = False
        self._ended = False

    # ---- start ------------------------------------------------------------------

    def mount(self, opts: set[str]) -> None:
        try:
            pyfuse3.init(self.ops, self.mountpoint, opts)
        except RuntimeError as exc:
            raise mount.MountError(f"mounting {self.mountpoint} failed ({exc}); see the lines above from libfuse") from None
        self.mounted = True
        self.fd = find_fuse_fd()

    async def prepare_takeover(self) -> None:
        """Start a session that is ready to serve a live connection: it has
        seen FUSE_INIT (from a socketpair) and is paused. `takeover(fd)` then
        puts the real descriptor in place."""
        ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.fd = ours.detach()
        try:
            pyfuse3.init(self.ops, f"/dev/fd/{self.fd}", set())
        except RuntimeError as exc:
            peer.close()
            raise HandoverError(f"libfuse refused /dev/fd/{self.fd} ({exc})") from None
        self.adopted = True
        with peer:
            peer.setblocking(False)
            peer.send(init_request())
            async with trio.open_nursery() as nursery:
                self._stopped = trio.Event()
                nursery.start_soon(self._main)
                with trio.fail_after(10):
                    while True:
                        await trio.lowlevel.wait_readable(peer.fileno())
                        try:
                            reply = peer.recv(4096)
                        except BlockingIOError:
                            continue
                        break
                # fuse_out_header: len, error, unique
                _, error, unique = struct.unpack_from("<IiQ", reply)
                if error != 0 or unique != 1:
                    raise HandoverError(f"the new session refused FUSE_INIT (error {error})")
                await self.pause()
            self._pause_wanted = False
            self.ops.pausing = False

    def takeover(self, fuse_fd: int) -> None:
        """Serve `fuse_fd` (an open /dev/fuse of a live mount) from now on,
        under the number the session was made with. Call while paused."""
        assert self._stopped.is_set()
        os.dup2(fuse_fd, self.fd, inheritable=False)
        if fuse_fd != self.fd:
            os.close(fuse_fd)

    # ---- serving --------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until unmounted from outside or terminated; paused in between
        when asked. The end: unmount, unless handed over."""
        try:
            task_status.started()
            await self._loop()
        finally:
            self._end()

    async def _main(self) -> None:
        try:
            await pyfuse3.main(min_tasks=1, max_tasks=64)
        finally:
            self._stopped.set()

    async def _loop(self) -> None:
        while True:
            self._stopped = trio.Event()
            await self._main()
            if not self._pause_wanted:
                return  # terminated, or the kernel ended the connection
            await self._resume.wait()
            self._resume = trio.Event()
            self._pause_wanted = False

    async def pause(self) -> None:
        """Stop reading requests; returns once no request is held. Requests
        that arrive meanwhile wait in the kernel."""
        self._pause_wanted = True
        stopped = self._stopped
        # A write that removed a directory waits for the kernel to drop its
        # entry, which may wait for a lookup of that directory: one this loop
        # will no longer read. While pausing, writes hand the invalidation to
        # pyfuse3's own thread instead (the kernel drops it once served again).
        self.ops.pausing = True
        t0 = trio.current_time()
        told = False
        while not stopped.is_set():
            if not told and trio.current_time() - t0 > 2:
                told = True
                log.warning("pausing FUSE takes long: %d handlers still in flight; tasks:\n%s", self.ops.in_flight,
                            "\n".join(_task_tree(trio.lowlevel.current_root_task())))
            # Wakes the reader that waits for the descriptor: it returns without
            # reading, and the next one takes its place, woken next turn; at every
            # turn of the loop, not once a millisecond: a reader that reads a
            # request while no other waits starts another, and at the slower pace
            # a busy tree kept the loop alive as long as its traffic lasted (seen:
            # 10-30 s). Never while a handler runs: it may need a request answered
            # (a write's invalidation started before the pause waits for a lookup).
            if self.ops.in_flight == 0:
                trio.lowlevel.notify_closing(self.fd)
            await trio.sleep(0)

    def resume(self) -> None:
        self.ops.pausing = False
        self._resume.set()

    def close(self) -> None:
        """Unmount a tree that was mounted but never served (a start refused after the mount); once."""
        if self.mounted:
            self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.handed_over:
            pyfuse3.close(unmount=False)
            return
        if self.adopted:
            # libfuse knows no mount point for a connection it took over: unmount it ourselves
            try:
                mount.unmount(self.mountpoint, lazy=True)
            except mount.MountError as exc:
                log.warning("%s", exc)
            pyfuse3.close(unmount=False)
            return
        pyfuse3.close(unmount=True)


def _task_tree(task, depth: int = 0) -> list[str]:
    """Where each trio task waits (for a log line when a pause takes long)."""
    where, c = "", task.coro
    while c is not None:
        frame = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None)
        if frame is not None:
            where = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        c = getattr(c, "cr_await", None) or getattr(c, "gi_yieldfrom", None)
    out = [f"{'  ' * depth}{task.name} @ {where}"]
    for nursery in task.child_nurseries:
        for t in nursery.child_tasks:
            out += _task_tree(t, depth + 1)
    return out


def dup_for_child(fd: int) -> int:
    """An inheritable copy of `fd` for a child process."""
    new = os.dup(fd)
    os.set_inheritable(new, True)
    return new

