/*
 * The rest of what NVIDIA's CUDA runtime and CuPy ask the stand-in driver: device attributes
 * (a Tesla T4's, compute capability 7.5, 40 SMs), the primary context's state and limits,
 * events, stream queries, copies and sets, page-locked host memory and pointer attributes.
 *
 * Copies and sets check their device side as the driver does: a range inside one live
 * allocation (or a module's global), else CUDA_ERROR_INVALID_VALUE; nothing is moved (the
 * card has no contents: a copy to the host writes zeros). Synchronous ones wait for this
 * process's kernels first, as on the legacy stream. Streams and events are the executor's
 * (cuda_exec.c): an event recorded into a stream completes when the card has run what was launched
 * into that stream before it, at the time the card reached it; cuEventQuery says
 * CUDA_ERROR_NOT_READY until then, cuEventElapsedTime gives the difference.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_stub.h"

typedef void *CUcontext;
typedef void *CUstream;

static CUresult check_device(int d)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    return d >= 0 && d < stub_device_count() ? STUB_OK : STUB_INVALID_DEVICE;
}

/* ---- attributes: CUdevice_attribute -> a T4's value; 0 where a T4 says no ---- */
static const struct { int attr, value; } T4[] = {
    {1, 1024}, {2, 1024}, {3, 1024}, {4, 64}, {5, 2147483647}, {6, 65535}, {7, 65535}, {8, 49152}, {9, 65536},
    {10, 32}, {11, 2147483647}, {12, 65536}, {13, 1590000}, {14, 512}, {15, 1}, {16, 40}, {17, 0}, {18, 0},
    {19, 1}, {20, 0}, {21, 131072}, {22, 131072}, {23, 65536}, {24, 16384}, {25, 16384}, {26, 16384},
    {27, 32768}, {28, 32768}, {29, 2048}, {30, 512}, {31, 1}, {32, 1}, {33, 0x3b}, {34, 0}, {35, 0},
    {36, 5001000}, {37, 256}, {38, 4194304}, {39, 1024}, {40, 3}, {41, 1}, {42, 32768}, {43, 2048}, {44, 1},
    {45, 32768}, {46, 32768}, {47, 8192}, {48, 8192}, {49, 32768}, {50, 0}, {51, 32}, {52, 32768},
    {53, 32768}, {54, 2046}, {55, 32768}, {56, 131072}, {57, 65536}, {58, 16384}, {59, 16384}, {60, 16384},
    {61, 32768}, {62, 2048}, {63, 32768}, {64, 32768}, {65, 2048}, {66, 32768}, {67, 32768}, {68, 2046},
    {69, 268435456}, {70, 131072}, {71, 65000}, {72, 2097120}, {73, 32768}, {74, 32768}, {75, 7}, {76, 5},
    {77, 32768}, {78, 1}, {79, 1}, {80, 1}, {81, 65536}, {82, 65536}, {83, 1}, {84, 0}, {85, 0}, {86, 0},
    {87, 32}, {88, 0}, {89, 1}, {90, 1}, {91, 1}, {95, 1}, {96, 1}, {97, 65536}, {99, 1}, {102, 1}, {103, 1},
    {106, 16}, {107, 0}, {110, 1}, {111, 0}, {112, 1}, {113, 1}, {115, 1}, {116, 1}, {117, 1}, {118, 0},
    {119, 1}, {121, 1}, {122, 1}, {123, 1}, {124, 1}, {125, 1}, {126, 1}, {130, 0}, {131, -1}, {134, -1},
    {139, 0x1eb810de}, {140, 0x12a210de}, {149, 1}, {157, 40},
};
CUresult cuDeviceGetAttribute(int *v, int attr, int dev)
{
    if (!v) return STUB_INVALID_VALUE;
    CUresult r = check_device(dev);
    if (r) return r;
    if (attr <= 0 || attr > 161) {
        stub_trace("cuDeviceGetAttribute %d unknown", attr);
        return STUB_INVALID_VALUE;
    }
    *v = 0;
    for (size_t i = 0; i < sizeof T4 / sizeof *T4; i++)
        if (T4[i].attr == attr) *v = T4[i].value;
    if (attr == 33) *v += dev;  /* PCI_BUS_ID: each card its own bus */
    return STUB_OK;
}
CUresult cuDeviceComputeCapability(int *major, int *minor, int dev)
{
    if (!major || !minor) return STUB_INVALID_VALUE;
    CUresult r = check_device(dev);
    if (!r) { *major = 7; *minor = 5; }
    return r;
}
CUresult cuDeviceGetPCIBusId(char *id, int len, int dev)
{
    if (!id || len <= 0) return STUB_INVALID_VALUE;
    CUresult r = check_device(dev);
    if (r) return r;
    char s[16];
    int n = snprintf(s, sizeof s, "0000:%02x:00.0", 0x3b + dev);
    snprintf(id, (size_t)len, "%s", s);
    return n < len ? STUB_OK : STUB_INVALID_VALUE;
}
CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer)
{
    if (!can) return STUB_INVALID_VALUE;
    CUresult r = check_device(dev);
    if (!r) r = check_device(peer);
    if (!r) *can = 0;
    return r;
}
CUresult cuDeviceGetLuid(char *luid, unsigned *mask, int dev) { (void)luid; (void)mask; return check_device(dev) ?: STUB_NOT_SUPPORTED; }
CUresult cuDeviceGetTexture1DLinearMaxWidth(size_t *w, int format, unsigned channels, int dev)
{
    (void)format; (void)channels;
    if (!w) return STUB_INVALID_VALUE;
    CUresult r = check_device(dev);
    if (!r) *w = 268435456;
    return r;
}

/* ---- the primary context ---- */
static unsigned primary_flags[16];
CUresult cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active)
{
    if (!flags || !active) return STUB_INVALID_VALUE;
    CUresult r = check_device(dev);
    if (!r) { *flags = primary_flags[dev]; *active = !stub_ctx_dead(dev); }
    return r;
}
CUresult cuDevicePrimaryCtxSetFlags_v2(int dev, unsigned flags)
{
    CUresult r = check_device(dev);
    if (r) return r;
    if (flags & ~0x1fu) return STUB_INVALID_VALUE;
    primary_flags[dev] = flags;
    return STUB_OK;
}
CUresult cuDevicePrimaryCtxReset_v2(int dev)
{
    CUresult r = check_device(dev);
    if (r) return r;
    stub_exec_sync(dev, NULL, 1);  /* (the driver waits for the context's work, then destroys it: card.c) */
    stub_ctx_kill(dev);
    return STUB_OK;
}
CUresult cuDevicePrimaryCtxReset(int dev) { return cuDevicePrimaryCtxReset_v2(dev); }
CUresult cuCtxGetFlags(unsigned *flags)
{
    if (!flags) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    *flags = primary_flags[stub_current_device()];
    return STUB_OK;
}
CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned *v)
{
    (void)ctx;
    if (!v) return STUB_INVALID_VALUE;
    *v = 3020;
    return STUB_OK;
}
CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id)
{
    if (!id) return STUB_INVALID_VALUE;
    *id = ctx ? (unsigned long long)(uintptr_t)ctx : (unsigned long long)stub_current_device() + 1;
    return STUB_OK;
}
static size_t limits[10] = {1024, 1048576, 8388608, 2, 2048, 32, 0, 0, 0, 0};
CUresult cuCtxGetLimit(size_t *v, int limit)
{
    if (!v || limit < 0 || limit > 9) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    *v = limits[limit];
    return STUB_OK;
}
/* What a limit holds of the card (issue 45, item 5; the driver API reference, cuCtxSetLimit):
 * CU_LIMIT_STACK_SIZE "controls the stack size in bytes of each GPU thread" — the driver backs the
 * stack of every thread the card can hold resident, so local memory is the stack times the
 * multiprocessors times the threads each holds (the T4's 40 x 1024: 40 MiB per KiB of stack; the
 * H100's 132 x 2048: 264 MiB), and "this size isn't reset back" after a launch that needed more;
 * CU_LIMIT_PRINTF_FIFO_SIZE and CU_LIMIT_MALLOC_HEAP_SIZE are a FIFO and a heap of that size. The
 * card's default stack, FIFO and heap are the context's (CGPU_STUB_CTX_MIB); raising one takes the
 * difference from the card's free memory, as the driver's own (NVML's per-process figure shows it),
 * and a card without the room answers CUDA_ERROR_OUT_OF_MEMORY, the limit unchanged; lowering it
 * gives it back. */
static uint64_t limit_bytes(int limit, size_t v)
{
    int sms = 0, threads = 0;
    cuDeviceGetAttribute(&sms, 16, stub_current_device());      /* MULTIPROCESSOR_COUNT */
    cuDeviceGetAttribute(&threads, 39, stub_current_device());  /* MAX_THREADS_PER_MULTIPROCESSOR */
    return limit == 0 ? (uint64_t)v * (uint64_t)sms * (uint64_t)threads : limit <= 2 ? (uint64_t)v : 0;
}
CUresult cuCtxSetLimit(int limit, size_t v)
{
    if (limit < 0 || limit > 6) return limit >= 7 && limit <= 9 ? STUB_NOT_SUPPORTED : STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (limit == 5 && v > 128) return STUB_INVALID_VALUE;
    int64_t delta = (int64_t)limit_bytes(limit, v) - (int64_t)limit_bytes(limit, limits[limit]);
    if (delta && stub_driver_memory(stub_current_device(), delta)) return STUB_OUT_OF_MEMORY;
    limits[limit] = v;
    return STUB_OK;
}
static int cache_config;
CUresult cuCtxGetCacheConfig(int *c) { if (!c) return STUB_INVALID_VALUE; *c = cache_config; return STUB_OK; }
CUresult cuCtxSetCacheConfig(int c) { if (c < 0 || c > 3) return STUB_INVALID_VALUE; cache_config = c; return STUB_OK; }
CUresult cuCtxGetSharedMemConfig(int *c) { if (!c) return STUB_INVALID_VALUE; *c = 1; return STUB_OK; }
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    if (least) *least = 0;
    if (greatest) *greatest = -1;
    return STUB_OK;
}

/* ---- streams ---- */
CUresult cuStreamQuery(CUstream s)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (stub_stream_dead(s, "cuStreamQuery")) return STUB_INVALID_HANDLE;
    CUresult r = stub_capture_forbids(s);
    if (r) return r;
    return stub_exec_idle(stub_current_device(), s, 0) ? STUB_OK : STUB_NOT_READY;
}
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int priority)
{
    CUresult cuStreamCreate(CUstream *, unsigned);
    if (priority > 0 || priority < -1) return STUB_INVALID_VALUE;  /* (clamped by a real driver; the range is [-1, 0]) */
    return cuStreamCreate(s, flags);
}
CUresult cuStreamGetPriority(CUstream s, int *p) { (void)s; if (!p) return STUB_INVALID_VALUE; *p = 0; return STUB_OK; }
CUresult cuStreamGetFlags(CUstream s, unsigned *f) { (void)s; if (!f) return STUB_INVALID_VALUE; *f = 0; return STUB_OK; }
CUresult cuStreamGetId(CUstream s, unsigned long long *id)
{
    if (!id) return STUB_INVALID_VALUE;
    *id = (unsigned long long)(uintptr_t)s;
    return STUB_OK;
}
CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx)
{
    if (!ctx) return STUB_INVALID_VALUE;
    *ctx = (CUcontext)(uintptr_t)(stub_stream_device(s) + 1);  /* (the context it was made in) */
    return STUB_OK;
}
CUresult cuStreamGetDevice(CUstream s, int *dev) { if (!dev) return STUB_INVALID_VALUE; *dev = stub_stream_device(s); return STUB_OK; }
/* (stream capture: cuda_graphs.c) */
/* ---- streams that wait on the host (issue 34) ----
 * cuStreamWaitValue32/64 and cuLaunchHostFunc return at once, as the driver's do: the stream (here
 * the context's work, which runs in launch order) stops at that point until a 32/64-bit word in
 * host memory meets the condition, or until the host function, run on a driver thread of the
 * process once the work before it is done, has returned. A thread of the stand-in's (started at the
 * first such call) looks at the pending waits every 50 µs and releases them on the card. A process
 * that waits for that stream before it sets the word waits for ever, as on the card. */
typedef void (*host_fn)(void *);
struct host_wait { int dev, kind; uint64_t seq; const volatile void *addr; uint64_t value; unsigned flags; host_fn fn; void *data; };
enum { WAIT_32 = 0, WAIT_64 = 1, WAIT_HOST_FN = 2 };
enum { WAIT_GEQ = 0, WAIT_EQ = 1, WAIT_AND = 2, WAIT_NOR = 3 };
static struct host_wait waits[1024];
static int nwaits;
static pthread_mutex_t waits_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t waiter_once = PTHREAD_ONCE_INIT;

static int wait_met(const struct host_wait *w)
{
    uint64_t v = w->kind == WAIT_32 ? __atomic_load_n((const volatile uint32_t *)w->addr, __ATOMIC_SEQ_CST)
                                    : __atomic_load_n((const volatile uint64_t *)w->addr, __ATOMIC_SEQ_CST);
    uint64_t want = w->value;
    if (w->kind == WAIT_32) want &= 0xffffffffu;
    switch (w->flags & 3) {
    case WAIT_GEQ: return w->kind == WAIT_32 ? (int32_t)((uint32_t)v - (uint32_t)want) >= 0 : (int64_t)(v - want) >= 0;
    case WAIT_EQ: return v == want;
    case WAIT_AND: return (v & want) != 0;
    default: return (~(v | want) & (w->kind == WAIT_32 ? 0xffffffffull : ~0ull)) != 0;
    }
}

static void *waiter(void *arg)
{
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&waits_lock);
        for (int i = 0; i < nwaits;) {
            struct host_wait w = waits[i];
            int go = w.kind == WAIT_HOST_FN ? stub_exec_reached(w.dev, w.seq) : wait_met(&w);
            if (!go) {
                i++;
                continue;
            }
            waits[i] = waits[--nwaits];
            pthread_mutex_unlock(&waits_lock);
            if (w.kind == WAIT_HOST_FN)
                w.fn(w.data);  /* (a driver thread of the process's: the stream goes on once it returns) */
            stub_exec_release(w.dev, w.seq);
            pthread_mutex_lock(&waits_lock);
        }
        pthread_mutex_unlock(&waits_lock);
        struct timespec t = {0, 50000};
        nanosleep(&t, NULL);
    }
    return NULL;
}

static void start_waiter(void)
{
    pthread_t t;
    pthread_attr_t a;
    sigset_t all, old;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_create(&t, &a, waiter, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
}

static CUresult host_wait(CUstream s, int kind, const void *addr, uint64_t value, unsigned flags, host_fn fn, void *data)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (stub_stream_dead(s, kind == WAIT_HOST_FN ? "cuLaunchHostFunc" : "cuStreamWaitValue")) return STUB_INVALID_HANDLE;
    int dev = stub_current_device();
    pthread_once(&waiter_once, start_waiter);
    pthread_mutex_lock(&waits_lock);
    if (nwaits == (int)(sizeof waits / sizeof *waits)) {
        pthread_mutex_unlock(&waits_lock);
        return STUB_OUT_OF_MEMORY;
    }
    uint64_t seq = 0;
    CUresult r = stub_exec_hold(dev, s, &seq);
    if (r == STUB_OK)
        waits[nwaits++] = (struct host_wait){dev, kind, seq, addr, value, flags, fn, data};
    pthread_mutex_unlock(&waits_lock);
    return r;
}

CUresult cuLaunchHostFunc(CUstream s, host_fn fn, void *data)
{
    if (!fn) return STUB_INVALID_VALUE;
    return host_wait(s, WAIT_HOST_FN, NULL, 0, 0, fn, data);
}
CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags)
{
    if (!addr || addr & 3 || (flags & ~(3u | 1u << 30))) return STUB_INVALID_VALUE;
    return host_wait(s, WAIT_32, (const void *)(uintptr_t)addr, value, flags, NULL, NULL);
}
CUresult cuStreamWaitValue64_v2(CUstream s, CUdeviceptr addr, uint64_t value, unsigned flags)
{
    if (!addr || addr & 7 || (flags & ~(3u | 1u << 30))) return STUB_INVALID_VALUE;
    return host_wait(s, WAIT_64, (const void *)(uintptr_t)addr, value, flags, NULL, NULL);
}
CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { return cuStreamWaitValue32_v2(s, addr, value, flags); }
CUresult cuStreamWaitValue64(CUstream s, CUdeviceptr addr, uint64_t value, unsigned flags) { return cuStreamWaitValue64_v2(s, addr, value, flags); }
/* (the write's counterpart: the value written once the work before it is done; at once here if so) */
static CUresult write_value(CUstream s, CUdeviceptr addr, uint64_t value, int wide)
{
    if (!addr || addr & (wide ? 7 : 3)) return STUB_INVALID_VALUE;
    stub_exec_sync(stub_current_device(), s, 0);
    if (wide) __atomic_store_n((volatile uint64_t *)(uintptr_t)addr, value, __ATOMIC_SEQ_CST);
    else __atomic_store_n((volatile uint32_t *)(uintptr_t)addr, (uint32_t)value, __ATOMIC_SEQ_CST);
    return STUB_OK;
}
CUresult cuStreamWriteValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { (void)flags; return write_value(s, addr, value, 0); }
CUresult cuStreamWriteValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) { return cuStreamWriteValue32_v2(s, addr, value, flags); }

/* ---- events: marks in a stream (cuda_exec.c) ---- */
/* (an event destroyed, by cuEventDestroy or with its context, is kept, marked: a use of it is seen) */
enum { EVENT_MAGIC = 0x6576656e, EVENT_DEAD = 0x64656164, EVENT_DISABLE_TIMING = 2 };
struct event { unsigned magic, flags; int dev; unsigned gen; struct stub_mark m; };
static int event_live(const struct event *e, const char *call)
{
    if (!e || (e->magic != EVENT_MAGIC && e->magic != EVENT_DEAD)) return 0;
    if (e->magic == EVENT_MAGIC && stub_ctx_alive(e->dev, e->gen)) return 1;
    stub_misuse(call, e->magic == EVENT_DEAD ? "a destroyed event" : "an event of a destroyed context");
    return 0;
}
#define event_ok(e) event_live((e), __func__)
CUresult cuEventCreate(struct event **e, unsigned flags)
{
    if (!e || flags & ~0xfu) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    *e = calloc(1, sizeof **e);
    (*e)->magic = EVENT_MAGIC;
    (*e)->flags = flags;
    (*e)->dev = stub_current_device();
    (*e)->gen = stub_ctx_gen((*e)->dev);
    return STUB_OK;
}
CUresult cuEventDestroy_v2(struct event *e)
{
    if (!event_ok(e)) return STUB_INVALID_HANDLE;
    stub_exec_mark_drop(&e->m);
    e->magic = EVENT_DEAD;
    return STUB_OK;
}
CUresult cuEventRecord(struct event *e, CUstream s)
{
    stub_called("cuEventRecord");
    if (!event_ok(e)) return STUB_INVALID_HANDLE;
    if (stub_stream_dead(s, "cuEventRecord")) return STUB_INVALID_HANDLE;
    return stub_exec_mark(&e->m, stub_current_device(), s);
}
CUresult cuEventRecord_ptsz(struct event *e, CUstream s) { return cuEventRecord(e, s ? s : (CUstream)2); }
CUresult cuEventRecordWithFlags(struct event *e, CUstream s, unsigned flags)
{
    if (flags & ~1u) return STUB_INVALID_VALUE;
    return cuEventRecord(e, s);
}
CUresult cuEventRecordWithFlags_ptsz(struct event *e, CUstream s, unsigned flags)
{
    return cuEventRecordWithFlags(e, s ? s : (CUstream)2, flags);
}
CUresult cuEventQuery(struct event *e)
{
    if (!event_ok(e)) return STUB_INVALID_HANDLE;
    CUresult r = stub_capture_forbids(NULL);
    if (r) return r;
    return stub_exec_mark_done(&e->m) ? STUB_OK : STUB_NOT_READY;
}
CUresult cuEventSynchronize(struct event *e)
{
    if (!event_ok(e)) return STUB_INVALID_HANDLE;
    CUresult r = stub_capture_forbids(NULL);
    if (r) return r;
    stub_exec_mark_wait(&e->m);
    return STUB_OK;
}
CUresult cuEventElapsedTime_v2(float *ms, struct event *a, struct event *b)
{
    if (!ms) return STUB_INVALID_VALUE;
    if (!event_ok(a) || !event_ok(b)) return STUB_INVALID_HANDLE;
    if ((a->flags | b->flags) & EVENT_DISABLE_TIMING || !a->m.recorded || !b->m.recorded) return STUB_INVALID_HANDLE;
    if (cuEventQuery(a) || cuEventQuery(b)) return STUB_NOT_READY;
    *ms = (float)((double)((int64_t)(b->m.at - a->m.at)) / 1e6);
    return STUB_OK;
}
CUresult cuStreamWaitEvent(CUstream s, struct event *e, unsigned flags)
{
    (void)s;
    if (flags & ~1u) return STUB_INVALID_VALUE;
    return event_ok(e) ? STUB_OK : STUB_INVALID_HANDLE;  /* (a context's work runs in launch order: already in order) */
}
CUresult cuStreamQuery_ptsz(CUstream s) { return cuStreamQuery(s ? s : (CUstream)2); }

/* ---- copies and sets ---- */
/* a synchronous copy's wait for this process's kernels on its current card: the thread's capture
 * mode decides, as for any call */
static CUresult synchronize(void)
{
    CUresult r = stub_capture_forbids(NULL);
    return r ? r : stub_exec_sync(stub_current_device(), NULL, 1);
}
static int on_card(CUdeviceptr p, size_t n)
{
    CUdeviceptr base;
    size_t size;
    return !stub_find_alloc(p, n, &base, &size) || !stub_find_global(p, n);
}
static CUresult copy(CUdeviceptr dst, int dst_dev, CUdeviceptr src, int src_dev, size_t n, int sync)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (!n) return STUB_OK;
    if ((dst_dev && !on_card(dst, n)) || (src_dev && !on_card(src, n))) return STUB_INVALID_VALUE;
    if (!dst_dev && !dst) return STUB_INVALID_VALUE;
    if (!src_dev && !src) return STUB_INVALID_VALUE;
    if (sync) synchronize();
    if (!dst_dev) memset((void *)(uintptr_t)dst, 0, n);
    return STUB_OK;
}
#define H(p) ((CUdeviceptr)(uintptr_t)(p))
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return copy(d, 1, H(h), 0, n, 1); }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return copy(H(h), 0, d, 1, n, 1); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy(d, 1, s, 1, n, 0); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, CUstream s) { (void)s; return copy(d, 1, H(h), 0, n, 0); }
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, CUstream s) { (void)s; return copy(H(h), 0, d, 1, n, 1); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s) { (void)s; return copy(d, 1, src, 1, n, 0); }
/* unified addressing: a pointer inside an allocation is the card's, any other the host's */
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy(d, on_card(d, 1), s, on_card(s, 1), n, 1); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    (void)st;
    int dd = on_card(d, 1);
    return copy(d, dd, s, on_card(s, 1), n, !dd);
}
CUresult cuMemcpyPeer(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n) { (void)dc; (void)sc; return copy(d, 1, s, 1, n, 1); }
CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st)
{
    (void)dc; (void)sc; (void)st;
    return copy(d, 1, s, 1, n, 0);
}
static CUresult set(CUdeviceptr d, size_t n) { return !stub_inited() ? STUB_NOT_INITIALIZED : !n || on_card(d, n) ? STUB_OK : STUB_INVALID_VALUE; }
/* CGPU_STUB_MEMSETS_ON_CARD=1 (issue 34): an asynchronous memset is what it is on the card, a kernel
 * queued into its stream, of n bytes at 2 TB/s (an H100's HBM written; 1 µs at least). Off by
 * default: the suite's other tests count the card's kernels. */
static CUresult set_async(CUdeviceptr d, size_t n, CUstream s)
{
    CUresult r = set(d, n);
    const char *on = getenv("CGPU_STUB_MEMSETS_ON_CARD");
    if (r || !n || !on || *on != '1') return r;
    if (stub_stream_dead(s, "cuMemsetAsync")) return STUB_INVALID_HANDLE;
    uint64_t us = n / 2000000;
    return stub_exec_launch(stub_current_device(), s, us ? us : 1, 0);
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { (void)v; return set(d, n); }
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { (void)v; return set(d, 2 * n); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { (void)v; return set(d, 4 * n); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { (void)v; return set_async(d, n, s); }
CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { (void)v; return set_async(d, n, s ? s : (CUstream)2); }
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) { (void)v; return set_async(d, 2 * n, s); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) { (void)v; return set_async(d, 4 * n, s); }
CUresult cuMemsetD2D8_v2(CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h) { (void)v; return h ? set(d, pitch * (h - 1) + w) : STUB_OK; }
CUresult cuMemsetD2D32_v2(CUdeviceptr d, size_t pitch, unsigned v, size_t w, size_t h) { (void)v; return h ? set(d, pitch * (h - 1) + 4 * w) : STUB_OK; }

/* More of the driver's work on the card (issue 45, item 9), with the checks its reference documents;
 * like this file's copies, no card time (the stand-in's card runs kernels; an asynchronous memset
 * with CGPU_STUB_MEMSETS_ON_CARD=1). The CUDA Driver API reference: "Memory Management"
 * (cuMemsetD2D8Async/16/32: a pitched 2-D area of Height rows of Width elements; cuMemcpy2D/3D and
 * their Async forms: a CUDA_MEMCPY2D/3D descriptor), "Unified Addressing" (cuMemPrefetchAsync: "the
 * memory range must refer to managed memory allocated via cuMemAllocManaged"), "Stream Memory
 * Operations" (cuStreamWriteValue64; cuStreamBatchMemOp: "count ... must not exceed 256", flags 0). */
static CUresult set2d_async(CUdeviceptr d, size_t pitch, size_t w, size_t h, CUstream s)
{
    if (w > pitch && h > 1) return STUB_INVALID_VALUE;
    return h ? set_async(d, pitch * (h - 1) + w, s) : set(d, 0);
}
CUresult cuMemsetD2D8Async(CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream s) { (void)v; return set2d_async(d, p, w, h, s); }
CUresult cuMemsetD2D16Async(CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream s) { (void)v; return set2d_async(d, p, 2 * w, h, s); }
CUresult cuMemsetD2D32Async(CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h, CUstream s) { (void)v; return set2d_async(d, p, 4 * w, h, s); }
CUresult cuMemsetD2D16_v2(CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h) { (void)v; return h ? set(d, pitch * (h - 1) + 2 * w) : STUB_OK; }
static CUresult described(const void *p, int sync)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (!p) return STUB_INVALID_VALUE;
    return sync ? synchronize() : STUB_OK;
}
CUresult cuMemcpy2D_v2(const void *p) { return described(p, 1); }
CUresult cuMemcpy3D_v2(const void *p) { return described(p, 1); }
CUresult cuMemcpy2DAsync_v2(const void *p, CUstream s) { (void)s; return described(p, 0); }
CUresult cuMemcpy3DAsync_v2(const void *p, CUstream s) { (void)s; return described(p, 0); }
CUresult cuMemPrefetchAsync(CUdeviceptr d, size_t n, int dev, CUstream s)
{
    (void)s;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    return n && on_card(d, n) ? STUB_OK : STUB_INVALID_VALUE;
}
CUresult cuStreamWriteValue64_v2(CUstream s, CUdeviceptr addr, uint64_t value, unsigned flags) { (void)flags; return write_value(s, addr, value, 1); }
CUresult cuStreamBatchMemOp_v2(CUstream s, unsigned count, void *ops, unsigned flags)
{
    (void)s;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    return !count || count > 256 || !ops || flags ? STUB_INVALID_VALUE : STUB_OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    CUdeviceptr b;
    size_t s;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (stub_find_alloc(p, 1, &b, &s)) return STUB_NOT_FOUND;
    if (base) *base = b;
    if (size) *size = s;
    return STUB_OK;
}

/* ---- page-locked host memory: real memory of this process ---- */
static struct { void *p; size_t n; } host[1024];
static pthread_mutex_t host_lock = PTHREAD_MUTEX_INITIALIZER;
static int host_find(const void *p)
{
    for (int i = 0; i < 1024; i++)
        if (host[i].p && (const char *)p >= (const char *)host[i].p && (const char *)p < (const char *)host[i].p + host[i].n)
            return i;
    return -1;
}
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned flags)
{
    if (!pp || !n || flags & ~0xfu) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    void *p = NULL;
    if (posix_memalign(&p, 4096, n)) return STUB_OUT_OF_MEMORY;
    pthread_mutex_lock(&host_lock);
    int i = host_find(NULL);
    for (i = 0; i < 1024 && host[i].p; i++) {}
    if (i < 1024) { host[i].p = p; host[i].n = n; }
    pthread_mutex_unlock(&host_lock);
    if (i == 1024) { free(p); return STUB_OUT_OF_MEMORY; }
    *pp = p;
    return STUB_OK;
}
CUresult cuMemAllocHost_v2(void **pp, size_t n) { return cuMemHostAlloc(pp, n, 0); }
CUresult cuMemFreeHost(void *p)
{
    pthread_mutex_lock(&host_lock);
    int i = host_find(p);
    int ok = i >= 0 && host[i].p == p;
    if (ok) host[i].p = NULL;
    pthread_mutex_unlock(&host_lock);
    if (!ok) return STUB_INVALID_VALUE;
    free(p);
    return STUB_OK;
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags)
{
    if (!d || flags) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&host_lock);
    int i = host_find(p);
    pthread_mutex_unlock(&host_lock);
    if (i < 0) return STUB_INVALID_VALUE;
    *d = H(p);
    return STUB_OK;
}
CUresult cuMemHostGetFlags(unsigned *flags, void *p)
{
    if (!flags) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&host_lock);
    int i = host_find(p);
    pthread_mutex_unlock(&host_lock);
    if (i < 0) return STUB_INVALID_VALUE;
    *flags = 0;
    return STUB_OK;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    if (!p || !n || flags & ~0xfu) return STUB_INVALID_VALUE;
    return STUB_OK;
}
CUresult cuMemHostUnregister(void *p) { return p ? STUB_OK : STUB_INVALID_VALUE; }

/* ---- pointer attributes ---- */
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p)
{
    if (!data) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    CUdeviceptr base = 0;
    size_t size = 0;
    int dev = !stub_find_alloc(p, 1, &base, &size), pinned = 0;
    if (!dev) {
        pthread_mutex_lock(&host_lock);
        int i = host_find((void *)(uintptr_t)p);
        if (i >= 0) { pinned = 1; base = H(host[i].p); size = host[i].n; }
        pthread_mutex_unlock(&host_lock);
    }
    if (!dev && !pinned) return STUB_INVALID_VALUE;  /* memory the driver does not know */
    switch (attr) {
    case 1: *(CUcontext *)data = (CUcontext)(uintptr_t)(stub_current_device() + 1); break;
    case 2: *(unsigned *)data = dev ? 2 : 1; break;  /* CU_MEMORYTYPE_DEVICE / HOST */
    case 3: *(CUdeviceptr *)data = p; break;
    case 4: if (dev) return STUB_INVALID_VALUE; *(void **)data = (void *)(uintptr_t)p; break;
    case 6: case 8: case 13: *(int *)data = attr == 13; break;
    case 7: case 20: *(unsigned long long *)data = base; break;
    case 9: *(int *)data = stub_current_device(); break;
    case 10: case 15: *(int *)data = 0; break;
    case 11: *(CUdeviceptr *)data = base; break;
    case 12: *(size_t *)data = size; break;
    default: return STUB_INVALID_VALUE;
    }
    return STUB_OK;
}
/* cuda.h: "will not return an error when the ptr encountered is not a valid CUDA pointer. Instead,
 * the attributes are assigned default NULL values" (an attribute a pointer has not: the same) */
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p)
{
    if (!attrs || !data) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    for (unsigned i = 0; i < n; i++) {
        if (!data[i]) return STUB_INVALID_VALUE;
        if (attrs[i] < 1 || attrs[i] > 22) return STUB_INVALID_VALUE;
        if (cuPointerGetAttribute(data[i], attrs[i], p) == STUB_OK) continue;
        switch (attrs[i]) {
        case 1: case 3: case 4: case 7: case 11: case 12: case 17: case 18: case 19: case 20:
            memset(data[i], 0, 8); break;             /* pointers, sizes, 64-bit ids */
        case 5: memset(data[i], 0, 16); break;        /* CUDA_POINTER_ATTRIBUTE_P2P_TOKENS */
        default: memset(data[i], 0, 4);
        }
    }
    return STUB_OK;
}

struct stub_proc { const char *name; void *fn; };
HIDDEN const struct stub_proc STUB_PROCS_DEVICE[] = {
#define P(f) {#f, (void *)f}
#define PV(n, f) {n, (void *)f}
    P(cuDeviceGetAttribute), P(cuDeviceComputeCapability), P(cuDeviceGetPCIBusId), P(cuDeviceCanAccessPeer),
    P(cuDeviceGetLuid), P(cuDeviceGetTexture1DLinearMaxWidth), P(cuDevicePrimaryCtxGetState),
    PV("cuDevicePrimaryCtxSetFlags", cuDevicePrimaryCtxSetFlags_v2),
    PV("cuDevicePrimaryCtxReset", cuDevicePrimaryCtxReset_v2),
    P(cuCtxGetFlags), P(cuCtxGetApiVersion), P(cuCtxGetId), P(cuCtxGetLimit), P(cuCtxSetLimit), P(cuCtxGetCacheConfig),
    P(cuCtxSetCacheConfig), P(cuCtxGetSharedMemConfig), P(cuCtxGetStreamPriorityRange),
    P(cuStreamQuery), P(cuStreamCreateWithPriority), P(cuStreamGetPriority), P(cuStreamGetFlags), P(cuStreamGetId),
    P(cuStreamGetCtx), P(cuStreamGetDevice),
    P(cuLaunchHostFunc), P(cuStreamWaitEvent), PV("cuStreamWaitValue32", cuStreamWaitValue32_v2),
    PV("cuStreamWaitValue64", cuStreamWaitValue64_v2), PV("cuStreamWriteValue32", cuStreamWriteValue32_v2),
    P(cuEventCreate), PV("cuEventDestroy", cuEventDestroy_v2), P(cuEventRecord), P(cuEventRecordWithFlags),
    P(cuEventQuery), P(cuEventSynchronize), PV("cuEventElapsedTime", cuEventElapsedTime_v2),
    P(cuEventRecord_ptsz), P(cuEventRecordWithFlags_ptsz), P(cuStreamQuery_ptsz),
    PV("cuMemcpyHtoD", cuMemcpyHtoD_v2), PV("cuMemcpyDtoH", cuMemcpyDtoH_v2), PV("cuMemcpyDtoD", cuMemcpyDtoD_v2),
    PV("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2), PV("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2),
    PV("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2), P(cuMemcpy), P(cuMemcpyAsync), P(cuMemcpyPeer), P(cuMemcpyPeerAsync),
    PV("cuMemsetD8", cuMemsetD8_v2), PV("cuMemsetD16", cuMemsetD16_v2), PV("cuMemsetD32", cuMemsetD32_v2),
    P(cuMemsetD8Async), P(cuMemsetD16Async), P(cuMemsetD32Async), PV("cuMemsetD2D8", cuMemsetD2D8_v2),
    PV("cuMemsetD2D32", cuMemsetD2D32_v2), PV("cuMemGetAddressRange", cuMemGetAddressRange_v2),
    P(cuMemsetD2D8Async), P(cuMemsetD2D16Async), P(cuMemsetD2D32Async), PV("cuMemsetD2D16", cuMemsetD2D16_v2),
    PV("cuMemcpy2D", cuMemcpy2D_v2), PV("cuMemcpy3D", cuMemcpy3D_v2), PV("cuMemcpy2DAsync", cuMemcpy2DAsync_v2),
    PV("cuMemcpy3DAsync", cuMemcpy3DAsync_v2), PV("cuStreamWriteValue64", cuStreamWriteValue64_v2),
    PV("cuStreamBatchMemOp", cuStreamBatchMemOp_v2),
    P(cuMemHostAlloc), PV("cuMemAllocHost", cuMemAllocHost_v2), P(cuMemFreeHost),
    PV("cuMemHostGetDevicePointer", cuMemHostGetDevicePointer_v2), P(cuMemHostGetFlags),
    PV("cuMemHostRegister", cuMemHostRegister_v2), P(cuMemHostUnregister), P(cuPointerGetAttribute),
    P(cuPointerGetAttributes),
    {NULL, NULL},
#undef P
#undef PV
};
