"""bench/tree_ops: the tree against procfs, measured in one run.

Prints p50/p99 of
  open/read/close   on 0/policy          vs /proc/sys/kernel/pid_max
  open/write/close  on 0/policy (durable, alternating 1/2)
                                          vs the same write of pid_max's current value
  a whole `cat` process on 0/policy      vs `cat` of the procfs file
and the ratios. Samples of both sides are interleaved so that noise from this
shared machine falls on both alike.

Goals (issue 2): read p50 <= 120 µs and p99 <= 300 µs; durable write
p99 <= 1.5 ms; whole-cat ratio <= 1.3x procfs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import daemon, pct, us  # noqa: E402

PROC = "/proc/sys/kernel/pid_max"


def read_once(path: str) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    os.read(fd, 4096)
    os.close(fd)
    return time.perf_counter() - t


def write_once(path: str, data: bytes) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, data)
    os.close(fd)
    return time.perf_counter() - t


def cat_once(path: str) -> float:
    t = time.perf_counter()
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def row(name: str, ours: list[float], ref: list[float]) -> tuple[float, float]:
    p50, p99 = pct(ours, 50), pct(ours, 99)
    r50, r99 = pct(ref, 50), pct(ref, 99)
    print(f"{name:<18} cgpu_km p50 {us(p50)} p99 {us(p99)} | procfs p50 {us(r50)} p99 {us(r99)} "
          f"| ratio p50 {p50 / r50:6.1f}x")
    return p50, p99


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=5000, help="samples per read/write series")
    ap.add_argument("--cats", type=int, default=400, help="samples of the whole-cat series")
    args = ap.parse_args()
    with daemon() as mnt:
        pol = os.path.join(mnt, "0", "policy")
        for _ in range(200):  # warm up: lookups cached, code paths hot
            read_once(pol), read_once(PROC)
        ours, ref = [], []
        for _ in range(args.n):
            ours.append(read_once(pol))
            ref.append(read_once(PROC))
        r50, r99 = row("open/read/close", ours, ref)

        cur = open(PROC).read().encode()
        ours, ref = [], []
        for i in range(args.n // 2):
            ours.append(write_once(pol, b"1\n" if i % 2 else b"2\n"))
            ref.append(write_once(PROC, cur))
        w50, w99 = row("open/write/close", ours, ref)

        ours, ref = [], []
        for _ in range(args.cats):
            ours.append(cat_once(pol))
            ref.append(cat_once(PROC))
        c50, _ = row("whole cat", ours, ref)
        cat_ratio = c50 / pct(ref, 50)

    print()
    print(f"read  p50 {r50 * 1e6:.0f} µs (goal <= 120)  p99 {r99 * 1e6:.0f} µs (goal <= 300)")
    print(f"write p99 {w99 * 1e6:.0f} µs durable (goal <= 1500)")
    print(f"whole cat {cat_ratio:.2f}x procfs (goal <= 1.3x)")


if __name__ == "__main__":
    main()
