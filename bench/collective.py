"""bench/collective: a two-rank job (a process per GPU, as torchrun starts them) sharing both GPUs at
1:1 with a neighbour on each (issue 34, item 1), against the stand-in's collectives by group
(CGPU_STUB_COLLECTIVE=<job>: each rank's n-th kernel is half of an all-reduce with the other rank's
n-th, and holds its card, spinning and never preempted, until its peer has started).

`cgpud serve --gpus sim:2xT4 --compute gate`, policy 2 on both GPUs, 10 ms slices. The job (weight 1,
GPUs 0 and 1) launches an all-reduce of KERNEL_US every 5 ms from each rank (tests/test_collectives.py's
rank); the neighbours (weight 1, one on each GPU) launch 1 ms kernels back to back (test_gate's launcher).
Figures, each against the same job alone in the same run (no neighbours, the same daemon and policy):

- the longest stall a closing causes: a half's time spinning for its peer (the card held, nothing
  done), p99 and max over the job's halves (goal: at most 2 slices, 20 ms; before issue 34, up to
  the daemon's 5 s drain cap when a closing fell between the two ranks' halves);
- the job's throughput (all-reduces per second, from the ranks' common start to the end of the
  last, in the card's own times) against its weight's share: it needs a fifth of each GPU and is
  entitled to half, so its share is all it asks for: the alone run's rate (goal at least 97 %);
- how well its turns were aligned: of the time it held GPU 0 (the daemon's trace), the part it held
  GPU 1 too (its switchers start its turns together: docs/isolation.md, "Gangs").

Both jobs are run: ranks that wait for each all-reduce (a training step) and ranks that do not
(--ahead alone: halves queued ahead on both cards), each quiet and beside --hogs CPU hogs (busy
shells at normal priority; the job alone measured beside as many). The per-launch cost of the
library's bookkeeping is bench/gate.py's (row 1).

--one-thread (issue 45, item 1): the job is one process whose one thread drives both GPUs (DataParallel's,
MirroredStrategy's loop: GPU 0's half, then GPU 1's, every 5 ms; CGPU_STUB_COLLECTIVE=1), under the same
closings; its hangs are counted too (a run not done 60 s past its time; goal 0).

    .venv/bin/python bench/collective.py [--seconds S] [--kernel-us US] [--hogs N] [--ahead | --wait] [--one-thread]
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
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from gang import Daemon  # noqa: E402  (bench/gang.py)
from test_collectives import RANK, halves  # noqa: E402
from test_gate import LAUNCHER  # noqa: E402

from cgpud.client import Client  # noqa: E402

CGPU = str(Path(sys.executable).parent / "cgpu")
PERIOD_US = 5000

# one_job COUNT KERNEL_US PERIOD_US WAIT STARTFILE: one thread, a context on each of devices 0 and 1,
# an all-reduce (a half on each, GPU 0's first) every PERIOD_US, each waited for when WAIT; its start
# (CLOCK_MONOTONIC seconds) written to STARTFILE
ONE_JOB = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    long count = atol(argv[1]);
    unsigned us = (unsigned)atoi(argv[2]);
    double period = atof(argv[3]) / 1e6;
    int wait = atoi(argv[4]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *ctx[2];
    if (!h || ((int (*)(unsigned))dlsym(h, "cuInit"))(0)) return 2;
    int (*create)(void **, unsigned, int) = (int (*)(void **, unsigned, int))dlsym(h, "cuCtxCreate_v2");
    int (*set)(void *) = (int (*)(void *))dlsym(h, "cuCtxSetCurrent");
    int (*sync)(void) = (int (*)(void))dlsym(h, "cuCtxSynchronize");
    l_t launch = (l_t)dlsym(h, "cuLaunchKernel");
    for (int d = 0; d < 2; d++)
        if (create(&ctx[d], 0, d)) return 3;
    double next = now() + 0.05;
    FILE *f = fopen(argv[5], "w");
    if (!f) return 4;
    fprintf(f, "%.9f\n", next);
    fclose(f);
    for (long i = 0; i < count; i++) {
        while (now() < next) { struct timespec t = {0, 100000}; nanosleep(&t, NULL); }
        next += period;
        for (int d = 0; d < 2; d++)
            if (set(ctx[d]) || launch(NULL, us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 5;
        for (int d = 0; d < 2 && wait; d++)
            set(ctx[d]), sync();
    }
    for (int d = 0; d < 2; d++)
        set(ctx[d]), sync();
    return 0;
}
"""


def run(libs: Path, tmp: Path, seconds: float, kernel_us: int, neighbours: bool, wait: bool = True,
        one_thread: bool = False) -> dict:
    """The job (and its neighbours): its halves' spins (ns), its all-reduces per second, whether it hung."""
    tmp.mkdir()
    d = Daemon(libs, tmp)
    procs = []
    try:
        d.write("0/policy", "2")
        d.write("1/policy", "2")
        with Client(str(d.socket)) as c:
            devices = c.call("hello")["devices"]
        env = dict(os.environ, CGPUD_SOCKET=str(d.socket), LD_LIBRARY_PATH=os.fspath(libs),
                   CGPU_STUB_CUDA_DEVICES="2", CGPU_STUB_CUDA_STATE=os.fspath(tmp / "card"))
        count = int(seconds * 1e6 / PERIOD_US)
        # (both ranks' periods from one start, once both came up: the container's start and the
        # processes' at normal priority are not the job's time, and the ranks start in step)
        (tmp / "meet").mkdir()
        rank = (f"CGPU_STUB_COLLECTIVE=job-{tmp.name} CGPU_STUB_CUDA_DEVICE={devices[0]},{devices[1]} "
                f"CGPU_STUB_CUDA_LOG={tmp}/rank$R {libs / 'rank'} $R {count} {kernel_us} {PERIOD_US} {int(wait)} @{tmp / 'meet'}")
        job = f"for R in 0 1; do R=$R sh -c '{rank}' & done; wait"
        if one_thread:
            job = (f"CGPU_STUB_COLLECTIVE=1 CGPU_STUB_CUDA_DEVICE={devices[0]},{devices[1]} CGPU_STUB_CUDA_LOG={tmp}/rank0 "
                   f"exec {libs / 'one_job'} {count} {kernel_us} {PERIOD_US} {int(wait)} {tmp / 'meet' / 'start'}")
        runs = [("job000000001", ["--gpus", "0,1"], job)]
        if neighbours:
            runs += [(f"neighbour{g:03}", ["--gpu", str(g)],
                      f"CGPU_STUB_CUDA_DEVICE={devices[g]} CGPU_STUB_CUDA_LOG={tmp}/n{g} "
                      f"exec {libs / 'launcher'} {seconds * 1.5 + 2} 1000 0 0") for g in (0, 1)]
        for name, gpus, cmd in reversed(runs):  # (the neighbours first: the job starts beside them)
            procs.append(subprocess.Popen([CGPU, "run", "--name", name, *gpus, "--mem", "64M", "--weight", "1",
                                           "--", "sh", "-c", cmd], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        if neighbours:
            for p in procs[:2]:
                assert p.stdout.readline().strip() == "started", p.stderr.read()
        try:
            out, err = procs[-1].communicate(timeout=seconds * 4 + 60)
        except subprocess.TimeoutExpired:
            return {"hung": 1}
        assert procs[-1].returncode == 0, err
        with Client(str(d.socket)) as c:  # (the job's slices: its last `seconds`, before its neighbours end)
            trace = c.call("trace", seconds=seconds)
        for p in procs[:-1]:
            p.communicate(timeout=seconds * 4 + 60)
        with Client(str(d.socket)) as c:
            stats = c.call("stats")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        d.stop()
    hs = [h for g in (0, 1) if (tmp / f"rank{g}").exists() for h in halves(tmp / f"rank{g}")]
    assert len(hs) == 2 * count, (len(hs), count)
    if one_thread:
        t0 = float((tmp / "meet" / "start").read_text())
    else:
        t0 = max(float((tmp / "meet" / f"ready{g}").read_text()) for g in (0, 1)) + 0.05  # (their start)
    spins = sorted(h[2] - h[1] - h[4] * 1000 for h in hs)
    # all-reduces a second, from the common start to the end of the last (the card's own times)
    return {"spins": spins, "rate": count / (max(h[2] for h in hs) / 1e9 - t0), "stats": stats,
            "aligned": aligned(trace, "job000000001"), "hung": 0}


def aligned(trace: dict, job: str) -> float | None:
    """Of the time the job held GPU 0 (the daemon's trace: the slices it was let run in), the part
    it held GPU 1 too: how well its turns were aligned (None: it was never stopped, nothing to align)."""
    held = []
    for g in trace["gpus"]:
        ks = {k for k, n in enumerate(g["names"]) if n.startswith(job)}
        spans = [(s[0], s[1]) for s in g["slices"] if ks & set(s[3])]
        if len(spans) == len(g["slices"]):
            return None
        held.append(spans)
    if len(held) != 2:
        return None
    both = sum(max(0, min(b, d) - max(a, c)) for a, b in held[0] for c, d in held[1])
    return both / max(1, sum(b - a for a, b in held[0]))


def hogs(n: int) -> list[subprocess.Popen]:
    """n CPU hogs (busy shells at normal priority) on this machine."""
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def p99(xs: list[int]) -> float:
    return xs[int(0.99 * (len(xs) - 1))] / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--kernel-us", type=int, default=1000)
    ap.add_argument("--hogs", type=int, default=4, help="CPU hogs in the loaded runs (0: quiet runs only)")
    ap.add_argument("--ahead", action="store_true", help="only the job whose ranks do not wait for their all-reduces")
    ap.add_argument("--wait", action="store_true", help="only the job whose ranks wait for each all-reduce")
    ap.add_argument("--one-thread", action="store_true", help="the job: one process, one thread driving both GPUs")
    a = ap.parse_args()
    jobs = [w for w in (True, False) if (not a.ahead and not a.wait) or (w and a.wait) or (not w and a.ahead)]
    loads = [0] + ([a.hogs] if a.hogs else [])
    two_slices = 20.0  # (2 slices of the default 10 ms, the daemon's here)
    rows, figures = [], []
    with tempfile.TemporaryDirectory() as d:
        libs = Path(d) / "libs"
        subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), "stubs", "libcgpu", f"STUBS={libs}",
                        f"LIB={libs}"], check=True)
        for name, src in (("rank", RANK), ("launcher", LAUNCHER), ("one_job", ONE_JOB)):
            (libs / f"{name}.c").write_text(src)
            subprocess.run(["gcc", "-O2", "-o", os.fspath(libs / name), os.fspath(libs / f"{name}.c"), "-ldl",
                            "-lpthread"], check=True)
        for wait in jobs:
            for load in loads:
                tag = f"{'waiting' if wait else 'ahead'}-{load}"
                hs = hogs(load)
                try:
                    alone = run(libs, Path(d) / f"alone-{tag}", a.seconds, a.kernel_us, False, wait, a.one_thread)
                    shared = run(libs, Path(d) / f"shared-{tag}", a.seconds, a.kernel_us, True, wait, a.one_thread)
                finally:
                    for h in hs:
                        h.kill()
                        h.wait()
                job = ("one thread on both GPUs, " if a.one_thread else "") + \
                    ("ranks waiting for each all-reduce" if wait else "ranks queueing ahead (--ahead)") + \
                    (f", {load} CPU hogs" if load else ", quiet")
                if alone["hung"] or shared["hung"]:
                    figures.append(f"figure [{job}]: HUNG (alone: {alone['hung']}, beside neighbours: "
                                   f"{shared['hung']}; goal 0)")
                    continue
                rows.append((job, alone, shared))
                ratio = shared["rate"] / alone["rate"]
                figures.append(
                    f"figure [{job}]: hangs 0; stall p99 {p99(shared['spins']):.2f} ms, max {shared['spins'][-1] / 1e6:.2f} ms "
                    f"against 2 slices ({two_slices:.0f} ms): {'met' if shared['spins'][-1] / 1e6 <= two_slices else 'NOT met'}; "
                    f"throughput {shared['rate']:.1f}/s against the job alone {alone['rate']:.1f}/s (its share: all it "
                    f"asks): {ratio * 100:.1f} % (goal 97 %: {'met' if ratio >= 0.97 else 'NOT met'})")
    print(f"{'':72} {'spin p99 ms':>12} {'spin max ms':>12} {'all-reduces/s':>14} {'turns aligned':>14}")
    for job, alone, shared in rows:
        for name, r in (("alone (reference)", alone), ("beside a neighbour per GPU", shared)):
            al = "-" if r["aligned"] is None else f"{r['aligned'] * 100:.0f} %"
            print(f"{(job + ': ' + name):72} {p99(r['spins']):12.2f} {r['spins'][-1] / 1e6:12.2f} {r['rate']:14.1f} "
                  f"{al:>14}")
    print("(turns aligned: of the time the job held GPU 0, the part it held GPU 1 too, from the daemon's trace)")
    for f in figures:
        print(f)


if __name__ == "__main__":
    main()
