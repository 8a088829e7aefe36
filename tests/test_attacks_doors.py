"""Attacks on the node's open doors: the control sockets (issue 44, docs/security.md "The node's doors").

Each is a real daemon and real client processes on the host (the containers' flood through podman is
tests/test_attacks.py's): many callers holding connections open at once, one caller that pipelines
requests and never reads their answers, one-byte allocations without end. Before this, the flood
made `accept` fail with EMFILE at the daemon's open-file limit and every start of a GPU container
failed; the reader that never reads kept a stop (and a hot upgrade) waiting for hours; the
allocations grew the daemon's table without bound.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cgpud.client import Client
from cgpud.control.doors import MAX_CALLER_CONNS, MAX_CONNS, SEND_S
from cgpud.control.memory import MAX_HELD_PER_CONN, MAX_HELD_PER_INSTANCE
from test_upgrade import subreaper, upgrade  # noqa: F401  (the fixture)

# A flooder: N connections to SOCKET held open, a hello on each; prints "answered A refused R closed C",
# then holds them all until its stdin closes.
FLOOD = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
held, answered, refused, closed = [], 0, 0, 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    try:
        s.connect(path)
        try:
            s.sendall(b'{"op": "hello"}\n')
        except OSError:
            pass  # (refused and closed already: its answer is still there to read)
        line = s.makefile("rb").readline()
    except OSError:
        line = b""
    if not line:
        closed += 1
    elif json.loads(line).get("error") == "EAGAIN":
        refused += 1
    else:
        answered += 1
    held.append(s)
print("answered", answered, "refused", refused, "closed", closed, flush=True)
sys.stdin.read()
"""


def _systemd_soft_limit(make_daemon, **kw):
    """A daemon started as systemd starts a service whose unit says nothing: 1024 open files (soft)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        return make_daemon(**kw)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _flooders(path: Path, per: int, uids: list[int]) -> list[subprocess.Popen]:
    # (the system's Python: the flooders are other users, and the venv's may be under /root)
    return [subprocess.Popen(["/usr/bin/python3", "-I", "-c", FLOOD, os.fspath(path), str(per)], user=uid, group=65534,
                             extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for uid in uids]


def test_a_flood_from_many_users_is_bounded_in_all_and_root_is_still_served(make_daemon):
    """20 host users, 60 connections each (under the per-caller bound, 1,200 in all: past the bound
    of everyone but root and the admin group, and past what 1,024 open files hold). Before: the
    daemon's accept failed with EMFILE and root's hello (the OCI hook's register) got no answer."""
    d = _systemd_soft_limit(make_daemon)
    per, uids = MAX_CALLER_CONNS - 4, list(range(61000, 61020))
    procs = _flooders(d.socket, per, uids)
    try:
        counts = [p.stdout.readline().split() for p in procs]
        answered = sum(int(c[1]) for c in counts)
        refused = sum(int(c[3]) for c in counts)
        assert answered == MAX_CONNS and refused == per * len(uids) - MAX_CONNS, counts
        t0 = time.monotonic()
        with Client(os.fspath(d.socket), timeout=5) as c:  # (root: the trusted pool, which no flood fills)
            assert c.call("hello")["privileged"] is True
            c.call("register", name="doors0000001", gpus=[0], memsize=1 << 30)
            assert "doors0000001" in d.instances(0)
        assert time.monotonic() - t0 < 5
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(30)
    with Client(os.fspath(d.socket), timeout=5) as c:  # (the flood gone: its slots are free again)
        assert c.call("hello")["privileged"] is True


def test_a_host_user_on_the_containers_socket_is_bounded_like_a_container(make_daemon):
    """Before: a host process on the containers' socket was counted under no key: no bound at all."""
    d = _systemd_soft_limit(make_daemon)
    (p,) = _flooders(d.socket.parent / "tenant" / d.socket.name, MAX_CALLER_CONNS + 36, [61100])
    try:
        # (answered: EPERM, a caller in no instance; counted all the same)
        assert p.stdout.readline().split() == ["answered", str(MAX_CALLER_CONNS), "refused", "36", "closed", "0"]
    finally:
        p.stdin.close()
        p.wait(30)


def _non_reader(path: Path) -> socket.socket:
    """A connection that pipelines hellos as fast as the daemon takes them and reads nothing."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.fspath(path))
    s.setblocking(False)
    lines = b'{"op": "hello"}\n' * 4000
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # (until the daemon's answers fill what the kernel buffers)
        try:
            s.send(lines)
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:  # (closed by the daemon: it read no answer in SEND_S)
            break
    return s


def test_a_client_that_never_reads_its_answers_cannot_hold_a_stop(make_daemon):
    """Before: every answer waited 10 s to be sent, then the next line's: SIGTERM waited hours."""
    d = make_daemon()
    s = _non_reader(d.socket)
    try:
        t0 = time.monotonic()
        assert d.signal_stop(signal.SIGTERM, timeout=SEND_S + 10) == 0
        assert time.monotonic() - t0 < SEND_S + 10
    finally:
        s.close()


def test_a_client_that_never_reads_its_answers_cannot_hold_a_hot_upgrade(make_daemon, subreaper):
    d = make_daemon()
    s = _non_reader(d.socket)
    try:
        t0 = time.monotonic()
        assert upgrade(d, timeout=SEND_S + 10).startswith("done ")
        assert time.monotonic() - t0 < SEND_S + 10
        with Client(os.fspath(d.socket), timeout=5) as c:
            assert c.call("hello")["privileged"] is True
    finally:
        s.close()


def test_a_flood_of_held_connections_cannot_keep_a_hot_upgrade_from_happening(make_daemon, subreaper):
    """Before: the old daemon passed every open connection in one message, and the kernel passes at
    most 253 descriptors in one (SCM_MAX_FD): with the flood's 1,200 held, sendmsg failed with
    EINVAL and every hot upgrade rolled back."""
    d = make_daemon()
    procs = _flooders(d.socket, MAX_CALLER_CONNS - 4, list(range(61200, 61220)))
    try:
        assert sum(int(p.stdout.readline().split()[1]) for p in procs) == MAX_CONNS
        assert upgrade(d, timeout=30).startswith("done ")
        assert "not handed on" not in d.log_text()  # (every one of them came over)
        with Client(os.fspath(d.socket), timeout=5) as c:
            assert c.call("hello")["privileged"] is True
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(30)


ALLOCS = r"""
import json, sys
from cgpud.client import Client, ControlError
clients = [Client() for _ in range(5)]
def alloc(c):
    try:
        return c.call("gpu_alloc", bytes=1)["handle"]
    except ControlError as e:
        return f"{e.error} {e}"
first = [alloc(clients[0]) for _ in range(int(sys.argv[1]))]
past_conn = alloc(clients[0])
for c in clients[1:4]:
    for _ in range(int(sys.argv[1])):
        alloc(c)
past_inst = alloc(clients[4])
clients[0].call("gpu_free", handle=first[0])
again = alloc(clients[4])
used = clients[4].call("gpu_meminfo")["used"]
print(json.dumps({"past_conn": past_conn, "past_inst": past_inst, "again": again, "used": used}))
"""


def test_one_byte_allocations_are_bounded_by_count(make_daemon):
    """Before: each gpu_alloc of one byte added an entry for as long as its connection lived."""
    d = make_daemon()
    env = dict(os.environ, CGPUD_SOCKET=os.fspath(d.socket))
    r = subprocess.run([os.fspath(Path(sys.executable).parent / "cgpu"), "run", "--name", "doorsalloc01", "--mem",
                        "1G", "--gpu", "0", "--", sys.executable, "-c", ALLOCS, str(MAX_HELD_PER_CONN)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["past_conn"].startswith("ENOSPC ") and f"holds {MAX_HELD_PER_CONN} allocations" in got["past_conn"]
    assert MAX_HELD_PER_INSTANCE == 4 * MAX_HELD_PER_CONN
    assert got["past_inst"].startswith("ENOSPC ") and "instance doorsalloc01 holds" in got["past_inst"], got
    assert isinstance(got["again"], int), got  # (one freed: one more may be held)
    assert got["used"] == MAX_HELD_PER_INSTANCE, got  # (nothing refused was counted)
