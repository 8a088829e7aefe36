/*
 * libcgpu, memory: virtual memory management (cgpu_memory.h). The physical memory is made by
 * cuMemCreate, keyed by its handle (cuMemMap only maps it); it lives until its last release AND
 * its last unmap (the driver's rule), and only then comes back.
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

/* Mapped: the handle's memory lives on until its last unmap, whenever it is released. */
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUdeviceptr handle, unsigned long long flags)
{
    PASS_THROUGH(real.mem_map, va, size, offset, handle, flags);
    in_driver++;
    CUresult r = real.mem_map(va, size, offset, handle, flags);
    in_driver--;
    if (r != CU_OK)
        return r;
    mem_lock();
    struct entry *h = table_find(&allocs, handle), *m;
    if (h && (m = table_add(&mapped, va))) {  /* (a handle we did not charge: another process's, imported) */
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
