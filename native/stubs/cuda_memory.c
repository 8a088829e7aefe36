/*
 * The stand-in libcuda.so.1's device memory (split from libcuda.c: one concern a file): this
 * process's allocations (fake device pointers, sizes kept per process) taken from the card in its
 * 2 MiB pages, cuMemAlloc_v2 / cuMemFree_v2, pitched, managed and stream-ordered allocations (the
 * pools are cuda_pools.c's), cuMemCreate / cuMemRelease and the virtual address space (device
 * memory from the card; host memory, CU_MEM_LOCATION_TYPE_HOST(_NUMA), not), arrays (2-D, 3-D
 * and mipmapped), cuMemGetInfo. Its pitched, managed, stream-ordered and 2-D array allocators call
 * its own exported cuMemAlloc_v2 (through the PLT, so through an interposer): libcgpu must not
 * charge such a nested call twice. The pool, cuMemCreate, 3-D and mipmapped ones and their frees
 * take from the card directly, as a real driver does inside itself: only libcgpu's own wrappers
 * of them can charge them.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <sys/syscall.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_stub.h"

typedef int CUdevice;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101 };

/* This process's allocations and VMM handles, hashed by pointer (open addressing, linear probing):
 * host: not on the card; vmm: a cuMemCreate handle, whose memory lives while it has references
 * (cuMemCreate's, cuMemRetainAllocationHandle's, less cuMemRelease's) or mappings; types: the
 * shareable handle types its cuMemCreate requested; shared: exported or imported memory's id on the
 * card (card.c), which leaves the card when every process holding it let go. */
#define NALLOCS (1 << 16)
static struct { CUdeviceptr ptr; size_t size; int host, dev, vmm, refs, maps, types; uint64_t shared; } allocs[NALLOCS];
static size_t alloc_slot(CUdeviceptr p) { return (size_t)((p * 0x9E3779B97F4A7C15ull) >> 48) & (NALLOCS - 1); }
static int alloc_find(CUdeviceptr p)  /* its index, -1 if unknown */
{
    for (size_t i = alloc_slot(p), n = 0; p && allocs[i].ptr && n < NALLOCS; i = (i + 1) & (NALLOCS - 1), n++)
        if (allocs[i].ptr == p) return (int)i;
    return -1;
}
static void alloc_erase(size_t i)  /* backward-shift deletion: no tombstones */
{
    allocs[i].ptr = 0;
    for (size_t j = (i + 1) & (NALLOCS - 1); allocs[j].ptr; j = (j + 1) & (NALLOCS - 1)) {
        size_t home = alloc_slot(allocs[j].ptr);
        if (((j - home) & (NALLOCS - 1)) >= ((j - i) & (NALLOCS - 1))) {
            allocs[i] = allocs[j];
            allocs[j].ptr = 0;
            i = j;
        }
    }
}

/* a new fake pointer (or handle) for `size` bytes, taken from card `dev` unless `host` */
static size_t nallocs;
/* The card's pages (issue 34): device memory is handed out in 2 MiB pages. An allocation of 2 MiB or
 * more takes its size rounded up to whole pages; smaller ones are packed together in pages of their
 * own per process and card (what they add up to, rounded up), as the driver's suballocator does.
 * The card's figure and NVML's per-process view show the pages; CGPU_STUB_PAGE_KIB=0: bytes, as
 * the first stand-in counted. */
static uint64_t page_bytes(void)
{
    const char *k = getenv("CGPU_STUB_PAGE_KIB");
    return k && *k ? strtoull(k, NULL, 10) << 10 : 2ull << 20;
}
static uint64_t small_bytes[16];
static pid_t small_pid;
static uint64_t round_up(uint64_t n, uint64_t page) { return page ? (n + page - 1) / page * page : n; }
/* what `size` bytes (freed: `size` < 0) change the card's pages on `dev` by */
static int64_t pages_for(int dev, int64_t size)
{
    uint64_t page = page_bytes(), n = (uint64_t)(size < 0 ? -size : size);
    if (small_pid != getpid()) { small_pid = getpid(); memset(small_bytes, 0, sizeof small_bytes); }
    if (!page) return size;
    if (n >= page) return size < 0 ? -(int64_t)round_up(n, page) : (int64_t)round_up(n, page);
    uint64_t before = round_up(small_bytes[dev], page);
    small_bytes[dev] = size < 0 ? (small_bytes[dev] > n ? small_bytes[dev] - n : 0) : small_bytes[dev] + n;
    return (int64_t)round_up(small_bytes[dev], page) - (int64_t)before;
}
static CUresult take_on(int dev, CUdeviceptr *p, size_t size, int host)
{
    static CUdeviceptr next = 0x7f0000000000ull;
    if (nallocs >= NALLOCS / 2) return OUT_OF_MEMORY;  /* (the stand-in's own bound: 32,768 live) */
    host |= stub_memory_is_free();
    if (!host) {
        int64_t pages = pages_for(dev, (int64_t)size);
        if (pages > 0 && stub_card_memory(dev, pages, NULL)) {
            pages_for(dev, -(int64_t)size);
            return OUT_OF_MEMORY;
        }
        stub_alloc_pause();
    }
    size_t i = alloc_slot(next);
    while (allocs[i].ptr)
        i = (i + 1) & (NALLOCS - 1);
    allocs[i].ptr = next;
    allocs[i].size = size;
    allocs[i].host = host;
    allocs[i].dev = dev;
    allocs[i].vmm = allocs[i].maps = allocs[i].types = 0;
    allocs[i].shared = 0;
    allocs[i].refs = 1;
    nallocs++;
    *p = next;
    next += (size + 0xfffff) & ~(CUdeviceptr)0xfffff;
    return OK;
}
static CUresult take(CUdeviceptr *p, size_t size, int host) { return take_on(stub_current_device(), p, size, host); }
static __thread int ordered;
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!p || !size) return INVALID_VALUE;
    CUresult r = ordered ? OK : stub_capture_forbids(NULL);
    if (r) return r;
    return take(p, size, 0);
}
/* its memory back to the card, the entry gone */
static void let_go(int i)
{
    if (allocs[i].shared)  /* (another process may hold it still: the card says when it goes) */
        stub_shared_drop(allocs[i].shared);
    else if (!allocs[i].host) {
        int64_t pages = pages_for(allocs[i].dev, -(int64_t)allocs[i].size);
        if (pages) stub_card_memory(allocs[i].dev, pages, NULL);
    }
    alloc_erase((size_t)i);
    nallocs--;
}
static CUresult drop(CUdeviceptr p)
{
    int i = alloc_find(p);
    if (i < 0 || allocs[i].vmm) return INVALID_VALUE;  /* (a VMM handle goes by cuMemRelease) */
    let_go(i);
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p)
{
    CUresult r = p && !ordered ? stub_capture_forbids(NULL) : OK;
    return r ? r : p ? drop(p) : OK;
}  /* 0: nothing, as the driver (cudaFree(0) passes it on) */
/* the card's memory, not through the exported cuMemAlloc_v2 */
static CUresult device(CUdeviceptr *p, size_t size)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!p || !size) return INVALID_VALUE;
    return take(p, size, 0);
}
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height, unsigned elem)
{
    (void)elem;
    if (!pitch) return INVALID_VALUE;
    *pitch = (width + 511) & ~(size_t)511;
    return cuMemAlloc_v2(p, *pitch * height);
}
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned flags) { (void)flags; return cuMemAlloc_v2(p, size); }
typedef void *CUstream;
/* (ordered: inside a stream-ordered free, legal during a capture) */
static CUresult free_ordered(const char *name, CUdeviceptr p)
{
    stub_called(name);
    ordered++;
    CUresult r = cuMemFree_v2(p);
    ordered--;
    return r;
}
/* Stream-ordered allocations come from pools (cuda_pools.c): cuMemAllocAsync from the current pool
 * of the stream's device, cuMemFreeAsync back to the pool (the card keeps it up to the pool's
 * release threshold, until a synchronization or cuMemPoolTrimTo). */
static CUresult pool_alloc(const char *name, CUdeviceptr *p, size_t size, CUstream s, void *pool)
{
    stub_called(name);
    CUresult r;
    if (stub_capture_alloc(s, size, p, &r)) return r;  /* (into a capture: a graph's allocation node) */
    return stub_pool_alloc_async(p, size, s, pool);
}
static CUresult pool_free(const char *name, CUdeviceptr p, CUstream s)
{
    CUresult r;
    if (stub_capture_free(s, p, &r) || stub_pool_free(p, &r)) {
        stub_called(name);
        return r;
    }
    return free_ordered(name, p);  /* (not a pool's: as cuMemFree) */
}
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, CUstream s) { return pool_alloc(__func__, p, size, s, NULL); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t size, CUstream s) { return pool_alloc(__func__, p, size, s, NULL); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return pool_free(__func__, p, s); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return pool_free(__func__, p, s); }
typedef void *CUmemoryPool;
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s)
{
    if (!pool) return INVALID_VALUE;
    return pool_alloc(__func__, p, size, s, pool);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s)
{
    if (!pool) return INVALID_VALUE;
    return pool_alloc(__func__, p, size, s, pool);
}

/* Virtual memory management: a handle is a fake pointer; cuda.h's layout (CUDA 13: id or `localized`). */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type;  /* CUmemLocationType */
    union { int id; struct { unsigned char deviceId, localityDomainId; } localized; };
} CUmemLocation;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
enum { LOC_DEVICE = 1, LOC_HOST = 2, LOC_HOST_NUMA = 3, LOC_DEVICE_LOCALITY_DOMAIN = 6 };
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!h || !prop || !size || flags) return INVALID_VALUE;
    CUresult r;
    switch (prop->location.type) {
    case LOC_DEVICE:
        r = prop->location.id >= 0 && prop->location.id < stub_device_count() ? take_on(prop->location.id, h, size, 0)
                                                                   : INVALID_DEVICE;
        break;
    case LOC_DEVICE_LOCALITY_DOMAIN:
        r = prop->location.localized.deviceId == 0 && prop->location.localized.localityDomainId == 0
                ? device(h, size) : INVALID_DEVICE;
        break;
    case LOC_HOST: case LOC_HOST_NUMA:
        r = take(h, size, 1);  /* host memory: not the card's */
        break;
    default:
        return INVALID_VALUE;
    }
    if (r == OK) {
        allocs[alloc_find(*h)].vmm = 1;
        allocs[alloc_find(*h)].types = prop->requestedHandleTypes;
    }
    return r;
}
/* what cuMemCreate was asked for (an imported handle: where its memory is, as the exporter's) */
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    int i = alloc_find(h);
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!prop || i < 0 || !allocs[i].vmm || allocs[i].refs <= 0) return INVALID_VALUE;
    memset(prop, 0, sizeof *prop);
    prop->type = 1;  /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop->requestedHandleTypes = allocs[i].types;
    prop->location.type = allocs[i].host ? LOC_HOST : LOC_DEVICE;
    prop->location.id = allocs[i].host ? 0 : allocs[i].dev;
    return OK;
}
/* IPC through shareable handles (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, the one the stand-in has):
 * NVIDIA's driver API reference, cuMemExportToShareableHandle, "Exports an allocation to a requested
 * shareable handle type", a type cuMemCreate asked for in CUmemAllocationProp::requestedHandleTypes
 * (an allocation made without it is not exportable: CUDA_ERROR_INVALID_VALUE here); the handle is a
 * file descriptor that processes pass over a unix socket (SCM_RIGHTS), as the CUDA sample
 * memMapIPCDrv does; cuMemImportFromShareableHandle gives the importer a handle of its own to the
 * same memory, which "it needs to pair ... with cuMemRelease" (cuMemRelease). The descriptor here is
 * a file of its own naming the memory's id on the card (card.c), a new one per export. */
enum { HANDLE_POSIX_FD = 1 };
/* a file of its own, in no directory (memfd_create by its system call: the stand-in is also built
 * for glibc 2.17, which has no wrapper; else an unlinked temporary file) */
static int note_fd(void)
{
#ifdef SYS_memfd_create
    int fd = (int)syscall(SYS_memfd_create, "cgpu-stub-cumem", 0u);
    if (fd >= 0) return fd;
#endif
    char path[] = "/tmp/cgpu-stub-cumem-XXXXXX";
    int t = mkstemp(path);
    if (t >= 0) unlink(path);
    return t;
}
#define IPC_MAGIC 0x3143504955504743ull  /* "CGPUIPC1" */
struct ipc_note { uint64_t magic, id, size; int32_t host, dev; };
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags)
{
    int i = alloc_find(h);
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!out || flags || i < 0 || !allocs[i].vmm || allocs[i].refs <= 0) return INVALID_VALUE;
    if (type != HANDLE_POSIX_FD) return STUB_NOT_SUPPORTED;  /* (Win32 handles and fabric: not on this card) */
    if (!(allocs[i].types & type)) return INVALID_VALUE;
    uint64_t page = page_bytes();
    if (!allocs[i].shared) {  /* (its pages: VMM allocations are whole granules, 2 MiB) */
        uint64_t bytes = allocs[i].host ? 0 : page ? round_up(allocs[i].size, page) : allocs[i].size;
        if (!allocs[i].host && page && allocs[i].size < page) return INVALID_VALUE;
        if (!(allocs[i].shared = stub_shared_export(allocs[i].dev, bytes))) return OUT_OF_MEMORY;
    }
    struct ipc_note n = {IPC_MAGIC, allocs[i].shared, allocs[i].size, allocs[i].host, allocs[i].dev};
    int fd = note_fd();
    if (fd < 0) return OUT_OF_MEMORY;
    if (pwrite(fd, &n, sizeof n, 0) != sizeof n) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    *(int *)out = fd;
    return OK;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type)
{
    struct ipc_note n;
    int fd = (int)(intptr_t)os_handle, dev;
    uint64_t bytes;
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!h) return INVALID_VALUE;
    if (type != HANDLE_POSIX_FD) return STUB_NOT_SUPPORTED;
    if (pread(fd, &n, sizeof n, 0) != sizeof n || n.magic != IPC_MAGIC) return INVALID_VALUE;
    if (stub_shared_hold(n.id, &dev, &bytes)) return INVALID_VALUE;  /* (its memory is gone from the card) */
    CUresult r = take_on(n.dev, h, n.size, 1);  /* (a handle of this process's: the card's memory is held already) */
    if (r != OK) {
        stub_shared_drop(n.id);
        return r;
    }
    int i = alloc_find(*h);
    allocs[i].vmm = 1;
    allocs[i].host = n.host;
    allocs[i].types = type;
    allocs[i].shared = n.id;
    return OK;
}
/* The driver's rule: the physical memory of a handle lives until cuMemRelease (and every
 * cuMemRetainAllocationHandle's release) AND the last cuMemUnmap of it. Strict: an unknown or
 * released handle, a range not reserved, mapped twice, or not exactly mapped is CUDA_ERROR_INVALID_VALUE. */
static void vmm_maybe_gone(int i)
{
    if (allocs[i].refs == 0 && allocs[i].maps == 0)
        let_go(i);
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    int i = alloc_find(h);
    if (!stub_inited()) return NOT_INITIALIZED;
    if (i < 0 || !allocs[i].vmm || allocs[i].refs <= 0) return INVALID_VALUE;
    allocs[i].refs--;
    vmm_maybe_gone(i);
    return OK;
}
#define NVAS 4096
static struct { CUdeviceptr va; size_t size; } vas[NVAS];                         /* reservations */
static struct { CUdeviceptr va; size_t size; CUmemGenericAllocationHandle h; } maps[NVAS];  /* mappings */
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    static CUdeviceptr next_va = 0x200000000000ull;
    (void)alignment; (void)addr;  /* (a hint: the stand-in picks its own) */
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!ptr || !size || flags) return INVALID_VALUE;
    for (int i = 0; i < NVAS; i++)
        if (!vas[i].va) {
            vas[i].va = *ptr = next_va;
            vas[i].size = size;
            next_va += (size + 0x1fffff) & ~(CUdeviceptr)0x1fffff;
            return OK;
        }
    return OUT_OF_MEMORY;
}
static int mapping_at(CUdeviceptr va)
{
    for (int i = 0; i < NVAS; i++)
        if (maps[i].va == va && va) return i;
    return -1;
}
static int overlaps_a_mapping(CUdeviceptr va, size_t size)
{
    for (int i = 0; i < NVAS; i++)
        if (maps[i].va && maps[i].va < va + size && va < maps[i].va + maps[i].size) return 1;
    return 0;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    for (int i = 0; i < NVAS; i++)
        if (vas[i].va == ptr && ptr) {
            if (vas[i].size != size || overlaps_a_mapping(ptr, size)) return INVALID_VALUE;  /* (unmap first) */
            vas[i].va = 0;
            return OK;
        }
    return INVALID_VALUE;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags)
{
    int i = alloc_find(h), reserved = 0;
    if (!stub_inited()) return NOT_INITIALIZED;
    if (i < 0 || !allocs[i].vmm || allocs[i].refs <= 0 || flags || offset || !size || size > allocs[i].size)
        return INVALID_VALUE;
    for (int k = 0; k < NVAS; k++)
        reserved |= vas[k].va && vas[k].va <= ptr && ptr + size <= vas[k].va + vas[k].size;
    if (!reserved || overlaps_a_mapping(ptr, size)) return INVALID_VALUE;
    for (int k = 0; k < NVAS; k++)
        if (!maps[k].va) {
            maps[k].va = ptr;
            maps[k].size = size;
            maps[k].h = h;
            allocs[i].maps++;
            return OK;
        }
    return OUT_OF_MEMORY;
}
/* [ptr, ptr + size) must be exactly whole mappings, one after the other */
static int whole_mappings(CUdeviceptr ptr, size_t size)
{
    CUdeviceptr at = ptr;
    int k;
    while (at < ptr + size && (k = mapping_at(at)) >= 0)
        at += maps[k].size;
    return size && at == ptr + size;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!whole_mappings(ptr, size)) return INVALID_VALUE;
    for (CUdeviceptr at = ptr; at < ptr + size;) {
        int k = mapping_at(at), i = alloc_find(maps[k].h);
        at += maps[k].size;
        maps[k].va = 0;
        if (i >= 0) {
            allocs[i].maps--;
            vmm_maybe_gone(i);
        }
    }
    return OK;
}
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    return desc && count && whole_mappings(ptr, size) ? OK : INVALID_VALUE;
}
/* the handle of the mapping that holds `addr` (anywhere in it), with one more reference */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!h) return INVALID_VALUE;
    for (int k = 0; k < NVAS; k++)
        if (maps[k].va && maps[k].va <= a && a < maps[k].va + maps[k].size) {
            int i = alloc_find(maps[k].h);
            if (i < 0) return INVALID_VALUE;
            allocs[i].refs++;
            *h = maps[k].h;
            return OK;
        }
    return INVALID_VALUE;
}

typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
static size_t format_bytes(int f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;   /* (UNSIGNED|SIGNED)_INT8 */
    case 0x02: case 0x09: case 0x10: return 2;   /* INT16, HALF */
    default: return 4;                 /* INT32, FLOAT, ... */
    }
}
CUresult cuArrayCreate_v2(CUdeviceptr *h, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (!d || !h) return INVALID_VALUE;
    size_t bytes = d->Width * (d->Height ? d->Height : 1) * format_bytes(d->Format) * (d->NumChannels ? d->NumChannels : 1);
    return cuMemAlloc_v2(h, bytes);
}
CUresult cuArrayDestroy(CUdeviceptr h) { return cuMemFree_v2(h); }
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;
enum { ARRAY3D_LAYERED = 0x01, ARRAY3D_CUBEMAP = 0x04 };
static size_t at_least_1(size_t n) { return n ? n : 1; }
CUresult cuArray3DCreate_v2(CUdeviceptr *h, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!d || !h) return INVALID_VALUE;
    return device(h, d->Width * at_least_1(d->Height) * at_least_1(d->Depth) * format_bytes(d->Format)
                                * at_least_1(d->NumChannels));
}
/* every level half the one before (at least 1); a layered or cubemap array's depth is its layers: kept */
CUresult cuMipmappedArrayCreate(CUdeviceptr *h, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    if (!d || !h || !levels) return INVALID_VALUE;
    size_t w = d->Width, ht = at_least_1(d->Height), dp = at_least_1(d->Depth), elements = 0;
    for (unsigned l = 0; l < levels; l++) {
        elements += w * ht * dp;
        w = at_least_1(w / 2);
        ht = at_least_1(ht / 2);
        if (!(d->Flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP)))
            dp = at_least_1(dp / 2);
    }
    return device(h, elements * format_bytes(d->Format) * at_least_1(d->NumChannels));
}
CUresult cuMipmappedArrayDestroy(CUdeviceptr h) { return drop(h); }

CUresult cuMemGetInfo_v2(size_t *free_, size_t *total_)
{
    uint64_t used;
    if (!stub_inited()) return NOT_INITIALIZED;
    stub_card_memory(stub_current_device(), 0, &used);
    *free_ = stub_card_bytes() - used;
    *total_ = stub_card_bytes();
    return OK;
}
/* CUDA 2.0's, for 32-bit sizes (what cuGetProcAddress gives for cuMemGetInfo below version 3020) */
CUresult cuMemGetInfo(unsigned int *free_, unsigned int *total_)
{
    size_t f, t;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    stub_called(__func__);
    if (r != OK) return r;
    *free_ = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
    *total_ = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    return OK;
}
int stub_find_alloc(CUdeviceptr p, size_t n, CUdeviceptr *base, size_t *size)
{
    for (size_t i = 0; i < sizeof allocs / sizeof *allocs; i++)
        if (allocs[i].ptr && !allocs[i].host && p >= allocs[i].ptr && p - allocs[i].ptr <= allocs[i].size
            && n <= allocs[i].size - (p - allocs[i].ptr)) {
            *base = allocs[i].ptr;
            *size = allocs[i].size;
            return 0;
        }
    return stub_pool_find(p, n, base, size);  /* (a pool's allocation) */
}


/* The driver's own `fn`, as a real cuGetProcAddress gives it (libcuda.c's OWN). */
#define OWN(fn) extern __typeof__(fn) own_##fn __attribute__((alias(#fn), visibility("hidden")))
OWN(cuMemAlloc_v2);
OWN(cuMemFree_v2);
OWN(cuMemGetInfo);
OWN(cuMemGetInfo_v2);
OWN(cuMemAllocPitch_v2);
OWN(cuMemAllocManaged);
OWN(cuMemAllocAsync);
OWN(cuMemAllocAsync_ptsz);
OWN(cuMemFreeAsync);
OWN(cuMemFreeAsync_ptsz);
OWN(cuArrayCreate_v2);
OWN(cuArrayDestroy);
OWN(cuMemAllocFromPoolAsync);
OWN(cuMemAllocFromPoolAsync_ptsz);
OWN(cuMemCreate);
OWN(cuMemRelease);
OWN(cuMemAddressReserve);
OWN(cuMemAddressFree);
OWN(cuMemMap);
OWN(cuMemUnmap);
OWN(cuMemSetAccess);
OWN(cuMemRetainAllocationHandle);
OWN(cuMemExportToShareableHandle);
OWN(cuMemGetAllocationPropertiesFromHandle);
OWN(cuMemImportFromShareableHandle);
OWN(cuArray3DCreate_v2);
OWN(cuMipmappedArrayCreate);
OWN(cuMipmappedArrayDestroy);

/* cuGetProcAddress's forms of this file's names (cuda_export.c picks by version and flags). */
HIDDEN const struct stub_versioned STUB_VERSIONED_MEMORY[] = {
    {"cuMemAlloc", 3020, 0, (void *)own_cuMemAlloc_v2},
    {"cuMemFree", 3020, 0, (void *)own_cuMemFree_v2},
    {"cuMemGetInfo", 2000, 0, (void *)own_cuMemGetInfo},
    {"cuMemGetInfo", 3020, 0, (void *)own_cuMemGetInfo_v2},
    {"cuMemAllocPitch", 3020, 0, (void *)own_cuMemAllocPitch_v2},
    {"cuMemAllocManaged", 6000, 0, (void *)own_cuMemAllocManaged},
    {"cuMemAllocAsync", 11020, 0, (void *)own_cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, (void *)own_cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, (void *)own_cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, (void *)own_cuMemFreeAsync_ptsz},
    {"cuArrayCreate", 3020, 0, (void *)own_cuArrayCreate_v2},
    {"cuArrayDestroy", 2000, 0, (void *)own_cuArrayDestroy},
    {"cuDeviceGetDefaultMemPool", 11020, 0, (void *)stub_default_mem_pool},
    {"cuMemAllocFromPoolAsync", 11020, 0, (void *)own_cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, 1, (void *)own_cuMemAllocFromPoolAsync_ptsz},
    {"cuMemCreate", 10020, 0, (void *)own_cuMemCreate},
    {"cuMemRelease", 10020, 0, (void *)own_cuMemRelease},
    {"cuMemAddressReserve", 10020, 0, (void *)own_cuMemAddressReserve},
    {"cuMemAddressFree", 10020, 0, (void *)own_cuMemAddressFree},
    {"cuMemMap", 10020, 0, (void *)own_cuMemMap},
    {"cuMemUnmap", 10020, 0, (void *)own_cuMemUnmap},
    {"cuMemSetAccess", 10020, 0, (void *)own_cuMemSetAccess},
    {"cuMemRetainAllocationHandle", 11000, 0, (void *)own_cuMemRetainAllocationHandle},
    {"cuMemExportToShareableHandle", 10020, 0, (void *)own_cuMemExportToShareableHandle},
    {"cuMemGetAllocationPropertiesFromHandle", 10020, 0, (void *)own_cuMemGetAllocationPropertiesFromHandle},
    {"cuMemImportFromShareableHandle", 10020, 0, (void *)own_cuMemImportFromShareableHandle},
    {"cuArray3DCreate", 3020, 0, (void *)own_cuArray3DCreate_v2},
    {"cuMipmappedArrayCreate", 5000, 0, (void *)own_cuMipmappedArrayCreate},
    {"cuMipmappedArrayDestroy", 5000, 0, (void *)own_cuMipmappedArrayDestroy},
    {NULL, 0, 0, NULL},
};
