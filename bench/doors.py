"""bench/doors: a GPU container's start during a connection flood, against none (issue 44, "the node's
open doors"; docs/security.md).

One daemon started as systemd starts a service whose unit says nothing (soft open-file limit 1024;
the daemon raises its own), tests/test_podman.py's isolated podman with the OCI hook. A start is
`podman run --rm -e ALIYUN_COM_GPU_MEM_CONTAINER=1 … true`, timed whole (the hook registers the
container, poststop deregisters it). In turns of --turn starts, alternately:
  - flooded: 20 host users hold 60 connections each open on the daemon's socket (1,200: past the
    1,024 of everyone but root and the admin group; before issue 44, past what 1,024 open files
    held, and accept failed with EMFILE), and one more connects, says hello and closes in a loop on
    both sockets;
  - none (the reference).
Printed: p50/p99 of each, the ratio (goal: within 2x), starts that failed, what the flood got.

    .venv/bin/python bench/doors.py [--starts 30] [--turn 5] [--code DIR]

--code DIR runs the daemon (and the hook) from another checkout, e.g. the code before issue 44:
`git archive 555a060 | tar -x -C /tmp/before` (its PYTHONPATH; the bench's own code is this one).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent), str(HERE)]

from common import pct  # noqa: E402
from conftest import Daemon, _make_base  # noqa: E402
from test_attacks_doors import _flooders  # noqa: E402
from test_podman import Podman  # noqa: E402

CHURN = r"""
import socket, sys, time
paths, n = sys.argv[1:], 0
while True:
    for p in paths:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        try:
            s.connect(p)
            s.sendall(b'{"op": "hello"}\n')
            s.recv(4096)
            n += 1
        except OSError:
            pass
        finally:
            s.close()
"""


def flood_on(d: Daemon) -> list[subprocess.Popen]:
    procs = _flooders(d.socket, 60, list(range(62000, 62020)))
    got = [p.stdout.readline().split() for p in procs]
    tenant = d.socket.parent / "tenant" / d.socket.name
    procs.append(subprocess.Popen(["/usr/bin/python3", "-I", "-c", CHURN, os.fspath(d.socket), os.fspath(tenant)],
                                  user=62100, group=65534, extra_groups=[], stdin=subprocess.PIPE))
    flood_on.last = (sum(int(c[1]) for c in got if len(c) > 5), sum(int(c[3]) for c in got if len(c) > 5))
    return procs


def flood_off(procs: list[subprocess.Popen]) -> None:
    procs[-1].kill()
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=30, help="starts of each kind")
    ap.add_argument("--turn", type=int, default=5, help="starts per turn")
    ap.add_argument("--code", default=None, help="a checkout to run the daemon from (default: this one)")
    args = ap.parse_args()
    if args.code:
        os.environ["PYTHONPATH"] = os.path.abspath(args.code)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    d = Daemon(_make_base(), "sim:T4")
    try:
        d.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    pm = Podman(d)
    times: dict[bool, list[float]] = {True: [], False: []}
    failed = {True: 0, False: 0}
    floods = []
    try:
        flooded = True
        while min(len(times[True]) + failed[True], len(times[False]) + failed[False]) < args.starts:
            procs = flood_on(d) if flooded else []
            if flooded:
                floods.append(flood_on.last)
            try:
                for _ in range(args.turn):
                    t0 = time.perf_counter()
                    p = pm.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}, "true")
                    dt = (time.perf_counter() - t0) * 1000
                    if p.returncode == 0:
                        times[flooded].append(dt)
                    else:
                        failed[flooded] += 1
                        print(f"  a start failed ({'flooded' if flooded else 'none'}): {p.stderr.strip()[-200:]}",
                              flush=True)
            finally:
                if procs:
                    flood_off(procs)
            flooded = not flooded
        print(f"GPU container start (podman run --rm, the hook registering and deregistering), {args.starts} each, "
              f"in turns of {args.turn}:")
        for flooded, what in ((True, "during the flood"), (False, "none (reference)")):
            xs = times[flooded]
            got = f"p50 {pct(xs, 50):.0f} ms, p99 {pct(xs, 99):.0f} ms" if xs else "no start succeeded"
            print(f"  {what:17s}: {got}, failed {failed[flooded]}")
        if times[True] and times[False]:
            print(f"  p99 ratio: {pct(times[True], 99) / pct(times[False], 99):.2f} (goal <= 2)")
        ans = sorted(a for a, _ in floods)
        ref = sorted(r for _, r in floods)
        print(f"  the flood's 1,200 held connections: answered {ans[0]}..{ans[-1]}, refused (EAGAIN) {ref[0]}..{ref[-1]} "
              "per turn")
    finally:
        pm.cleanup()
        d.cleanup()


if __name__ == "__main__":
    main()
