/*
 * libcgpu, compute: queued work bounded per stream (cgpu_compute.h).
 */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu_compute.h"

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
#define ITEMS 256
#define STREAM_LEGACY ((void *)1)
#define STREAM_PER_THREAD ((void *)2)
#define STREAM_GONE ((void *)3)  /* a stream destroyed (its events still ours, the stream never touched again) */
struct pending {
    void *event;
    uint32_t launches;  /* the launches it covers */
    uint64_t upto;      /* the items noted before it (items [the event before's upto, upto) are its) */
    int64_t est;        /* their estimated GPU ns, together */
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
    int timed;                  /* the event before `tail` (the last one known complete) was placed on the card's clock */
    double last_at;             /* at last_at (ms, charge.c's clock of the context, epoch `epoch`) */
    unsigned epoch;
    int gpu;                    /* its context's page GPU (-1: the container's) */
    int used;
    /* programmatic dependent launches (issue 34): an event of ours between two would serialize them
     * on the card, so in a stream that has them a due event is held back (owed) until the next launch
     * that is not one, and recorded before it, the same place after the launches it covers; a run
     * whose start could not be marked (restart) is charged at the stream's mean. */
    int pdl, owed, restart;
    /* each item's time (issue 34: a mean hides a long kernel behind short ones): the kinds of the
     * launches noted, by number (ITEMS back), and the estimated GPU ns of those not known done */
    uint64_t items[ITEMS];
    uint64_t noted;
    int64_t ahead, unrec_est;
    int64_t card_per;           /* GPU ns per launch as its events measured it: the least of the last 8 runs' */
    int64_t span_per[8];        /* (a run's span holds the card's idle time while this thread was late, never less
                                 * than its work: the least of a few is the work's) */
    unsigned span_at;
};
static struct squeue queues[QUEUE_STREAMS];
static int newest_done(struct squeue *q);  /* (below) */
static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t capture_seen = -1000000000000ll;  /* when a launch into a capturing stream was last seen */

/* ---- each item's time: kinds of launches (issue 34, "the bound in time per item") ----
 * A stream's mean time per launch hides a long kernel behind short ones (a model's few long GEMMs
 * among many short elementwise kernels: after the short ones the mean is theirs, and the launcher
 * queues every GEMM of the layer at it, tens of ms past the budget). So each launch is estimated by
 * its kind — the function and its grid and block (a graph: its executable; a copy or memset: the call
 * and its size) — whose GPU time is learned from the events that cover it: an event covering one
 * kind gives it exactly; one covering several gives its one kind not measured yet the rest, or else
 * scales each kind toward the measured whole. A kind not seen yet counts at the stream's mean (its
 * first run may pass the budget by its length once). KINDS kinds, open addressing, full: the mean. */
#define KINDS 4096
static struct kind { uint64_t key; int64_t ns; uint32_t seen, pad; } kinds[KINDS];

static struct kind *kind_of(uint64_t key, int make)
{
    if (!key)
        return NULL;
    for (unsigned i = (unsigned)(key >> 20) % KINDS, n = 0; n < 16; i = (i + 1) % KINDS, n++) {
        uint64_t k = __atomic_load_n(&kinds[i].key, __ATOMIC_RELAXED);
        if (k == key)
            return &kinds[i];
        if (!k) {
            if (!make)
                return NULL;
            kinds[i].ns = 0;
            kinds[i].seen = 0;
            __atomic_store_n(&kinds[i].key, key, __ATOMIC_RELEASE);
            return &kinds[i];
        }
    }
    return NULL;
}

/* an item of kind `key`'s estimated GPU ns (racily read on the launch path: a word) */
static int64_t item_ns(uint64_t key, int64_t mean)
{
    struct kind *k = kind_of(key, 0);
    int64_t ns = k ? __atomic_load_n(&k->ns, __ATOMIC_RELAXED) : 0;
    return ns > 0 ? ns : mean;
}

/* The items [from, to) of q ran in `ns` of GPU time (queue_lock held): their kinds learned. */
static void learn(const uint64_t *items, uint64_t from, uint64_t to, int64_t ns, int64_t mean)
{
    if (to <= from || ns <= 0 || to - from > ITEMS)
        return;
    int64_t known = 0, sum = 0;
    uint64_t fresh = 0, n_fresh = 0, distinct = items[from % ITEMS], one = 1;
    for (uint64_t i = from; i < to; i++) {
        struct kind *k = kind_of(items[i % ITEMS], 1);
        if (!k)
            return;  /* (a kind not kept: nothing learned from this run) */
        one &= items[i % ITEMS] == distinct;
        if (!k->seen) {
            if (fresh && fresh != k->key)
                fresh = ~0ull;  /* (two kinds not measured yet) */
            else
                fresh = k->key;
            n_fresh++;
        } else
            known += k->ns;
        sum += k->seen ? k->ns : mean;
    }
    if (one) {  /* one kind: measured */
        struct kind *k = kind_of(distinct, 0);
        int64_t per = ns / (int64_t)(to - from);
        k->ns = k->seen ? k->ns + (per - k->ns) / 2 : per;
        k->seen++;
        return;
    }
    if (fresh && fresh != ~0ull) {  /* one kind not measured yet: the rest is its */
        struct kind *k = kind_of(fresh, 0);
        int64_t per = (ns - known) / (int64_t)n_fresh;
        k->ns = per > 0 ? per : 1;
        k->seen = 1;
        return;
    }
    if (sum <= 0)
        return;
    for (uint64_t i = from; i < to; i++) {  /* each distinct kind once, halfway to the measured whole */
        struct kind *k = kind_of(items[i % ITEMS], 0);
        int dup = 0;
        for (uint64_t j = from; j < i && !dup; j++)
            dup = items[j % ITEMS] == k->key;
        if (dup)
            continue;
        int64_t was = k->seen ? k->ns : mean, want = (int64_t)((double)was * (double)ns / (double)sum);
        k->ns = was + (want - was) / 2;
        if (k->ns < 1)
            k->ns = 1;
        k->seen++;
    }
}

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
static int over_budget(const struct squeue *q, int64_t budget, uint32_t w, uint64_t item)
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
    /* (each queued item at its kind's time, this one too; a graph's kind is its executable, learned whole:
     * until then its nodes at the mean) */
    int64_t next = item_ns(item, (int64_t)w * q->per_launch);
    return __atomic_load_n(&q->ahead, __ATOMIC_RELAXED) + next > budget;
}

/* What a launch of q is charged when no event measured it: the least of its last runs' per launch,
 * once three were measured (the first may hold the process's start: the driver's first launch), else 0. */
static int64_t estimate_per(const struct squeue *q)
{
    return q->span_at >= 3 ? q->card_per : 0;
}

/* An event done (queue_lock held): at `done` when this thread saw it complete, else 0. */
static void completed(struct squeue *q, int64_t done)
{
    struct pending *p = &q->ring[q->tail % QUEUE_RING];
    int64_t from = q->seen > p->recorded ? q->seen : p->recorded, ns = 0;
    double at_ms = 0;
    unsigned epoch = 0;
    /* (its time on the card's clock of the context; charge.c may keep the event as its reference: the
     * slot gets a new one at its next record) */
    int placed = p->event && charge_time(q->ctx, &p->event, &at_ms, &epoch);
    void *before = q->ring[(q->tail - 1) % QUEUE_RING].event;
    if (placed && p->counted && q->timed && epoch == q->epoch) {
        ns = (int64_t)((at_ms - q->last_at) * 1e6);  /* the run's own GPU time (the driver's clock) */
        charge_span(q->gpu, q->ctx, epoch, q->last_at, at_ms);  /* charged: what no other stream's run was */
    } else if (!placed && p->counted && q->timed && before && p->event)  /* (no clock for its context: summed) */
        ns = charge_elapsed(q->gpu, before, p->event);
    if (ns > 0 && p->launches)  /* (its items: from the event before's upto to its) */
        learn(q->items, q->ring[(q->tail - 1) % QUEUE_RING].upto, p->upto, ns, q->per_launch);
    __atomic_sub_fetch(&q->ahead, p->est, __ATOMIC_RELAXED);
    if (ns > 0 && p->launches) {
        int64_t per = ns / p->launches;
        q->span_per[q->span_at++ % 8] = per;
        q->card_per = per;
        for (int i = 0; i < 8; i++)
            if (q->span_per[i] && q->span_per[i] < q->card_per)
                q->card_per = q->span_per[i];
        if (!done)  /* (a card that keeps up: no wait measures its mean, the events do) */
            q->per_launch = q->per_launch ? q->per_launch + (per - q->per_launch) / 4 : per;
    }
    q->timed = placed || p->event;
    q->last_at = at_ms;
    q->epoch = epoch;
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


/* A stream with programmatic dependent launches, at a closing (issue 45, item 13): an event recorded
 * after its last launch would sit between that launch and the next, which then could not overlap it
 * on the card (docs/isolation.md, "Programmatic dependent launches and the drain"). So the drain
 * records none there: it asks the stream itself whether its work is done (cuStreamQuery, which puts
 * nothing into it), until the deadline, the stream touched only under the queues' lock while it is
 * still ours (a stream being destroyed is marked gone first: queue_forget_stream). */
static void stream_idle_wait(struct squeue *q, void *stream, CUcontext c, int64_t deadline)
{
    for (int64_t nap = 20000;; nap = nap < 100000 ? nap * 2 : 200000) {
        CUresult r = CU_OK;
        int st = 0;
        CUcontext prev;
        pthread_mutex_lock(&queue_lock);
        if (q->used && q->stream == stream && q->ctx == c && ev.capturing(stream, &st) == CU_OK && !st
            && real.ctx_push && real.ctx_push(c) == CU_OK) {
            r = ev.stream_query(stream);
            real.ctx_pop(&prev);
        }
        pthread_mutex_unlock(&queue_lock);
        int64_t now = mono_ns();
        if (r != 600 || now >= deadline)
            return;  /* (done, gone, capturing, or an error: nothing to wait for; or the deadline) */
        struct timespec t = {0, (long)(deadline - now < nap ? deadline - now : nap)};
        nanosleep(&t, NULL);
    }
}

/* The drain's part (ctx_lock held, in the helper thread, relaxed capture mode): on page GPU k (-1:
 * all), record an event after the launches not yet covered in every stream that is not capturing
 * and has a handle of its own (one with programmatic dependent launches: none, its work asked of
 * the stream itself), and wait for each stream's last event. *captures: whether a stream
 * may be capturing now (one of ours says so, or a launch into a capturing stream was seen in the
 * last second). Returns whether launches are left that no event covers and whose length is not
 * known yet (the caller then synchronizes the context, unless a stream may be capturing). */
int drain_queues(int k, int *captures_out, int64_t deadline)
{
    if (!queue_ready())
        return 0;
    struct { struct squeue *q; void *event; unsigned upto; } last[QUEUE_STREAMS];
    struct { struct squeue *q; void *stream; CUcontext ctx; } idle[QUEUE_STREAMS];  /* programmatic ones */
    int n = 0, ni = 0, loose = 0, captures = mono_ns() - __atomic_load_n(&capture_seen, __ATOMIC_RELAXED) < 1000000000ll;
    pthread_mutex_lock(&queue_lock);
    for (int i = 0; i < QUEUE_STREAMS; i++) {
        struct squeue *q = &queues[i];
        if (!q->used || (k >= 0 && gpu_of_ctx(q->ctx) != k))
            continue;
        if (q->stream && q->stream != STREAM_PER_THREAD && q->stream != STREAM_GONE) {  /* (the legacy and per-thread streams: only their owners') */
            int st = 0;
            if (ev.capturing(q->stream, &st) != CU_OK || st) {
                captures = 1;
                continue;
            }
            struct pending *p = &q->ring[q->head % QUEUE_RING];
            CUcontext prev;
            if (q->pdl && q->unrecorded && ev.stream_query) {  /* (no event of ours before its next launch) */
                idle[ni++] = (typeof(idle[0])){q, q->stream, q->ctx};
                q->restart = 1;  /* (what it launched since its last event: charged at its mean, at the owed event) */
                continue;
            }
            if (q->unrecorded && q->head - q->tail < QUEUE_RING - 1 && real.ctx_push && real.ctx_push(q->ctx) == CU_OK) {
                if ((p->event || ev.create(&p->event, 0) == CU_OK) && ev.record(p->event, q->stream) == CU_OK) {
                    p->launches = q->unrecorded;
                    q->covered += p->launches;
                    p->recorded = mono_ns();
                    p->upto = q->noted;
                    p->est = q->unrec_est;
                    q->unrec_est = 0;
                    /* (launches made longer ago than a tick: done long since, most likely; what ran from the
                     * last event to this one is mostly the process's host time then, not counted) */
                    p->counted = launch_ns() - q->last_launch <= (int64_t)budget_ns() / 16 && !q->restart;
                    if (q->restart)
                        charge_estimate(q->gpu, (int64_t)q->unrecorded * estimate_per(q));
                    q->unrecorded = 0;
                    q->owed = q->restart = 0;
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
    int done[QUEUE_STREAMS];
    for (int i = 0; i < n; i++)  /* (events recorded outside any capture: legal in relaxed mode) */
        done[i] = event_wait(last[i].event, deadline) == CU_OK;
    for (int i = 0; i < ni; i++)
        stream_idle_wait(idle[i].q, idle[i].stream, idle[i].ctx, deadline);
    pthread_mutex_lock(&queue_lock);
    for (int i = 0; i < n; i++)
        while (done[i] && last[i].q->used && last[i].q->tail - last[i].upto >= 0x80000000u)  /* tail before upto */
            completed(last[i].q, 0);
    pthread_mutex_unlock(&queue_lock);
    return loose;
}

/* Before a launch into `stream` of context `c` on a shared GPU: wait while its queue is over the budget. */
void queue_wait(CUcontext c, void *stream, int ptsz, uint32_t w, uint64_t item)
{
    int64_t budget = budget_ns();
    struct squeue *q = cached_queue(c, stream, ptsz);
    if (q && !over_budget(q, budget, w, item))
        return;  /* (the usual case: no lock) */
    pthread_mutex_lock(&queue_lock);
    q = remember(queue_of(c, stream, ptsz), c, stream, ptsz);
    int checked = 0;
    while (q && over_budget(q, budget, w, item)) {
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
            r = event_wait(e, mono_ns() + CGPU_DRAIN_BOUND_NS);
            done = r == CU_OK ? mono_ns() : 0;
        }
        if (relaxed)
            ev.exchange(&mode);
        pthread_mutex_lock(&queue_lock);
        if (r == 600)  /* not done within the bound: this launch goes (the stream may wait on the host: a value, a
                        * host function, another process); the next one waits again, at most as long (a stream
                        * behind by much work, after a time unbounded, is so brought back within its bound) */
            break;
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
        if (q->restart) {  /* (its run's start was not marked: its launches at the stream's mean) */
            charge_estimate(q->gpu, (int64_t)q->unrecorded * estimate_per(q));
            counted = 0;
            q->restart = 0;
        }
        p->launches = q->unrecorded;
        q->covered += p->launches;
        p->recorded = now;
        p->counted = counted;
        p->upto = q->noted;
        p->est = q->unrec_est;
        q->unrec_est = 0;
        q->unrecorded = 0;
        q->owed = 0;
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
/* (an item noted: its kind, and its estimated time queued) */
static void note_item(struct squeue *q, uint64_t item, uint32_t w)
{
    int64_t est = item_ns(item, (int64_t)w * __atomic_load_n(&q->per_launch, __ATOMIC_RELAXED));
    q->items[__atomic_fetch_add(&q->noted, 1, __ATOMIC_RELAXED) % ITEMS] = item;
    __atomic_add_fetch(&q->unrec_est, est, __ATOMIC_RELAXED);
    __atomic_add_fetch(&q->ahead, est, __ATOMIC_RELAXED);
}

int queue_note(CUcontext c, void *stream, int ptsz, uint32_t w, int pdl, uint64_t item)
{
    struct squeue *q = cached_queue(c, stream, ptsz);
    if (q && pdl && !__atomic_load_n(&q->pdl, __ATOMIC_RELAXED))
        __atomic_store_n(&q->pdl, 1, __ATOMIC_RELAXED);
    if (q) {  /* (the usual case: counted without the lock, until an event is due) */
        note_item(q, item, w);
        int64_t due = __atomic_load_n(&q->due, __ATOMIC_RELAXED);
        if ((int64_t)__atomic_add_fetch(&q->unrecorded, w, __ATOMIC_RELAXED) < due
            && __atomic_load_n(&q->unrec_est, __ATOMIC_RELAXED) < (int64_t)budget_ns() / 16)
            return 1;  /* (an event every `due` launches, or sooner when their items' time reaches a tick) */
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
        q->unrecorded += w;
        note_item(q, item, w);
        if (pdl)
            q->pdl = 1;
    }
    if ((q->unrecorded < due_of(q) && q->unrec_est < (int64_t)budget_ns() / 16) || q->head - q->tail >= QUEUE_RING - 1) {
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
        q->ahead -= q->unrec_est;
        q->unrec_est = 0;
        q->due = due_of(q);
        pthread_mutex_unlock(&queue_lock);
        return 1;
    }
    /* A stream with programmatic dependent launches: the event is owed, recorded before the next launch
     * that is not one (queue_start); unless its launches since the last event reach the budget at its
     * mean as its events measured it (8 events' worth while not known): then here, the bound before the
     * overlap (the wait before a launch has an event to wait for; one overlap lost per budget at most). */
    int64_t per = q->card_per ? q->card_per : q->per_launch;
    int64_t owing = per ? (int64_t)q->unrecorded * per : (int64_t)q->unrecorded * budget_ns() / 8 / due_of(q);
    if (q->pdl && owing < (int64_t)budget_ns())
        q->owed = 1;
    else
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
void queue_start(CUcontext c, void *stream, int ptsz, int pdl)
{
    int64_t now = launch_ns(), tick = (int64_t)budget_ns() / 16, gap = tick + 1;
    struct squeue *q = cached_queue(c, stream, ptsz);
    if (q) {
        gap = now - q->last_launch;
        q->last_launch = now;
        if (gap <= tick && (pdl || !__atomic_load_n(&q->owed, __ATOMIC_RELAXED)))
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
    if (pdl)
        q->pdl = 1;
    if (q->owed && !pdl) {  /* the event owed since the launch before: here, before this one */
        if (gap <= tick) {
            if (q->head - q->tail < QUEUE_RING - 1 && !capturing(stream, ptsz))
                record(q, mono_ns(), 1);
            q->due = due_of(q);
            pthread_mutex_unlock(&queue_lock);
            return;
        }
        q->owed = 0;  /* (after a pause: the stream idled meanwhile, most likely; its launches at its mean) */
        q->restart = 1;
    }
    if (q->head != q->tail) {
        if (!newest_done(q)) {  /* (still running: the run goes on) */
            pthread_mutex_unlock(&queue_lock);
            return;
        }
        while (q->tail != q->head)
            completed(q, 0);
    }
    if (pdl && q->unrecorded) {  /* (a run's start event would sit between it and a launch maybe still running) */
        q->restart = 1;
        pthread_mutex_unlock(&queue_lock);
        return;
    }
    if (q->head - q->tail >= QUEUE_RING - 1 || capturing(stream, ptsz)) {
        pthread_mutex_unlock(&queue_lock);
        return;
    }
    record(q, mono_ns(), 0);  /* (the events' times are CLOCK_MONOTONIC's, as the waits'; restart: record's) */
    pthread_mutex_unlock(&queue_lock);
}

/* The driver's event functions are there (a driver without them: nothing is bounded). */
int queue_ready(void)
{
    return ev.create && ev.record && ev.query && ev.sync && ev.capturing;
}

/* Whether launches on page GPU k (index 1 + k; [0]: the container's gate) were made that no stream's
 * queue counted since the last drain there: made while the queue was not bounded (policy 5), or with
 * no queue left. A flag, set after the launch's driver call, and only where it is clear: the launch
 * path reads a word the drain alone writes (no line shared by the launching threads' writes). A
 * launch that finds it set while a drain takes it is covered by that drain (its work was queued
 * before it looked). */
unsigned long queue_loose[1 + CGPU_MAX_GPUS];  /* (set by queue_untracked, cgpu_compute.h) */

/* Whether any launch no queue counted was made on page GPU k (-1: all), taken. */
unsigned long queue_take_untracked(int k)
{
    unsigned long loose = 0;
    for (int j = k < 0 ? 0 : 1 + k; j <= (k < 0 ? CGPU_MAX_GPUS : 1 + k); j++)
        loose += __atomic_exchange_n(&queue_loose[j], 0, __ATOMIC_SEQ_CST);
    return loose;
}

/* ---- a graph's weight: its nodes (issue 34) ----
 * A graph launch queues all its kernels (and copies, and memsets): it counts as that many launches
 * of the stream's mean, not as one (a mixed graph/eager stream queued hundreds of ms so). Its nodes
 * are counted when it is instantiated (gate.c's wrappers), by executable graph, in a table of
 * GRAPHS entries (open addressing; full: a graph not in it counts as one launch, as before). */
#define GRAPHS 1024
static struct { void *exec; uint32_t nodes; } graphs[GRAPHS];
static pthread_mutex_t graphs_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned graph_slot(const void *exec)
{
    uintptr_t h = (uintptr_t)exec;
    h ^= h >> 17;
    h *= 0x9e3779b97f4a7c15ull;
    return (unsigned)(h >> 40) % GRAPHS;
}

void queue_graph_made(void *exec, uint32_t nodes)
{
    if (!exec)
        return;
    pthread_mutex_lock(&graphs_lock);
    for (unsigned i = graph_slot(exec), n = 0; n < GRAPHS; i = (i + 1) % GRAPHS, n++)
        if (!graphs[i].exec || graphs[i].exec == exec || graphs[i].exec == (void *)1) {
            __atomic_store_n(&graphs[i].nodes, nodes ? nodes : 1, __ATOMIC_RELAXED);
            __atomic_store_n(&graphs[i].exec, exec, __ATOMIC_RELEASE);
            break;
        }
    pthread_mutex_unlock(&graphs_lock);
}

void queue_graph_gone(void *exec)
{
    pthread_mutex_lock(&graphs_lock);
    for (unsigned i = graph_slot(exec), n = 0; n < GRAPHS && graphs[i].exec; i = (i + 1) % GRAPHS, n++)
        if (graphs[i].exec == exec) {
            __atomic_store_n(&graphs[i].exec, (void *)1, __ATOMIC_RELEASE);  /* (a tombstone: the probe goes on past it) */
            break;
        }
    pthread_mutex_unlock(&graphs_lock);
}

/* (read on the launch path without the lock: an entry's nodes are written before its executable) */
uint32_t queue_graph_weight(void *exec)
{
    for (unsigned i = graph_slot(exec), n = 0; n < GRAPHS; i = (i + 1) % GRAPHS, n++) {
        void *e = __atomic_load_n(&graphs[i].exec, __ATOMIC_ACQUIRE);
        if (!e)
            break;
        if (e == exec)
            return __atomic_load_n(&graphs[i].nodes, __ATOMIC_RELAXED);
    }
    return 1;
}

void queue_forget_stream(void *stream)
{
    if (!stream || stream == STREAM_LEGACY || stream == STREAM_PER_THREAD)
        return;
    pthread_mutex_lock(&queue_lock);
    for (int i = 0; i < QUEUE_STREAMS; i++)
        if (queues[i].used && queues[i].stream == stream)
            queues[i].stream = STREAM_GONE;  /* (its events go on being waited for: the context's, alive) */
    pthread_mutex_unlock(&queue_lock);
}

/* (ctx_lock held: gpu_of_ctx) */
void queue_forget_context(CUcontext c)
{
    pthread_mutex_lock(&queue_lock);
    for (int i = 0; i < QUEUE_STREAMS; i++)
        if (queues[i].used && (c ? queues[i].ctx == c : gpu_of_ctx(queues[i].ctx) == -2))
            memset(&queues[i], 0, sizeof queues[i]);  /* (its events: destroyed by the driver with the context) */
    charge_forget_context(c);
    pthread_mutex_unlock(&queue_lock);
}

void queue_forked(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;  /* (a parent's thread may have held one at the fork: issue 45, item 12) */
    queue_lock = fresh;
    graphs_lock = fresh;
    memset(graphs, 0, sizeof graphs);  /* (executable graphs are the parent's context's) */
    memset(queue_loose, 0, sizeof queue_loose);
    memset(queues, 0, sizeof queues);  /* (the parent's streams and events: not the child's) */
    charge_forked();
    my_tid = 0;
    last_q = NULL;
}
