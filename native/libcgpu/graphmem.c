/*
 * libcgpu, memory: CUDA graphs' own memory, charged before the driver takes it (issue 45, item 6),
 * and a graph's nodes counted through its child and conditional graphs (item 9). docs/memory.md,
 * "Graph memory".
 *
 * A graph's allocation nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync captured: PyTorch's
 * cudaMallocAsync backend under CUDA graphs) take nothing at capture; the driver maps their
 * physical memory from the device's graph memory pool at instantiation, upload or the first launch
 * (the CUDA Programming Guide, "Graph Memory Nodes": "CUDA may update physical memory mappings at
 * any time during graph instantiation, launch, or execution"), and the pool keeps it across
 * replays and past the graph's destruction until cuDeviceGraphMemTrim. None of it passes an
 * allocator libcgpu sees: the first replay took GiBs past memsize and the watchdog killed.
 *
 * So at instantiation the graph is walked (cuGraphGetNodes, cuGraphNodeGetType; a child graph
 * node's graph, cuGraphChildGraphNodeGetGraph; a conditional node's bodies, cuGraphNodeGetParams,
 * or where the driver has none, what its cuGraphAddNode returned): what its allocation nodes'
 * address ranges cover (cuGraphMemAllocNodeGetParams: dptr, bytesize, in the card's 2 MiB pages;
 * an address the driver reused within the graph, for allocations whose lifetimes do not overlap,
 * counted once) is what the executable graph may map, on the GPU each node's pool properties
 * name (else the instantiating context's). Per GPU, the pool is charged the larger of
 * what the driver says it reserves (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) and what the live executable
 * graphs may map together: growth beyond what is charged already is held (take()) BEFORE the
 * driver instantiates, and when it does not fit, after what pools and dead processes gave back,
 * the instantiation is refused with CUDA_ERROR_OUT_OF_MEMORY (the driver is not asked). Memory the
 * pool reuses — a graph instantiated after another was destroyed, its pages kept by the pool — is
 * not charged again. cuGraphExecDestroy and cuDeviceGraphMemTrim settle the charge down to that
 * larger figure again (the reserved attribute re-read: a trim gives back what no graph holds), and
 * up (force) when the driver reserved more than foreseen. Graphs launched one after another may
 * share pages on a real card ("multiple graphs may use the same physical memory ... if they will
 * not run simultaneously"): that is the driver's option, not a promise, so it is not credited (an
 * over-charge by what they share, never a kill). The node count replaces cuGraphGetNodes's in the
 * gate's weight (queue.c, "a graph's weight"): a child graph node counts its graph's nodes, a
 * conditional node itself and each body's nodes once (a WHILE body's iterations are decided on
 * the card: counted once, the least it can run when entered).
 */
#include <stdlib.h>
#include <string.h>

#include "cgpu_memory.h"

enum { NODE_GRAPH = 4, NODE_MEM_ALLOC = 10, NODE_CONDITIONAL = 13 };
enum { ATTR_RESERVED_CURRENT = 2 };
#define DEPTH 16  /* child and conditional graphs nested deeper are not walked (counted as one node) */

static struct {
    CUresult (*nodes)(void *, void **, size_t *);
    CUresult (*type)(void *, int *);
    CUresult (*child)(void *, void **);
    CUresult (*alloc_params)(void *, void *);
    CUresult (*params)(void *, void *);
    CUresult (*attr)(int, int, uint64_t *);
    CUresult (*trim)(int);
    CUresult (*upload)(void *, void *);
    CUresult (*upload_ptsz)(void *, void *);
    CUresult (*is_capturing)(void *, int *);
    CUresult (*is_capturing_ptsz)(void *, int *);
    CUresult (*add_node)(void **, void *, const void *, size_t, void *);                   /* CUDA 12.2 */
    CUresult (*add_node_v2)(void **, void *, const void *, const void *, size_t, void *);  /* 12.3 (edges) */
} gd;
static pthread_once_t gd_once = PTHREAD_ONCE_INIT;
static void gd_load(void)
{
    setup_once();
    gd.nodes = (CUresult (*)(void *, void **, size_t *))sym("cuGraphGetNodes");
    gd.type = (CUresult (*)(void *, int *))sym("cuGraphNodeGetType");
    gd.child = (CUresult (*)(void *, void **))sym("cuGraphChildGraphNodeGetGraph");
    gd.alloc_params = (CUresult (*)(void *, void *))sym("cuGraphMemAllocNodeGetParams");
    gd.params = (CUresult (*)(void *, void *))sym("cuGraphNodeGetParams");
    gd.attr = (CUresult (*)(int, int, uint64_t *))sym("cuDeviceGetGraphMemAttribute");
    gd.trim = (CUresult (*)(int))sym("cuDeviceGraphMemTrim");
    gd.upload = (CUresult (*)(void *, void *))sym("cuGraphUpload");
    gd.upload_ptsz = (CUresult (*)(void *, void *))sym("cuGraphUpload_ptsz");
    gd.is_capturing = (CUresult (*)(void *, int *))sym("cuStreamIsCapturing");
    gd.is_capturing_ptsz = (CUresult (*)(void *, int *))sym("cuStreamIsCapturing_ptsz");
    gd.add_node = (CUresult (*)(void **, void *, const void *, size_t, void *))sym("cuGraphAddNode");
    gd.add_node_v2 = (CUresult (*)(void **, void *, const void *, const void *, size_t, void *))sym("cuGraphAddNode_v2");
}

/* A stream-ordered allocation into a capturing stream is an allocation node of its graph: no memory
 * until the graph is instantiated, uploaded or launched ("CUDA assigns virtual addresses for the
 * graph allocation at node creation time"), charged then (graph_foresee), not at the capture. */
int graph_capturing(void *stream, int ptsz)
{
    pthread_once(&gd_once, gd_load);
    CUresult (*fn)(void *, int *) = ptsz ? gd.is_capturing_ptsz : gd.is_capturing;
    int status = 0;
    if (!fn)
        return 0;
    in_driver++;
    CUresult r = fn(stream, &status);
    in_driver--;
    return r == CU_OK && status != 0;  /* (CU_STREAM_CAPTURE_STATUS_ACTIVE, or _INVALIDATED: the driver's to answer) */
}

/* cuda.h's CUDA_MEM_ALLOC_NODE_PARAMS (CUmemPoolProps is 88 bytes) and CUgraphNodeParams's
 * conditional member (after its type and 12 reserved bytes) */
typedef struct {
    struct { int alloc_type, handle_types, loc_type, loc_id; unsigned char rest[72]; } props;  /* where it is */
    const void *access;
    size_t naccess, bytesize;
    CUdeviceptr dptr;
} alloc_params;
enum { LOC_DEVICE = 1 };
typedef struct {
    int type, reserved0[3];
    union {
        long long reserved1[29];
        struct { uint64_t handle; int type; unsigned size; void **bodies; void *ctx; } cond;
    } u;
    long long reserved2;
} node_params;

/* The allocation nodes' address ranges seen by a walk: a graph's memory is what they cover, an
 * address the driver reused within the graph counted once ("CUDA may reuse memory within a graph
 * by assigning the same virtual address ranges to different allocations whose lifetimes do not
 * overlap", the Guide's "Address Reuse within a Graph"). */
struct range { CUdeviceptr p, end; int g; };
struct ranges { struct range *r; size_t n, cap; int lost, cur; };

static int devs[CGPU_MAX_GPUS];  /* page GPU g's CUDA device, seen at its graphs (+1; 0: not yet) */
static void devs_seen(int g, int dev)
{
    __atomic_store_n(&devs[g], dev + 1, __ATOMIC_RELAXED);
}

/* (the page GPU of an allocation: the device its pool properties name, else the instantiating
 * context's; -1: not the container's page, not charged) */
static int gpu_of(const alloc_params *a, int cur)
{
    if (a->props.loc_type != LOC_DEVICE)
        return cur;
    int g = page_index(a->props.loc_id);
    if (g >= 0)
        devs_seen(g, a->props.loc_id);
    return g;
}

static void add_range(struct ranges *rs, CUdeviceptr p, uint64_t bytes, int g)
{
    if (rs->n == rs->cap) {
        size_t cap = rs->cap * 2 + 16;
        void *more = realloc(rs->r, cap * sizeof *rs->r);
        if (!more) {
            rs->lost = 1;  /* (no host memory: counted as the sum, never less) */
            return;
        }
        rs->r = more;
        rs->cap = cap;
    }
    rs->r[rs->n].p = p;
    rs->r[rs->n].g = g;
    rs->r[rs->n++].end = p + (bytes + MEM_PAGE - 1) / MEM_PAGE * MEM_PAGE;
}

static int by_gpu_start(const void *a, const void *b)
{
    const struct range *x = a, *y = b;
    return x->g != y->g ? (x->g < y->g ? -1 : 1) : x->p < y->p ? -1 : x->p > y->p;
}

/* what the ranges cover on each GPU, in bytes, into bytes[] */
static void covered(struct ranges *rs, uint64_t *bytes)
{
    CUdeviceptr upto = 0;
    memset(bytes, 0, CGPU_MAX_GPUS * sizeof *bytes);
    qsort(rs->r, rs->n, sizeof *rs->r, by_gpu_start);
    for (size_t i = 0; i < rs->n; i++) {
        if (i && rs->r[i].g != rs->r[i - 1].g)
            upto = 0;
        CUdeviceptr from = rs->r[i].p > upto ? rs->r[i].p : upto;
        if (rs->r[i].end > from)
            bytes[rs->r[i].g] += rs->r[i].end - from;
        if (rs->r[i].end > upto)
            upto = rs->r[i].end;
    }
}

/* ---- conditional nodes' bodies where cuGraphNodeGetParams is missing (a driver before it) ----
 * A conditional node is made only by cuGraphAddNode (CONDITIONAL), whose phGraph_out the driver
 * fills with its bodies ("CUDA-owned array ... Valid for the lifetime of the conditional node"):
 * kept here by node, in NCONDS slots by the node's hash (two in one slot: the older forgotten, its
 * node counted as one). */
#define NCONDS 1024
static struct { void *node; void **bodies; unsigned size; } conds[NCONDS];
static pthread_mutex_t cond_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned cond_slot(const void *node)
{
    return (unsigned)(((uintptr_t)node * 0x9E3779B97F4A7C15ull) >> 40) % NCONDS;
}

static CUresult added(CUresult r, void **node, node_params *p)
{
    if (r != CU_OK || !node || !p || p->type != NODE_CONDITIONAL || !p->u.cond.bodies)
        return r;
    pthread_mutex_lock(&cond_lock);
    unsigned i = cond_slot(*node);
    conds[i].node = *node;
    conds[i].bodies = p->u.cond.bodies;
    conds[i].size = p->u.cond.size;
    pthread_mutex_unlock(&cond_lock);
    return r;
}

/* (a node's bodies: from the driver, else from its cuGraphAddNode) */
static unsigned bodies_of(void *node, void ***bodies)
{
    node_params np;
    if (gd.params && gd.params(node, &np) == CU_OK && np.type == NODE_CONDITIONAL) {
        *bodies = np.u.cond.bodies;
        return *bodies ? np.u.cond.size : 0;
    }
    unsigned i = cond_slot(node), size = 0;
    pthread_mutex_lock(&cond_lock);
    if (conds[i].node == node) {
        *bodies = conds[i].bodies;
        size = conds[i].size;
    }
    pthread_mutex_unlock(&cond_lock);
    return size;
}

CUresult cuGraphAddNode(void **node, void *graph, const void *deps, size_t n, void *params)
{
    pthread_once(&gd_once, gd_load);
    PASS_THROUGH(gd.add_node, node, graph, deps, n, params);
    in_driver++;
    CUresult r = gd.add_node(node, graph, deps, n, params);
    in_driver--;
    return added(r, node, params);
}
CUresult cuGraphAddNode_v2(void **node, void *graph, const void *deps, const void *edges, size_t n, void *params)
{
    pthread_once(&gd_once, gd_load);
    PASS_THROUGH(gd.add_node_v2, node, graph, deps, edges, n, params);
    in_driver++;
    CUresult r = gd.add_node_v2(node, graph, deps, edges, n, params);
    in_driver--;
    return added(r, node, params);
}

/* (in_driver held) graph's nodes and allocations added to *p and *rs, its children's and bodies' too */
static void walk(void *graph, struct graph_plan *p, struct ranges *rs, int depth)
{
    size_t n = 0;
    if (gd.nodes(graph, NULL, &n) != CU_OK || !n)
        return;
    void **nodes = malloc(n * sizeof *nodes);
    if (!nodes || gd.nodes(graph, nodes, &n) != CU_OK) {
        p->nodes += (uint32_t)n;
        free(nodes);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        int type = -1;
        void *child = NULL, **bodies = NULL;
        alloc_params a;
        if (gd.type)
            gd.type(nodes[i], &type);
        if (type == NODE_GRAPH && depth < DEPTH && gd.child && gd.child(nodes[i], &child) == CU_OK && child) {
            uint32_t before = p->nodes;
            walk(child, p, rs, depth + 1);
            if (p->nodes == before)
                p->nodes++;  /* (an empty child: one node still) */
            continue;
        }
        p->nodes++;
        int g;
        if (type == NODE_MEM_ALLOC && gd.alloc_params && gd.alloc_params(nodes[i], &a) == CU_OK
            && (g = gpu_of(&a, rs->cur)) >= 0 && g < CGPU_MAX_GPUS) {
            p->bytes[g] += (a.bytesize + MEM_PAGE - 1) / MEM_PAGE * MEM_PAGE;  /* (the sum; the cover below) */
            if (a.dptr)
                add_range(rs, a.dptr, a.bytesize, g);
            else
                rs->lost = 1;  /* (no address told: the sum) */
        }
        for (unsigned b = 0, nb = type == NODE_CONDITIONAL && depth < DEPTH ? bodies_of(nodes[i], &bodies) : 0; b < nb; b++)
            if (bodies[b])
                walk(bodies[b], p, rs, depth + 1);
    }
    free(nodes);
}

/* ---- the charge: per GPU, the larger of the pool's reservation and what live graphs may map ---- */
#define NEXECS 1024
static struct { void *exec; int g; uint64_t bytes; } execs[NEXECS];  /* live executable graphs with graph memory */
static uint64_t live[CGPU_MAX_GPUS], charged[CGPU_MAX_GPUS];
static pthread_mutex_t gm_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t reserved_now(int g, int dev)
{
    uint64_t v = 0;
    in_driver++;
    if (!gd.attr || gd.attr(dev, ATTR_RESERVED_CURRENT, &v) != CU_OK)
        v = 0;
    in_driver--;
    return v;
}

/* (gm_lock held) the charge on GPU g made what it must be now: down (untake) or up (force) */
static void settle_gpu(int g, int dev)
{
    uint64_t r = reserved_now(g, dev), want = r > live[g] ? r : live[g];
    if (want < charged[g])
        untake(g, charged[g] - want);
    else if (want > charged[g])
        force(g, want - charged[g]);
    charged[g] = want;
}

/* (gm_lock held) the CUDA device of page GPU g: the current context's when it is g's, else the one
 * its graphs were seen on */
static int device_of(int g)
{
    CUdevice dev = 0;
    in_driver++;
    if (!real.ctx_get_device || real.ctx_get_device(&dev) != CU_OK)
        dev = -1;
    in_driver--;
    if (dev >= 0 && page_index(dev) == g)
        devs[g] = dev + 1;
    return devs[g] ? devs[g] - 1 : 0;
}

/* (gm_lock held) `bytes` more that live graphs may map on GPU g: what the pool's charge grows by,
 * held; 0: no room (nothing held) */
static int hold_gpu(int g, uint64_t bytes)
{
    uint64_t r = reserved_now(g, device_of(g)), base = r > live[g] ? r : live[g];
    uint64_t want = live[g] + bytes > base ? live[g] + bytes : base;
    uint64_t more = want > charged[g] ? want - charged[g] : 0;
    if (more && !take(g, more) && !(settle_all() && take(g, more)))
        return 0;
    charged[g] += more;
    live[g] += bytes;  /* (held for it until the driver answers) */
    return 1;
}

CUresult graph_foresee(void *graph, struct graph_plan *p)
{
    pthread_once(&gd_once, gd_load);
    memset(p, 0, sizeof *p);
    if (!gd.nodes || !graph)
        return CU_OK;
    struct ranges rs = {.cur = current_gpu()};  /* (-1: a GPU given whole, the driver's to hold) */
    in_driver++;
    walk(graph, p, &rs, 0);
    in_driver--;
    if (!rs.lost)
        covered(&rs, p->bytes);
    free(rs.r);
    for (int g = 0; g < CGPU_MAX_GPUS; g++)
        p->any |= p->bytes[g] != 0;
    if (!p->any)
        return CU_OK;  /* (no graph memory on the container's GPUs) */
    if (!need_slot())
        return CU_OUT_OF_MEMORY;
    follow();
    for (int g = 0; g < CGPU_MAX_GPUS; g++)
        if (p->bytes[g])
            driver_share(g);
    pthread_mutex_lock(&gm_lock);
    for (int g = 0; g < CGPU_MAX_GPUS; g++)
        if (p->bytes[g] && !hold_gpu(g, p->bytes[g])) {
            for (int h = 0; h < g; h++)  /* (what was held on the GPUs before, back) */
                if (p->bytes[h]) {
                    live[h] -= p->bytes[h];
                    settle_gpu(h, device_of(h));
                }
            pthread_mutex_unlock(&gm_lock);
            p->any = 0;
            return CU_OUT_OF_MEMORY;  /* (past memsize at its first replay: refused here, never a kill) */
        }
    pthread_mutex_unlock(&gm_lock);
    return CU_OK;
}

void graph_made(CUresult r, void *exec, struct graph_plan *p)
{
    if (!p->any)
        return;
    pthread_mutex_lock(&gm_lock);
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        if (!p->bytes[g])
            continue;
        int kept = 0;
        for (int i = 0; r == CU_OK && exec && i < NEXECS && !kept; i++)
            if (!execs[i].exec) {
                execs[i].exec = exec;
                execs[i].g = g;
                execs[i].bytes = p->bytes[g];
                kept = 1;
            }
        if (!kept)  /* (refused by the driver; or no record left: its share is charged till a trim) */
            live[g] -= p->bytes[g];
        if (r != CU_OK)
            settle_gpu(g, device_of(g));
    }
    pthread_mutex_unlock(&gm_lock);
}

void graph_gone(void *exec)
{
    pthread_mutex_lock(&gm_lock);
    for (int i = 0; i < NEXECS; i++)
        if (execs[i].exec == exec && exec) {
            int g = execs[i].g;
            live[g] -= execs[i].bytes;
            execs[i].exec = NULL;
            settle_gpu(g, device_of(g));  /* (the pool keeps its pages: the charge stays at its reservation) */
        }
    pthread_mutex_unlock(&gm_lock);
}

/* cuDeviceGraphMemTrim: what the pool gave back comes back. */
CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    pthread_once(&gd_once, gd_load);
    PASS_THROUGH(gd.trim, dev);
    in_driver++;
    CUresult r = gd.trim(dev);
    in_driver--;
    int g = page_index(dev);
    if (r == CU_OK && g >= 0) {
        pthread_mutex_lock(&gm_lock);
        devs[g] = dev + 1;
        settle_gpu(g, dev);
        pthread_mutex_unlock(&gm_lock);
    }
    return r;
}

/* cuGraphUpload: the graph's memory was held at its instantiation; what the driver reserved past
 * that (its own rounding) is charged after. */
static CUresult uploaded(CUresult r)
{
    int g = current_gpu();
    if (r == CU_OK && g >= 0) {
        pthread_mutex_lock(&gm_lock);
        if (charged[g] || live[g])
            settle_gpu(g, device_of(g));
        pthread_mutex_unlock(&gm_lock);
    }
    return r;
}
static CUresult upload(CUresult (*fn)(void *, void *), void *exec, void *stream)
{
    PASS_THROUGH(fn, exec, stream);
    in_driver++;
    CUresult r = fn(exec, stream);
    in_driver--;
    return uploaded(r);
}
CUresult cuGraphUpload(void *exec, void *stream)
{
    pthread_once(&gd_once, gd_load);
    return upload(gd.upload, exec, stream);
}
CUresult cuGraphUpload_ptsz(void *exec, void *stream)
{
    pthread_once(&gd_once, gd_load);
    return upload(gd.upload_ptsz, exec, stream);
}

static void graphmem_forked(void)
{
    memset(execs, 0, sizeof execs);  /* (the parent's graphs) */
    memset(live, 0, sizeof live);
    memset(charged, 0, sizeof charged);
    memset(devs, 0, sizeof devs);
    memset(conds, 0, sizeof conds);  /* (the parent's graphs) */
    pthread_mutex_init(&cond_lock, NULL);
    pthread_mutex_init(&gm_lock, NULL);
}

__attribute__((constructor)) static void graphmem_hooks(void)
{
    memory_on_fork(graphmem_forked);
}
