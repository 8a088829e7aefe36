"""bench/monitor: what watching a node costs the daemon (docs/monitoring.md).

One simulated T4 under policy 2 with 8 idle instances of weight 1: each holds
one 10 ms slot, so the scheduler makes 100 decisions a second and its ring
of slices fills at that rate (the worst case for `trace`). Once the ring holds
its full 60 s:

- round trip of the `trace` op for the whole 60 s (what `cgpu trace --seconds
  60` asks) and of `query` + `stats` (what one `cgpu-smi` refresh asks),
  each against `hello` on the same connection in the same run (the protocol's
  floor), p50 and p99;
- the scheduler's slice-boundary lateness (mean over a window, from the
  stats op's count and sum) while nobody asks vs while a client asks for 60 s
  of trace every 0.5 s and for a cgpu-smi refresh every 0.1 s: the ratio.

Run as root: python bench/monitor.py [--window 10]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import daemon, pct  # noqa: E402

from cgpud.client import Client  # noqa: E402


def timed(c: Client, op: str, n: int, **args) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        c.call(op, **args)
        out.append(time.perf_counter() - t)
    return out


def lateness(c: Client) -> tuple[int, float]:
    st = c.call("stats")[0]["lateness"]
    return st["count"], st["sum"]


def mean_lateness(sock: str, window: float, load: bool) -> float:
    stop = threading.Event()

    def pester() -> None:
        with Client(sock) as c:
            k = 0
            while not stop.is_set():
                if k % 5 == 0:
                    c.call("trace", seconds=60)
                c.call("query")
                c.call("stats")
                k += 1
                stop.wait(0.1)

    th = threading.Thread(target=pester) if load else None
    with Client(sock) as c:
        n0, s0 = lateness(c)
        if th:
            th.start()
        time.sleep(window)
        n1, s1 = lateness(c)
    if th:
        stop.set()
        th.join()
    return (s1 - s0) / max(1, n1 - n0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=10.0, help="lateness window per case (s)")
    ap.add_argument("--n", type=int, default=50, help="round trips per op")
    args = ap.parse_args()
    with daemon(handle=True) as d:
        with open(os.path.join(d.mount, "0/policy"), "w") as f:
            f.write("2")
        with open(os.path.join(d.mount, "default_memsize"), "w") as f:
            f.write(str(1 << 30))
        for k in range(8):
            with open(os.path.join(d.mount, "inst_ctl"), "w") as f:
                f.write(f"0bench{os.getpid() % 100000:05d}.{k}")
        print("filling the ring (61 s) ...", flush=True)
        time.sleep(61)
        with Client(d.socket) as c:
            res = c.call("trace", seconds=60)
            n_slices = len(res["gpus"][0]["slices"])
            size = len(json.dumps(res))
            hello = timed(c, "hello", args.n)
            trace = timed(c, "trace", args.n, seconds=60)
            smi = [a + b for a, b in zip(timed(c, "query", args.n), timed(c, "stats", args.n))]
        quiet = mean_lateness(d.socket, args.window, load=False)
        busy = mean_lateness(d.socket, args.window, load=True)
    h50, h99 = pct(hello, 50), pct(hello, 99)
    print(f"ring: {n_slices} slices in 60 s; the trace answer is {size / 1024:.0f} KiB of JSON")
    print(f"hello (reference)      p50 {h50 * 1e3:7.2f} ms  p99 {h99 * 1e3:7.2f} ms")
    for name, xs in (("trace, 60 s", trace), ("query + stats (smi)", smi)):
        p50, p99 = pct(xs, 50), pct(xs, 99)
        print(f"{name:<22} p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms   ({p50 / h50:.1f}x / {p99 / h99:.1f}x hello)")
    print(f"scheduler lateness, mean: quiet {quiet * 1e6:.0f} µs, while watched {busy * 1e6:.0f} µs "
          f"({busy / quiet:.2f}x)")


if __name__ == "__main__":
    main()
