/*
 * libcgpu, memory: every allocator charges the container's usage page BEFORE the real call (a
 * compare-and-swap loop: racing processes can never pass memsize), allocates, and gives the
 * charge back if the driver fails; every free gives back what its allocation held.
 */
#include <sched.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cgpu_memory.h"

/* ---- what this process holds: a hash table by pointer (or VMM handle), never full -------------
 *
 * Open addressing with linear probing and backward-shift deletion (no tombstones), grown to twice
 * its size at 3/4 full: an allocation and its free cost a hash and a probe or two under one lock,
 * however many are live. It never drops an entry: if it cannot grow (no host memory left), the
 * allocation stays charged until the process ends (never less held than the driver holds). */
static int table_lock;  /* (cgpu_memory.h: mem_lock) */
struct table allocs;
struct table mapped;

static size_t home(const struct table *t, uint64_t key)
{
    return (size_t)(key * 0x9E3779B97F4A7C15ull >> 32) & (t->cap - 1);  /* (Fibonacci hashing: aligned keys spread) */
}

struct entry *table_find(struct table *t, uint64_t key)
{
    if (!t->cap)
        return NULL;
    for (size_t i = home(t, key);; i = (i + 1) & (t->cap - 1)) {
        if (!t->e[i].used)
            return NULL;
        if (t->e[i].key == key)
            return &t->e[i];
    }
}

static struct entry *place(struct table *t, const struct entry *x)
{
    size_t i = home(t, x->key);
    while (t->e[i].used)
        i = (i + 1) & (t->cap - 1);
    t->e[i] = *x;
    t->n++;
    return &t->e[i];
}

/* A new entry for `key` (NULL if the table cannot grow). */
struct entry *table_add(struct table *t, uint64_t key)
{
    if ((t->n + 1) * 4 > t->cap * 3) {
        size_t cap = t->cap ? t->cap * 2 : 1024;
        struct entry *e = calloc(cap, sizeof *e), *old = t->e;
        if (!e)
            return NULL;
        size_t oldcap = t->cap;
        t->e = e;
        t->cap = cap;
        t->n = 0;
        for (size_t i = 0; i < oldcap; i++)
            if (old[i].used)
                place(t, &old[i]);
        free(old);
    }
    struct entry x = {.key = key, .used = 1};
    return place(t, &x);
}

void table_erase(struct table *t, struct entry *x)
{
    size_t i = (size_t)(x - t->e), mask = t->cap - 1;
    t->e[i].used = 0;
    t->n--;
    for (size_t j = (i + 1) & mask; t->e[j].used; j = (j + 1) & mask) {
        size_t h = home(t, t->e[j].key);
        if (((j - h) & mask) >= ((j - i) & mask)) {  /* it may move back into the hole */
            t->e[i] = t->e[j];
            t->e[j].used = 0;
            i = j;
        }
    }
}

void table_drop(struct table *t)
{
    free(t->e);
    memset(t, 0, sizeof *t);
}

/* The headroom kept free on GPU g for the driver's growth between two of the daemon's readings
 * (docs/memory.md): the largest growth seen between two readings in any of the container's
 * processes, at least 1 % of memsize and at most 3 %; none where no watchdog reads NVML for it. */
static uint64_t headroom(int g)
{
    if (!drv || !__atomic_load_n(&drv->watched, __ATOMIC_ACQUIRE))
        return 0;
    uint64_t m = limits->memsize[g], step = __atomic_load_n(&drv->step[g], __ATOMIC_ACQUIRE);
    uint64_t least = m / 100, most = m * 3 / 100;
    return step < least ? least : step > most ? most : step;
}

/* What allocations may fill on GPU g: memsize less the headroom. */
uint64_t room(int g)
{
    uint64_t m = limits->memsize[g], h = headroom(g);
    return m > h ? m - h : 0;
}

/* Reserve `size` on GPU g before the driver is asked: racing processes can never pass memsize together. */
static int reserve(int g, size_t size)
{
    uint64_t cap = room(g), used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
    do {
        if (size > cap || used > cap - size)
            return 0;
    } while (!__atomic_compare_exchange_n(&usage->used[g], &used, used + size, 0, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE));
    return 1;
}

static void refund(int g, size_t size)
{
    __atomic_sub_fetch(&usage->used[g], size, __ATOMIC_ACQ_REL);
}

void mem_lock(void)
{
    while (__atomic_exchange_n(&table_lock, 1, __ATOMIC_ACQUIRE))
        while (__atomic_load_n(&table_lock, __ATOMIC_RELAXED))
            sched_yield();
}

void mem_unlock(void)
{
    __atomic_store_n(&table_lock, 0, __ATOMIC_RELEASE);
}

/* This process's bytes held on GPU g, in its slot: a locked add (a sibling may lower the slot's
 * charge for the driver's own memory at the same time: readings.c). */
static void hold(int g, int64_t delta)
{
    __atomic_add_fetch(&mine->held[g], (uint64_t)delta, __ATOMIC_ACQ_REL);
}

/* Under the lock: what `e` held back to the container, its entry gone. */
/* The card's pages (issue 45, item 14). The driver hands device memory out in 2 MiB pages: an
 * allocation of a page or more takes its size in whole pages; smaller ones are packed together in
 * pages of the process's own on that GPU (its suballocator), so what they take is what they add up
 * to, in whole pages. NVML's per-process figure, and so the watchdog, counts the pages: charging the
 * bytes let processes each holding an odd number of 1 MiB pieces fill memsize's bytes while the card
 * held more (test_racing_processes_never_pass_memsize_together: 202 MiB of a 200 MiB page). So where
 * the watchdog reads the instance (the page marked watched, as the headroom), an allocation is
 * charged what it changes this process's pages by, never less than the card takes; elsewhere
 * (simulated GPUs, the stand-in without a watchdog) nothing judges the pages, and allocations fill
 * memsize to the byte as before. An allocation keeps how it was charged for its free. */
static uint64_t small_held[CGPU_MAX_GPUS];  /* (locked) the bytes of the allocations under a page */

static uint64_t in_pages(uint64_t n)
{
    return (n + MEM_PAGE - 1) / MEM_PAGE * MEM_PAGE;
}

static int by_pages(void)
{
    return drv && __atomic_load_n(&drv->watched, __ATOMIC_ACQUIRE);
}

/* (locked) what an allocation of `size` bytes on GPU g (freed: `sign` < 0) changes the charge by */
static int64_t pages_delta(int g, uint64_t size, int sign, int how)
{
    if (size > (1ull << 62))
        return sign > 0 ? INT64_MAX : 0;  /* (more than any memsize: refused, never charged short) */
    if (how != CHARGE_PAGES)
        return sign > 0 ? (int64_t)size : -(int64_t)size;
    if (size >= MEM_PAGE)
        return sign > 0 ? (int64_t)in_pages(size) : -(int64_t)in_pages(size);
    uint64_t before = in_pages(small_held[g]);
    small_held[g] = sign > 0 ? small_held[g] + size : small_held[g] > size ? small_held[g] - size : 0;
    return (int64_t)in_pages(small_held[g]) - (int64_t)before;
}

void let_go(struct entry *e)
{
    int g = e->gpu;
    uint64_t back = (uint64_t)-pages_delta(g, e->size, -1, (int)e->handle);
    table_erase(&allocs, e);
    hold(g, -(int64_t)back);
    refund(g, back);
}

/* An allocation of `size` bytes: what it takes reserved on the container's account and held in the
 * slot before the driver is asked (as take()), under the lock (the pages of racing threads add up).
 * 0: no room; else how it is charged (CHARGE_BYTES, CHARGE_PAGES), for untake_alloc and commit. */
int take_alloc(int g, size_t size)
{
    int how = by_pages() ? CHARGE_PAGES : CHARGE_BYTES;
    mem_lock();
    int64_t d = pages_delta(g, size, 1, how);
    if (d > 0 && !reserve(g, (size_t)d)) {
        pages_delta(g, size, -1, how);
        mem_unlock();
        return 0;
    }
    hold(g, d);
    mem_unlock();
    return how;
}

/* What take_alloc() held, back (the driver refused). */
void untake_alloc(int g, size_t size, int how)
{
    mem_lock();
    uint64_t back = (uint64_t)-pages_delta(g, size, -1, how);
    hold(g, -(int64_t)back);
    mem_unlock();
    refund(g, back);
}

/* Reserved on the container's account AND held in this process's slot before the driver is asked:
 * the daemon reads the slot just before NVML, so an allocation straddling its reading is in both or
 * in the slot alone (a reading low by it, which the charge ignores once), never charged twice. */
int take(int g, size_t size)
{
    if (!reserve(g, size))
        return 0;
    mem_lock();
    hold(g, (int64_t)size);
    mem_unlock();
    return 1;
}

/* What take() held, back (the driver refused, or took less). */
void untake(int g, size_t size)
{
    mem_lock();
    hold(g, -(int64_t)size);
    mem_unlock();
    refund(g, size);
}

/* `size` more held on GPU g whatever room is left (the driver took it already). */
void force(int g, size_t size)
{
    mem_lock();
    hold(g, (int64_t)size);
    mem_unlock();
    __atomic_add_fetch(&usage->used[g], (uint64_t)size, __ATOMIC_ACQ_REL);
}

/* Before an allocation is refused: what pools gave back since, and what dead processes of the
 * container held (a SIGKILLed sibling's: its slot's liveness lock is gone), back. 1: try again. */
int settle_all(void)
{
    if (pools_settle_hook)
        pools_settle_hook();
    reclaim_dead();
    readings_siblings();  /* (a sleeping sibling's charge a reading lowered: readings.c) */
    return 1;
}

/* The driver gave it (take() held it already): its size is kept for the free. */
void commit(int g, CUdeviceptr key, size_t size, int how)
{
    mem_lock();
    struct entry *e = table_find(&allocs, key);
    if (e)
        let_go(e);  /* (the driver gave the same pointer again: the old one was freed behind our back) */
    e = table_add(&allocs, key);
    if (e) {
        e->size = size;
        e->gpu = g;
        e->refs = 1;
        e->handle = (uint64_t)how;
    }
    mem_unlock();
}

/* Freed: what it held comes back (nothing for a pointer we never saw). A VMM handle's memory
 * comes back at its last release only once it is mapped nowhere (the driver's rule). */
void forget(CUdeviceptr key)
{
    mem_lock();
    struct entry *e = table_find(&allocs, key);
    if (e && --e->refs <= 0 && e->maps <= 0)
        let_go(e);
    mem_unlock();
}

/* ---- the driver's own memory ---------------------------------------------------------------
 *
 * A context, the local memory of its threads and the device heap are memory the driver takes for
 * the process beside its allocations: NVML's per-process view counts them (and the daemon's
 * watchdog fails the process by that view), so they are the container's too. They are found once
 * per process and GPU, at the first allocation or cuMemGetInfo there (a context exists then): what
 * NVML says this process holds less what it holds through us; where NVML cannot tell (no NVML,
 * or the container's PIDs are not the host's NVML names), CGPU_CONTEXT_MIB (default 0: not
 * known). It is charged to the process's slot whatever room is left (the driver took it
 * already): a process that fills what cuMemGetInfo calls free is refused there, never past
 * memsize, and it comes back when the process ends. (HAMi-core charges a per-context figure.) */
static int driver_counted[CGPU_MAX_GPUS];
static pthread_mutex_t driver_lock = PTHREAD_MUTEX_INITIALIZER;


/* ---- growth the driver does on its own, measured (issue 45, items 4, 5, 15) -------------------
 *
 * After a call at which the driver may take memory for the process by itself — a function's code
 * at cuModuleGetFunction (lazy loading), a library's first use at a launch, local memory at
 * cuCtxSetLimit — what it took is measured: the card's free memory (the driver's own cuMemGetInfo,
 * exact at once, where NVML's per-process figure comes late) before and after, less what the
 * process's own account moved meanwhile. It is charged at once where the watchdog reads the
 * instance (the readings settle it, as any growth), and the largest such step on each GPU is kept:
 * the next such call must find that much room within memsize, or it is refused with
 * out-of-memory. So whatever a module's shape, growth nobody foresaw passes memsize by at most one
 * step (within the watchdog's allowance: it tolerates that much for a process that went through
 * libcgpu), and the process's next call fails: never a kill. A launch's growth is measured at the
 * process's next call (the launch itself is the gate's) if it comes within 100 ms, else it is left
 * to the readings. The card's free moves with its other processes too: a neighbour allocating in the
 * window makes a step look larger (charged until the readings settle it; more room kept), freeing
 * makes it look smaller (the readings charge the rest). */
static pthread_mutex_t growth_lock = PTHREAD_MUTEX_INITIALIZER;
static struct growth pending;  /* a launch's, measured at the next call (pending_set) */
static int pending_set;
static uint64_t grow_step[CGPU_MAX_GPUS];
#define PENDING_NS 100000000ull  /* a launch's growth is measured at a call within 100 ms of it, else left to the readings */

static uint64_t card_free(void)
{
    size_t f = 0, t = 0;
    in_driver++;
    CUresult r = real.info ? real.info(&f, &t) : CU_NOT_INITIALIZED;
    in_driver--;
    return r == CU_OK ? f : UINT64_MAX;
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

void growth_begin(int g, struct growth *w)
{
    w->g = g;
    w->at = now_ns();
    w->free = g >= 0 ? card_free() : UINT64_MAX;
    w->held = g >= 0 ? __atomic_load_n(&mine->held[g], __ATOMIC_ACQUIRE) : 0;
}

uint64_t growth_end(struct growth *w, int learn)
{
    int g = w->g;
    if (g < 0 || w->free == UINT64_MAX || current_gpu() != g)
        return 0;  /* (no figure, or another GPU current now: the readings settle it) */
    uint64_t now = card_free(), held = __atomic_load_n(&mine->held[g], __ATOMIC_ACQUIRE);
    if (now == UINT64_MAX || now >= w->free)
        return 0;
    uint64_t card = w->free - now, own = held > w->held ? held - w->held : 0;
    if (card <= own)
        return 0;
    uint64_t grew = card - own;
    if (drv && __atomic_load_n(&drv->watched, __ATOMIC_ACQUIRE))
        charge_driver(g, (int64_t)grew);
    /* (a step kept room for is at most the watchdog's allowance, the larger of 256 MiB and 3 % of
     * memsize: a neighbour's allocation in the window must not make every later first launch fail) */
    uint64_t most = limits->memsize[g] * 3 / 100 > (256ull << 20) ? limits->memsize[g] * 3 / 100 : 256ull << 20;
    pthread_mutex_lock(&growth_lock);
    if (learn && (grew < most ? grew : most) > grow_step[g])
        grow_step[g] = grew < most ? grew : most;
    pthread_mutex_unlock(&growth_lock);
    return grew;
}

/* A launch that may grow, its watch begun: measured at the process's next call. */
void growth_pending(const struct growth *w)
{
    pthread_mutex_lock(&growth_lock);
    pending = *w;
    pending_set = 1;
    pthread_mutex_unlock(&growth_lock);
}

static void growth_settle(void)
{
    if (!__atomic_load_n(&pending_set, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&growth_lock);
    struct growth w = pending;
    int set = pending_set && current_gpu() == w.g;
    if (pending_set && now_ns() - w.at > PENDING_NS)
        pending_set = set = 0;  /* (too long ago: the card's free moved with the neighbours too) */
    if (set)
        pending_set = 0;
    pthread_mutex_unlock(&growth_lock);
    if (set)
        growth_end(&w, 1);
}

uint64_t growth_step(int g)
{
    pthread_mutex_lock(&growth_lock);
    uint64_t s = grow_step[g];
    pthread_mutex_unlock(&growth_lock);
    return s > MEM_PAGE ? s : MEM_PAGE;
}

/* The daemon's newest reading of this process applied (readings.c: a growth, or a shrink none of its
 * siblings applied yet); its context is in the reading on each GPU it names. */
void follow(void)
{
    growth_settle();
    unsigned k = mine ? (unsigned)(mine - usage->procs) : 0;
    if (!mine || !readings_new(k, 1))
        return;
    pthread_mutex_lock(&driver_lock);  /* (not while driver_share reads NVML against the slot) */
    unsigned gpus = readings_apply(k, 1);
    pthread_mutex_unlock(&driver_lock);
    for (int g = 0; g < CGPU_MAX_GPUS; g++)
        if (gpus & (1u << g))
            __atomic_store_n(&driver_counted[g], 1, __ATOMIC_RELEASE);
}

void driver_share(int g)
{
    if (__atomic_load_n(&driver_counted[g], __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&driver_lock);
    if (!driver_counted[g]) {
        uint64_t seen = nvml_process_bytes(g), own = 0;
        uint64_t ours = __atomic_load_n(&mine->held[g], __ATOMIC_ACQUIRE);
        if (seen != UINT64_MAX)
            own = seen > ours ? seen - ours : 0;
        else {
            const char *mib = getenv("CGPU_CONTEXT_MIB");
            own = mib && *mib ? strtoull(mib, NULL, 10) << 20 : 0;
        }
        if (own)
            charge_driver(g, (int64_t)own);
        __atomic_store_n(&driver_counted[g], 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&driver_lock);
}

/* A process's first context on a GPU: NVML's list of processes before and after it, to find
 * which of them is this process (inside a PID namespace NVML names it by the host's PID). A create
 * (`pushed` 1) makes its context current (cuda.h, cuCtxCreate: "Creates a new CUDA context and
 * associates it with the calling thread ... If a context is already current to the thread, it is
 * supplanted by the newly created context"; cuDevicePrimaryCtxRetain: "Unlike cuCtxCreate() the newly
 * retained context is not pushed onto the stack"): the thread's known current context is then what
 * the driver left (contexts.c). */
#define CONTEXT_MADE(dev, pushed, call)                                                 \
    do {                                                                         \
        int g_ = page_index(dev);                                                \
        if (g_ >= 0 && !__atomic_load_n(&driver_counted[g_], __ATOMIC_ACQUIRE)) { \
            pthread_mutex_lock(&driver_lock);                                    \
            nvml_context_before(g_);                                             \
        }                                                                        \
        else                                                                     \
            g_ = -1;                                                             \
        in_driver++;                                                             \
        CUresult r_ = (call);                                                    \
        in_driver--;                                                             \
        if (pushed)                                                              \
            contexts_switched();                                                 \
        if (g_ >= 0) {                                                           \
            if (r_ == CU_OK)                                                     \
                nvml_context_after(g_);                                          \
            pthread_mutex_unlock(&driver_lock);                                  \
        }                                                                        \
        return r_;                                                               \
    } while (0)

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    PASS_THROUGH(real.primary_retain, ctx, dev);
    CONTEXT_MADE(dev, 0, real.primary_retain(ctx, dev));
}

/* (cuCtxCreate: CUDA 2.0's form, cudaTypedefs.h's PFN_cuCtxCreate_v2000, the same arguments) */
CUresult cuCtxCreate(CUcontext *ctx, unsigned flags, CUdevice dev)
{
    static void *real_v1;
    ctx_create2_fn fn = __atomic_load_n(&real_v1, __ATOMIC_ACQUIRE);
    if (!fn && (fn = (ctx_create2_fn)sym("cuCtxCreate")))
        __atomic_store_n(&real_v1, (void *)fn, __ATOMIC_RELEASE);
    PASS_THROUGH(fn, ctx, flags, dev);
    CONTEXT_MADE(dev, 1, fn(ctx, flags, dev));
}

CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev)
{
    PASS_THROUGH(real.ctx_create2, ctx, flags, dev);
    CONTEXT_MADE(dev, 1, real.ctx_create2(ctx, flags, dev));
}

CUresult cuCtxCreate_v3(CUcontext *ctx, void *affinity, int n, unsigned flags, CUdevice dev)
{
    PASS_THROUGH(real.ctx_create3, ctx, affinity, n, flags, dev);
    CONTEXT_MADE(dev, 1, real.ctx_create3(ctx, affinity, n, flags, dev));
}

CUresult cuCtxCreate_v4(CUcontext *ctx, void *params, unsigned flags, CUdevice dev)
{
    PASS_THROUGH(real.ctx_create4, ctx, params, flags, dev);
    CONTEXT_MADE(dev, 1, real.ctx_create4(ctx, params, flags, dev));
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size)
{
    PASS_THROUGH(real.alloc, p, size);
    CHARGED(size, *p, real.alloc(p, size));
}

CUresult cuMemFree_v2(CUdeviceptr p)
{
    PASS_THROUGH(real.free, p);
    RELEASED(p, real.free(p));
}

/* Pitched: the driver picks the pitch; charged for the widest it picks (512-byte rows). */
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height, unsigned elem)
{
    PASS_THROUGH(real.pitch, p, pitch, width, height, elem);
    size_t size = ((width + 511) & ~(size_t)511) * height;
    CHARGED(size, *p, real.pitch(p, pitch, width, height, elem));
}

/* Managed (unified) memory: charged its whole size at the allocation, oversubscription refused (docs/memory.md,
 * "Managed memory": libcgpu sees no page migrate, and a refusal beats the watchdog's kill; SPEC §3). */
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned flags)
{
    PASS_THROUGH(real.managed, p, size, flags);
    CHARGED(size, *p, real.managed(p, size, flags));
}

typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } array_desc;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } array3d_desc;
enum { ARRAY3D_LAYERED = 0x01, ARRAY3D_CUBEMAP = 0x04 };

static size_t format_bytes(int f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    default: return 4;
    }
}

static size_t at_least_1(size_t n)
{
    return n ? n : 1;
}

/* An array's bytes: width x height x depth (0 counts as 1) of `channels` elements of `format`;
 * too large for size_t: SIZE_MAX (more than any memsize: refused, never charged short). */
static size_t array_bytes(size_t w, size_t h, size_t depth, int format, unsigned channels)
{
    size_t n = w, by[] = {at_least_1(h), at_least_1(depth), format_bytes(format), at_least_1(channels)};
    for (size_t i = 0; i < sizeof by / sizeof *by; i++)
        if (__builtin_mul_overflow(n, by[i], &n))
            return SIZE_MAX;
    return n;
}

CUresult cuArrayCreate_v2(CUdeviceptr *h, const array_desc *d)
{
    PASS_THROUGH(real.array, h, d);
    if (!d)
        UNCHARGED(real.array(h, d));
    size_t size = array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels);
    CHARGED(size, *h, real.array(h, d));
}

CUresult cuArray3DCreate_v2(CUdeviceptr *h, const array3d_desc *d)
{
    PASS_THROUGH(real.array3d, h, d);
    if (!d)
        UNCHARGED(real.array3d(h, d));
    size_t size = array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels);
    CHARGED(size, *h, real.array3d(h, d));
}

CUresult cuArrayDestroy(CUdeviceptr h)
{
    PASS_THROUGH(real.array_free, h);
    RELEASED(h, real.array_free(h));
}

/* Every level: each half the one before in every dimension (at least 1), but the depth of a
 * layered or cubemap array is its layers (faces), the same at every level. */
static size_t mipmap_bytes(const array3d_desc *d, unsigned levels)
{
    size_t w = at_least_1(d->Width), h = at_least_1(d->Height), depth = at_least_1(d->Depth), total = 0;
    int layers = (d->Flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP)) != 0;
    for (unsigned l = 0; l < levels; l++) {
        size_t level = array_bytes(w, h, depth, d->Format, d->NumChannels);
        int last = w == 1 && h == 1 && (layers || depth == 1);  /* the levels left are all this one */
        if ((last && __builtin_mul_overflow(level, (size_t)(levels - l), &level))
            || __builtin_add_overflow(total, level, &total))
            return SIZE_MAX;
        if (last)
            break;
        w = at_least_1(w / 2);
        h = at_least_1(h / 2);
        depth = layers ? depth : at_least_1(depth / 2);
    }
    return total;
}

CUresult cuMipmappedArrayCreate(CUdeviceptr *h, const array3d_desc *d, unsigned levels)
{
    PASS_THROUGH(real.mipmap, h, d, levels);
    if (!d)
        UNCHARGED(real.mipmap(h, d, levels));
    size_t size = mipmap_bytes(d, levels);
    CHARGED(size, *h, real.mipmap(h, d, levels));
}

CUresult cuMipmappedArrayDestroy(CUdeviceptr h)
{
    PASS_THROUGH(real.mipmap_free, h);
    RELEASED(h, real.mipmap_free(h));
}

/* `bytes` more of the driver's own may go onto GPU g now: memsize (the headroom included) holds it
 * after the readings so far, what pools gave back and what dead processes held. */
int driver_room(int g, uint64_t bytes)
{
    follow();
    driver_share(g);
    uint64_t used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE), cap = limits->memsize[g];
    if (used <= cap && bytes <= cap - used)
        return 1;
    settle_all();
    used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
    return used <= cap && bytes <= cap - used;
}

CUresult cuMemGetInfo_v2(size_t *free_, size_t *total_)
{
    if (!isolated())
        return asked ? CU_NOT_INITIALIZED : real.info ? real.info(free_, total_) : CU_NOT_INITIALIZED;
    if (!real.info)
        return CU_NOT_INITIALIZED;
    int g = current_gpu();
    size_t f, t;
    CUresult r = real.info(&f, &t);  /* (the driver must answer: a context exists) */
    if (r != CU_OK || g < 0) {  /* (a GPU given whole: as the driver says) */
        if (r == CU_OK)
            *free_ = f, *total_ = t;
        return r;
    }
    if (need_slot()) {
        follow();
        driver_share(g);
        if (pools_settle_hook)
            pools_settle_hook();
        reclaim_dead();  /* (a dead sibling's memory is free again) */
        readings_siblings();  /* (and what readings gave back of a sleeping one's) */
    }
    uint64_t cap = room(g), used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
    *total_ = limits->memsize[g];
    /* Never an error when over; the headroom is not free (what fills "free" leaves the driver room
     * to grow); never the card's free, which says what the neighbours use (an allocation the card
     * cannot hold fails at the driver, as on a full card). */
    *free_ = used >= cap ? 0 : by_pages() ? (cap - used) / MEM_PAGE * MEM_PAGE : cap - used;  /* (pages: what fits) */
    return CU_OK;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!isolated())
        return asked ? CU_NOT_INITIALIZED : real.total ? real.total(bytes, d) : CU_NOT_INITIALIZED;
    CUresult r = real.total(bytes, d);
    int k = page_index(d);
    if (r == CU_OK && k >= 0)
        *bytes = limits->memsize[k];
    return r;
}

static void (*forks[4])(void);  /* the files above's resets in a forked child */
static int nforks;

/* What the parent allocated is the parent's. */
void memory_forked(void)
{
    table_lock = 0;  /* (a thread of the parent may have held it: none runs here) */
    memset(driver_counted, 0, sizeof driver_counted);  /* (a child's contexts are its own) */
    readings_forked();
    memset(small_held, 0, sizeof small_held);
    memset(grow_step, 0, sizeof grow_step);
    pending_set = 0;
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;  /* (a parent's thread may have held one at the fork:
                                                         * a context being made: issue 45, item 12) */
    growth_lock = fresh;
    driver_lock = fresh;
    table_drop(&allocs);
    table_drop(&mapped);
    for (int i = 0; i < nforks; i++)
        forks[i]();
}

/* What the files above hand down at load (pools.c, modules.c): nothing here calls up, no circle. */
int (*pools_settle_hook)(void);
void memory_on_fork(void (*fn)(void))
{
    if (nforks < (int)(sizeof forks / sizeof *forks))
        forks[nforks++] = fn;
}
