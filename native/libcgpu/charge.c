/*
 * libcgpu, compute: the GPU-time charge (docs/scheduler.md, "The charge: GPU time"). A run of a
 * stream's queued work is bracketed by timing events (queue.c); the GPU time between two of them,
 * once the later is complete, is added to the slot's counter of the run's GPU, which the daemon
 * charges the step by.
 *
 * Merged, not summed (issue 34): streams of one context run at the same time (a pipeline's copy and
 * compute streams, DDP's communication stream beside the compute one), and each stream's runs,
 * bracketed by its own events, span the time the others' work took too: summed, a process with two
 * busy streams was charged about twice the card's time. So each complete event is placed on the
 * card's clock of its context — cuEventElapsedTime from a reference event of that context (an
 * event of ours, taken out of its queue's ring when it completed; renewed once it is a second old,
 * float's 24 bits then still under 0.1 µs) — and a run is charged only the part of its span that no
 * run of the context charged already (the union of the context's runs: a few merged intervals
 * back, a second's worth). Runs whose span is not known (a stream whose timing events could not be
 * placed: queue.c's programmatic dependent launches) are charged an estimate, added as it is.
 * Everything here is called under queue.c's lock.
 */
#include <string.h>

#include "cgpu_compute.h"

#define CHARGE_CTXS 16
#define SPANS 32
#define RENEW_MS 1000.0f
struct ctx_clock {
    CUcontext ctx;
    void *ref;        /* a complete event of the context: its time is base (ms) */
    double base;
    unsigned epoch;   /* a new reference (not a renewal) starts a new epoch: times of another are not comparable */
    int nspans;
    double span[SPANS][2];  /* what was charged, merged and sorted, [start, end) ms */
};
static struct ctx_clock clocks[CHARGE_CTXS];
static unsigned epochs;

static void add_ns(int gpu, int64_t ns)
{
    if (ns > 0 && gpu_time && mine && gpu >= 0 && gpu < CGPU_MAX_GPUS)
        __atomic_add_fetch(&gpu_time->procs[mine - usage->procs].ns[gpu], (uint64_t)ns, __ATOMIC_RELAXED);
}

static struct ctx_clock *clock_of(CUcontext c, int make)
{
    struct ctx_clock *free_at = NULL;
    for (int i = 0; i < CHARGE_CTXS; i++) {
        if (clocks[i].ref && clocks[i].ctx == c)
            return &clocks[i];
        if (!free_at && !clocks[i].ref)
            free_at = &clocks[i];
    }
    return make ? free_at : NULL;
}

static int elapsed(float *ms, void *from, void *to)
{
    int mode = 2, relaxed = ev.exchange && ev.exchange(&mode) == CU_OK;  /* (another thread's global capture) */
    int got = ev.elapsed(ms, from, to) == CU_OK;
    if (relaxed)
        ev.exchange(&mode);
    return got;
}

int charge_time(CUcontext c, void **event, double *at, unsigned *epoch)
{
    if (!ev.elapsed || !event || !*event)
        return 0;
    struct ctx_clock *k = clock_of(c, 1);
    if (!k)
        return 0;
    if (!k->ref) {  /* the context's first: the reference, at 0 */
        memset(k, 0, sizeof *k);
        k->ctx = c;
        k->ref = *event;
        k->epoch = ++epochs;
        *event = NULL;
        *at = 0;
        *epoch = k->epoch;
        return 1;
    }
    float ms = 0;
    if (!elapsed(&ms, k->ref, *event))
        return 0;
    *at = k->base + ms;
    *epoch = k->epoch;
    if (ms > RENEW_MS || ms < -RENEW_MS) {  /* renewed: this one is the reference now, the clock goes on */
        if (ev.destroy)
            ev.destroy(k->ref);
        k->ref = *event;
        k->base = *at;
        *event = NULL;
    }
    return 1;
}

int64_t charge_span(int gpu, CUcontext c, unsigned epoch, double a, double b)
{
    struct ctx_clock *k = clock_of(c, 0);
    if (!k || k->epoch != epoch || !(b > a))
        return 0;
    double fresh = b - a;  /* less what is charged already */
    for (int i = 0; i < k->nspans; i++) {
        double lo = k->span[i][0] > a ? k->span[i][0] : a, hi = k->span[i][1] < b ? k->span[i][1] : b;
        if (hi > lo)
            fresh -= hi - lo;
    }
    /* merged in: [a, b) and every span it touches become one */
    double na = a, nb = b;
    int n = 0;
    double keep[SPANS + 1][2];
    for (int i = 0; i < k->nspans; i++) {
        if (k->span[i][1] < a || k->span[i][0] > b) {
            keep[n][0] = k->span[i][0];
            keep[n++][1] = k->span[i][1];
        } else {
            na = k->span[i][0] < na ? k->span[i][0] : na;
            nb = k->span[i][1] > nb ? k->span[i][1] : nb;
        }
    }
    int at = 0;
    while (at < n && keep[at][0] < na)
        at++;
    memmove(&keep[at + 1], &keep[at], (size_t)(n - at) * sizeof keep[0]);
    keep[at][0] = na;
    keep[at][1] = nb;
    n++;
    int from = n > SPANS ? n - SPANS : 0;  /* (the oldest forgotten past SPANS) */
    double newest = keep[n - 1][1];
    while (from < n - 1 && keep[from][1] < newest - 1000.0)
        from++;  /* (and those over a second old: no run of a stream spans that long between its events) */
    k->nspans = n - from;
    memcpy(k->span, &keep[from], (size_t)k->nspans * sizeof keep[0]);
    int64_t ns = fresh > 0 ? (int64_t)(fresh * 1e6) : 0;  /* (the driver's clock, not the host's) */
    add_ns(gpu, ns);
    return ns;
}

int64_t charge_elapsed(int gpu, void *from, void *to)
{
    float ms = 0;
    if (!ev.elapsed || !from || !to || !elapsed(&ms, from, to) || ms <= 0)
        return 0;
    int64_t ns = (int64_t)((double)ms * 1e6);
    add_ns(gpu, ns);
    return ns;
}

void charge_estimate(int gpu, int64_t ns)
{
    add_ns(gpu, ns);
}

void charge_forget_context(CUcontext c)
{
    for (int i = 0; i < CHARGE_CTXS; i++)
        if (clocks[i].ref && (!c || clocks[i].ctx == c))
            memset(&clocks[i], 0, sizeof clocks[i]);  /* (its events: destroyed by the driver with the context) */
}

void charge_forked(void)
{
    memset(clocks, 0, sizeof clocks);  /* (the parent's events) */
}

void charge_timed(void)
{
    if (!gpu_time || !mine)
        return;
    unsigned k = (unsigned)(mine - usage->procs);
    gpu_time->procs[k].pid = mine->pid;
    __atomic_store_n(&gpu_time->procs[k].timed, 1, __ATOMIC_SEQ_CST);
}
