/*
 * libcgpu: the in-container interception library (docs/isolation.md), loaded
 * into a container's processes (LD_PRELOAD or /etc/ld.so.preload).
 *
 * This first part holds GPU memory to the container's memsize, to the byte and
 * across all its processes, and shows memsize as the card:
 *   - every allocator here — cuMemAlloc_v2, cuMemAllocPitch_v2 (charged for
 *     512-byte rows), cuMemAllocManaged, cuMemAllocAsync,
 *     cuMemAllocFromPoolAsync, cuMemCreate (device memory: location
 *     CU_MEM_LOCATION_TYPE_DEVICE or _DEVICE_LOCALITY_DOMAIN; host memory is
 *     not charged), cuArrayCreate_v2, cuArray3DCreate_v2 and
 *     cuMipmappedArrayCreate (every level) —
 *     charges the container's usage page BEFORE the real call
 *     (a compare-and-swap loop: racing processes can never pass memsize),
 *     allocates, and gives the charge back if the driver fails;
 *     past memsize: CUDA_ERROR_OUT_OF_MEMORY, nothing allocated;
 *   - cuMemFree_v2, cuMemFreeAsync, cuMemRelease, cuArrayDestroy and
 *     cuMipmappedArrayDestroy give it back, and so does a process's exit; a process
 *     killed without a chance to is given back by the next process that
 *     starts (its slot's pid is gone);
 *   - cuMemGetInfo_v2 -> (memsize - used, memsize), never an error when over;
 *     cuDeviceTotalMem_v2 -> memsize; nvmlDeviceGetMemoryInfo and _v2 ->
 *     total memsize, used the container's usage, free the rest (nvidia-smi);
 *     the real NVML is CGPU_REAL_LIBNVML, else libnvidia-ml.so.1.
 * It interposes the exported names, `dlsym` itself (what a client that
 * dlopens libcuda.so.1 finds), and cuGetProcAddress / _v2 (how CUDA >= 11.3
 * and NVIDIA's cuda-bindings resolve the driver), wrapping a returned
 * cuGetProcAddress. The real driver is dlopen'ed: CGPU_REAL_LIBCUDA, else
 * libcuda.so.1.
 *
 * Fail closed: with CGPU_PAGE_DIR set (the container asked for isolation) but
 * its pages missing, foreign or of another version, cuInit returns
 * CUDA_ERROR_NOT_INITIALIZED and one line on stderr says why; the process
 * never runs unisolated. Without CGPU_PAGE_DIR, a process of a container whose
 * pages are mounted at /run/cgpu (it cleared its environment; /etc/ld.so.preload
 * loaded the library) uses those; anywhere else it passes everything through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cgpu_page.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
enum { CU_OK = 0, CU_OUT_OF_MEMORY = 2, CU_NOT_INITIALIZED = 3 };

typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*total_fn)(size_t *, CUdevice);
typedef CUresult (*getproc_fn)(const char *, void **, int, uint64_t);
typedef CUresult (*pitch_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, void *);
typedef CUresult (*free_async_fn)(CUdeviceptr, void *);
typedef CUresult (*array_fn)(CUdeviceptr *, const void *);
typedef CUresult (*pool_alloc_fn)(CUdeviceptr *, size_t, void *, void *);
typedef CUresult (*mem_create_fn)(CUdeviceptr *, size_t, const void *, unsigned long long);
typedef CUresult (*mipmap_fn)(CUdeviceptr *, const void *, unsigned);
typedef CUresult (*getproc2_fn)(const char *, void **, int, uint64_t, int *);
typedef void *(*dlsym_fn)(void *, const char *);
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef int (*nvml_mem_fn)(void *, nvmlMemory_t *);
typedef int (*nvml_mem2_fn)(void *, nvmlMemory_v2_t *);
typedef int (*nvml_index_fn)(void *, unsigned int *);
typedef int (*nvml_uuid_fn)(void *, char *, unsigned int);
typedef CUresult (*device_uuid_fn)(unsigned char *, CUdevice);
typedef void *CUcontext;
typedef CUresult (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                              void **, void **);
typedef CUresult (*launch_coop_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   void *, void **);
typedef CUresult (*launch_ex_fn)(const void *, void *, void **, void **);
typedef CUresult (*graph_launch_fn)(void *, void *);
typedef CUresult (*ctx_get_fn)(CUcontext *);
typedef CUresult (*ctx_device_fn)(CUdevice *);
typedef CUresult (*ctx_push_fn)(CUcontext);
typedef CUresult (*ctx_sync_fn)(void);

static struct {
    void *lib;
    init_fn init;
    alloc_fn alloc;
    free_fn free;
    info_fn info;
    total_fn total;
    getproc_fn getproc;
    getproc2_fn getproc2;
    pitch_fn pitch;
    managed_fn managed;
    alloc_async_fn alloc_async;
    free_async_fn free_async;
    array_fn array;
    free_fn array_free;
    pool_alloc_fn pool_alloc;
    mem_create_fn mem_create;
    free_fn mem_release;
    array_fn array3d;
    mipmap_fn mipmap;
    free_fn mipmap_free;
    void *nvml;
    nvml_mem_fn nvml_mem;
    nvml_mem2_fn nvml_mem2;
    nvml_index_fn nvml_index;
    nvml_uuid_fn nvml_uuid;
    device_uuid_fn device_uuid;
    launch_fn launch, launch_ptsz;
    launch_coop_fn launch_coop, launch_coop_ptsz;
    launch_ex_fn launch_ex, launch_ex_ptsz;
    graph_launch_fn graph_launch, graph_launch_ptsz;
    ctx_get_fn ctx_get;
    ctx_device_fn ctx_get_device;
    ctx_push_fn ctx_push;
    ctx_get_fn ctx_pop;
    ctx_sync_fn ctx_sync;
} real;

static dlsym_fn real_dlsym;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static const struct cgpu_limits *limits;  /* read-only */
static int per_gpu;        /* the page has a gate per GPU (else the container's one gate) */
static int has_uuids;      /* the page names its GPUs' UUIDs (read once: written before its magic) */
static int dev_page[64];   /* per CUDA device: its page GPU once known; -2 not asked yet, -3 no UUID */
static int uuids_in_page(void);
static struct cgpu_usage *usage;
static struct cgpu_proc *mine;
static int asked;          /* CGPU_PAGE_DIR is set: this process must be isolated */
static char why[8192];     /* why the pages are not usable ("" when they are) */
static char page_dir[4096];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
/* >0 while this thread is inside the real driver: a driver that calls its own exported
 * functions (through its PLT, so through ours) must not be charged twice. */
static __thread int in_driver;
static struct { CUdeviceptr ptr; size_t size; int gpu; } table[8192];

static void *sym(const char *name)
{
    return real.lib && real_dlsym ? real_dlsym(real.lib, name) : NULL;
}

static int alive(int32_t pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH);
}

/* What a slot's process held back to the container, and the slot free. */
static void release(struct cgpu_proc *p)
{
    unsigned k = (unsigned)(p - usage->procs);
    __atomic_fetch_and(&usage->gated_slots[k / 32], ~(1u << (k % 32)), __ATOMIC_ACQ_REL);
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        uint64_t held = __atomic_exchange_n(&p->held[g], 0, __ATOMIC_ACQ_REL);
        if (held)
            __atomic_sub_fetch(&usage->used[g], held, __ATOMIC_ACQ_REL);
    }
    __atomic_store_n(&p->pid, 0, __ATOMIC_RELEASE);
}

/* A dead process's memory back to the container: clear its slot first (one finder wins). */
static void reclaim(struct cgpu_proc *p)
{
    int32_t pid = __atomic_load_n(&p->pid, __ATOMIC_ACQUIRE);
    if (pid <= 0 || alive(pid) || !__atomic_compare_exchange_n(&p->pid, &pid, -1, 0, __ATOMIC_ACQ_REL,
                                                                __ATOMIC_ACQUIRE))
        return;
    release(p);
}

/* Map `size` bytes of the page `name`, or `least` of an older, shorter one (*got: what was mapped). */
static void *map_least(const char *dir, const char *name, size_t size, size_t least, size_t *got, int writable)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, sizeof why, "%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) || (size_t)st.st_size < least) {
        snprintf(why, sizeof why, "%s is not a cgpud page (%lld bytes, %zu wanted)", path,
                 (long long)st.st_size, size);
        close(fd);
        return NULL;
    }
    size = (size_t)st.st_size < size ? least : size;
    *got = size;
    void *p = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(why, sizeof why, "%s: cannot map it: %s", path, strerror(errno));
        return NULL;
    }
    return p;
}

static void *map(const char *dir, const char *name, size_t size, int writable)
{
    size_t got;
    return map_least(dir, name, size, size, &got, writable);
}

/* A process slot of its own in the usage page (mine stays NULL if all are taken). */
static void claim_slot(void)
{
    mine = NULL;
    for (int i = 0; i < CGPU_MAX_PROCS && !mine; i++) {
        int32_t zero = 0;
        if (__atomic_compare_exchange_n(&usage->procs[i].pid, &zero, (int32_t)getpid(), 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            mine = &usage->procs[i];
            __atomic_store_n(&mine->gated, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&mine->acked, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&mine->gpus, 0, __ATOMIC_RELEASE);
        }
    }
}

static void forked(void);

static void setup(void)
{
    real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    const char *path = getenv("CGPU_REAL_LIBCUDA");
    real.lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    real.init = (init_fn)sym("cuInit");
    real.alloc = (alloc_fn)sym("cuMemAlloc_v2");
    real.free = (free_fn)sym("cuMemFree_v2");
    real.info = (info_fn)sym("cuMemGetInfo_v2");
    real.total = (total_fn)sym("cuDeviceTotalMem_v2");
    real.getproc = (getproc_fn)sym("cuGetProcAddress");
    real.getproc2 = (getproc2_fn)sym("cuGetProcAddress_v2");
    real.pitch = (pitch_fn)sym("cuMemAllocPitch_v2");
    real.managed = (managed_fn)sym("cuMemAllocManaged");
    real.alloc_async = (alloc_async_fn)sym("cuMemAllocAsync");
    real.free_async = (free_async_fn)sym("cuMemFreeAsync");
    real.array = (array_fn)sym("cuArrayCreate_v2");
    real.array_free = (free_fn)sym("cuArrayDestroy");
    real.launch = (launch_fn)sym("cuLaunchKernel");
    real.launch_ptsz = (launch_fn)sym("cuLaunchKernel_ptsz");
    real.launch_coop = (launch_coop_fn)sym("cuLaunchCooperativeKernel");
    real.launch_coop_ptsz = (launch_coop_fn)sym("cuLaunchCooperativeKernel_ptsz");
    real.launch_ex = (launch_ex_fn)sym("cuLaunchKernelEx");
    real.launch_ex_ptsz = (launch_ex_fn)sym("cuLaunchKernelEx_ptsz");
    real.graph_launch = (graph_launch_fn)sym("cuGraphLaunch");
    real.graph_launch_ptsz = (graph_launch_fn)sym("cuGraphLaunch_ptsz");
    real.ctx_get = (ctx_get_fn)sym("cuCtxGetCurrent");
    real.ctx_get_device = (ctx_device_fn)sym("cuCtxGetDevice");
    real.device_uuid = (device_uuid_fn)sym("cuDeviceGetUuid_v2");
    if (!real.device_uuid)
        real.device_uuid = (device_uuid_fn)sym("cuDeviceGetUuid");
    real.ctx_push = (ctx_push_fn)sym("cuCtxPushCurrent_v2");
    real.ctx_pop = (ctx_get_fn)sym("cuCtxPopCurrent_v2");
    real.ctx_sync = (ctx_sync_fn)sym("cuCtxSynchronize");
    real.pool_alloc = (pool_alloc_fn)sym("cuMemAllocFromPoolAsync");
    real.mem_create = (mem_create_fn)sym("cuMemCreate");
    real.mem_release = (free_fn)sym("cuMemRelease");
    real.array3d = (array_fn)sym("cuArray3DCreate_v2");
    real.mipmap = (mipmap_fn)sym("cuMipmappedArrayCreate");
    real.mipmap_free = (free_fn)sym("cuMipmappedArrayDestroy");
    const char *npath = getenv("CGPU_REAL_LIBNVML");
    real.nvml = dlopen(npath && *npath ? npath : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (real.nvml && real_dlsym) {
        real.nvml_mem = (nvml_mem_fn)real_dlsym(real.nvml, "nvmlDeviceGetMemoryInfo");
        real.nvml_mem2 = (nvml_mem2_fn)real_dlsym(real.nvml, "nvmlDeviceGetMemoryInfo_v2");
        real.nvml_index = (nvml_index_fn)real_dlsym(real.nvml, "nvmlDeviceGetIndex");
        real.nvml_uuid = (nvml_uuid_fn)real_dlsym(real.nvml, "nvmlDeviceGetUUID");
    }

    const char *dir = getenv("CGPU_PAGE_DIR");
    if ((!dir || !*dir) && access("/run/cgpu/limits", F_OK) == 0)
        dir = "/run/cgpu";  /* a container's (cgpu-runtime's mount): its processes are isolated, environment or not */
    asked = dir && *dir;
    if (!asked)
        return;
    snprintf(page_dir, sizeof page_dir, "%s", dir);
    size_t got = 0;
    limits = map_least(dir, "limits", sizeof *limits, CGPU_LIMITS_SHARED_GATE, &got, 0);
    per_gpu = got == sizeof *limits;
    for (int i = 0; i < 64; i++)
        dev_page[i] = -2;
    if (limits && (limits->magic != CGPU_MAGIC || limits->version != CGPU_VERSION
                   || limits->ngpus == 0 || limits->ngpus > CGPU_MAX_GPUS)) {
        snprintf(why, sizeof why, "%s/limits is %s", dir,
                 limits->magic != CGPU_MAGIC ? "not a cgpud page (foreign magic)"
                 : limits->version != CGPU_VERSION ? "of another version of cgpud: restart the container"
                 : "malformed (its GPU count)");
        limits = NULL;
    }
    if (!limits)
        return;
    usage = map(dir, "usage", sizeof *usage, 1);
    if (usage && (usage->magic != CGPU_MAGIC || usage->version != CGPU_VERSION)) {
        snprintf(why, sizeof why, "%s/usage is not a cgpud usage page of this version", dir);
        usage = NULL;
    }
    if (!usage) {
        limits = NULL;
        return;
    }
    for (int i = 0; i < CGPU_MAX_PROCS; i++)
        reclaim(&usage->procs[i]);
    claim_slot();
    pthread_atfork(NULL, NULL, forked);
    if (!mine) {
        snprintf(why, sizeof why, "%s/usage has no free process slot (%d processes use the GPU)", dir,
                 CGPU_MAX_PROCS);
        limits = NULL;
        usage = NULL;
    }
    why[0] = limits ? 0 : why[0];
    has_uuids = limits && uuids_in_page();
}

/* At exit the driver frees what the process held: so does its page. */
__attribute__((destructor)) static void give_back(void)
{
    if (mine && usage)
        release(mine);
}

static int isolated(void)
{
    pthread_once(&once, setup);
    return limits != NULL;
}

/* The page's GPU of a CUDA device. With the GPUs' UUIDs in the page: the one whose UUID the
 * driver gives the device, whatever order CUDA numbers them in (CUDA_DEVICE_ORDER). Without
 * them, from a driver that cannot say a UUID, or for a UUID the page does not name (a MIG
 * device's is its own): device k is GPU k of the page, -1 past the page's (a GPU given whole),
 * as before UUIDs: a device is never less held for them. */

static int uuids_in_page(void)
{
    static const unsigned char zero[16];
    if (!per_gpu)
        return 0;
    for (uint32_t k = 0; k < limits->ngpus; k++)
        if (memcmp(limits->uuid[k], zero, 16))
            return 1;
    return 0;
}

static int uuid_to_page(const unsigned char *u)
{
    for (uint32_t k = 0; k < limits->ngpus; k++)
        if (!memcmp(limits->uuid[k], u, 16))
            return (int)k;
    return -1;
}

static int page_index(int dev)
{
    if (dev < 0)
        return -1;
    if (dev < 64 && real.device_uuid && has_uuids) {
        int k = __atomic_load_n(&dev_page[dev], __ATOMIC_RELAXED);
        if (k == -2) {
            unsigned char u[16];
            k = real.device_uuid(u, dev) == CU_OK ? uuid_to_page(u) : -3;
            k = k == -1 ? -3 : k;
            __atomic_store_n(&dev_page[dev], k, __ATOMIC_RELAXED);
        }
        if (k != -3)
            return k;
    }
    return (uint32_t)dev < limits->ngpus ? dev : -1;
}

/* The page's GPU of the calling thread's current context (see page_index). */
static int current_gpu(void)
{
    CUdevice dev = 0;
    if (!real.ctx_get_device || real.ctx_get_device(&dev) != CU_OK)
        return 0;  /* (no context yet: the driver refuses the allocation itself) */
    return page_index(dev);
}

CUresult cuInit(unsigned flags)
{
    pthread_once(&once, setup);
    if (asked && !limits) {
        fprintf(stderr, "cgpu: GPU isolation was asked for but cannot be applied (%s): CUDA is not started\n", why);
        return CU_NOT_INITIALIZED;
    }
    return real.init ? real.init(flags) : CU_NOT_INITIALIZED;
}

/* Reserve `size` on GPU g before the driver is asked: racing processes can never pass memsize together. */
static int reserve(int g, size_t size)
{
    uint64_t cap = limits->memsize[g], used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
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

/* The driver gave it: this process holds it, and its size is kept for the free. */
static void commit(int g, CUdeviceptr key, size_t size)
{
    __atomic_add_fetch(&mine->held[g], size, __ATOMIC_ACQ_REL);
    pthread_mutex_lock(&table_lock);
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!table[i].ptr) {
            table[i].ptr = key;
            table[i].size = size;
            table[i].gpu = g;
            break;
        }
    pthread_mutex_unlock(&table_lock);
}

/* Freed: what it held comes back (nothing for a pointer we never saw). */
static void forget(CUdeviceptr key)
{
    size_t size = 0;
    int g = 0;
    pthread_mutex_lock(&table_lock);
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (table[i].ptr == key && key) {
            size = table[i].size;
            g = table[i].gpu;
            table[i].ptr = 0;
            break;
        }
    pthread_mutex_unlock(&table_lock);
    if (size) {
        __atomic_sub_fetch(&mine->held[g], size, __ATOMIC_ACQ_REL);
        refund(g, size);
    }
}

/* An allocation of `size` bytes done by `call` (the real driver's), held to memsize on the page's
 * GPU `gpu` (-1: a GPU given whole, not charged). */
#define CHARGED(size, key, call) CHARGED_ON(current_gpu(), size, key, call)
#define CHARGED_ON(gpu, size, key, call)                                                \
    do {                                                                                 \
        int g_ = (gpu);                                                                  \
        if (g_ < 0)                                                                      \
            return (call); /* a GPU given whole: the driver's to hold */                 \
        if (!reserve(g_, (size)))                                                        \
            return CU_OUT_OF_MEMORY;                                                     \
        in_driver++;                                                                     \
        CUresult r_ = (call);                                                            \
        in_driver--;                                                                     \
        if (r_ != CU_OK) {                                                               \
            refund(g_, (size));                                                          \
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

#define PASS_THROUGH(fn, ...)                                                                      \
    do {                                                                                           \
        if (in_driver)                                                                             \
            return (fn) ? (fn)(__VA_ARGS__) : CU_NOT_INITIALIZED;                                  \
        if (!isolated())                                                                           \
            return asked ? CU_NOT_INITIALIZED : (fn) ? (fn)(__VA_ARGS__) : CU_NOT_INITIALIZED;     \
        if (!(fn))                                                                                 \
            return CU_NOT_INITIALIZED; /* a driver without it (older): nothing to call */          \
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

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, void *stream)
{
    PASS_THROUGH(real.alloc_async, p, size, stream);
    CHARGED(size, *p, real.alloc_async(p, size, stream));
}

CUresult cuMemFreeAsync(CUdeviceptr p, void *stream)
{
    PASS_THROUGH(real.free_async, p, stream);
    RELEASED(p, real.free_async(p, stream));
}

/* From a named pool (CUmemoryPool), stream-ordered: freed by cuMemFreeAsync. */
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t size, void *pool, void *stream)
{
    PASS_THROUGH(real.pool_alloc, p, size, pool, stream);
    CHARGED(size, *p, real.pool_alloc(p, size, pool, stream));
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

CUresult cuMemGetInfo_v2(size_t *free_, size_t *total_)
{
    if (!isolated())
        return asked ? CU_NOT_INITIALIZED : real.info ? real.info(free_, total_) : CU_NOT_INITIALIZED;
    int g = current_gpu();
    size_t f, t;
    CUresult r = real.info(&f, &t);  /* (the driver must answer: a context exists) */
    if (r != CU_OK || g < 0) {  /* (a GPU given whole: as the driver says) */
        if (r == CU_OK)
            *free_ = f, *total_ = t;
        return r;
    }
    uint64_t cap = limits->memsize[g], used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE);
    *total_ = cap;
    *free_ = used >= cap ? 0 : cap - used;  /* never an error when over */
    if (*free_ > f)
        *free_ = f;  /* nor more than the card has left */
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

/* ---- compute: kernel launches wait at the container's gate ----------------------------
 *
 * The daemon closes the gate (makes it even) when the container's slice ends and
 * opens it (odd, and a FUTEX_WAKE) when the next begins. A launch that finds it
 * closed waits on it with a futex: no polling, no sleep steps; the CPU side of the
 * process runs on. A helper thread, started with the first launch, answers each
 * closing: once no thread is inside a launch, it synchronizes every context the
 * process launched in (the work it had already queued is done), writes the closed
 * gate's value into the process's `acked` and a byte into the `drained` FIFO, so
 * the daemon can start the next container's slice knowing the GPU is free. */

/* Threads of this process inside a launch now: [0] on the container's gate, [1 + k] on GPU k's. */
static unsigned launching[1 + CGPU_MAX_GPUS];
static pthread_once_t helper_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctxs[64];
static int ctx_gpu[64];  /* the page's GPU of each (-1: past the page's) */
static int nctxs;
static __thread CUcontext known_ctx;  /* the last context this thread was seen to launch in */
static __thread int known_gpu;        /* and its page GPU */

/* The gate a launch on page GPU `k` waits at (-1: the container's). */
static const uint32_t *gate_word(int k)
{
    return k >= 0 ? &limits->gpu_gate[k] : &limits->gate;
}

static uint32_t gate_value(int k)
{
    return __atomic_load_n(gate_word(k), __ATOMIC_SEQ_CST);
}

/* Sleep while `word` still reads `seen` (any change wakes it). */
static void futex_wait_on(const uint32_t *word, uint32_t seen)
{
    /* (a read-only shared mapping: the futex is keyed by the file, so the daemon's wake reaches it) */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, NULL, NULL, 0);
}

/* The page GPU the calling thread launches on (its current context's device), -1 for the
 * container's gate: a page without per-GPU gates, or a device past the page's. The device is
 * asked at every launch (a context's address may come back for another device once destroyed). */
static int note_context(void)
{
    CUcontext c = NULL;
    if (!real.ctx_get || real.ctx_get(&c) != CU_OK || !c)
        return per_gpu ? 0 : -1;  /* (no context: the driver refuses the launch itself) */
    CUdevice dev = -1;
    int k = -1;
    if (per_gpu && real.ctx_get_device && real.ctx_get_device(&dev) == CU_OK)
        k = page_index(dev);
    if (c == known_ctx && k == known_gpu)
        return k;
    known_ctx = c;
    known_gpu = k;
    pthread_mutex_lock(&ctx_lock);
    int i = 0;
    while (i < nctxs && ctxs[i] != c)
        i++;
    if (i < nctxs)
        ctx_gpu[i] = k;  /* (drained with that GPU from now on) */
    else if (nctxs < (int)(sizeof ctxs / sizeof *ctxs)) {
        ctx_gpu[nctxs] = k;
        ctxs[nctxs++] = c;
    }
    pthread_mutex_unlock(&ctx_lock);
    return k;
}

/* Finish the work queued on page GPU `k` (all of it for -1): once no launch there is in
 * flight, synchronize the contexts of that GPU. */
static void drain(int k)
{
    while (__atomic_load_n(&launching[1 + k], __ATOMIC_SEQ_CST))
        sched_yield();  /* a launch that passed the gate before it closed: a few µs */
    pthread_mutex_lock(&ctx_lock);
    in_driver++;
    for (int i = 0; i < nctxs && real.ctx_push && real.ctx_pop && real.ctx_sync; i++) {
        CUcontext prev;
        if ((k < 0 || ctx_gpu[i] == k) && real.ctx_push(ctxs[i]) == CU_OK) {
            real.ctx_sync();
            real.ctx_pop(&prev);
        }
    }
    in_driver--;
    pthread_mutex_unlock(&ctx_lock);
}

/* Tell the daemon: `acked` says which closing was answered, a byte in the FIFO wakes it. */
static void answer(uint32_t closing)
{
    static int fifo = -1;
    __atomic_store_n(&mine->acked, closing, __ATOMIC_SEQ_CST);
    if (fifo < 0) {
        char path[4200];
        snprintf(path, sizeof path, "%s/drained", page_dir);
        fifo = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);  /* (no reader: the daemon is away; later) */
    }
    if (fifo >= 0 && write(fifo, "d", 1) < 0 && errno != EAGAIN) {
        close(fifo);
        fifo = -1;
    }
}

static void *gate_helper(void *arg)
{
    (void)arg;
    /* The next container's slice waits for this thread's answer: its timed waits (a driver that
     * synchronizes by sleeping) end when due, not up to the default 50 µs of timer slack later. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    for (;;) {
        if (!per_gpu) {  /* the container's one gate: answer each closing with its value */
            uint32_t g = gate_value(-1);
            if (!(g & 1) && __atomic_load_n(&mine->acked, __ATOMIC_ACQUIRE) != g) {
                drain(-1);
                answer(g);
            }
            futex_wait_on(&limits->gate, g);
            continue;
        }
        /* per GPU: at each closing (of any GPU's gate), drain the GPUs it launches on whose
         * gates are closed now, and answer with the count of closings */
        uint32_t c = __atomic_load_n(&limits->closings, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&mine->acked, __ATOMIC_ACQUIRE) != c) {
            uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST);
            for (uint32_t k = 0; k < limits->ngpus; k++)
                if (on & (1u << k) && !(gate_value((int)k) & 1))
                    drain((int)k);
            answer(c);
        }
        futex_wait_on(&limits->closings, c);
    }
    return NULL;
}

static void start_helper(void)
{
    pthread_t t;
    pthread_attr_t a;
    sigset_t all, old;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 64 << 10);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  /* signals stay with the process's own threads */
    if (pthread_create(&t, &a, gate_helper, NULL) == 0) {
        unsigned k = (unsigned)(mine - usage->procs);
        __atomic_store_n(&mine->gated, per_gpu ? 2 : 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_or(&usage->gated_slots[k / 32], 1u << (k % 32), __ATOMIC_SEQ_CST);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
}

/* Pass the gate of page GPU `k` (-1: the container's): on return this thread counts in
 * launching[1 + k] and the gate was open. The process says it launches on GPU k before it
 * looks at the gate, so a closing either sees it (and waits for its answer) or stops it. */
static void gate_enter(int k)
{
    pthread_once(&helper_once, start_helper);
    if (k >= 0 && !(__atomic_load_n(&mine->gpus, __ATOMIC_RELAXED) & (1u << k)))
        __atomic_fetch_or(&mine->gpus, 1u << k, __ATOMIC_SEQ_CST);
    for (;;) {
        __atomic_add_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
        uint32_t g = gate_value(k);
        if (g & 1)
            return;
        __atomic_sub_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
        futex_wait_on(gate_word(k), g);
    }
}

#define GATED(fn, ...)                                          \
    do {                                                        \
        PASS_THROUGH(fn, __VA_ARGS__);                          \
        if (!(fn))                                              \
            return CU_NOT_INITIALIZED;                          \
        int k_ = note_context();                                \
        gate_enter(k_);                                         \
        in_driver++;                                            \
        CUresult r_ = (fn)(__VA_ARGS__);                        \
        in_driver--;                                            \
        __atomic_sub_fetch(&launching[1 + k_], 1, __ATOMIC_SEQ_CST); \
        return r_;                                              \
    } while (0)

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra)
{
    GATED(real.launch, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shmem, void *stream, void **params, void **extra)
{
    GATED(real.launch_ptsz, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shmem, void *stream, void **params)
{
    GATED(real.launch_coop, f, gx, gy, gz, bx, by, bz, shmem, stream, params);
}

CUresult cuLaunchCooperativeKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                        unsigned bz, unsigned shmem, void *stream, void **params)
{
    GATED(real.launch_coop_ptsz, f, gx, gy, gz, bx, by, bz, shmem, stream, params);
}

CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra)
{
    GATED(real.launch_ex, config, f, params, extra);
}

CUresult cuLaunchKernelEx_ptsz(const void *config, void *f, void **params, void **extra)
{
    GATED(real.launch_ex_ptsz, config, f, params, extra);
}

CUresult cuGraphLaunch(void *exec, void *stream)
{
    GATED(real.graph_launch, exec, stream);
}

CUresult cuGraphLaunch_ptsz(void *exec, void *stream)
{
    GATED(real.graph_launch_ptsz, exec, stream);
}

/* A forked child holds nothing yet, has no helper thread, and needs a slot of its own. */
static void forked(void)
{
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    helper_once = fresh;
    memset(launching, 0, sizeof launching);
    nctxs = 0;
    known_ctx = NULL;
    memset(table, 0, sizeof table);  /* what the parent allocated is the parent's */
    if (!usage)
        return;
    claim_slot();
    if (!mine)
        limits = NULL;  /* (its cuInit then fails closed, as at a start with no slot) */
}

/* ---- NVML: what nvidia-smi and NVML clients see ------------------------------------ */

enum { NVML_OK = 0, NVML_UNINITIALIZED = 1, NVML_NOT_SUPPORTED = 3, NVML_UNKNOWN = 999 };

/* total = memsize, used = the container's usage, free = the rest (never negative) */
/* "GPU-8-4-4-4-12" hex digits (NVML's UUID) into 16 bytes; 0 if it is not one */
static int parse_uuid(const char *text, unsigned char *u)
{
    int n = 0;
    if (strncmp(text, "GPU-", 4))
        return 0;
    for (const char *p = text + 4; *p && n < 32; p++) {
        int v = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10
              : *p >= 'A' && *p <= 'F' ? *p - 'A' + 10 : *p == '-' ? -1 : -2;
        if (v == -2)
            return 0;
        if (v >= 0) {
            u[n / 2] = (unsigned char)(n % 2 ? (u[n / 2] | v) : v << 4);
            n++;
        }
    }
    return n == 32;
}

/* The page's GPU of an NVML device: by UUID when the page names it, else by NVML's index. */
static int nvml_page_index(void *dev)
{
    char text[96];
    unsigned char u[16];
    unsigned int idx;
    int k;
    if (has_uuids && real.nvml_uuid && real.nvml_uuid(dev, text, sizeof text) == NVML_OK && parse_uuid(text, u)
        && (k = uuid_to_page(u)) >= 0)
        return k;
    if (!real.nvml_index || real.nvml_index(dev, &idx) != NVML_OK || idx >= limits->ngpus)
        return -1;
    return (int)idx;
}

static int nvml_view(void *dev, unsigned long long *total, unsigned long long *free_, unsigned long long *used_)
{
    int k = nvml_page_index(dev);
    if (k < 0)
        return 0;
    unsigned int idx = (unsigned int)k;
    uint64_t cap = limits->memsize[idx], used = __atomic_load_n(&usage->used[idx], __ATOMIC_ACQUIRE);
    *total = cap;
    *used_ = used > cap ? cap : used;
    *free_ = cap - *used_;
    return 1;
}

int nvmlDeviceGetMemoryInfo(void *dev, nvmlMemory_t *mem)
{
    pthread_once(&once, setup);
    if (asked && !limits)
        return NVML_UNKNOWN;
    if (!real.nvml_mem)
        return NVML_NOT_SUPPORTED;
    int r = real.nvml_mem(dev, mem);
    if (r == NVML_OK && limits)
        nvml_view(dev, &mem->total, &mem->free, &mem->used);
    return r;
}

int nvmlDeviceGetMemoryInfo_v2(void *dev, nvmlMemory_v2_t *mem)
{
    pthread_once(&once, setup);
    if (asked && !limits)
        return NVML_UNKNOWN;
    if (!real.nvml_mem2)
        return NVML_NOT_SUPPORTED;
    int r = real.nvml_mem2(dev, mem);
    if (r == NVML_OK && limits && nvml_view(dev, &mem->total, &mem->free, &mem->used))
        mem->reserved = 0;
    return r;
}

/* ---- how clients find the functions -------------------------------------------- */

static void *ours(const char *name)
{
    static const struct { const char *name; void *fn; } T[] = {
        {"cuInit", (void *)cuInit},
        {"cuMemAlloc", (void *)cuMemAlloc_v2}, {"cuMemAlloc_v2", (void *)cuMemAlloc_v2},
        {"cuMemFree", (void *)cuMemFree_v2}, {"cuMemFree_v2", (void *)cuMemFree_v2},
        {"cuMemGetInfo", (void *)cuMemGetInfo_v2}, {"cuMemGetInfo_v2", (void *)cuMemGetInfo_v2},
        {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2}, {"cuDeviceTotalMem_v2", (void *)cuDeviceTotalMem_v2},
        {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2}, {"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2},
        {"cuMemAllocManaged", (void *)cuMemAllocManaged},
        {"cuMemAllocAsync", (void *)cuMemAllocAsync}, {"cuMemFreeAsync", (void *)cuMemFreeAsync},
        {"cuArrayCreate", (void *)cuArrayCreate_v2}, {"cuArrayCreate_v2", (void *)cuArrayCreate_v2},
        {"cuArrayDestroy", (void *)cuArrayDestroy},
        {"cuLaunchKernel", (void *)cuLaunchKernel}, {"cuLaunchKernel_ptsz", (void *)cuLaunchKernel_ptsz},
        {"cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel},
        {"cuLaunchCooperativeKernel_ptsz", (void *)cuLaunchCooperativeKernel_ptsz},
        {"cuLaunchKernelEx", (void *)cuLaunchKernelEx}, {"cuLaunchKernelEx_ptsz", (void *)cuLaunchKernelEx_ptsz},
        {"cuGraphLaunch", (void *)cuGraphLaunch}, {"cuGraphLaunch_ptsz", (void *)cuGraphLaunch_ptsz},
        {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
        {"cuMemCreate", (void *)cuMemCreate}, {"cuMemRelease", (void *)cuMemRelease},
        {"cuArray3DCreate", (void *)cuArray3DCreate_v2}, {"cuArray3DCreate_v2", (void *)cuArray3DCreate_v2},
        {"cuMipmappedArrayCreate", (void *)cuMipmappedArrayCreate},
        {"cuMipmappedArrayDestroy", (void *)cuMipmappedArrayDestroy},
        {"nvmlDeviceGetMemoryInfo", (void *)nvmlDeviceGetMemoryInfo},
        {"nvmlDeviceGetMemoryInfo_v2", (void *)nvmlDeviceGetMemoryInfo_v2},
    };
    for (size_t i = 0; i < sizeof T / sizeof *T; i++)
        if (!strcmp(name, T[i].name))
            return T[i].fn;
    return NULL;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status);

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    pthread_once(&once, setup);
    CUresult r = real.getproc2 ? real.getproc2(symbol, pfn, version, flags, status)
               : real.getproc ? real.getproc(symbol, pfn, version, flags) : CU_NOT_INITIALIZED;
    if (r != CU_OK || !symbol || !pfn)
        return r;
    if (!strcmp(symbol, "cuGetProcAddress"))  /* the one it returns must be ours too */
        *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    else if (ours(symbol)) {
        char ptsz[128];
        snprintf(ptsz, sizeof ptsz, "%s_ptsz", symbol);
        void *alt = sym(ptsz);  /* the driver chose the per-thread default stream's: so do we */
        *pfn = alt && *pfn == alt && ours(ptsz) ? ours(ptsz) : ours(symbol);
    }
    return r;
}

void *dlsym(void *handle, const char *name)
{
    pthread_once(&once, setup);
    if (!strncmp(name, "cu", 2) || !strncmp(name, "nvmlDeviceGetMemoryInfo", 23)) {
        if (!strcmp(name, "cuGetProcAddress"))
            return (void *)cuGetProcAddress;
        if (!strcmp(name, "cuGetProcAddress_v2"))
            return (void *)cuGetProcAddress_v2;
        void *fn = ours(name);
        if (fn && real_dlsym && real_dlsym(handle, name))  /* only where the real driver has it */
            return fn;
    }
    return real_dlsym ? real_dlsym(handle, name) : NULL;
}
