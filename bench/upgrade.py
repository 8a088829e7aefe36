"""bench/upgrade: hot upgrades under load (issue 6).

One daemon (default slice 10 ms), policy 3 with max_inst 4: a `cgpu run`
workload of weight 1 runs 1/4 of the time and is frozen the rest, printing a
progress sample every 2 ms while it runs (`cgpu workload --json --interval`).
A bash loop of GNU `cat` reads five nodes of the mount without pause, and a
Python thread times its own reads. Then `echo 1 > upgrade`, UPGRADES times,
with a normal window of the same length between two upgrades.

Printed:
- failed reads during the upgrades (goal 0), out of how many;
- the scheduling gap of each upgrade (goal <= 1 s): the longest stretch the
  workload ran without being frozen, in a window around the upgrade, against
  the same figure over a normal window of the same length (there it is about
  one slice: the scheduler freezes it three slices in four). During the switch
  nothing is frozen (the old daemon thaws all; the new one freezes again once
  its scheduler runs), so the stretch is how long scheduling stopped;
- the longest the workload stayed frozen around an upgrade vs in a normal
  window (the switch must not leave it frozen);
- the longest read around an upgrade vs the p99 of a normal window (reads
  wait in the kernel while no process serves), and how long `echo 1 >
  upgrade` took (the new daemon's start-up: the write returns once it is ready).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import daemon, pct, tool  # noqa: E402

from cgpud.client import Client  # noqa: E402

FROZEN_GAP = 0.008  # samples come every 2 ms while it runs: a longer silence is a freeze (or a preemption)


def pid_of(sock: str) -> int:
    with Client(sock) as c:
        return c.call("hello")["pid"]


def stretches(samples: list[float], t0: float, t1: float) -> tuple[float, float]:
    """(longest run without a freeze, longest freeze) among the samples in [t0, t1]."""
    xs = [t for t in samples if t0 <= t <= t1]
    run = longest_run = longest_freeze = 0.0
    for a, b in zip(xs, xs[1:]):
        if b - a >= FROZEN_GAP:
            longest_freeze = max(longest_freeze, b - a)
            run = 0.0
        else:
            run += b - a
            longest_run = max(longest_run, run)
    return longest_run, longest_freeze


class FreezeWatch(threading.Thread):
    """Every change of the workload cgroup's `frozen` state, as it happens
    (cgroup.events wakes poll() with POLLPRI on a change)."""

    def __init__(self, group: str) -> None:
        super().__init__(daemon=True)
        self.path = os.path.join(group, "cgroup.events")
        self.changes: list[tuple[float, bool]] = []
        self.stop = False

    def run(self) -> None:
        import select

        with open(self.path) as f:
            p = select.poll()
            p.register(f, select.POLLPRI | select.POLLERR)
            last = None
            while not self.stop:
                f.seek(0)
                now = "frozen 1" in f.read()
                if now != last:
                    self.changes.append((time.monotonic(), now))
                    last = now
                p.poll(100)

    def longest_thawed(self, t0: float, t1: float) -> float:
        """The longest the group stayed thawed within [t0, t1]."""
        best, since = 0.0, None
        state = False
        for t, frozen in self.changes:
            if t < t0:
                state = frozen
                continue
            if t > t1:
                break
            if since is None and not state:
                since = t0
            if frozen and since is not None:
                best = max(best, t - since)
                since = None
            elif not frozen and since is None:
                since = t
            state = frozen
        if since is not None:
            best = max(best, t1 - since)
        return best


def timed_reader(path: str, out: str, stop: str) -> None:
    """(In a process of its own, so that it does not hold up the freeze
    watcher's thread): read `path` until `stop` exists; "start seconds" or
    "start ERR" per read into `out`."""
    lines = []
    while not os.path.exists(stop):
        t = time.monotonic()
        try:
            with open(path, "rb") as f:
                f.read()
            lines.append(f"{t} {time.monotonic() - t}")
        except OSError:
            lines.append(f"{t} ERR")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upgrades", type=int, default=5)
    ap.add_argument("--window", type=float, default=2.0, help="seconds around each upgrade, and between two")
    ap.add_argument("--timed-reader", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.timed_reader:
        return timed_reader(*args.timed_reader)
    total = (args.upgrades + 1) * (args.window + 4) + 10
    with daemon(extra=["--slice-ms", "10", "--log-level", "info"], handle=True) as r:
        mnt, sock = r.mount, r.socket
        for rel, v in (("0/max_inst", "4"), ("0/policy", "3"), ("default_memsize", str(1 << 30))):
            with open(os.path.join(mnt, rel), "w") as f:
                f.write(v)
        name = "benchupgrade"
        wl = subprocess.Popen([tool("cgpu"), "run", "--name", name, "--", tool("cgpu"), "workload", "--seconds",
                               str(total), "--json", "--interval", "0.002"],
                              env=r.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not os.path.isdir(os.path.join(mnt, "0", name)):
            time.sleep(0.05)
        from cgpud.containers.cgroups import v2_root

        watch = FreezeWatch(os.path.join(v2_root(), "cgpud", name))
        watch.start()
        files = ["version", "0/policy", "0/max_inst", f"0/{name}/weight", f"0/{name}/memsize"]
        stop = os.path.join(r.base, "reader.stop")
        out = os.path.join(r.base, "reader.out")
        cmds = "; ".join(f'cat {os.path.join(mnt, f)} > /dev/null && echo ok || echo FAILED' for f in files)
        reader = subprocess.Popen(["bash", "-c", f"while [ ! -e {stop} ]; do {cmds}; done > {out} 2>&1"])
        timed_out = os.path.join(r.base, "timed.out")
        timed = subprocess.Popen([sys.executable, __file__, "--timed-reader", os.path.join(mnt, "0/policy"),
                                  timed_out, stop])
        time.sleep(1.0)
        windows = []  # (normal t0, t1), (upgrade t0, t1), write seconds
        for _ in range(args.upgrades):
            n0 = time.monotonic()
            time.sleep(args.window)
            old = pid_of(sock)
            u0 = time.monotonic()
            w = subprocess.run(["bash", "-c", f"echo 1 > {mnt}/upgrade"], capture_output=True, text=True)
            wrote = time.monotonic() - u0
            if w.returncode != 0:
                raise SystemExit(f"upgrade failed: {w.stderr}")
            while True:
                try:
                    if pid_of(sock) != old:
                        break
                except Exception:  # noqa: BLE001 - the socket changes hands
                    pass
                time.sleep(0.01)
            u1 = time.monotonic()
            windows.append(((n0, n0 + args.window), (u0 - args.window / 2 + wrote, u0 + wrote + args.window / 2), wrote, u1 - u0))
            time.sleep(args.window / 2 + 0.5)
        watch.stop = True
        open(stop, "w").close()
        reader.wait(30)
        timed.wait(30)
        with open(timed_out) as f:
            timed_reads = [(float(a), b) for a, b in (x.split() for x in f.read().splitlines() if x)]
        wl.send_signal(signal.SIGTERM)
        wout, _ = wl.communicate(timeout=60)
        with open(out) as f:
            lines = f.read().splitlines()
        final = pid_of(sock)
        os.kill(final, signal.SIGTERM)
        while os.path.exists(f"/proc/{final}"):
            time.sleep(0.05)
        with open(os.path.join(r.base, "daemon.log")) as f:
            log = f.read()
    samples = [json.loads(x)["at"] for x in wout.splitlines() if x.startswith('{"at"')]
    switches = [float(m) / 1000 for m in re.findall(r"switch took (\d+) ms", log)]
    failed = sum(1 for x in lines if x != "ok")
    print(f"hot upgrades: {args.upgrades}; GNU cat reads: {len(lines)}, failed: {failed} (goal 0); "
          f"timed reads: {len(timed_reads)}, failed: {sum(b == 'ERR' for _, b in timed_reads)} (goal 0)")
    reads = [(t, float(b)) for t, b in timed_reads if b != "ERR"]
    print("per upgrade: how long `echo 1 > upgrade` took; the switch (old daemon's log); the scheduling gap\n"
          "(longest thawed stretch of the workload's cgroup, from cgroup.events) vs a normal window; the same\n"
          "from its iteration samples (longest run without a pause >= 8 ms); its longest frozen stretch\n"
          "(samples) vs normal; the longest read vs a normal window's p99")
    print(f"{'#':>2} {'write':>8} {'switch':>8} {'gap':>8} {'normal':>8} {'ratio':>6} {'samples':>8} {'normal':>8} "
          f"{'frozen':>8} {'normal':>8} {'max read':>9} {'p99 normal':>10}")
    gaps, sgaps = [], []
    for i, ((n0, n1), (u0, u1), wrote, _) in enumerate(windows):
        gap, ngap = watch.longest_thawed(u0, u1), watch.longest_thawed(n0, n1)
        g_run, g_frz = stretches(samples, u0, u1)
        n_run, n_frz = stretches(samples, n0, n1)
        reads_u = [s for t, s in reads if u0 <= t <= u1]
        reads_n = [s for t, s in reads if n0 <= t <= n1]
        gaps.append(gap)
        sgaps.append(g_run)
        sw = f"{switches[i] * 1000:6.0f}ms" if i < len(switches) else "     ?  "
        print(f"{i:2d} {wrote * 1000:6.0f}ms {sw} {gap * 1000:6.0f}ms {ngap * 1000:6.0f}ms {gap / ngap if ngap else 0:6.1f} "
              f"{g_run * 1000:6.0f}ms {n_run * 1000:6.0f}ms "
              f"{g_frz * 1000:6.0f}ms {n_frz * 1000:6.0f}ms {max(reads_u) * 1000:7.1f}ms {pct(reads_n, 99) * 1000:8.2f}ms")
    print(f"scheduling gap: max {max(gaps) * 1000:.0f} ms by cgroup.events, {max(sgaps) * 1000:.0f} ms by the samples "
          f"(goal <= 1000 ms); {max(gaps) / 0.010:.0f} base slices of 10 ms")


if __name__ == "__main__":
    main()
