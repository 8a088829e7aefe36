/*
 * What cuda_graphs.c (streams, capture, instantiation, launches) and cuda_graphnodes.c below it
 * (a graph's nodes, the device's graph memory pool) share: a graph and its nodes. Hidden.
 */
#ifndef CGPU_CUDA_GRAPH_H
#define CGPU_CUDA_GRAPH_H
#include "cuda_stub.h"

/* cuda.h's CUgraphNodeType, as far as the stand-in builds them */
enum { NODE_KERNEL = 0, NODE_GRAPH = 4, NODE_EMPTY = 5, NODE_MEM_ALLOC = 10, NODE_MEM_FREE = 11, NODE_CONDITIONAL = 13 };
enum { GRAPH_MAGIC = 0x67726170, EXEC_MAGIC = 0x65786563, NODE_MAGIC = 0x6e6f6465 };
#define GRAPH_NDEV 16  /* the devices a graph's memory may be on */

struct graph;
struct gnode {
    unsigned magic;
    int type;
    uint64_t us;          /* a kernel: its µs (a launch's gridX * gridY * gridZ) */
    uint64_t bytes;       /* an allocation: its bytesize */
    CUdeviceptr dptr;     /* an allocation's address (fixed at the node's creation), a free's */
    int dev;              /* an allocation's device (its pool properties' location, else the graph's) */
    struct graph *child;  /* a child graph node's graph: its own */
    struct graph **body;  /* a conditional node's bodies (nbody), its type (IF 0, WHILE 1, SWITCH 2), its handle */
    unsigned nbody;
    int ctype;
    uint64_t handle;
};
struct graph {
    unsigned magic;
    int dev;
    size_t n, cap;
    uint64_t *us;          /* an executable graph: its kernels in order */
    uint64_t on_card;      /* an executable graph: the driver's own memory for it */
    uint64_t need[GRAPH_NDEV];  /* an executable graph: its graph allocations' bytes on each device (in pages) */
    struct { CUdeviceptr p; uint64_t bytes; int dev; } *ranges;  /* ... by address (an address reused in it: its largest) */
    size_t nranges, cranges;
    int mapped;            /* ... given their physical memory from the device's graph pool */
    unsigned mapped_gen[GRAPH_NDEV];  /* ... in that generation of each device's context */
    int embedded;          /* a child graph node's graph: no memory node may be added to it */
    struct gnode **nodes;  /* a graph: its nodes, in the order made */
    size_t nn, ncap;
};

/* ---- cuda_graphnodes.c ---- */
HIDDEN struct graph *graph_new(int dev, unsigned magic);
HIDDEN void graph_free(struct graph *g);  /* with its nodes, their child graphs and bodies; an exec's memory unmapped */
HIDDEN int graph_append(struct graph *g, const uint64_t *us, size_t n);  /* an exec's kernels: 0, -1 */
HIDDEN CUresult graph_add_kernels(struct graph *g, const uint64_t *us, size_t n);  /* kernel nodes */
HIDDEN CUresult graph_add_alloc(struct graph *g, size_t bytes, int dev, CUdeviceptr *dptr);  /* a mem-alloc node on dev */
HIDDEN CUresult graph_add_free(struct graph *g, CUdeviceptr dptr);  /* a mem-free node */
HIDDEN int graph_allocation(CUdeviceptr p);  /* p is a graph allocation's address */
HIDDEN CUresult graph_flatten(const struct graph *g, struct graph *exec);  /* its kernels and memory into exec */
HIDDEN CUresult graph_map(struct graph *exec);  /* its graph memory from the device's graph pool (OOM: the card full) */
HIDDEN void *graphnodes_proc(const char *symbol, int version);  /* cuGetProcAddress's names of cuda_graphnodes.c */
#endif
