/*
 * libcgpu, compute: the contexts the process launches in, and their page GPU (cgpu_compute.h).
 */
#include <signal.h>
#include <time.h>

#include "cgpu_compute.h"

pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctxs[64];
static int ctx_gpu[64];  /* the page's GPU of each (-1: past the page's) */
static CUdevice ctx_dev[64];  /* its CUDA device (-1: not asked: a page with the one gate) */
static int nctxs;
static unsigned ctx_epoch;  /* counts the contexts forgotten: a thread's known_ctx of an older epoch is looked up again */
HOT_TLS CUcontext known_ctx;
HOT_TLS int known_gpu;
static HOT_TLS unsigned known_epoch;

/* The page GPU the calling thread launches on (its current context's device), -1 for the
 * container's gate: a page without per-GPU gates, or a device past the page's. The device is
 * asked at every launch (a context's address may come back for another device once destroyed). */
int note_context(void)
{
    CUcontext c = NULL;
    if (!real.ctx_get || real.ctx_get(&c) != CU_OK || !c)
        return per_gpu ? 0 : -1;  /* (no context: the driver refuses the launch itself) */
    CUdevice dev = -1;
    int k = -1;
    if (per_gpu && real.ctx_get_device && real.ctx_get_device(&dev) == CU_OK)
        k = page_index(dev);
    unsigned epoch = __atomic_load_n(&ctx_epoch, __ATOMIC_ACQUIRE);
    if (c == known_ctx && k == known_gpu && epoch == known_epoch)
        return k;
    known_ctx = c;
    known_gpu = k;
    known_epoch = epoch;
    pthread_mutex_lock(&ctx_lock);
    int i = 0;
    while (i < nctxs && ctxs[i] != c)
        i++;
    if (i < nctxs) {
        ctx_gpu[i] = k;  /* (drained with that GPU from now on) */
        ctx_dev[i] = dev;
    } else if (nctxs < (int)(sizeof ctxs / sizeof *ctxs)) {  /* (destroyed ones are forgotten: these live) */
        ctx_gpu[nctxs] = k;
        ctx_dev[nctxs] = dev;
        ctxs[nctxs++] = c;
    }
    pthread_mutex_unlock(&ctx_lock);
    return k;
}

/* The page GPU of context c (ctx_lock held), -2 if it is not known. */
int gpu_of_ctx(CUcontext c)
{
    for (int i = 0; i < nctxs; i++)
        if (ctxs[i] == c)
            return ctx_gpu[i];
    return -2;
}


/* The contexts' synchronize, by a thread of its own (the syncer): cuCtxSynchronize has no deadline,
 * and the helper answers within one. One request at a time: a closing that finds the syncer still
 * at the one before waits for that (within its deadline) instead of asking again. */
static pthread_mutex_t sync_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sync_cv = PTHREAD_COND_INITIALIZER;
static int sync_asked = -2, sync_busy;  /* sync_asked: the page GPU asked for (-1: all; -2: none) */
static uint64_t sync_done;               /* requests done */
static pthread_once_t syncer_once = PTHREAD_ONCE_INIT;

static void *syncer(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&sync_lock);
    for (;;) {
        while (sync_asked == -2)
            pthread_cond_wait(&sync_cv, &sync_lock);
        int k = sync_asked;
        sync_asked = -2;
        sync_busy = 1;
        pthread_mutex_unlock(&sync_lock);
        pthread_mutex_lock(&ctx_lock);  /* (a context is not destroyed under it) */
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
        pthread_mutex_lock(&sync_lock);
        sync_busy = 0;
        sync_done++;
        pthread_cond_broadcast(&sync_cv);
    }
    return NULL;
}

static int syncer_ok;
static void start_syncer(void)
{
    int made = -1;  /* (as the helper: more stack when the static TLS does not fit) */
    for (size_t stack = 256 << 10; made && stack <= (64u << 20); stack *= 4)
        made = start_thread(syncer, stack);
    syncer_ok = made == 0;
}

int contexts_sync(int k, int64_t deadline)
{
    pthread_once(&syncer_once, start_syncer);
    if (!syncer_ok)
        return -1;
    pthread_mutex_lock(&sync_lock);
    /* (one running now began before this closing: what it finishes may not cover this closing's work;
     * the one asked for now, after it, does) */
    uint64_t want = sync_done + 1 + (sync_busy ? 1 : 0);
    sync_asked = sync_asked == -2 || sync_asked == k ? k : -1;
    pthread_cond_broadcast(&sync_cv);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    int64_t left = deadline - mono_ns();
    left = left < 0 ? 0 : left > 1000000000000000ll ? 1000000000000000ll : left;  /* (INT64_MAX: none, in effect) */
    int64_t ns = (int64_t)until.tv_nsec + left;
    until.tv_sec += (time_t)(ns / 1000000000);
    until.tv_nsec = (long)(ns % 1000000000);
    while (sync_done < want && pthread_cond_timedwait(&sync_cv, &sync_lock, &until) == 0)
        ;
    int r = sync_done >= want ? 0 : -1;
    pthread_mutex_unlock(&sync_lock);
    return r;
}

/* ---- the handles' lifetimes (issue 34) -------------------------------------------------------
 *
 * The helper thread records into the process's streams, waits for its events, and synchronizes its
 * contexts; a handle the application destroyed meanwhile is undefined behaviour inside the driver
 * (per-request streams in CuPy and Triton's backends, cudaDeviceReset, Numba's cuda.close(), the
 * runtime's release of the primary context at exit). So the destroying calls are wrapped: under the
 * contexts' lock (the drain and the syncer hold it while they use a context), what the library knew
 * of the handle is forgotten before the driver destroys it: a stream's queue keeps its events (they
 * are the context's) but never names the stream again; a context's queues are dropped with their
 * events (the driver destroys them with it, the library does not touch them again), and the context
 * leaves the list the drain synchronizes. The primary context's release destroys it only when it
 * was the last retain: the driver is asked (cuDevicePrimaryCtxGetState) under the same lock. The
 * application's own events are never used by the library: their destruction is the driver's. */
typedef CUresult (*handle_fn)(void *);
typedef CUresult (*device_fn)(CUdevice);
typedef CUresult (*primary_state_fn)(CUdevice, unsigned *, int *);
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
    *real_cuDevicePrimaryCtxReset_v2, *real_cuDevicePrimaryCtxGetState;

/* Forget contexts: `c` (NULL: every one of CUDA device `dev`; dev -1 with c NULL: every one). (ctx_lock held) */
static void forget_contexts(CUcontext c, CUdevice dev)
{
    for (int i = 0; i < nctxs;) {
        if (c ? ctxs[i] == c : dev < 0 || ctx_dev[i] < 0 || ctx_dev[i] == dev) {
            queue_forget_context(ctxs[i]);
            nctxs--;
            ctxs[i] = ctxs[nctxs];
            ctx_gpu[i] = ctx_gpu[nctxs];
            ctx_dev[i] = ctx_dev[nctxs];
        } else
            i++;
    }
    if (!c)
        queue_forget_context(NULL);  /* (and queues of contexts never listed: of that device, or all) */
    __atomic_add_fetch(&ctx_epoch, 1, __ATOMIC_RELEASE);
}

static CUresult stream_destroy(handle_fn fn, void *stream)
{
    PASS_THROUGH(fn, stream);
    queue_forget_stream(stream);
    in_driver++;
    CUresult r = fn(stream);
    in_driver--;
    return r;
}
CUresult cuStreamDestroy(void *stream) { return stream_destroy(REAL(handle_fn, cuStreamDestroy), stream); }
CUresult cuStreamDestroy_v2(void *stream) { return stream_destroy(REAL(handle_fn, cuStreamDestroy_v2), stream); }

static CUresult ctx_destroy(handle_fn fn, CUcontext c)
{
    PASS_THROUGH(fn, c);
    pthread_mutex_lock(&ctx_lock);
    forget_contexts(c, -1);
    in_driver++;
    CUresult r = fn(c);
    in_driver--;
    pthread_mutex_unlock(&ctx_lock);
    return r;
}
CUresult cuCtxDestroy(CUcontext c) { return ctx_destroy(REAL(handle_fn, cuCtxDestroy), c); }
CUresult cuCtxDestroy_v2(CUcontext c) { return ctx_destroy(REAL(handle_fn, cuCtxDestroy_v2), c); }

static CUresult primary_reset(device_fn fn, CUdevice dev)
{
    PASS_THROUGH(fn, dev);
    pthread_mutex_lock(&ctx_lock);
    forget_contexts(NULL, dev);  /* (the primary context's handle is not known here: the device's all) */
    in_driver++;
    CUresult r = fn(dev);
    in_driver--;
    pthread_mutex_unlock(&ctx_lock);
    return r;
}
CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return primary_reset(REAL(device_fn, cuDevicePrimaryCtxReset), dev); }
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    return primary_reset(REAL(device_fn, cuDevicePrimaryCtxReset_v2), dev);
}

static CUresult primary_release(device_fn fn, CUdevice dev)
{
    PASS_THROUGH(fn, dev);
    primary_state_fn state = REAL(primary_state_fn, cuDevicePrimaryCtxGetState);
    pthread_mutex_lock(&ctx_lock);
    in_driver++;
    CUresult r = fn(dev);
    unsigned flags = 0;
    int active = 0;
    if (r == CU_OK && (!state || state(dev, &flags, &active) != CU_OK || !active))
        forget_contexts(NULL, dev);  /* (its last release: destroyed; not known: forgotten, to be safe) */
    in_driver--;
    pthread_mutex_unlock(&ctx_lock);
    return r;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return primary_release(REAL(device_fn, cuDevicePrimaryCtxRelease), dev);
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return primary_release(REAL(device_fn, cuDevicePrimaryCtxRelease_v2), dev);
}

void contexts_forked(void)
{
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    syncer_once = fresh;  /* (no syncer in the child) */
    sync_asked = -2;
    sync_busy = 0;
    nctxs = 0;
    known_ctx = NULL;
}
