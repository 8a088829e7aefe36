"""bench/gate: what the compute gate (libcgpu + cgpud.sched.gate, issue 12)
costs and how well it shares, against the stand-in libcuda.so.1 in the same run.

1. Added cost per ungated cuLaunchKernel: a C client times N launches through
   plain dlsym (the stand-in's launches made free: CGPU_STUB_CUDA_FAST=1), with
   and without libcgpu (gate open), interleaved rounds. Goal: p50 <= 100 ns.
   Against reference libcgpus built in the same run from other revisions'
   native/ (--ref, repeatable; default 4bb5e69, the main issue 34 was filed
   against: what its new bookkeeping adds per launch, and main as it is now),
   the same client and stand-in, their rounds interleaved with ours. The
   client launches a function of a module it loaded (through libcgpu, the
   lazy-load check reads the launched functions' table at every launch; a
   NULL function, as before issue 45, skipped it).
1b. The same per launch in the launching thread's CPU time, by 1 thread and
   by 4 launching at once, gate open and bounded, for this libcgpu and each
   reference (issue 45, item 10: no process-wide lock on the launch path;
   goal <= 40 ns added open, no growth with threads); and what the stand-in's
   cuCtxGetCurrent alone costs (the driver call a launch made before libcgpu
   kept the thread's current context: a reference's figures include it).
1c. The same in instructions per launch, gate open (valgrind's callgrind,
   where it is installed): what the machine's load does not move.
2. Gate opened -> a waiting launch proceeds: the gate driven as the daemon
   drives it (the GPU's switcher thread, libcgpu-switch.so); the time from just
   before it opens to the start of the first kernel the stand-in logs after it.
   Goal: p99 <= 200 us.
3. Share error through the gate: `cgpud serve --compute gate`, max_inst 4,
   10 ms slices, 2 and 3 instances under `cgpu run` launching 1 ms kernels, for
   policies 0-3; each instance's share of the card's kernel time against what
   its policy gives it, over whole turns of the ring (from a start of the first
   instance's run to another, past the first and before the last 0.5 s).
   Goal: <= 0.5 pp.
5. High-priority takeover, from timestamps: a normal instance keeps the card
   busy with 1 ms kernels (one queued behind the running one); a high-priority
   instance waits at its closed gate; the takeover is done as the scheduler
   does it (the normal gate closed, its work drained, the high-priority gate
   opened). Printed: gate opened -> the high-priority kernel starts, and
   takeover decided -> it starts, from the same clock (CLOCK_MONOTONIC: the
   stand-in's kernel log), no kernel time subtracted.
4. Daemon CPU with 25 gated instances (policy 2, max_inst 25, weight 1 each,
   10 ms; metrics served, as by default), and the same with freezing, in the
   same run. Goal: gated <= 2 % of
   a core. By thread (schedstat: nanoseconds, not clock ticks): the switcher
   thread against a bare C thread waking as often; the trio thread against a
   bare trio loop waking as often.

    .venv/bin/python bench/gate.py [--quick] [--ref REV] [--launch-only]

(--launch-only: part 1 alone, against the reference: about a minute.)
"""
from __future__ import annotations

import argparse
import bisect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from cgpud.gpus import pages  # noqa: E402
from cgpud.sched import native  # noqa: E402
from cgpud.sched.gate import GateFreezer  # noqa: E402
from test_gate import LAUNCHER  # noqa: E402  (the tests' client)

CGPU = str(Path(sys.executable).parent / "cgpu")
CGPUD = str(Path(sys.executable).parent / "cgpud")

TIMER = r"""
/* timer N [THREADS [ctx]]: N launches of a kernel (a function of a module loaded as an application loads
   one: through libcgpu, its lazy-load check runs at every launch) through plain dlsym by each of
   THREADS threads (default 1) started together; prints the mean of the threads' ns per launch, wall
   and the thread's own CPU time (CLOCK_THREAD_CPUTIME_ID: what a thread waiting for a core does not
   count, so a machine with fewer free cores than THREADS measures the launch path, not the scheduler).
   With "ctx": N calls of cuCtxGetCurrent instead (the one driver call libcgpu adds to a launch) */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*i_t)(unsigned);
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
static long n;
static l_t launch;
static void *(*set)(void *);
static int (*get)(void **);
static int ctx_only;
static pthread_barrier_t go;
static void *ctx, *fn;
static double ns_of(struct timespec a, struct timespec b) { return (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec); }
static void *run(void *out) {
    ((int (*)(void *))set)(ctx);
    pthread_barrier_wait(&go);
    struct timespec a, b, ca, cb;
    clock_gettime(CLOCK_MONOTONIC, &a);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ca);
    void *c;
    if (ctx_only)
        for (long i = 0; i < n; i++) { if (get(&c)) exit(2); }
    else
        for (long i = 0; i < n; i++) if (launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) exit(2);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cb);
    clock_gettime(CLOCK_MONOTONIC, &b);
    ((double *)out)[0] = ns_of(a, b) / n;
    ((double *)out)[1] = ns_of(ca, cb) / n;
    return NULL;
}
int main(int argc, char **argv) {
    n = atol(argv[1]);
    int k = argc > 2 ? atoi(argv[2]) : 1;
    ctx_only = argc > 3;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    get = (int (*)(void **))dlsym(h, "cuCtxGetCurrent");
    i_t init = (i_t)dlsym(h, "cuInit"); launch = (l_t)dlsym(h, "cuLaunchKernel");
    set = (void *(*)(void *))dlsym(h, "cuCtxSetCurrent");
    if (init(0) || ((int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, 0)) return 1;
    ((int (*)(void *))set)(ctx);
    void *mod;
    static const char ptx[] = ".version 8.0\n.target sm_75\n.address_size 64\n.visible .entry k0()\n{\nret;\n}\n";
    if (((int (*)(void **, const void *))dlsym(h, "cuModuleLoadData"))(&mod, ptx)
        || ((int (*)(void **, void *, const char *))dlsym(h, "cuModuleGetFunction"))(&fn, mod, "k0")) return 1;
    pthread_t t[64];
    double ns[64][2], wall = 0, cpu = 0;
    pthread_barrier_init(&go, NULL, (unsigned)k);
    for (int i = 0; i < k; i++) pthread_create(&t[i], NULL, run, ns[i]);
    for (int i = 0; i < k; i++) pthread_join(t[i], NULL), wall += ns[i][0], cpu += ns[i][1];
    printf("%.2f %.2f\n", wall / k, cpu / k);
    return 0;
}
"""


FUTEX = r"""
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static long now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec; }
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    struct { uint32_t word; long sent, got[100000]; } *m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE,
                                                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (fork() == 0) {  /* the waiter: as a launch at a closed gate */
        for (uint32_t k = 0; k < (uint32_t)n; k++) {
            while (__atomic_load_n(&m->word, __ATOMIC_SEQ_CST) == k)
                syscall(SYS_futex, &m->word, FUTEX_WAIT, k, NULL, NULL, 0);
            m->got[k] = now() - m->sent;
        }
        _exit(0);
    }
    for (int k = 0; k < n; k++) {
        usleep(3000);  /* the waiter sleeps, its CPU idle, as between slices */
        m->sent = now();
        __atomic_add_fetch(&m->word, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &m->word, FUTEX_WAKE, 1, NULL, NULL, 0);
    }
    wait(NULL);
    for (int k = 0; k < n; k++) printf("%ld\n", m->got[k]);
    return 0;
}
"""

WAKES = r"""
#define _GNU_SOURCE
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
/* wakes RATE SECONDS: a thread that, RATE times a second, sleeps to a step's end and then waits for an
   answer from another process (which gives it 1 ms later), as the switcher does; prints its CPU % */
static double cpu(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    double rate = atof(argv[1]), seconds = atof(argv[2]);
    int ask[2], answer[2];
    if (pipe(ask) || pipe(answer)) return 1;
    pid_t child = fork();
    if (child == 0) {
        char c;
        fclose(stdout);
        while (read(ask[0], &c, 1) == 1) { usleep(1000); if (write(answer[1], &c, 1) != 1) return 1; }
        return 0;
    }
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long step = (long)(1e9 / rate), n = (long)(rate * seconds);
    double c0 = cpu();
    for (long i = 0; i < n; i++) {
        t.tv_nsec += step;
        while (t.tv_nsec >= 1000000000) { t.tv_nsec -= 1000000000; t.tv_sec++; }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL);
        char c = 'x';
        if (write(ask[1], &c, 1) != 1) return 1;
        struct pollfd p = {.fd = answer[0], .events = POLLIN};
        poll(&p, 1, -1);
        if (read(answer[0], &c, 1) != 1) return 1;
    }
    printf("%.3f\n", (cpu() - c0) / seconds * 100);
    kill(child, SIGKILL);
    return 0;
}
"""

TRIO_LOOP = """
import sys, time, trio
from cgpud.sched.timerfd import TimerFd
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
async def main():
    t = TimerFd()
    c0, w0 = time.process_time(), time.monotonic()
    due = trio.current_time()
    while time.monotonic() - w0 < seconds:
        due += 1 / rate
        await t.sleep_until(due)
    print((time.process_time() - c0) / (time.monotonic() - w0) * 100)
trio.run(main)
"""


def build(tmp: Path) -> Path:
    r = subprocess.run(["make", "-s", "-B", "-C", str(ROOT / "native"), "stubs", "libcgpu", f"STUBS={tmp}",
                        f"LIB={tmp}"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr)
    for name, src in (("timer", TIMER), ("launcher", LAUNCHER), ("futex", FUTEX), ("wakes", WAKES)):
        (tmp / f"{name}.c").write_text(src)
        subprocess.run(["gcc", "-O2", "-o", str(tmp / name), str(tmp / f"{name}.c"), "-ldl", "-lpthread"], check=True)
    return tmp


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build_ref(tmp: Path, rev: str) -> Path | None:
    """libcgpu.so of revision `rev`'s native/ (git archive), built as ours is; None where it cannot be."""
    src = tmp / f"ref-src-{rev}"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "native"], capture_output=True)
    if archive.returncode:
        print(f"(no reference: git archive {rev}: {archive.stderr.decode().strip()})")
        return None
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    zig = ROOT / ".venv" / "bin" / "python-zig"
    r = subprocess.run(["make", "-s", "-C", str(src / "native"), "libcgpu", f"LIB={tmp / ('ref-' + rev)}",
                        *([f"ZIG={zig}"] if zig.exists() else [])], capture_output=True, text=True)
    if r.returncode:
        print(f"(no reference: {rev}'s libcgpu does not build: {r.stderr.strip()[-300:]})")
        return None
    return tmp / f"ref-{rev}" / "libcgpu.so"


def share_pages(tmp: Path, d: str, on: bool) -> Path:
    """A container's pages in tmp/d, its GPU shared (`on`: launches bounded) or alone."""
    pages.create(str(tmp / d), [1 << 30])
    g = GateFreezer(str(tmp / d))
    g.share(None, on, 2000)
    g.close()
    return tmp / d


def launch_cost(tmp: Path, n: int, rounds: int, refs: dict[str, Path] | None = None) -> None:
    """Alone on its GPU (the page's shared bit clear: what the scheduler says once an instance has
    the GPU to itself), and bounded (the bit set: an event every few launches, docs/scheduler.md),
    by 1 thread and by 4 at once. With `refs`, the same with those libcgpus, interleaved: what ours
    adds against them. Each figure is a median over the rounds; 1b's are the threads' CPU time per
    launch (wall time with more threads than free cores measures the machine's scheduler)."""
    # (the stand-in alone with the same environment's names: its launch reads the environment with getenv, whose
    # cost grows with the entries before a match: two more entries cost it ~90 instructions a launch)
    base = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": str(tmp), "CGPU_STUB_CUDA_FAST": "1",
            "CGPU_STUB_CUDA_STATE": str(tmp / "card1"), "LD_PRELOAD": "", "CGPU_PAGE_DIR": str(tmp / "none")}
    libs = {"this": tmp / "libcgpu.so", **(refs or {})}
    runs = {("stand-in", "-"): base}
    for rev, lib in libs.items():  # (each its own pages: one libcgpu's slots are its)
        for how, on in (("alone", False), ("bounded", True)):
            runs[(rev, how)] = {**base, "LD_PRELOAD": str(lib), "CGPU_PAGE_DIR": str(share_pages(tmp, f"{how}-{rev}", on))}
    got: dict[tuple, dict[str, list[float]]] = {key: {"wall": [], "cpu": [], "wall4": [], "cpu4": []} for key in runs}
    ctx: list[float] = []

    def timed(env: dict, *args: str) -> list[float]:
        out = subprocess.run([str(tmp / "timer"), *args], env=env, capture_output=True, text=True, check=True).stdout
        return [float(x) for x in out.split()]

    for _ in range(rounds):
        for key, env in runs.items():
            for suffix, threads in (("", 1), ("4", 4)):
                wall, cpu = timed(env, str(n // threads), str(threads))
                got[key]["wall" + suffix].append(wall)
                got[key]["cpu" + suffix].append(cpu)
        ctx.append(timed(base, str(n), "1", "ctx")[1])
    med = {key: {k: statistics.median(v) for k, v in d.items()} for key, d in got.items()}
    p = med[("stand-in", "-")]
    h, b = med[("this", "alone")], med[("this", "bounded")]
    print(f"1. cuLaunchKernel through dlsym, gate open: stand-in alone {p['wall']:.1f} ns, with libcgpu "
          f"{h['wall']:.1f} ns; added p50 {h['wall'] - p['wall']:.1f} ns ({h['wall'] / p['wall']:.2f}x; goal <= 100 ns); "
          f"on a shared GPU (its queue bounded) {b['wall']:.1f} ns, added {b['wall'] - p['wall']:.1f} ns")
    print(f"1b. per launch, CPU ns of the launching thread, 1 thread / 4 threads launching at once (issue 45, item 10: "
          f"no process-wide lock on the launch path; goal <= 40 ns added open, no growth with threads), {rounds} "
          f"interleaved rounds of {n} launches: stand-in alone {p['cpu']:.1f} / {p['cpu4']:.1f} ns; the stand-in's "
          f"cuCtxGetCurrent alone (a launch's one driver call before libcgpu kept the thread's current context: "
          f"in a reference's figures below, not in this one's) {statistics.median(ctx):.1f} ns")
    for rev in libs:
        a, bb = med[(rev, "alone")], med[(rev, "bounded")]
        print(f"   {rev + ' libcgpu' if rev == 'this' else rev + chr(39) + 's libcgpu'}: gate open added "
              f"{a['cpu'] - p['cpu']:.1f} / {a['cpu4'] - p['cpu4']:.1f} ns; bounded added {bb['cpu'] - p['cpu']:.1f} / "
              f"{bb['cpu4'] - p['cpu4']:.1f} ns (wall, 4 threads: open {a['wall4']:.1f} ns against the stand-in's "
              f"{p['wall4']:.1f})")
    instructions(tmp, runs, libs)
    for rev in refs or {}:
        rh, rb = got[(rev, "alone")]["wall"], got[(rev, "bounded")]["wall"]
        held, shared = got[("this", "alone")]["wall"], got[("this", "bounded")]["wall"]
        spread = statistics.median(abs(x - y) for x, y in zip(held, rh))
        print(f"   against {rev}'s libcgpu, wall, 1 thread: alone {h['wall']:.1f} ns vs {statistics.median(rh):.1f} ns "
              f"(this one adds {h['wall'] - statistics.median(rh):+.1f} ns a launch); bounded {b['wall']:.1f} ns vs "
              f"{statistics.median(rb):.1f} ns (this one adds {b['wall'] - statistics.median(rb):+.1f} ns); a round's own "
              f"difference varies by {spread:.1f} ns (median |ours - {rev}'s|); best rounds: alone {min(held):.1f} vs "
              f"{min(rh):.1f} ns ({min(held) - min(rh):+.1f}), bounded {min(shared):.1f} vs {min(rb):.1f} ns "
              f"({min(shared) - min(rb):+.1f})")


def instructions(tmp: Path, runs: dict, libs: dict) -> None:
    """1c. Instructions per launch, counted by valgrind's callgrind (what no other load on the machine
    moves): the difference between two runs of the timer, 20 000 and 120 000 launches, over the
    100 000 more, so what the start costs cancels out; against the stand-in alone, same environment."""
    if not shutil.which("valgrind"):
        print("1c. (no valgrind here: instructions per launch not counted)")
        return

    def per_launch(env: dict, *extra: str) -> float:
        counts = []
        for n in (20_000, 120_000):
            r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(tmp / "timer"),
                                str(n), "1", *extra], env=env, capture_output=True, text=True, check=True)
            counts.append(int(r.stderr.split("Collected : ")[1].split()[0]))
        return (counts[1] - counts[0]) / 100_000

    p = per_launch(runs[("stand-in", "-")])
    ctx = per_launch(runs[("stand-in", "-")], "ctx")
    added = {rev: per_launch(runs[(rev, "alone")]) - p for rev in libs}
    print(f"1c. instructions per launch, gate open (callgrind, 1 thread): stand-in alone {p:.0f}; its cuCtxGetCurrent "
          f"alone {ctx:.0f}; added " + ", ".join(f"{'this libcgpu' if rev == 'this' else rev + chr(39) + 's'} {a:.0f}"
                                               for rev, a in added.items())
          + " (bounded: not counted, its events follow the clock, which valgrind slows tens of times)")


def gated_launcher(tmp: Path, tag: str, kernel_us: int, card: str) -> tuple[GateFreezer, subprocess.Popen, Path]:
    """A launcher of `kernel_us` kernels under libcgpu with pages of its own, started, and its gate;
    its kernels are logged to the returned file."""
    pages.create(str(tmp / f"pages-{tag}"), [1 << 30])
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": str(tmp), "LD_PRELOAD": str(tmp / "libcgpu.so"),
           "CGPU_PAGE_DIR": str(tmp / f"pages-{tag}"), "CGPU_STUB_CUDA_STATE": str(tmp / card),
           "CGPU_STUB_CUDA_LOG": str(tmp / f"kernels-{tag}")}
    gate = GateFreezer(str(tmp / f"pages-{tag}"))
    p = subprocess.Popen([str(tmp / "launcher"), "600", str(kernel_us), "0"], env=env, stdout=subprocess.PIPE,
                         text=True)
    p.stdout.readline()
    return gate, p, tmp / f"kernels-{tag}"


def close(gate: GateFreezer, poll: float = 0.0001) -> None:
    """Close the gate and wait until its process has drained."""
    gate.freeze()
    while not gate.is_frozen():
        time.sleep(poll)


def first_kernels_after(log: Path, times: list[int]) -> list[float]:
    """µs from each time to the start of the first kernel in `log` after it."""
    starts = sorted(int(line.split()[1]) for line in log.read_text().splitlines())
    return [(starts[i] - t) / 1000 for t in times if (i := bisect.bisect_left(starts, t)) < len(starts)]


def wake_latency(tmp: Path, rounds: int) -> None:
    """As the daemon does it: the GPU's switcher thread closes the launcher's gate for 2 ms (another
    instance's step), then opens it for 3 ms; from just before it opens (the switcher's report: the
    drain seen) to the start of the first kernel the stand-in logs after it."""
    gate, p, log = gated_launcher(tmp, "wake", 50, "card2")
    pages.create(str(tmp / "pages-other"), [1 << 30])
    other = native.Page(str(tmp / "pages-other"), [0])
    sw = native.Switcher(0, 0.02)
    steps = [(0.002 if k % 2 else 0.003, k % 2, native.NOTIFY if k == 2 * rounds - 1 else 0) for k in range(2 * rounds)]
    try:
        gate.close()  # (the page is the switcher's now, as in the daemon)
        page = native.Page(gate.path, [0])
        sw.submit(1, [page, other], [True, True], steps)
        reports: list = []
        deadline = time.monotonic() + rounds * 0.01 + 10
        while time.monotonic() < deadline:
            got, cur = sw.take()
            reports += got
            if cur is not None and cur.step == 2 * rounds - 1:
                break
            time.sleep(0.05)
        sw.cancel()
        time.sleep(0.05)
        reports += sw.take()[0]
        opens = [r.begin + r.drain_ns for r in reports if r.step % 2 == 0 and r.step > 0]
    finally:
        p.kill()
        p.wait()
        sw.close()
        page.thaw(None)
        page.release()
        other.release()
    lat = first_kernels_after(log, opens)
    floor = futex_wakes(tmp, rounds)
    print(f"2. gate opened by the switcher thread -> the waiting launch's kernel starts: p50 {pct(lat, 0.5):.0f} us, "
          f"p99 {pct(lat, 0.99):.0f} us over {len(lat)} openings (goal p99 <= 200 us); this machine's floor, a bare "
          f"futex wake of a sleeping process: p50 {pct(floor, 0.5):.0f} us, p99 {pct(floor, 0.99):.0f} us")


def futex_wakes(tmp: Path, rounds: int) -> list[float]:
    """µs from FUTEX_WAKE to the woken process running, a waiter idle in between (C, no library)."""
    out = subprocess.run([str(tmp / "futex"), str(rounds)], capture_output=True, text=True, check=True).stdout
    return [int(x) / 1000 for x in out.split()]


def takeover(tmp: Path, rounds: int) -> None:
    normal, p_normal, _ = gated_launcher(tmp, "normal", 1000, "card5")
    prio, p_prio, log = gated_launcher(tmp, "prio", 100, "card5")
    decided, opened = [], []
    try:
        for _ in range(rounds):
            close(prio)  # the normal instance has the card for a while
            normal.thaw()
            time.sleep(0.02)
            decided.append(time.monotonic_ns())  # the high-priority instance takes over
            close(normal, 0.00005)
            opened.append(time.monotonic_ns())
            prio.thaw()
            time.sleep(0.005)
    finally:
        for p in (p_normal, p_prio):
            p.kill()
            p.wait()
        normal.thaw()
        prio.thaw()
    from_open, from_decision = first_kernels_after(log, opened), first_kernels_after(log, decided)
    print(f"5. high-priority takeover with a normal instance running 1 ms kernels: gate opened -> its kernel starts "
          f"p50 {pct(from_open, 0.5):.0f} us, p99 {pct(from_open, 0.99):.0f} us; takeover decided -> its kernel "
          f"starts p50 {pct(from_decision, 0.5) / 1000:.2f} ms, p99 {pct(from_decision, 0.99) / 1000:.2f} ms "
          f"(the normal instance's queued work drains first) over {rounds} takeovers")


class Daemon:
    def __init__(self, tmp: Path, compute: str, metrics: str = "off") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="d", dir=tmp))
        (self.dir / "mnt").mkdir()
        self.sock = self.dir / "sock"
        self.proc = subprocess.Popen([CGPUD, "serve", "--gpus", "sim:T4", "--mount", str(self.dir / "mnt"),
                                      "--state-dir", str(self.dir / "state"), "--socket", str(self.sock),
                                      "--dev-dir", str(self.dir / "dev"), "--metrics-addr", metrics,
                                      "--libcgpu", str(tmp / "libcgpu.so"), "--compute", compute],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "log", "w"))
        deadline = time.monotonic() + 20
        while not (self.dir / "mnt" / "version").exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"cgpud did not start: {(self.dir / 'log').read_text()}")
            time.sleep(0.05)

    def write(self, rel: str, value: str) -> None:
        try:
            with open(self.dir / "mnt" / rel, "w") as f:
                f.write(value)
        except OSError as exc:
            raise SystemExit(f"{rel}: {exc}; the daemon said:\n{(self.dir / 'log').read_text()}") from None

    def stats(self) -> dict:
        from cgpud.client import Client

        with Client(str(self.sock)) as c:
            return c.call("stats")[0]

    def cpu_seconds(self) -> float:
        f = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, tmp: Path, name: str, weight: int, seconds: float, cpu: int = 0) -> subprocess.Popen:
        env = dict(os.environ, CGPUD_SOCKET=str(self.sock), LD_LIBRARY_PATH=str(tmp),
                   CGPU_STUB_CUDA_STATE=str(self.dir / "card"), CGPU_STUB_CUDA_LOG=str(self.dir / f"{name}.k"))
        cmd = f'CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE" exec {tmp / "launcher"} {seconds} 1000 {cpu}'
        return subprocess.Popen([CGPU, "run", "--name", name, "--mem", "16M", "--weight", str(weight), "--",
                                 "sh", "-c", cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def expected(policy: int, weights: list[int], max_inst: int) -> list[float]:
    n = len(weights)
    if policy == 0:
        return [1 / max_inst] * n
    if policy == 1:
        return [1 / n] * n
    if policy == 2:
        return [w / sum(weights) for w in weights]
    return [w / max_inst for w in weights]


def shares(tmp: Path, seconds: float) -> None:
    d = Daemon(tmp, "gate")
    worst = worst_split = over = 0.0
    gaps: list[float] = []
    try:
        d.write("0/max_inst", "4")
        for n in (2, 3):
            weights = [1, 2, 1][:n]
            for policy in range(4):
                d.write("0/policy", str(policy))
                names = [f"p{policy}n{n}i{k}".ljust(12, "x") for k in range(n)]
                procs = [d.run(tmp, nm, w, seconds) for nm, w in zip(names, weights)]
                for p in procs:
                    p.stdout.readline()
                for p in procs:
                    p.communicate(timeout=60)
                logs = [[tuple(map(int, line.split())) for line in (d.dir / f"{nm}.k").read_text().splitlines()]
                        for nm in names]
                t0, t1 = whole_cycles(logs, max(ks[0][1] for ks in logs) + 500_000_000,
                                      min(ks[-1][2] for ks in logs) - 500_000_000)
                got = [sum(max(0, min(e, t1) - max(s, t0)) for _, s, e in ks) / (t1 - t0) for ks in logs]
                want = expected(policy, weights, 4)
                err = max(abs(g - w) for g, w in zip(got, want)) * 100
                over = max(over, max(g - w for g, w in zip(got, want)) * 100)
                # how the card's kernel time was split among them (the time lost at switches left out)
                split = max(abs(g / sum(got) - w / sum(want)) for g, w in zip(got, want)) * 100
                worst, worst_split = max(worst, err), max(worst_split, split)
                # the card idle where one instance's kernels give way to another's (policies 1 and 2 leave
                # no slot idle on purpose): what every switch costs
                if policy in (1, 2):
                    gaps += switch_gaps(logs, t0, t1)
                print(f"3. policy {policy}, {n} instances (weights {weights}): kernel-time shares "
                      f"{' '.join(f'{g:.3f}' for g in got)} want {' '.join(f'{w:.3f}' for w in want)}: "
                      f"error {err:.2f} pp; split error {split:.2f} pp")
    finally:
        d.stop()
    print(f"3. share error through the gate, worst of the 8: {worst_split:.2f} pp in the split of the card's "
          f"kernel time (goal <= 0.5 pp); {worst:.2f} pp against the policy's share of wall time, the time the "
          f"card idles at switches included (most any instance got above its share: {over:+.2f} pp)")
    floor = futex_wakes(tmp, 300)
    print(f"3. the card idle at a switch (policies 1 and 2, {len(gaps)} switches): p50 {pct(gaps, 0.5):.0f} us, "
          f"mean {statistics.mean(gaps):.0f} us, {statistics.mean(gaps) / 100:.1f} % of a 10 ms slice; a switch "
          f"waits on three wakes (the helper's, the daemon's, the next launcher's): 3 x {pct(floor, 0.5):.0f} us, "
          f"this machine's bare futex wake p50, is {3 * pct(floor, 0.5):.0f} us")


def whole_cycles(logs: list[list[tuple[int, int, int]]], lo: int, hi: int) -> tuple[int, int]:
    """The span from the first to the last start of a run of the first instance's kernels within
    [lo, hi]: whole turns of the ring (it runs once a turn), so that no slot is cut at its edges
    (one 10 ms slot cut off a 5 s span would be 0.2 pp of error that is the measure's, not the
    scheduler's)."""
    ks = sorted((s, k) for k, ks in enumerate(logs) for _, s, _ in ks)
    runs = [s for (s, k), (_, before) in zip(ks[1:], ks) if k == 0 and before != 0 and lo <= s <= hi]
    return runs[0], runs[-1]


def switch_gaps(logs: list[list[tuple[int, int, int]]], t0: int, t1: int) -> list[float]:
    """µs the card stood idle between the last kernel of one instance and the first of the next."""
    ks = sorted((s, e, k) for k, ks in enumerate(logs) for _, s, e in ks if t0 <= s and e <= t1)
    return [max(0, b[0] - a[1]) / 1000 for a, b in zip(ks, ks[1:]) if a[2] != b[2]]


def threads(pid: int) -> dict[str, tuple[int, int]]:
    """Each thread of `pid` by name: (CPU ns, voluntary context switches: its wake-ups)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            ns = int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
            status = Path(f"/proc/{pid}/task/{t}/status").read_text()
        except OSError:
            continue
        wakes = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        a, b = out.get(name, (0, 0))
        out[name] = (a + ns, b + wakes)
    return out


def daemon_cpu(tmp: Path, seconds: float, count: int) -> None:
    out, per = {}, {}
    for compute in ("gate", "freeze"):
        d = Daemon(tmp, compute, metrics="127.0.0.1:0")  # (as it runs by default: metrics on, any free port)
        try:
            d.write("0/max_inst", "25")  # (the most there may be; weight 1 each: Σ weight = max_inst)
            d.write("0/policy", "2")
            procs = [d.run(tmp, f"{compute[:4]}{k:08d}", 1, seconds + 3) for k in range(count)]
            for p in procs:
                p.stdout.readline()
            time.sleep(1.0)
            a, t0, s0 = threads(d.proc.pid), time.monotonic(), d.stats()
            time.sleep(seconds)
            b, el, s1 = threads(d.proc.pid), time.monotonic() - t0, d.stats()
            per[compute] = {n: ((b[n][0] - a.get(n, (0, 0))[0]) / 1e9 / el * 100, (b[n][1] - a.get(n, (0, 0))[1]) / el)
                            for n in b}
            out[compute] = sum(c for c, _ in per[compute].values())
            per[compute]["switched"] = ((s1["switched"] - s0["switched"]) / el, 0)
            for p in procs:
                p.communicate(timeout=120)
        finally:
            d.stop()
    main, switcher = per["gate"].get("cgpud", (0.0, 0.0)), per["gate"].get("cgpu-switch0", (0.0, 0.0))
    # the floors, in the same run: a bare C thread waking twice a switch as the switcher does (at the step's
    # end, and at the stopped instance's answer), and a bare trio loop waking as often as the daemon's thread
    switches = per["gate"]["switched"][0]
    floor = float(subprocess.run([str(tmp / "wakes"), str(switches), str(seconds)], capture_output=True, text=True,
                                 check=True).stdout)
    bare = float(subprocess.run([sys.executable, "-c", TRIO_LOOP, str(max(main[1], 1.0)), str(seconds)], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout)
    print(f"4. daemon CPU with {count} instances at 10 ms slices, policy 2: gated {out['gate']:.2f} % of a core, "
          f"frozen {out['freeze']:.2f} % in the same run ({out['gate'] / max(out['freeze'], 1e-9):.2f}x; goal gated "
          f"<= 2 %)")
    print(f"4. gated, by thread: the switcher thread {switcher[0]:.2f} % ({switches:.0f} slices a second, "
          f"{switcher[1]:.0f} wake-ups); a bare C thread waking as often (twice a slice) takes {floor:.2f} %. "
          f"The trio thread {main[0]:.2f} % ({main[1]:.1f} wake-ups a second); a bare trio loop waking as often "
          f"takes {bare:.2f} %; the metrics server's thread {per['gate'].get('cgpud-metrics', (0.0, 0.0))[0]:.2f} %")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ref", action="append", help="a revision whose libcgpu is a per-launch reference "
                    "(repeatable; default 4bb5e69 and main)")
    ap.add_argument("--launch-only", action="store_true", help="part 1 alone (with the reference)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-gate-"))
    try:
        build(tmp)
        refs = {rev: lib for rev in (args.ref or ["4bb5e69", "main"]) if (lib := build_ref(tmp, rev))}
        launch_cost(tmp, 200_000 if args.quick else 1_000_000 if args.launch_only else 2_000_000,
                    5 if args.quick else 9, refs)
        if args.launch_only:
            return
        wake_latency(tmp, 100 if args.quick else 500)
        takeover(tmp, 100 if args.quick else 300)
        shares(tmp, 3 if args.quick else 6)
        daemon_cpu(tmp, 3 if args.quick else 6, 25)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
