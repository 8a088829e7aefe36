/*
 * libcgpu, memory: every allocator charges the container's usage page BEFORE the real call (a
 * compare-and-swap loop: racing processes can never pass memsize), allocates, and gives the
 * charge back if the driver fails; every free gives back what its allocation held.
 */
#include <sched.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>

#include "cgpu_internal.h"

/* ---- what this process holds: a hash table by pointer (or VMM handle), never full -------------
 *
 * Open addressing with linear probing and backward-shift deletion (no tombstones), grown to twice
 * its size at 3/4 full: an allocation and its free cost a hash and a probe or two under one lock,
 * however many are live. It never drops an entry: if it cannot grow (no host memory left), the
 * allocation stays charged until the process ends (never less held than the driver holds). */
struct entry {
    uint64_t key;   /* the pointer, handle or mapped address */
    uint64_t size;
    uint64_t handle; /* a mapping: its handle */
    int32_t gpu;
    int32_t refs;   /* a VMM handle: its references (cuMemCreate's, cuMemRetainAllocationHandle's) */
    int32_t maps;   /* and its mappings */
    int32_t used;
};
struct table { struct entry *e; size_t cap, n; };
static int table_lock;       /* a spin lock: one locked instruction to take, none to leave */
static struct table allocs;  /* what an allocator returned (a VMM handle too) */
static struct table mapped;  /* VMM: a mapped address -> its handle */

static size_t home(const struct table *t, uint64_t key)
{
    return (size_t)(key * 0x9E3779B97F4A7C15ull >> 32) & (t->cap - 1);  /* (Fibonacci hashing: aligned keys spread) */
}

static struct entry *lookup(struct table *t, uint64_t key)
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
static struct entry *add(struct table *t, uint64_t key)
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

static void erase(struct table *t, struct entry *x)
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
static uint64_t room(int g)
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

static void lock(void)
{
    while (__atomic_exchange_n(&table_lock, 1, __ATOMIC_ACQUIRE))
        while (__atomic_load_n(&table_lock, __ATOMIC_RELAXED))
            sched_yield();
}

static void unlock(void)
{
    __atomic_store_n(&table_lock, 0, __ATOMIC_RELEASE);
}

/* Under the lock: this process's bytes held on GPU g, in its slot (only this process writes its
 * slot, and only under the lock: no locked instruction needed; the reader of a dead process's
 * slot reads it once it is dead). */
static void hold(int g, int64_t delta)
{
    uint64_t *h = &mine->held[g];
    __atomic_store_n(h, __atomic_load_n(h, __ATOMIC_RELAXED) + (uint64_t)delta, __ATOMIC_RELEASE);
}

/* Under the lock: what `e` held back to the container, its entry gone. */
static void let_go(struct entry *e)
{
    int g = e->gpu;
    uint64_t size = e->size;
    erase(&allocs, e);
    hold(g, -(int64_t)size);
    refund(g, size);
}

/* Reserved on the container's account AND held in this process's slot before the driver is asked:
 * the daemon reads the slot just before NVML, so an allocation straddling its reading is in both or
 * in the slot alone (a reading low by it, which the charge ignores once), never charged twice. */
static int take(int g, size_t size)
{
    if (!reserve(g, size))
        return 0;
    lock();
    hold(g, (int64_t)size);
    unlock();
    return 1;
}

/* What take() held, back (the driver refused, or took less). */
static void untake(int g, size_t size)
{
    lock();
    hold(g, -(int64_t)size);
    unlock();
    refund(g, size);
}

/* `size` more held on GPU g whatever room is left (the driver took it already). */
static void force(int g, size_t size)
{
    lock();
    hold(g, (int64_t)size);
    unlock();
    __atomic_add_fetch(&usage->used[g], (uint64_t)size, __ATOMIC_ACQ_REL);
}

static int pools_settle_all(void);

/* Before an allocation is refused: what pools gave back since, and what dead processes of the
 * container held (a SIGKILLed sibling's: its slot's liveness lock is gone), back. 1: try again. */
static int settle_all(void)
{
    pools_settle_all();
    reclaim_dead();
    return 1;
}

/* The driver gave it (take() held it already): its size is kept for the free. */
static void commit(int g, CUdeviceptr key, size_t size)
{
    lock();
    struct entry *e = lookup(&allocs, key);
    if (e)
        let_go(e);  /* (the driver gave the same pointer again: the old one was freed behind our back) */
    e = add(&allocs, key);
    if (e) {
        e->size = size;
        e->gpu = g;
        e->refs = 1;
    }
    unlock();
}

/* Freed: what it held comes back (nothing for a pointer we never saw). A VMM handle's memory
 * comes back at its last release only once it is mapped nowhere (the driver's rule). */
static void forget(CUdeviceptr key)
{
    lock();
    struct entry *e = lookup(&allocs, key);
    if (e && --e->refs <= 0 && e->maps <= 0)
        let_go(e);
    unlock();
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

/* This process's record of the driver's readings (NULL: an older cgpud's page). */
static struct cgpu_driver *record(void)
{
    return drv && mine ? &drv->procs[mine - usage->procs] : NULL;
}

/* `delta` more (less) of the driver's own memory charged to this process on GPU g, whatever room is
 * left: the driver took it already. */
static void charge_driver(int g, int64_t delta)
{
    struct cgpu_driver *r = record();
    lock();
    hold(g, delta);
    unlock();
    __atomic_add_fetch(&usage->used[g], (uint64_t)delta, __ATOMIC_ACQ_REL);
    if (r)
        __atomic_add_fetch(&r->driver[g], (uint64_t)delta, __ATOMIC_ACQ_REL);
}

/* ---- the driver's memory as it grows -------------------------------------------------------
 *
 * After its context the driver's memory for a process grows through no call we see (modules
 * loaded at a kernel's first launch, library handles, graph instantiation: +66 and +70 MiB on an
 * H100, issue 28). The daemon's watchdog writes NVML's figure for the process into its record
 * every look, with what the process had allocated through us just before; the driver's own is the
 * difference. It is charged here at the next allocation (or cuMemGetInfo, or module load): the
 * process holds the larger of its own account and NVML's figure plus what it allocated since. Less
 * than before is given back only when two readings in a row say so (a free between the daemon's
 * two reads makes one reading low). The growth between two readings sizes the headroom. */
static uint32_t applied;  /* the seq of the last reading applied */
static uint64_t last_want[CGPU_MAX_GPUS];
static int read_before[CGPU_MAX_GPUS];  /* a reading was applied on GPU g: the next one's growth is a step */

static void follow(void)
{
    struct cgpu_driver *r = record();
    if (!r)
        return;
    uint32_t seq = __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE);
    if (seq == applied || (seq & 1))
        return;
    uint64_t nvml[CGPU_MAX_GPUS], allocs[CGPU_MAX_GPUS];
    int32_t pid = __atomic_load_n(&r->pid, __ATOMIC_ACQUIRE);
    uint64_t claim = idents ? __atomic_load_n(&idents->procs[mine - usage->procs].read_claim, __ATOMIC_ACQUIRE) : 0;
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        nvml[g] = __atomic_load_n(&r->nvml[g], __ATOMIC_ACQUIRE);
        allocs[g] = __atomic_load_n(&r->allocs[g], __ATOMIC_ACQUIRE);
    }
    if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != seq || pid != mine->pid || claim != my_claim())
        return;  /* (being written, or a reading of the slot's previous process: its pid may be this
                  * one's, an exec'd image's or a reused pid's; its claim is not) */
    pthread_mutex_lock(&driver_lock);
    if (seq != applied) {
        applied = seq;
        for (int g = 0; g < (int)limits->ngpus; g++) {
            if (!nvml[g])
                continue;  /* (NVML lists it on no such GPU) */
            uint64_t want = nvml[g] > allocs[g] ? nvml[g] - allocs[g] : 0;
            uint64_t have = __atomic_load_n(&r->driver[g], __ATOMIC_ACQUIRE);
            uint64_t keep = want > last_want[g] ? want : last_want[g];
            last_want[g] = want;
            if (want > have) {
                uint64_t grew = want - have, step = __atomic_load_n(&drv->step[g], __ATOMIC_ACQUIRE);
                charge_driver(g, (int64_t)grew);
                while (read_before[g] && grew > step  /* (the first reading's may be its whole context) */
                       && !__atomic_compare_exchange_n(&drv->step[g], &step, grew, 0, __ATOMIC_ACQ_REL,
                                                       __ATOMIC_ACQUIRE))
                    ;
            } else if (keep < have)
                charge_driver(g, -(int64_t)(have - keep));
            __atomic_store_n(&driver_counted[g], 1, __ATOMIC_RELEASE);  /* (its context is in the reading) */
            read_before[g] = 1;
        }
    }
    pthread_mutex_unlock(&driver_lock);
}

static void driver_share(int g)
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
 * which of them is this process (inside a PID namespace NVML names it by the host's PID). */
#define CONTEXT_MADE(dev, call)                                                 \
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
    CONTEXT_MADE(dev, real.primary_retain(ctx, dev));
}

CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev)
{
    PASS_THROUGH(real.ctx_create2, ctx, flags, dev);
    CONTEXT_MADE(dev, real.ctx_create2(ctx, flags, dev));
}

CUresult cuCtxCreate_v3(CUcontext *ctx, void *affinity, int n, unsigned flags, CUdevice dev)
{
    PASS_THROUGH(real.ctx_create3, ctx, affinity, n, flags, dev);
    CONTEXT_MADE(dev, real.ctx_create3(ctx, affinity, n, flags, dev));
}

CUresult cuCtxCreate_v4(CUcontext *ctx, void *params, unsigned flags, CUdevice dev)
{
    PASS_THROUGH(real.ctx_create4, ctx, params, flags, dev);
    CONTEXT_MADE(dev, real.ctx_create4(ctx, params, flags, dev));
}

/* An allocation of `size` bytes done by `call` (the real driver's), held to memsize on the page's
 * GPU `gpu` (-1: a GPU given whole, not charged). */
#define CHARGED(size, key, call) CHARGED_ON(current_gpu(), size, key, call)
#define CHARGED_ON(gpu, size, key, call)                                                \
    do {                                                                                 \
        int g_ = (gpu);                                                                  \
        if (g_ < 0)                                                                      \
            return (call); /* a GPU given whole: the driver's to hold */                 \
        if (!need_slot())                                                                \
            return CU_OUT_OF_MEMORY;                                                     \
        follow();                                                                        \
        driver_share(g_);                                                                \
        if (!take(g_, (size)) && !(settle_all() && take(g_, (size))))                    \
            return CU_OUT_OF_MEMORY; /* (a pool or a dead process may have given back) */ \
        in_driver++;                                                                     \
        CUresult r_ = (call);                                                            \
        for (int w_ = 0; r_ == CU_OUT_OF_MEMORY && held_elsewhere(w_); w_++)             \
            r_ = (call); /* (the card full inside memsize: page.c, held_elsewhere) */    \
        in_driver--;                                                                     \
        if (r_ != CU_OK) {                                                               \
            untake(g_, (size));                                                          \
            return r_;                                                                   \
        }                                                                                \
        commit(g_, (key), (size));                                                       \
        return CU_OK;                                                                    \
    } while (0)

/* A free done by `call`: what `key` held comes back once the driver has let it go. */
#define RELEASED(key, call)              \
    do {                                 \
        in_driver++;                     \
        CUresult r_ = (call);            \
        in_driver--;                     \
        if (r_ == CU_OK)                 \
            forget(key);                 \
        return r_;                       \
    } while (0)

/* A call that allocates nothing charged here (host memory; a descriptor the driver will refuse). */
#define UNCHARGED(call)         \
    do {                        \
        in_driver++;            \
        CUresult r_ = (call);   \
        in_driver--;            \
        return r_;              \
    } while (0)

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

/* Managed (unified) memory escapes the real product's isolation; here it is counted (SPEC §3). */
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned flags)
{
    PASS_THROUGH(real.managed, p, size, flags);
    CHARGED(size, *p, real.managed(p, size, flags));
}

/* ---- stream-ordered pools: charged by their reservation ---------------------------------------
 *
 * A pool (cuMemAllocAsync's current pool of the stream's device, or a named one) keeps physical
 * memory up to its release threshold after cuMemFreeAsync: RMM sets the threshold to the device's
 * memory and primes the pool with free/2, PyTorch's cudaMallocAsync backend raises it. So a pool is
 * charged by what it reserves (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), not per allocation: an
 * allocation that the pool's unused reservation holds is not charged again; one that needs the pool
 * to grow holds the growth's worst case (its size, in 2 MiB pages) before the call, and is refused
 * with CUDA_ERROR_OUT_OF_MEMORY when that does not fit (never the watchdog's kill); after the call
 * the charge becomes the pool's reservation, whatever the pool did. cuMemFreeAsync refunds nothing
 * the pool keeps; what it gives back at a synchronization or cuMemPoolTrimTo is refunded at the
 * next cuMemGetInfo, pool call, or refused allocation. The GPU charged is the pool's: the one its
 * cuMemPoolCreate named, else the stream's device's (cuStreamGetDevice / cuStreamGetCtx), not the
 * current context's; a pool located on the host is not charged as device memory. */
enum { POOL_ATTR_RESERVED_CURRENT = 5, POOL_ATTR_USED_CURRENT = 7 };
enum { LOC_HOST = 2, LOC_HOST_NUMA = 3 };
#define POOL_PAGE (2ull << 20)
#define NPOOLS 64
static struct {
    CUresult (*get_attr)(void *, int, void *);
    CUresult (*device_pool)(void **, CUdevice);   /* cuDeviceGetMemPool */
    CUresult (*stream_device)(void *, CUdevice *); /* cuStreamGetDevice (CUDA 12.8) */
    CUresult (*stream_ctx)(void *, CUcontext *);   /* cuStreamGetCtx */
    CUresult (*create)(void **, const void *);
    CUresult (*destroy)(void *);
    CUresult (*trim)(void *, size_t);
    CUresult (*is_loaded)(int *, void *);        /* cuFuncIsLoaded (CUDA 12.4) */
    CUresult (*func_module)(void **, void *);    /* cuFuncGetModule (CUDA 11.0) */
    CUresult (*func_count)(unsigned *, void *);  /* cuModuleGetFunctionCount (CUDA 12.4) */
} pd;
static pthread_once_t pd_once = PTHREAD_ONCE_INIT;
static void pd_load(void)
{
    setup_once();  /* (the driver loaded first) */
    pd.get_attr = (CUresult (*)(void *, int, void *))sym("cuMemPoolGetAttribute");
    pd.device_pool = (CUresult (*)(void **, CUdevice))sym("cuDeviceGetMemPool");
    pd.stream_device = (CUresult (*)(void *, CUdevice *))sym("cuStreamGetDevice");
    pd.stream_ctx = (CUresult (*)(void *, CUcontext *))sym("cuStreamGetCtx");
    pd.create = (CUresult (*)(void **, const void *))sym("cuMemPoolCreate");
    pd.destroy = (CUresult (*)(void *))sym("cuMemPoolDestroy");
    pd.trim = (CUresult (*)(void *, size_t))sym("cuMemPoolTrimTo");
    pd.is_loaded = (CUresult (*)(int *, void *))sym("cuFuncIsLoaded");
    pd.func_module = (CUresult (*)(void **, void *))sym("cuFuncGetModule");
    pd.func_count = (CUresult (*)(unsigned *, void *))sym("cuModuleGetFunctionCount");
}

struct pool_rec {
    void *pool;
    int gpu;        /* the page's GPU it is charged on (-1: the host's, or a GPU given whole) */
    int located;    /* its cuMemPoolCreate said where it is */
    uint64_t charged;  /* what its reservation is charged (in this process's slot) */
};
static struct pool_rec pool_recs[NPOOLS];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct table pooled;  /* a pool allocation -> its pool's record (handle: the index) */

/* The device of a stream (the legacy and per-thread ones: the current context's). */
static CUdevice stream_device(void *stream)
{
    CUdevice dev = 0;
    in_driver++;
    if (pd.stream_device && pd.stream_device(stream, &dev) == CU_OK)
        goto done;
    CUcontext ctx;
    if (stream && pd.stream_ctx && real.ctx_push && real.ctx_pop && real.ctx_get_device
        && pd.stream_ctx(stream, &ctx) == CU_OK && real.ctx_push(ctx) == CU_OK) {
        CUcontext was;
        if (real.ctx_get_device(&dev) != CU_OK)
            dev = -1;
        real.ctx_pop(&was);
        if (dev >= 0)
            goto done;
    }
    if (!real.ctx_get_device || real.ctx_get_device(&dev) != CU_OK)
        dev = 0;
done:
    in_driver--;
    return dev;
}

/* (pool_lock held) the record of `pool`, made on GPU g if new; NULL if none is left */
static struct pool_rec *pool_rec(void *pool, int g)
{
    struct pool_rec *free_rec = NULL;
    for (int i = 0; i < NPOOLS; i++) {
        if (pool_recs[i].pool == pool)
            return &pool_recs[i];
        if (!pool_recs[i].pool && !free_rec)
            free_rec = &pool_recs[i];
    }
    if (free_rec)
        *free_rec = (struct pool_rec){.pool = pool, .gpu = g};
    return free_rec;
}

static int pool_attr(void *pool, int attr, uint64_t *v)
{
    in_driver++;
    CUresult r = pd.get_attr ? pd.get_attr(pool, attr, v) : CU_NOT_INITIALIZED;
    in_driver--;
    return r == CU_OK;
}

/* (pool_lock held) the record's charge made what its pool reserves now; a pool gone: all back.
 * 1 when something came back. */
static int settle(struct pool_rec *r)
{
    uint64_t now;
    int back = 0;
    if (!pool_attr(r->pool, POOL_ATTR_RESERVED_CURRENT, &now))
        now = 0;  /* (destroyed) */
    if (r->gpu >= 0 && now < r->charged) {
        untake(r->gpu, r->charged - now);
        back = 1;
    } else if (r->gpu >= 0 && now > r->charged)
        force(r->gpu, now - r->charged);
    r->charged = now;
    return back;
}

/* What every pool gave back since (a synchronization, a trim) refunded; 1 when anything came back. */
static int pools_settle_all(void)
{
    int back = 0;
    if (!pd.get_attr)
        return 0;
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < NPOOLS; i++)
        if (pool_recs[i].pool && pool_recs[i].charged)
            back |= settle(&pool_recs[i]);
    pthread_mutex_unlock(&pool_lock);
    return back;
}

enum { ASYNC, ASYNC_PTSZ, FROM_POOL, FROM_POOL_PTSZ };
static CUresult alloc_call(int how, CUdeviceptr *p, size_t size, void *pool, void *stream)
{
    in_driver++;
    CUresult r = how == ASYNC ? real.alloc_async(p, size, stream)
               : how == ASYNC_PTSZ ? real.alloc_async_ptsz(p, size, stream)
               : how == FROM_POOL ? real.pool_alloc(p, size, pool, stream)
               : real.pool_alloc_ptsz(p, size, pool, stream);
    in_driver--;
    return r;
}

static CUresult pooled_alloc(int how, CUdeviceptr *p, size_t size, void *pool, void *stream)
{
    pthread_once(&pd_once, pd_load);
    CUdevice dev = stream_device(stream);
    int sg = page_index(dev);
    if (!pool && pd.device_pool) {
        in_driver++;
        if (pd.device_pool(&pool, dev) != CU_OK)
            pool = NULL;
        in_driver--;
    }
    if (!pool || !pd.get_attr) {  /* (a driver without pools' attributes: charged per allocation) */
        if (how == ASYNC || how == ASYNC_PTSZ) {
            if (how == ASYNC)
                CHARGED_ON(sg, size, *p, real.alloc_async(p, size, stream));
            CHARGED_ON(sg, size, *p, real.alloc_async_ptsz(p, size, stream));
        }
        if (how == FROM_POOL)
            CHARGED_ON(sg, size, *p, real.pool_alloc(p, size, pool, stream));
        CHARGED_ON(sg, size, *p, real.pool_alloc_ptsz(p, size, pool, stream));
    }
    if (sg >= 0 && !need_slot())
        return CU_OUT_OF_MEMORY;
    if (sg >= 0) {
        follow();
        driver_share(sg);
    }
    pthread_mutex_lock(&pool_lock);
    struct pool_rec *r = pool_rec(pool, sg);
    int g = r ? r->gpu : sg;
    if (g < 0) {  /* (the host's pool, or a GPU given whole) */
        pthread_mutex_unlock(&pool_lock);
        return alloc_call(how, p, size, pool, stream);
    }
    uint64_t reserved = 0, used = 0, want = 0;
    if (r)
        settle(r);
    if (pool_attr(pool, POOL_ATTR_RESERVED_CURRENT, &reserved) && pool_attr(pool, POOL_ATTR_USED_CURRENT, &used)
        && reserved >= used && size <= reserved - used)
        want = 0;  /* (its unused reservation holds it: charged already) */
    else
        want = (size + POOL_PAGE - 1) / POOL_PAGE * POOL_PAGE;  /* (the most it may grow by) */
    if (want && !take(g, want)) {
        pthread_mutex_unlock(&pool_lock);
        settle_all();
        pthread_mutex_lock(&pool_lock);
        if (!take(g, want)) {
            pthread_mutex_unlock(&pool_lock);
            return CU_OUT_OF_MEMORY;
        }
    }
    CUresult res = alloc_call(how, p, size, pool, stream);
    if (res != CU_OK) {
        if (want)
            untake(g, want);
        pthread_mutex_unlock(&pool_lock);
        return res;
    }
    if (!r) {  /* (no record left: charged per allocation, forgotten at its free) */
        commit(g, *p, want);
        pthread_mutex_unlock(&pool_lock);
        return CU_OK;
    }
    uint64_t now = reserved;
    if (!pool_attr(pool, POOL_ATTR_RESERVED_CURRENT, &now))
        now = r->charged + want;
    uint64_t grew = now > r->charged ? now - r->charged : 0;
    if (grew > want)
        force(g, grew - want);  /* (the driver grew it past the worst case: it took it) */
    else if (grew < want)
        untake(g, want - grew);
    r->charged = now < r->charged ? r->charged : now;  /* (less: refunded by the next settle) */
    lock();
    struct entry *e = lookup(&pooled, *p);
    if (!e)
        e = add(&pooled, *p);
    if (e) {
        e->handle = (uint64_t)(r - pool_recs);
        e->gpu = g;
    }
    unlock();
    pthread_mutex_unlock(&pool_lock);
    return CU_OK;
}

/* A stream-ordered free: a pool's allocation goes back to its pool, which keeps it (nothing
 * refunded but what the pool's reservation lost); any other, as before. */
static CUresult pooled_free(CUdeviceptr p, void *stream, int ptsz)
{
    pthread_once(&pd_once, pd_load);
    in_driver++;
    CUresult r = ptsz ? real.free_async_ptsz(p, stream) : real.free_async(p, stream);
    in_driver--;
    if (r != CU_OK)
        return r;
    pthread_mutex_lock(&pool_lock);
    lock();
    struct entry *e = lookup(&pooled, p);
    int k = e ? (int)e->handle : -1;
    if (e)
        erase(&pooled, e);
    unlock();
    if (k >= 0 && pool_recs[k].pool)
        settle(&pool_recs[k]);
    pthread_mutex_unlock(&pool_lock);
    if (k < 0)
        forget(p);
    return r;
}

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, void *stream)
{
    PASS_THROUGH(real.alloc_async, p, size, stream);
    return pooled_alloc(ASYNC, p, size, NULL, stream);
}

CUresult cuMemFreeAsync(CUdeviceptr p, void *stream)
{
    PASS_THROUGH(real.free_async, p, stream);
    return pooled_free(p, stream, 0);
}

/* The per-thread-default-stream forms (_ptsz): the same, on the driver's own form. */
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t size, void *stream)
{
    PASS_THROUGH(real.alloc_async_ptsz, p, size, stream);
    return pooled_alloc(ASYNC_PTSZ, p, size, NULL, stream);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *stream)
{
    PASS_THROUGH(real.free_async_ptsz, p, stream);
    return pooled_free(p, stream, 1);
}

/* From a named pool (CUmemoryPool), stream-ordered: freed by cuMemFreeAsync. */
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t size, void *pool, void *stream)
{
    PASS_THROUGH(real.pool_alloc, p, size, pool, stream);
    return pooled_alloc(FROM_POOL, p, size, pool, stream);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t size, void *pool, void *stream)
{
    PASS_THROUGH(real.pool_alloc_ptsz, p, size, pool, stream);
    return pooled_alloc(FROM_POOL_PTSZ, p, size, pool, stream);
}

/* A pool made: where its memory is (the host's is not charged as device memory). */
typedef struct { int allocType, handleTypes; struct { int type, id; } location; } pool_props;
CUresult cuMemPoolCreate(void **pool, const pool_props *props)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.create, pool, props);
    in_driver++;
    CUresult r = pd.create(pool, props);
    in_driver--;
    if (r != CU_OK || !pool || !props)
        return r;
    int host = props->location.type == LOC_HOST || props->location.type == LOC_HOST_NUMA;
    pthread_mutex_lock(&pool_lock);
    struct pool_rec *rec = pool_rec(*pool, -1);
    if (rec) {
        if (rec->charged && rec->gpu >= 0)
            untake(rec->gpu, rec->charged);  /* (a handle reused: the old pool's record) */
        *rec = (struct pool_rec){.pool = *pool, .gpu = host ? -1 : page_index(props->location.id), .located = 1};
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

/* A pool destroyed, or trimmed: what it gave back comes back. */
CUresult cuMemPoolDestroy(void *pool)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.destroy, pool);
    in_driver++;
    CUresult r = pd.destroy(pool);
    in_driver--;
    if (r != CU_OK)
        return r;
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < NPOOLS; i++)
        if (pool_recs[i].pool == pool) {
            settle(&pool_recs[i]);
            if (!pool_recs[i].charged)
                pool_recs[i].pool = NULL;
        }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

CUresult cuMemPoolTrimTo(void *pool, size_t keep)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.trim, pool, keep);
    in_driver++;
    CUresult r = pd.trim(pool, keep);
    in_driver--;
    pools_settle_all();
    return r;
}

/* cuda.h's CUmemAllocationProp, as far as it is read: where the memory is. (CUDA 13 puts
 * `localized` {deviceId, localityDomainId} in a union with location.id: same bytes.) */
typedef struct {
    int type, requestedHandleTypes;
    struct { int type, id; } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} mem_prop;
enum { LOC_DEVICE = 1, LOC_DEVICE_LOCALITY_DOMAIN = 6 };

/* Virtual memory management: the physical memory is made here, keyed by its handle (cuMemMap
 * only maps it); device memory is charged, host memory (HOST, HOST_NUMA) is not. */
CUresult cuMemCreate(CUdeviceptr *handle, size_t size, const mem_prop *prop, unsigned long long flags)
{
    PASS_THROUGH(real.mem_create, handle, size, prop, flags);
    if (!prop || (prop->location.type != LOC_DEVICE && prop->location.type != LOC_DEVICE_LOCALITY_DOMAIN))
        UNCHARGED(real.mem_create(handle, size, prop, flags));
    if (prop->location.type == LOC_DEVICE)  /* on the device it names, whichever context is current */
        CHARGED_ON(page_index(prop->location.id),
                   size, *handle, real.mem_create(handle, size, prop, flags));
    CHARGED(size, *handle, real.mem_create(handle, size, prop, flags));
}

CUresult cuMemRelease(CUdeviceptr handle)
{
    PASS_THROUGH(real.mem_release, handle);
    RELEASED(handle, real.mem_release(handle));
}

/* Mapped: the handle's memory lives on until its last unmap, whenever it is released. */
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUdeviceptr handle, unsigned long long flags)
{
    PASS_THROUGH(real.mem_map, va, size, offset, handle, flags);
    in_driver++;
    CUresult r = real.mem_map(va, size, offset, handle, flags);
    in_driver--;
    if (r != CU_OK)
        return r;
    lock();
    struct entry *h = lookup(&allocs, handle), *m;
    if (h && (m = add(&mapped, va))) {  /* (a handle we did not charge: another process's, imported) */
        m->size = size;
        m->handle = handle;
        h->maps++;
    }
    unlock();
    return r;
}

/* Unmapped: [va, va + size) is whole mappings, one after the other; a handle released and mapped
 * nowhere any more is freed by the driver now, and comes back. */
CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    PASS_THROUGH(real.mem_unmap, va, size);
    in_driver++;
    CUresult r = real.mem_unmap(va, size);
    in_driver--;
    if (r != CU_OK)
        return r;
    lock();
    struct entry *m;
    for (CUdeviceptr at = va; at - va < size && (m = lookup(&mapped, at));) {
        uint64_t handle = m->handle;
        at += m->size ? m->size : size;
        erase(&mapped, m);
        struct entry *h = lookup(&allocs, handle);
        if (h && --h->maps <= 0 && h->refs <= 0)
            let_go(h);
    }
    unlock();
    return r;
}

/* One more reference to a mapped handle: it needs its own cuMemRelease. */
CUresult cuMemRetainAllocationHandle(CUdeviceptr *handle, void *addr)
{
    PASS_THROUGH(real.mem_retain, handle, addr);
    in_driver++;
    CUresult r = real.mem_retain(handle, addr);
    in_driver--;
    if (r != CU_OK || !handle)
        return r;
    lock();
    struct entry *h = lookup(&allocs, *handle);
    if (h)
        h->refs++;
    unlock();
    return r;
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

/* ---- modules and libraries -----------------------------------------------------------------
 *
 * Their code goes to the card (at the load, or at a kernel's first launch with lazy loading): the
 * driver's own memory, which the readings charge once NVML shows it. A load that would take the
 * container past memsize is refused here: CUDA_ERROR_OUT_OF_MEMORY, nothing loaded. Its size is
 * the image's: a fat binary's header says it (the runtime's wrapper points at one), an ELF cubin
 * ends with its section headers, PTX is text; a file, its length. */
static size_t image_bytes(const void *image)
{
    const unsigned char *p = image;
    uint32_t magic;
    if (!p)
        return 0;
    if (strnlen(image, 4) < 4)
        return strlen(image);  /* (not 4 bytes of header: a short text, read no further) */
    memcpy(&magic, p, 4);
    if (magic == 0x466243b1u) {  /* __fatBinC_Wrapper_t {magic, version, data, ...} */
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        return data ? image_bytes(data) : 0;
    }
    if (magic == 0xba55ed50u) {  /* fatbinary_section.h: {magic, version u16, header_size u16, size u64} */
        uint16_t head;
        uint64_t size;
        memcpy(&head, p + 6, 2);
        memcpy(&size, p + 8, 8);
        return head + size;
    }
    if (!memcmp(p, "\177ELF", 4) && p[4] == 2) {  /* ELF64: e_shoff (40), e_shentsize (58), e_shnum (60) */
        uint64_t shoff;
        uint16_t entsize, num;
        memcpy(&shoff, p + 40, 8);
        memcpy(&entsize, p + 58, 2);
        memcpy(&num, p + 60, 2);
        return shoff + (size_t)entsize * num;
    }
    return strnlen(image, 64 << 20);  /* PTX */
}

static size_t file_bytes(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 ? (size_t)st.st_size : 0;
}

/* May `size` bytes of the driver's own go to the current GPU now? (Not charged: the readings do.) */
static int loadable(size_t size)
{
    int g = current_gpu();
    if (g < 0)
        return 1;  /* (a GPU given whole) */
    if (!need_slot())
        return 0;
    follow();
    driver_share(g);
    uint64_t used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE), m = limits->memsize[g];
    return used <= m && size <= m - used;
}

static struct table module_bytes;  /* a module loaded through us -> its image's bytes */
static void loaded_module(void *m, size_t size)
{
    lock();
    struct entry *e = m ? lookup(&module_bytes, (uint64_t)(uintptr_t)m) : NULL;
    if (m && !e)
        e = add(&module_bytes, (uint64_t)(uintptr_t)m);
    if (e) {
        e->size = size;
        e->maps = 0;  /* (none of its functions launched yet: a library's first use is to come) */
    }
    unlock();
}

#define LOADED(size, out, call)                    \
    do {                                           \
        size_t n_ = (size);                        \
        if (!loadable(n_))                         \
            return CU_OUT_OF_MEMORY;               \
        in_driver++;                               \
        CUresult r_ = (call);                      \
        in_driver--;                               \
        if (r_ == CU_OK && (out))                  \
            loaded_module(*(out), n_);             \
        return r_;                                 \
    } while (0)

CUresult cuModuleLoad(void **m, const char *path)
{
    PASS_THROUGH(real.module_load, m, path);
    LOADED(file_bytes(path), m, real.module_load(m, path));
}

CUresult cuModuleLoadData(void **m, const void *image)
{
    PASS_THROUGH(real.module_load_data, m, image);
    LOADED(image_bytes(image), m, real.module_load_data(m, image));
}

CUresult cuModuleLoadDataEx(void **m, const void *image, unsigned n, void *options, void **values)
{
    PASS_THROUGH(real.module_load_data_ex, m, image, n, options, values);
    LOADED(image_bytes(image), m, real.module_load_data_ex(m, image, n, options, values));
}

CUresult cuModuleLoadFatBinary(void **m, const void *image)
{
    PASS_THROUGH(real.module_load_fatbin, m, image);
    LOADED(image_bytes(image), m, real.module_load_fatbin(m, image));
}

CUresult cuLibraryLoadData(void **l, const void *code, void *jit, void **jit_values, unsigned njit, void *options,
                           void **values, unsigned n)
{
    PASS_THROUGH(real.library_load_data, l, code, jit, jit_values, njit, options, values, n);
    LOADED(image_bytes(code), l, real.library_load_data(l, code, jit, jit_values, njit, options, values, n));
}

CUresult cuLibraryLoadFromFile(void **l, const char *path, void *jit, void **jit_values, unsigned njit, void *options,
                               void **values, unsigned n)
{
    PASS_THROUGH(real.library_load_file, l, path, jit, jit_values, njit, options, values, n);
    LOADED(file_bytes(path), l, real.library_load_file(l, (const void *)path, jit, jit_values, njit, options, values, n));
}

/* ---- a launch's lazy load (issue 34, item 7) ---------------------------------------------------
 *
 * With lazy loading (CUDA 12.2's default) a function's code goes onto the card at its first launch:
 * the driver's own memory, tens of MiB at a library's first use. A process that filled its instance
 * and then launches new code would take NVML's figure past memsize before any reading charges it
 * (and be killed by the watchdog). So a launch of a function not known loaded (cuFuncIsLoaded; else
 * its first launch through us) must find room for its code on the instance's GPU — its share of its
 * module's image (the image over the module's functions, in 2 MiB pages, at least one page) within
 * memsize, the headroom included — or it is answered CUDA_ERROR_OUT_OF_MEMORY, as the real driver
 * answers a lazy load that does not fit, and nothing is launched. Where the daemon's watchdog reads
 * NVML for the instance, that much is charged at once as the driver's own (the next readings settle
 * it to what the driver really took).
 *
 * A library's first use takes more than its code: the first launch of any function of a module of
 * a library's size (CGPU_LIBRARY_FUNCTIONS functions or more, default 8: cuBLAS, cuDNN, cuFFT,
 * NCCL) is foreseen CGPU_FIRST_USE_MIB more (default 64: the H100 grew 66 MiB at cuBLAS's first
 * matmul, its kernel's code one 2 MiB page of it), for its handles, tables and workspaces. */
static struct table loaded_fns;  /* functions known on the card */

static uint64_t env_count(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    char *end;
    unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
    return v && *v && !*end ? (uint64_t)n : dflt;
}

static void loaded_fn(void *f)
{
    lock();
    if (!lookup(&loaded_fns, (uint64_t)(uintptr_t)f))
        add(&loaded_fns, (uint64_t)(uintptr_t)f);
    unlock();
}

/* A function of module m was launched through us: its library's first use is behind it. */
static void module_used(void *m)
{
    if (!m)
        return;
    lock();
    struct entry *e = lookup(&module_bytes, (uint64_t)(uintptr_t)m);
    if (!e)
        e = add(&module_bytes, (uint64_t)(uintptr_t)m);
    if (e)
        e->maps = 1;
    unlock();
}

CUresult lazy_room(void *f)
{
    if (in_driver || !f || !isolated())
        return CU_OK;  /* (not isolated: the launch's own wrapper decides) */
    lock();
    int known = lookup(&loaded_fns, (uint64_t)(uintptr_t)f) != NULL;
    unlock();
    if (__builtin_expect(known, 1))
        return CU_OK;
    pthread_once(&pd_once, pd_load);
    int state = 0;
    uint64_t bytes = POOL_PAGE;
    void *m = NULL, *first = NULL;  /* first: a library's module whose first use this launch is */
    unsigned n = 0;
    in_driver++;
    if (pd.is_loaded && pd.is_loaded(&state, f) == CU_OK && state == 1)
        bytes = 0;  /* (CU_FUNCTION_LOADING_STATE_LOADED: on the card already) */
    else if (pd.func_module && pd.func_count && pd.func_module(&m, f) == CU_OK && m
             && pd.func_count(&n, m) == CU_OK && n) {
        lock();
        struct entry *e = lookup(&module_bytes, (uint64_t)(uintptr_t)m);
        uint64_t image = e ? e->size : 0;
        int used = e && e->maps;
        unlock();
        uint64_t share = (image / n + POOL_PAGE - 1) / POOL_PAGE * POOL_PAGE;
        bytes = share > bytes ? share : bytes;
        if (!used && n >= env_count("CGPU_LIBRARY_FUNCTIONS", 8)) {
            bytes += env_count("CGPU_FIRST_USE_MIB", 64) << 20;
            first = m;
        }
    }
    in_driver--;
    int g = current_gpu();
    if (!bytes || g < 0 || !need_slot()) {
        loaded_fn(f);
        module_used(first);
        return CU_OK;
    }
    follow();
    driver_share(g);
    uint64_t used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE), cap = limits->memsize[g];
    if (used > cap || bytes > cap - used) {
        settle_all();
        used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
        if (used > cap || bytes > cap - used)
            return CU_OUT_OF_MEMORY;
    }
    if (drv && __atomic_load_n(&drv->watched, __ATOMIC_ACQUIRE))
        charge_driver(g, (int64_t)bytes);
    loaded_fn(f);
    module_used(first);
    return CU_OK;
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
        pools_settle_all();
        reclaim_dead();  /* (a dead sibling's memory is free again) */
    }
    uint64_t cap = room(g), used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
    *total_ = limits->memsize[g];
    /* Never an error when over; the headroom is not free (what fills "free" leaves the driver room
     * to grow); never the card's free, which says what the neighbours use (an allocation the card
     * cannot hold fails at the driver, as on a full card). */
    *free_ = used >= cap ? 0 : cap - used;
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

/* What the parent allocated is the parent's. */
void memory_forked(void)
{
    table_lock = 0;  /* (a thread of the parent may have held it: none runs here) */
    memset(driver_counted, 0, sizeof driver_counted);  /* (a child's contexts are its own) */
    applied = 0;
    memset(last_want, 0, sizeof last_want);
    memset(read_before, 0, sizeof read_before);
    free(allocs.e);
    free(mapped.e);
    free(pooled.e);
    free(loaded_fns.e);
    free(module_bytes.e);
    memset(&loaded_fns, 0, sizeof loaded_fns);
    memset(&module_bytes, 0, sizeof module_bytes);
    memset(&allocs, 0, sizeof allocs);
    memset(&mapped, 0, sizeof mapped);
    memset(&pooled, 0, sizeof pooled);
    memset(pool_recs, 0, sizeof pool_recs);  /* (the parent's pools) */
    pthread_mutex_init(&pool_lock, NULL);
}
