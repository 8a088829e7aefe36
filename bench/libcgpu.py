"""bench/libcgpu: what the in-container library costs, and whether it ever
lets a container past memsize (issue 12), one run, against the stand-in
libcuda.so.1 (native/stubs) without the library in the same run.

1. Added cost per cuMemAlloc_v2 (+ cuMemFree_v2): a C client times N pairs
   through plain dlsym, with and without LD_PRELOAD=libcgpu.so, interleaved.
   Goal: added <= 2 µs per allocation.
2. Overshoot: 4 processes race 2,500 allocations each (10,000) of random
   sizes into one memsize that cannot hold them all; afterwards the card's
   bytes in use are compared with memsize. Goal: 0 bytes past it.

    .venv/bin/python bench/libcgpu.py [--pairs 200000]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from cgpud.gpus import pages  # noqa: E402

TIMER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*i_t)(unsigned); typedef int (*a_t)(unsigned long long *, size_t); typedef int (*f_t)(unsigned long long);
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    i_t init = (i_t)dlsym(h, "cuInit"); a_t alloc = (a_t)dlsym(h, "cuMemAlloc_v2"); f_t fr = (f_t)dlsym(h, "cuMemFree_v2");
    init(0);
    unsigned long long p;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) { if (alloc(&p, 4096)) return 1; fr(p); }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""

RACER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*i_t)(unsigned); typedef int (*a_t)(unsigned long long *, size_t);
int main(int argc, char **argv) {
    srand(atoi(argv[1]));
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    i_t init = (i_t)dlsym(h, "cuInit"); a_t alloc = (a_t)dlsym(h, "cuMemAlloc_v2");
    init(0);
    unsigned long long p; long ok = 0;
    for (int i = 0; i < 2500; i++) ok += alloc(&p, 1 + (size_t)(rand() % (1 << 20))) == 0;
    printf("%ld\n", ok);
    fflush(stdout);
    getchar();  /* hold it until told */
    return 0;
}
"""


def build(tmp: Path) -> tuple[Path, Path, Path]:
    r = subprocess.run(["make", "-s", "-B", "-C", str(ROOT / "native"), "stubs", "libcgpu", f"STUBS={tmp}",
                        f"LIB={tmp}"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr)
    progs = []
    for name, src in (("timer", TIMER), ("racer", RACER)):
        (tmp / f"{name}.c").write_text(src)
        subprocess.run(["gcc", "-O2", "-o", str(tmp / name), str(tmp / f"{name}.c"), "-ldl"], check=True)
        progs.append(tmp / name)
    return tmp, progs[0], progs[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-libcgpu-"))
    libs, timer, racer = build(tmp)
    pages.create(str(tmp / "pages"), [1 << 40])
    base = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": str(libs), "CGPU_STUB_CUDA_STATE": str(tmp / "card"),
            "CGPU_STUB_CUDA_MIB": str(1 << 21)}
    lib = {**base, "LD_PRELOAD": str(libs / "libcgpu.so"), "CGPU_PAGE_DIR": str(tmp / "pages")}
    plain, held = [], []
    for _ in range(args.rounds):
        plain.append(float(subprocess.run([str(timer), str(args.pairs)], env=base, capture_output=True,
                                          text=True, check=True).stdout))
        held.append(float(subprocess.run([str(timer), str(args.pairs)], env=lib, capture_output=True,
                                         text=True, check=True).stdout))
    p, h = sorted(plain)[len(plain) // 2], sorted(held)[len(held) // 2]
    print(f"cuMemAlloc_v2 + cuMemFree_v2 through dlsym: stand-in alone {p:.0f} ns, with libcgpu {h:.0f} ns per pair; "
          f"added {h - p:.0f} ns ({h / p:.2f}x; goal <= 2000 ns)")

    memsize = 3 * 1000 * (1 << 20) // 2  # 1.5 GB: about 3,000 of the 10,000 random allocations fit
    (tmp / "card").unlink()
    pages.create(str(tmp / "pages"), [memsize])
    procs = [subprocess.Popen([str(racer), str(seed)], env=lib, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for seed in range(4)]
    granted = sum(int(pr.stdout.readline()) for pr in procs)
    card = int.from_bytes((tmp / "card").read_bytes()[:8], "little")
    used = pages.used(str(tmp / "pages"))[0]
    for pr in procs:
        pr.communicate("", timeout=30)
    print(f"10,000 racing allocations from 4 processes into a memsize of {memsize} bytes: {granted} granted, "
          f"{used} bytes held by the page, {card} on the card; past memsize: {max(0, card - memsize)} bytes (goal 0)")


if __name__ == "__main__":
    main()
