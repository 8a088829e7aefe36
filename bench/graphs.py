"""bench/graphs: CUDA graphs captured while the compute gate closes (issue 23, part 1).

NVIDIA's real runtime (cuda.bindings.runtime, libcudart 13) captures graphs in the global capture
mode, as PyTorch does, on the stand-in driver (native/stubs/cuda_graphs.c keeps the driver's
capture rules): each capture launches 5 kernels over ~10 ms, then the graph is instantiated,
replayed and waited for (tests/test_graphs.py's CAPTURER). Meanwhile the container's gate is
closed N times (default 1,000) as the scheduler closes it: closed, drained (libcgpu's helper
thread synchronizes the context), kept closed 2 ms, opened, open 4 ms.

Figure: captures invalidated by the closings (goal 0), against the reference measured in the
same run: the same loop without libcgpu (the gate closes on nobody).

Figure 2 (issue 45, item 2): a global-mode capture on GPU 1 (tests/test_graphs.py's TWO_GPUS: another
thread captures 5 kernels over ~10 ms, again and again) while GPU 0's work is not bounded (the GPUs
not shared: each drain synchronizes GPU 0's context), GPU 0's gate closed N / 4 times: captures
invalidated (goal 0), against the same without libcgpu.

    .venv/bin/python bench/graphs.py [--closings N]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from cgpud.gpus import pages  # noqa: E402
from cgpud.sched.gate import GateFreezer  # noqa: E402
from real_cuda import UUID  # noqa: E402
from test_graphs import CAPTURER, TWO_GPUS, closings, stopped  # noqa: E402


def run(libs: Path, tmp: Path, n: int, preload: bool) -> tuple[int, int, int, float]:
    """(captures, invalidated, replayed, seconds) of the capturer while the gate closes n times."""
    tmp.mkdir()
    pages.create(os.fspath(tmp / "pages"), [1 << 30])
    gate = GateFreezer(os.fspath(tmp / "pages"))
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_UUIDS": UUID,
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CGPU_PAGE_DIR": os.fspath(tmp / "pages")}
    if preload:
        env["LD_PRELOAD"] = os.fspath(libs / "libcgpu.so")
    p = subprocess.Popen([sys.executable, "-c", CAPTURER, os.fspath(tmp / "stop")], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop = None
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        t0 = time.monotonic()
        closings(gate, n, 0.002, 0.004)
        took = time.monotonic() - t0
        stop = tmp / "stop"
    finally:
        out = stopped(p, gate, stop)
    captures, invalidated, replayed = map(int, out.splitlines()[0].split())  # (then each capture's span)
    return captures, invalidated, replayed, took


def two_gpus(libs: Path, tmp: Path, n: int, preload: bool) -> tuple[int, int]:
    """(captures, invalidated) on GPU 1 while GPU 0's gate closes n times, its work untracked."""
    tmp.mkdir()
    pages.create(os.fspath(tmp / "pages"), [1 << 30, 1 << 30])
    gate = GateFreezer(os.fspath(tmp / "pages"), gpus=[0, 1])
    for k in (0, 1):
        gate.share(k, False, 2000)
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_DEVICES": "2",
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CGPU_PAGE_DIR": os.fspath(tmp / "pages")}
    if preload:
        env["LD_PRELOAD"] = os.fspath(libs / "libcgpu.so")
    p = subprocess.Popen([sys.executable, "-c", TWO_GPUS, os.fspath(tmp / "stop"), "1"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop = None
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        for _ in range(n):
            gate.freeze(0)
            t0 = time.monotonic()
            while gate.undrained(0) and time.monotonic() - t0 < 5:
                time.sleep(0.0005)
            gate.thaw(0)
            time.sleep(0.01)
        stop = tmp / "stop"
    finally:
        out = stopped(p, gate, stop)
    captures, invalidated = map(int, out.split())
    return captures, invalidated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--closings", type=int, default=1000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        libs = Path(d) / "libs"
        subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), "stubs", "libcgpu", f"STUBS={libs}",
                        f"LIB={libs}"], check=True)
        gated = run(libs, Path(d) / "gated", a.closings, True)
        ref = run(libs, Path(d) / "ref", a.closings, False)
        two = two_gpus(libs, Path(d) / "two", a.closings // 4, True)
        two_ref = two_gpus(libs, Path(d) / "two-ref", a.closings // 4, False)
    print(f"{'':34} {'captures':>9} {'invalidated':>12} {'replayed':>9} {'closings':>9} {'seconds':>8}")
    for name, (c, i, r, s) in (("with libcgpu (gate closing)", gated), ("reference: without libcgpu", ref)):
        print(f"{name:34} {c:9d} {i:12d} {r:9d} {a.closings:9d} {s:8.1f}")
    print(f"figure: captures invalidated while the gate closed {a.closings} times: {gated[1]} "
          f"(reference without libcgpu: {ref[1]}; goal 0)")
    print(f"figure 2: global-mode captures on GPU 1 invalidated while GPU 0 drained untracked work "
          f"{a.closings // 4} times: {two[1]} of {two[0]} (reference without libcgpu: {two_ref[1]} of {two_ref[0]}; "
          f"goal 0)")


if __name__ == "__main__":
    main()
