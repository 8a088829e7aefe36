/*
 * libcgpu, compute: kernel launches wait at the gate (docs/isolation.md, "Compute"), then within
 * their stream's bound of queued work (docs/scheduler.md, "Queued work"). The top of the compute
 * part (cgpu_compute.h): the launch entry points.
 */
#include "cgpu_compute.h"
#include "cgpu_memory.h"
#include "cgpu_work.h"

/* Inside a launch on page GPU k (-1: the container's gate), as the drain sees it: in the calling
 * thread's own record (threads.c: no word another thread writes), else (no record: no host memory
 * for one) in the shared count. `on`: entering (before the gate is read: a full fence between, or
 * the helper's membarrier for it, threads.c) or leaving. */
static inline void in_launch(struct cgpu_thread *t, int k, int on)
{
    if (__builtin_expect(t != NULL, 1)) {
        if (!on)
            __atomic_store_n(&t->gate, 0, __ATOMIC_RELEASE);
        else if (__builtin_expect(__atomic_load_n(&cgpu_asym, __ATOMIC_RELAXED), 1)) {
            __atomic_store_n(&t->gate, (uint32_t)(2 + k), __ATOMIC_RELAXED);
            __atomic_signal_fence(__ATOMIC_SEQ_CST);  /* (the compiler's order; the CPU's: the helper's membarrier) */
        } else
            __atomic_store_n(&t->gate, (uint32_t)(2 + k), __ATOMIC_SEQ_CST);
    } else if (on)
        __atomic_add_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
    else
        __atomic_sub_fetch(&launching[1 + k], 1, __ATOMIC_SEQ_CST);
}

/* Pass the gate of page GPU `k` (-1: the container's): on return this thread is inside a launch on
 * k (in_launch) and the gate was open. The thread says it launches on GPU k before it looks at the
 * gate, so a closing either sees it (and waits for it) or stops it. The common case (the gate open,
 * no gang) inline in the launch; a gang, or a closed gate, here. */
static __attribute__((noinline)) struct cgpu_thread *gate_pass(struct cgpu_thread *t, int k)
{
    for (;;) {
        in_launch(t, k, 1);
        uint32_t g = gate_value(k);
        if (k < 0 || !ganged()) {
            if (g & 1)
                return t;
        } else {  /* a gang: GPU k's gate and the container's (closed while any GPU's is) */
            uint32_t all = gate_value(-1);
            if (gang_pass(k))
                return t;
            if (g & 1) {  /* GPU k open, another closed: wait for the container's gate */
                in_launch(t, k, 0);
                __atomic_add_fetch(&gate_waiting[0], 1, __ATOMIC_SEQ_CST);
                futex_wait_on(&limits->gate, all);
                __atomic_sub_fetch(&gate_waiting[0], 1, __ATOMIC_SEQ_CST);
                continue;
            }
        }
        in_launch(t, k, 0);
        __atomic_add_fetch(&gate_waiting[1 + k], 1, __ATOMIC_SEQ_CST);
        futex_wait_on(gate_word(k), g);
        __atomic_sub_fetch(&gate_waiting[1 + k], 1, __ATOMIC_SEQ_CST);
    }
}

static inline struct cgpu_thread *gate_enter(int k)
{
    struct cgpu_thread *t = cgpu_self();
    drain_start_helper();
    if (k >= 0 && !(__atomic_load_n(&mine->gpus, __ATOMIC_RELAXED) & (1u << k)))
        __atomic_fetch_or(&mine->gpus, 1u << k, __ATOMIC_SEQ_CST);
    in_launch(t, k, 1);
    if (__builtin_expect((k < 0 || !ganged()) && (gate_value(k) & 1), 1))
        return t;
    return gate_pass(t, k);
}


/* Whether a launch on page GPU k may wait for its queue: not while its gate (or a gang's) is closed
 * or a closing is being answered. Then it waits at the gate anyway, or must pass: a gang's
 * collective half let through to its peer (catch_up) would otherwise wait behind a half that spins
 * for it. */
static int may_wait(int k)
{
    if (gang_catching_up() || !(gate_value(k) & 1))
        return 0;
    return !ganged() || (gate_value(-1) & 1);
}

/* Whether launches on page GPU k are bounded now: it is shared, or (a gang: its launches anywhere run
 * only while all its gates are open) any GPU the process launches on is. One load when none is.
 * (The container's gate, k -1: never.) */
static inline int shared_gpu(int k)
{
    uint32_t sh = k >= 0 && per_gpu ? __atomic_load_n(&limits->shared, __ATOMIC_RELAXED) : 0;
    if (__builtin_expect(!sh, 1))
        return 0;
    return (sh >> k & 1) || (ganged() && (sh & __atomic_load_n(&mine->gpus, __ATOMIC_RELAXED) & ~CGPU_PROC_DRAINING));
}

/* A launch's kind (queue.c, "each item's time"): what it runs and on how much (never 0) */
static inline uint64_t kind_key(const void *what, uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t h = (uint64_t)(uintptr_t)what * 0x9e3779b97f4a7c15ull;
    h = (h ^ a) * 0xc2b2ae3d27d4eb4full;
    h = (h ^ b) * 0x165667b19e3779f9ull;
    h = (h ^ c) * 0x9e3779b97f4a7c15ull;
    return (h ^ h >> 29) | 1;
}
#define KERNEL_KIND(f, gx, gy, gz, bx, by, bz) \
    kind_key((f), (uint64_t)(gx) << 32 | (gy), (uint64_t)(gz) << 32 | (bx), (uint64_t)(by) << 32 | (bz))

/* A launch into `stream_` (`ptsz_`: a per-thread-default-stream form) through the gate of its
 * GPU; while the GPU is shared, within the queue's budget (w_: it counts as w_ launches; item_: its kind). */
#define GATED_P(stream_, ptsz_, w_, pdl_, item_, fn, ...)       \
    do {                                                        \
        PASS_THROUGH(fn, __VA_ARGS__);                          \
        if (!(fn))                                              \
            return CU_NOT_INITIALIZED;                          \
        if (!need_slot())                                       \
            return CU_LAUNCH_OUT_OF_RESOURCES;                  \
        int k_ = note_context();                                \
        int b_ = shared_gpu(k_) && queue_ready();               \
        if (b_ && may_wait(k_)) {                               \
            in_driver++;  /* (before the gate: a closing does not wait for a thread waiting here) */ \
            queue_wait(known_ctx, (stream_), (ptsz_), (w_), (item_)); \
            in_driver--;                                        \
        }                                                       \
        struct cgpu_thread *t_ = gate_enter(k_);                \
        in_driver++;                                            \
        if (b_)                                                 \
            queue_start(known_ctx, (stream_), (ptsz_), (pdl_));  \
        CUresult r_ = (fn)(__VA_ARGS__);                        \
        if (r_ == CU_OK && !(b_ && queue_note(known_ctx, (stream_), (ptsz_), (w_), (pdl_), (item_)))) \
            queue_untracked(k_); \
        in_driver--;                                            \
        in_launch(t_, k_, 0);                                   \
        return r_;                                              \
    } while (0)

#define GATED(stream_, ptsz_, item_, fn, ...) GATED_P(stream_, ptsz_, 1, 0, item_, fn, __VA_ARGS__)

/* cuLaunchKernelEx's config (cuda.h's CUlaunchConfig): the stream after the dimensions and the shared
 * memory, then the attributes (an id padded to 8 bytes, a 64-byte value) */
struct launch_attr { unsigned id; char pad[4]; union { char bytes[64]; int i; } value; };
struct launch_config { unsigned grid[3], block[3], shmem; void *stream; const struct launch_attr *attrs; unsigned nattrs; };
#define CONFIG_STREAM(c) ((c) ? ((const struct launch_config *)(c))->stream : NULL)
/* Hopper's programmatic dependent launch: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) set */
static int programmatic(const void *config)
{
    const struct launch_config *c = config;
    int pdl = 0;
    for (unsigned i = 0; c && c->attrs && i < c->nattrs && i < 64; i++)
        if (c->attrs[i].id == 6)
            pdl = c->attrs[i].value.i != 0;
    return pdl;
}
static uint64_t config_kind(const void *config, const void *f)
{
    const struct launch_config *c = config;
    return c ? KERNEL_KIND(f, c->grid[0], c->grid[1], c->grid[2], c->block[0], c->block[1], c->block[2]) : 0;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED(stream, 0, KERNEL_KIND(f, gx, gy, gz, bx, by, bz), real.launch, f, gx, gy, gz, bx, by, bz, shmem, stream,
          params, extra);
}

CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shmem, void *stream, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED(stream, 1, KERNEL_KIND(f, gx, gy, gz, bx, by, bz), real.launch_ptsz, f, gx, gy, gz, bx, by, bz, shmem,
          stream, params, extra);
}

CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shmem, void *stream, void **params)
{
    LAZY_ROOM(f);
    GATED(stream, 0, KERNEL_KIND(f, gx, gy, gz, bx, by, bz), real.launch_coop, f, gx, gy, gz, bx, by, bz, shmem,
          stream, params);
}

CUresult cuLaunchCooperativeKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                        unsigned bz, unsigned shmem, void *stream, void **params)
{
    LAZY_ROOM(f);
    GATED(stream, 1, KERNEL_KIND(f, gx, gy, gz, bx, by, bz), real.launch_coop_ptsz, f, gx, gy, gz, bx, by, bz,
          shmem, stream, params);
}

CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED_P(CONFIG_STREAM(config), 0, 1, programmatic(config), config_kind(config, f), real.launch_ex, config, f,
            params, extra);
}

CUresult cuLaunchKernelEx_ptsz(const void *config, void *f, void **params, void **extra)
{
    LAZY_ROOM(f);
    GATED_P(CONFIG_STREAM(config), 1, 1, programmatic(config), config_kind(config, f), real.launch_ex_ptsz, config,
            f, params, extra);
}

CUresult cuGraphLaunch(void *exec, void *stream)
{
    GATED_P(stream, 0, queue_graph_weight(exec), 0, kind_key(exec, 0, 0, 0), real.graph_launch, exec, stream);
}

CUresult cuGraphLaunch_ptsz(void *exec, void *stream)
{
    GATED_P(stream, 1, queue_graph_weight(exec), 0, kind_key(exec, 0, 0, 0), real.graph_launch_ptsz, exec, stream);
}

/* ---- copies and memsets into a stream: under the same rules as kernels (issue 34) ----
 * A memset is a kernel on the card, and a copy between the card's memory one too (or a copy
 * engine's work, time-sliced with the channel's): both run on after a gate closes if let through it,
 * and queue as kernels do. So the asynchronous forms pass the gate and the queue's bound as a launch
 * (counted as one launch of the stream's mean). Host-to-device and device-to-host copies are gated
 * too: they hold the channel while the next instance's slice runs. */
typedef CUresult (*memset8_fn)(CUdeviceptr, unsigned char, size_t, void *);
typedef CUresult (*memset16_fn)(CUdeviceptr, unsigned short, size_t, void *);
typedef CUresult (*memset32_fn)(CUdeviceptr, unsigned, size_t, void *);
typedef CUresult (*copy_fn)(CUdeviceptr, CUdeviceptr, size_t, void *);
typedef CUresult (*copy_htod_fn)(CUdeviceptr, const void *, size_t, void *);
typedef CUresult (*copy_dtoh_fn)(void *, CUdeviceptr, size_t, void *);
static void *copy_sym(void **slot, const char *name)
{
    void *f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!f && (f = sym(name)))
        __atomic_store_n(slot, f, __ATOMIC_RELEASE);
    return f;
}
#define COPY_OP(type, name, ptsz, stream, ...)                              \
    static void *real_##name;                                               \
    CUresult name(COPY_PARAMS_##type)                                       \
    {                                                                       \
        type fn = (type)copy_sym(&real_##name, #name);                      \
        GATED(stream, ptsz, kind_key(&real_##name, n, 0, 0), fn, __VA_ARGS__); \
    }
#define COPY_PARAMS_memset8_fn CUdeviceptr d, unsigned char v, size_t n, void *s
#define COPY_PARAMS_memset16_fn CUdeviceptr d, unsigned short v, size_t n, void *s
#define COPY_PARAMS_memset32_fn CUdeviceptr d, unsigned v, size_t n, void *s
#define COPY_PARAMS_copy_fn CUdeviceptr d, CUdeviceptr src, size_t n, void *s
#define COPY_PARAMS_copy_htod_fn CUdeviceptr d, const void *h, size_t n, void *s
#define COPY_PARAMS_copy_dtoh_fn void *h, CUdeviceptr src, size_t n, void *s
COPY_OP(memset8_fn, cuMemsetD8Async, 0, s, d, v, n, s)
COPY_OP(memset8_fn, cuMemsetD8Async_ptsz, 1, s, d, v, n, s)
COPY_OP(memset16_fn, cuMemsetD16Async, 0, s, d, v, n, s)
COPY_OP(memset16_fn, cuMemsetD16Async_ptsz, 1, s, d, v, n, s)
COPY_OP(memset32_fn, cuMemsetD32Async, 0, s, d, v, n, s)
COPY_OP(memset32_fn, cuMemsetD32Async_ptsz, 1, s, d, v, n, s)
COPY_OP(copy_fn, cuMemcpyAsync, 0, s, d, src, n, s)
COPY_OP(copy_fn, cuMemcpyAsync_ptsz, 1, s, d, src, n, s)
COPY_OP(copy_fn, cuMemcpyDtoDAsync_v2, 0, s, d, src, n, s)
COPY_OP(copy_fn, cuMemcpyDtoDAsync_v2_ptsz, 1, s, d, src, n, s)
COPY_OP(copy_htod_fn, cuMemcpyHtoDAsync_v2, 0, s, d, h, n, s)
COPY_OP(copy_htod_fn, cuMemcpyHtoDAsync_v2_ptsz, 1, s, d, h, n, s)
COPY_OP(copy_dtoh_fn, cuMemcpyDtoHAsync_v2, 0, s, h, src, n, s)
COPY_OP(copy_dtoh_fn, cuMemcpyDtoHAsync_v2_ptsz, 1, s, h, src, n, s)

/* ---- every other path that puts work on the card (issue 45, item 9; cgpu_work.h's list) ----
 * The legacy launches (cuLaunch, cuLaunchGrid, cuLaunchGridAsync), the 2-D, 3-D, peer and batched
 * copies, the 2-D memsets, prefetches of managed memory, a stream's memory operations (writes and
 * batches): each work on the card, under the same rules as a kernel (the gate, and the queue's bound
 * for those into a stream). The synchronous copies and memsets return once their work is done: they
 * pass the gate, and count as a launch in flight while they run (a closing's drain waits for them,
 * within its deadline). */
#define GATED_SYNC(item_, fn, ...)                                   \
    do {                                                             \
        PASS_THROUGH(fn, __VA_ARGS__);                               \
        if (!need_slot())                                            \
            return CU_LAUNCH_OUT_OF_RESOURCES;                       \
        int k_ = note_context();                                     \
        struct cgpu_thread *t_ = gate_enter(k_);                     \
        in_driver++;                                                 \
        CUresult r_ = (fn)(__VA_ARGS__);                             \
        in_driver--;                                                 \
        in_launch(t_, k_, 0);                                        \
        return r_;                                                   \
    } while (0)
#define WORK_ARGS(...) __VA_ARGS__
#define WORK_DEFINE_ASYNC(e, n, v, p, params, args, stream, bytes)                               \
    static void *real_##e;                                                                       \
    CUresult e params                                                                            \
    {                                                                                            \
        typedef CUresult(*fn_t) params;                                                          \
        fn_t fn_ = (fn_t)copy_sym(&real_##e, #e);                                                \
        GATED(stream, p, kind_key(&real_##e, (uint64_t)(bytes), 0, 0), fn_, WORK_ARGS args);     \
    }
#define WORK_DEFINE_SYNC(e, n, v, p, params, args, bytes)                                        \
    static void *real_##e;                                                                       \
    CUresult e params                                                                            \
    {                                                                                            \
        typedef CUresult(*fn_t) params;                                                          \
        fn_t fn_ = (fn_t)copy_sym(&real_##e, #e);                                                \
        GATED_SYNC(kind_key(&real_##e, (uint64_t)(bytes), 0, 0), fn_, WORK_ARGS args);           \
    }
WORK_ASYNC(WORK_DEFINE_ASYNC)
WORK_SYNC(WORK_DEFINE_SYNC)

typedef CUresult (*launch_legacy_fn)(void *);
typedef CUresult (*launch_grid_fn)(void *, int, int);
static void *real_cuLaunch, *real_cuLaunchGrid;
CUresult cuLaunch(void *f)  /* (a 1 x 1 grid; its block shape set by cuFuncSetBlockShape) */
{
    launch_legacy_fn fn = (launch_legacy_fn)copy_sym(&real_cuLaunch, "cuLaunch");
    LAZY_ROOM(f);
    GATED(NULL, 0, KERNEL_KIND(f, 1, 1, 1, 0, 0, 0), fn, f);
}
CUresult cuLaunchGrid(void *f, int w, int h)
{
    launch_grid_fn fn = (launch_grid_fn)copy_sym(&real_cuLaunchGrid, "cuLaunchGrid");
    LAZY_ROOM(f);
    GATED(NULL, 0, KERNEL_KIND(f, w, h, 1, 0, 0, 0), fn, f, w, h);
}

/* ---- graphs: their nodes counted and their graph memory held at instantiation (graphmem.c; queue.c,
 * "a graph's weight") ---- */
typedef CUresult (*instantiate5_fn)(void **, void *, void **, char *, size_t);
typedef CUresult (*instantiate_flags_fn)(void **, void *, unsigned long long);
typedef CUresult (*instantiate_params_fn)(void **, void *, void *);
typedef CUresult (*exec_destroy_fn)(void *);
static void *graph_sym(void **slot, const char *name)
{
    void *f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!f && (f = sym(name)))
        __atomic_store_n(slot, f, __ATOMIC_RELEASE);
    return f;
}
#define GRAPH_REAL(type, name) ((type)graph_sym(&real_##name, #name))
static void *real_cuGraphInstantiate, *real_cuGraphInstantiate_v2, *real_cuGraphInstantiateWithFlags,
    *real_cuGraphInstantiateWithParams, *real_cuGraphInstantiateWithParams_ptsz, *real_cuGraphExecDestroy;

static CUresult made(CUresult r, void **exec, struct graph_plan *plan)
{
    graph_made(r, exec ? *exec : NULL, plan);
    if (r == CU_OK && exec)
        queue_graph_made(*exec, plan->nodes);
    return r;
}
/* (its graph memory past memsize: CUDA_ERROR_OUT_OF_MEMORY, the driver not asked) */
#define INSTANTIATE(type, name, ...)                              \
    do {                                                          \
        type fn_ = GRAPH_REAL(type, name);                        \
        PASS_THROUGH(fn_, __VA_ARGS__);                           \
        struct graph_plan plan_;                                  \
        if (graph_foresee(graph, &plan_) != CU_OK)                \
            return CU_OUT_OF_MEMORY;                              \
        in_driver++;                                              \
        CUresult r_ = fn_(__VA_ARGS__);                           \
        in_driver--;                                              \
        return made(r_, exec, &plan_);                            \
    } while (0)

CUresult cuGraphInstantiate(void **exec, void *graph, void **err, char *log, size_t size)
{
    INSTANTIATE(instantiate5_fn, cuGraphInstantiate, exec, graph, err, log, size);
}
CUresult cuGraphInstantiate_v2(void **exec, void *graph, void **err, char *log, size_t size)
{
    INSTANTIATE(instantiate5_fn, cuGraphInstantiate_v2, exec, graph, err, log, size);
}
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags)
{
    INSTANTIATE(instantiate_flags_fn, cuGraphInstantiateWithFlags, exec, graph, flags);
}
CUresult cuGraphInstantiateWithParams(void **exec, void *graph, void *params)
{
    INSTANTIATE(instantiate_params_fn, cuGraphInstantiateWithParams, exec, graph, params);
}
CUresult cuGraphInstantiateWithParams_ptsz(void **exec, void *graph, void *params)
{
    INSTANTIATE(instantiate_params_fn, cuGraphInstantiateWithParams_ptsz, exec, graph, params);
}
CUresult cuGraphExecDestroy(void *exec)
{
    exec_destroy_fn fn = GRAPH_REAL(exec_destroy_fn, cuGraphExecDestroy);
    PASS_THROUGH(fn, exec);
    queue_graph_gone(exec);
    in_driver++;
    CUresult r = fn(exec);
    in_driver--;
    if (r == CU_OK)
        graph_gone(exec);  /* (its pool's pages kept by the driver: the charge follows its reservation) */
    return r;
}

/* A forked child has no helper thread, no launches in flight, and none of the parent's streams. */
void gate_forked(void)
{
    drain_forked();
    queue_forked();
    gang_forked();
    contexts_forked();
}
