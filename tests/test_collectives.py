"""Collectives across processes (issue 34, item 1): a job of one process per GPU (torchrun's,
DeepSpeed's ranks) is one gang, and a closing that falls between two ranks' halves of an
all-reduce is caught up, so no half spins through a closed gate and every closing is answered.

No GPU here: the stand-in's collectives by group (CGPU_STUB_COLLECTIVE=<name>, native/stubs/
cuda_exec.c): each process of the group on card 0 or 1 launches halves; its n-th half holds its
card, spinning and never preempted, until the n-th half of the group's process on the other card
has started (NCCL's rendezvous)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from cgpud.sched.gate import GateFreezer

RANK = r"""
/* rank DEV COUNT KERNEL_US PERIOD_US [WAIT [T0]]: one rank of a job: a context on CUDA device DEV, COUNT
   kernels of KERNEL_US launched (with CGPU_STUB_COLLECTIVE=<job>: halves of the job's all-reduces),
   one every PERIOD_US at most (0: back to back), the launching thread at real-time priority as the
   tests' launcher's; WAIT 1: each waited for before the next (a training step waits for its
   all-reduce's result); then a synchronize. T0 (CLOCK_MONOTONIC seconds): the first launch not before
   it, the period counted from it (the job's ranks in step, whenever each process came up); T0 @DIR:
   the ranks meet first (each writes DIR/ready<DEV> with the time it came up and waits for the
   other's), and start 50 ms after the later. Prints "started" when its context is made, then "done". */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
typedef int (*c_t)(void **, unsigned, int);
typedef int (*s_t)(void);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    int dev = atoi(argv[1]);
    long count = atol(argv[2]);
    unsigned us = (unsigned)atoi(argv[3]);
    double period = atof(argv[4]) / 1e6;
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *ctx;
    if (!h || ((int (*)(unsigned))dlsym(h, "cuInit"))(0)) { fprintf(stderr, "cuInit\n"); return 2; }
    if (((c_t)dlsym(h, "cuCtxCreate_v2"))(&ctx, 0, dev)) { fprintf(stderr, "ctx\n"); return 3; }
    l_t launch = (l_t)dlsym(h, "cuLaunchKernel");
    struct sched_param rt = {.sched_priority = 1};
    pthread_setschedparam(pthread_self(), SCHED_RR, &rt);
    printf("started\n");
    fflush(stdout);
    double next = argc > 6 && argv[6][0] != '@' ? atof(argv[6]) : now();
    if (argc > 6 && argv[6][0] == '@') {
        char mine[4096], tmp[4200], other[4096];
        snprintf(mine, sizeof mine, "%s/ready%d", argv[6] + 1, dev);
        snprintf(tmp, sizeof tmp, "%s.tmp", mine);
        snprintf(other, sizeof other, "%s/ready%d", argv[6] + 1, 1 - dev);
        FILE *f = fopen(tmp, "w");
        if (!f) { fprintf(stderr, "ready\n"); return 5; }
        fprintf(f, "%.9f\n", now());
        fclose(f);
        rename(tmp, mine);
        double theirs = 0;
        for (;;) {
            FILE *o = fopen(other, "r");
            if (o && fscanf(o, "%lf", &theirs) == 1) { fclose(o); break; }
            if (o) fclose(o);
            struct timespec t = {0, 1000000};
            nanosleep(&t, NULL);
        }
        next = (theirs > next ? theirs : next) + 0.05;
    }
    while (now() < next) {
        struct timespec t = {0, 200000};
        nanosleep(&t, NULL);
    }
    for (long i = 0; i < count; i++) {
        if (period > 0) {
            while (now() < next) {
                struct timespec t = {0, 100000};
                nanosleep(&t, NULL);
            }
            next += period;
        }
        if (launch(NULL, us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) { fprintf(stderr, "launch\n"); return 4; }
        if (argc > 5 && atoi(argv[5])) ((s_t)dlsym(h, "cuCtxSynchronize"))();
    }
    ((s_t)dlsym(h, "cuCtxSynchronize"))();
    printf("done\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs
    d = build_libs(tmp_path_factory.mktemp("collectives"))
    (d / "rank.c").write_text(RANK)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(d / "rank"), os.fspath(d / "rank.c"), "-ldl", "-lpthread"],
                   check=True)
    return d


def halves(log: Path) -> list[list[int]]:
    """The log's collective halves: pid, start, end, card, µs of its own work."""
    return [list(map(int, line.split())) for line in log.read_text().splitlines() if len(line.split()) == 5]


def ranks(libs: Path, tmp: Path, count: int, kernel_us: int, period_us: int, preload: bool = True,
          start: float | None = None, skew: float = 0.0):
    """The job's two ranks, started; `start` (s, CLOCK_MONOTONIC): their first launches not before it
    (in step, whenever each process came up), rank 1's `skew` s later (as ranks whose CPU work
    differs launch their halves apart)."""
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_DEVICES": "2",
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CGPU_STUB_COLLECTIVE": "job-" + tmp.name}
    if preload:
        env.update(LD_PRELOAD=os.fspath(libs / "libcgpu.so"), CGPU_PAGE_DIR=os.fspath(tmp / "pages"))
    procs = [subprocess.Popen([os.fspath(libs / "rank"), str(dev), str(count), str(kernel_us), str(period_us),
                               *([] if start is None else ["0", f"{start + dev * skew:.6f}"])],
                              env=dict(env, CGPU_STUB_CUDA_LOG=os.fspath(tmp / f"rank{dev}")), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for dev in (0, 1)]
    for p in procs:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
    assert start is None or time.monotonic() < start, "the ranks came up after their start: give them longer"
    return procs


def finish(procs) -> None:
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0 and out.split() == ["done"], err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_the_stand_ins_ranks_meet_across_processes(libs, tmp_path):
    """Without libcgpu: rank 1 starts launching 0.3 s after rank 0; rank 0's first half spins on
    card 0 until rank 1's first has started, and then both end together, each half `us` after the
    later start (the rendezvous)."""
    procs = ranks(libs, tmp_path, 20, 1000, 0, preload=False)
    finish(procs)
    a, b = halves(tmp_path / "rank0"), halves(tmp_path / "rank1")
    assert len(a) == len(b) == 20 and {h[3] for h in a} == {0} and {h[3] for h in b} == {1}
    for x, y in zip(a, b):
        assert x[2] == y[2] == max(x[1], y[1]) + 1_000_000, (x, y)  # both end `us` after the later start


def test_a_closing_between_two_ranks_halves_is_caught_up(libs, tmp_path):
    """Two ranks (a process per GPU) of one container, at real-time priority as the tests'
    launchers, launch an all-reduce half of 1 ms every 5 ms, rank 1 2 ms after rank 0 (so that a
    closing often falls between two halves); GPU 0's gate (so the container's: a gang) is closed 40
    times, held 20 ms each. Every closing is answered, and no half spins for its
    peer for as long as a closing is held (the stand-in's own account of each half: its end less its
    start less its work): a rank whose half was cut off from its peer's by the closing is let through
    to complete it (the catch-up compares the container's processes' counts), so a closing stalls
    no card. On main the catch-up counted a process's own launches only and the drain had no
    deadline: rank 0's drain waited for its half, spinning for a peer held at the gate, and the
    closing was not answered; a half not caught up spins the whole hold (20 ms or more)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30, 1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"), gpus=[0, 1])
    for k in (0, 1):  # (as the daemon does under every controlled policy: 2 ms queued ahead per stream at most)
        gate.share(k, True, 2000)
    start = time.monotonic() + 2.0
    procs = ranks(libs, tmp_path, 400, 1000, 5000, start=start, skew=0.002)
    unanswered, holds = 0, []
    try:
        time.sleep(max(0.0, start - time.monotonic()))  # (the closings while they launch)
        for _ in range(40):
            time.sleep(0.01)
            closed = time.monotonic_ns()
            gate.freeze(0)
            t0 = time.monotonic()
            while not gate.is_frozen() and time.monotonic() - t0 < 2:  # (liveness: the drain bound is 15 ms)
                time.sleep(0.0002)
            unanswered += not gate.is_frozen()
            time.sleep(0.02)
            gate.thaw(0)
            holds.append((closed, time.monotonic_ns()))
        finish(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        gate.thaw()
        gate.close()
    assert unanswered == 0, f"{unanswered} of 40 closings not answered"
    # every collective whole: each rank's 400 halves ran, none lost with a closing
    hs = halves(tmp_path / "rank0") + halves(tmp_path / "rank1")
    assert len(hs) == 800
    # no half spun through a closing held: none spun as long as the shortest hold (each 20 ms or more)
    spins = sorted((h[2] - h[1] - h[4] * 1000, h[1]) for h in hs)
    shortest = min(b - a for a, b in holds)
    assert spins[-1][0] < shortest, \
        f"a half spun {spins[-1][0] / 1e6:.1f} ms for its peer, through a closing held {shortest / 1e6:.1f} ms"


# ---- a gang's turns aligned across its GPUs (the daemon's switchers) ----

@pytest.fixture
def gang_and_neighbours(tmp_path):
    """A gang's pages on node GPUs 0 and 1, a neighbour's on each, and a switcher per GPU (as the
    daemon has them: a gang's turns aligned, here up to 30 s, so that only the other GPU's
    switcher can let it open)."""
    from cgpud.sched import native
    for name, sizes in (("g", [1 << 30, 1 << 30]), ("n0", [1 << 30]), ("n1", [1 << 30])):
        pages.create(os.fspath(tmp_path / name), sizes)
    g = native.Page(os.fspath(tmp_path / "g"), [0, 1])
    n = [native.Page(os.fspath(tmp_path / f"n{k}"), [k]) for k in (0, 1)]
    sws = [native.Switcher(k, 0.05) for k in (0, 1)]
    for sw in sws:
        sw.align(30.0)
    yield tmp_path, g, n, sws
    for sw in sws:
        sw.close()
    for p in (g, *n):
        p.thaw(None)


def _note(sw, timeout: float) -> bool:
    import select
    r, _, _ = select.select([sw.fileno()], [], [], timeout)
    if r:
        sw.ack()
    return bool(r)


def _in_force(sw, batch: int, step: int, timeout: float = 10.0):
    while True:
        _, cur = sw.take()
        if cur is not None and (cur.batch, cur.step) == (batch, step):
            return cur
        assert _note(sw, timeout), "the switcher said nothing"


def _cancel(sw) -> None:
    sw.cancel()
    while not sw.idle():
        _note(sw, 5.0)
    sw.take()


def test_a_gangs_turn_starts_on_its_gpus_together(gang_and_neighbours):
    """GPU 1's switcher holds the gang closed (its neighbour's step in force) when GPU 0's plan
    comes to the gang's turn: GPU 0's neighbour runs on (its step in force, its gate open) and
    the gang is opened on GPU 0 only once GPU 1's switcher comes to the gang's turn too. Before
    the alignment GPU 0 opened the gang at once, and it ran only in the intersection of its turns
    (on a card, a half of a collective queued on GPU 0 spun until GPU 1's turn came)."""
    tmp, g, (n0, n1), (sw0, sw1) = gang_and_neighbours
    assert sw1.submit(1, [g, n1], [True, True], [(30.0, 1, 1)])  # (native.NOTIFY: 1)
    _in_force(sw1, 1, 0)
    assert g.closed_on(1) and not n1.closed_on(1)
    assert sw0.submit(1, [g, n0], [True, True], [(0.001, 1, 0), (30.0, 0, 1)])
    end = time.monotonic() + 0.3
    while _note(sw0, max(0.0, end - time.monotonic())):  # (a step that asked to be told of it, or none)
        pass
    _, cur = sw0.take()
    assert cur is not None and (cur.batch, cur.step) == (1, 0), "GPU 0 opened the gang while GPU 1 held it"
    assert g.closed_on(0) and not n0.closed_on(0), "GPU 0's neighbour did not run on meanwhile"
    _cancel(sw1)
    ready = time.monotonic_ns()
    assert sw1.submit(2, [g, n1], [True, True], [(30.0, 0, 1)])  # GPU 1 comes to the gang's turn
    on0, on1 = _in_force(sw0, 1, 1), _in_force(sw1, 2, 0)
    assert on0.start >= ready, "GPU 0 opened the gang before GPU 1 was ready to"
    assert not g.closed_on(0) and not g.closed_on(1) and n0.closed_on(0) and n1.closed_on(1)
    _cancel(sw0)
    _cancel(sw1)


def test_a_gang_waits_for_its_other_gpu_one_bound_at_most(gang_and_neighbours):
    """GPU 1's switcher never comes to the gang's turn: GPU 0 opens it after its bound (the daemon's:
    one slice), not never; a GPU whose switcher carries nothing is not waited for at all."""
    tmp, g, (n0, n1), (sw0, sw1) = gang_and_neighbours
    sw0.align(0.05)
    assert sw1.submit(1, [g, n1], [True, True], [(30.0, 1, 1)])
    _in_force(sw1, 1, 0)
    assert sw0.submit(1, [g, n0], [True, True], [(0.001, 1, 0), (30.0, 0, 1)])
    on0 = _in_force(sw0, 1, 1)
    assert not g.closed_on(0) and g.closed_on(1)
    _cancel(sw0)
    _cancel(sw1)  # (GPU 1's switcher idle now, the gang still held closed there: by nobody's plan)
    sw0.align(30.0)
    assert sw0.submit(2, [g, n0], [True, True], [(0.001, 1, 0), (30.0, 0, 1)])
    _in_force(sw0, 2, 1)
    assert not g.closed_on(0) and on0.start > 0
    _cancel(sw0)


# ---- the drain bound follows the slice ----

def test_the_drain_bound_is_the_one_the_daemon_tells(libs, tmp_path):
    """The daemon writes its drain bound (two slices) into the limits page; the library answers a
    closing within three quarters of it. A process whose 3 s kernel cannot be done by any bound,
    with the daemon's bound at 1 s (slices of 500 ms), answers at 750 ms: the switch waits for it,
    long past the 15 ms of a default slice, and does not give up on it (it answered). On main the
    library's bound was a fixed 15 ms whatever the slice."""
    from cgpud.sched import native
    from test_gate import LAUNCHER
    (libs / "launcher.c").write_text(LAUNCHER)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(libs / "launcher"), os.fspath(libs / "launcher.c"), "-ldl",
                    "-lpthread"], check=True)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        pages.create(os.fspath(d), [1 << 30])
    ps = [native.Page(os.fspath(d), [0]) for d in dirs]
    for p in ps:
        p.set_shared(0, True, 2000)
        p.set_bound(1_000_000)
    assert int.from_bytes((dirs[1] / "limits").read_bytes()[12:16], "little") == 1_000_000
    sw = native.Switcher(0, 0.05)
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
           "LD_PRELOAD": os.fspath(libs / "libcgpu.so"), "CGPU_PAGE_DIR": os.fspath(dirs[1]),
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card")}
    b = subprocess.Popen([os.fspath(libs / "launcher"), "60", "3000000", "0"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert b.stdout.readline().strip() == "started", b.stderr.read()
        assert sw.submit(1, ps, [True, True], [(0.3, 1, 0), (30.0, 0, 1)])
        _in_force(sw, 1, 1)
        cur = sw.take()[1]  # (the switch to a: its drain of b, then a's gate opened)
        assert cur.gave_up == -1, f"given up on after {cur.drain_ns / 1e6:.0f} ms: it did not answer"
        assert cur.drain_ns >= 500_000_000, \
            f"b answered after {cur.drain_ns / 1e6:.0f} ms, not at three quarters of the daemon's 1 s bound"
        _cancel(sw)
    finally:
        b.kill()
        b.wait()
        sw.close()
        for p in ps:
            p.thaw(None)
            p.release()


# ---- under load: the daemon's switchers at its priority ----

def test_the_switcher_runs_at_the_daemons_real_time_priority():
    """The daemon runs SCHED_RR with SCHED_RESET_ON_FORK (cgpud/sched/priority.py: the processes it
    starts run at normal priority), which also reset the threads it made: the switchers ran at
    normal priority, behind the workloads they switch — under four CPU hogs a gang's steps ended
    tens of ms late on one GPU and not the other, its turns fell out of step (bench/collective.py:
    91 % of its throughput). A switcher runs at the policy and priority of the thread that made it."""
    from cgpud.sched import native
    old = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(3))
    try:
        sw = native.Switcher(7, 0.05)
    finally:
        os.sched_setscheduler(0, old[0], old[1])
    try:
        sw.submit(1, [], [], [(0.001, -1, 1)])  # (a step: the thread has run past its start)
        _note(sw, 5.0)
        tasks = Path("/proc/self/task")
        ids = [t for t in tasks.iterdir() if (t / "comm").read_text().strip() == "cgpu-switch7"]
        assert len(ids) == 1
        stat = (ids[0] / "stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # (from field 3 on: after the command's parentheses)
        policy, rt = int(fields[41 - 3]), int(fields[40 - 3])  # (proc(5): rt_priority 40, policy 41)
        assert (policy, rt) == (os.SCHED_RR, 3), f"the switcher runs at policy {policy}, priority {rt}"
    finally:
        sw.close()


def test_a_gangs_turn_ends_on_its_gpus_together(gang_and_neighbours):
    """GPU 0's plan ends the gang's turn while GPU 1's switcher still runs it: the gang runs on on
    GPU 0 (its gate open there, the neighbour's closed) until GPU 1's turn ends too, so no GPU
    stands idle with the gang's gate open and the gang held by its other GPU's closing. Before,
    GPU 0 closed it at once: the rest of its turn on GPU 1 stood idle."""
    tmp, g, (n0, n1), (sw0, sw1) = gang_and_neighbours
    assert sw1.submit(1, [g, n1], [True, True], [(30.0, 0, 1)])
    _in_force(sw1, 1, 0)
    assert sw0.submit(1, [g, n0], [True, True], [(0.001, 0, 1), (30.0, 1, 1)])
    _in_force(sw0, 1, 0)
    end = time.monotonic() + 0.3
    while _note(sw0, max(0.0, end - time.monotonic())):
        pass
    _, cur = sw0.take()
    assert cur is not None and (cur.batch, cur.step) == (1, 0), "GPU 0 ended the gang's turn while GPU 1 ran it"
    assert not g.closed_on(0) and n0.closed_on(0)
    ended = time.monotonic_ns()
    _cancel(sw1)  # GPU 1's turn of the gang ends (its switcher moves on)
    assert sw1.submit(2, [g, n1], [True, True], [(30.0, 1, 1)])
    on0 = _in_force(sw0, 1, 1)
    assert on0.begin >= ended, "GPU 0 ended the gang's turn before GPU 1 did"
    assert g.closed_on(0) and not n0.closed_on(0)
    _cancel(sw0)
    _cancel(sw1)


# ---- one thread drives a collective across GPUs (issue 45, item 1) ----

ONE_THREAD = r"""
/* one_thread COUNT: one thread, a context on each of CUDA devices 0 and 1, launches COUNT all-reduces
   (with CGPU_STUB_COLLECTIVE=1 each kernel is a half: GPU 0's spins until GPU 1's has started); after
   GPU 0's half it prints "half" and reads a line before it launches GPU 1's (the thread's own CPU work
   between them, as DataParallel's or MirroredStrategy's loop over its devices). "started" once both
   contexts are made, "done" at the end. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
int main(int argc, char **argv) {
    long count = atol(argv[1]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *ctx[2];
    if (!h || ((int (*)(unsigned))dlsym(h, "cuInit"))(0)) { fprintf(stderr, "cuInit\n"); return 2; }
    int (*create)(void **, unsigned, int) = (int (*)(void **, unsigned, int))dlsym(h, "cuCtxCreate_v2");
    int (*set)(void *) = (int (*)(void *))dlsym(h, "cuCtxSetCurrent");
    int (*sync)(void) = (int (*)(void))dlsym(h, "cuCtxSynchronize");
    for (int d = 0; d < 2; d++)
        if (create(&ctx[d], 0, d)) { fprintf(stderr, "ctx\n"); return 3; }
    l_t launch = (l_t)dlsym(h, "cuLaunchKernel");
    printf("started\n");
    fflush(stdout);
    char line[64];
    for (long i = 0; i < count; i++)
        for (int d = 0; d < 2; d++) {
            if (d) {
                printf("half\n");
                fflush(stdout);
                if (!fgets(line, sizeof line, stdin)) return 5;
            }
            if (set(ctx[d]) || launch(NULL, 500, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) {
                fprintf(stderr, "launch\n");
                return 4;
            }
        }
    for (int d = 0; d < 2; d++)
        set(ctx[d]), sync();
    printf("done\n");
    return 0;
}
"""


def said(p: subprocess.Popen, timeout: float) -> str:
    """The process's next line on stdout, read byte by byte (no buffer ahead of select); "" when it
    said none within `timeout` s."""
    import select
    end, got = time.monotonic() + timeout, b""
    while not got.endswith(b"\n"):
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            return ""
        b = os.read(p.stdout.fileno(), 1)
        if not b:
            return got.decode().strip()
        got += b
    return got.decode().strip()


def test_one_thread_driving_a_collective_across_gpus_never_hangs_at_a_closing(libs, tmp_path):
    """One thread launches all-reduces across GPUs 0 and 1 (a half on each), its launches not
    bounded (the GPUs not shared: each drain synchronizes the contexts, the work no queue counted);
    GPU 0's gate closes between the thread's two halves, and the thread goes on to GPU 1's 30 ms
    later (held at the gate: the process is a gang, its launches run while all its GPUs' gates are
    open). Five times: every closing is answered (the synchronize waited for whole no longer once a
    launch waits at another gate: it waits for that launch) and the process ends. Before, the
    drain's synchronize of GPU 0's context held the contexts' lock while it waited for GPU 0's half,
    which waits for GPU 1's; the thread's launch on GPU 1 waited for that lock: the process hung for
    good (issue 45, item 1)."""
    from test_graphs import stopped
    from test_libcgpu import compile_c
    compile_c(libs, "one_thread", ONE_THREAD)
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30, 1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"), gpus=[0, 1])
    for k in (0, 1):  # (policy 5's: nothing bounded, every launch counted by no queue)
        gate.share(k, False, 2000)
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_DEVICES": "2",
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"), "CGPU_STUB_COLLECTIVE": "1",
           "LD_PRELOAD": os.fspath(libs / "libcgpu.so"), "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages")}
    p = subprocess.Popen([os.fspath(libs / "one_thread"), "5"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    unanswered = 0
    try:
        assert said(p, 10.0) == "started"
        for i in range(5):
            line = said(p, 10.0)
            assert line != "", f"the process hung at all-reduce {i}: its launch on GPU 1 waited for the library"
            assert line == "half"
            gate.freeze(0)  # (the drain synchronizes GPU 0's context: its half waits for GPU 1's)
            time.sleep(0.03)
            p.stdin.write(b"go\n")
            p.stdin.flush()
            t0 = time.monotonic()
            while gate.undrained(0) and time.monotonic() - t0 < 2:  # (liveness: the drain bound is 15 ms)
                time.sleep(0.001)
            unanswered += bool(gate.undrained(0))
            gate.thaw(0)
        p.stdin.close()
        assert said(p, 30.0) == "done" and p.wait(timeout=30) == 0
    finally:
        stopped(p, gate, None)  # (killed if it hung; the gate opened and let go)
    assert unanswered == 0, f"{unanswered} of 5 closings not answered"
