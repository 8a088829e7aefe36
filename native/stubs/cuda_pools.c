/*
 * The stand-in's stream-ordered memory pools (cuMemPool*), as unkind as the card's (issue 34):
 *
 * - A pool holds physical memory (its reservation) in 2 MiB granules, in segments: each growth of
 *   the pool is one segment, of the allocation's size in granules, taken from the card. An
 *   allocation is one contiguous range of a segment: it takes the first run of free granules that
 *   holds it (backing what of it was released, from the card), and when no segment has one the pool
 *   grows by a new segment of its whole size, however much is free in pieces elsewhere (issue 45, item 3: the pool fragments; NVIDIA's Programming
 *   Guide, "Stream Ordered Memory Allocator", documents no compaction: "physical memory ... reserved
 *   by the pool" is reused by later allocations, and the pool grows when what it holds does not
 *   serve the request). cuMemFreeAsync gives an allocation back to the POOL, not to the card: the
 *   card's memory, and NVML's per-process figure, keep it.
 * - At a synchronization (cuCtxSynchronize, cuStreamSynchronize) a pool releases what it holds
 *   unused above its release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, default 0: all of it);
 *   cuMemPoolTrimTo(pool, keep) releases unused memory until the pool holds `keep` or less, "or there
 *   is no more memory that the allocator can safely release" (the driver API reference): unused
 *   granules go back, their ranges staying their segments'. RMM's async resource sets
 *   the threshold to the device's memory and primes the pool with free/2; PyTorch's cudaMallocAsync
 *   backend raises it: their pools then keep everything they ever reserved.
 * - CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT / _HIGH, USED_MEM_CURRENT / _HIGH answer what the pool
 *   reserves and what its allocations use (a _HIGH set to 0 resets it), as cuda.h's enum numbers.
 * - A device's default pool (cuDeviceGetDefaultMemPool), its current pool (cuDeviceGetMemPool,
 *   cuDeviceSetMemPool: what cuMemAllocAsync takes from, on the STREAM's device), pools made by
 *   cuMemPoolCreate on a device or on the host (CU_MEM_LOCATION_TYPE_HOST / _HOST_NUMA: host
 *   memory, never the card's).
 * Pools are per process (a process's pool is its own); what a dead process's pools held comes back
 * to the card with the rest of its record (libcuda.c).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_stub.h"

typedef void *CUstream;
#define PAGE (2ull << 20)
#define NPOOLS 64
#define NPTRS (1 << 15)
enum { ATTR_RELEASE_THRESHOLD = 4, ATTR_RESERVED_CURRENT = 5, ATTR_RESERVED_HIGH = 6, ATTR_USED_CURRENT = 7,
       ATTR_USED_HIGH = 8 };
enum { LOC_DEVICE = 1, LOC_HOST = 2, LOC_HOST_NUMA = 3 };
enum { POOL_MAGIC = 0x706f6f6c };

#define NSEGS 256
enum { FREE, USED, UNBACKED };
struct seg {
    CUdeviceptr base;
    uint64_t pages;   /* its granules */
    uint8_t *used;    /* each granule: FREE (backed, unused), USED, UNBACKED (NULL: no segment) */
};
struct pool {
    unsigned magic;
    int dev, host, live;
    int flags[4];  /* the reuse attributes (1 to 3): kept and answered */
    uint64_t threshold, reserved, reserved_high, used, used_high;
    struct seg segs[NSEGS];
};
static struct pool pools[NPOOLS];
static struct pool *defaults[16], *current[16];
static struct { CUdeviceptr p; size_t n; struct pool *pool; int seg; uint64_t at; } ptrs[NPTRS];  /* live allocations */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static CUdeviceptr next_ptr = 0x7e0000000000ull;
static size_t nptrs;  /* live pool allocations */

static uint64_t pages_of(uint64_t n) { return (n + PAGE - 1) / PAGE * PAGE; }

static struct pool *pool_of(void *h)  /* (lock held) a live pool, or NULL */
{
    struct pool *p = h;
    return p >= pools && p < pools + NPOOLS && p->magic == POOL_MAGIC && p->live ? p : NULL;
}

static struct pool *make(int dev, int host)  /* (lock held) */
{
    for (int i = 0; i < NPOOLS; i++)
        if (!pools[i].live) {
            for (int k = 0; k < NSEGS; k++)
                free(pools[i].segs[k].used);
            pools[i] = (struct pool){.magic = POOL_MAGIC, .dev = dev, .host = host, .live = 1};
            return &pools[i];
        }
    return NULL;
}

static struct pool *default_of(int dev)  /* (lock held) */
{
    if (!defaults[dev])
        defaults[dev] = make(dev, 0);
    return defaults[dev];
}

/* The pool's reservation moved by `delta` bytes (the card's, unless a host pool): 0, or -1 no room. */
static int reserve(struct pool *p, int64_t delta)
{
    if (!p->host && stub_driver_memory(p->dev, delta))
        return -1;
    p->reserved += (uint64_t)delta;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    return 0;
}

/* Unused memory back to the card until the pool holds `keep` or less, a granule at a time, the newest
 * segments' first: its range stays the segment's (unbacked), and a segment left with nothing goes. */
static void release_above(struct pool *p, uint64_t keep)
{
    for (int k = NSEGS - 1; k >= 0 && p->reserved > keep; k--) {
        struct seg *g = &p->segs[k];
        for (uint64_t i = g->pages; g->used && i-- > 0 && p->reserved > keep;)
            if (g->used[i] == FREE) {
                g->used[i] = UNBACKED;
                reserve(p, -(int64_t)PAGE);
            }
        int left = 0;
        for (uint64_t i = 0; g->used && i < g->pages; i++)
            left |= g->used[i] != UNBACKED;
        if (g->used && !left) {
            free(g->used);
            *g = (struct seg){0};
        }
    }
}

/* The first run of `n` granules of a segment with no allocation in them: its segment (*at: the run's
 * first granule), -1. */
static int fit(struct pool *p, uint64_t n, uint64_t *at)
{
    for (int k = 0; k < NSEGS; k++) {
        struct seg *g = &p->segs[k];
        for (uint64_t i = 0, run = 0; g->used && i < g->pages; i++) {
            run = g->used[i] == USED ? 0 : run + 1;
            if (run == n) {
                *at = i + 1 - n;
                return k;
            }
        }
    }
    return -1;
}

/* A new segment of `n` granules (unbacked): its index, -1 (none left). */
static int grow(struct pool *p, uint64_t n)
{
    int k = 0;
    while (k < NSEGS && p->segs[k].used)
        k++;
    if (k == NSEGS || !(p->segs[k].used = malloc(n)))
        return -1;
    memset(p->segs[k].used, UNBACKED, n);
    p->segs[k].base = next_ptr;
    p->segs[k].pages = n;
    next_ptr += n * PAGE;
    return k;
}

static CUresult pool_alloc(CUdeviceptr *out, size_t size, struct pool *p, int *grew)
{
    if (!out || !size) return STUB_INVALID_VALUE;
    uint64_t n = pages_of(size), at = 0;
    if (nptrs >= NPTRS / 2) return STUB_OUT_OF_MEMORY;  /* (the stand-in's own bound) */
    int k = fit(p, n / PAGE, &at), made = k < 0;
    if (k < 0 && (k = grow(p, n / PAGE)) < 0)
        return STUB_OUT_OF_MEMORY;
    uint8_t *g = p->segs[k].used + at;
    uint64_t unbacked = 0;
    for (uint64_t j = 0; j < n / PAGE; j++)
        unbacked += g[j] == UNBACKED;
    if (unbacked && reserve(p, (int64_t)(unbacked * PAGE))) {  /* (the card has no room for them) */
        if (made) {
            free(p->segs[k].used);
            p->segs[k] = (struct seg){0};
        }
        return STUB_OUT_OF_MEMORY;
    }
    *grew = unbacked > 0;
    memset(g, USED, n / PAGE);
    CUdeviceptr ptr = p->segs[k].base + at * PAGE;
    size_t i = (size_t)((ptr * 0x9E3779B97F4A7C15ull) >> 49) & (NPTRS - 1);
    while (ptrs[i].p) i = (i + 1) & (NPTRS - 1);
    nptrs++;
    ptrs[i].p = *out = ptr;
    ptrs[i].n = n;
    ptrs[i].pool = p;
    ptrs[i].seg = k;
    ptrs[i].at = at;
    p->used += n;
    if (p->used > p->used_high) p->used_high = p->used;
    return STUB_OK;
}

static int find_ptr(CUdeviceptr p)  /* (lock held) its index, -1 */
{
    size_t i = (size_t)((p * 0x9E3779B97F4A7C15ull) >> 49) & (NPTRS - 1);
    for (size_t n = 0; p && ptrs[i].p && n < NPTRS; i = (i + 1) & (NPTRS - 1), n++)
        if (ptrs[i].p == p) return (int)i;
    return -1;
}

static void erase_ptr(size_t i)  /* backward-shift deletion */
{
    ptrs[i].p = 0;
    for (size_t j = (i + 1) & (NPTRS - 1); ptrs[j].p; j = (j + 1) & (NPTRS - 1)) {
        size_t home = (size_t)((ptrs[j].p * 0x9E3779B97F4A7C15ull) >> 49) & (NPTRS - 1);
        if (((j - home) & (NPTRS - 1)) >= ((j - i) & (NPTRS - 1))) {
            ptrs[i] = ptrs[j];
            ptrs[j].p = 0;
            i = j;
        }
    }
}

/* cuMemAllocAsync: from the current pool of the stream's device. */
CUresult stub_pool_alloc_async(CUdeviceptr *out, size_t size, const void *stream, void *pool)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    pthread_mutex_lock(&lock);
    struct pool *p;
    if (pool)
        p = pool_of(pool);
    else {
        int dev = stub_stream_device(stream);
        p = current[dev] ? current[dev] : default_of(dev);
    }
    int grew = 0;
    CUresult r = p ? pool_alloc(out, size, p, &grew) : STUB_INVALID_VALUE;
    pthread_mutex_unlock(&lock);
    if (grew)
        stub_alloc_pause();  /* (its pages from the card: as any allocation's, cuda_memory.c) */
    return r;
}

/* cuMemFreeAsync of a pool's allocation: back to its pool (1, *r); not one (0). */
int stub_pool_free(CUdeviceptr ptr, CUresult *r)
{
    pthread_mutex_lock(&lock);
    int i = find_ptr(ptr);
    if (i >= 0) {
        struct pool *p = ptrs[i].pool;
        p->used -= ptrs[i].n;
        memset(p->segs[ptrs[i].seg].used + ptrs[i].at, FREE, ptrs[i].n / PAGE);
        erase_ptr((size_t)i);
        nptrs--;
        *r = STUB_OK;
    }
    pthread_mutex_unlock(&lock);
    return i >= 0;
}

/* A synchronization: each pool of card `dev` (-1: every card) keeps at most its release threshold unused. */
void stub_pools_settle(int dev)
{
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NPOOLS; i++)
        if (pools[i].live && (dev < 0 || pools[i].dev == dev))
            release_above(&pools[i], pools[i].threshold);
    pthread_mutex_unlock(&lock);
}

/* [p, p + n) inside a live pool allocation: 0 and its base and size, else -1 (copies' checks). */
int stub_pool_find(CUdeviceptr p, size_t n, CUdeviceptr *base, size_t *size)
{
    int found = -1;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < NPTRS && found < 0; i++)
        if (ptrs[i].p && !ptrs[i].pool->host && p >= ptrs[i].p && p - ptrs[i].p <= ptrs[i].n
            && n <= ptrs[i].n - (p - ptrs[i].p)) {
            *base = ptrs[i].p;
            *size = ptrs[i].n;
            found = 0;
        }
    pthread_mutex_unlock(&lock);
    return found;
}

CUresult cuDeviceGetDefaultMemPool(void **pool, int dev)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (!pool) return STUB_INVALID_VALUE;
    if (dev < 0 || dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    *pool = default_of(dev);
    pthread_mutex_unlock(&lock);
    return *pool ? STUB_OK : STUB_OUT_OF_MEMORY;
}

extern __typeof__(cuDeviceGetDefaultMemPool) stub_default_mem_pool
    __attribute__((alias("cuDeviceGetDefaultMemPool"), visibility("hidden")));  /* (libcuda.c's table: its own) */

CUresult cuDeviceGetMemPool(void **pool, int dev)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (!pool) return STUB_INVALID_VALUE;
    if (dev < 0 || dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    *pool = current[dev] ? current[dev] : default_of(dev);
    pthread_mutex_unlock(&lock);
    return STUB_OK;
}

CUresult cuDeviceSetMemPool(int dev, void *pool)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (dev < 0 || dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    struct pool *p = pool_of(pool);
    CUresult r = p && !p->host && p->dev == dev ? STUB_OK : STUB_INVALID_VALUE;
    if (!r) current[dev] = p;
    pthread_mutex_unlock(&lock);
    return r;
}

/* cuda.h's CUmemPoolProps, as far as it is read: where the pool's memory is. */
typedef struct { int allocType, handleTypes; struct { int type, id; } location; } pool_props;

CUresult cuMemPoolCreate(void **pool, const pool_props *props)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (!pool || !props) return STUB_INVALID_VALUE;
    int host = props->location.type == LOC_HOST || props->location.type == LOC_HOST_NUMA;
    if (!host && (props->location.type != LOC_DEVICE || props->location.id < 0
                  || props->location.id >= stub_device_count()))
        return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *pool = make(host ? 0 : props->location.id, host);
    pthread_mutex_unlock(&lock);
    return *pool ? STUB_OK : STUB_OUT_OF_MEMORY;
}

CUresult cuMemPoolDestroy(void *pool)
{
    pthread_mutex_lock(&lock);
    struct pool *p = pool_of(pool);
    int d;
    CUresult r = STUB_INVALID_VALUE;
    for (d = 0; p && d < 16 && defaults[d] != p; d++)
        ;
    if (p && d == 16) {  /* (a default pool cannot be destroyed) */
        release_above(p, 0);  /* (what its live allocations use goes when they are freed) */
        p->live = p->used ? p->live : 0;
        for (d = 0; d < 16; d++)
            if (current[d] == p) current[d] = NULL;
        r = STUB_OK;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemPoolTrimTo(void *pool, size_t keep)
{
    pthread_mutex_lock(&lock);
    struct pool *p = pool_of(pool);
    if (p) release_above(p, keep);
    pthread_mutex_unlock(&lock);
    return p ? STUB_OK : STUB_INVALID_VALUE;
}

CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value)
{
    if (!value) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct pool *p = pool_of(pool);
    CUresult r = p ? STUB_OK : STUB_INVALID_VALUE;
    if (!p)
        ;
    else if (attr >= 1 && attr <= 3)
        p->flags[attr] = *(int *)value;
    else if (attr == ATTR_RELEASE_THRESHOLD)
        p->threshold = *(uint64_t *)value;
    else if ((attr == ATTR_RESERVED_HIGH || attr == ATTR_USED_HIGH) && *(uint64_t *)value == 0)
        *(attr == ATTR_RESERVED_HIGH ? &p->reserved_high : &p->used_high) =
            attr == ATTR_RESERVED_HIGH ? p->reserved : p->used;
    else
        r = STUB_INVALID_VALUE;  /* (the current figures are read-only; a high mark resets to 0 only) */
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value)
{
    if (!value) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct pool *p = pool_of(pool);
    CUresult r = p ? STUB_OK : STUB_INVALID_VALUE;
    if (!p)
        ;
    else if (attr >= 1 && attr <= 3)
        *(int *)value = p->flags[attr];
    else if (attr >= ATTR_RELEASE_THRESHOLD && attr <= ATTR_USED_HIGH) {
        uint64_t v[] = {p->threshold, p->reserved, p->reserved_high, p->used, p->used_high};
        *(uint64_t *)value = v[attr - ATTR_RELEASE_THRESHOLD];
    } else
        r = STUB_INVALID_VALUE;
    pthread_mutex_unlock(&lock);
    return r;
}

struct stub_proc { const char *name; void *fn; };
HIDDEN const struct stub_proc STUB_PROCS_POOLS[] = {
    {"cuDeviceGetMemPool", (void *)cuDeviceGetMemPool},
    {"cuDeviceSetMemPool", (void *)cuDeviceSetMemPool},
    {"cuMemPoolCreate", (void *)cuMemPoolCreate},
    {"cuMemPoolDestroy", (void *)cuMemPoolDestroy},
    {"cuMemPoolTrimTo", (void *)cuMemPoolTrimTo},
    {"cuMemPoolSetAttribute", (void *)cuMemPoolSetAttribute},
    {"cuMemPoolGetAttribute", (void *)cuMemPoolGetAttribute},
    {NULL, NULL},
};
