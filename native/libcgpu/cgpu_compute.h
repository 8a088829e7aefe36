/*
 * libcgpu's compute part (docs/isolation.md, "Compute"; docs/scheduler.md, "Queued work"): what
 * its files share. One file per concern, in layers that call down, never up:
 *   clock.c     the clocks (CLOCK_MONOTONIC, the launch path's cheap counter), the bounded wait
 *               for an event, the library's threads;
 *   contexts.c  the contexts the process launched in and their page GPU, their synchronize (the
 *               syncer thread), the captures on each;
 *   gang.c      the gate words and futexes, a gang's launches counted and the catch-up of a
 *               collective a closing cut in half;
 *   charge.c    the GPU-time charge: a run's GPU time, from its timing events, into the slot;
 *   queue.c     queued work bounded per stream (events, the wait before a launch, the drain's
 *               part of the streams);
 *   handles.c   the handles' lifetimes (a destroyed context, stream or green context is forgotten
 *               before the driver sees it go) and the captures begun and ended;
 *   drain.c     the helper thread: answers each closing once its work is done (or its bound passed);
 *   gate.c      the top: the launch entry points (the gate, then the queue's bound).
 * Everything here is hidden.
 */
#ifndef CGPU_COMPUTE_H
#define CGPU_COMPUTE_H

#include "cgpu_internal.h"

/* (a launch's thread-locals: initial-exec, one load each, as in_driver: libcgpu is loaded at start) */
#define HOT_TLS __thread __attribute__((tls_model("initial-exec")))

#pragma GCC visibility push(hidden)

/* ---- clock.c ---- */
/* The drain bound (docs/isolation.md, "The drain bound"): the helper answers a closing at most this
 * long after it saw it, whatever the application does: three quarters of the daemon's drain bound
 * (two of its slices, said in the limits page: it gives up on a process at one drain bound; the
 * quarter left is for the wake-ups), so 15 ms at the default 10 ms slice, and where the page says
 * none (an older cgpud). The wait before a launch waits at most as long for its stream. */
int64_t drain_bound_ns(void);
#define CGPU_DRAIN_BOUND_NS drain_bound_ns()
int64_t mono_ns(void);
/* Wait for `event` to complete, until `deadline` (CLOCK_MONOTONIC ns): CU_OK when it did (or an
 * error: counted as done), 600 (CUDA_ERROR_NOT_READY) when the deadline passed first. Never an
 * unbounded call into the driver: queries, with the thread asleep between them. */
CUresult event_wait(void *event, int64_t deadline);
int start_thread(void *(*fn)(void *), size_t stack);  /* detached, signals blocked: 0 or the error */
int64_t launch_ns(void);  /* the launch path's clock (compared only with its own readings) */

/* ---- contexts.c ---- */
extern pthread_mutex_t ctx_lock;
/* The calling thread's current context as libcgpu knows it (docs/isolation.md, "The launch path"):
 * kept by the wrapped calls that change it (contexts_switched), asked of the driver only where it is
 * not known. Each is trusted as of one epoch of the table (a context forgotten: an address may come
 * back for another device). */
extern HOT_TLS CUcontext known_ctx;  /* the thread's current context */
extern HOT_TLS int known_gpu;        /* and its page GPU */
extern HOT_TLS unsigned ctx_known;   /* 1 + the epoch as of which known_ctx is current (0: not known) */
extern HOT_TLS unsigned gpu_known;   /* 1 + the epoch as of which known_gpu is its page GPU (0: not known) */
extern HOT_TLS unsigned contexts_seen_epoch;  /* (contexts.c: the thread's cache of contexts, as of) */
extern unsigned contexts_epoch;
int note_context_slow(void);
/* The calling thread's page GPU (-1: the container's gate): no driver call, no shared write while
 * the thread's current context and its GPU are known; else found (contexts.c). */
static inline int note_context(void)
{
    if (__builtin_expect(gpu_known == 1 + __atomic_load_n(&contexts_epoch, __ATOMIC_ACQUIRE), 1))
        return known_gpu;
    return note_context_slow();
}
int gpu_of_ctx(CUcontext c);         /* (ctx_lock held) -2: not known */
int contexts_forget(CUcontext c, CUdevice dev, CUcontext *gone);  /* (ctx_lock held) out of the table: gone[] (64 at most) */
void contexts_wait(CUcontext c, CUdevice dev);  /* (ctx_lock held) the syncer done with them */
void contexts_capture(CUcontext c, int delta);  /* a capture begun (+1) or ended (-1) on a stream of c */
/* synchronize the contexts on page GPU k (-1: all), by a thread of its own: asked (a ticket; 0: no
 * thread), then waited for until the deadline (0 done, -1 not yet: it goes on) */
uint64_t contexts_sync_ask(int k);
int contexts_sync_wait(uint64_t ticket, int64_t deadline);
void contexts_forked(void);

/* ---- gang.c ---- */
/* Threads of this process inside a launch now: [0] on the container's gate, [1 + k] on GPU k's. */
extern unsigned launching[1 + CGPU_MAX_GPUS];  /* (those of threads with no record: threads.c) */
int launches_in_flight(int k);  /* a thread of the process is inside a launch on page GPU k */
/* The gate a launch on page GPU `k` waits at (-1: the container's), and its value. */
static inline const uint32_t *gate_word(int k)
{
    return k >= 0 ? &limits->gpu_gate[k] : &limits->gate;
}
static inline uint32_t gate_value(int k)
{
    return __atomic_load_n(gate_word(k), __ATOMIC_SEQ_CST);
}
void futex_wake_all(const uint32_t *word);
void futex_wait_on(const uint32_t *word, uint32_t seen);
extern int gang_on;
static inline int ganged(void)  /* (gang.c) */
{
    return __atomic_load_n(&gang_on, __ATOMIC_RELAXED);
}
void gang_init(void);             /* CGPU_GANG (at the first launch) */
int gang_pass(int k);             /* a launch on GPU k may pass the gang's gates now (counted) */
int gang_catching_up(void);       /* the helper answers a closing: catch-up allowed */
void gang_catch_up(uint32_t on, int64_t deadline);  /* the helper: the halves of a collective a closing cut catch up */
void gang_forked(void);

/* ---- charge.c ---- */
/* A complete timing event of context c placed on the card's clock of c: 1 and *at (ms) and *epoch
 * (times of two epochs are not comparable), else 0. It may take the event (*event then NULL: it is
 * the context's reference now; the caller makes another for its next record). */
int charge_time(CUcontext c, void **event, double *at, unsigned *epoch);
/* A run of context c on page GPU `gpu` from a to b (ms, one epoch): what of it no run of c was
 * charged already goes to the slot's counter (the union of concurrent streams' runs); its ns. */
int64_t charge_span(int gpu, CUcontext c, unsigned epoch, double a, double b);
void charge_estimate(int gpu, int64_t ns);  /* GPU time whose span is not known, as it is */
/* the GPU time between two complete events, summed as it is (a context with no clock: CHARGE_CTXS in use) */
int64_t charge_elapsed(int gpu, void *from, void *to);
void charge_forget_context(CUcontext c);    /* a context destroyed (NULL: all) */
void charge_forked(void);
void charge_timed(void);  /* the slot's GPU time is counted from now (the helper started) */

/* ---- queue.c ---- */
int queue_ready(void);
/* w: the launch counts as w (a graph: its nodes); item: its kind (queue.c: the function and its grid and
 * block, a graph's executable, a copy's call and size; 0: none, the stream's mean) */
void queue_wait(CUcontext c, void *stream, int ptsz, uint32_t w, uint64_t item);
/* pdl: a programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): no event
 * of ours may sit between it and the launch before it (the card would serialize them) */
void queue_start(CUcontext c, void *stream, int ptsz, int pdl);
int queue_note(CUcontext c, void *stream, int ptsz, uint32_t w, int pdl, uint64_t item);
extern unsigned long queue_loose[1 + CGPU_MAX_GPUS];  /* (queue.c: set, a launch on page GPU k no queue counted) */
static inline void queue_untracked(int k)  /* a launch on page GPU k no queue counted (queue.c) */
{
    if (!__atomic_load_n(&queue_loose[1 + k], __ATOMIC_ACQUIRE))
        __atomic_store_n(&queue_loose[1 + k], 1, __ATOMIC_SEQ_CST);
}
unsigned long queue_take_untracked(int k);
int drain_queues(int k, int *captures, int64_t deadline);
void queue_forget_stream(void *stream);  /* a stream destroyed: never named again (its events kept) */
void queue_forget_context(CUcontext c);  /* a context destroyed (NULL: those of no listed context): its queues dropped (queue_lock taken) */
void queue_graph_made(void *exec, uint32_t nodes);  /* an executable graph of `nodes` nodes */
void queue_graph_gone(void *exec);
uint32_t queue_graph_weight(void *exec);  /* its nodes (1: not known) */
void queue_forked(void);

/* ---- handles.c ---- (the CUDA names it wraps only) */

/* ---- drain.c ---- */
/* Threads of this process waiting at a closed gate now: [0] the container's, [1 + k] GPU k's (gate.c
 * counts them; the drain bounds a synchronize that may wait for one of them) */
extern unsigned gate_waiting[1 + CGPU_MAX_GPUS];
extern int helper_asked;
void drain_start_helper_slow(void);
static inline void drain_start_helper(void)  /* once */
{
    if (__builtin_expect(!__atomic_load_n(&helper_asked, __ATOMIC_ACQUIRE), 0))
        drain_start_helper_slow();
}
void drain_forked(void);

#pragma GCC visibility pop

#endif
