"""Least privilege (SPEC §1, docs/security.md): the admin group, who may
do what on the tree and the control socket, every input bounded.

Other tests cover the rest: a plain user reads everything and writes nothing
(test_mounted_tree), a plain user may query but not register
(test_control), a process outside any instance gets EPERM for GPU memory
(test_gpumem).

The admin group here is `nogroup` (gid 65534, nobody's own group): no
group is created on the machine. A second unprivileged user (uid/gid 4242,
no groups) stands for "anyone else".
"""
from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess

import pytest

from cgpud.client import Client
from conftest import NOBODY, as_nobody, nobody_python
from test_gpumem import Holder, holders  # noqa: F401  (the fixture)

OTHER = 4242
NAME = f"pv{os.getpid():010d}"[-12:]

SOCKET_SCRIPT = (
    "import json, socket, sys\n"
    "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile('rwb')\n"
    "for req in json.loads(sys.argv[2]):\n"
    "    f.write(json.dumps(req).encode() + b'\\n'); f.flush(); print(f.readline().decode().strip())\n"
)

WRITE_SCRIPT = (
    "import errno, os, sys\n"
    "for rel, data in zip(sys.argv[2::2], sys.argv[3::2]):\n"
    "    try:\n"
    "        fd = os.open(os.path.join(sys.argv[1], rel), os.O_WRONLY)\n"
    "        os.write(fd, data.encode()); os.close(fd); print('ok')\n"
    "    except OSError as e:\n"
    "        print(errno.errorcode[e.errno])\n"
)


def run_as(uid: int, argv: list[str]) -> subprocess.CompletedProcess:
    if uid == NOBODY:
        return as_nobody(argv)
    return subprocess.run(argv, user=uid, group=uid, extra_groups=[], capture_output=True, text=True,
                          cwd="/", timeout=30, stdin=subprocess.DEVNULL)


def socket_as(uid: int, path, reqs: list[dict]) -> list[dict]:
    r = run_as(uid, [nobody_python(), "-c", SOCKET_SCRIPT, str(path), json.dumps(reqs)])
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def writes_as(uid: int, mount, pairs: list[tuple[str, str]]) -> list[str]:
    argv = [nobody_python(), "-c", WRITE_SCRIPT, str(mount)]
    for rel, data in pairs:
        argv += [rel, data]
    r = run_as(uid, argv)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.fixture
def admin_daemon(make_daemon):
    return make_daemon(extra_args=["--admin-group", "nogroup"])


def test_admin_group_members_write_the_tree_and_register_others_do_not(admin_daemon):
    d = admin_daemon
    d.write("default_memsize", str(1 << 30))
    st = os.stat(d.path("0/policy"))
    assert stat.S_IMODE(st.st_mode) == 0o664 and st.st_uid == 0 and st.st_gid == NOBODY
    for ro in ("version", "0/free_weight", "0/major"):
        assert stat.S_IMODE(os.stat(d.path(ro)).st_mode) == 0o444
    # nobody is in the admin group (its own group): writes land, read-only stays refused
    assert writes_as(NOBODY, d.mount, [("0/policy", "2"), (f"inst_ctl", f"0{NAME}"), (f"0/{NAME}/weight", "3"),
                                       ("version", "9")]) == ["ok", "ok", "ok", "EACCES"]
    assert d.value("0/policy") == "2" and d.value(f"0/{NAME}/weight") == "3"
    before = d.snapshot()
    # anyone else: EACCES for every write, and nothing changed
    assert writes_as(OTHER, d.mount, [("0/policy", "1"), ("inst_ctl", f"-{NAME}"), (f"0/{NAME}/weight", "1"),
                                      ("default_memsize", "1")]) == ["EACCES"] * 4
    assert d.snapshot() == before
    # the control socket: the admin group registers and deregisters, anyone else only reads
    other = NAME[:-1] + "o"
    r = socket_as(NOBODY, d.socket, [{"op": "hello"}, {"op": "register", "name": other, "gpus": [0], "memsize": 1 << 30}])
    assert r[0]["result"]["privileged"] is True and r[1]["ok"] is True, r
    r = socket_as(OTHER, d.socket, [{"op": "hello"}, {"op": "query"},
                                    {"op": "deregister", "name": other},
                                    {"op": "register", "name": NAME[:-1] + "p", "gpus": [0]}])
    assert r[0]["result"]["privileged"] is False and r[1]["ok"] is True
    assert [x.get("error") for x in r[2:]] == ["EACCES", "EACCES"]
    assert sorted(d.instances(0)) == sorted([NAME, other])
    r = socket_as(NOBODY, d.socket, [{"op": "deregister", "name": other}])
    assert r[0]["ok"] is True and d.instances(0) == [NAME]


def test_without_an_admin_group_root_alone_writes(daemon):
    st = os.stat(daemon.path("0/policy"))
    assert stat.S_IMODE(st.st_mode) == 0o644 and (st.st_uid, st.st_gid) == (0, 0)
    assert writes_as(NOBODY, daemon.mount, [("0/policy", "1")]) == ["EACCES"]
    r = socket_as(NOBODY, daemon.socket, [{"op": "register", "name": NAME, "gpus": [0]}])
    assert r[0]["error"] == "EACCES"


BAD_NAMES = ["../../etc/pa", "abc/defghijk", "abcdefghijk\0", "..", "", "a" * 13, "a" * 11, "a" * 50_000,
             "abcdéfghijkl", "abcdefghijk ", "abcdefghij\nk"]


def test_instance_names_are_validated_on_the_socket_and_on_inst_ctl(daemon):
    before = daemon.snapshot()
    with Client(str(daemon.socket)) as c:
        for name in BAD_NAMES:
            c.sock.sendall(json.dumps({"op": "register", "name": name, "gpus": [0]}).encode() + b"\n")
            resp = json.loads(c._rfile.readline())
            assert resp["ok"] is False and resp["error"] == "EINVAL", (name[:20], resp)
            assert len(resp["message"]) < 200  # input is echoed cut short
    for name in BAD_NAMES:
        for data in (b"0" + name.encode()[:64], b"-" + name.encode()[:64]):
            assert daemon.write_errno("inst_ctl", data) == errno.EINVAL, data
    assert daemon.snapshot() == before


def _converse(path, data: bytes) -> list[dict]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(path))
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    finally:
        s.close()
    return [json.loads(line) for line in out.splitlines()]


def test_request_lines_are_bounded_and_never_stop_the_daemon(daemon):
    hello = b'{"op": "hello"}\n'
    # nested deeper than the parser goes: one EINVAL, and the connection goes on
    r = _converse(daemon.socket, b"[" * 60_000 + b"\n" + hello)
    assert [x.get("error") for x in r] == ["EINVAL", None] and r[1]["ok"] is True
    # a line over 64 KiB that ends within the same read: refused, connection closed
    r = _converse(daemon.socket, b'{"op": "' + b"x" * 70_000 + b'"}\n' + hello)
    assert len(r) == 1 and r[0]["error"] == "EINVAL" and "too long" in r[0]["message"]
    # just under the limit: an ordinary answer (an unknown op, quoted short)
    r = _converse(daemon.socket, b'{"op": "' + b"x" * 65_000 + b'"}\n' + hello)
    assert r[0]["error"] == "EINVAL" and len(r[0]["message"]) < 300 and r[1]["ok"] is True
    # not UTF-8, numbers with thousands of digits, NaN, huge ints: EINVAL each, in order
    lines = [b"\xff\xfe", b'{"op": "register", "name": "%s", "gpus": [0], "memsize": %s}' % (NAME.encode(), b"9" * 5000),
             b'{"op": "register", "name": "%s", "gpus": [0], "memsize": NaN}' % NAME.encode(),
             b'{"op": "register", "name": "%s", "gpus": [0], "weight": %s}' % (NAME.encode(), b"9" * 100),
             b'{"op": "register", "name": "%s", "gpus": [%s]}' % (NAME.encode(), b"9" * 100)]
    r = _converse(daemon.socket, b"\n".join(lines) + b"\n" + hello)
    assert [x.get("error") for x in r] == ["EINVAL"] * len(lines) + [None], r
    # a client that sends half a line and waits holds up nobody else
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(str(daemon.socket))
    try:
        slow.sendall(b'{"op": "hel')
        with Client(str(daemon.socket), timeout=10) as c:
            assert c.call("hello")["gpus"] == 1
    finally:
        slow.close()
    assert daemon.alive() and daemon.instances(0) == []


def test_a_process_touches_only_its_own_instances_memory(daemon, holders):  # noqa: F811
    daemon.write("default_memsize", str(1 << 30))
    a = Holder(daemon, NAME, "1G")
    holders.append(a)
    b = Holder(daemon, NAME[:-1] + "b", "1G")
    holders.append(b)
    ha = a.alloc(100 << 20)
    assert "Free: %d" % ((1 << 30) - (100 << 20)) in daemon.read(f"0/{NAME}/meminfo")
    # b cannot free a's allocation (handles belong to the connection that made them)
    assert b.raw("gpu_free", handle=ha).startswith("ENOENT")
    # b sees and allocates only in its own instance
    assert f'"instance": "{b.name}"' in b.raw("gpu_meminfo")
    assert f'"instance": "{b.name}"' in b.raw("gpu_alloc", bytes=1 << 20)
    # a GPU b has no share of: EPERM
    assert b.raw("gpu_meminfo", gpu=1).startswith("EPERM")
    assert "Free: %d" % ((1 << 30) - (100 << 20)) in daemon.read(f"0/{NAME}/meminfo")
    assert a.raw("gpu_free", handle=ha).startswith("ok")


def test_a_member_by_supplementary_group_is_admin_and_groups_are_taken_at_connect(admin_daemon):
    """uid 4242 with nogroup as a supplementary group is an admin; the
    groups come from the kernel's record of the connect (SO_PEERGROUPS), not
    from /proc/<pid> later, where the pid could be another process by then."""
    d = admin_daemon
    r = subprocess.run([nobody_python(), "-c", SOCKET_SCRIPT, str(d.socket), json.dumps([{"op": "hello"}])],
                       user=OTHER, group=OTHER, extra_groups=[NOBODY], capture_output=True, text=True, cwd="/",
                       timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"]["privileged"] is True


def test_peer_groups_are_recorded_at_connect():
    from cgpud.control.protocol import peer_of

    a, b = socket.socketpair()
    try:
        p = peer_of(a)
        assert p.pid == os.getpid() and p.uid == os.geteuid()
        assert p.supplementary == frozenset(os.getgroups())
        assert p.groups() == set(os.getgroups()) | {os.getegid()}
    finally:
        a.close()
        b.close()
