/*
 * libcgpu, compute: kernel launches wait at the gate (docs/isolation.md, "Compute").
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <time.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu_internal.h"

/* ---- compute: kernel launches wait at the container's gate ----------------------------
 *
 * The daemon closes the gate (makes it even) when the container's slice ends and
 * opens it (odd, and a FUTEX_WAKE) when the next begins. A launch that finds it
 * closed waits on it with a futex: no polling, no sleep steps; the CPU side of the
 * process runs on. A helper thread, started with the first launch, answers each
 * closing: once no thread is inside a launch, it synchronizes every context the
 * process launched in (the work it had already queued is done), writes the closed
 * gate's value into the process's `acked` and a byte into the `drained` FIFO, so
 * the daemon can start the next container's slice knowing the GPU is free. */

/* ---- a gang: a container's GPUs opened and closed together (docs/isolation.md, "Gangs") ----
 *
 * A collective kernel (NCCL's all-reduce, ...) on one GPU spins until its peers on the
 * container's other GPUs have run: with gates per GPU, a container open on one GPU and closed on
 * another would spin away its slice there, and the drain of the open one would wait for a kernel
 * that cannot end. So a launch on GPU k waits for GPU k's gate and the container's gate, which
 * the daemon keeps closed while any of the container's GPUs' gates is (cgpu_page.h): the
 * container's launches run only while it holds all the GPUs it is active on. (GPUs it does not
 * use are never held closed: an idle instance is not.) CGPU_GANG=0 in the container: each GPU on
 * its own (for processes that share nothing across GPUs; it changes only the container's own time).
 *
 * A closing can still fall between two halves of a collective (a thread launched its half, the
 * peer's launch comes after the gate closed): the peer's launch is let through while the helper
 * answers that closing, if its GPU is behind the process's most-launched GPU of the gang (ranks
 * launch the same sequence), at most GANG_CATCH_UP launches per GPU per closing; the helper waits
 * up to GANG_WAIT_NS for them before it drains. GPUs more than 2 * GANG_CATCH_UP launches apart are
 * not ranks of one collective: they count as even from there. */
#define GANG_CATCH_UP 4
#define GANG_WAIT_NS 20000000ll
static int gang_off = -1;  /* CGPU_GANG=0 (read at the first launch) */
static unsigned long launched[CGPU_MAX_GPUS];  /* this process's launches on each page GPU */
static unsigned long base[CGPU_MAX_GPUS];      /* ... when a closing last found them far apart */
static unsigned catch_up_used[CGPU_MAX_GPUS];
static int catch_up_open;                      /* the helper answers a closing: catch-up allowed */

/* Threads of this process inside a launch now: [0] on the container's gate, [1 + k] on GPU k's. */
static unsigned launching[1 + CGPU_MAX_GPUS];
static pthread_once_t helper_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctxs[64];
static int ctx_gpu[64];  /* the page's GPU of each (-1: past the page's) */
static int nctxs;
/* (a launch's thread-locals: initial-exec, one load each, as in_driver: libcgpu is loaded at start) */
#define HOT_TLS __thread __attribute__((tls_model("initial-exec")))
static HOT_TLS CUcontext known_ctx;  /* the last context this thread was seen to launch in */
static HOT_TLS int known_gpu;        /* and its page GPU */

/* The gate a launch on page GPU `k` waits at (-1: the container's). */
static const uint32_t *gate_word(int k)
{
    return k >= 0 ? &limits->gpu_gate[k] : &limits->gate;
}

static uint32_t gate_value(int k)
{
    return __atomic_load_n(gate_word(k), __ATOMIC_SEQ_CST);
}

static void futex_wake_all(const uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int ganged(void)
{
    return per_gpu && !gang_off;
}

/* How far page GPU `k` is behind this process's most-launched GPU of the gang (counted from `base`). */
static unsigned long behind(int k)
{
    uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST);
    unsigned long most = 0, mine_k = __atomic_load_n(&launched[k], __ATOMIC_SEQ_CST) - base[k];
    for (uint32_t j = 0; j < limits->ngpus; j++)
        if (on & (1u << j)) {
            unsigned long n = __atomic_load_n(&launched[j], __ATOMIC_SEQ_CST) - base[j];
            most = n > most ? n : most;
        }
    return most > mine_k ? most - mine_k : 0;
}

/* A launch on GPU k let through a closed gate: it completes a collective a closing cut in half. */
static int catch_up(int k)
{
    if (!__atomic_load_n(&catch_up_open, __ATOMIC_SEQ_CST) || !behind(k))
        return 0;
    return __atomic_add_fetch(&catch_up_used[k], 1, __ATOMIC_SEQ_CST) <= GANG_CATCH_UP;
}

/* Whether the GPUs this process launches on are even (or caught up as far as allowed). */
static int caught_up(void)
{
    uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST);
    for (uint32_t j = 0; j < limits->ngpus; j++)
        if (on & (1u << j) && behind((int)j) && __atomic_load_n(&catch_up_used[j], __ATOMIC_SEQ_CST) < GANG_CATCH_UP)
            return 0;
    return 1;
}

/* No launch of this process on the GPUs `on` is in flight (one that passed the gate before it
 * closed counts its GPU only once it returns: only then are the counts to compare). */
static int settled(uint32_t on)
{
    for (uint32_t j = 0; j < limits->ngpus; j++)
        if (on & (1u << j) && __atomic_load_n(&launching[1 + j], __ATOMIC_SEQ_CST))
            return 0;
    return 1;
}

static int64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000ll + t.tv_nsec;
}

/* The launch path's clock, for its one question (were the launches into a stream a tick apart?):
 * the CPU's own counter (x86-64's TSC, aarch64's virtual counter: 9 ns on the machine it was
 * written on, where a vDSO clock_gettime took 21) in ns by a rate measured against CLOCK_MONOTONIC
 * over the first 20 ms it is asked; CLOCK_MONOTONIC until then and on other CPUs. Only its own
 * readings are compared with one another (it drifts from CLOCK_MONOTONIC by the rate's error). */
static inline uint64_t counter(void)
{
#if defined(__x86_64__)
    return __builtin_ia32_rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ volatile("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    return 0;
#endif
}
static uint64_t counter0, counter_rate;  /* counter_rate: ns per count << 24 (0: not known) */
static int64_t counter0_ns;
static int counter_state;                /* 0: not begun, 1: being set, 2: sampling from counter0, 3: known */
static int64_t launch_ns(void)
{
    uint64_t rate = __atomic_load_n(&counter_rate, __ATOMIC_ACQUIRE);
    if (__builtin_expect(rate != 0, 1))
        return counter0_ns + (int64_t)(((unsigned __int128)(counter() - counter0) * rate) >> 24);
    int64_t now = mono_ns();
    int st = __atomic_load_n(&counter_state, __ATOMIC_ACQUIRE), busy = 1;
    if (st == 0 && counter() && __atomic_compare_exchange_n(&counter_state, &st, busy, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        counter0 = counter();
        counter0_ns = mono_ns();
        __atomic_store_n(&counter_state, 2, __ATOMIC_RELEASE);
    } else if (st == 2 && now - counter0_ns >= 20000000
               && __atomic_compare_exchange_n(&counter_state, &st, busy, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        uint64_t c = counter();
        int64_t t = mono_ns();
        rate = c > counter0 ? (uint64_t)(((unsigned __int128)(uint64_t)(t - counter0_ns) << 24) / (c - counter0)) : 0;
        __atomic_store_n(&counter_rate, rate, __ATOMIC_RELEASE);
        __atomic_store_n(&counter_state, rate ? 3 : 0, __ATOMIC_RELEASE);
    }
    return now;
}

/* Sleep while `word` still reads `seen` (any change wakes it). */
static void futex_wait_on(const uint32_t *word, uint32_t seen)
{
    /* (a read-only shared mapping: the futex is keyed by the file, so the daemon's wake reaches it) */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, NULL, NULL, 0);
}

/* The page GPU the calling thread launches on (its current context's device), -1 for the
 * container's gate: a page without per-GPU gates, or a device past the page's. The device is
 * asked at every launch (a context's address may come back for another device once destroyed). */
static int note_context(void)
{
    CUcontext c = NULL;
    if (!real.ctx_get || real.ctx_get(&c) != CU_OK || !c)
        return per_gpu ? 0 : -1;  /* (no context: the driver refuses the launch itself) */
    CUdevice dev = -1;
    int k = -1;
    if (per_gpu && real.ctx_get_device && real.ctx_get_device(&dev) == CU_OK)
        k = page_index(dev);
    if (c == known_ctx && k == known_gpu)
        return k;
    known_ctx = c;
    known_gpu = k;
    pthread_mutex_lock(&ctx_lock);
    int i = 0;
    while (i < nctxs && ctxs[i] != c)
        i++;
    if (i < nctxs)
        ctx_gpu[i] = k;  /* (drained with that GPU from now on) */
    else if (nctxs < (int)(sizeof ctxs / sizeof *ctxs)) {
        ctx_gpu[nctxs] = k;
        ctxs[nctxs++] = c;
    }
    pthread_mutex_unlock(&ctx_lock);
    return k;
}

/* The drain synchronizes from the helper thread while the process's other threads may be
 * capturing streams into CUDA graphs (PyTorch, vLLM, torch.compile: in the global capture mode).
 * In the thread's default mode, global, such a synchronize is a potentially unsafe call the driver
 * refuses, invalidating their captures; in relaxed mode it is allowed and touches no capture
 * (cuThreadExchangeStreamCaptureMode, CUDA 10.1 on). 0, or -1 said once on stderr: the driver
 * refused (then the drain synchronizes as before, and a capture may be invalidated by it). */
static int relax_capture_mode(void)
{
    int mode = 2;  /* CU_STREAM_CAPTURE_MODE_RELAXED */
    if (!ev.exchange)
        return 0;  /* a driver before capture modes: no capture is global */
    CUresult r = ev.exchange(&mode);
    if (r == CU_OK)
        return 0;
    fprintf(stderr, "cgpu: the driver refused relaxed stream-capture mode to the gate's helper thread (error %d):"
            " a CUDA graph captured while the gate closes may be invalidated\n", r);
    return -1;
}

static int drain_queues(int k, int *captures);  /* (with the queues, below) */
/* Launches on page GPU k (index 1 + k; [0]: the container's gate) not counted in a stream's queue
 * since the last drain there: made while the queue was not bounded (policy 5), or with no queue left. */
static unsigned long untracked[1 + CGPU_MAX_GPUS];

/* Finish the work queued on page GPU `k` (all of it for -1): once no launch there is in flight,
 * wait for each stream's last event (the queues, below). A context is synchronized only when
 * launches were made that no queue counted (and no stream may be capturing): synchronizing a
 * context that holds a capturing stream waits on it, which the driver refuses in every capture
 * mode and which invalidates the capture — and a capture may have begun on a stream nothing was
 * launched into yet. What a bounded stream launched since its last event (less than 1/16 of the
 * budget once its mean is known; before, the launches count as not counted) may run on past the
 * answer. */
static void drain(int k)
{
    while (__atomic_load_n(&launching[1 + k], __ATOMIC_SEQ_CST))
        sched_yield();  /* a launch that passed the gate before it closed: a few µs */
    pthread_mutex_lock(&ctx_lock);
    in_driver++;
    int captures = 0;
    unsigned long loose = (unsigned long)drain_queues(k, &captures);
    for (int j = k < 0 ? 0 : 1 + k; j <= (k < 0 ? CGPU_MAX_GPUS : 1 + k); j++)
        loose += __atomic_exchange_n(&untracked[j], 0, __ATOMIC_SEQ_CST);
    for (int i = 0; i < nctxs && loose && !captures && real.ctx_push && real.ctx_pop && real.ctx_sync; i++) {
        CUcontext prev;
        if ((k < 0 || ctx_gpu[i] == k) && real.ctx_push(ctxs[i]) == CU_OK) {
            real.ctx_sync();
            real.ctx_pop(&prev);
        }
    }
    in_driver--;
    pthread_mutex_unlock(&ctx_lock);
}

/* Tell the daemon: `acked` says which closing was answered, a byte in the FIFO wakes it. */
static void answer(uint32_t closing)
{
    static int fifo = -1;
    __atomic_store_n(&mine->acked, closing, __ATOMIC_SEQ_CST);
    if (fifo < 0) {
        char path[4200];
        snprintf(path, sizeof path, "%s/drained", page_dir);
        fifo = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);  /* (no reader: the daemon is away; later) */
    }
    if (fifo >= 0 && write(fifo, "d", 1) < 0 && errno != EAGAIN) {
        close(fifo);
        fifo = -1;
    }
}

/* This process is alive, says a read lock on its slot's first byte in the usage page (POSIX: not
 * a forked child's, gone with the process); the daemon asks for it (F_GETLK gives the holder's pid
 * in the daemon's namespace) before it gives up on a slot that does not answer (cgpu-switch.c). */
static int lock_fd = -1;
static void hold_slot_lock(void)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/usage", page_dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    struct flock l = {.l_type = F_RDLCK, .l_whence = SEEK_SET,
                      .l_start = (off_t)((const char *)mine - (const char *)usage), .l_len = 1};
    if (fcntl(fd, F_SETLK, &l) < 0) {
        close(fd);
        return;
    }
    lock_fd = fd;
}

/* The helper is answering a closing (the daemon waits for a live process that drains). */
static void draining(int on)
{
    if (on)
        __atomic_fetch_or(&mine->gpus, CGPU_PROC_DRAINING, __ATOMIC_SEQ_CST);
    else
        __atomic_fetch_and(&mine->gpus, ~CGPU_PROC_DRAINING, __ATOMIC_SEQ_CST);
}

static void *gate_helper(void *arg)
{
    (void)arg;
    hold_slot_lock();
    /* The next container's slice waits for this thread's answer: its timed waits (a driver that
     * synchronizes by sleeping) end when due, not up to the default 50 µs of timer slack later. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    relax_capture_mode();
    for (;;) {
        if (!per_gpu) {  /* the container's one gate: answer each closing with its value */
            uint32_t g = gate_value(-1);
            if (!(g & 1) && __atomic_load_n(&mine->acked, __ATOMIC_ACQUIRE) != g) {
                draining(1);
                drain(-1);
                answer(g);
                draining(0);
            }
            futex_wait_on(&limits->gate, g);
            continue;
        }
        /* per GPU: at each closing (of any GPU's gate), drain the GPUs it launches on whose
         * gates are closed now, and answer with the count of closings */
        uint32_t c = __atomic_load_n(&limits->closings, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&mine->acked, __ATOMIC_ACQUIRE) != c) {
            draining(1);
            uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST) & ~CGPU_PROC_DRAINING;
            if (ganged() && (on & (on - 1))) {  /* a gang: the halves of a collective cut by the closing */
                uint32_t apart = 0;
                for (uint32_t k = 0; k < limits->ngpus; k++)
                    if (on & (1u << k) && behind((int)k) > 2 * GANG_CATCH_UP)
                        apart = 1;
                if (apart)  /* more apart than collectives in flight: the ranks launch differently; even from here */
                    for (uint32_t k = 0; k < limits->ngpus; k++)
                        base[k] = __atomic_load_n(&launched[k], __ATOMIC_SEQ_CST);
                memset(catch_up_used, 0, sizeof catch_up_used);
                __atomic_store_n(&catch_up_open, 1, __ATOMIC_SEQ_CST);
                int64_t start = mono_ns(), now = start, woke = 0;
                while (!(settled(on) && caught_up()) && now < start + GANG_WAIT_NS) {
                    if (now >= woke + 50000) {  /* the launches waiting: look again (every 50 µs) */
                        futex_wake_all(&limits->gate);
                        for (uint32_t k = 0; k < limits->ngpus; k++)
                            if (on & (1u << k))
                                futex_wake_all(&limits->gpu_gate[k]);
                        woke = now;
                    }
                    if (now - start < 200000)
                        sched_yield();  /* (a peer's launch is usually microseconds away) */
                    else {
                        struct timespec t = {0, 50000};
                        nanosleep(&t, NULL);
                    }
                    now = mono_ns();
                }
                __atomic_store_n(&catch_up_open, 0, __ATOMIC_SEQ_CST);  /* (drain() then waits for those in flight) */
            }
            for (uint32_t k = 0; k < limits->ngpus; k++)
                if (on & (1u << k) && !(gate_value((int)k) & 1))
                    drain((int)k);
            answer(c);
            draining(0);
        }
        futex_wait_on(&limits->closings, c);
    }
    return NULL;
}

static void start_helper(void)
{
    const char *g = getenv("CGPU_GANG");
    gang_off = g && !strcmp(g, "0");
    pthread_t t;
    pthread_attr_t a;
    sigset_t all, old;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  /* signals stay with the process's own threads */
    /* 64 KiB of its own; glibc takes the static TLS out of it (EINVAL when it does not fit: a
     * program with large __thread arrays): then 4 times as much, up to 64 MiB, and said if never */
    int made = -1;
    for (size_t stack = 64 << 10; made && stack <= (64u << 20); stack *= 4) {
        pthread_attr_setstacksize(&a, stack);
        made = pthread_create(&t, &a, gate_helper, NULL);
    }
    if (made)
        fprintf(stderr, "cgpu: the compute gate's helper thread cannot start (%s): this process's kernels "
                "are not gated\n", strerror(made));
    if (made == 0) {
        unsigned k = (unsigned)(mine - usage->procs);
        if (gpu_time) {  /* (its GPU time is counted: the daemon charges it by that) */
            gpu_time->procs[k].pid = mine->pid;
            __atomic_store_n(&gpu_time->procs[k].timed, 1, __ATOMIC_SEQ_CST);
        }
        __atomic_store_n(&mine->gated, per_gpu ? 2 : 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_or(&usage->gated_slots[k / 32], 1u << (k % 32), __ATOMIC_SEQ_CST);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
}

/* Pass the gate of page GPU `k` (-1: the container's): on return this thread counts in
 * launching[1 + k] and the gate was open. The process says it launches on GPU k before it
 * looks at the gate, so a closing either sees it (and waits for its answer) or stops it. */
static void gate_enter(int k)
{
    pthread_once(&helper_once, start_helper);
    if (k >= 0 && !(__atomic_load_n(&mine->gpus, __ATOMIC_RELAXED) & (1u << k)))
        __atomic_fetch_or(&mine->gpus, 1u << k, __ATOMIC_SEQ_CST);
    for (;;) {
        __atomic_add_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
        uint32_t g = gate_value(k);
        if (k < 0 || !ganged()) {
            if (g & 1)
                return;
        } else {  /* a gang: GPU k's gate and the container's (closed while any GPU's is) */
            uint32_t all = gate_value(-1);
            if (((g & all & 1) || catch_up(k))) {
                __atomic_add_fetch(&launched[k], 1, __ATOMIC_SEQ_CST);
                return;
            }
            if (g & 1) {  /* GPU k open, another closed: wait for the container's gate */
                __atomic_sub_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
                futex_wait_on(&limits->gate, all);
                continue;
            }
        }
        __atomic_sub_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
        futex_wait_on(gate_word(k), g);
    }
}


/* ---- queued work bounded (docs/scheduler.md, "Queued work") -------------------------------------
 *
 * A launch returns before its kernel runs: a process can queue hundreds of milliseconds of work
 * (the H100's driver takes ~1024 launches per stream before one blocks), all of which runs on after
 * its gate closes. While the page's `shared` bit of its GPU is set (the daemon sets it under every
 * controlled policy; a page starts with all set), the process keeps at most the budget
 * (`queue_budget_us`) of GPU time queued ahead per stream: an event (a timing one: the same events
 * measure the process's GPU time, queue_start) is recorded after every `stride` launches, and a launch waits for the oldest ones while the launches not yet
 * done, one more included, times the stream's mean GPU time per launch, would pass the budget (one
 * behind the running one always passes). The mean comes from the waits themselves: an event that
 * completes while this thread waits for it ends the GPU time of the launches it covers (counted
 * from the completion before, or its recording when later: an overestimate, never an under-), or, for
 * a card that keeps up (no wait), the events' own elapsed times.
 * With the bit clear (policy 5) a launch does one load more and nothing else; with it set, no lock
 * and no driver call but at an event or a wait.
 *
 * Never into a stream that is capturing (its launches are recorded into a graph, not run; an event
 * recorded there would become a node of the user's graph); waits and queries in relaxed capture
 * mode (another thread's global capture forbids them otherwise). Streams are told apart by their
 * context and handle (the legacy stream, NULL or CU_STREAM_LEGACY, as one; a thread's per-thread
 * stream, CU_STREAM_PER_THREAD or NULL through a _ptsz form, as its own); a stream the process
 * destroyed keeps its events until they complete (a driver error on one counts as complete). */
#define QUEUE_STREAMS 64
#define QUEUE_RING 64
#define STREAM_LEGACY ((void *)1)
#define STREAM_PER_THREAD ((void *)2)
static int queue_ready(void);
struct pending {
    void *event;
    uint32_t launches;  /* the launches it covers */
    int64_t recorded;   /* when (CLOCK_MONOTONIC ns) */
    int counted;        /* the GPU time from the event before it to it is the stream's work (0: a run's start) */
};
struct squeue {
    CUcontext ctx;
    void *stream;       /* as recorded into (the legacy stream as NULL) */
    long owner;         /* a per-thread stream's thread (0: any) */
    struct pending ring[QUEUE_RING];
    unsigned head, tail;        /* events [tail, head) not known complete */
    uint32_t unrecorded;        /* launches since the last event */
    uint64_t covered;           /* the launches the events [tail, head) cover */
    int64_t due;                /* launches an event is recorded after (set at each event) */
    int64_t per_launch;         /* mean GPU ns per launch (0: not known yet) */
    int64_t seen;               /* the last completion observed (a lower bound of it) */
    int64_t stride;             /* launches an event covers while the mean is not known */
    int64_t last_launch;        /* when the last launch into it was made (launch_ns) */
    int timed;                  /* the event before `tail` (the last one known complete) is a timing reference */
    int gpu;                    /* its context's page GPU (-1: the container's) */
    int used;
};
static struct squeue queues[QUEUE_STREAMS];
static int newest_done(struct squeue *q);  /* (below) */
static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t capture_seen = -1000000000000ll;  /* when a launch into a capturing stream was last seen */

static uint32_t budget_ns(void)
{
    uint32_t us = __atomic_load_n(&limits->queue_budget_us, __ATOMIC_RELAXED);
    return (us ? us : CGPU_QUEUE_BUDGET_US_DEFAULT) * 1000u;
}

static HOT_TLS long my_tid;  /* (0 in a forked child's thread until asked) */
static long thread_id(void)
{
    if (!my_tid)
        my_tid = (long)syscall(SYS_gettid);
    return my_tid;
}

/* Whether `stream` (`ptsz`: a per-thread form's NULL) is capturing now; an error counts as capturing
 * (then nothing is recorded into it nor waited for). cuStreamIsCapturing is legal in every mode. */
static int capturing(void *stream, int ptsz)
{
    int status = 0;
    void *s = stream ? stream : ptsz ? STREAM_PER_THREAD : NULL;
    return !ev.capturing || ev.capturing(s, &status) != CU_OK || status != 0;  /* 0: CU_STREAM_CAPTURE_STATUS_NONE */
}

/* The queue of (context, stream) (queue_lock held); NULL when none is free (not bounded then). */
static struct squeue *queue_of(CUcontext c, void *stream, int ptsz)
{
    long owner = 0;
    if (stream == STREAM_LEGACY || (!stream && !ptsz))
        stream = NULL;
    else if (!stream || stream == STREAM_PER_THREAD) {
        stream = STREAM_PER_THREAD;
        owner = thread_id();
    }
    struct squeue *idle = NULL;
    for (int i = 0; i < QUEUE_STREAMS; i++) {
        struct squeue *q = &queues[i];
        if (q->used && q->ctx == c && q->stream == stream && q->owner == owner)
            return q;
        if (!idle && (!q->used || q->head == q->tail))
            idle = q;
    }
    if (!idle)
        return NULL;
    void *events[QUEUE_RING] = {0};
    if (idle->used && idle->ctx == c)  /* (one whose events all completed, of the same context: kept) */
        for (unsigned k = 0; k < QUEUE_RING; k++)
            events[k] = idle->ring[k].event;
    else if (idle->used)  /* (of another context: destroyed) */
        for (unsigned k = 0; k < QUEUE_RING; k++)
            if (idle->ring[k].event && ev.destroy)
                ev.destroy(idle->ring[k].event);
    memset(idle, 0, sizeof *idle);
    for (unsigned k = 0; k < QUEUE_RING; k++)
        idle->ring[k].event = events[k];
    idle->used = 1;
    idle->gpu = known_gpu;
    idle->ctx = c;
    idle->stream = stream;
    idle->owner = owner;
    return idle;
}

/* The calling thread's last queue, and what it was looked up by: a launch into the same stream as
 * the one before finds its queue without the lock (read racily: a queue changes owner only when idle
 * and a new stream takes it, and a stale look costs one launch's wait or event at most). */
static HOT_TLS struct squeue *last_q;
static HOT_TLS CUcontext last_ctx;
static HOT_TLS void *last_stream;
static HOT_TLS int last_ptsz;

static struct squeue *cached_queue(CUcontext c, void *stream, int ptsz)
{
    struct squeue *q = last_q;
    if (!q || last_ctx != c || last_stream != stream || last_ptsz != ptsz || !__atomic_load_n(&q->used, __ATOMIC_RELAXED))
        return NULL;
    /* (still this stream's: a queue idle for long may have been taken by another stream since) */
    void *as = stream == STREAM_LEGACY || (!stream && !ptsz) ? NULL : !stream ? STREAM_PER_THREAD : stream;
    return q->ctx == c && q->stream == as && (as != STREAM_PER_THREAD || q->owner == thread_id()) ? q : NULL;
}

static struct squeue *remember(struct squeue *q, CUcontext c, void *stream, int ptsz)
{
    last_q = q;
    last_ctx = c;
    last_stream = stream;
    last_ptsz = ptsz;
    return q;
}

/* Launches queued on q and not known done (queue_lock held, or racily from the launch path). */
static uint64_t queued(const struct squeue *q)
{
    return __atomic_load_n(&q->unrecorded, __ATOMIC_RELAXED) + q->covered;
}

/* Whether a launch into q must wait first (queue_lock held): one more would pass the budget, and
 * two launches are queued already (one behind the running one is always let through: a kernel
 * longer than the budget still follows the one before without a gap). */
static int over_budget(const struct squeue *q, int64_t budget)
{
    if (q->head == q->tail)
        return 0;
    if (q->head - q->tail >= QUEUE_RING - 1)
        return 1;
    uint64_t n = queued(q);
    if (n < 2)
        return 0;
    if (!q->per_launch) {  /* not known yet: two events queued at most, so a wait soon measures it */
        unsigned evs = 0;  /* (a run's start event covers no launch: not counted) */
        for (unsigned i = q->tail; i != q->head; i++)
            evs += q->ring[i % QUEUE_RING].launches > 0;
        return evs >= 2;
    }
    return (int64_t)(n + 1) * q->per_launch > budget;
}

/* An event done (queue_lock held): at `done` when this thread saw it complete, else 0. */
static void completed(struct squeue *q, int64_t done)
{
    struct pending *p = &q->ring[q->tail % QUEUE_RING];
    int64_t from = q->seen > p->recorded ? q->seen : p->recorded;
    float ms = 0;
    int got = 0;
    if (p->counted && q->timed && ev.elapsed) {  /* (relaxed capture mode: another thread's global capture) */
        int mode = 2, relaxed = ev.exchange && ev.exchange(&mode) == CU_OK;
        got = ev.elapsed(&ms, q->ring[(q->tail - 1) % QUEUE_RING].event, p->event) == CU_OK;
        if (relaxed)
            ev.exchange(&mode);
    }
    if (got && ms > 0) {  /* the GPU time of the launches it covers (the driver's clock, not the host's) */
        int64_t ns = (int64_t)((double)ms * 1e6);
        if (gpu_time && mine && q->gpu >= 0 && q->gpu < CGPU_MAX_GPUS)
            __atomic_add_fetch(&gpu_time->procs[mine - usage->procs].ns[q->gpu], (uint64_t)ns, __ATOMIC_RELAXED);
        if (p->launches && !done) {  /* (a card that keeps up: no wait measures its mean, the events do) */
            int64_t per = ns / p->launches;
            q->per_launch = q->per_launch ? q->per_launch + (per - q->per_launch) / 4 : per;
        }
    }
    q->timed = p->event != NULL;
    if (done && q->seen && p->launches && done > from) {
        int64_t per = (done - from) / p->launches;
        q->per_launch = q->per_launch ? q->per_launch + (per - q->per_launch) / 4 : per;
    }
    int64_t at = done ? done : p->recorded;  /* (seen complete later: it completed after its recording) */
    if (at > q->seen)
        q->seen = at;
    q->covered -= p->launches;
    q->tail++;
}

/* The page GPU of context c (ctx_lock held), -2 if it is not known. */
static int gpu_of_ctx(CUcontext c)
{
    for (int i = 0; i < nctxs; i++)
        if (ctxs[i] == c)
            return ctx_gpu[i];
    return -2;
}

/* The drain's part (ctx_lock held, in the helper thread, relaxed capture mode): on page GPU k (-1:
 * all), record an event after the launches not yet covered in every stream that is not capturing
 * and has a handle of its own, and wait for each stream's last event. *captures: whether a stream
 * may be capturing now (one of ours says so, or a launch into a capturing stream was seen in the
 * last second). Returns whether launches are left that no event covers and whose length is not
 * known yet (the caller then synchronizes the context, unless a stream may be capturing). */
static int drain_queues(int k, int *captures_out)
{
    if (!queue_ready())
        return 0;
    struct { struct squeue *q; void *event; unsigned upto; } last[QUEUE_STREAMS];
    int n = 0, loose = 0, captures = mono_ns() - __atomic_load_n(&capture_seen, __ATOMIC_RELAXED) < 1000000000ll;
    pthread_mutex_lock(&queue_lock);
    for (int i = 0; i < QUEUE_STREAMS; i++) {
        struct squeue *q = &queues[i];
        if (!q->used || (k >= 0 && gpu_of_ctx(q->ctx) != k))
            continue;
        if (q->stream && q->stream != STREAM_PER_THREAD) {  /* (the legacy and per-thread streams: only their owners') */
            int st = 0;
            if (ev.capturing(q->stream, &st) != CU_OK || st) {
                captures = 1;
                continue;
            }
            struct pending *p = &q->ring[q->head % QUEUE_RING];
            CUcontext prev;
            if (q->unrecorded && q->head - q->tail < QUEUE_RING - 1 && real.ctx_push && real.ctx_push(q->ctx) == CU_OK) {
                if ((p->event || ev.create(&p->event, 0) == CU_OK) && ev.record(p->event, q->stream) == CU_OK) {
                    p->launches = q->unrecorded;
                    q->covered += p->launches;
                    p->recorded = mono_ns();
                    /* (launches made longer ago than a tick: done long since, most likely; what ran from the
                     * last event to this one is mostly the process's host time then, not counted) */
                    p->counted = launch_ns() - q->last_launch <= (int64_t)budget_ns() / 16;
                    q->unrecorded = 0;
                    q->head++;
                }
                real.ctx_pop(&prev);
            }
        }
        loose |= q->unrecorded && !q->per_launch;
        if (q->head != q->tail)
            last[n++] = (typeof(last[0])){q, q->ring[(q->head - 1) % QUEUE_RING].event, q->head};
    }
    pthread_mutex_unlock(&queue_lock);
    *captures_out = captures;
    for (int i = 0; i < n; i++)
        ev.sync(last[i].event);  /* (an event recorded outside any capture: legal in relaxed mode) */
    pthread_mutex_lock(&queue_lock);
    for (int i = 0; i < n; i++)
        while (last[i].q->used && last[i].q->tail - last[i].upto >= 0x80000000u)  /* tail before upto */
            completed(last[i].q, 0);
    pthread_mutex_unlock(&queue_lock);
    return loose;
}

/* Before a launch into `stream` of context `c` on a shared GPU: wait while its queue is over the budget. */
static void queue_wait(CUcontext c, void *stream, int ptsz)
{
    int64_t budget = budget_ns();
    struct squeue *q = cached_queue(c, stream, ptsz);
    if (q && !over_budget(q, budget))
        return;  /* (the usual case: no lock) */
    pthread_mutex_lock(&queue_lock);
    q = remember(queue_of(c, stream, ptsz), c, stream, ptsz);
    int checked = 0;
    while (q && over_budget(q, budget)) {
        if (!checked++ && capturing(stream, ptsz)) {
            __atomic_store_n(&capture_seen, mono_ns(), __ATOMIC_RELAXED);
            break;  /* (its launches are recorded into a graph, not queued: nothing to wait for) */
        }
        unsigned t = q->tail;
        void *e = q->ring[t % QUEUE_RING].event;
        pthread_mutex_unlock(&queue_lock);
        int mode = 2;  /* CU_STREAM_CAPTURE_MODE_RELAXED: another thread's global capture forbids waits otherwise */
        int relaxed = ev.exchange && ev.exchange(&mode) == CU_OK;
        CUresult r = ev.query(e);
        int64_t done = 0;
        if (r == 600) {  /* CUDA_ERROR_NOT_READY: wait for it; its completion measures the stream */
            r = ev.sync(e);
            done = r == CU_OK ? mono_ns() : 0;
        }
        if (relaxed)
            ev.exchange(&mode);
        pthread_mutex_lock(&queue_lock);
        if (q->tail == t && q->used)  /* (another thread may have counted it meanwhile) */
            completed(q, done);
    }
    pthread_mutex_unlock(&queue_lock);
}

/* Record a timing event into q's stream after its launches not yet covered (queue_lock held; the
 * stream not capturing, in the calling thread's current context): `counted`, the GPU time since the
 * event before is the stream's work; 0, a run's start. */
static void record(struct squeue *q, int64_t now, int counted)
{
    struct pending *p = &q->ring[q->head % QUEUE_RING];
    if (!p->event && ev.create(&p->event, 0 /* timing (docs/scheduler.md, "The charge") */) != CU_OK)
        p->event = NULL;
    if (p->event && ev.record(p->event, q->stream) == CU_OK) {
        p->launches = q->unrecorded;
        q->covered += p->launches;
        p->recorded = now;
        p->counted = counted;
        q->unrecorded = 0;
        q->head++;
    }
}

/* About 16 events per budget: every `due` launches once the mean is known (each covering 1/16 of
 * the budget). Until then every `stride` launches: 1, doubled each time the event before is found
 * complete already (a card that keeps up with the launches: they never wait, so the mean is never
 * measured), halved when it is not. (queue_lock held) */
static int64_t due_of(const struct squeue *q)
{
    int64_t want = q->per_launch ? (int64_t)budget_ns() / 16 / q->per_launch : q->stride ? q->stride : 1;
    return want < 1 ? 1 : want > 64 ? 64 : want;
}

/* After a launch into `stream` on a shared GPU: count it, and record an event every `due` launches
 * (worked out at the event before). 0: not counted (no queue left for it). */
static int queue_note(CUcontext c, void *stream, int ptsz)
{
    struct squeue *q = cached_queue(c, stream, ptsz);
    if (q) {  /* (the usual case: counted without the lock, until an event is due) */
        int64_t due = __atomic_load_n(&q->due, __ATOMIC_RELAXED);
        if ((int64_t)__atomic_add_fetch(&q->unrecorded, 1, __ATOMIC_RELAXED) < due)
            return 1;
        pthread_mutex_lock(&queue_lock);
        if (!q->used) {  /* (taken meanwhile by another stream) */
            pthread_mutex_unlock(&queue_lock);
            return 0;
        }
    } else {
        pthread_mutex_lock(&queue_lock);
        q = remember(queue_of(c, stream, ptsz), c, stream, ptsz);
        if (!q) {
            pthread_mutex_unlock(&queue_lock);
            return 0;
        }
        q->unrecorded++;
    }
    if (q->unrecorded < due_of(q) || q->head - q->tail >= QUEUE_RING - 1) {
        q->due = due_of(q);
        pthread_mutex_unlock(&queue_lock);
        return 1;
    }
    if (q->head != q->tail) {  /* (what is done is counted at each event: a run may last as long as launches come) */
        int done = newest_done(q);
        if (!q->per_launch && q->ring[(q->head - 1) % QUEUE_RING].launches) {  /* (not a run's start) */
            int64_t st = q->stride ? q->stride : 1;
            q->stride = done ? (st < 32 ? st * 2 : 64) : st > 1 ? st / 2 : 1;
        }
        while (done && q->tail != q->head)
            completed(q, 0);
    }
    int64_t now = mono_ns();
    if (capturing(stream, ptsz)) {  /* (its launches went into a graph: none queued; no event into it) */
        __atomic_store_n(&capture_seen, now, __ATOMIC_RELAXED);
        q->unrecorded = 0;
        q->due = due_of(q);
        pthread_mutex_unlock(&queue_lock);
        return 1;
    }
    record(q, now, 1);
    q->due = due_of(q);
    pthread_mutex_unlock(&queue_lock);
    return 1;
}

/* Whether the newest event of q is complete (queue_lock held; relaxed capture mode for the query). */
static int newest_done(struct squeue *q)
{
    int mode = 2, relaxed = ev.exchange && ev.exchange(&mode) == CU_OK;
    int done = ev.query(q->ring[(q->head - 1) % QUEUE_RING].event) != 600;
    if (relaxed)
        ev.exchange(&mode);
    return done;
}

/* Before a launch into `stream` on a shared GPU, past the gate: a run of the stream's queued work
 * begins at a launch made more than a tick (budget / 16) after the one before, when its events are
 * done, with a timing event recorded now: what ran before it (idle time, and the few µs of the
 * launches since its last event) is not counted. The GPU time of a run is counted from that event
 * to each later one as it is found complete (completed()). Launches a tick apart or closer are one
 * run (an event found done by the next launch starts none: that cost a query and a second record
 * per event for under a tick counted); one read of the CPU's counter per launch, and never an event
 * into a capturing stream. */
static void queue_start(CUcontext c, void *stream, int ptsz)
{
    int64_t now = launch_ns(), tick = (int64_t)budget_ns() / 16;
    struct squeue *q = cached_queue(c, stream, ptsz);
    if (q) {
        int64_t gap = now - q->last_launch;
        q->last_launch = now;
        if (gap <= tick)
            return;  /* (the usual case: within a run, the launches a tick apart or closer) */
    }
    pthread_mutex_lock(&queue_lock);
    if (!q || !q->used) {
        q = remember(queue_of(c, stream, ptsz), c, stream, ptsz);
        if (!q) {
            pthread_mutex_unlock(&queue_lock);
            return;
        }
        q->last_launch = now;
    }
    if (q->head != q->tail) {
        if (!newest_done(q)) {  /* (still running: the run goes on) */
            pthread_mutex_unlock(&queue_lock);
            return;
        }
        while (q->tail != q->head)
            completed(q, 0);
    }
    if (q->head - q->tail >= QUEUE_RING - 1 || capturing(stream, ptsz)) {
        pthread_mutex_unlock(&queue_lock);
        return;
    }
    record(q, mono_ns(), 0);  /* (the events' times are CLOCK_MONOTONIC's, as the waits') */
    pthread_mutex_unlock(&queue_lock);
}

/* The driver's event functions are there (a driver without them: nothing is bounded). */
static int queue_ready(void)
{
    return ev.create && ev.record && ev.query && ev.sync && ev.capturing;
}

/* Whether a launch on page GPU k may wait for its queue: not while its gate (or a gang's) is closed
 * or a closing is being answered. Then it waits at the gate anyway, or must pass: a gang's
 * collective half let through to its peer (catch_up) would otherwise wait behind a half that spins
 * for it. */
static int may_wait(int k)
{
    if (__atomic_load_n(&catch_up_open, __ATOMIC_SEQ_CST) || !(gate_value(k) & 1))
        return 0;
    return !ganged() || (gate_value(-1) & 1);
}

/* Whether launches on page GPU k are bounded now: it is shared, or (a gang: its launches anywhere run
 * only while all its gates are open) any GPU the process launches on is. One load when none is.
 * (The container's gate, k -1: never.) */
static inline int shared_gpu(int k)
{
    uint32_t sh = k >= 0 && per_gpu ? __atomic_load_n(&limits->shared, __ATOMIC_RELAXED) : 0;
    if (__builtin_expect(!sh, 1))
        return 0;
    return (sh >> k & 1) || (ganged() && (sh & __atomic_load_n(&mine->gpus, __ATOMIC_RELAXED) & ~CGPU_PROC_DRAINING));
}

/* A launch into `stream_` (`ptsz_`: a per-thread-default-stream form) through the gate of its
 * GPU; while the GPU is shared, within the queue's budget. */
#define GATED(stream_, ptsz_, fn, ...)                          \
    do {                                                        \
        PASS_THROUGH(fn, __VA_ARGS__);                          \
        if (!(fn))                                              \
            return CU_NOT_INITIALIZED;                          \
        if (!need_slot())                                       \
            return CU_LAUNCH_OUT_OF_RESOURCES;                  \
        int k_ = note_context();                                \
        int b_ = shared_gpu(k_) && queue_ready();               \
        if (b_ && may_wait(k_)) {                               \
            in_driver++;  /* (before the gate: a closing does not wait for a thread waiting here) */ \
            queue_wait(known_ctx, (stream_), (ptsz_));          \
            in_driver--;                                        \
        }                                                       \
        gate_enter(k_);                                         \
        in_driver++;                                            \
        if (b_)                                                 \
            queue_start(known_ctx, (stream_), (ptsz_));         \
        CUresult r_ = (fn)(__VA_ARGS__);                        \
        if (r_ == CU_OK && !(b_ && queue_note(known_ctx, (stream_), (ptsz_)))) \
            __atomic_add_fetch(&untracked[1 + k_], 1, __ATOMIC_RELAXED); \
        in_driver--;                                            \
        __atomic_sub_fetch(&launching[1 + k_], 1, __ATOMIC_SEQ_CST); \
        return r_;                                              \
    } while (0)

/* cuLaunchKernelEx's config: the stream is after the dimensions and the shared memory */
struct launch_config { unsigned grid[3], block[3], shmem; void *stream; };
#define CONFIG_STREAM(c) ((c) ? ((const struct launch_config *)(c))->stream : NULL)

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED(stream, 0, real.launch, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shmem, void *stream, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED(stream, 1, real.launch_ptsz, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shmem, void *stream, void **params)
{
    LAZY_ROOM(f);
    GATED(stream, 0, real.launch_coop, f, gx, gy, gz, bx, by, bz, shmem, stream, params);
}

CUresult cuLaunchCooperativeKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                        unsigned bz, unsigned shmem, void *stream, void **params)
{
    LAZY_ROOM(f);
    GATED(stream, 1, real.launch_coop_ptsz, f, gx, gy, gz, bx, by, bz, shmem, stream, params);
}

CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED(CONFIG_STREAM(config), 0, real.launch_ex, config, f, params, extra);
}

CUresult cuLaunchKernelEx_ptsz(const void *config, void *f, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED(CONFIG_STREAM(config), 1, real.launch_ex_ptsz, config, f, params, extra);
}

CUresult cuGraphLaunch(void *exec, void *stream)
{
    GATED(stream, 0, real.graph_launch, exec, stream);
}

CUresult cuGraphLaunch_ptsz(void *exec, void *stream)
{
    GATED(stream, 1, real.graph_launch_ptsz, exec, stream);
}

/* A forked child has no helper thread and no launches in flight. */
void gate_forked(void)
{
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    helper_once = fresh;
    memset(launching, 0, sizeof launching);
    memset(launched, 0, sizeof launched);
    memset(base, 0, sizeof base);
    catch_up_open = 0;
    memset(untracked, 0, sizeof untracked);
    nctxs = 0;
    known_ctx = NULL;
    memset(queues, 0, sizeof queues);  /* (the parent's streams and events: not the child's) */
    my_tid = 0;
    last_q = NULL;
    if (lock_fd >= 0)
        close(lock_fd);  /* (the parent's lock is the parent's: a child holds none until it launches) */
    lock_fd = -1;
}
