"""Crash safety under churn (issue 6, part 3): `kill -9` at random moments
while the tree is written, instances come and go through `inst_ctl` AND the
control socket, and real workloads in instance cgroups are frozen and thawed
by the scheduler. After each kill, the guard must thaw every cgroup; after
each restart every acknowledged change is there (or the one in flight), no
instance is lost or duplicated, and the tree holds SPEC §4.

And a full disk under the state directory (a real 64 KiB tmpfs): writes,
inst_ctl creations and socket registrations fail with ENOSPC and change
nothing; once there is room again they work.
"""
from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cgpud.client import Client, ControlError, DaemonUnavailable
from test_crash import NAMES, TOGGLED, Writer, check_acked, read_state
from test_crash import VALUES as CRASH_VALUES
from test_model import fill, tiny_fs  # noqa: F401 - a fixture

CGPU = str(Path(sys.executable).parent / "cgpu")
ROUNDS = int(os.environ.get("CGPUD_CRASH_ROUNDS", "12"))
MIB = 1 << 20
GIB = 1 << 30
SOCKET_NAME = "churnsocket0"
# test_crash's writes, with room for more instances: Σ weight ≤ 3·3 (NAMES) + 1 (TOGGLED)
# + 1 (SOCKET_NAME) + 2 (workloads) = 13 ≤ the smallest max_inst; and GPU 1's policy
VALUES = {**CRASH_VALUES, "0/max_inst": [str(v) for v in range(16, 26)], "1/policy": [str(v) for v in range(6)]}


class SocketChurn(threading.Thread):
    """Registers SOCKET_NAME on GPUs 0 and 1 and deregisters it, over the
    control socket, until the daemon dies; `acked` lists "exists"/"absent"
    after each acknowledged change, `inflight` the change not answered."""

    def __init__(self, sock: str, exists: bool) -> None:
        super().__init__(daemon=True)
        self.sock, self.exists = sock, exists
        self.acked: list[str] = []
        self.inflight: str | None = None
        self.unexpected: list[str] = []

    def run(self) -> None:
        try:
            c = Client(self.sock, timeout=10)
        except DaemonUnavailable:
            return
        with c:
            while True:
                want = "absent" if self.exists else "exists"
                self.inflight = want
                try:
                    if want == "exists":
                        c.call("register", name=SOCKET_NAME, gpus=[0, 1], memsize=64 * MIB)
                    else:
                        c.call("deregister", name=SOCKET_NAME)
                except DaemonUnavailable:
                    return
                except ControlError as exc:
                    self.inflight = None
                    self.unexpected.append(f"{want}: {exc.error} {exc}")
                    return
                self.inflight = None
                self.exists = want == "exists"
                self.acked.append(want)


def groups_of(d) -> dict[str, str]:
    """Instance name -> its cgroup, for the instances that have one (state.json)."""
    import json

    st = json.loads((d.state_dir / "state.json").read_text())["state"]
    return {i["name"]: i["target"]["path"] for g in st["gpus"] for i in g["instances"]
            if i.get("target", {}).get("path")}


def frozen(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.events")) as f:
            return "frozen 1" in f.read()
    except FileNotFoundError:
        return False


def wait_thawed(paths, timeout: float = 10.0) -> list[str]:
    """The cgroups still frozen after `timeout` (the guard thaws them at once)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in paths if frozen(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def instance_table(d) -> dict[int, dict[str, str]]:
    """GPU -> {name: id}."""
    return {g: {n: d.value(f"{g}/{n}/id") for n in d.instances(g)} for g in (0, 1)}


def start_workload(d, name: str) -> subprocess.Popen:
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    p = subprocess.Popen([CGPU, "run", "--name", name, "--mem", "64M", "--", CGPU, "workload", "--seconds", "600"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 15
    while name not in d.instances(0):
        assert p.poll() is None, p.stderr.read()
        assert time.monotonic() < deadline, f"{name} did not appear"
        time.sleep(0.02)
    return p


def test_kill_9_during_writes_churn_and_workloads(make_daemon):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d = make_daemon(gpus="sim:2xT4")
    d.write("default_memsize", str(256 * MIB))
    d.write("0/max_inst", "16")
    for n in NAMES:
        d.create(0, n)
    suffix = f"{os.getpid() % 1000000:06d}"
    workloads = {f"crashwl0{suffix}"[:12]: None, f"crashwl1{suffix}"[:12]: None}
    for name in workloads:
        workloads[name] = start_workload(d, name)
    groups = groups_of(d)
    assert set(workloads) <= set(groups)
    state = read_state(d, VALUES)
    sock_state = "exists" if SOCKET_NAME in d.instances(0) else "absent"
    ids_before = instance_table(d)
    frozen_seen = 0
    try:
        for rnd in range(ROUNDS):
            where = f"round {rnd} (seed {seed})"
            w = Writer(d, random.Random(rng.random()), state["inst_ctl"] == "exists", VALUES)
            s = SocketChurn(str(d.socket), sock_state == "exists")
            w.start()
            s.start()
            until = time.monotonic() + rng.uniform(0.05, 0.4)  # the kill comes at a random moment;
            seen = False                                        # meanwhile, is a workload held frozen?
            while time.monotonic() < until:
                seen = seen or any(frozen(p) for p in groups.values())
                time.sleep(0.005)
            frozen_seen += seen
            d.kill9()
            # the guard thaws what the dead daemon froze
            left = wait_thawed(groups.values())
            assert left == [], f"{where}: still frozen after the kill: {left}"
            w.join(10)
            s.join(10)
            assert not w.is_alive() and not s.is_alive(), f"{where}: a client hangs on the dead daemon"
            assert w.unexpected == [] and s.unexpected == [], (where, w.unexpected, s.unexpected)
            d.start()
            now = read_state(d, VALUES)
            check_acked(w, state, now, where)
            # the socket's registrations: the last acknowledged, or the one in flight
            on = {g: SOCKET_NAME in d.instances(g) for g in (0, 1)}
            assert on[0] == on[1], f"{where}: {SOCKET_NAME} on one GPU only: {on}"
            got = "exists" if on[0] else "absent"
            allowed = {s.acked[-1] if s.acked else sock_state} | ({s.inflight} if s.inflight else set())
            assert got in allowed, f"{where}: {SOCKET_NAME} {got}; acknowledged {s.acked[-3:]}, in flight {s.inflight}"
            # no instance lost or duplicated; ids unique per GPU; the ones that stayed kept their id
            table = instance_table(d)
            for g in (0, 1):
                assert len(set(table[g].values())) == len(table[g]), f"{where}: duplicate ids on GPU {g}: {table[g]}"
                for n, i in ids_before[g].items():
                    if n in table[g] and n not in (TOGGLED, SOCKET_NAME):
                        assert table[g][n] == i, f"{where}: {n} changed id"
            assert set(NAMES) | set(workloads) <= set(table[0]), f"{where}: lost {set(NAMES) | set(workloads) - set(table[0])}"
            weights = sum(int(d.value(f"0/{n}/weight")) for n in d.instances(0))
            assert int(d.value("0/free_weight")) == int(now["0/max_inst"]) - weights >= 0, where
            for name, p in workloads.items():
                assert p.poll() is None, f"{where}: workload {name} died: {p.stderr.read()}"
            state, sock_state, ids_before = now, got, table
        d.stop()
        assert wait_thawed(groups.values(), 1.0) == []  # a clean stop thaws too
    finally:
        for p in workloads.values():
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workloads.values():
            if p is not None:
                p.wait(20)
    assert frozen_seen >= 1, "the workloads were never seen frozen: the kills did not test the guard"


# ---- a full disk ---------------------------------------------------------------------------


def test_full_disk_refuses_writes_creations_and_registrations(tiny_fs, make_daemon):
    d = make_daemon(start=False)
    d.state_dir = tiny_fs / "state"
    d.start()
    d.write("default_memsize", str(GIB))  # (so that ENOSPC below can only be the disk's)
    d.create(0, "fulldisk0001")
    d.write("0/policy", "2")
    before = d.snapshot()
    fill(tiny_fs)
    assert d.write_errno("0/policy", "3") == errno.ENOSPC
    assert d.write_errno("0/fulldisk0001/weight", "2") == errno.ENOSPC
    assert d.write_errno("inst_ctl", "0fulldisk0002") == errno.ENOSPC
    assert d.write_errno("inst_ctl", "-fulldisk0001") == errno.ENOSPC
    with Client(str(d.socket)) as c:
        with pytest.raises(ControlError) as info:
            c.call("register", name="fulldisk0003", gpus=[0], memsize=64 * MIB)
        assert info.value.error == "ENOSPC"
        with pytest.raises(ControlError) as info:
            c.call("deregister", name="fulldisk0001")
        assert info.value.error == "ENOSPC"
    r = subprocess.run([CGPU, "run", "--name", "fulldisk0004", "--", "true"], capture_output=True, text=True,
                       env=dict(os.environ, CGPUD_SOCKET=str(d.socket)), timeout=30)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "fulldisk0004" in r.stderr, r.stderr
    assert d.snapshot() == before  # nothing changed, in the tree
    d.kill9()
    d.start()
    assert d.snapshot() == before  # nor on disk
    (tiny_fs / "filler").unlink()  # room again: the same changes go through
    d.write("0/policy", "3")
    d.write("inst_ctl", "0fulldisk0002")
    with Client(str(d.socket)) as c:
        c.call("register", name="fulldisk0003", gpus=[0], memsize=64 * MIB)
    assert {"fulldisk0001", "fulldisk0002", "fulldisk0003"} <= set(d.instances(0))
    assert d.value("0/policy") == "3"
    d.stop()  # (before the tmpfs goes)
