/*
 * A stand-in libcuda.so.1 for the tests: no GPU here (native/Makefile, `stubs`).
 *
 * One card of CGPU_STUB_CUDA_MIB MiB (default 15109, a T4) whose memory is shared
 * by every process using it: its state is a file (CGPU_STUB_CUDA_STATE, default
 * /tmp/cgpu-stub-cuda.state) holding the bytes in use, changed under flock.
 * It answers what the CUDA driver API's clients need to allocate and ask about
 * memory: cuInit, versions, one device, contexts, cuMemAlloc_v2 / cuMemFree_v2
 * (fake device pointers, sizes kept per process), cuMemGetInfo_v2,
 * cuDeviceTotalMem_v2, pitched, managed and stream-ordered allocations, arrays,
 * streams, error names, and cuGetProcAddress / _v2 by name. Its other allocators
 * call its own exported cuMemAlloc_v2 (through the PLT, so through an interposer):
 * libcgpu must not charge such a nested call twice.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101,
       NOT_FOUND = 500 };

static int inited;
static struct { CUdeviceptr ptr; size_t size; } allocs[4096];

static uint64_t total(void)
{
    const char *m = getenv("CGPU_STUB_CUDA_MIB");
    return (uint64_t)(m && *m ? strtoull(m, NULL, 10) : 15109) << 20;
}

/* add `delta` to the bytes in use if the card has room; 0 or -1 */
static int card(int64_t delta, uint64_t *used_out)
{
    const char *p = getenv("CGPU_STUB_CUDA_STATE");
    int fd = open(p && *p ? p : "/tmp/cgpu-stub-cuda.state", O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    flock(fd, LOCK_EX);
    uint64_t used = 0;
    if (pread(fd, &used, sizeof used, 0) != sizeof used)
        used = 0;
    int rc = 0;
    if (delta > 0 && used + (uint64_t)delta > total())
        rc = -1;
    else {
        used = delta < 0 && (uint64_t)-delta > used ? 0 : used + (uint64_t)delta;
        if (pwrite(fd, &used, sizeof used, 0) != sizeof used)
            rc = -1;
    }
    if (used_out)
        *used_out = used;
    flock(fd, LOCK_UN);
    close(fd);
    return rc;
}

CUresult cuInit(unsigned flags) { (void)flags; inited = 1; return OK; }
CUresult cuDriverGetVersion(int *v) { if (!v) return INVALID_VALUE; *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!inited) return NOT_INITIALIZED; *n = 1; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!inited) return NOT_INITIALIZED;
    if (ordinal != 0) return INVALID_DEVICE;
    *d = 0;
    return OK;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    if (d != 0) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Stand-in Tesla T4");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!inited) return NOT_INITIALIZED;
    if (d != 0) return INVALID_DEVICE;
    *bytes = total();
    return OK;
}
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice d)
{
    (void)flags;
    if (!inited) return NOT_INITIALIZED;
    if (d != 0) return INVALID_DEVICE;
    *ctx = (CUcontext)0x1;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) { return cuCtxCreate_v2(ctx, 0, d); }
CUresult cuCtxSetCurrent(CUcontext ctx) { (void)ctx; return inited ? OK : NOT_INITIALIZED; }
CUresult cuCtxDestroy_v2(CUcontext ctx) { (void)ctx; return OK; }
CUresult cuCtxSynchronize(void) { return OK; }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size)
{
    static CUdeviceptr next = 0x7f0000000000ull;
    if (!inited) return NOT_INITIALIZED;
    if (!p || !size) return INVALID_VALUE;
    if (card((int64_t)size, NULL)) return OUT_OF_MEMORY;
    for (size_t i = 0; i < sizeof allocs / sizeof *allocs; i++)
        if (!allocs[i].ptr) {
            allocs[i].ptr = next;
            allocs[i].size = size;
            *p = next;
            next += (size + 0xfffff) & ~(CUdeviceptr)0xfffff;
            return OK;
        }
    card(-(int64_t)size, NULL);
    return OUT_OF_MEMORY;
}
CUresult cuMemFree_v2(CUdeviceptr p)
{
    for (size_t i = 0; i < sizeof allocs / sizeof *allocs; i++)
        if (allocs[i].ptr == p && p) {
            card(-(int64_t)allocs[i].size, NULL);
            allocs[i].ptr = 0;
            return OK;
        }
    return INVALID_VALUE;
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
CUresult cuStreamCreate(CUstream *s, unsigned flags) { (void)flags; *s = (CUstream)0x2; return inited ? OK : NOT_INITIALIZED; }
CUresult cuStreamDestroy_v2(CUstream s) { (void)s; return OK; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return OK; }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, CUstream s) { (void)s; return cuMemAlloc_v2(p, size); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return cuMemFree_v2(p); }

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

CUresult cuMemGetInfo_v2(size_t *free_, size_t *total_)
{
    uint64_t used;
    if (!inited) return NOT_INITIALIZED;
    card(0, &used);
    *free_ = total() - used;
    *total_ = total();
    return OK;
}
CUresult cuGetErrorName(CUresult e, const char **s)
{
    *s = e == OK ? "CUDA_SUCCESS" : e == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
       : e == NOT_INITIALIZED ? "CUDA_ERROR_NOT_INITIALIZED" : e == INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE"
       : "CUDA_ERROR_UNKNOWN";
    return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

static const struct { const char *name; void *fn; } TABLE[] = {
    {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount}, {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetName", (void *)cuDeviceGetName}, {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2},
    {"cuCtxCreate", (void *)cuCtxCreate_v2}, {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent}, {"cuCtxDestroy", (void *)cuCtxDestroy_v2},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize}, {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemFree", (void *)cuMemFree_v2}, {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuGetErrorName", (void *)cuGetErrorName}, {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2}, {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuStreamCreate", (void *)cuStreamCreate}, {"cuStreamDestroy", (void *)cuStreamDestroy_v2},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize}, {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync}, {"cuArrayCreate", (void *)cuArrayCreate_v2},
    {"cuArrayDestroy", (void *)cuArrayDestroy},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    (void)version; (void)flags;
    if (!symbol || !pfn) return INVALID_VALUE;
    if (!strcmp(symbol, "cuGetProcAddress")) {
        *pfn = (void *)cuGetProcAddress_v2;
        if (status) *status = 0;
        return OK;
    }
    for (size_t i = 0; i < sizeof TABLE / sizeof *TABLE; i++)
        if (!strcmp(symbol, TABLE[i].name)) {
            *pfn = TABLE[i].fn;
            if (status) *status = 0;  /* CU_GET_PROC_ADDRESS_SUCCESS */
            return OK;
        }
    *pfn = NULL;
    if (status) *status = 1;  /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}
