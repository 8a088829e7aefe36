/*
 * The stand-in's graph nodes and the device's graph memory pool (issue 45, items 6 and 9), as
 * NVIDIA documents them: the CUDA Programming Guide's "Graph Memory Nodes" and "Conditional Graph
 * Nodes", and the driver API reference of each call below.
 *
 * Nodes: a graph holds its nodes (cuGraphGetNodes gives their handles, cuGraphNodeGetType their
 * CUgraphNodeType): kernels (captured launches; cuGraphAddNode's KERNEL, gridX * gridY * gridZ µs
 * as a launch), empty nodes, child graph nodes (cuGraphAddChildGraphNode: "The child graph is
 * cloned in this call", and "If childGraph contains allocation nodes, free nodes, or conditional
 * nodes, this call will return an error"; cuGraphAddNode's GRAPH with
 * CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE takes the graph itself, memory nodes and all;
 * cuGraphChildGraphNodeGetGraph: "Allocation and free nodes cannot be added to the returned
 * graph"), conditional nodes (cuGraphAddNode's CONDITIONAL: the driver makes `size` body graphs
 * and returns them in phGraph_out, "CUDA-owned array populated with conditional node child graphs
 * during creation of the node"; cuGraphConditionalHandleCreate's default value, assigned at each
 * launch with CU_GRAPH_COND_ASSIGN_DEFAULT), memory nodes (below). cuGraphNodeGetParams describes
 * each. The stand-in's kernels run no code, so none sets a conditional's value: an IF runs its
 * body when the default is nonzero (its second body, if any, otherwise), a SWITCH its body[value],
 * a WHILE its body once when the default is nonzero (as if the body's last kernel ended the loop).
 *
 * Graph memory ("Graph Memory Nodes"): an allocation node (cuGraphAddMemAllocNode, or
 * cuMemAllocAsync into a capturing stream) gets its address at creation ("CUDA assigns virtual
 * addresses for the graph allocation at node creation time"), no memory: capture takes nothing
 * from the card. Physical memory comes from the device's graph memory pool, which "may update
 * physical memory mappings at any time during graph instantiation, launch, or execution": here at
 * cuGraphUpload, at an instantiation with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD, else at the first
 * launch (the latest the Guide allows, so the least an interposer sees coming), all of an
 * executable graph's allocations at once, each on its device (its pool properties' location; a
 * captured one, the stream's), in 2 MiB pages: what its addresses cover (an allocation
 * made after a free of the graph's own at least as large takes its address: the Guide's "Address
 * Reuse within a Graph", below), and none shared between graphs (the Guide's "multiple graphs may
 * use the same physical memory ... if they will not run simultaneously" is the driver's option,
 * not a promise: never relied on here).
 * The pool keeps what it took across replays and past cuGraphExecDestroy ("destroying a graph
 * which contains memory nodes (even if their allocations are free) will not immediately return
 * physical memory to the OS"); only cuDeviceGraphMemTrim gives back what no executable graph holds
 * ("will unmap and release any physical memory reserved by graph memory nodes that is not actively
 * in use"), and the context's teardown all of it. A growth the card cannot hold fails the launch
 * (or upload) with CUDA_ERROR_OUT_OF_MEMORY. cuDeviceGetGraphMemAttribute answers
 * USED_MEM_CURRENT / _HIGH (what executable graphs hold) and RESERVED_MEM_CURRENT / _HIGH (what
 * the pool took from the card); cuDeviceSetGraphMemAttribute resets a high mark ("can only be
 * reset to zero"). The pool's memory is the driver's own for the process (NVML's per-process
 * figure shows it).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_graph.h"

#define PAGE (2ull << 20)
#define NDEV GRAPH_NDEV
#define GRAPH_VA 0x7d0000000000ull  /* graph allocations' addresses (the pools' start at 0x7e...) */
enum { LOC_DEVICE = 1 };
enum { COND_IF = 0, COND_WHILE = 1, COND_SWITCH = 2, COND_ASSIGN_DEFAULT = 1 };
enum { ATTR_USED_CURRENT = 0, ATTR_USED_HIGH = 1, ATTR_RESERVED_CURRENT = 2, ATTR_RESERVED_HIGH = 3 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* the graph pools, the addresses, the handles */
static struct { uint64_t used, used_high, reserved, reserved_high; unsigned gen; } pools[NDEV];
static CUdeviceptr next_va = GRAPH_VA;
#define NHANDLES 4096
static unsigned nhandles;
static unsigned handle_value[NHANDLES];  /* a conditional handle's default value (its flags' ASSIGN_DEFAULT: else 0) */

static uint64_t pages_of(uint64_t n) { return (n + PAGE - 1) / PAGE * PAGE; }

struct graph *graph_new(int dev, unsigned magic)
{
    struct graph *g = calloc(1, sizeof *g);
    if (g) {
        g->magic = magic;
        g->dev = dev;
    }
    return g;
}

static struct gnode *node_new(struct graph *g, int type)
{
    if (g->nn == g->ncap) {
        size_t cap = g->ncap * 2 + 8;
        struct gnode **more = realloc(g->nodes, cap * sizeof *more);
        if (!more) return NULL;
        g->nodes = more;
        g->ncap = cap;
    }
    struct gnode *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    n->magic = NODE_MAGIC;
    n->type = type;
    g->nodes[g->nn++] = n;
    return n;
}

static struct gnode *node_of(const void *h)
{
    const struct gnode *n = h;
    return n && n->magic == NODE_MAGIC ? (struct gnode *)n : NULL;
}

static struct graph *graph_of(const void *h)
{
    const struct graph *g = h;
    return g && g->magic == GRAPH_MAGIC ? (struct graph *)g : NULL;
}

/* (lock held) the graph pool of card dev, emptied when its context was torn down since */
static void pool_settle(int dev)
{
    unsigned gen = stub_ctx_gen(dev);
    if (pools[dev].gen == gen) return;
    if (pools[dev].reserved) stub_driver_memory(dev, -(int64_t)pools[dev].reserved);  /* (the context's teardown) */
    memset(&pools[dev], 0, sizeof pools[dev]);
    pools[dev].gen = gen;
}

/* (lock held) what exec holds on card dev back to its pool (the pool keeps the pages:
 * cuDeviceGraphMemTrim gives them back) */
static void unmap_on(struct graph *exec, int dev)
{
    pool_settle(dev);
    if (pools[dev].gen == exec->mapped_gen[dev])
        pools[dev].used -= exec->need[dev];
}

static void unmap(struct graph *exec)
{
    pthread_mutex_lock(&lock);
    for (int dev = 0; exec->mapped && dev < NDEV; dev++)
        if (exec->need[dev]) unmap_on(exec, dev);
    exec->mapped = 0;
    pthread_mutex_unlock(&lock);
}

/* (lock held) exec's memory on card dev from its graph pool, grown from the card: 0, -1 (no room) */
static int map_on(struct graph *exec, int dev)
{
    pool_settle(dev);
    typeof(pools[0]) *p = &pools[dev];
    uint64_t want = p->used + exec->need[dev], grow = want > p->reserved ? want - p->reserved : 0;
    if (grow && stub_driver_memory(dev, (int64_t)grow)) {
        stub_trace("graph memory: %llu bytes more than card %d holds", (unsigned long long)grow, dev);
        return -1;
    }
    p->reserved += grow;
    p->used = want;
    exec->mapped_gen[dev] = p->gen;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    if (p->used > p->used_high) p->used_high = p->used;
    return 0;
}

CUresult graph_map(struct graph *exec)
{
    if (exec->mapped) return STUB_OK;
    pthread_mutex_lock(&lock);
    int dev = 0;
    while (dev < NDEV && (!exec->need[dev] || !map_on(exec, dev)))
        dev++;
    if (dev < NDEV)  /* (no room on card dev: what the cards before it took goes back to their pools) */
        while (dev-- > 0)
            if (exec->need[dev]) unmap_on(exec, dev);
    exec->mapped = dev == NDEV;
    pthread_mutex_unlock(&lock);
    return exec->mapped ? STUB_OK : STUB_OUT_OF_MEMORY;
}

void graph_free(struct graph *g)
{
    if (!g) return;
    if (g->magic == EXEC_MAGIC) unmap(g);
    stub_driver_memory(g->dev, -(int64_t)g->on_card);
    for (size_t i = 0; i < g->nn; i++) {
        struct gnode *n = g->nodes[i];
        graph_free(n->child);
        for (unsigned b = 0; b < n->nbody; b++) graph_free(n->body[b]);
        free(n->body);
        n->magic = 0;
        free(n);
    }
    g->magic = 0;
    free(g->nodes);
    free(g->ranges);
    free(g->us);
    free(g);
}

int graph_append(struct graph *g, const uint64_t *us, size_t n)
{
    if (g->n + n > g->cap) {
        size_t cap = (g->n + n) * 2 + 8;
        uint64_t *more = realloc(g->us, cap * sizeof *more);
        if (!more) return -1;
        g->us = more;
        g->cap = cap;
    }
    memcpy(g->us + g->n, us, n * sizeof *us);
    g->n += n;
    return 0;
}

CUresult graph_add_kernels(struct graph *g, const uint64_t *us, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct gnode *k = node_new(g, NODE_KERNEL);
        if (!k) return STUB_OUT_OF_MEMORY;
        k->us = us[i];
    }
    return STUB_OK;
}

/* An allocation node's address: a range this graph freed before (a free node of one of its own
 * allocations, at least as large, not reused yet: their lifetimes do not overlap), else a new one.
 * "CUDA may reuse memory within a graph by assigning the same virtual address ranges to different
 * allocations whose lifetimes do not overlap" (the Guide's "Address Reuse within a Graph"): the
 * graph's memory is then what its addresses cover, not the sum of its allocations. */
static CUdeviceptr address_for(struct graph *g, size_t bytes)
{
    for (size_t i = 0; i < g->nn; i++) {
        struct gnode *f = g->nodes[i];
        if (f->type != NODE_MEM_FREE || f->handle) continue;  /* (a free node's handle: its range reused) */
        for (size_t j = 0; j < i; j++)
            if (g->nodes[j]->type == NODE_MEM_ALLOC && g->nodes[j]->dptr == f->dptr
                && pages_of(g->nodes[j]->bytes) >= pages_of(bytes)) {
                f->handle = 1;
                return f->dptr;
            }
    }
    pthread_mutex_lock(&lock);
    CUdeviceptr p = next_va;
    next_va += pages_of(bytes);
    pthread_mutex_unlock(&lock);
    return p;
}

CUresult graph_add_alloc(struct graph *g, size_t bytes, int dev, CUdeviceptr *dptr)
{
    if (!bytes || !dptr || dev < 0 || dev >= NDEV || dev >= stub_device_count()) return STUB_INVALID_VALUE;
    if (g->embedded) return STUB_INVALID_VALUE;  /* (cuGraphChildGraphNodeGetGraph's graph: no memory nodes) */
    CUdeviceptr at = address_for(g, bytes);
    struct gnode *n = node_new(g, NODE_MEM_ALLOC);
    if (!n) return STUB_OUT_OF_MEMORY;
    n->dptr = *dptr = at;
    n->bytes = bytes;
    n->dev = dev;
    return STUB_OK;
}

/* An allocation of exec's at p: its need grows by what p's range adds (an address reused: its largest). */
static int add_range(struct graph *exec, CUdeviceptr p, uint64_t bytes, int dev)
{
    for (size_t i = 0; i < exec->nranges; i++)
        if (exec->ranges[i].p == p) {
            if (bytes > exec->ranges[i].bytes) {
                exec->need[dev] += bytes - exec->ranges[i].bytes;
                exec->ranges[i].bytes = bytes;
            }
            return 0;
        }
    if (exec->nranges == exec->cranges) {
        size_t cap = exec->cranges * 2 + 8;
        void *more = realloc(exec->ranges, cap * sizeof *exec->ranges);
        if (!more) return -1;
        exec->ranges = more;
        exec->cranges = cap;
    }
    exec->ranges[exec->nranges].p = p;
    exec->ranges[exec->nranges].dev = dev;
    exec->ranges[exec->nranges++].bytes = bytes;
    exec->need[dev] += bytes;
    return 0;
}

CUresult graph_add_free(struct graph *g, CUdeviceptr dptr)
{
    if (g->embedded || !graph_allocation(dptr)) return STUB_INVALID_VALUE;
    struct gnode *n = node_new(g, NODE_MEM_FREE);
    if (!n) return STUB_OUT_OF_MEMORY;
    n->dptr = dptr;
    return STUB_OK;
}

int graph_allocation(CUdeviceptr p)
{
    pthread_mutex_lock(&lock);
    int in = p >= GRAPH_VA && p < next_va;
    pthread_mutex_unlock(&lock);
    return in;
}

static unsigned cond_value(uint64_t handle)
{
    pthread_mutex_lock(&lock);
    unsigned v = handle && handle <= nhandles ? handle_value[handle - 1] : 0;
    pthread_mutex_unlock(&lock);
    return v;
}

/* g's kernels appended to exec in the order they run, and its allocations' pages (bodies and
 * children too, whether they run or not) added to exec's need, an address reused counted once. */
CUresult graph_flatten(const struct graph *g, struct graph *exec)
{
    for (size_t i = 0; i < g->nn; i++) {
        const struct gnode *n = g->nodes[i];
        CUresult r = STUB_OK;
        if (n->type == NODE_KERNEL && graph_append(exec, &n->us, 1)) return STUB_OUT_OF_MEMORY;
        if (n->type == NODE_MEM_ALLOC && add_range(exec, n->dptr, pages_of(n->bytes), n->dev)) return STUB_OUT_OF_MEMORY;
        if (n->child && (r = graph_flatten(n->child, exec))) return r;
        if (n->type != NODE_CONDITIONAL) continue;
        unsigned v = cond_value(n->handle), run = n->nbody;  /* (the body that runs: nbody, none) */
        if (n->ctype == COND_SWITCH) run = v;
        else if (v) run = 0;
        else if (n->ctype == COND_IF) run = 1;  /* (its else body, if it has one) */
        for (unsigned b = 0; b < n->nbody; b++) {
            struct graph scratch = {.magic = EXEC_MAGIC, .dev = exec->dev};
            if ((r = graph_flatten(n->body[b], b == run ? exec : &scratch))) return r;
            for (int d = 0; d < NDEV; d++) exec->need[d] += scratch.need[d];
            free(scratch.us);
            free(scratch.ranges);
        }
    }
    return STUB_OK;
}

static int has_special(const struct graph *g)  /* memory or conditional nodes, anywhere in it */
{
    for (size_t i = 0; i < g->nn; i++)
        if (g->nodes[i]->type == NODE_MEM_ALLOC || g->nodes[i]->type == NODE_MEM_FREE
            || g->nodes[i]->type == NODE_CONDITIONAL || (g->nodes[i]->child && has_special(g->nodes[i]->child)))
            return 1;
    return 0;
}

static struct graph *copy_of(const struct graph *g)
{
    struct graph *c = graph_new(g->dev, GRAPH_MAGIC);
    for (size_t i = 0; c && i < g->nn; i++) {
        const struct gnode *n = g->nodes[i];
        struct gnode *m = node_new(c, n->type);
        if (!m) break;
        m->us = n->us;
        if (n->child && !(m->child = copy_of(n->child))) break;
        if (m->child) m->child->embedded = 1;
    }
    if (c && c->nn != g->nn) {
        graph_free(c);
        return NULL;
    }
    return c;
}

/* ---- the nodes' calls ---- */
typedef void *CUgraphNode;
static CUresult added(CUgraphNode *out, struct graph *g)
{
    *out = g->nodes[g->nn - 1];
    return STUB_OK;
}

CUresult cuGraphNodeGetType(CUgraphNode h, int *type)
{
    struct gnode *n = node_of(h);
    if (!n || !type) return STUB_INVALID_VALUE;
    *type = n->type;
    return STUB_OK;
}

CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode h, struct graph **out)
{
    struct gnode *n = node_of(h);
    if (!n || n->type != NODE_GRAPH || !out) return STUB_INVALID_VALUE;
    *out = n->child;
    return STUB_OK;
}

CUresult cuGraphAddChildGraphNode(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, size_t ndeps,
                                  struct graph *child)
{
    if (!out || !graph_of(g) || !graph_of(child) || (ndeps && !deps)) return STUB_INVALID_VALUE;
    if (has_special(child)) return STUB_INVALID_VALUE;  /* (the reference's rule, above) */
    struct graph *c = copy_of(child);
    struct gnode *n = c ? node_new(g, NODE_GRAPH) : NULL;
    if (!n) {
        graph_free(c);
        return STUB_OUT_OF_MEMORY;
    }
    n->child = c;
    c->embedded = 1;
    return added(out, g);
}

CUresult cuGraphAddEmptyNode(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, size_t ndeps)
{
    if (!out || !graph_of(g) || (ndeps && !deps)) return STUB_INVALID_VALUE;
    return node_new(g, NODE_EMPTY) ? added(out, g) : STUB_OUT_OF_MEMORY;
}

/* CUDA_MEM_ALLOC_NODE_PARAMS: CUmemPoolProps (88 bytes), accessDescs, accessDescCount, bytesize, dptr */
typedef struct { unsigned char pool_props[88]; const void *access; size_t naccess, bytesize; CUdeviceptr dptr; } alloc_params;

CUresult cuGraphAddMemAllocNode(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, size_t ndeps,
                                alloc_params *p)
{
    if (!out || !graph_of(g) || !p || (ndeps && !deps)) return STUB_INVALID_VALUE;
    int type, id;  /* CUmemPoolProps's location (after allocType and handleTypes): its device */
    memcpy(&type, p->pool_props + 8, sizeof type);
    memcpy(&id, p->pool_props + 12, sizeof id);
    CUresult r = graph_add_alloc(g, p->bytesize, type == LOC_DEVICE ? id : g->dev, &p->dptr);
    return r ? r : added(out, g);
}

CUresult cuGraphAddMemFreeNode(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, size_t ndeps,
                               CUdeviceptr dptr)
{
    if (!out || !graph_of(g) || (ndeps && !deps)) return STUB_INVALID_VALUE;
    CUresult r = graph_add_free(g, dptr);
    return r ? r : added(out, g);
}

CUresult cuGraphMemAllocNodeGetParams(CUgraphNode h, alloc_params *p)
{
    struct gnode *n = node_of(h);
    if (!n || n->type != NODE_MEM_ALLOC || !p) return STUB_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    int where[2] = {LOC_DEVICE, n->dev};  /* (its pool properties' location: the device it is on) */
    memcpy(p->pool_props + 8, where, sizeof where);
    p->bytesize = n->bytes;
    p->dptr = n->dptr;
    return STUB_OK;
}

CUresult cuGraphMemFreeNodeGetParams(CUgraphNode h, CUdeviceptr *dptr)
{
    struct gnode *n = node_of(h);
    if (!n || n->type != NODE_MEM_FREE || !dptr) return STUB_INVALID_VALUE;
    *dptr = n->dptr;
    return STUB_OK;
}

CUresult cuGraphConditionalHandleCreate(uint64_t *handle, struct graph *g, void *ctx, unsigned dflt, unsigned flags)
{
    if (!handle || !graph_of(g) || flags & ~(unsigned)COND_ASSIGN_DEFAULT) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = nhandles < NHANDLES ? STUB_OK : STUB_OUT_OF_MEMORY;
    if (!r) {
        handle_value[nhandles++] = flags & COND_ASSIGN_DEFAULT ? dflt : 0;
        *handle = nhandles;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* CUgraphNodeParams: its type, 12 bytes reserved, then a union of 232 bytes, then 8 reserved */
typedef struct {
    int type, reserved0[3];
    union {
        long long reserved1[29];
        struct { void *func; unsigned grid[3], block[3]; } kernel;
        struct { struct graph *graph; int ownership; } graph;                 /* CUDA_CHILD_GRAPH_NODE_PARAMS */
        alloc_params alloc;
        struct { CUdeviceptr dptr; } free;
        struct { uint64_t handle; int type; unsigned size; struct graph **out; void *ctx; } cond;
    } u;
    long long reserved2;
} node_params;
enum { OWNERSHIP_CLONE = 0, OWNERSHIP_MOVE = 1 };

static CUresult add_node(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, size_t ndeps, node_params *p)
{
    if (!out || !graph_of(g) || !p || (ndeps && !deps)) return STUB_INVALID_VALUE;
    switch (p->type) {
    case NODE_KERNEL: {
        uint64_t us = (uint64_t)p->u.kernel.grid[0] * p->u.kernel.grid[1] * p->u.kernel.grid[2];
        CUresult r = graph_add_kernels(g, &us, 1);
        return r ? r : added(out, g);
    }
    case NODE_EMPTY:
        return cuGraphAddEmptyNode(out, g, deps, ndeps);
    case NODE_MEM_ALLOC:
        return cuGraphAddMemAllocNode(out, g, deps, ndeps, &p->u.alloc);
    case NODE_MEM_FREE:
        return cuGraphAddMemFreeNode(out, g, deps, ndeps, p->u.free.dptr);
    case NODE_GRAPH: {
        struct graph *child = graph_of(p->u.graph.graph);
        if (!child || child == g) return STUB_INVALID_VALUE;
        if (p->u.graph.ownership != OWNERSHIP_MOVE)
            return cuGraphAddChildGraphNode(out, g, deps, ndeps, child);
        struct gnode *n = node_new(g, NODE_GRAPH);  /* (moved: the graph is the node's now, memory nodes and all) */
        if (!n) return STUB_OUT_OF_MEMORY;
        n->child = child;
        return added(out, g);
    }
    case NODE_CONDITIONAL: {
        unsigned size = p->u.cond.size, type = (unsigned)p->u.cond.type;
        if (type > COND_SWITCH || !size || (type == COND_WHILE && size != 1) || (type == COND_IF && size > 2)
            || !p->u.cond.handle || p->u.cond.handle > nhandles)
            return STUB_INVALID_VALUE;
        struct gnode *n = node_new(g, NODE_CONDITIONAL);
        if (!n || !(n->body = calloc(size, sizeof *n->body))) return STUB_OUT_OF_MEMORY;
        n->ctype = (int)type;
        n->handle = p->u.cond.handle;
        for (; n->nbody < size; n->nbody++)
            if (!(n->body[n->nbody] = graph_new(g->dev, GRAPH_MAGIC))) return STUB_OUT_OF_MEMORY;
        p->u.cond.out = n->body;  /* ("CUDA-owned array populated with conditional node child graphs") */
        return added(out, g);
    }
    }
    return STUB_NOT_SUPPORTED;  /* (node types the stand-in does not build) */
}

CUresult cuGraphAddNode(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, size_t ndeps, node_params *p)
{
    return add_node(out, g, deps, ndeps, p);
}
CUresult cuGraphAddNode_v2(CUgraphNode *out, struct graph *g, const CUgraphNode *deps, const void *edges,
                           size_t ndeps, node_params *p)
{
    return add_node(out, g, deps, ndeps, p);
}

/* CGPU_STUB_NO_NODE_PARAMS=1: a driver before cuGraphNodeGetParams (CUDA_ERROR_NOT_FOUND, as its
 * cuGetProcAddress answers a name it does not have), to test what an interposer does without it. */
CUresult cuGraphNodeGetParams(CUgraphNode h, node_params *p)
{
    const char *old = getenv("CGPU_STUB_NO_NODE_PARAMS");
    if (old && *old == '1') return STUB_NOT_FOUND;
    struct gnode *n = node_of(h);
    if (!n || !p) return STUB_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->type = n->type;
    if (n->type == NODE_KERNEL) {
        p->u.kernel.grid[0] = (unsigned)n->us;
        p->u.kernel.grid[1] = p->u.kernel.grid[2] = p->u.kernel.block[0] = p->u.kernel.block[1] = p->u.kernel.block[2] = 1;
    } else if (n->type == NODE_GRAPH)
        p->u.graph.graph = n->child;
    else if (n->type == NODE_MEM_ALLOC)
        return cuGraphMemAllocNodeGetParams(h, &p->u.alloc);
    else if (n->type == NODE_MEM_FREE)
        p->u.free.dptr = n->dptr;
    else if (n->type == NODE_CONDITIONAL) {
        p->u.cond.handle = n->handle;
        p->u.cond.type = n->ctype;
        p->u.cond.size = n->nbody;
        p->u.cond.out = n->body;
    }
    return STUB_OK;
}

/* ---- the device's graph memory pool ---- */
CUresult cuDeviceGetGraphMemAttribute(int dev, int attr, uint64_t *value)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (dev < 0 || dev >= stub_device_count() || dev >= NDEV) return STUB_INVALID_DEVICE;
    if (!value || attr < ATTR_USED_CURRENT || attr > ATTR_RESERVED_HIGH) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    pool_settle(dev);
    uint64_t v[] = {pools[dev].used, pools[dev].used_high, pools[dev].reserved, pools[dev].reserved_high};
    *value = v[attr];
    pthread_mutex_unlock(&lock);
    return STUB_OK;
}

CUresult cuDeviceSetGraphMemAttribute(int dev, int attr, const uint64_t *value)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (dev < 0 || dev >= stub_device_count() || dev >= NDEV) return STUB_INVALID_DEVICE;
    if (!value || *value || (attr != ATTR_USED_HIGH && attr != ATTR_RESERVED_HIGH)) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    pool_settle(dev);
    if (attr == ATTR_USED_HIGH) pools[dev].used_high = pools[dev].used;  /* (reset: it reads what is held now) */
    else pools[dev].reserved_high = pools[dev].reserved;
    pthread_mutex_unlock(&lock);
    return STUB_OK;
}

CUresult cuDeviceGraphMemTrim(int dev)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (dev < 0 || dev >= stub_device_count() || dev >= NDEV) return STUB_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    pool_settle(dev);
    uint64_t back = pools[dev].reserved - pools[dev].used;  /* (what no executable graph holds) */
    if (back) stub_driver_memory(dev, -(int64_t)back);
    pools[dev].reserved -= back;
    pthread_mutex_unlock(&lock);
    return STUB_OK;
}

void *graphnodes_proc(const char *symbol, int version)
{
    static const struct { const char *name; void *fn; } names[] = {
#define P(f) {#f, (void *)f}
        P(cuGraphNodeGetType), P(cuGraphChildGraphNodeGetGraph), P(cuGraphAddChildGraphNode), P(cuGraphAddEmptyNode),
        P(cuGraphAddMemAllocNode), P(cuGraphAddMemFreeNode), P(cuGraphMemAllocNodeGetParams),
        P(cuGraphMemFreeNodeGetParams), P(cuGraphConditionalHandleCreate), P(cuGraphNodeGetParams),
        P(cuDeviceGetGraphMemAttribute), P(cuDeviceSetGraphMemAttribute), P(cuDeviceGraphMemTrim),
#undef P
    };
    if (!strcmp(symbol, "cuGraphAddNode"))
        return version >= 12030 ? (void *)cuGraphAddNode_v2 : (void *)cuGraphAddNode;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!strcmp(symbol, names[i].name)) return names[i].fn;
    return NULL;
}
