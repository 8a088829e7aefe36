"""The bounds of the control sockets' connections (docs/security.md, "The node's doors").

Both sockets (the daemon's own and the containers', control.server) count together:
- per caller the node does not trust — a container (by its pid namespace, control.callers'
  key) or a host user who is neither root nor the admin group (by uid) — MAX_CALLER_CONNS;
- all of those callers together, MAX_CONNS;
- the trusted callers (root and the admin group on the host: the OCI hook, cgpu-runtime, the
  node's tools) in a pool of their own, MAX_TRUSTED_CONNS, that no one else can fill: a flood
  from any number of tenants never keeps a GPU container from starting.
Each pool fits in the open-file limit the daemon raised at start (cgpud.daemon.main,
`raise_open_files`; systemd/cgpud.service's LimitNOFILE): a connection holds FDS_PER_CONN
descriptors, FDS_SPARE are left for the rest of the daemon, so `accept` never meets EMFILE.
A connection past a bound gets one EAGAIN line and is closed at once (`refuse`): but for the first
MAX_LINGER of them at any moment, which wait up to LINGER_S for the request their client sends next
(read and dropped), so that the close comes after it: a client that connects and sends at once
(the daemon, real-time, answers before it sends) then reads the line instead of EPIPE on its send.
Past MAX_LINGER a refusal waits for nothing.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import socket
from collections import Counter

log = logging.getLogger("cgpud")

MAX_CALLER_CONNS = 64  # open connections per untrusted caller (a container's pid namespace, a host uid)
MAX_CONNS = 1024  # open connections of all untrusted callers together
MAX_TRUSTED_CONNS = 1024  # open connections of root and the admin group on the host, a pool of their own
FDS_PER_CONN = 2  # the socket and the caller's pidfd (control.callers)
FDS_SPARE = 512  # the rest of the daemon: FUSE, state, cgroups, pages, the metrics port, a hot upgrade
WANT_OPEN_FILES = FDS_SPARE + FDS_PER_CONN * (MAX_CONNS + MAX_TRUSTED_CONNS)  # 4608
MAX_LINGER = 64  # refused connections that may wait (LINGER_S) for the request their client sends next
LINGER_S = 0.5
BACKLOG = 512  # connections the kernel queues before `accept` (a flood's are refused faster than they come)
SEND_S = 5.0  # an answer sent within this, or its connection is closed (a client that does not read)


def caps(nofile: int) -> tuple[int, int]:
    """(untrusted, trusted) pool sizes within `nofile` open files: both shrink together when the
    limit is lower than they need (never below one caller's worth)."""
    room = max(0, nofile - FDS_SPARE) // FDS_PER_CONN
    if room >= MAX_CONNS + MAX_TRUSTED_CONNS:
        return MAX_CONNS, MAX_TRUSTED_CONNS
    return max(MAX_CALLER_CONNS, room // 2), max(MAX_CALLER_CONNS, room // 2)


def raise_open_files() -> int:
    """The daemon at start: its soft RLIMIT_NOFILE raised to the hard limit (systemd gives a service
    1024 soft unless the unit says otherwise), at most what the pools need. The soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANT_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANT_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d (%s)", soft, want, exc)
    if soft != resource.RLIM_INFINITY and soft < WANT_OPEN_FILES:
        log.warning("open-file limit %d (hard %d): the control sockets take %d and %d connections at most "
                    "(LimitNOFILE=%d or more gives %d and %d)", soft, hard, *caps(soft), WANT_OPEN_FILES,
                    MAX_CONNS, MAX_TRUSTED_CONNS)
    return soft


class Doors:
    """The open connections of both sockets, counted: `enter` says whether one may stay."""

    def __init__(self, nofile: int | None = None) -> None:
        if nofile is None:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            nofile = 1 << 30 if nofile == resource.RLIM_INFINITY else nofile
        self.max_conns, self.max_trusted = caps(nofile)
        self.per_caller: Counter = Counter()  # by untrusted caller
        self.pools: Counter = Counter()  # "untrusted", "trusted"
        self.refused = 0
        self.lingering = 0  # refused connections waiting for their client's request (at most MAX_LINGER)

    def enter(self, trusted: bool, key: tuple, what: str) -> tuple[tuple, str | None]:
        """Count a connection in: (its ticket for `leave`, why it must go or None). `key`: its
        caller (ignored when trusted); `what`: the caller in words."""
        pool = "trusted" if trusted else "untrusted"
        self.pools[pool] += 1
        if not trusted:
            self.per_caller[key] += 1
        ticket = (pool, None if trusted else key)
        why = None
        if not trusted and self.per_caller[key] > MAX_CALLER_CONNS:
            why = f"too many connections from {what} (at most {MAX_CALLER_CONNS} open at once); close some"
        elif self.pools[pool] > (cap := self.max_trusted if trusted else self.max_conns):
            who = "root and the admin group" if trusted else "all callers but root and the admin group"
            why = f"too many connections to the daemon (at most {cap} open at once for {who}); try again"
        if why is not None:
            self.refused += 1
        return ticket, why

    def may_linger(self) -> bool:
        """Whether a refused connection may wait for its client's request (then `lingered()` after)."""
        if self.lingering >= MAX_LINGER:
            return False
        self.lingering += 1
        return True

    def lingered(self) -> None:
        self.lingering -= 1

    def leave(self, ticket: tuple) -> None:
        pool, key = ticket
        self.pools[pool] -= 1
        if key is not None:
            self.per_caller[key] -= 1
            if not self.per_caller[key]:
                del self.per_caller[key]


def refuse(fd: int, why: str) -> None:
    """One EAGAIN line to the connection `fd`, past its bound (nothing here waits)."""
    send_and_drain(fd, json.dumps({"ok": False, "error": "EAGAIN", "message": why}).encode() + b"\n")


def send_and_drain(fd: int, data: bytes = b"") -> None:
    """`data` sent and what the client sent read, without waiting: a close with unread data would
    reset the connection before the client reads what it was sent."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        if data:
            sock.send(data, socket.MSG_DONTWAIT)
        for _ in range(16):
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                break
    except OSError:  # (BlockingIOError: nothing more was sent; or it is gone)
        pass
    finally:
        sock.close()
