"""Attacks on the control socket from real root containers (issue 33, SPEC §9, docs/security.md).

One daemon and three podman containers (tests/test_podman.py's isolated podman, the hook):
- `victim`: a managed container, the neighbour an attacker is after;
- `attacker`: a managed container (root in it) with the daemon's socket directory mounted read-write
  at /hostsock, as the device plugin's Allocate and the DRA plugin's CDI spec mounted it before, and
  the containers' directory read-only at /run/cgpud, as they mount it now;
- `outsider`: a root container that cgpud does not manage (no GPU asked for), with both mounts.

From inside, a static client (tests/attack_client.c) sends each attack. Each must be refused with
a clear error (an errno and one line), change nothing (the tree, every file of it, as before), and
name nothing of another tenant in any reply. What a container may do — its own memory, its own
view — still works. Before this, from /hostsock, every one of these succeeded (see the commit).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cgpud.client import Client
from cgpud.control.server import CONTAINER_OPS, MAX_CONTAINER_CONNS
from conftest import Daemon, _make_base
from test_podman import Podman
from test_runc import targets
from test_upgrade import subreaper, upgrade  # noqa: F401  (the fixture)

ROOT = Path(__file__).parent.parent
HOST_SOCK = "/hostsock/cgpud.sock"  # the daemon's own socket (its directory mounted as before)
TENANT_SOCK = "/run/cgpud/cgpud.sock"  # the containers' socket (as Allocate / CDI mount it now)
SOCKETS = [HOST_SOCK, TENANT_SOCK]


class Scene:
    def __init__(self) -> None:
        self.d = Daemon(_make_base(), "sim:T4")
        self.d.start()
        self.pm = Podman(self.d)
        out = self.pm.rootfs / "bin" / "attack"
        r = subprocess.run(["gcc", "-static", "-Os", "-o", os.fspath(out), os.fspath(ROOT / "tests" / "attack_client.c")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        sock_dir = self.d.socket.parent
        (sock_dir / "tenant").mkdir(exist_ok=True)  # (the daemon made it; before, it did not exist)
        mounts = [f"{sock_dir}:/hostsock", f"{sock_dir / 'tenant'}:/run/cgpud:ro"]
        # (the victim holds its GPU open: active, the scheduler's telemetry names it)
        self.victim = self._start({"ALIYUN_COM_GPU_MEM_CONTAINER": "4"}, [f"{self.d.dev_dir / 'simgpu0'}:/dev/simgpu0"],
                                  "sh", "-c", "exec 3< /dev/simgpu0; exec sleep 600")
        self.attacker = self._start({"ALIYUN_COM_GPU_MEM_CONTAINER": "3"}, mounts)
        self.outsider = self._start({}, mounts)
        self.victim_name, self.attacker_name = self.victim[:12], self.attacker[:12]
        assert sorted(self.d.instances(0)) == sorted([self.victim_name, self.attacker_name])
        self.victim_pid = int(self.pm("inspect", "--format", "{{.State.Pid}}", self.victim).stdout)
        self.victim_target = targets(self.d)[self.victim_name]
        self.victim_memsize = int(self.d.value(f"0/{self.victim_name}/memsize"))

    def _start(self, env: dict, mounts: list[str], *cmd: str) -> str:
        p = self.pm.run(env, *(cmd or ("sleep", "600")), detach=True, volumes=mounts)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    def attack(self, who: str, sock: str, *args: str | dict) -> list[str]:
        """The client's output lines, run in container `who` ("attacker", "outsider")."""
        argv = [json.dumps(a) if isinstance(a, dict) else a for a in args]
        r = self.pm("exec", getattr(self, who), "/bin/attack", sock, *argv, timeout=60)
        return r.stdout.splitlines()

    def ask(self, who: str, sock: str, req: dict) -> dict:
        (line,) = self.attack(who, sock, req)
        try:
            return json.loads(line)
        except ValueError:
            raise AssertionError(f"no answer from the daemon: {line}") from None

    def others(self) -> list[str]:
        """What names another tenant: the victim's instance, container ID, pid, cgroup."""
        return [self.victim_name, self.victim, str(self.victim_pid), self.victim_target["path"]]

    def close(self) -> None:
        try:
            self.pm.cleanup()
        finally:
            self.d.cleanup()


@pytest.fixture(scope="module")
def scene():
    s = Scene()
    yield s
    s.close()


def refused(s: Scene, reply: dict, *codes: str) -> None:
    """Refused with one of `codes` and one line; naming nothing of the victim."""
    assert reply["ok"] is False and reply["error"] in codes, reply
    assert reply["message"] and "\n" not in reply["message"], reply
    text = json.dumps(reply)
    assert not [o for o in s.others() if o in text], f"names another tenant: {text}"


@pytest.mark.parametrize("sock", SOCKETS)
def test_hello_from_a_root_container_is_not_privileged(scene, sock):
    r = scene.ask("attacker", sock, {"op": "hello"})
    assert r["ok"], r
    assert r["result"]["privileged"] is False and r["result"]["caller"] == "container"
    assert r["result"]["instance"] == scene.attacker_name


@pytest.mark.parametrize("sock", SOCKETS)
def test_stats_tell_only_the_callers_own_instance(scene, sock):
    """cgpu-smi inside a container: its own instance's telemetry (none here: it is idle), while the
    host's stats name the victim; no node-wide counts."""
    scene.d.write("0/policy", "1")  # (a scheduler that runs: telemetry of both instances)
    try:
        with Client(os.fspath(scene.d.socket), timeout=10) as c:
            deadline = time.monotonic() + 10
            while not any(scene.victim_name in st["instances"] for st in c.call("stats")):
                assert time.monotonic() < deadline, "the scheduler published no telemetry of the victim"
                time.sleep(0.05)
        (line,) = scene.attack("attacker", sock, {"op": "stats"})
    finally:
        scene.d.write("0/policy", "0")
    r = json.loads(line)
    assert r["ok"], r
    assert {n for st in r["result"] for n in st["instances"]} <= {scene.attacker_name}, r
    assert not [k for st in r["result"] for k in st if k in ("slices", "switches", "lateness", "switched")], r
    assert not [o for o in scene.others() if o in line], f"names another tenant: {line}"


@pytest.mark.parametrize("sock", SOCKETS)
def test_query_lists_only_the_callers_own_instance(scene, sock):
    (line,) = scene.attack("attacker", sock, {"op": "query"})
    r = json.loads(line)
    assert r["ok"], r
    assert [i["name"] for g in r["result"]["gpus"] for i in g["instances"]] == [scene.attacker_name]
    assert not [o for o in scene.others() if o in line], f"names another tenant: {line}"


@pytest.mark.parametrize("sock", SOCKETS)
@pytest.mark.parametrize("req", [
    pytest.param(lambda s: {"op": "deregister", "name": s.victim_name}, id="deregister-neighbour"),
    pytest.param(lambda s: {"op": "deregister", "name": s.attacker_name}, id="deregister-self"),
    pytest.param(lambda s: {"op": "register", "name": "forged000001", "gpus": [0], "memsize": 5 << 30},
                 id="register-5GiB-promised"),
    pytest.param(lambda s: {"op": "register", "name": "forged000002", "gpus": [0], "target": s.victim_target},
                 id="register-neighbours-cgroup"),
    pytest.param(lambda s: {"op": "register", "name": "forged000003", "gpus": [0],
                            "target": {"kind": s.victim_target["kind"],
                                       "path": f"/proc/self/root{s.victim_target['path']}"}},
                 id="register-symlinked-cgroup"),
    pytest.param(lambda s: {"op": "register", "name": "forged000004", "gpus": [0],
                            "target": {"kind": s.victim_target["kind"],
                                       "path": os.path.dirname(s.victim_target["path"])}},
                 id="register-host-parent-cgroup"),
    pytest.param(lambda s: {"op": "hook", "stage": "poststop",
                            "state": {"ociVersion": "1.0.2", "id": s.victim, "status": "stopped", "bundle": "/"}},
                 id="hook-poststop-neighbour"),
    pytest.param(lambda s: {"op": "hook", "stage": "createRuntime",
                            "state": {"ociVersion": "1.0.2", "id": "f" * 64, "status": "creating",
                                      "pid": s.victim_pid, "bundle": "/"}},
                 id="hook-create-with-neighbours-pid"),
    pytest.param(lambda s: {"op": "prepare", "bundle": "/", "id": "f" * 64}, id="prepare"),
    pytest.param(lambda s: {"op": "cold_upgrade"}, id="cold_upgrade"),
    pytest.param(lambda s: {"op": "trace", "seconds": 5}, id="trace"),
])
def test_a_container_cannot_change_or_see_beyond_its_instance(scene, sock, req):
    before = scene.d.snapshot()
    r = scene.ask("attacker", sock, req(scene))
    refused(scene, r, "EACCES")
    assert "for the host only" in r["message"], r
    assert scene.d.snapshot() == before
    assert sorted(scene.d.instances(0)) == sorted([scene.victim_name, scene.attacker_name])


def test_a_containers_own_memory_still_works_and_is_its_own(scene):
    for sock in SOCKETS:
        out = scene.attack("attacker", sock, {"op": "gpu_meminfo"}, {"op": "gpu_alloc", "bytes": 1 << 20},
                           {"op": "gpu_free", "handle": 1 << 40})
        meminfo, alloc, free = (json.loads(x) for x in out)
        assert meminfo["ok"] and meminfo["result"]["instance"] == scene.attacker_name, meminfo
        assert alloc["ok"] and alloc["result"]["instance"] == scene.attacker_name, alloc
        refused(scene, free, "ENOENT")  # (another connection's handle, or none: not this one's)
    assert set(CONTAINER_OPS) == {"hello", "query", "stats", "gpu_alloc", "gpu_free", "gpu_meminfo"}


@pytest.mark.parametrize("req", [{"op": "hello"}, {"op": "query"}, {"op": "gpu_meminfo"},
                                 {"op": "gpu_alloc", "bytes": 1 << 20}, {"op": "stats"}])
def test_a_container_cgpud_does_not_manage_gets_nothing_on_the_containers_socket(scene, req):
    r = scene.ask("outsider", TENANT_SOCK, req)
    refused(scene, r, "EPERM")
    assert "does not manage" in r["message"] or "no cgpud instance" in r["message"], r


@pytest.mark.parametrize("req", [
    pytest.param(lambda s: {"op": "deregister", "name": s.victim_name}, id="deregister"),
    pytest.param(lambda s: {"op": "register", "name": "forged000005", "gpus": [0], "memsize": 1 << 30}, id="register"),
    pytest.param(lambda s: {"op": "gpu_alloc", "bytes": 1 << 20}, id="gpu_alloc"),
])
def test_a_container_cgpud_does_not_manage_changes_nothing_on_the_hosts_socket(scene, req):
    before = scene.d.snapshot()
    refused(scene, scene.ask("outsider", HOST_SOCK, req(scene)), "EPERM", "EACCES")
    assert scene.d.snapshot() == before


@pytest.mark.parametrize("sock", SOCKETS)
def test_garbage_then_a_query_on_the_same_connection(scene, sock):
    out = scene.attack("attacker", sock, "--raw", "\x01\x7f not json\n[[[[[[\n{\"op\": 5}\n\n", json.dumps({"op": "query"}))
    replies = [json.loads(x) for x in out]
    assert [r.get("error") for r in replies[:3]] == ["EINVAL"] * 3, replies
    assert replies[3]["ok"], replies
    assert [i["name"] for g in replies[3]["result"]["gpus"] for i in g["instances"]] == [scene.attacker_name]
    assert not [o for o in scene.others() if o in "\n".join(out)]


def test_an_overlong_line_closes_only_that_connection(scene):
    before = scene.d.snapshot()
    out = scene.attack("attacker", TENANT_SOCK, "--big", str(70_000), json.dumps({"op": "query"}))
    assert len(out) == 1 and json.loads(out[0])["error"] == "EINVAL" and "too long" in out[0], out
    assert scene.d.snapshot() == before
    r = scene.ask("attacker", TENANT_SOCK, {"op": "query"})
    assert [i["name"] for g in r["result"]["gpus"] for i in g["instances"]] == [scene.attacker_name]


@pytest.mark.parametrize("sock", SOCKETS)
def test_a_connection_whose_process_is_gone_answers_nothing(scene, sock):
    """The process that connected exits; its child carries on with the connection (its pid could
    be any process's by now): refused, not answered as whoever has that pid."""
    (line,) = scene.attack("attacker", sock, "--orphan", json.dumps({"op": "query"}))
    refused(scene, json.loads(line), "EPERM")
    assert "gone" in line


def test_a_connection_flood_from_a_container_is_bounded_and_the_host_is_served(scene):
    n = MAX_CONTAINER_CONNS + 36
    (line,) = scene.attack("attacker", TENANT_SOCK, "--flood", str(n))
    assert line == f"answered {MAX_CONTAINER_CONNS} refused 36 closed 0", line
    with Client(os.fspath(scene.d.socket), timeout=10) as c:
        assert sorted(i["name"] for g in c.call("query")["gpus"] for i in g["instances"]) == \
            sorted([scene.victim_name, scene.attacker_name])


def _ask_on(path, req: dict) -> dict:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(os.fspath(path))
        f = s.makefile("rwb")
        f.write(json.dumps(req).encode() + b"\n")
        f.flush()
        return json.loads(f.readline())
    finally:
        s.close()


def test_the_containers_socket_makes_everyone_a_container_and_outlives_a_hot_upgrade(make_daemon, subreaper):
    """On the containers' socket even a host root process is a container (here: in no instance, so
    nothing); each daemon makes the socket anew, a hot upgrade's too, in the directory containers
    have mounted."""
    d = make_daemon()
    tenant = d.socket.parent / "tenant" / d.socket.name
    for _ in range(2):
        r = _ask_on(tenant, {"op": "register", "name": "forged000006", "gpus": [0], "memsize": 1 << 30})
        assert r["ok"] is False and r["error"] == "EPERM" and "containers' socket" in r["message"], r
        assert _ask_on(tenant, {"op": "hello"})["error"] == "EPERM"
        assert d.instances(0) == []
        assert _ask_on(d.socket, {"op": "hello"})["result"]["privileged"] is True  # (the host's, as before)
        upgrade(d)
