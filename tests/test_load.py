"""Load (issue 6, part 6), short: 8 client processes for 5 s read the tree,
write settings and query the socket while the scheduler freezes and thaws
real `cgpu run` workloads. No unexpected error, the daemon stays up, the
invariants hold, and the schedule went on. bench/soak.py has the full
32-client, 60 s, 25-instance run and its latency and share figures (no
timing is asserted here).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cgpud.client import Client
from loadgen import run_clients
from test_sched_real import wait_frozen
from treefuzz import invariants

BIN = Path(sys.executable).parent


def test_clients_under_load_see_no_unexpected_error(daemon):
    d = daemon
    d.write("default_memsize", str(64 << 20))
    d.write("0/policy", "1")
    tag = f"l{os.getpid() % 100000:05d}"
    names = [f"{tag}{i:02d}".ljust(12, "w") for i in range(4)]
    idle = f"{tag}id".ljust(12, "i")
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    runs = [subprocess.Popen([str(BIN / "cgpu"), "run", "--name", n, "--", str(BIN / "cgpu"), "workload",
                              "--seconds", "60"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for n in names]
    try:
        with Client(str(d.socket)) as c:
            c.call("register", name=idle, gpus=[0])
        for n in names:
            wait_frozen_or_present(d, n)
        with Client(str(d.socket)) as c:
            before = c.call("stats")[0]
        res = run_clients(str(d.mount), str(d.socket), names, idle, count=8, seconds=5, interval=0.005)
        assert res.unexpected == [], res.unexpected[:5]
        assert res.ops > 8 * 50 and all(res.lat.values())  # every kind of op ran, many times
        assert d.alive()
        with Client(str(d.socket)) as c:
            q = c.call("query")
            after = c.call("stats")[0]
        assert invariants(q) == []
        assert sorted(i["name"] for i in q["gpus"][0]["instances"]) == sorted(names + [idle])
        assert q["gpus"][0]["policy"] == 1 and q["default_memsize"] == 64 << 20
        assert after["switches"] > before["switches"]  # the scheduler went on switching throughout
        wait_frozen(names[0], timeout=10)
    finally:
        for p in runs:
            p.terminate()
        for p in runs:
            p.wait(15)
    log = d.log_text()
    assert "Traceback" not in log and "internal error" not in log, log


def wait_frozen_or_present(d, name: str, timeout: float = 15.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not os.path.isdir(d.path(f"0/{name}")):
        assert time.monotonic() < deadline, f"{name} did not appear:\n{d.log_text()}"
        time.sleep(0.02)
