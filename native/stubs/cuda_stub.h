/*
 * What the stand-in libcuda.so.1's files share (native/stubs/, in the layers below). Nothing here
 * is exported: hidden, one library's own (stub_called excepted, exported as it always was).
 */
#ifndef CGPU_CUDA_STUB_H
#define CGPU_CUDA_STUB_H
#include <stddef.h>
#include <stdint.h>

#define HIDDEN __attribute__((visibility("hidden")))
typedef int CUresult;
typedef unsigned long long CUdeviceptr;

/* cuda.h's CUresult values the stand-in answers */
enum {
    STUB_OK = 0, STUB_INVALID_VALUE = 1, STUB_OUT_OF_MEMORY = 2, STUB_NOT_INITIALIZED = 3,
    STUB_DEINITIALIZED = 4, STUB_INVALID_DEVICE = 101, STUB_INVALID_IMAGE = 200, STUB_INVALID_CONTEXT = 201,
    STUB_NO_BINARY_FOR_GPU = 209, STUB_INVALID_PTX = 218, STUB_INVALID_SOURCE = 300, STUB_INVALID_HANDLE = 400,
    STUB_NOT_FOUND = 500, STUB_NOT_READY = 600, STUB_ILLEGAL_ADDRESS = 700, STUB_LAUNCH_OUT_OF_RESOURCES = 701,
    STUB_INVALID_ADDRESS_SPACE = 717, STUB_NOT_PERMITTED = 800, STUB_NOT_SUPPORTED = 801, STUB_UNKNOWN = 999,
};

/*
 * The layers, each file calling only the files below it (tests/test_stub_layers.py checks it):
 *
 *   cuda_export.c    cuGetProcAddress and cuGetExportTable: the names, from every file below
 *   cuda_device.c    device attributes, the primary context, events, stream queries, copies
 *   libcuda.c        cuInit, devices, launches               cuda_memory.c  allocations (this process's table), VMM, arrays
 *   cuda_contexts.c  contexts: each card's primary one, green contexts
 *   cuda_pools.c     stream-ordered pools: what they reserve, keep, release
 *   cuda_graphs.c    streams, stream capture and graphs      cuda_modules.c  modules, functions
 *   cuda_graphnodes.c  a graph's nodes, the device's graph memory pool (cuda_graph.h)
 *   -------------------------------------------------- the card model ----------------------
 *   cuda_queues.c    the card's executor, this process's side: its queues, events, a launch
 *   cuda_exec.c      the card's executor: the shared file, time-slicing, switches (cuda_exec.h)
 *   card.c           the cards, their memory (the state file), this process's driver state
 *   cuda_log.c       the stand-in's logs      cuda_mps.c  the MPS client: its server, pinned limits, threads
 */

/* ---- cuda_log.c ---- */
HIDDEN void stub_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));  /* CGPU_STUB_CUDA_TRACE */
void stub_called(const char *name);  /* (CGPU_STUB_CUDA_CALLS: the entry point's name logged) */
HIDDEN void stub_ctx_asked(void);    /* (CGPU_STUB_CUDA_CTX_CALLS: a cuCtxGetCurrent logged) */

/* ---- cuda_mps.c: the process as an MPS client (issue 37, docs/mps.md) ---- */
enum { STUB_DEVICE_UNAVAILABLE = 46, STUB_MPS_CONNECTION_FAILED = 805 };
HIDDEN CUresult stub_mps_connect(void);     /* cuInit: a control daemon in the pipe directory makes it a client */
HIDDEN int stub_mps_client(void);           /* this process is an MPS client */
HIDDEN unsigned stub_mps_percentage(void);  /* its active thread percentage, 1..100 (100: no client) */
HIDDEN uint64_t stub_mps_mem_limit(int dev);/* its pinned device memory limit on card dev (UINT64_MAX: none) */
HIDDEN CUresult stub_mps_context(int dev);  /* may it make a context on card dev (not while a server holds it) */

/* ---- card.c: the cards and their memory ---- */
HIDDEN int stub_inited(void);                  /* cuInit has been called */
HIDDEN void stub_paused(const char *var);      /* <var>=<path>: <path>.in made, waits for <path>.go (a test's pause) */
HIDDEN void stub_alloc_pause(void);            /* stub_paused("CGPU_STUB_ALLOC_PAUSE"): an allocation in flight */
HIDDEN void stub_set_inited(void);
HIDDEN int stub_current_device(void);          /* the calling thread's current context's device */
HIDDEN void stub_set_current_device(int dev);
HIDDEN int stub_device_count(void);
HIDDEN uint64_t stub_card_bytes(void);         /* each card's memory */
/* add `delta` to the bytes in use on card `dev` if it has room: 0, or -1 (and nothing changed);
 * *used_out (unless NULL): the bytes in use after (delta 0: a dead process's memory given back first) */
HIDDEN int stub_card_memory(int dev, int64_t delta, uint64_t *used_out);
/* Memory shared between processes (cuMem IPC), its bytes on card `dev` already taken by the exporting
 * process: it stays on the card until every process holding it let go (or died). export: its id (0:
 * no room); hold: one more hold by this process (-1: no such memory on the card any more; *dev,
 * *bytes: where it is, how much); drop: one hold of this process's let go. */
HIDDEN uint64_t stub_shared_export(int dev, uint64_t bytes);
HIDDEN int stub_shared_hold(uint64_t id, int *dev, uint64_t *bytes);
HIDDEN void stub_shared_drop(uint64_t id);
/* CGPU_STUB_CUDA_FAST=1: allocations do not touch the card's file (to time what an interposer adds) */
HIDDEN int stub_memory_is_free(void);
/* the driver's own memory for this process on card `dev` (modules' code, a graph's
 * resources): taken from the card's free memory and shown in NVML's per-process view, as a real
 * driver's is; 0, or -1 when the card has no room. `delta` < 0 gives it back. */
HIDDEN int stub_driver_memory(int dev, int64_t delta);
/* its growth per event, CGPU_STUB_<name>_KIB or `kib` (the H100's figures, issue 28) */
HIDDEN uint64_t stub_growth(const char *name, uint64_t kib);
/* contexts' lifetimes (issue 34): a context destroyed (cuCtxDestroy, the primary one's reset or
 * last release) takes its streams and events with it, as the driver's does: a handle of one used
 * afterwards is answered CUDA_ERROR_INVALID_HANDLE or CUDA_ERROR_CONTEXT_IS_DESTROYED, and with
 * CGPU_STUB_STRICT_HANDLES=1 the process aborts, saying which call used which handle (the real
 * driver's behaviour there is undefined: a crash, or another object's state). */
HIDDEN unsigned stub_ctx_gen(int dev);              /* the generation of card dev's context now */
HIDDEN int stub_ctx_alive(int dev, unsigned gen);   /* a handle made in that generation is still valid */
HIDDEN int stub_ctx_dead(int dev);                  /* card dev's context is destroyed (none made since) */
HIDDEN void stub_ctx_retain(int dev);               /* retained (made anew if destroyed) */
HIDDEN int stub_ctx_release(int dev);               /* released: 1 when that was its last retain */
HIDDEN void stub_ctx_kill(int dev);                 /* destroyed (its work waited for by the caller) */
HIDDEN void stub_misuse(const char *call, const char *what);  /* a destroyed handle used */
enum { STUB_CONTEXT_IS_DESTROYED = 709 };

/* ---- cuda_queues.c over cuda_exec.c: the card's executor (queues per stream, one kernel at a time, time-sliced contexts) ---- */
/* a kernel of `us` µs into `stream` (NULL: the legacy stream; 2: the thread's) on card `dev`; blocks
 * only while the stream's queue is full; coll: half of a collective across cards 0 and 1 */
HIDDEN CUresult stub_exec_launch(int dev, const void *stream, uint64_t us, int coll);
/* a point in `stream` that waits on the host until released (*seq: which) */
HIDDEN CUresult stub_exec_hold(int dev, const void *stream, uint64_t *seq);
HIDDEN void stub_exec_release(int dev, uint64_t seq);
HIDDEN int stub_exec_reached(int dev, uint64_t seq);  /* all before entry seq done */
HIDDEN CUresult stub_exec_sync(int dev, const void *stream, int all);  /* wait: the stream's work, or all (the context's) */
HIDDEN int stub_exec_idle(int dev, const void *stream, int all);       /* its work done: 1, else 0 */
/* a point in a stream (an event): done when the card has run what was launched into it before; behind
 * queued work its record is an entry of the stream, costing the card and the host time; its time is the
 * card's timestamp (inexact: cuda_exec.c) */
struct stub_mark { int dev, recorded, done; uint64_t ticket, at; };  /* at: when the card reached it (ns) */
HIDDEN CUresult stub_exec_mark(struct stub_mark *m, int dev, const void *stream);
HIDDEN int stub_exec_mark_done(struct stub_mark *m);
HIDDEN void stub_exec_mark_wait(struct stub_mark *m);
HIDDEN void stub_exec_mark_drop(struct stub_mark *m);
HIDDEN void stub_exec_overwritten(int dev, uint64_t seq);
HIDDEN CUresult stub_run_kernel(uint64_t us, const void *stream);   /* one kernel launched into `stream` */
/* one kernel; pdl: launched programmatic-dependent (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION):
 * it overlaps the tail of the kernel straight before it in its stream, nothing between them */
HIDDEN CUresult stub_run_kernel_as(uint64_t us, const void *stream, int pdl);

/* ---- cuda_modules.c ---- */
HIDDEN int stub_function_valid(const void *f);
HIDDEN CUresult stub_module_function(void **f, void *module, const char *name);  /* cuModuleGetFunction's */
HIDDEN int stub_find_global(CUdeviceptr p, size_t n);  /* [p, p + n) inside a module's global: 0, else -1 */
/* a launch of function (or kernel) `f`: its code loaded onto the card at its first (lazy loading) */
HIDDEN CUresult stub_function_loaded(const void *f);

/* ---- cuda_graphs.c: streams, stream capture and graphs ---- */
/* the device a stream was made on (the legacy and per-thread streams: the current one) */
HIDDEN int stub_stream_device(const void *s);
/* may the calling thread make a potentially unsafe call (synchronizing `synced`, NULL: none) now? */
HIDDEN CUresult stub_capture_forbids(const void *synced);
/* may the calling thread synchronize the context on card `dev` (none of its streams capturing)? */
HIDDEN CUresult stub_capture_forbids_context(int dev);
/* a launch of n kernels into stream s: 1 (and *r) when s captures it, 0 when it is to run */
HIDDEN int stub_capture_launch(const void *s, const uint64_t *us, size_t n, CUresult *r);
HIDDEN CUresult stub_graph_launch(const void *exec, const void *s);
/* cuMemAllocAsync / cuMemFreeAsync into stream s: 1 (and *r) when s captures it (a graph's memory
 * node; a free of a graph allocation too), 0 when it is the pools' */
HIDDEN int stub_capture_alloc(const void *s, size_t size, CUdeviceptr *p, CUresult *r);
HIDDEN int stub_capture_free(const void *s, CUdeviceptr p, CUresult *r);
HIDDEN void *stub_graphs_proc(const char *symbol, int version);
HIDDEN void *stub_capture_info(int version);     /* cuStreamGetCaptureInfo in the form of the caller's CUDA version */
/* a stream object destroyed, or of a destroyed context (said to stub_misuse by `call`) */
HIDDEN int stub_stream_dead(const void *s, const char *call);

/* ---- cuda_pools.c: stream-ordered pools (what they reserve stays on the card up to their release threshold) ---- */
HIDDEN CUresult stub_pool_alloc_async(CUdeviceptr *out, size_t size, const void *stream, void *pool);  /* NULL pool: the stream's device's current */
HIDDEN int stub_pool_free(CUdeviceptr p, CUresult *r);  /* a pool's allocation back to its pool: 1, else 0 */
HIDDEN void stub_pools_settle(int dev);  /* a synchronization: unused memory above each threshold released */
HIDDEN int stub_pool_find(CUdeviceptr p, size_t n, CUdeviceptr *base, size_t *size);
HIDDEN CUresult stub_default_mem_pool(void **pool, int dev);  /* cuDeviceGetDefaultMemPool, never an interposer's */

/* ---- cuda_contexts.c ---- */
/* cuGetProcAddress's answer for a name of cuda_contexts.c's: NULL, *named 1 when no form of it fits the version */
HIDDEN void *stub_contexts_proc(const char *symbol, int version, int *named);

/* ---- cuda_memory.c ---- */
/* the live device allocation holding [p, p + n): 0 and its base and size, or -1 */
HIDDEN int stub_find_alloc(CUdeviceptr p, size_t n, CUdeviceptr *base, size_t *size);

/* ---- cuGetProcAddress's forms of libcuda.c's and cuda_memory.c's names (cuda_export.c picks):
 * each form from the CUDA version that introduced it (cudaTypedefs.h's PFN_<name>_v<version>),
 * ptsz: its per-thread-default-stream form; a table ends with a NULL name ---- */
struct stub_versioned { const char *name; int since, ptsz; void *fn; };
extern HIDDEN const struct stub_versioned STUB_VERSIONED_LIBCUDA[], STUB_VERSIONED_MEMORY[];
#endif
