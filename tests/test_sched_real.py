"""The scheduler on real processes: stand-in workloads under `cgpu run`, each
in its own cgroup, frozen and thawed through cgroup.freeze by a real daemon.

Tolerances are loose (CI machines are shared and noisy); bench/shares holds
the tight figures.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.containers.cgroups import v2_root
from cgpud.client import Client

CGPU = str(Path(sys.executable).parent / "cgpu")

# The workloads (not `cgpu run`, which must be free to start the next one)
# share one CPU at a real-time round-robin priority below the daemon's (10),
# and the tests judge the CPU time of their cgroups: that is the time the
# scheduler thawed them, not how fast or how busy the machine was. The two
# virtual CPUs of these shared machines run one loop at speeds up to 1.8 times
# apart (a 1:2 split read 3.9 or 1.2 by iterations, by the CPU each workload
# sat on), and other load takes CPU from whichever workload is thawed (1.6 and
# 2.4 seen in normal priority). Round robin, not FIFO: a workload starting
# while another runs alone on that CPU gets its turn and can open the GPU.
PINNED = ("chrt", "--rr", "1", "taskset", "--cpu-list", str(max(os.sched_getaffinity(0))))


class Workloads:
    def __init__(self, daemon) -> None:
        self.d = daemon
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, seconds: float, *args: str) -> subprocess.Popen:
        env = dict(os.environ, CGPUD_SOCKET=str(self.d.socket))
        p = subprocess.Popen([CGPU, "run", "--name", name, "--mem", "64M", *args, "--",
                              *PINNED, CGPU, "workload", "--seconds", str(seconds), "--json"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs[name] = p
        deadline = time.monotonic() + 15
        while not os.path.isdir(self.d.path(f"0/{name}")):
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < deadline, f"{name} did not appear"
            time.sleep(0.02)
        return p

    def result(self, name: str) -> dict:
        out, err = self.procs[name].communicate(timeout=60)
        assert self.procs[name].returncode == 0, err
        return json.loads(out)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def sched(daemon):
    daemon.write("default_memsize", str(64 << 20))
    w = Workloads(daemon)
    yield daemon, w
    w.stop_all()


def group(name: str) -> str:
    return os.path.join(v2_root(), "cgpud", name)


def usage(name: str) -> float:
    with open(os.path.join(group(name), "cpu.stat")) as f:
        return int(f.read().split("usage_usec ")[1].split()[0]) / 1e6


def frozen(name: str) -> bool:
    with open(os.path.join(group(name), "cgroup.events")) as f:
        return "frozen 1" in f.read()


def wait_frozen(name: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not frozen(name):
        assert time.monotonic() < deadline, f"never saw {name} frozen"
        time.sleep(0.001)


def stats(daemon) -> dict:
    with Client(str(daemon.socket)) as c:
        return c.call("stats")[0]


def test_policy2_weights_1_to_2_give_cpu_time_1_to_2(sched):
    d, w = sched
    d.write("0/policy", "2")
    w.start("weightone001", 8, "--weight", "1")
    w.start("weighttwo002", 8, "--weight", "2")
    # Both run from here: each second's CPU time of the two cgroups. The
    # median second counts, so one burst of other work cannot decide.
    time.sleep(0.5)
    seen = [(usage("weightone001"), usage("weighttwo002"))]
    for _ in range(5):
        time.sleep(1.0)
        seen.append((usage("weightone001"), usage("weighttwo002")))
    ratios = sorted((b1 - b0) / (a1 - a0) for (a0, b0), (a1, b1) in zip(seen, seen[1:]))
    assert all(p.poll() is None for p in w.procs.values()), "a workload ended inside the window"
    ratio = ratios[len(ratios) // 2]
    # 2 within 15 %: 1:1 would be 1.0 and 1:3 3.0
    assert 1.7 <= ratio <= 2.3, ratios
    st = stats(d)
    assert st["freezes"] > 0 and st["thaws"] > 0


def test_policy3_caps_a_lone_instance_at_its_weight(sched):
    d, w = sched
    d.write("0/policy", "3")
    w.start("fixedfour004", 5, "--weight", "4")  # 4/16 = 25 %
    time.sleep(1.0)
    u0, t0 = usage("fixedfour004"), time.monotonic()
    time.sleep(3.0)
    share = (usage("fixedfour004") - u0) / (time.monotonic() - t0)
    assert 0.15 <= share <= 0.27, share


def test_policy1_gives_a_newly_active_instance_its_share(sched):
    d, w = sched
    d.write("0/policy", "1")
    w.start("alonefirst01", 9)
    time.sleep(1.5)
    u0, t0 = usage("alonefirst01"), time.monotonic()
    time.sleep(1.5)
    alone = (usage("alonefirst01") - u0) / (time.monotonic() - t0)
    w.start("joinslater02", 5)
    time.sleep(1.0)
    a0, b0, t0 = usage("alonefirst01"), usage("joinslater02"), time.monotonic()
    time.sleep(3.0)
    dt = time.monotonic() - t0
    a, b = (usage("alonefirst01") - a0) / dt, (usage("joinslater02") - b0) / dt
    assert alone > 0.6, alone            # alone it had (nearly) the whole GPU
    # then they share 1/2 : 1/2 (CPU time on a shared two-core machine: 2 of 5 runs went past 1.25 over 2 s)
    assert 0.75 <= b / a <= 1.33, (a, b)


def test_policy5_freezes_nothing(sched):
    d, w = sched
    d.write("0/policy", "5")
    before = stats(d)["freezes"]
    w.start("nativeone001", 2)
    w.start("nativetwo002", 2)
    a, b = w.result("nativeone001"), w.result("nativetwo002")
    assert stats(d)["freezes"] == before
    assert a["iterations"] > 0 and b["iterations"] > 0


def test_high_priority_takes_over_up_to_prio_ratio(sched):
    d, w = sched
    d.write("0/policy", "1")
    d.write("0/prio_ratio", "70")
    w.start("normalone001", 8)
    time.sleep(1.0)
    w.start("highprio0001", 4, "--highprio")
    res_time = time.monotonic()
    time.sleep(1.5)
    h0, n0, t0 = usage("highprio0001"), usage("normalone001"), time.monotonic()
    time.sleep(2.0)
    dt = time.monotonic() - t0
    h, n = (usage("highprio0001") - h0) / dt, (usage("normalone001") - n0) / dt
    assert h > n, (h, n)
    assert 0.5 <= h / (h + n) <= 0.75, (h, n)   # capped at prio_ratio 70 %
    res = w.result("highprio0001")
    assert res["first_kernel_s"] < 0.25, res      # ran at once on opening the GPU
    assert res_time > 0


def test_kill9_of_the_daemon_leaves_nothing_frozen(sched):
    d, w = sched
    d.write("0/policy", "3")  # weight 1 of 16: frozen 15/16 of the time
    w.start("keptfrozen01", 20)
    wait_frozen("keptfrozen01")
    d.kill9()
    t = time.monotonic()
    while frozen("keptfrozen01"):
        assert time.monotonic() - t < 1.0, "still frozen 1 s after the daemon died"
        time.sleep(0.01)
    u0 = usage("keptfrozen01")
    time.sleep(0.5)
    assert usage("keptfrozen01") - u0 > 0.2  # and it runs


def test_sigterm_leaves_nothing_frozen(sched):
    d, w = sched
    d.write("0/policy", "3")
    w.start("termfrozen01", 20)
    wait_frozen("termfrozen01")
    d.stop()
    assert not frozen("termfrozen01")
