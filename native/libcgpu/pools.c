/*
 * libcgpu, memory: stream-ordered pools, charged by their reservation (cgpu_memory.h).
 */
#include <string.h>

#include "cgpu_memory.h"

/* ---- stream-ordered pools: charged by their reservation ---------------------------------------
 *
 * A pool (cuMemAllocAsync's current pool of the stream's device, or a named one) keeps physical
 * memory up to its release threshold after cuMemFreeAsync: RMM sets the threshold to the device's
 * memory and primes the pool with free/2, PyTorch's cudaMallocAsync backend raises it. So a pool is
 * charged by what it reserves (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), not per allocation: every
 * allocation holds the growth's worst case (its size, in 2 MiB pages) before the call, however much
 * the pool holds unused (a pool fragments, and frees pending on other streams are not reusable yet:
 * "size <= reserved - used" let a fragmented pool grow to 1.25 x memsize, issue 45 item 3); when
 * that does not fit, the pool first gives back what it holds unused (cuMemPoolTrimTo), then the
 * request is refused with CUDA_ERROR_OUT_OF_MEMORY (never the watchdog's kill); after the call the
 * charge becomes the pool's reservation, whatever the pool did (a reuse: nothing more). cuMemFreeAsync refunds nothing
 * the pool keeps; what it gives back at a synchronization or cuMemPoolTrimTo is refunded at the
 * next cuMemGetInfo, pool call, or refused allocation. The GPU charged is the pool's: the one its
 * cuMemPoolCreate named, else the stream's device's (cuStreamGetDevice / cuStreamGetCtx), not the
 * current context's; a pool located on the host is not charged as device memory. */
enum { POOL_ATTR_RESERVED_CURRENT = 5, POOL_ATTR_USED_CURRENT = 7 };
enum { LOC_HOST = 2, LOC_HOST_NUMA = 3 };
#define NPOOLS 64
static struct {
    CUresult (*get_attr)(void *, int, void *);
    CUresult (*device_pool)(void **, CUdevice);   /* cuDeviceGetMemPool */
    CUresult (*stream_device)(void *, CUdevice *); /* cuStreamGetDevice (CUDA 12.8) */
    CUresult (*stream_ctx)(void *, CUcontext *);   /* cuStreamGetCtx */
    CUresult (*create)(void **, const void *);
    CUresult (*destroy)(void *);
    CUresult (*trim)(void *, size_t);
    CUresult (*stream_sync)(void *);       /* cuStreamSynchronize */
    CUresult (*stream_sync_ptsz)(void *);  /* its per-thread-default-stream form */
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
    pd.stream_sync = (CUresult (*)(void *))sym("cuStreamSynchronize");
    pd.stream_sync_ptsz = (CUresult (*)(void *))sym("cuStreamSynchronize_ptsz");
}

struct pool_rec {
    void *pool;
    int gpu;        /* the page's GPU it is charged on (-1: the host's, or a GPU given whole) */
    int located;    /* its cuMemPoolCreate said where it is */
    uint64_t charged;  /* what its reservation is charged (in this process's slot) */
};
static struct pool_rec pool_recs[NPOOLS];
static int any_pool;  /* a pool was ever charged here (synchronizations then settle them) */
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
    if (free_rec) {
        *free_rec = (struct pool_rec){.pool = pool, .gpu = g};
        __atomic_store_n(&any_pool, 1, __ATOMIC_RELEASE);
    }
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

/* ---- synchronizations (issue 45, item 7) ------------------------------------------------------
 *
 * A pool gives back what it keeps above its release threshold at a synchronization: "the allocator
 * will try to release memory back to the OS on the next call to stream, event or context
 * synchronize" (CUDA Programming Guide, Stream Ordered Memory Allocator, physical page caching).
 * It is refunded there, so the container's other processes see it at once: before, it came back
 * only at this process's next memory call, and a sibling meanwhile got a false out-of-memory and a
 * low cuMemGetInfo. */
static CUresult synced(CUresult r)
{
    if (r == CU_OK && __atomic_load_n(&any_pool, __ATOMIC_ACQUIRE))
        pools_settle_all();
    return r;
}

#define SYNCED(fn, ...)                          \
    do {                                         \
        in_driver++;                             \
        CUresult r_ = (fn)(__VA_ARGS__);         \
        in_driver--;                             \
        return synced(r_);                       \
    } while (0)

CUresult cuStreamSynchronize(void *stream)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.stream_sync, stream);
    SYNCED(pd.stream_sync, stream);
}

CUresult cuStreamSynchronize_ptsz(void *stream)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.stream_sync_ptsz, stream);
    SYNCED(pd.stream_sync_ptsz, stream);
}

CUresult cuCtxSynchronize(void)
{
    PASS_THROUGH(real.ctx_sync);
    SYNCED(real.ctx_sync);
}

CUresult cuEventSynchronize(void *event)
{
    PASS_THROUGH(ev.sync, event);
    SYNCED(ev.sync, event);
}

/* (pool_lock held) The pool's unused memory back to the card, as much as `want` more on GPU g needs
 * (cuMemPoolTrimTo), its charge settled: 1 when something came back. What the pool keeps unused is
 * its to reuse, but only the driver knows whether a request fits in it: a pool fragments, and
 * memory freed on another stream may not be reusable yet. So a request is held its worst case, and
 * before one is refused the pool gives back what it does not use (what the driver itself would
 * never do: it grows instead, past memsize). */
static int trim_for(void *pool, struct pool_rec *r, int g, uint64_t want)
{
    uint64_t reserved = 0, used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE), cap = room(g);
    if (!r || !pd.trim || !pool_attr(pool, POOL_ATTR_RESERVED_CURRENT, &reserved))
        return 0;
    uint64_t short_by = used > cap ? want + (used - cap) : want > cap - used ? want - (cap - used) : 0;
    in_driver++;
    CUresult t = pd.trim(pool, reserved > short_by ? reserved - short_by : 0);
    in_driver--;
    return t == CU_OK && settle(r);
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
    if (graph_capturing(stream, how == ASYNC_PTSZ || how == FROM_POOL_PTSZ))
        return alloc_call(how, p, size, pool, stream);  /* (a graph's allocation node: charged at its instantiation) */
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
    uint64_t want = (size + MEM_PAGE - 1) / MEM_PAGE * MEM_PAGE;  /* (the most it may grow by) */
    if (r)
        settle(r);
    if (!take(g, want)) {
        pthread_mutex_unlock(&pool_lock);
        settle_all();
        pthread_mutex_lock(&pool_lock);
        if (!take(g, want) && !(trim_for(pool, r, g, want) && take(g, want))) {
            pthread_mutex_unlock(&pool_lock);
            return CU_OUT_OF_MEMORY;
        }
    }
    /* The driver's call without the lock (issue 45, item 10: a cudaMallocAsync that waits in the
     * driver, for its pool to grow, held up every other thread's): the worst case is held already
     * (take: an atomic reservation on the page), so what the pool is charged is settled after the
     * call. Two calls in flight on one pool: the first to settle charges the pool's reservation,
     * which may hold the other's growth while its worst case is still held (more held for a moment,
     * never less); the other's settling then finds nothing grown and gives its worst case back. */
    pthread_mutex_unlock(&pool_lock);
    CUresult res = alloc_call(how, p, size, pool, stream);
    pthread_mutex_lock(&pool_lock);
    if (r && r->pool != pool)
        r = NULL;  /* (the pool destroyed meanwhile, its record another's: charged per allocation) */
    if (res != CU_OK) {
        untake(g, want);
        pthread_mutex_unlock(&pool_lock);
        return res;
    }
    if (!r) {  /* (no record left: charged per allocation, forgotten at its free) */
        commit(g, *p, want, CHARGE_BYTES);
        pthread_mutex_unlock(&pool_lock);
        return CU_OK;
    }
    uint64_t now = 0;
    if (!pool_attr(pool, POOL_ATTR_RESERVED_CURRENT, &now))
        now = r->charged + want;
    uint64_t grew = now > r->charged ? now - r->charged : 0;
    if (grew > want)
        force(g, grew - want);  /* (the driver grew it past the worst case: it took it) */
    else if (grew < want)
        untake(g, want - grew);
    r->charged = now < r->charged ? r->charged : now;  /* (less: refunded by the next settle) */
    mem_lock();
    struct entry *e = table_find(&pooled, *p);
    if (!e)
        e = table_add(&pooled, *p);
    if (e) {
        e->handle = (uint64_t)(r - pool_recs);
        e->gpu = g;
    }
    mem_unlock();
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
    mem_lock();
    struct entry *e = table_find(&pooled, p);
    int k = e ? (int)e->handle : -1;
    if (e)
        table_erase(&pooled, e);
    mem_unlock();
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

static void pools_forked(void)
{
    table_drop(&pooled);
    memset(pool_recs, 0, sizeof pool_recs);  /* (the parent's pools) */
    pthread_mutex_init(&pool_lock, NULL);
}

__attribute__((constructor)) static void pools_hooks(void)
{
    pools_settle_hook = pools_settle_all;
    memory_on_fork(pools_forked);
}
