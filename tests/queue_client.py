"""A small C client of the stand-in driver's executor (native/stubs/cuda_exec.c), found with plain
dlopen + dlsym as any program finds libcuda.so.1: tests/test_stub_executor.py, the deep-queue
tests (tests/test_deep_queue.py) and bench/deep_queue.py drive it. Its modes print one result per line
(CLOCK_MONOTONIC ns, comparable with the kernel log's times)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SOURCE = r"""
/* queue-client MODE ...
 * US (burst, loop, host, queue): one length, or a step of mixed ones as real workloads have (a model's few
 * long GEMMs among many short elementwise kernels): "3000x4,20x40" is 4 kernels of 3000 µs then 40 of 20,
 * the launches going round the step
 *   burst N US         N launches; prints each launch's return time, then the synchronize's return time
 *   loop SECONDS US K  K launches then cuCtxSynchronize, again and again (a PyTorch-like loop that runs ahead):
 *                      prints "started", then the launches made
 *   host SECONDS US HOST_US  one launch, a synchronize, then HOST_US of host work (a spin), again and again
 *                      (small-batch inference: CPU-bound): prints "started", then the launches made
 *   one US             one launch and a synchronize: prints "pid launch_ns" (taken just before the launch)
 *   every SECONDS US GAP_MS  one launch and a synchronize, a pause, again: prints each launch's time and its
 *                      launch to completion (ns)
 *   queue N US SECONDS N launches, then no call into the driver for SECONDS (its exit waits for its queue)
 *   events N US        a kernel then an event, N times, into a stream of its own (see test_stub_executor)
 *   streams US_A US_B  3 kernels into stream A, then 1 into B (see test_stub_executor)
 *   pdl R N US [event] R rounds into a stream of its own through cuLaunchKernelEx: a kernel, then N-1 launched
 *                      programmatic-dependent (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, Hopper's
 *                      PDL), with `event` an event recorded after each launch; then cuStreamSynchronize. First
 *                      two launches into it, each then synchronized (the process's first launch, lazily loaded,
 *                      over): prints "warm" and reads a line before the rounds
 *   pdlgate LONG_US US a stream of its own, through cuLaunchKernelEx: two launches (the second programmatic-dependent),
 *                      each then synchronized: prints "warm", reads a line; one PDL launch of LONG_US: prints
 *                      "launched", reads a line (a closing of the gate meanwhile); one PDL launch of US, then
 *                      cuStreamSynchronize: prints "done"
 *   two SECONDS US K   two threads, each with a stream of its own: K launches then cuStreamSynchronize, again
 *                      and again (concurrent streams of one process): prints "started", then the launches made
 *   shape SECONDS N MEAN_US FLOOR_US HOST_US GAP_US SEED [WARM_US]
 *                      a framework's step, again and again (bench/resnet_shape.py): N launches, each due HOST_US
 *                      after the one before (the framework's dispatch, the driver's launch included; after
 *                      it returned when it waited longer; slept, see pause_until), of FLOOR_US + MEAN_US * m_i µs, m_i a fixed pseudo-random mix of mean 1
 *                      drawn from SEED (the same every step); then GAP_US of host time and cuCtxSynchronize:
 *                      prints "started", then each step's end (ns). WARM_US (optional, after SEED): for that long
 *                      after a launch that waited over 1 ms (its thread asleep, its core idle) the host takes
 *                      twice as long (a core woken cold: its caches and clock, bench/resnet_shape.py) */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
typedef int (*v_t)(void);
typedef int (*p_t)(void *);
typedef int (*pp_t)(void *, void *);
typedef int (*c_t)(void **, unsigned);
typedef int (*t_t)(float *, void *, void *);
typedef int (*x_t)(const void *, void *, void **, void **);
/* cuda.h's CUlaunchAttribute (an id padded to 8 bytes, a 64-byte value) and CUlaunchConfig */
typedef struct { unsigned id; char pad[4]; union { char bytes[64]; int i; } value; } attr_t;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shmem; void *stream; attr_t *attrs; unsigned nattrs; } config_t;
static long long now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000ll + t.tv_nsec; }
static void *h;
/* The host's time between launches, slept rather than spun (a 2-core machine runs a pair of these
 * beside the daemon): woken late by up to tens of µs, the launches that fell due meanwhile go at once,
 * so the rate holds over a step and the card's queue takes the bunching. */
static void pause_until(long long t)
{
    if (t - now() < 50000) return;
    struct timespec ts = {(time_t)(t / 1000000000ll), (long)(t % 1000000000ll)};
    clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
}
/* The modes the deep-queue tests time (loop, host, every, burst): the process at a real-time priority below
 * the daemon's, where it may be, as test_gate's launcher: it launches (and does its host work) as soon
 * as its gate opens however busy the machine, so the shares measure the scheduler, not the CPU load
 * (the CPU-bound instance's third read 0.275 beside four CPU hogs without: issue 35). */
static void realtime(void)
{
    struct sched_param rt = {.sched_priority = 1};
    sched_setscheduler(0, SCHED_RR, &rt);
}
static long long two_secs_ns, two_counts[2];
static unsigned two_us;
static int two_k;
static int (*two_ssync)(void *);
static int (*two_screate)(void **, unsigned);
static void launch(unsigned us, void *stream);
static void *two_thread(void *arg)
{
    long i = (long)arg;
    void *s;
    two_screate(&s, 0);
    long long t0 = now();
    while (now() - t0 < two_secs_ns) {
        for (int k = 0; k < two_k; k++, two_counts[i]++) launch(two_us, s);
        two_ssync(s);
    }
    return NULL;
}
static void *sym(const char *n) { void *f = dlsym(h, n); if (!f) { fprintf(stderr, "no %s\n", n); exit(2); } return f; }
static l_t launch_fn;
static unsigned *mix, nmix;  /* the step's lengths (US), gone round launch by launch */
static unsigned long long mixed;
static void parse_mix(const char *spec)
{
    char *copy = strdup(spec), *save = NULL;
    for (char *part = strtok_r(copy, ",", &save); part; part = strtok_r(NULL, ",", &save)) {
        unsigned us = (unsigned)atoi(part), times = 1;
        char *x = strchr(part, 'x');
        if (x) times = (unsigned)atoi(x + 1);
        mix = realloc(mix, (nmix + times) * sizeof *mix);
        for (unsigned i = 0; i < times; i++) mix[nmix++] = us ? us : 1;
    }
    free(copy);
    if (!nmix) { fprintf(stderr, "no lengths in %s\n", spec); exit(1); }
}
static unsigned next_us(void) { return mix[mixed++ % nmix]; }
static void launch(unsigned us, void *stream)
{
    int r = launch_fn(NULL, us, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
    if (r) { fprintf(stderr, "launch %d\n", r); exit(4); }
}
int main(int argc, char **argv)
{
    if (argc < 3) return 1;
    if (!(h = dlopen("libcuda.so.1", RTLD_NOW))) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    if (((int (*)(unsigned))sym("cuInit"))(0)) return 3;
    launch_fn = (l_t)sym("cuLaunchKernel");
    v_t sync = (v_t)sym("cuCtxSynchronize");
    p_t ssync = (p_t)sym("cuStreamSynchronize"), squery = (p_t)sym("cuStreamQuery");
    p_t equery = (p_t)sym("cuEventQuery"), esync = (p_t)sym("cuEventSynchronize");
    pp_t erecord = (pp_t)sym("cuEventRecord");
    c_t ecreate = (c_t)sym("cuEventCreate"), screate = (c_t)sym("cuStreamCreate");
    t_t elapsed = (t_t)sym("cuEventElapsedTime_v2");
    const char *mode = argv[1];
    if (argc > 3 && strcmp(mode, "shape") && strcmp(mode, "pdl") && strcmp(mode, "two")) parse_mix(argv[3]);
    if (!strcmp(mode, "burst") && argc == 4) {
        realtime();  /* (its launches a tick apart only when the card makes them so, not a preemption) */
        int n = atoi(argv[2]);
        long long *ret = calloc((size_t)n, sizeof *ret);
        for (int i = 0; i < n; i++) {
            launch(next_us(), NULL);
            ret[i] = now();
        }
        sync();
        long long done = now();
        for (int i = 0; i < n; i++) printf("%lld\n", ret[i]);
        printf("%lld\n", done);
    } else if (!strcmp(mode, "loop") && argc == 5) {
        realtime();
        double secs = atof(argv[2]);
        int k = atoi(argv[4]);
        printf("started\n");
        fflush(stdout);
        long long t0 = now(), n = 0;
        while (now() - t0 < secs * 1e9) {
            for (int i = 0; i < k; i++, n++) launch(next_us(), NULL);
            sync();
        }
        printf("%lld\n", n);
    } else if (!strcmp(mode, "host") && argc == 5) {
        realtime();
        double secs = atof(argv[2]);
        long long host = atoll(argv[4]) * 1000;
        printf("started\n");
        fflush(stdout);
        long long t0 = now(), n = 0;
        while (now() - t0 < secs * 1e9) {
            launch(next_us(), NULL);
            sync();
            n++;
            for (long long t = now(); now() - t < host;) {}
        }
        printf("%lld\n", n);
    } else if (!strcmp(mode, "shape") && (argc == 9 || argc == 10)) {
        double secs = atof(argv[2]), mean = atof(argv[4]), floor_us = atof(argv[5]);
        int n = atoi(argv[3]);
        long long host = (long long)(atof(argv[6]) * 1000), gap = (long long)(atof(argv[7]) * 1000);
        unsigned long long x = strtoull(argv[8], NULL, 10) * 2654435761ull + 1;
        long long warm = argc == 10 ? (long long)(atof(argv[9]) * 1000) : 0, slow_until = 0;
        unsigned *len = calloc((size_t)n, sizeof *len);
        for (int i = 0; i < n; i++) {  /* m_i: an exponential mix (mean 1) cut at 8, by xorshift64 */
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            double u = (double)(x >> 11) / 9007199254740992.0, m = -log(1 - u);
            len[i] = (unsigned)(floor_us + mean * (m < 8 ? m : 8) + 0.5);
        }
        printf("started\n");
        fflush(stdout);
        long long t0 = now(), *ends = calloc(1 << 20, sizeof *ends), steps = 0;
        while (now() - t0 < secs * 1e9 && steps < 1 << 20) {
            long long at = now();
            for (int i = 0; i < n; i++) {
                at += at < slow_until ? 2 * host : host;
                pause_until(at);
                long long a = now();
                launch(len[i] ? len[i] : 1, NULL);
                long long r = now();
                if (r - a > host) at = r;  /* (a launch that waited, at the gate or a full queue: its host work after it) */
                if (r - a > 1000000) slow_until = r + warm;
            }
            pause_until(at + gap);
            sync();
            ends[steps++] = now();
        }
        for (long long i = 0; i < steps; i++) printf("%lld\n", ends[i]);
    } else if (!strcmp(mode, "queue") && argc == 5) {  /* queue N US SECONDS: N launches, then no call for SECONDS */
        for (int i = 0; i < atoi(argv[2]); i++) launch(next_us(), NULL);
        printf("queued\n");
        fflush(stdout);
        usleep((useconds_t)(atof(argv[4]) * 1e6));
    } else if (!strcmp(mode, "every") && argc == 5) {
        realtime();
        /* every SECONDS US GAP_MS: one launch and a synchronize, then a pause, again and again (gpu-check's
         * high-priority row): prints "started", then per launch: when it was made (ns, CLOCK_MONOTONIC, taken
         * just before it) and its launch to completion (ns) */
        double secs = atof(argv[2]), gap = atof(argv[4]);
        printf("started\n");
        fflush(stdout);
        long long t0 = now();
        while (now() - t0 < secs * 1e9) {
            long long a = now();
            launch((unsigned)atoi(argv[3]), NULL);
            sync();
            printf("%lld %lld\n", a, now() - a);
            usleep((useconds_t)(gap * 1000));
        }
    } else if (!strcmp(mode, "pdl") && (argc == 5 || argc == 6)) {
        realtime();  /* (a launch the machine's load holds off past its predecessor's end cannot overlap it) */
        x_t launch_ex = (x_t)sym("cuLaunchKernelEx");
        int rounds = atoi(argv[2]), n = atoi(argv[3]), with_events = argc == 6 && !strcmp(argv[5], "event");
        void *s, *e;
        screate(&s, 0);
        ecreate(&e, 0);
        attr_t pdl = {.id = 6 /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */, .value.i = 1};
        for (int w = 0; w < 2; w++) {
            launch((unsigned)atoi(argv[4]), s);
            ssync(s);
            usleep(2000);
        }
        printf("warm\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 5;
        for (int r = 0; r < rounds; r++) {
            for (int i = 0; i < n; i++) {
                config_t c = {(unsigned)atoi(argv[4]), 1, 1, 1, 1, 1, 0, s, i ? &pdl : NULL, i ? 1 : 0};
                int rc = launch_ex(&c, NULL, NULL, NULL);
                if (rc) { fprintf(stderr, "cuLaunchKernelEx %d\n", rc); return 4; }
                if (with_events) erecord(e, s);
            }
            ssync(s);
        }
        printf("%d\n", rounds);
    } else if (!strcmp(mode, "pdlgate") && argc == 4) {
        x_t launch_ex = (x_t)sym("cuLaunchKernelEx");
        void *s;
        screate(&s, 0);
        attr_t pdl = {.id = 6 /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */, .value.i = 1};
        unsigned lengths[] = {100, 100, (unsigned)atoi(argv[2]), (unsigned)atoi(argv[3])};
        char line[16];
        for (int i = 0; i < 4; i++) {
            if (i == 2 || i == 3) {
                printf(i == 2 ? "warm\n" : "launched\n");
                fflush(stdout);
                if (!fgets(line, sizeof line, stdin)) return 5;
            }
            config_t c = {lengths[i], 1, 1, 1, 1, 1, 0, s, i ? &pdl : NULL, i ? 1 : 0};
            int rc = launch_ex(&c, NULL, NULL, NULL);
            if (rc) { fprintf(stderr, "cuLaunchKernelEx %d\n", rc); return 4; }
            if (i < 2) ssync(s);
        }
        ssync(s);
        printf("done\n");
    } else if (!strcmp(mode, "two") && argc == 5) {
        realtime();
        two_secs_ns = (long long)(atof(argv[2]) * 1e9);
        two_us = (unsigned)atoi(argv[3]);
        two_k = atoi(argv[4]);
        two_ssync = ssync;
        two_screate = screate;
        printf("started\n");
        fflush(stdout);
        pthread_t t[2];
        for (long i = 0; i < 2; i++) pthread_create(&t[i], NULL, two_thread, (void *)i);
        for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
        printf("%lld\n", two_counts[0] + two_counts[1]);
    } else if (!strcmp(mode, "one") && argc == 3) {
        long long t = now();
        launch((unsigned)atoi(argv[2]), NULL);
        sync();
        printf("%d %lld\n", (int)getpid(), t);
    } else if (!strcmp(mode, "events") && argc == 4) {
        /* prints: events done right after the launches; events done after cuEventSynchronize of the
         * (N/2)th; then "result ms" of cuEventElapsedTime from an event recorded first to each */
        int n = atoi(argv[2]);
        void *s, *first, **ev = calloc((size_t)n, sizeof *ev);
        screate(&s, 0);
        ecreate(&first, 0);
        erecord(first, s);
        for (int i = 0; i < n; i++) {
            launch((unsigned)atoi(argv[3]), s);
            ecreate(&ev[i], 0);
            erecord(ev[i], s);
        }
        int ready = 0;
        for (int i = 0; i < n; i++) ready += equery(ev[i]) == 0;
        printf("%d\n", ready);
        esync(ev[n / 2 - 1]);
        ready = 0;
        for (int i = 0; i < n; i++) ready += equery(ev[i]) == 0;
        printf("%d\n", ready);
        ssync(s);
        for (int i = 0; i < n; i++) {
            float ms = -1;
            int r = elapsed(&ms, first, ev[i]);
            printf("%d %.3f\n", r, ms);
        }
    } else if (!strcmp(mode, "streams") && argc == 4) {
        /* prints: B done when A's synchronize returned (0/1); B done after cuCtxSynchronize (0/1);
         * A's synchronize's return time; an event recorded into the legacy stream (NULL) after the
         * launches: done at once (0/1), done when A's synchronize returned (0/1), at the end (0/1) */
        void *a, *b, *legacy;
        screate(&a, 0);
        screate(&b, 0);
        ecreate(&legacy, 0);
        for (int i = 0; i < 3; i++) launch((unsigned)atoi(argv[2]), a);
        launch((unsigned)atoi(argv[3]), b);
        erecord(legacy, NULL);
        int l0 = equery(legacy) == 0;
        ssync(a);
        long long t = now();
        int b_then = squery(b) == 0, l1 = equery(legacy) == 0;
        sync();
        printf("%d\n%d\n%lld\n%d\n%d\n%d\n", b_then, squery(b) == 0, t, l0, l1, equery(legacy) == 0);
    } else
        return 1;
    return 0;
}
"""


def build(where: Path) -> Path:
    """The client, compiled into `where`."""
    (where / "queue-client.c").write_text(SOURCE)
    out = where / "queue-client"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", os.fspath(out), os.fspath(where / "queue-client.c"), "-ldl", "-lm", "-lpthread"],
                   check=True)
    return out


def kernels(log: Path) -> list[tuple[int, int, int]]:
    """(pid, start ns, end ns) of each piece of a kernel the stand-in ran (a kernel is one piece
    unless a timeslice's end cut it)."""
    if not log.exists():
        return []
    return [tuple(map(int, line.split()[:3])) for line in log.read_text().splitlines() if line.strip()]
