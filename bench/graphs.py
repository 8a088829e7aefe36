"""bench/graphs: CUDA graphs captured while the compute gate closes (issue 23, part 1).

NVIDIA's real runtime (cuda.bindings.runtime, libcudart 13) captures graphs in the global capture
mode, as PyTorch does, on the stand-in driver (native/stubs/cuda_graphs.c keeps the driver's
capture rules): each capture launches 5 kernels over ~10 ms, then the graph is instantiated,
replayed and waited for (tests/test_graphs.py's CAPTURER). Meanwhile the container's gate is
closed N times (default 1,000) as the scheduler closes it: closed, drained (libcgpu's helper
thread synchronizes the context), kept closed 2 ms, opened, open 4 ms.

Figure: captures invalidated by the closings (goal 0), against the reference measured in the
same run: the same loop without libcgpu (the gate closes on nobody).

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
from test_graphs import CAPTURER, closings  # noqa: E402


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
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        t0 = time.monotonic()
        closings(gate, n, 0.002, 0.004)
        took = time.monotonic() - t0
        (tmp / "stop").touch()
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
        gate.thaw()
        gate.close()
    captures, invalidated, replayed = map(int, out.split())
    return captures, invalidated, replayed, took


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
    print(f"{'':34} {'captures':>9} {'invalidated':>12} {'replayed':>9} {'closings':>9} {'seconds':>8}")
    for name, (c, i, r, s) in (("with libcgpu (gate closing)", gated), ("reference: without libcgpu", ref)):
        print(f"{name:34} {c:9d} {i:12d} {r:9d} {a.closings:9d} {s:8.1f}")
    print(f"figure: captures invalidated while the gate closed {a.closings} times: {gated[1]} "
          f"(reference without libcgpu: {ref[1]}; goal 0)")


if __name__ == "__main__":
    main()
