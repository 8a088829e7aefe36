/*
 * A stand-in libcuda.so.1 for the tests: no GPU here (native/Makefile, `stubs`).
 *
 * One card of CGPU_STUB_CUDA_MIB MiB (default 15109, a T4) whose memory is shared
 * by every process using it: its state is a file (CGPU_STUB_CUDA_STATE, default
 * /tmp/cgpu-stub-cuda.state) holding the bytes in use, changed under flock.
 * It answers what the CUDA driver API's clients need to allocate and ask about
 * memory: cuInit, versions, one device, contexts, cuMemAlloc_v2 / cuMemFree_v2
 * (fake device pointers, sizes kept per process), cuMemGetInfo_v2,
 * cuDeviceTotalMem_v2, pitched, managed and stream-ordered allocations (from the
 * default pool or a named one), cuMemCreate / cuMemRelease (device memory from the
 * card; host memory, CU_MEM_LOCATION_TYPE_HOST(_NUMA), not), arrays (2-D, 3-D and
 * mipmapped), streams, error names, and cuGetProcAddress / _v2 by name. Its
 * pitched, managed, stream-ordered and 2-D array allocators call its own exported
 * cuMemAlloc_v2 (through the PLT, so through an interposer): libcgpu must not
 * charge such a nested call twice. The pool, cuMemCreate, 3-D and mipmapped ones
 * and their frees take from the card directly, as a real driver does inside
 * itself: only libcgpu's own wrappers of them can charge them.
 *
 * Kernels: the card runs one kernel at a time, for everyone. A launch
 * (cuLaunchKernel, _ptsz, cooperative, cuLaunchKernelEx) takes gridX*gridY*gridZ
 * microseconds of the card (a graph, cuGraphLaunch: each of its kernels; stream capture and
 * graphs, and the driver's capture rules, are stubs/cuda_graphs.c's),
 * queued after whatever the card has (the state file's second word: when it is
 * next free); it returns at once, as a real launch does, but a process has at most
 * one kernel waiting behind its running one (a launch waits until its previous one
 * has started). cuCtxSynchronize / cuStreamSynchronize wait until the process's
 * last kernel has ended (asleep, spinning its last 200 µs, as the real driver's default
 * scheduling spins). With CGPU_STUB_CUDA_LOG set, each kernel appends
 * "pid start_ns end_ns" (CLOCK_MONOTONIC) to it; CGPU_STUB_CUDA_FAST=1 makes
 * launches free and instant (to time what an interposer adds). cuInit opens
 * CGPU_STUB_CUDA_DEVICE (a comma-separated list: each), if set, and keeps it open, as the real
 * driver keeps /dev/nvidiaN: the daemon sees the process use the GPU. CGPU_STUB_COLLECTIVE=1:
 * every kernel of the process is half of a collective across cards 0 and 1 (run_collective).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "cuda_stub.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101, NOT_SUPPORTED = 801,
       NOT_FOUND = 500 };

static int inited;
static struct { CUdeviceptr ptr; size_t size; int host, dev; } allocs[4096];  /* host: not on the card */

static uint64_t total(void)
{
    const char *m = getenv("CGPU_STUB_CUDA_MIB");
    return (uint64_t)(m && *m ? strtoull(m, NULL, 10) : 15109) << 20;
}

/* CGPU_STUB_CUDA_DEVICES cards (default 1), each of the same size; a thread's current
 * device is its current context's (cuCtxSetCurrent, cuCtxCreate, cuCtxPushCurrent),
 * device 0 until it makes one current. In the state file, card d keeps its bytes in use
 * at 16*d and when it is next free at 16*d + 8. */
static int devices(void)
{
    const char *n = getenv("CGPU_STUB_CUDA_DEVICES");
    int v = n && *n ? atoi(n) : 1;
    return v < 1 ? 1 : v > 16 ? 16 : v;
}
static __thread int cur_dev;

/* add `delta` to the bytes in use on the current device if it has room; 0 or -1 */
static int card_of(int dev, int64_t delta, uint64_t *used_out);
static int card(int64_t delta, uint64_t *used_out) { return card_of(cur_dev, delta, used_out); }
static int card_of(int dev, int64_t delta, uint64_t *used_out)
{
    const char *p = getenv("CGPU_STUB_CUDA_STATE");
    int fd = open(p && *p ? p : "/tmp/cgpu-stub-cuda.state", O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    flock(fd, LOCK_EX);
    uint64_t used = 0;
    if (pread(fd, &used, sizeof used, 16 * dev) != sizeof used)
        used = 0;
    int rc = 0;
    if (delta > 0 && used + (uint64_t)delta > total())
        rc = -1;
    else {
        used = delta < 0 && (uint64_t)-delta > used ? 0 : used + (uint64_t)delta;
        if (pwrite(fd, &used, sizeof used, 16 * dev) != sizeof used)
            rc = -1;
    }
    if (used_out)
        *used_out = used;
    flock(fd, LOCK_UN);
    close(fd);
    return rc;
}

CUresult cuInit(unsigned flags)
{
    static int device = -1;
    const char *dev = getenv("CGPU_STUB_CUDA_DEVICE");
    (void)flags;
    if (device < 0 && dev && *dev)  /* (a comma-separated list: each of them, a process on several GPUs) */
        for (const char *p = dev; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
            char one[4096];
            snprintf(one, sizeof one, "%.*s", (int)strcspn(p, ","), p);
            int fd = open(one, O_RDONLY | O_CLOEXEC);
            device = device < 0 ? fd : device;
        }
    inited = 1;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return INVALID_VALUE; *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!inited) return NOT_INITIALIZED; *n = devices(); return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!inited) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices()) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
/* Device d's UUID: the d-th of CGPU_STUB_CUDA_UUIDS ("GPU-8-4-4-4-12" hex, comma separated), as a
 * real driver says the UUIDs nvidia-smi shows; without it, CUDA_ERROR_NOT_SUPPORTED. */
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d)
{
    const char *list = getenv("CGPU_STUB_CUDA_UUIDS");
    if (!uuid) return INVALID_VALUE;
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    if (!list || !*list) return NOT_SUPPORTED;
    for (int i = 0; i < d && list; i++)
        list = (list = strchr(list, ',')) ? list + 1 : NULL;
    if (!list || strncmp(list, "GPU-", 4)) return INVALID_VALUE;
    int n = 0;
    for (const char *p = list + 4; *p && *p != ',' && n < 32; p++) {
        int v = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
        if (v < 0) continue;  /* (the dashes) */
        uuid[n / 2] = (unsigned char)(n % 2 ? (uuid[n / 2] | v) : v << 4);
        n++;
    }
    return n == 32 ? OK : INVALID_VALUE;
}
CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Stand-in Tesla T4");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!inited) return NOT_INITIALIZED;
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    *bytes = total();
    return OK;
}
/* a context is its device + 1 */
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    if (!inited) return NOT_INITIALIZED;
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    *ctx = (CUcontext)(uintptr_t)(d + 1);
    return OK;
}
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice d)
{
    (void)flags;
    CUresult r = cuDevicePrimaryCtxRetain(ctx, d);
    if (r == OK)
        cur_dev = d;
    return r;
}
CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (!inited) return NOT_INITIALIZED;
    if (ctx) cur_dev = (int)(uintptr_t)ctx - 1;
    return OK;
}
CUresult cuCtxGetDevice(CUdevice *d) { if (!d) return INVALID_VALUE; if (!inited) return NOT_INITIALIZED; *d = cur_dev; return OK; }
CUresult cuCtxDestroy_v2(CUcontext ctx) { (void)ctx; return OK; }
static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void sleep_until(uint64_t ns)
{
    struct timespec t = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL))
        ;
}

static uint64_t last_start, last_end;  /* this process's last kernel on the card */

/* The state file and the kernel log, opened once per process and kept (a launch is then
 * a lock, a read and a write, as cheap as a stand-in can make it). A forked child opens
 * its own: flock's lock belongs to the open file, which the child would share. */
static pthread_mutex_t kernel_files_lock = PTHREAD_MUTEX_INITIALIZER;
static int kernel_state_fd = -1, kernel_log_fd = -1;
static pid_t kernel_files_pid;
static char kernel_files_named[2][4096];  /* the paths they were opened by (the environment may change) */

static int kernel_files(int *log_fd)
{
    const char *p = getenv("CGPU_STUB_CUDA_STATE"), *log = getenv("CGPU_STUB_CUDA_LOG");
    p = p && *p ? p : "/tmp/cgpu-stub-cuda.state";
    log = log ? log : "";
    pthread_mutex_lock(&kernel_files_lock);
    if (kernel_files_pid != getpid() || strcmp(p, kernel_files_named[0]) || strcmp(log, kernel_files_named[1])) {
        if (kernel_state_fd >= 0) close(kernel_state_fd);
        if (kernel_log_fd >= 0) close(kernel_log_fd);
        kernel_state_fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        kernel_log_fd = *log ? open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666) : -1;
        snprintf(kernel_files_named[0], sizeof kernel_files_named[0], "%s", p);
        snprintf(kernel_files_named[1], sizeof kernel_files_named[1], "%s", log);
        kernel_files_pid = kernel_state_fd >= 0 ? getpid() : 0;
    }
    int fd = kernel_state_fd;
    *log_fd = kernel_log_fd;
    pthread_mutex_unlock(&kernel_files_lock);
    return fd;
}

/* A collective (CGPU_STUB_COLLECTIVE=1: every kernel of the process is one): a kernel on card 0
 * or 1 is half of one with the process's next kernel on the other card, as an all-reduce's ranks
 * are. The first half starts on its card as any kernel and holds it (spinning, the card's next
 * free time HELD) until its peer has started on the other; both end `us` after the later start.
 * Each half is logged "pid start end dev us" when the pair is complete: its time spinning is
 * end - start - us. Another kernel on a HELD card waits until it is free. */
#define HELD UINT64_MAX
static pthread_mutex_t collective_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { int on; uint64_t start, us; } half[2];  /* a half waiting for its peer, per card */

static int collective(void)
{
    const char *c = getenv("CGPU_STUB_COLLECTIVE");
    return c && *c == '1';
}

static void log_kernel(int lf, uint64_t start, uint64_t end, int dev, uint64_t us)
{
    if (lf < 0) return;
    char line[128];
    int n = dev < 0 ? snprintf(line, sizeof line, "%d %llu %llu\n", (int)getpid(), (unsigned long long)start,
                               (unsigned long long)end)
                    : snprintf(line, sizeof line, "%d %llu %llu %d %llu\n", (int)getpid(), (unsigned long long)start,
                               (unsigned long long)end, dev, (unsigned long long)us);
    if (write(lf, line, (size_t)n) < 0) { /* (a log, best effort) */ }
}

static CUresult run_collective(int fd, int lf, uint64_t us)
{
    int d = cur_dev, peer = 1 - cur_dev;
    if (d > 1) return INVALID_VALUE;
    for (;;) {
        pthread_mutex_lock(&collective_lock);
        flock(fd, LOCK_EX);
        uint64_t free_at = 0, now = now_ns();
        if (pread(fd, &free_at, sizeof free_at, 16 * d + 8) != sizeof free_at)
            free_at = 0;
        if (free_at != HELD) {
            uint64_t start = free_at > now ? free_at : now, end = HELD;
            if (half[peer].on) {  /* the pair is complete: both end together */
                uint64_t later = start > half[peer].start ? start : half[peer].start;
                end = later + (us > half[peer].us ? us : half[peer].us) * 1000;
                half[peer].on = 0;
                int bad = pwrite(fd, &end, sizeof end, 16 * peer + 8) != sizeof end;
                bad |= pwrite(fd, &end, sizeof end, 16 * d + 8) != sizeof end;
                log_kernel(lf, half[peer].start, end, peer, half[peer].us);
                log_kernel(lf, start, end, d, us);
                if (end > last_end) last_end = end;
                if (bad) end = 0;
            } else {
                half[d].on = 1;
                half[d].start = start;
                half[d].us = us;
                if (pwrite(fd, &end, sizeof end, 16 * d + 8) != sizeof end) end = 0;
            }
            last_start = start;
            flock(fd, LOCK_UN);
            pthread_mutex_unlock(&collective_lock);
            return end ? OK : OUT_OF_MEMORY;
        }
        flock(fd, LOCK_UN);
        pthread_mutex_unlock(&collective_lock);
        sleep_until(now_ns() + 50000);  /* the card is held by a collective waiting for its peer */
    }
}

static CUresult run_kernel(uint64_t us)
{
    const char *fast = getenv("CGPU_STUB_CUDA_FAST");
    if (!inited) return NOT_INITIALIZED;
    if (fast && *fast == '1') return OK;
    sleep_until(last_start);  /* one kernel waiting behind the running one, at most */
    int lf, fd = kernel_files(&lf);
    if (fd < 0) return OUT_OF_MEMORY;
    if (collective())
        return run_collective(fd, lf, us);
    uint64_t free_at = 0, now;
    for (;;) {
        flock(fd, LOCK_EX);
        now = now_ns();
        if (pread(fd, &free_at, sizeof free_at, 16 * cur_dev + 8) != sizeof free_at)
            free_at = 0;
        if (free_at != HELD)
            break;
        flock(fd, LOCK_UN);
        sleep_until(now + 50000);  /* held by another process's collective waiting for its peer */
    }
    uint64_t start = free_at > now ? free_at : now, end = start + us * 1000;
    int bad = pwrite(fd, &end, sizeof end, 16 * cur_dev + 8) != sizeof end;
    flock(fd, LOCK_UN);
    if (bad) return OUT_OF_MEMORY;
    last_start = start;
    last_end = end;
    log_kernel(lf, start, end, -1, us);
    return OK;
}

/* Wait for this process's last kernel to end: asleep until shortly before, then spinning, as the
 * real driver's default (CU_CTX_SCHED_AUTO: it spins while a process has no more contexts than
 * the machine has cores) returns as the work ends, not a timer's wake-up (~100 µs here) later. */
#define SYNC_SPIN_NS 200000ull
CUresult cuCtxSynchronize(void)
{
    CUresult r = stub_capture_forbids(NULL);  /* cuda_graphs.c: not during another's capture */
    if (r) return r;
    while (cur_dev < 2 && __atomic_load_n(&half[cur_dev].on, __ATOMIC_SEQ_CST))
        sleep_until(now_ns() + 50000);  /* a collective on this card waits for its peer */
    uint64_t end = last_end;
    if (end > SYNC_SPIN_NS)
        sleep_until(end - SYNC_SPIN_NS);
    while (now_ns() < end)
        ;
    return OK;
}
CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    if (!ctx) return INVALID_VALUE;
    *ctx = inited ? (CUcontext)(uintptr_t)(cur_dev + 1) : NULL;
    return OK;
}
static __thread int pushed[16], npushed;
CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    if (!inited) return NOT_INITIALIZED;
    if (npushed < 16) pushed[npushed++] = cur_dev;
    if (ctx) cur_dev = (int)(uintptr_t)ctx - 1;
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    if (!inited) return NOT_INITIALIZED;
    if (ctx) *ctx = (CUcontext)(uintptr_t)(cur_dev + 1);
    if (npushed) cur_dev = pushed[--npushed];
    return OK;
}

typedef void *CUfunction;
CUresult cuModuleGetFunction(CUfunction *f, void *module, const char *name) { return stub_module_function(f, module, name); }
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra)
{
    (void)f; (void)bx; (void)by; (void)bz; (void)shmem; (void)params; (void)extra;
    uint64_t us = (uint64_t)gx * (gy ? gy : 1) * (gz ? gz : 1);
    CUresult r;
    return stub_capture_launch(stream, &us, 1, &r) ? r : run_kernel(us);  /* (into a capture: recorded) */
}
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shmem, void *stream, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shmem, void *stream, void **params)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, NULL);
}
typedef struct { unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes; void *hStream; } launch_config;
CUresult cuLaunchKernelEx(const launch_config *c, CUfunction f, void **params, void **extra)
{
    (void)f; (void)params; (void)extra;
    if (!c) return INVALID_VALUE;
    uint64_t us = (uint64_t)c->gridDimX * (c->gridDimY ? c->gridDimY : 1) * (c->gridDimZ ? c->gridDimZ : 1);
    CUresult r;
    return stub_capture_launch(c->hStream, &us, 1, &r) ? r : run_kernel(us);
}
CUresult cuGraphLaunch(void *exec, void *stream) { return stub_graph_launch(exec, stream); }  /* cuda_graphs.c */
CUresult stub_run_kernel(uint64_t us) { return run_kernel(us); }

/* a new fake pointer (or handle) for `size` bytes, taken from card `dev` unless `host` */
static CUresult take_on(int dev, CUdeviceptr *p, size_t size, int host)
{
    static CUdeviceptr next = 0x7f0000000000ull;
    if (!host && card_of(dev, (int64_t)size, NULL)) return OUT_OF_MEMORY;
    for (size_t i = 0; i < sizeof allocs / sizeof *allocs; i++)
        if (!allocs[i].ptr) {
            allocs[i].ptr = next;
            allocs[i].size = size;
            allocs[i].host = host;
            allocs[i].dev = dev;
            *p = next;
            next += (size + 0xfffff) & ~(CUdeviceptr)0xfffff;
            return OK;
        }
    if (!host) card_of(dev, -(int64_t)size, NULL);
    return OUT_OF_MEMORY;
}
static CUresult take(CUdeviceptr *p, size_t size, int host) { return take_on(cur_dev, p, size, host); }
static __thread int ordered;
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size)
{
    if (!inited) return NOT_INITIALIZED;
    if (!p || !size) return INVALID_VALUE;
    CUresult r = ordered ? OK : stub_capture_forbids(NULL);
    if (r) return r;
    return take(p, size, 0);
}
static CUresult drop(CUdeviceptr p)
{
    for (size_t i = 0; i < sizeof allocs / sizeof *allocs; i++)
        if (allocs[i].ptr == p && p) {
            if (!allocs[i].host) card_of(allocs[i].dev, -(int64_t)allocs[i].size, NULL);
            allocs[i].ptr = 0;
            return OK;
        }
    return INVALID_VALUE;
}
CUresult cuMemFree_v2(CUdeviceptr p)
{
    CUresult r = p && !ordered ? stub_capture_forbids(NULL) : OK;
    return r ? r : p ? drop(p) : OK;
}  /* 0: nothing, as the driver (cudaFree(0) passes it on) */
/* the card's memory, not through the exported cuMemAlloc_v2 */
static CUresult device(CUdeviceptr *p, size_t size)
{
    if (!inited) return NOT_INITIALIZED;
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
CUresult cuStreamCreate(CUstream *s, unsigned flags);  /* cuda_graphs.c, as cuStreamDestroy_v2 */
CUresult cuStreamDestroy_v2(CUstream s);
CUresult cuStreamSynchronize(CUstream s)
{
    CUresult r = stub_capture_forbids(s);
    return r ? r : cuCtxSynchronize();
}
/* (ordered: inside a stream-ordered allocation, legal during a capture) */
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, CUstream s)
{
    (void)s;
    ordered++;
    CUresult r = cuMemAlloc_v2(p, size);
    ordered--;
    return r;
}
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    (void)s;
    ordered++;
    CUresult r = cuMemFree_v2(p);
    ordered--;
    return r;
}
typedef void *CUmemoryPool;
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    if (!inited) return NOT_INITIALIZED;
    if (d != 0) return INVALID_DEVICE;
    *pool = (CUmemoryPool)0x3;
    return OK;
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s)
{
    (void)s;
    if (!pool) return INVALID_VALUE;
    return device(p, size);
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
    if (!inited) return NOT_INITIALIZED;
    if (!h || !prop || !size || flags) return INVALID_VALUE;
    switch (prop->location.type) {
    case LOC_DEVICE:
        return prop->location.id >= 0 && prop->location.id < devices() ? take_on(prop->location.id, h, size, 0)
                                                                      : INVALID_DEVICE;
    case LOC_DEVICE_LOCALITY_DOMAIN:
        return prop->location.localized.deviceId == 0 && prop->location.localized.localityDomainId == 0
                   ? device(h, size) : INVALID_DEVICE;
    case LOC_HOST: case LOC_HOST_NUMA:
        return take(h, size, 1);  /* host memory: not the card's */
    default:
        return INVALID_VALUE;
    }
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return drop(h); }

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

/* For the other files of the stand-in (cuda_stub.h) */
int stub_inited(void) { return inited; }
int stub_device_count(void) { return devices(); }
int stub_current_device(void) { return cur_dev; }
CUresult stub_synchronize(void) { return cuCtxSynchronize(); }
uint64_t stub_work_end(void) { return last_end; }
int stub_find_alloc(CUdeviceptr p, size_t n, CUdeviceptr *base, size_t *size)
{
    for (size_t i = 0; i < sizeof allocs / sizeof *allocs; i++)
        if (allocs[i].ptr && !allocs[i].host && p >= allocs[i].ptr && p - allocs[i].ptr <= allocs[i].size
            && n <= allocs[i].size - (p - allocs[i].ptr)) {
            *base = allocs[i].ptr;
            *size = allocs[i].size;
            return 0;
        }
    return -1;
}

/* The driver's own `fn`, as a real cuGetProcAddress gives it: a hidden alias binds here, never to an
 * interposer's same-named export (the plain address would be libcgpu's when it is preloaded). */
#define OWN(fn) extern __typeof__(fn) own_##fn __attribute__((alias(#fn), visibility("hidden")))
OWN(cuMemAllocFromPoolAsync); OWN(cuMemCreate); OWN(cuMemRelease); OWN(cuArray3DCreate_v2);
OWN(cuMipmappedArrayCreate); OWN(cuMipmappedArrayDestroy);
OWN(cuLaunchKernel); OWN(cuLaunchKernel_ptsz); OWN(cuLaunchCooperativeKernel); OWN(cuLaunchKernelEx);
OWN(cuGraphLaunch);

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
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent}, {"cuCtxGetDevice", (void *)cuCtxGetDevice}, {"cuCtxPushCurrent", (void *)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", (void *)cuCtxPopCurrent_v2}, {"cuModuleGetFunction", (void *)cuModuleGetFunction},
    {"cuLaunchKernel", (void *)own_cuLaunchKernel}, {"cuLaunchCooperativeKernel", (void *)own_cuLaunchCooperativeKernel},
    {"cuLaunchKernelEx", (void *)own_cuLaunchKernelEx}, {"cuGraphLaunch", (void *)own_cuGraphLaunch},
    {"cuArrayDestroy", (void *)cuArrayDestroy}, {"cuDeviceGetDefaultMemPool", (void *)cuDeviceGetDefaultMemPool},
    {"cuMemAllocFromPoolAsync", (void *)own_cuMemAllocFromPoolAsync}, {"cuMemCreate", (void *)own_cuMemCreate},
    {"cuMemRelease", (void *)own_cuMemRelease}, {"cuArray3DCreate", (void *)own_cuArray3DCreate_v2},
    {"cuMipmappedArrayCreate", (void *)own_cuMipmappedArrayCreate},
    {"cuMipmappedArrayDestroy", (void *)own_cuMipmappedArrayDestroy},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    (void)version;
    if (!symbol || !pfn) return INVALID_VALUE;
    if (!strcmp(symbol, "cuGetProcAddress")) {
        *pfn = (void *)cuGetProcAddress_v2;
        if (status) *status = 0;
        return OK;
    }
    if ((flags & 2) && !strcmp(symbol, "cuLaunchKernel")) {  /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
        *pfn = (void *)own_cuLaunchKernel_ptsz;
        if (status) *status = 0;
        return OK;
    }
    if ((*pfn = stub_graphs_proc(symbol, version))) {  /* cuda_graphs.c: streams, capture and graphs */
        if (status) *status = 0;
        return OK;
    }
    for (size_t i = 0; i < sizeof TABLE / sizeof *TABLE; i++)
        if (!strcmp(symbol, TABLE[i].name)) {
            *pfn = TABLE[i].fn;
            if (status) *status = 0;  /* CU_GET_PROC_ADDRESS_SUCCESS */
            return OK;
        }
    if ((*pfn = stub_more_proc(symbol, version, flags))) {  /* cuda_export.c: what the real runtime asks for */
        if (status) *status = 0;
        return OK;
    }
    if (status) *status = 1;  /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}
