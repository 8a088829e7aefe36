"""bench/pools: stream-ordered pools, allocations in flight, new code after a fill (issue 34, items 2, 3
and 7; docs/memory.md).

The daemon runs with `--gpus nvml` on the tests' stand-in libnvidia-ml.so.1 and libcuda (native/stubs:
pools that keep what they reserve up to their release threshold, in 2 MiB pages; growth in the card's
steps; contexts of 500 MiB; an 8 GiB card), libcgpu for `cgpu run`, the memory watchdog killing past
memsize. Each figure is printed against the same job in the same run through the libcgpu of main
before this work (BEFORE, built from git):

1. a pool user in a 4 GiB instance (RMM-style: release threshold at the device's memory, the pool
   primed with free/2; then PyTorch-async-style: 64 MiB blocks allocated and freed back to the pool and
   reused, then 64 MiB and 2 MiB blocks until out-of-memory), with a neighbour instance of 4 GiB that
   allocates its memsize less its context and 3 % in 256 MiB steps meanwhile: what the pool user
   allocated before out-of-memory (goal >= memsize - context - 3 %), whether it was killed (goal no),
   the neighbour's in-quota allocations that failed (goal 0);
2. a 4 GiB allocation straddling one of the watchdog's readings (the stand-in pauses inside it for
   0.7 s: more than a look): for how long cuMemGetInfo then shows it charged twice (goal 0 ms);
3. a process that fills a 2 GiB instance and then launches six new functions of 64 MiB of code each:
   killed (goal no), the peak of NVML's figure for it (goal <= memsize + 1 %);
4. the cost per cuLaunchKernel of a loaded function (the stand-in's launches made free) through
   libcgpu now and through BEFORE's, against the stand-in alone: what the new bookkeeping adds.

    .venv/bin/python bench/pools.py [--launches 200000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from common import daemon  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402
from test_growth import CONTEXT, CONTEXT_MIB, NEW_CODE, NEW_LAUNCHES, PYTORCH_FILL, cgpu_run, finish, name  # noqa: E402
from test_libcgpu import build_libs  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
BEFORE = "4bb5e69"  # main when issue 34's memory work started


def build_before(where: Path, commit: str = BEFORE) -> str:
    """libcgpu.so as it was at `commit` (BEFORE), built into `where`."""
    src = where / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", os.path.dirname(HERE), "archive", commit, "native"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", os.fspath(src)], input=archive, check=True)
    subprocess.run(["make", "-s", "-C", os.fspath(src / "native"), "libcgpu", f"LIB={where}",
                    f"ZIG={os.environ.get('ZIG') or os.path.join(os.path.dirname(sys.executable), 'python-zig')}"],
                   check=True)
    return os.fspath(where / "libcgpu.so")


def through(lib: str | None) -> str:
    """Code that runs the program again through `lib` (None: as it is)."""
    if lib is None:
        return ""
    return f"""
import os, sys
if os.environ.get("LD_PRELOAD") != {lib!r}:
    os.environ["LD_PRELOAD"] = {lib!r}
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[-1], sys.argv[-1]])
"""


def killed(rc: int) -> bool:
    return rc in (137, -9)


POOL_USER = """
import time
s = ok(d.cuStreamCreate(1)); dev = ok(d.cuDeviceGet(0)); pool = ok(d.cuDeviceGetMemPool(dev))
OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
A = d.CUmemPool_attribute
ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(ok(d.cuDeviceTotalMem(dev)))))
free, total = ok(d.cuMemGetInfo())
ok(d.cuMemFreeAsync(ok(d.cuMemAllocAsync(free // 2, s)), s)); ok(d.cuStreamSynchronize(s))  # RMM's priming
print("primed", flush=True)
for _ in range(20):  # PyTorch's cudaMallocAsync backend: blocks freed to the pool and reused
    blocks = [ok(d.cuMemAllocAsync(64 * 2**20, s)) for _ in range(8)]
    for b in blocks:
        ok(d.cuMemFreeAsync(b, s))
    ok(d.cuStreamSynchronize(s))
    time.sleep(0.05)
held = 0
for size in (64 * 2**20, 2 * 2**20):
    while (r := d.cuMemAllocAsync(size, s))[0] == d.CUresult.CUDA_SUCCESS:
        held += size
    assert r[0] == OOM, r
ok(d.cuStreamSynchronize(s))
time.sleep(1.1)  # two looks of the watchdog
print("allocated", held, flush=True)
"""

NEIGHBOUR = """
import time
failed, got = 0, 0
want = 4 * 2**30 - 500 * 2**20 - 4 * 2**30 * 3 // 100
while got + 256 * 2**20 <= want:
    r = d.cuMemAlloc(256 * 2**20)
    if r[0] == d.CUresult.CUDA_SUCCESS:
        got += 256 * 2**20
    else:
        failed += 1
        time.sleep(0.05)
        if failed > 40:
            break
print("neighbour", failed, flush=True)
"""

START = "ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))\n"


def pool_user(run, lib: str | None) -> tuple[str, str, str]:
    p = cgpu_run(run, name("pu"), "4G", START + textwrap.dedent(POOL_USER), first=through(lib))
    primed = p.stdout.readline().strip()
    time.sleep(0.6)
    n = cgpu_run(run, name("pn"), "4G", START + textwrap.dedent(NEIGHBOUR), first=through(lib))
    rc, out, err = finish(p, timeout=120)
    nrc, nout, nerr = finish(n, timeout=120)
    allocated = next((int(line.split()[1]) for line in out.split("\n") if line.startswith("allocated")), None)
    failed = next((line.split()[1] for line in nout.split("\n") if line.startswith("neighbour")), f"rc {nrc}")
    what = f"{allocated >> 20} MiB" if allocated is not None else ("killed" if killed(rc) else f"failed rc {rc}")
    return what if primed == "primed" else f"failed: {err.strip()[-200:]}", "yes" if killed(rc) else "no", failed


STRADDLE = """
import time
ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
ok(d.cuMemGetInfo())
big = ok(d.cuMemAlloc(4 * 2**30))
end, twice, last = time.monotonic() + 3, 0.0, time.monotonic()
while (now := time.monotonic()) < end:
    free, total = ok(d.cuMemGetInfo())
    if total - free > 2 * 4 * 2**30:  # (more than the allocation twice, its context aside: charged twice)
        twice += now - last
    last = now
    time.sleep(0.005)
print("twice", twice, flush=True)
"""


def straddle(run, lib: str | None, tmp: Path) -> str:
    pause = tmp / f"pause{time.monotonic_ns()}"
    env_first = f"import os\nos.environ['CGPU_STUB_ALLOC_PAUSE'] = {os.fspath(pause)!r}\n"
    p = cgpu_run(run, name("st"), "9G", STRADDLE, first=env_first + through(lib))
    deadline = time.monotonic() + 30
    while not Path(f"{pause}.in").exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.002)
    time.sleep(0.7)  # (a look of the watchdog falls inside the call)
    Path(f"{pause}.go").write_text("")
    rc, out, err = finish(p, timeout=60)
    line = next((x for x in out.split("\n") if x.startswith("twice")), None)
    return f"{float(line.split()[1]) * 1000:.0f} ms" if line else f"failed rc {rc}: {err.strip()[-200:]}"


def new_code(run, lib: str | None) -> tuple[str, str]:
    rc, out, err = finish(cgpu_run(run, name("nc"), "2G", CONTEXT + NEW_CODE + PYTORCH_FILL + NEW_LAUNCHES,
                                   first=through(lib)), timeout=120)
    peak = next((int(x.split()[1]) for x in out.split("\n") if x.startswith("peak")), None)
    return "yes" if killed(rc) else "no", (f"{peak >> 20} MiB" if peak is not None else "(killed before)")


TIMER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*i_t)(unsigned); typedef int (*d_t)(int *, int); typedef int (*c_t)(void **, int);
typedef int (*s_t)(void *); typedef int (*m_t)(void **, const void *); typedef int (*f_t)(void **, void *, const char *);
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    int dev; void *ctx, *mod, *fn;
    if (((i_t)dlsym(h, "cuInit"))(0)) return 1;
    ((d_t)dlsym(h, "cuDeviceGet"))(&dev, 0);
    ((c_t)dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, dev);
    ((s_t)dlsym(h, "cuCtxSetCurrent"))(ctx);
    const char *ptx = ".version 8.0\n.target sm_75\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
    if (((m_t)dlsym(h, "cuModuleLoadData"))(&mod, ptx)) return 2;
    ((f_t)dlsym(h, "cuModuleGetFunction"))(&fn, mod, "k");
    l_t launch = (l_t)dlsym(h, "cuLaunchKernel");
    if (launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 3;  /* (its first launch: loaded) */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) if (launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 4;
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.2f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""


def launch_cost(tmp: Path, libs: Path, old: str, n: int, rounds: int) -> None:
    from cgpud.gpus import pages

    (tmp / "timer.c").write_text(TIMER)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(tmp / "timer"), os.fspath(tmp / "timer.c"), "-ldl"], check=True)
    pages.create(os.fspath(tmp / "lp"), [GIB])
    base = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_FAST": "1",
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card-timer")}
    now = {**base, "LD_PRELOAD": os.fspath(libs / "libcgpu.so"), "CGPU_PAGE_DIR": os.fspath(tmp / "lp")}
    before = {**now, "LD_PRELOAD": old}
    got: dict[str, list[float]] = {"alone": [], "now": [], "before": []}
    for _ in range(rounds):
        for k, env in (("alone", base), ("now", now), ("before", before)):
            got[k].append(float(subprocess.run([os.fspath(tmp / "timer"), str(n)], env=env, capture_output=True,
                                               text=True, check=True).stdout))
    a, w, b = (statistics.median(got[k]) for k in ("alone", "now", "before"))
    print(f"4. cuLaunchKernel of a loaded function (stand-in launches free), p50 of {rounds} rounds of {n}: "
          f"stand-in alone {a:.1f} ns; through libcgpu now {w:.1f} ns (+{w - a:.1f}), at {BEFORE} {b:.1f} ns "
          f"(+{b - a:.1f}): the new bookkeeping adds {w - b:+.1f} ns")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=200000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgpud-pools-") as tmp:
        tmp = Path(tmp)
        libs = build_libs(tmp / "libs")
        old = build_before(tmp / "before")
        stub = NvmlStub(libs, tmp / "nvml.conf", cuda_state=tmp / "card.state")
        stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
        stub.write()
        os.environ.update({**stub.env({}), "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card.state"),
                           "CGPU_STUB_CTX_MIB": str(CONTEXT_MIB), "CGPU_STUB_CUDA_MIB": "10240",
                           "CGPU_STUB_NVML_LAG_MS": "50"})
        with daemon("nvml", ["--libcgpu", os.fspath(libs / "libcgpu.so")], handle=True, devices=("nvidia0",)) as run:
            floor = 4 * GIB - CONTEXT_MIB * MIB - 4 * GIB * 3 // 100
            print(f"1. a pool user in a 4 GiB instance (RMM priming, PyTorch-async reuse), a 4 GiB neighbour "
                  f"allocating in quota, on a 10 GiB card (goal: >= {floor >> 20} MiB = memsize - context - 3 %; "
                  f"killed no; neighbour failures 0)")
            for label, lib in (("now", None), (f"at {BEFORE}", old)):
                allocated, was_killed, failed = pool_user(run, lib)
                print(f"   {label:10} allocated {allocated:>10}  killed {was_killed:>3}  neighbour's in-quota "
                      f"allocations failed {failed}")
            print("2. a 4 GiB allocation straddling a reading (9 GiB instance): time charged twice (goal 0 ms)")
            for label, lib in (("now", None), (f"at {BEFORE}", old)):
                print(f"   {label:10} {straddle(run, lib, tmp)}")
            print("3. a 2 GiB instance filled, then six new functions of 64 MiB of code launched "
                  f"(goal: killed no, NVML's peak <= {(2 * GIB + 2 * GIB // 100) >> 20} MiB)")
            for label, lib in (("now", None), (f"at {BEFORE}", old)):
                was_killed, peak = new_code(run, lib)
                print(f"   {label:10} killed {was_killed:>3}  NVML's peak for it {peak}")
        launch_cost(tmp, libs, old, args.launches, args.rounds)


if __name__ == "__main__":
    main()
