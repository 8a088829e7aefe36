/*
 * libcgpu, compute: the helper thread answers the daemon's closings (cgpu_compute.h).
 */
#include <errno.h>
#include <stdint.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "cgpu_compute.h"

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


unsigned gate_waiting[1 + CGPU_MAX_GPUS];

/* Whether a thread of the process waits at a gate other than page GPU k's now: a launch the work on
 * GPU k may wait for (a collective's half on another GPU, held by a gang's closing or that GPU's). */
static int waits_elsewhere(int k)
{
    for (int j = 0; j <= CGPU_MAX_GPUS; j++)
        if (j != 1 + k && __atomic_load_n(&gate_waiting[j], __ATOMIC_SEQ_CST))
            return 1;
    return 0;
}

/* The contexts on page GPU k synchronized (by the syncer), waited for whole, but past the deadline
 * no longer once a launch of the process waits at another gate: what is synchronized may be a
 * collective's half waiting for that launch (issue 45, item 1: one thread driving an all-reduce
 * across GPUs, untracked, waited on GPU 0 for a half whose peer was held at GPU 1's gate by the
 * same closing). The synchronize goes on; its work runs on past the answer, as a bounded stream's. */
static void sync_whole(int k, int64_t deadline)
{
    uint64_t ticket = contexts_sync_ask(k);
    while (contexts_sync_wait(ticket, mono_ns() + 1000000) != 0)
        if (!ticket || (mono_ns() >= deadline && waits_elsewhere(k)))
            return;
}

/* Finish the work queued on page GPU `k` (all of it for -1), until `deadline`: once no launch there
 * is in flight, wait for each stream's last event (the queues, queue.c). A context is synchronized
 * only when launches were made that no queue counted (and no stream may be capturing):
 * synchronizing a context that holds a capturing stream waits on it, which the driver refuses in
 * every capture mode and which invalidates the capture — and a capture may have begun on a stream
 * nothing was launched into yet. What a bounded stream launched since its last event (less than
 * 1/16 of the budget once its mean is known; before, the launches count as not counted) may run on
 * past the answer, and so does whatever of the bounded work was not done by the deadline (a stream
 * waiting on the host, a collective whose peer has not launched, a kernel longer than the bound): the
 * answer comes at the deadline whatever the application does (docs/isolation.md, "the drain
 * bound"). Work no queue bounded is waited for whole (the daemon's cap bounds that wait). */
static void drain(int k, int64_t deadline)
{
    threads_fence();  /* (the gate is seen closed: every launch after this sees it too) */
    while (launches_in_flight(k) && mono_ns() < deadline)
        sched_yield();  /* a launch that passed the gate before it closed: a few µs */
    /* (the contexts' lock, for the deadline at most: a context being destroyed holds it a moment) */
    while (pthread_mutex_trylock(&ctx_lock)) {
        if (mono_ns() >= deadline)
            return;
        struct timespec t = {0, 20000};
        nanosleep(&t, NULL);
    }
    in_driver++;
    int captures = 0;
    unsigned long loose = (unsigned long)drain_queues(k, &captures, deadline);
    loose += queue_take_untracked(k);
    in_driver--;
    pthread_mutex_unlock(&ctx_lock);
    if (loose && !captures)  /* work no queue bounded (made while the GPU was not shared, or before the stream's mean was
                              * known): waited for whole, as before issue 34 (its length is not bounded either; the daemon's
                              * drain_cap bounds its wait), e.g. the backlog of a daemon's restart */
        sync_whole(k, deadline);
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
                drain(-1, INT64_MAX);  /* (an older cgpud's page: its daemon bounds nothing, and waits for the drain) */
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
            int64_t deadline = mono_ns() + CGPU_DRAIN_BOUND_NS;  /* (one for the whole answer) */
            uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST) & ~CGPU_PROC_DRAINING;
            if (ganged())  /* a gang: the halves of a collective cut by the closing (its ranks here or in other processes) */
                gang_catch_up(on, deadline);
            for (uint32_t k = 0; k < limits->ngpus; k++)
                if (on & (1u << k) && !(gate_value((int)k) & 1))
                    drain((int)k, deadline);
            answer(c);
            draining(0);
        }
        futex_wait_on(&limits->closings, c);
    }
    return NULL;
}

static void start_helper(void)
{
    threads_asym_register();
    gang_init();
    /* 64 KiB of its own; glibc takes the static TLS out of it (EINVAL when it does not fit: a
     * program with large __thread arrays): then 4 times as much, up to 64 MiB, and said if never */
    int made = -1;
    for (size_t stack = 64 << 10; made && stack <= (64u << 20); stack *= 4)
        made = start_thread(gate_helper, stack);
    if (made)
        fprintf(stderr, "cgpu: the compute gate's helper thread cannot start (%s): this process's kernels "
                "are not gated\n", strerror(made));
    if (made == 0) {
        unsigned k = (unsigned)(mine - usage->procs);
        charge_timed();  /* (its GPU time is counted: the daemon charges it by that) */
        __atomic_store_n(&mine->gated, per_gpu ? 2 : 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_or(&usage->gated_slots[k / 32], 1u << (k % 32), __ATOMIC_SEQ_CST);
    }
}

static pthread_once_t helper_once = PTHREAD_ONCE_INIT;

int helper_asked;  /* (the launch path's one load, cgpu_compute.h: pthread_once's call once only) */
void drain_start_helper_slow(void)
{
    pthread_once(&helper_once, start_helper);
    __atomic_store_n(&helper_asked, 1, __ATOMIC_RELEASE);
}

/* A forked child has no helper thread (and holds no lock on its slot until it launches). */
void drain_forked(void)
{
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    helper_once = fresh;
    helper_asked = 0;
    memset(gate_waiting, 0, sizeof gate_waiting);  /* (the parent's threads are not the child's) */
    if (lock_fd >= 0)
        close(lock_fd);  /* (the parent's lock is the parent's: a child holds none until it launches) */
    lock_fd = -1;
}
