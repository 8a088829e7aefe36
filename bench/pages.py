"""bench/pages: what reading a container's usage page with pread (never mapped: docs/isolation.md,
"The pages") costs the daemon's switcher, against the mapped reads of `--base` (default main)'s
libcgpu-switch.so, built from its source in the same run.

A page of one GPU with N launching process slots (N = 1, 4, 32; 1 to 4 is a container's usual), its
gate closed, none of them drained: the two calls a switch makes on it, timed through ctypes over
many calls, interleaved rounds, the median of the rounds:

- `undrained`: who has not drained the closing (cg_page_undrained: at each closing, and at each wake
  while it waits);
- `gpu_ns`: the GPU time its processes got (cg_page_gpu_ns: twice a step, the runner's).

The ctypes call itself (cg_page_per_gpu, which reads nothing) is printed as the floor and
subtracted. Goal: a switch's reads (two of each) cost under 1 % of a 10 ms slice (100 µs).

    .venv/bin/python bench/pages.py [--base main] [--calls 20000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT  # noqa: E402
from cgpud.gpus import pages  # noqa: E402
from cgpud.sched import native  # noqa: E402


def build_base(base: str, where: str) -> str:
    """`base`'s libcgpu-switch.so, built from its source as native/Makefile builds it."""
    for rel in ("native/switch/cgpu-switch.c", "native/libcgpu/cgpu_page.h"):
        out = os.path.join(where, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(subprocess.run(["git", "-C", ROOT, "show", f"{base}:{rel}"], check=True,
                                   capture_output=True).stdout)
    so = os.path.join(where, "libcgpu-switch.so")
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o", so,
                    os.path.join(where, "native/switch/cgpu-switch.c"), "-lpthread"], check=True)
    return so


def lib(path: str) -> ctypes.CDLL:
    handle = ctypes.CDLL(path)
    native._declare(handle) if hasattr(handle, "cg_page_damage") else _declare_base(handle)
    return handle


def _declare_base(handle: ctypes.CDLL) -> None:
    P, I, VP = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    for name, res, args in (("cg_page_open", P, [ctypes.c_char_p, VP, I, ctypes.c_char_p, ctypes.c_size_t, VP]),
                            ("cg_page_release", None, [P]), ("cg_page_per_gpu", I, [P]),
                            ("cg_page_freeze", None, [P, I]), ("cg_page_undrained", I, [P, I, VP, I]),
                            ("cg_page_gpu_ns", ctypes.c_int64, [P, I])):
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = res, args


def make_page(directory: str, n: int) -> None:
    """Pages of one GPU whose first n slots are launching processes (this one), none drained."""
    pages.create(directory, [1 << 30])
    raw = bytearray(open(os.path.join(directory, "usage"), "rb").read())
    for k in range(n):
        pages.PROC_HEAD.pack_into(raw, pages.USAGE_HEAD.size + k * pages.PROC.size, os.getpid(), pages.GATED_PER_GPU,
                                  0, 1)
        pages.BUSY.pack_into(raw, pages.BUSY_OFFSET + k * pages.BUSY.size, 1, os.getpid(), 1000 + k,
                             *[0] * (pages.MAX_GPUS - 1))
    for w in range(pages.MAX_PROCS // 32):
        bits = sum(1 << b for b in range(32) if w * 32 + b < n)
        struct.pack_into("<I", raw, pages.GATED_OFFSET + 4 * w, bits)
    with open(os.path.join(directory, "usage"), "wb") as f:
        f.write(raw)


def per_call(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if native.load() is None:
        sys.exit(native.missing())
    tmp = tempfile.mkdtemp(prefix="cgpud-bench-pages-")
    libs = {f"{a.base} (mapped)": lib(build_base(a.base, os.path.join(tmp, "base"))),
            "this tree (pread)": lib(native.candidates()[0])}
    print(f"{'slots':>5}  {'build':<22} {'ctypes floor':>12} {'undrained':>10} {'gpu_ns':>8}  per switch (2 + 2)")
    for n in (1, 4, 32):
        handles = {}
        for label, so in libs.items():
            d = os.path.join(tmp, f"{n}-{len(handles)}")
            make_page(d, n)
            why, gone, gpus = ctypes.create_string_buffer(4400), ctypes.c_int(0), (ctypes.c_int * 1)(0)
            h = so.cg_page_open(os.fsencode(d), gpus, 1, why, len(why), ctypes.byref(gone))
            assert h, why.value
            so.cg_page_freeze(h, 0)
            assert so.cg_page_undrained(h, 0, None, 0) == n and so.cg_page_gpu_ns(h, 0) >= 0
            handles[label] = (so, h)
        rows: dict[str, list[tuple[float, float, float]]] = {label: [] for label in handles}
        for _ in range(a.rounds):  # (interleaved: a burst of load falls on both)
            for label, (so, h) in handles.items():
                floor = per_call(lambda: so.cg_page_per_gpu(h), a.calls)
                und = per_call(lambda: so.cg_page_undrained(h, 0, None, 0), a.calls)
                ns = per_call(lambda: so.cg_page_gpu_ns(h, 0), a.calls)
                rows[label].append((floor, und - floor, ns - floor))
        for label, got in rows.items():
            floor, und, ns = (statistics.median(x[i] for x in got) for i in range(3))
            print(f"{n:>5}  {label:<22} {floor:>10.0f} ns {und:>7.0f} ns {ns:>5.0f} ns  "
                  f"{(2 * und + 2 * ns) / 1000:.2f} µs = {(2 * und + 2 * ns) / 1e7 * 100:.3f} % of a 10 ms slice")
        for so, h in handles.values():
            so.cg_page_release(h)


if __name__ == "__main__":
    main()
