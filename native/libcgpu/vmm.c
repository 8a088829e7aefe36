/*
 * libcgpu, memory: virtual memory management (cgpu_memory.h). The physical memory is made by
 * cuMemCreate, keyed by its handle (cuMemMap only maps it); it lives until its last release AND
 * its last unmap (the driver's rule), and only then comes back. A handle imported from another
 * process is charged too, from its first mapping (IPC, below).
 */
#include "cgpu_memory.h"

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

/* ---- IPC: memory shared between processes through shareable handles (issue 45, item 11) ----
 *
 * The driver frees an exported allocation once every process holding it — its exporter and each
 * importer — released its handle and unmapped it (cuMemRelease). libcgpu cannot tell, in the
 * exporter, when the last importer of another process lets go (the shareable handle names nothing
 * a process can compare), so every holder is charged for what it holds: the exporter from
 * cuMemCreate to its own release and last unmap (as any VMM handle), each importer from its first
 * mapping (the import says no size: the mapping does, offset + size) to its own release and last
 * unmap. While the memory is on the card at least one process of those holding it is charged for
 * it: never a refund that lets an instance pass memsize (docs/memory.md, "Memory shared between
 * processes"). */
static struct {
    CUresult (*import)(CUdeviceptr *, void *, int);
    CUresult (*props)(mem_prop *, CUdeviceptr);
} ipc;
static pthread_once_t ipc_once = PTHREAD_ONCE_INIT;
static void ipc_load(void)
{
    setup_once();
    ipc.import = (CUresult (*)(CUdeviceptr *, void *, int))sym("cuMemImportFromShareableHandle");
    ipc.props = (CUresult (*)(mem_prop *, CUdeviceptr))sym("cuMemGetAllocationPropertiesFromHandle");
}

/* The page's GPU an imported handle's memory is on (-1: the host's, or a GPU given whole). */
static int imported_gpu(CUdeviceptr handle)
{
    mem_prop p;
    in_driver++;
    CUresult r = ipc.props ? ipc.props(&p, handle) : CU_NOT_INITIALIZED;
    in_driver--;
    if (r != CU_OK)
        return current_gpu();
    if (p.location.type != LOC_DEVICE && p.location.type != LOC_DEVICE_LOCALITY_DOMAIN)
        return -1;
    return p.location.type == LOC_DEVICE ? page_index(p.location.id) : current_gpu();
}

CUresult cuMemImportFromShareableHandle(CUdeviceptr *handle, void *os_handle, int type)
{
    pthread_once(&ipc_once, ipc_load);
    PASS_THROUGH(ipc.import, handle, os_handle, type);
    in_driver++;
    CUresult r = ipc.import(handle, os_handle, type);
    in_driver--;
    if (r != CU_OK || !handle)
        return r;
    int g = imported_gpu(*handle);
    if (g < 0)
        return r;  /* (host memory, or a GPU given whole: not charged) */
    mem_lock();
    struct entry *e = table_find(&allocs, *handle);
    if (e)
        e->refs++;  /* (the same handle again: one more release to pair) */
    else if ((e = table_add(&allocs, *handle))) {
        e->gpu = g;
        e->refs = 1;
        e->handle = CHARGE_BYTES;
        e->imported = 1;
    }
    mem_unlock();
    return r;
}

/* Before an imported handle is mapped: its charge raised to what the mapping reaches (0), or
 * out-of-memory (nothing charged). *more: what was added. */
static CUresult import_charge(CUdeviceptr handle, uint64_t reach, uint64_t *more, int *gpu)
{
    mem_lock();
    struct entry *e = table_find(&allocs, handle);
    int g = e && e->imported ? e->gpu : -1;
    *more = e && e->imported && reach > e->size ? reach - e->size : 0;
    mem_unlock();
    *gpu = g;
    if (!*more)
        return CU_OK;
    if (!need_slot())
        return CU_OUT_OF_MEMORY;
    follow();
    driver_share(g);
    if (!take(g, *more) && !(settle_all() && take(g, *more)))
        return CU_OUT_OF_MEMORY;
    mem_lock();
    if ((e = table_find(&allocs, handle)) && e->imported)
        e->size += *more;
    else
        g = -2;  /* (released meanwhile) */
    mem_unlock();
    if (g == -2) {
        untake(*gpu, *more);
        *more = 0;
    }
    return CU_OK;
}

static void import_uncharge(CUdeviceptr handle, int g, uint64_t more)
{
    if (!more)
        return;
    mem_lock();
    struct entry *e = table_find(&allocs, handle);
    if (e && e->imported)
        e->size -= more;
    mem_unlock();
    if (e)
        untake(g, more);
}

/* Mapped: the handle's memory lives on until its last unmap, whenever it is released. */
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUdeviceptr handle, unsigned long long flags)
{
    PASS_THROUGH(real.mem_map, va, size, offset, handle, flags);
    uint64_t more = 0;
    int g = -1;
    if (import_charge(handle, (uint64_t)offset + size, &more, &g) != CU_OK)
        return CU_OUT_OF_MEMORY;
    in_driver++;
    CUresult r = real.mem_map(va, size, offset, handle, flags);
    in_driver--;
    if (r != CU_OK) {
        import_uncharge(handle, g, more);
        return r;
    }
    mem_lock();
    struct entry *h = table_find(&allocs, handle), *m;
    if (h && (m = table_add(&mapped, va))) {  /* (a handle we did not charge: host memory, a GPU given whole) */
        m->size = size;
        m->handle = handle;
        h->maps++;
    }
    mem_unlock();
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
    mem_lock();
    struct entry *m;
    for (CUdeviceptr at = va; at - va < size && (m = table_find(&mapped, at));) {
        uint64_t handle = m->handle;
        at += m->size ? m->size : size;
        table_erase(&mapped, m);
        struct entry *h = table_find(&allocs, handle);
        if (h && --h->maps <= 0 && h->refs <= 0)
            let_go(h);
    }
    mem_unlock();
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
    mem_lock();
    struct entry *h = table_find(&allocs, *handle);
    if (h)
        h->refs++;
    mem_unlock();
    return r;
}
