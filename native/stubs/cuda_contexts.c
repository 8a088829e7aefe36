/*
 * The stand-in driver's contexts (out of libcuda.c, issue 45): the primary one of each card (one
 * per card and process, by generation: card.c) and green contexts.
 *
 * Green contexts (CUDA 12.4; the CUDA Driver API reference, "Green Contexts"): cuGreenCtxCreate
 * makes one on a device from a resource descriptor (flags must be CU_GREEN_CTX_DEFAULT_STREAM),
 * retaining the device's primary context; cuCtxFromGreenCtx gives the CUcontext through which the
 * rest of the driver API uses it ("Converts a green context into the primary context returned in
 * pctx ... usable with the rest of the CUDA driver API"): made current (cuCtxSetCurrent,
 * cuCtxPushCurrent), its launches run on its device's card (its SM share is not modelled: a
 * kernel takes its time whatever the share); cuGreenCtxDestroy destroys it and releases the
 * primary context it retained. A destroyed green context's CUcontext used afterwards (made
 * current, pushed, synchronized) is undefined behaviour in the driver: here CUDA_ERROR_CONTEXT_IS_
 * DESTROYED, and with CGPU_STUB_STRICT_HANDLES=1 an abort saying which call (card.c's
 * stub_misuse). Not modelled: the resources' splitting (cuDevSmResourceSplitByCount,
 * cuDevResourceGenerateDesc: any descriptor is taken), green contexts' own streams.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_stub.h"

typedef int CUdevice;
typedef void *CUcontext;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101 };

/* ---- green contexts ---- */
#define GREEN_MAGIC 0x67726e63u
struct green { unsigned magic; int dev, alive; char as_ctx; };  /* &as_ctx: its CUcontext (cuCtxFromGreenCtx) */
static pthread_mutex_t greens_lock = PTHREAD_MUTEX_INITIALIZER;
static struct green *greens[256];  /* every one made (destroyed ones kept, marked: a later use is seen) */
static int ngreens;
static __thread struct green *cur_green;  /* the calling thread's current context, when a green one */

static struct green *green_of(const void *h, int as_ctx)
{
    pthread_mutex_lock(&greens_lock);
    struct green *g = NULL;
    for (int i = 0; i < ngreens && !g; i++)
        if (h && (as_ctx ? (const void *)&greens[i]->as_ctx : (const void *)greens[i]) == h) g = greens[i];
    pthread_mutex_unlock(&greens_lock);
    return g;
}
static struct green *green_of_ctx(CUcontext ctx) { return green_of(ctx, 1); }

static CUresult green_current(struct green *g, const char *call)
{
    if (!g->alive) {
        stub_misuse(call, "a destroyed green context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    cur_green = g;
    stub_set_current_device(g->dev);
    return OK;
}

/* What the driver itself uses for a process's contexts on a card (context, local memory, the
 * device heap), as on a real card: CGPU_STUB_CTX_MIB (default 0) of the card, taken by the
 * process's first context there and held until it ends (NVML's per-process view shows it). */
static CUresult context_memory(CUdevice d)
{
    static pid_t paid_by;
    static int paid[16];
    const char *m = getenv("CGPU_STUB_CTX_MIB");
    uint64_t bytes = (uint64_t)(m && *m ? strtoull(m, NULL, 10) : 0) << 20;
    if (paid_by != getpid()) {
        paid_by = getpid();
        memset(paid, 0, sizeof paid);
    }
    if (paid[d] || !bytes) return OK;
    if (stub_card_memory(d, (int64_t)bytes, NULL)) return OUT_OF_MEMORY;
    paid[d] = 1;
    return OK;
}
/* A context is its device + 1 + 16 * its generation (card.c: one per card and process, live from the
 * start, destroyed by cuCtxDestroy, the primary context's reset or its last release, made again by a
 * retain or create as a new context, a new handle; what a destroyed one held is gone with it). */
static CUcontext ctx_handle(int d) { return (CUcontext)(uintptr_t)(1 + d + 16 * (uintptr_t)stub_ctx_gen(d)); }
/* The device of a context handle, or -1 (and *dead: a handle of a destroyed context) */
static int ctx_device(CUcontext ctx, int *dead)
{
    uintptr_t h = (uintptr_t)ctx - 1;
    int d = (int)(h % 16);
    *dead = 0;
    if (!ctx || d >= stub_device_count()) return -1;
    *dead = !stub_ctx_alive(d, (unsigned)(h / 16));
    return d;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (d < 0 || d >= stub_device_count()) return INVALID_DEVICE;
    CUresult r = stub_mps_context(d);  /* (an MPS server holds the card: its clients only) */
    if (r != OK) return r;
    stub_paused("CGPU_STUB_CTX_PAUSE");  /* (a test's: a retain in flight) */
    r = context_memory(d);
    if (r != OK) return r;
    stub_ctx_retain(d);
    *ctx = ctx_handle(d);
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    if (d < 0 || d >= stub_device_count()) return INVALID_DEVICE;
    if (stub_ctx_release(d)) {  /* (its last release: the primary context is destroyed) */
        stub_exec_sync(d, NULL, 1);
        stub_ctx_kill(d);
    }
    return OK;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { return cuDevicePrimaryCtxRelease_v2(d); }  /* (CUDA 7.0's form) */
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice d)
{
    (void)flags;
    CUresult r = cuDevicePrimaryCtxRetain(ctx, d);
    if (r == OK)
        stub_set_current_device(d);
    return r;
}
CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    struct green *g = green_of_ctx(ctx);
    if (g) return green_current(g, "cuCtxSetCurrent");
    cur_green = NULL;
    int dead, d = ctx_device(ctx, &dead);
    if (ctx && dead) {
        stub_misuse("cuCtxSetCurrent", "a destroyed context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    if (ctx && d >= 0) stub_set_current_device(d);
    return OK;
}
CUresult cuCtxGetDevice(CUdevice *d)
{
    if (!d) return INVALID_VALUE;
    if (!stub_inited()) return NOT_INITIALIZED;
    if (cur_green && !cur_green->alive) {
        stub_misuse("cuCtxGetDevice", "a destroyed green context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    *d = stub_current_device();
    return OK;
}
CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    if (green_of_ctx(ctx)) return INVALID_VALUE;  /* (a green context's: cuGreenCtxDestroy) */
    int dead, d = ctx_device(ctx, &dead);
    if (d < 0) return INVALID_VALUE;
    if (dead) {
        stub_misuse("cuCtxDestroy", "a destroyed context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    stub_exec_sync(d, NULL, 1);  /* (the driver waits for the context's work) */
    stub_ctx_kill(d);
    return OK;
}

/* Wait for this process's work on its current card (its context's, every stream). */
CUresult cuCtxSynchronize(void)
{
    if (cur_green && !cur_green->alive) {
        stub_misuse("cuCtxSynchronize", "a destroyed green context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    CUresult r = stub_capture_forbids_context(stub_current_device());  /* cuda_graphs.c: not while a capture is on */
    r = r ? r : stub_exec_sync(stub_current_device(), NULL, 1);
    if (!r) stub_pools_settle(stub_current_device());  /* (pools release what they keep above their thresholds) */
    return r;
}
CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    stub_ctx_asked();  /* (CGPU_STUB_CUDA_CTX_CALLS: a test counts them) */
    if (!ctx) return INVALID_VALUE;
    if (cur_green) {
        *ctx = cur_green->alive ? (CUcontext)&cur_green->as_ctx : NULL;  /* (destroyed: none current) */
        return OK;
    }
    *ctx = stub_inited() && !stub_ctx_dead(stub_current_device()) ? ctx_handle(stub_current_device()) : NULL;  /* (destroyed: none current) */
    return OK;
}
static __thread int pushed[16], npushed;
static __thread struct green *pushed_green[16];
CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    struct green *g = green_of_ctx(ctx), *was = cur_green;
    int dead = 0, d = g ? -1 : ctx_device(ctx, &dead), before = stub_current_device();
    if (ctx && dead) {
        stub_misuse("cuCtxPushCurrent", "a destroyed context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    if (g) {
        CUresult r = green_current(g, "cuCtxPushCurrent");
        if (r) return r;
    } else if (ctx && d >= 0) {
        cur_green = NULL;
        stub_set_current_device(d);
    }
    if (npushed < 16) {
        pushed_green[npushed] = was;
        pushed[npushed++] = before;
    }
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (ctx) *ctx = cur_green ? (CUcontext)&cur_green->as_ctx : ctx_handle(stub_current_device());
    if (npushed) {
        npushed--;
        cur_green = pushed_green[npushed];
        stub_set_current_device(cur_green ? cur_green->dev : pushed[npushed]);
    }
    return OK;
}


#define OWN(fn) extern __typeof__(fn) own_##fn __attribute__((alias(#fn), visibility("hidden")))
OWN(cuDevicePrimaryCtxRelease);
OWN(cuCtxCreate_v2);
OWN(cuDevicePrimaryCtxRetain);
OWN(cuDevicePrimaryCtxRelease_v2);
OWN(cuCtxSetCurrent);
OWN(cuCtxDestroy_v2);
OWN(cuCtxSynchronize);
OWN(cuCtxGetCurrent);
OWN(cuCtxGetDevice);
OWN(cuCtxPushCurrent_v2);
OWN(cuCtxPopCurrent_v2);

CUresult cuGreenCtxCreate(void **out, void *desc, CUdevice d, unsigned flags)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (!out || !desc || flags != 1 /* CU_GREEN_CTX_DEFAULT_STREAM */) return INVALID_VALUE;
    if (d < 0 || d >= stub_device_count()) return INVALID_DEVICE;
    CUcontext primary;
    CUresult r = own_cuDevicePrimaryCtxRetain(&primary, d);  /* (the driver's own: not through an interposer) */
    if (r) return r;
    struct green *g = calloc(1, sizeof *g);
    if (!g) return STUB_OUT_OF_MEMORY;
    *g = (struct green){.magic = GREEN_MAGIC, .dev = d, .alive = 1};
    pthread_mutex_lock(&greens_lock);
    if (ngreens < (int)(sizeof greens / sizeof *greens)) greens[ngreens++] = g;
    else r = STUB_OUT_OF_MEMORY;
    pthread_mutex_unlock(&greens_lock);
    if (r) {
        free(g);
        own_cuDevicePrimaryCtxRelease_v2(d);
        return r;
    }
    *out = g;
    return OK;
}

CUresult cuCtxFromGreenCtx(CUcontext *ctx, void *h)
{
    struct green *g = green_of(h, 0);
    if (!ctx || !g) return INVALID_VALUE;
    if (!g->alive) {
        stub_misuse("cuCtxFromGreenCtx", "a destroyed green context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    *ctx = (CUcontext)&g->as_ctx;
    return OK;
}

CUresult cuGreenCtxDestroy(void *h)
{
    struct green *g = green_of(h, 0);
    if (!g) return INVALID_VALUE;
    if (!g->alive) {
        stub_misuse("cuGreenCtxDestroy", "a destroyed green context");
        return STUB_CONTEXT_IS_DESTROYED;
    }
    stub_exec_sync(g->dev, NULL, 1);  /* (its work: the process's on the card, here) */
    g->alive = 0;
    return own_cuDevicePrimaryCtxRelease_v2(g->dev);  /* (the primary context it retained) */
}

OWN(cuGreenCtxCreate);
OWN(cuCtxFromGreenCtx);
OWN(cuGreenCtxDestroy);
/* cuGetProcAddress's answers (cuda_export.c) for this file's names, by (name, version): the form
 * of the newest version not newer than the caller's */
static const struct { const char *name; int since; void *fn; } TABLE[] = {
    {"cuCtxCreate", 3020, (void *)own_cuCtxCreate_v2},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)own_cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 7000, (void *)own_cuDevicePrimaryCtxRelease},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)own_cuDevicePrimaryCtxRelease_v2},
    {"cuCtxSetCurrent", 4000, (void *)own_cuCtxSetCurrent},
    {"cuCtxDestroy", 4000, (void *)own_cuCtxDestroy_v2},
    {"cuCtxSynchronize", 2000, (void *)own_cuCtxSynchronize},
    {"cuCtxGetCurrent", 4000, (void *)own_cuCtxGetCurrent},
    {"cuCtxGetDevice", 2000, (void *)own_cuCtxGetDevice},
    {"cuCtxPushCurrent", 4000, (void *)own_cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", 4000, (void *)own_cuCtxPopCurrent_v2},
    {"cuGreenCtxCreate", 12040, (void *)own_cuGreenCtxCreate},
    {"cuCtxFromGreenCtx", 12040, (void *)own_cuCtxFromGreenCtx},
    {"cuGreenCtxDestroy", 12040, (void *)own_cuGreenCtxDestroy},
};

void *stub_contexts_proc(const char *symbol, int version, int *named)
{
    int best = -1;
    for (int i = 0; i < (int)(sizeof TABLE / sizeof *TABLE); i++) {
        if (strcmp(symbol, TABLE[i].name)) continue;
        *named = 1;
        if (TABLE[i].since <= version && (best < 0 || TABLE[i].since > TABLE[best].since)) best = i;
    }
    return best >= 0 ? TABLE[best].fn : NULL;
}
