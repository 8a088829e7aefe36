/*
 * libcgpu's internal header: what its parts share (docs/isolation.md). The library is split by
 * concern, as HAMi-core splits its src/, in layers that call down, never up:
 *   driver.c     the bottom: the real driver's and NVML's functions and their loading, the C
 *                library's dlsym, whether this thread is inside the driver (in_driver);
 *   threads.c    this process's threads as the launch path sees them: a record each (inside
 *                which gate, reading which table), so the launch path takes no process-wide lock;
 *   page.c       the shared pages (cgpu_page.h): setting up (the driver, then the pages), process
 *                slots, a dead process's memory back, which page GPU a CUDA device is;
 *   memory.c     charge and refund: every allocator and free, the allocations' sizes, the
 *                driver's own memory as it grows, cuMemGetInfo and cuDeviceTotalMem (memory.c on
 *                top of pools.c, vmm.c, modules.c: one file per concern, cgpu_memory.h);
 *   gate.c       compute: kernel launches wait at the gate (futex), the helper thread drains
 *                and answers the daemon's closings (gate.c on top of clock.c, contexts.c,
 *                gang.c, charge.c, queue.c, drain.c: one file per concern, cgpu_compute.h);
 *   nvml.c       the container's view through NVML (nvidia-smi), and the driver's process list
 *                at the ioctl;
 *   interpose.c  the top: only how clients reach us — the exported names' table, dlsym,
 *                cuGetProcAddress, cuInit, ioctl — and what a fork resets in each part.
 * Everything declared here is hidden: only the CUDA/NVML names, dlsym and ioctl are exported.
 */
#ifndef CGPU_INTERNAL_H
#define CGPU_INTERNAL_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cgpu_page.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
enum { CU_OK = 0, CU_OUT_OF_MEMORY = 2, CU_NOT_INITIALIZED = 3, CU_LAUNCH_OUT_OF_RESOURCES = 701 };

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
typedef CUresult (*mem_map_fn)(CUdeviceptr, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*mem_unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*mem_retain_fn)(CUdeviceptr *, void *);
typedef CUresult (*getproc2_fn)(const char *, void **, int, uint64_t, int *);
typedef void *(*dlsym_fn)(void *, const char *);
typedef CUresult (*module_load_fn)(void **, const void *);  /* cuModuleLoad (a path), _LoadData, _LoadFatBinary */
typedef CUresult (*module_load_ex_fn)(void **, const void *, unsigned, void *, void **);
typedef CUresult (*library_load_fn)(void **, const void *, void *, void **, unsigned, void *, void **, unsigned);
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
typedef CUresult (*primary_retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*ctx_create2_fn)(CUcontext *, unsigned, CUdevice);
typedef CUresult (*ctx_create3_fn)(CUcontext *, void *, int, unsigned, CUdevice);
typedef CUresult (*ctx_create4_fn)(CUcontext *, void *, unsigned, CUdevice);

struct real_driver {
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
    alloc_async_fn alloc_async, alloc_async_ptsz;
    free_async_fn free_async, free_async_ptsz;
    array_fn array;
    free_fn array_free;
    pool_alloc_fn pool_alloc, pool_alloc_ptsz;
    mem_create_fn mem_create;
    free_fn mem_release;
    mem_map_fn mem_map;
    mem_unmap_fn mem_unmap;
    mem_retain_fn mem_retain;
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
    primary_retain_fn primary_retain;
    ctx_create2_fn ctx_create2;
    ctx_create3_fn ctx_create3;
    ctx_create4_fn ctx_create4;
    module_load_fn module_load, module_load_data, module_load_fatbin;
    module_load_ex_fn module_load_data_ex;
    library_load_fn library_load_data, library_load_file;
};

/* The driver's event and capture functions: what gate.c's bounded queues and its helper thread's
 * drain use (loaded with the rest, by driver_load; a driver without one of them: NULL). */
typedef CUresult (*event_create_fn)(void **, unsigned);
typedef CUresult (*event_record_fn)(void *, void *);
typedef CUresult (*event_fn)(void *);
typedef CUresult (*capturing_fn)(void *, int *);
typedef CUresult (*exchange_fn)(int *);
typedef CUresult (*elapsed_fn)(float *, void *, void *);
struct driver_events {
    event_create_fn create;
    event_record_fn record;
    event_fn query, sync, destroy;
    capturing_fn capturing;  /* cuStreamIsCapturing */
    exchange_fn exchange;    /* cuThreadExchangeStreamCaptureMode (CUDA 10.1 on) */
    elapsed_fn elapsed;
    event_fn stream_query;   /* cuStreamQuery (a stream's work done: CU_OK; 600 not yet) */
};

#pragma GCC visibility push(hidden)

/* ---- driver.c ---- */
extern struct real_driver real;
extern struct driver_events ev;
extern dlsym_fn real_dlsym;
extern void *(*cgpu_next_dlsym)(void *, const char *);  /* libc's dlsym */
void driver_next_dlsym(void);  /* find it (once; no lock) */
/* >0 while this thread is inside the real driver: a driver that calls its own exported
 * functions (through its PLT, so through ours) must not be charged twice. */
extern __thread int in_driver __attribute__((tls_model("initial-exec")));  /* (loaded at start: static TLS) */
void *sym(const char *name);
void *cgpu_next(const char *name);  /* the C library's `name` (the next object's after libcgpu) */
void driver_load(void);

/* ---- threads.c ---- */
/* A thread's record (one cache line, its own): what other threads must know of its launch. */
struct cgpu_thread {
    uint32_t gate;          /* 2 + k while inside a launch past page GPU k's gate (k -1: the container's); 0: none */
    uint32_t live;          /* a live thread's (0: free for the next thread) */
    void *hazard;           /* the module table it reads now (modules.c), NULL */
    struct cgpu_thread *next;
    char pad_[64 - 2 * 4 - 2 * sizeof(void *)];
} __attribute__((aligned(64)));
extern __thread struct cgpu_thread *cgpu_me __attribute__((tls_model("initial-exec")));
struct cgpu_thread *cgpu_thread_slow(void);
/* The calling thread's record (NULL: no host memory for one: the caller takes its slow path). */
static inline struct cgpu_thread *cgpu_self(void)
{
    struct cgpu_thread *t = cgpu_me;
    return __builtin_expect(t != NULL, 1) ? t : cgpu_thread_slow();
}
struct cgpu_thread *cgpu_threads(void);  /* the list (->next) */
extern int cgpu_asym;            /* the helper's membarrier stands for the launch path's fence */
void threads_asym_register(void);  /* (at the helper's start) */
void threads_fence(void);        /* before cgpu_launching: every thread's record as of its last barrier */
int cgpu_launching(int k);       /* a thread is inside a launch past page GPU k's gate */
int cgpu_hazard(const void *p);  /* a thread reads table p now */
void threads_forked(void);

/* ---- interpose.c ---- */
void *cgpu_dlsym_ours(void *handle, const char *name);

/* ---- page.c ---- */
void setup_once(void);
int pages_ready(void);  /* the pages mapped (not the driver loaded); the process is held by them */
extern void (*cgpu_on_fork)(void);  /* what a forked child runs (interpose.c's: each part's reset) */
extern const struct cgpu_limits *limits;  /* read-only */
extern int cgpu_set_up;
int isolated_slow(void);
static inline int isolated(void)  /* set up; the process is held by its pages (a load or two once set up) */
{
    if (__builtin_expect(!__atomic_load_n(&cgpu_set_up, __ATOMIC_ACQUIRE), 0))
        return isolated_slow();
    return limits != NULL;
}
extern int per_gpu;       /* the page has a gate per GPU (else the container's one gate) */
extern int has_uuids;     /* the page names its GPUs' UUIDs (read once: written before its magic) */
extern struct cgpu_usage *usage;
extern struct cgpu_usage_busy *gpu_time;  /* the GPU time per slot (NULL: an older cgpud's page) */
extern struct cgpu_usage_ident *idents;  /* who each slot's process is (NULL: an older cgpud's page) */
extern struct cgpu_usage_follow *follows;  /* how far each slot's readings were applied (NULL: an older page) */
extern struct cgpu_usage_driver *drv;  /* the driver's readings (NULL: an older cgpud's page) */
extern struct cgpu_proc *mine;
extern int asked;         /* CGPU_PAGE_DIR is set: this process must be isolated */
extern char why[8192];    /* why the pages are not usable ("" when they are) */
extern char page_dir[4096];
void *usage_block(size_t at, size_t size);  /* a block of the usage file, mapped (page.c) */
void page_setup(void);
/* The driver said out of memory inside memsize: wait for the daemon's watchdog (page.c); 1: ask again. */
int held_elsewhere(int attempt);
void page_forked(void);
int need_slot_slow(void);
static inline int need_slot(void)  /* this process's slot, taken at its first use of CUDA; 0: none left */
{
    return __builtin_expect(__atomic_load_n(&mine, __ATOMIC_ACQUIRE) != NULL, 1) ? 1 : need_slot_slow();
}
void reclaim_dead(void);
uint64_t my_claim(void);  /* this process's slot's claim (cgpu_ident; 0: none): a reading carrying another is not its */  /* what dead processes held back to the container */
int uuid_to_page(const unsigned char *u);
int page_index(int dev);
int current_gpu(void);

/* ---- nvml.c ---- */
uint64_t nvml_process_bytes(int g);
void *nvml_ours(const char *name);  /* our wrapper of an NVML name, NULL if none */
void nvml_context_before(int g);
void nvml_context_after(int g);
void nvml_forked(void);
int nvml_ioctl(int fd, unsigned long request, void *arg);  /* ioctl: the kernel driver's process lists */

/* ---- memory.c (cgpu_memory.h: its files) ---- */
void memory_forked(void);
/* Before a kernel launch of function `f`: room for its lazy load (CU_OK), else CU_OUT_OF_MEMORY.
 * A function among the thread's last few launched is let go here (modules.c, "functions launched"). */
#define CGPU_FN_CACHE 16
struct cgpu_fn_seen { uint64_t f; unsigned epoch; };
extern __thread struct cgpu_fn_seen cgpu_fn_cache[CGPU_FN_CACHE] __attribute__((tls_model("initial-exec")));
extern unsigned cgpu_fn_epoch;
CUresult lazy_room_slow(void *f);
static inline CUresult lazy_room(void *f)
{
    const struct cgpu_fn_seen *s = &cgpu_fn_cache[(unsigned)((uintptr_t)f >> 4) % CGPU_FN_CACHE];
    if (f && s->f == (uintptr_t)f && s->epoch == __atomic_load_n(&cgpu_fn_epoch, __ATOMIC_ACQUIRE))
        return CU_OK;
    return lazy_room_slow(f);
}
#define LAZY_ROOM(f)                     \
    do {                                 \
        CUresult lr_ = lazy_room(f);     \
        if (lr_ != CU_OK)                \
            return lr_;                  \
    } while (0)

/* ---- contexts.c (compute) ---- */
/* A wrapped call that may change the calling thread's current context (cuCtxSetCurrent, a push or
 * pop, a create, a destroy, a primary context's release or reset: handles.c, memory.c) has returned:
 * the context it left current is the thread's known one (docs/isolation.md, "The launch path"). */
void contexts_switched(void);

/* ---- gate.c ---- */
void gate_forked(void);

#pragma GCC visibility pop

/* A wrapped call: straight through while inside the driver; refused when isolation was asked
 * for and cannot be applied; passed through when it was not asked for. */
#define PASS_THROUGH(fn, ...)                                                                      \
    do {                                                                                           \
        if (in_driver)                                                                             \
            return (fn) ? (fn)(__VA_ARGS__) : CU_NOT_INITIALIZED;                                  \
        if (!isolated())                                                                           \
            return asked ? CU_NOT_INITIALIZED : (fn) ? (fn)(__VA_ARGS__) : CU_NOT_INITIALIZED;     \
        if (!(fn))                                                                                 \
            return CU_NOT_INITIALIZED; /* a driver without it (older): nothing to call */          \
    } while (0)

#endif
