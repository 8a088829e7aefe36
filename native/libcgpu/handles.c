/*
 * libcgpu, compute: the handles' lifetimes, and the captures begun and ended (cgpu_compute.h). Above
 * contexts.c and queue.c (it tells both), below drain.c: the circle contexts.c <-> queue.c of
 * before (issue 45's house item) is gone.
 *
 * The helper thread records into the process's streams, waits for its events, and synchronizes its
 * contexts; a handle the application destroyed meanwhile is undefined behaviour inside the driver
 * (per-request streams in CuPy and Triton's backends, cudaDeviceReset, Numba's cuda.close(), the
 * runtime's release of the primary context at exit, a green context's destroy). So the destroying
 * calls are wrapped: what the library knew of the handle is forgotten before the driver destroys it
 * (under the contexts' lock, which the drain holds while it uses a context's queues: a destroy waits
 * for the drain's deadline at most), and the syncer is waited for if it synchronizes that context
 * now (the driver's destroy waits for the same work). The driver's destroy itself runs under no lock
 * of the library's (issue 45, item 1). A stream's queue keeps its events (they are the context's)
 * but never names the stream again; a context's queues are dropped with their events (the driver
 * destroys them with it), and the context leaves the list the drain synchronizes. A primary
 * context's release is forgotten whether or not it was the last retain (a live one is noted again
 * at its next launch; asking the driver first would hold the lock across its destroy). A green
 * context (cuGreenCtxCreate, CUDA 12.4) launches through the CUcontext cuCtxFromGreenCtx gives for
 * it: cuGreenCtxDestroy forgets that one (issue 45, item 8). The application's own events are never
 * used by the library: their destruction is the driver's.
 *
 * The calls that change the calling thread's current context (cuCtxSetCurrent, the pushes and pops,
 * the destroys and cuCtxDetach, the primary context's release and reset; the creates are memory.c's)
 * tell contexts.c what they left current: a launch then needs no driver call to know its GPU
 * (docs/isolation.md, "The launch path").
 *
 * Captures (issue 45, item 2): the syncer never synchronizes a context with a capture on (in every
 * capture mode that invalidates it: the CUDA Programming Guide, "Prohibited and Unhandled
 * Operations"), whatever stream it is on, queued into or not: cuStreamBeginCapture's forms count one
 * on the stream's context when the driver began it, cuStreamEndCapture's forms (and a capturing
 * stream's destroy) count it off once the stream no longer captures.
 */
#include "cgpu_compute.h"

typedef CUresult (*handle_fn)(void *);
typedef CUresult (*device_fn)(CUdevice);
typedef CUresult (*ctx_of_fn)(void *, CUcontext *);  /* cuStreamGetCtx (stream, *ctx) */
typedef CUresult (*green_ctx_fn)(CUcontext *, void *);  /* cuCtxFromGreenCtx (*ctx, green) */
typedef CUresult (*begin_fn)(void *);
typedef CUresult (*begin2_fn)(void *, int);
typedef CUresult (*begin_graph_fn)(void *, void *, const void *, const void *, size_t, int);
typedef CUresult (*end_fn)(void *, void **);
typedef CUresult (*pop_fn)(CUcontext *);
static void *lazy(void **slot, const char *name)
{
    void *f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!f && (f = sym(name)))
        __atomic_store_n(slot, f, __ATOMIC_RELEASE);
    return f;
}
#define REAL(type, name) ((type)lazy(&real_##name, #name))
static void *real_cuStreamDestroy, *real_cuStreamDestroy_v2, *real_cuCtxDestroy, *real_cuCtxDestroy_v2,
    *real_cuDevicePrimaryCtxRelease, *real_cuDevicePrimaryCtxRelease_v2, *real_cuDevicePrimaryCtxReset,
    *real_cuDevicePrimaryCtxReset_v2, *real_cuGreenCtxDestroy, *real_cuCtxFromGreenCtx, *real_cuStreamGetCtx,
    *real_cuStreamBeginCapture, *real_cuStreamBeginCapture_ptsz, *real_cuStreamBeginCapture_v2,
    *real_cuStreamBeginCapture_v2_ptsz, *real_cuStreamBeginCaptureToGraph, *real_cuStreamBeginCaptureToGraph_ptsz,
    *real_cuStreamEndCapture, *real_cuStreamEndCapture_ptsz, *real_cuCtxSetCurrent, *real_cuCtxPushCurrent,
    *real_cuCtxPushCurrent_v2, *real_cuCtxPopCurrent, *real_cuCtxPopCurrent_v2, *real_cuCtxDetach;

/* Forget context c (NULL: every one of CUDA device `dev`; dev -1 with c NULL: every one), its queues
 * and its charge's clock, and wait for the syncer to be done with it. */
static void forget(CUcontext c, CUdevice dev)
{
    CUcontext gone[64];
    pthread_mutex_lock(&ctx_lock);
    int n = contexts_forget(c, dev, gone);
    for (int i = 0; i < n; i++)
        queue_forget_context(gone[i]);
    if (!c)
        queue_forget_context(NULL);  /* (and queues of contexts never listed: of that device, or all) */
    else if (!n)
        queue_forget_context(c);
    contexts_wait(c, dev);
    pthread_mutex_unlock(&ctx_lock);
}

/* The context of `stream` (the calling thread's current one where the driver does not say). */
static CUcontext context_of(void *stream)
{
    CUcontext c = NULL;
    ctx_of_fn of = REAL(ctx_of_fn, cuStreamGetCtx);
    in_driver++;
    if (!of || of(stream, &c) != CU_OK || !c) {
        c = NULL;
        if (real.ctx_get)
            real.ctx_get(&c);
    }
    in_driver--;
    return c;
}

static int stream_capturing(void *stream)
{
    int st = 0;
    in_driver++;
    int r = ev.capturing && ev.capturing(stream, &st) == CU_OK && st != 0;
    in_driver--;
    return r;
}

static CUresult stream_destroy(handle_fn fn, void *stream)
{
    PASS_THROUGH(fn, stream);
    queue_forget_stream(stream);
    CUcontext c = stream_capturing(stream) ? context_of(stream) : NULL;  /* (its capture ends with it) */
    in_driver++;
    CUresult r = fn(stream);
    in_driver--;
    if (r == CU_OK && c)
        contexts_capture(c, -1);
    return r;
}
CUresult cuStreamDestroy(void *stream) { return stream_destroy(REAL(handle_fn, cuStreamDestroy), stream); }
CUresult cuStreamDestroy_v2(void *stream) { return stream_destroy(REAL(handle_fn, cuStreamDestroy_v2), stream); }

/* cuCtxDestroy pops the context when it is the calling thread's current one (cuda.h: "If ctx is
 * current to the calling thread then ctx will also be popped from the current thread's context
 * stack (as though cuCtxPopCurrent() were called)"): what it leaves current is asked after it. */
static CUresult ctx_destroy(handle_fn fn, CUcontext c)
{
    PASS_THROUGH(fn, c);
    forget(c, -1);
    in_driver++;
    CUresult r = fn(c);
    in_driver--;
    contexts_switched();
    return r;
}
CUresult cuCtxDestroy(CUcontext c) { return ctx_destroy(REAL(handle_fn, cuCtxDestroy), c); }
CUresult cuCtxDestroy_v2(CUcontext c) { return ctx_destroy(REAL(handle_fn, cuCtxDestroy_v2), c); }
/* cuCtxDetach (CUDA 2.0, deprecated): "Decrements the usage count of the context ctx, and destroys the
 * context if the usage count goes to 0 ... must be current to the calling thread" (cuda.h): forgotten
 * as a destroy is, whether or not it was the last use (a live one is noted again at its next launch) */
CUresult cuCtxDetach(CUcontext c) { return ctx_destroy(REAL(handle_fn, cuCtxDetach), c); }

/* cuDevicePrimaryCtxReset and cuDevicePrimaryCtxRelease (the primary context's handle is not known
 * here: the device's all are forgotten). Neither pops it (cuda.h: "unlike cuCtxDestroy() this method
 * does not pop the context from stack in any circumstances"), but the last release destroys it: the
 * thread may be left with no live current context, so what is current is asked after it (the
 * forgetting has already made every thread's known context of an older epoch: asked again). */
static CUresult primary_end(device_fn fn, CUdevice dev)
{
    PASS_THROUGH(fn, dev);
    forget(NULL, dev);
    in_driver++;
    CUresult r = fn(dev);
    in_driver--;
    contexts_switched();
    return r;
}
CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return primary_end(REAL(device_fn, cuDevicePrimaryCtxReset), dev); }
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return primary_end(REAL(device_fn, cuDevicePrimaryCtxReset_v2), dev);
}
CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return primary_end(REAL(device_fn, cuDevicePrimaryCtxRelease), dev);
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_end(REAL(device_fn, cuDevicePrimaryCtxRelease_v2), dev);
}

/* ---- the calls that change the calling thread's current context (docs/isolation.md, "The launch
 * path": the launch takes the context they leave current from the thread's record, with no driver
 * call). From cuda.h (CUDA 13.5): cuCtxSetCurrent "Binds the specified CUDA context to the calling
 * CPU thread ... this will replace the top of that stack with ctx" (NULL: pops it); cuCtxPushCurrent
 * "The specified context becomes the CPU thread's current context"; cuCtxPopCurrent: "If a context was
 * current to the CPU thread before cuCtxCreate() or cuCtxPushCurrent() was called, this function makes
 * that context current to the CPU thread again". The CUDA 2.0 forms (cuCtxPushCurrent and
 * cuCtxPopCurrent, cudaTypedefs.h's PFN_..._v2000) take the same arguments. Whatever they return,
 * the context left current is asked once, after them (a green context's CUcontext included: the
 * driver's answer, not the argument). ---- */
#define SWITCH(fn, ...)                          \
    do {                                         \
        PASS_THROUGH(fn, __VA_ARGS__);           \
        in_driver++;                             \
        CUresult r_ = (fn)(__VA_ARGS__);         \
        in_driver--;                             \
        contexts_switched();                     \
        return r_;                               \
    } while (0)
CUresult cuCtxSetCurrent(CUcontext c) { SWITCH(REAL(handle_fn, cuCtxSetCurrent), c); }
CUresult cuCtxPushCurrent(CUcontext c) { SWITCH(REAL(handle_fn, cuCtxPushCurrent), c); }
CUresult cuCtxPushCurrent_v2(CUcontext c) { SWITCH(REAL(handle_fn, cuCtxPushCurrent_v2), c); }
CUresult cuCtxPopCurrent(CUcontext *c) { SWITCH(REAL(pop_fn, cuCtxPopCurrent), c); }
CUresult cuCtxPopCurrent_v2(CUcontext *c) { SWITCH(REAL(pop_fn, cuCtxPopCurrent_v2), c); }

/* cuGreenCtxDestroy (CUDA 12.4): the CUcontext its launches went through is forgotten first */
CUresult cuGreenCtxDestroy(void *green)
{
    handle_fn fn = REAL(handle_fn, cuGreenCtxDestroy);
    PASS_THROUGH(fn, green);
    green_ctx_fn as_ctx = REAL(green_ctx_fn, cuCtxFromGreenCtx);
    CUcontext c = NULL;
    in_driver++;
    int known = as_ctx && as_ctx(&c, green) == CU_OK && c;
    in_driver--;
    if (known)
        forget(c, -1);
    else
        forget(NULL, -1);  /* (its context not known: every one, to be safe; live ones are noted again) */
    in_driver++;
    CUresult r = fn(green);
    in_driver--;
    return r;
}

/* ---- captures begun and ended ---- */
#define BEGUN(fn, stream, ...)                               \
    do {                                                     \
        PASS_THROUGH(fn, __VA_ARGS__);                       \
        in_driver++;                                         \
        CUresult r_ = (fn)(__VA_ARGS__);                     \
        in_driver--;                                         \
        if (r_ == CU_OK)                                     \
            contexts_capture(context_of(stream), 1);         \
        return r_;                                           \
    } while (0)
CUresult cuStreamBeginCapture(void *s) { BEGUN(REAL(begin_fn, cuStreamBeginCapture), s, s); }
CUresult cuStreamBeginCapture_ptsz(void *s) { BEGUN(REAL(begin_fn, cuStreamBeginCapture_ptsz), s, s); }
CUresult cuStreamBeginCapture_v2(void *s, int mode) { BEGUN(REAL(begin2_fn, cuStreamBeginCapture_v2), s, s, mode); }
CUresult cuStreamBeginCapture_v2_ptsz(void *s, int mode)
{
    BEGUN(REAL(begin2_fn, cuStreamBeginCapture_v2_ptsz), s, s, mode);
}
CUresult cuStreamBeginCaptureToGraph(void *s, void *g, const void *deps, const void *data, size_t n, int mode)
{
    BEGUN(REAL(begin_graph_fn, cuStreamBeginCaptureToGraph), s, s, g, deps, data, n, mode);
}
CUresult cuStreamBeginCaptureToGraph_ptsz(void *s, void *g, const void *deps, const void *data, size_t n, int mode)
{
    BEGUN(REAL(begin_graph_fn, cuStreamBeginCaptureToGraph_ptsz), s, s, g, deps, data, n, mode);
}

static CUresult end_capture(end_fn fn, void *s, void **graph)
{
    PASS_THROUGH(fn, s, graph);
    int was = stream_capturing(s);
    CUcontext c = was ? context_of(s) : NULL;
    in_driver++;
    CUresult r = fn(s, graph);
    in_driver--;
    if (was && !stream_capturing(s))  /* (ended, even invalidated; not by another thread: it goes on) */
        contexts_capture(c, -1);
    return r;
}
CUresult cuStreamEndCapture(void *s, void **graph) { return end_capture(REAL(end_fn, cuStreamEndCapture), s, graph); }
CUresult cuStreamEndCapture_ptsz(void *s, void **graph)
{
    return end_capture(REAL(end_fn, cuStreamEndCapture_ptsz), s, graph);
}
