"""bench/standin_card: libcgpu on the less kind stand-in card (issues 34/35: mixed kernel lengths,
programmatic dependent launches, concurrent streams), each figure against a reference measured in
the same run. The library is this tree's (or --libcgpu), on a shared GPU (bounded, GPU time counted,
the 2 ms default budget), no daemon; the card is the stand-in (native/stubs/cuda_exec.c).

1. mixed lengths: STEPS steps of a model's kernels (4 of 3 ms, 40 of 20 µs) launched as fast as the
   queue lets them: the most work queued ahead of a launch (its return to its kernel's start) from
   the second step on, against the bound (the budget and the one running kernel: 5 ms) and against the
   same job without libcgpu (nothing bounds it);
2. programmatic dependent launches: 20 rounds of a kernel and 7 PDL ones of 100 µs: how many of the 140
   pairs overlap through libcgpu, against the same job without it and with an event after each launch;
3. two concurrent streams of one process (8 × 500 µs then a synchronize, each): the GPU time charged
   against the card's busy time in its log.

    .venv/bin/python bench/standin_card.py [--steps 8] [--seconds 1.5] [--libcgpu PATH]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.fspath(ROOT / "tests"))

from queue_client import build, kernels  # noqa: E402


def libs_in(d: Path, libcgpu: str | None) -> Path:
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "stubs", "libcgpu", f"STUBS={d}",
                        f"LIB={d}"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"standin_card: the build failed: {r.stderr.strip().splitlines()[-1:]}")
    if libcgpu:
        shutil.copy2(libcgpu, d / "libcgpu.so")
    build(d)
    return d


def env_for(libs: Path, d: Path, bounded: bool) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
           "CGPU_STUB_CUDA_STATE": os.fspath(d / "card"), "CGPU_STUB_CUDA_LOG": os.fspath(d / "log")}
    if bounded:
        from cgpud.gpus import pages
        from cgpud.sched.gate import GateFreezer
        pages.create(os.fspath(d / "pages"), [1 << 30])
        g = GateFreezer(os.fspath(d / "pages"))
        g.share(None, True, 2000)
        g.close()
        env.update(LD_PRELOAD=os.fspath(libs / "libcgpu.so"), CGPU_PAGE_DIR=os.fspath(d / "pages"))
    return env


def charged(d: Path) -> int:
    from cgpud.gpus import pages
    raw = (d / "pages" / "usage").read_bytes()
    return sum(pages.BUSY.unpack_from(raw, pages.BUSY_OFFSET + k * pages.BUSY.size)[2] for k in range(pages.MAX_PROCS))


def mixed(libs: Path, d: Path, bounded: bool, steps: int) -> float:
    step = 44
    env = env_for(libs, d, bounded)
    r = subprocess.run([os.fspath(libs / "queue-client"), "burst", str(steps * step), "3000x4,20x40"], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        sys.exit(f"standin_card: the mixed job failed: {r.stderr.strip()}")
    returned = [int(x) for x in r.stdout.split()[:-1]]
    starts = [s for _, s, _ in sorted(kernels(d / "log"), key=lambda k: k[1])]
    return max(s - t for s, t in list(zip(starts, returned))[step:]) / 1e6


def pdl(libs: Path, d: Path, bounded: bool, events: bool) -> int:
    env = env_for(libs, d, bounded)
    p = subprocess.Popen([os.fspath(libs / "queue-client"), "pdl", "20", "8", "100"] + (["event"] if events else []),
                         env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.communicate("go\n", timeout=120)
    ks = sorted(kernels(d / "log")[2:], key=lambda k: k[1])
    return sum(b[1] < a[2] for a, b in zip(ks, ks[1:]))


def two(libs: Path, d: Path, seconds: float) -> tuple[float, float]:
    env = env_for(libs, d, True)
    r = subprocess.run([os.fspath(libs / "queue-client"), "two", str(seconds), "500", "8"], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        sys.exit(f"standin_card: the two-stream job failed: {r.stderr.strip()}")
    return charged(d) / 1e6, sum(e - s for _, s, e in kernels(d / "log")) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--libcgpu", help="a libcgpu.so to measure instead of this tree's")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="standin-card-") as tmp:
        t = Path(tmp)
        libs = libs_in(t / "libs", a.libcgpu)
        ahead = mixed(libs, t / "m1", True, a.steps)
        free = mixed(libs, t / "m0", False, a.steps)
        print(f"1 mixed lengths: most queued ahead of a launch {ahead:.2f} ms | bound 5.00 ms (budget + one 3 ms kernel)"
              f" | without libcgpu {free:.2f} ms")
        over = pdl(libs, t / "p1", True, False)
        alone, serial = pdl(libs, t / "p0", False, False), pdl(libs, t / "pe", False, True)
        print(f"2 PDL pairs overlapping (of 140): through libcgpu {over} | without it {alone}"
              f" | with an event after each launch {serial}")
        got, busy = two(libs, t / "s", a.seconds)
        print(f"3 two concurrent streams: charged {got:.1f} ms | the card's busy time {busy:.1f} ms"
              f" (ratio {got / busy:.3f}, goal 1.00)")


if __name__ == "__main__":
    main()
