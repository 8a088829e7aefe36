"""bench/cudart: what libcgpu adds to a kernel launch made through NVIDIA's real CUDA runtime
(issue 20), against the stand-in driver alone in the same run.

A program built by nvcc (the `nvidia-cuda-nvcc` wheel) against libcudart 12 or 13 launches
`<<<grid, 32>>>` N times in a loop on the stand-in with CGPU_STUB_CUDA_FAST=1 (launches free and
instant: what is left is the runtime, the driver's entry and whatever sits between them), with
and without LD_PRELOAD=libcgpu.so (a page of 1 GiB, the gate open), the two interleaved round by
round. Printed per runtime:

1. per launch in the loop: stand-in alone and with libcgpu, p50 over the rounds, and the added
   cost: the p50 of each round's difference (alone and with libcgpu run back to back), and the
   difference of the two best rounds (the least disturbed by the rest of a shared machine).
   Goal: added <= 100 ns (as for the driver API, bench/gate.py).
2. the process's first launch (the runtime loads the module then; libcgpu starts its gate's
   helper thread), p50 over as many processes.

    .venv/bin/python bench/cudart.py [--launches 200000] [--rounds 15]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from cgpud.gpus import pages  # noqa: E402
from real_cuda import RUNTIMES, build, env  # noqa: E402

TIMER = r"""
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cuda_runtime.h>
__global__ void step(int *p) { if (p) p[threadIdx.x] += 1; }
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    if (cudaFree(0) != cudaSuccess) return 2;  /* the runtime and its context up */
    double a = now();
    step<<<1, 32>>>(nullptr);
    double b = now();
    if (cudaGetLastError() != cudaSuccess) return 3;
    double c = now();
    for (long i = 0; i < n; i++) step<<<1, 32>>>(nullptr);
    double d = now();
    if (cudaDeviceSynchronize() != cudaSuccess) return 4;
    printf("%.2f %.0f\n", (d - c) / n, b - a);
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-cudart-"))
    r = subprocess.run(["make", "-s", "-B", "-C", str(ROOT / "native"), "stubs", "libcgpu", f"STUBS={tmp}",
                        f"LIB={tmp}"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr)
    pages.create(str(tmp / "pages"), [1 << 30])
    for rt in sorted(RUNTIMES):
        prog = build(TIMER, tmp / f"timer{rt}", rt)
        alone = env(tmp, rt, tmp, preload=False, CGPU_STUB_CUDA_FAST="1")
        held = env(tmp, rt, tmp, page_dir=tmp / "pages", CGPU_STUB_CUDA_FAST="1")
        loop = {"alone": [], "libcgpu": []}
        first = {"alone": [], "libcgpu": []}
        for _ in range(args.rounds):
            for name, e in (("alone", alone), ("libcgpu", held)):
                out = subprocess.run([str(prog), str(args.launches)], env=e, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"timer{rt} ({name}) failed: rc {out.returncode} {out.stderr}")
                per, one = map(float, out.stdout.split())
                loop[name].append(per)
                first[name].append(one)
        p, h = statistics.median(loop["alone"]), statistics.median(loop["libcgpu"])
        added = statistics.median(b - a for a, b in zip(loop["alone"], loop["libcgpu"]))
        best = min(loop["libcgpu"]) - min(loop["alone"])
        fp, fh = statistics.median(first["alone"]), statistics.median(first["libcgpu"])
        print(f"runtime {rt}: <<<>>> in a loop: stand-in alone {p:.1f} ns, with libcgpu {h:.1f} ns per launch (p50); "
              f"added p50 {added:.1f} ns, best rounds {min(loop['alone']):.1f} -> {min(loop['libcgpu']):.1f} ns "
              f"(+{best:.1f}) (goal <= 100 ns)")
        print(f"runtime {rt}: first launch of a process: stand-in alone {fp / 1000:.1f} µs, with libcgpu "
              f"{fh / 1000:.1f} µs; added p50 {(fh - fp) / 1000:.1f} µs")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
