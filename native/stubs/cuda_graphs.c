/*
 * The stand-in driver's streams, stream capture and CUDA graphs, with the driver's capture rules
 * as NVIDIA documents them (cuStreamBeginCapture, cuThreadExchangeStreamCaptureMode,
 * CUstreamCaptureMode):
 *
 * - a thread has a capture mode (cuThreadExchangeStreamCaptureMode; GLOBAL unless changed), and
 *   a capture is begun with one (cuStreamBeginCapture_v2's `mode`);
 * - a "potentially unsafe" call (cuCtxSynchronize, cuStreamSynchronize, cuStreamQuery,
 *   cuEventSynchronize, cuEventQuery, cuMemAlloc, cuMemFree) is prohibited to a thread that
 *   captures itself (a capture not begun RELAXED) unless the thread's mode is RELAXED, and to a
 *   thread in GLOBAL mode while any other thread captures in GLOBAL mode. A prohibited call
 *   fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the captures that prohibited
 *   it: their cuStreamEndCapture answers CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (and no graph),
 *   and launches into them the same;
 * - synchronizing or querying a capturing stream is prohibited in every mode (it has no work to
 *   wait for: what is captured does not run), and invalidates its capture;
 * - so is synchronizing "a broader handle which encompasses an active stream capture, such as a
 *   device or context handle when any associated stream is in capture mode" (the CUDA Programming
 *   Guide, "Prohibited and Unhandled Operations"): cuCtxSynchronize while any stream of the
 *   context captures, whatever the thread's and the capture's modes (a relaxed thread is not
 *   spared: the H100 invalidated PyTorch's capture so when libcgpu's relaxed helper drained);
 * - a capture is ended by the thread that began it unless it was begun RELAXED
 *   (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD).
 *
 * A launch into a capturing stream (cuLaunchKernel and the others, cuGraphLaunch of an executable
 * graph) is recorded in its graph, not run. cuGraphInstantiate(WithFlags, WithParams) makes an
 * executable graph of the recorded kernels; cuGraphLaunch queues them into its stream one after
 * another (each its gridX*gridY*gridZ µs, as a launch: cuda_exec.c runs them). cuMemAllocAsync and
 * cuMemFreeAsync into a capturing stream become memory nodes of its graph; a graph's nodes (child,
 * conditional and memory nodes, built by hand too) and the device's graph memory pool are
 * cuda_graphnodes.c's. Not modelled: cross-stream capture through events (a fork into another
 * stream), the legacy stream's implicit dependencies.
 *
 * Streams are objects here (cuStreamCreate), so each one's capture is its own; the legacy (0, 1)
 * and per-thread (2) streams cannot be captured.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_graph.h"

typedef void *CUstream;
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
enum { STATUS_NONE = 0, STATUS_ACTIVE = 1, STATUS_INVALIDATED = 2 };
enum { ILLEGAL_STATE = 401, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901, CAPTURE_WRONG_THREAD = 908 };

struct stream {
    unsigned magic, flags;
    int dev;
    unsigned gen;                  /* its context's generation (cuda_stub.h) */
    int capturing, mode, invalid;  /* capturing: its capture's status; mode: the one it was begun with */
    pthread_t by;                  /* the thread that began the capture */
    unsigned long long id;
    struct graph *g;
};
enum { STREAM_MAGIC = 0x7374726d, STREAM_DEAD = 0x64656164 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct stream *capturing[256];  /* the streams capturing now */
static int ncapturing;
static unsigned long long capture_ids;
static __thread int thread_mode = MODE_GLOBAL;

static struct stream *stream_of(CUstream s)
{
    struct stream *st = (struct stream *)s;
    return (uintptr_t)s > 2 && st->magic == STREAM_MAGIC && stub_ctx_alive(st->dev, st->gen) ? st : NULL;
}

/* (a destroyed stream is kept, marked: a later use of its handle is seen, not another object's) */
int stub_stream_dead(const void *s, const char *call)
{
    const struct stream *st = (const struct stream *)s;
    if ((uintptr_t)s <= 2 || (st->magic != STREAM_MAGIC && st->magic != STREAM_DEAD)) return 0;
    if (st->magic == STREAM_MAGIC && stub_ctx_alive(st->dev, st->gen)) return 0;
    stub_misuse(call, st->magic == STREAM_DEAD ? "a destroyed stream" : "a stream of a destroyed context");
    return 1;
}

int stub_stream_device(const void *s)
{
    struct stream *st = stream_of((CUstream)s);
    return st ? st->dev : stub_current_device();
}

CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
    if (!s || flags & ~1u) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    struct stream *st = calloc(1, sizeof *st);
    st->magic = STREAM_MAGIC;
    st->flags = flags;
    st->dev = stub_current_device();
    st->gen = stub_ctx_gen(st->dev);
    *s = st;
    return STUB_OK;
}

static void end_capture(struct stream *st)  /* (lock held) */
{
    for (int i = 0; i < ncapturing; i++)
        if (capturing[i] == st)
            capturing[i] = capturing[--ncapturing];
    st->capturing = STATUS_NONE;
    st->invalid = 0;
}

CUresult cuStreamDestroy_v2(CUstream s)
{
    if (stub_stream_dead(s, "cuStreamDestroy")) return STUB_INVALID_HANDLE;
    struct stream *st = stream_of(s);
    if (!st) return STUB_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    if (st->capturing) {  /* (the driver ends the capture; its graph is dropped) */
        end_capture(st);
        graph_free(st->g);
    }
    st->magic = STREAM_DEAD;
    pthread_mutex_unlock(&lock);
    return STUB_OK;
}

/* Whether the calling thread may make a potentially unsafe call now (STUB_OK), else
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, the captures that prohibit it invalidated. `synced` is
 * the stream the call synchronizes or queries (NULL: none, or the whole context). */
CUresult stub_capture_forbids(const void *synced)
{
    struct stream *target = stream_of((CUstream)synced);
    CUresult r = STUB_OK;
    pthread_mutex_lock(&lock);
    if (target && target->capturing) {  /* its own work is being captured: nothing to wait for */
        target->capturing = STATUS_INVALIDATED;
        r = CAPTURE_UNSUPPORTED;
    }
    if (thread_mode != MODE_RELAXED)
        for (int i = 0; i < ncapturing; i++) {
            struct stream *c = capturing[i];
            int own = pthread_equal(c->by, pthread_self());
            if ((own && c->mode != MODE_RELAXED) || (!own && thread_mode == MODE_GLOBAL && c->mode == MODE_GLOBAL)) {
                c->capturing = STATUS_INVALIDATED;
                r = CAPTURE_UNSUPPORTED;
            }
        }
    pthread_mutex_unlock(&lock);
    if (r) stub_trace("potentially unsafe call during a capture: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED");
    return r;
}

/* cuCtxSynchronize's rule: the thread's mode as for any potentially unsafe call, and no stream of
 * the context on card `dev` capturing (each one that is: invalidated). */
CUresult stub_capture_forbids_context(int dev)
{
    CUresult r = stub_capture_forbids(NULL);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < ncapturing; i++)
        if (capturing[i]->g && capturing[i]->g->dev == dev) {
            capturing[i]->capturing = STATUS_INVALIDATED;
            r = CAPTURE_UNSUPPORTED;
        }
    pthread_mutex_unlock(&lock);
    if (r) stub_trace("a context synchronized while one of its streams captures: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED");
    return r;
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    if (!mode || *mode < MODE_GLOBAL || *mode > MODE_RELAXED) return STUB_INVALID_VALUE;
    int old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    return STUB_OK;
}

CUresult cuStreamBeginCapture_v2(CUstream s, int mode)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) return STUB_INVALID_VALUE;
    struct stream *st = stream_of(s);
    if (!st) return (uintptr_t)s <= 2 ? CAPTURE_UNSUPPORTED : STUB_INVALID_HANDLE;  /* the legacy / per-thread stream */
    pthread_mutex_lock(&lock);
    CUresult r = STUB_OK;
    if (st->capturing)
        r = ILLEGAL_STATE;
    else if (ncapturing == (int)(sizeof capturing / sizeof *capturing))
        r = STUB_OUT_OF_MEMORY;
    else if (!(st->g = graph_new(stub_current_device(), GRAPH_MAGIC)))
        r = STUB_OUT_OF_MEMORY;
    else {
        st->capturing = STATUS_ACTIVE;
        st->mode = mode;
        st->by = pthread_self();
        st->id = ++capture_ids;
        capturing[ncapturing++] = st;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuStreamBeginCapture(CUstream s) { return cuStreamBeginCapture_v2(s, MODE_GLOBAL); }

CUresult cuStreamEndCapture(CUstream s, struct graph **out)
{
    struct stream *st = stream_of(s);
    if (!out) return STUB_INVALID_VALUE;
    if (!st) return STUB_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    CUresult r = STUB_OK;
    if (!st->capturing)
        r = ILLEGAL_STATE;
    else if (st->mode != MODE_RELAXED && !pthread_equal(st->by, pthread_self()))
        r = CAPTURE_WRONG_THREAD;
    else {
        struct graph *g = st->g;
        r = st->capturing == STATUS_INVALIDATED ? CAPTURE_INVALIDATED : STUB_OK;
        end_capture(st);
        st->g = NULL;
        if (r) {
            graph_free(g);
            g = NULL;
        }
        *out = g;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuStreamGetCaptureInfo_v3(CUstream s, int *status, unsigned long long *id, struct graph **graph,
                                   const void **deps, const void **edges, size_t *ndeps)
{
    if (!status) return STUB_INVALID_VALUE;
    if (stub_stream_dead(s, "cuStreamIsCapturing")) return STUB_INVALID_HANDLE;
    struct stream *st = stream_of(s);
    if (!st && (uintptr_t)s > 2) return STUB_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    *status = st ? st->capturing : STATUS_NONE;
    if (*status) {  /* the other outputs only of a capture (left as they are otherwise) */
        if (id) *id = st->id;
        if (graph) *graph = st->g;
        if (deps) *deps = NULL;  /* (no node handles: the graph is its kernels in order) */
        if (edges) *edges = NULL;
        if (ndeps) *ndeps = 0;
    }
    pthread_mutex_unlock(&lock);
    return STUB_OK;
}
CUresult cuStreamGetCaptureInfo_v2(CUstream s, int *status, unsigned long long *id, struct graph **graph,
                                   const void **deps, size_t *ndeps)
{
    return cuStreamGetCaptureInfo_v3(s, status, id, graph, deps, NULL, ndeps);
}
CUresult cuStreamGetCaptureInfo(CUstream s, int *status, unsigned long long *id)
{
    return cuStreamGetCaptureInfo_v3(s, status, id, NULL, NULL, NULL, NULL);
}
CUresult cuStreamIsCapturing(CUstream s, int *status)
{
    return cuStreamGetCaptureInfo_v3(s, status, NULL, NULL, NULL, NULL, NULL);
}

/* A launch of `n` kernels of us[] µs into `s`: 1 and *r when `s` captures (recorded, or the
 * capture's error), 0 when it is to run. */
int stub_capture_launch(const void *s, const uint64_t *us, size_t n, CUresult *r)
{
    if (stub_stream_dead(s, "a launch")) {
        *r = STUB_INVALID_HANDLE;
        return 1;
    }
    struct stream *st = stream_of((CUstream)s);
    if (!st) return 0;
    pthread_mutex_lock(&lock);
    int captured = st->capturing != STATUS_NONE;
    if (captured)
        *r = st->capturing == STATUS_INVALIDATED ? CAPTURE_INVALIDATED
           : graph_add_kernels(st->g, us, n);
    pthread_mutex_unlock(&lock);
    return captured;
}

/* cuMemAllocAsync into `s`: 1 and *r when `s` captures (a mem-alloc node of the capture's graph, *p
 * its address: cuda_graphnodes.c), 0 when it is to allocate. */
int stub_capture_alloc(const void *s, size_t size, CUdeviceptr *p, CUresult *r)
{
    struct stream *st = stream_of((CUstream)s);
    if (!st) return 0;
    pthread_mutex_lock(&lock);
    int captured = st->capturing != STATUS_NONE;
    if (captured)
        *r = st->capturing == STATUS_INVALIDATED ? CAPTURE_INVALIDATED : graph_add_alloc(st->g, size, st->dev, p);
    pthread_mutex_unlock(&lock);
    return captured;
}

/* cuMemFreeAsync of `p` into `s`: 1 and *r when `s` captures (a mem-free node) or `p` is a graph
 * allocation (freed: "passing the allocation to cuMemFreeAsync or cuMemFree",
 * cuGraphAddMemAllocNode; its pages stay the executable graph's), 0 when it is another's to free. */
int stub_capture_free(const void *s, CUdeviceptr p, CUresult *r)
{
    struct stream *st = stream_of((CUstream)s);
    int captured = 0;
    if (st) {
        pthread_mutex_lock(&lock);
        if ((captured = st->capturing != STATUS_NONE))
            *r = st->capturing == STATUS_INVALIDATED ? CAPTURE_INVALIDATED : graph_add_free(st->g, p);
        pthread_mutex_unlock(&lock);
    }
    if (!captured && graph_allocation(p)) {
        *r = STUB_OK;
        captured = 1;
    }
    return captured;
}

CUresult cuGraphCreate(struct graph **g, unsigned flags)
{
    if (!g || flags) return STUB_INVALID_VALUE;
    *g = graph_new(stub_current_device(), GRAPH_MAGIC);
    return *g ? STUB_OK : STUB_OUT_OF_MEMORY;
}
CUresult cuGraphDestroy(struct graph *g)
{
    if (!g || g->magic != GRAPH_MAGIC) return STUB_INVALID_VALUE;
    graph_free(g);
    return STUB_OK;
}
CUresult cuGraphGetNodes(struct graph *g, void **nodes, size_t *n)
{
    if (!g || g->magic != GRAPH_MAGIC || !n) return STUB_INVALID_VALUE;
    if (nodes)
        for (size_t i = 0; i < *n && i < g->nn; i++)
            nodes[i] = g->nodes[i];  /* (its nodes: cuda_graphnodes.c) */
    *n = g->nn;
    return STUB_OK;
}

CUresult cuGraphInstantiateWithFlags(struct graph **exec, struct graph *g, unsigned long long flags)
{
    if (!exec || !g || g->magic != GRAPH_MAGIC || flags & ~0xfull) return STUB_INVALID_VALUE;
    struct graph *e = graph_new(g->dev, EXEC_MAGIC);
    CUresult r = e ? graph_flatten(g, e) : STUB_OUT_OF_MEMORY;
    if (r) {
        graph_free(e);
        return r;
    }
    /* the driver's own memory for it: CGPU_STUB_GRAPH_KIB (70 MiB, what one captured PyTorch graph
     * took on the H100 beyond its allocations), none left on the card: out of memory */
    uint64_t bytes = stub_growth("GRAPH", 70 << 10);
    if (stub_driver_memory(e->dev, (int64_t)bytes)) {
        graph_free(e);
        return STUB_OUT_OF_MEMORY;
    }
    e->on_card = bytes;
    /* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD (2): uploaded now, its graph memory with it (cuda_graphnodes.c) */
    if (flags & 2 && (r = graph_map(e))) {
        graph_free(e);
        return r;
    }
    *exec = e;
    return STUB_OK;
}
/* CUDA 11's signature (the error node and a log) */
CUresult cuGraphInstantiate_v2(struct graph **exec, struct graph *g, void **err_node, char *log, size_t log_size)
{
    if (err_node) *err_node = NULL;
    if (log && log_size) *log = 0;
    return cuGraphInstantiateWithFlags(exec, g, 0);
}
typedef struct { unsigned long long flags; CUstream upload; void *err_node; int result; } instantiate_params;
CUresult cuGraphInstantiateWithParams(struct graph **exec, struct graph *g, instantiate_params *p)
{
    if (!p) return STUB_INVALID_VALUE;
    CUresult r = cuGraphInstantiateWithFlags(exec, g, p->flags & 0xf);
    p->err_node = NULL;
    p->result = r ? 2 : 0;  /* CUDA_GRAPH_INSTANTIATE_(ERROR|SUCCESS) */
    return r;
}
CUresult cuGraphUpload(struct graph *exec, CUstream s)
{
    (void)s;
    return exec && exec->magic == EXEC_MAGIC ? graph_map(exec) : STUB_INVALID_VALUE;  /* (its graph memory mapped) */
}
CUresult cuGraphExecDestroy(struct graph *exec)
{
    if (!exec || exec->magic != EXEC_MAGIC) return STUB_INVALID_VALUE;
    graph_free(exec);
    return STUB_OK;
}

/* An executable graph's kernels, recorded into a capturing stream or run on the card. */
CUresult stub_graph_launch(const void *exec_, const void *s)
{
    const struct graph *exec = exec_;
    if (!exec || exec->magic != EXEC_MAGIC) return STUB_INVALID_VALUE;
    CUresult r;
    if (stub_capture_launch(s, exec->us, exec->n, &r))
        return r;
    if ((r = graph_map((struct graph *)exec)))  /* (its graph memory, at its first launch) */
        return r;
    for (size_t i = 0; i < exec->n; i++)
        if ((r = stub_run_kernel(exec->us[i], s)))
            return r;
    return STUB_OK;
}

/* cuStreamGetCaptureInfo in the form the caller was built for: CUDA 12.3's (edges), 11.3's (graph
 * and dependencies), 10.1's */
void *stub_capture_info(int version)
{
    return version >= 12030 ? (void *)cuStreamGetCaptureInfo_v3
         : version >= 11030 ? (void *)cuStreamGetCaptureInfo_v2 : (void *)cuStreamGetCaptureInfo;
}

/* The names of this file cuGetProcAddress gives, by the version asked for (cuda.h's _vN). */
void *stub_graphs_proc(const char *symbol, int version)
{
    static const struct { const char *name; void *fn; } plain[] = {
#define P(f) {#f, (void *)f}
        P(cuStreamIsCapturing), P(cuThreadExchangeStreamCaptureMode), P(cuStreamEndCapture), P(cuGraphCreate),
        P(cuGraphDestroy), P(cuGraphGetNodes), P(cuGraphInstantiateWithFlags), P(cuGraphInstantiateWithParams),
        P(cuGraphUpload), P(cuGraphExecDestroy), P(cuStreamCreate), {"cuStreamDestroy", (void *)cuStreamDestroy_v2},
#undef P
    };
    if (!strcmp(symbol, "cuStreamBeginCapture"))
        return version >= 10010 ? (void *)cuStreamBeginCapture_v2 : (void *)cuStreamBeginCapture;
    if (!strcmp(symbol, "cuStreamGetCaptureInfo"))
        return stub_capture_info(version);
    if (!strcmp(symbol, "cuGraphInstantiate"))
        return version >= 12000 ? (void *)cuGraphInstantiateWithFlags : (void *)cuGraphInstantiate_v2;
    for (size_t i = 0; i < sizeof plain / sizeof *plain; i++)
        if (!strcmp(symbol, plain[i].name))
            return plain[i].fn;
    return graphnodes_proc(symbol, version);  /* (cuda_graphnodes.c's) */
}
