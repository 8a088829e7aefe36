/*
 * What libcgpu's memory files share (docs/memory.md), one concern each, calling down:
 *   memory.c   the charge: what this process holds (a hash table), the container's account in the
 *              page (charged BEFORE the driver is asked), the driver's own memory,
 *              the plain allocators, arrays, cuMemGetInfo;
 *   pools.c    stream-ordered pools, charged by their reservation;
 *   vmm.c      virtual memory management (cuMemCreate/Map/Unmap/Release) and its handles' IPC;
 *   modules.c  modules and libraries, lazy loading, a launch's first use, the context's limits;
 *   readings.c the daemon's readings of the driver's own memory applied to a slot (below memory.c).
 * memory.c is the bottom of them but for readings.c, which it calls: pools.c, vmm.c and modules.c
 * call down into it, and what memory.c needs of them (pools' refunds, their resets in a forked
 * child) they hand it at load, so no call goes up (no circle in native/). Everything here is hidden (cgpu_internal.h's pragma).
 */
#ifndef CGPU_MEMORY_H
#define CGPU_MEMORY_H

#include "cgpu_internal.h"

#pragma GCC visibility push(hidden)

#define MEM_PAGE (2ull << 20) /* the card's page: what the driver grows by, at least */

/* ---- memory.c: what this process holds, by pointer (or VMM handle, or module...) ---- */
struct entry {
    uint64_t key;    /* the pointer, handle or mapped address */
    uint64_t size;
    uint64_t handle; /* a mapping: its handle */
    int32_t gpu;
    int32_t refs;    /* a VMM handle: its references (cuMemCreate's, cuMemRetainAllocationHandle's) */
    int32_t maps;    /* and its mappings */
    int32_t used;
    int32_t imported; /* a VMM handle imported from another process (vmm.c): charged what its mappings reach */
};
struct table { struct entry *e; size_t cap, n; };
extern struct table allocs;  /* what an allocator returned (a VMM handle too) */
extern struct table mapped;  /* VMM: a mapped address -> its handle */
/* The tables' spin lock (one for all of them): one locked instruction to take, none to leave. */
void mem_lock(void);
void mem_unlock(void);
struct entry *table_find(struct table *t, uint64_t key);  /* (locked) */
struct entry *table_add(struct table *t, uint64_t key);   /* (locked) NULL if it cannot grow */
void table_erase(struct table *t, struct entry *x);       /* (locked) */
void table_drop(struct table *t);                         /* emptied (a forked child's) */

uint64_t room(int g);  /* what allocations may fill on GPU g: memsize less the headroom */
int take(int g, size_t size);     /* reserved on the container and held in the slot; 0: no room */
void untake(int g, size_t size);  /* what take() held, back */
void force(int g, size_t size);   /* held whatever room is left (the driver took it already) */
/* An allocation's pages (the card's 2 MiB pages; smaller ones packed per process) taken, given back. */
enum { CHARGE_BYTES = 1, CHARGE_PAGES = 2 };
int take_alloc(int g, size_t size);  /* 0: no room; else how it was charged */
void untake_alloc(int g, size_t size, int how);
void let_go(struct entry *e);     /* (locked) what an allocation held, back; its entry gone */
void commit(int g, CUdeviceptr key, size_t size, int how);  /* the driver gave it: kept for the free */
void forget(CUdeviceptr key);     /* freed: what it held back */
int settle_all(void);             /* pools' and dead processes' memory back before a refusal */
/* The driver's own memory: charged whatever room is left; readings applied; a context's share. */
void charge_driver(int g, int64_t delta);  /* (readings.c) */
/* readings.c: slot k's newest reading applied (self: this process's own slot; a sibling's: only a
 * shrink), the GPUs it named; every sibling's; a forked child's. */
int readings_new(unsigned k, int self);  /* a reading not applied yet (no lock: the usual call's answer) */
unsigned readings_apply(unsigned k, int self);
void readings_siblings(void);
void readings_forked(void);
void follow(void);
void driver_share(int g);
/* Growth the driver does on its own at a call, measured (memory.c): begun before the call, ended
 * after it (charged where watched; the largest step kept); a launch's ends at the next call. */
struct growth { int g; uint64_t free, held, at; };
void growth_begin(int g, struct growth *w);
uint64_t growth_end(struct growth *w, int learn);  /* learn: a step to keep room for */
void growth_pending(const struct growth *w);
uint64_t growth_step(int g);  /* the largest step learned on GPU g (a launch's), at least a page */
/* `bytes` more of the driver's own on GPU g may be taken now (the headroom included): 1, else 0
 * (after what pools and dead processes gave back). */
int driver_room(int g, uint64_t bytes);

/* ---- graphmem.c: CUDA graphs' own memory (the device's graph pool), held at instantiation, and a
 * graph's nodes counted; above memory.c as pools.c is, calling down into it ---- */
struct graph_plan {  /* nodes: its weight; bytes: what its allocation nodes may map on each GPU (any: some) */
    uint32_t nodes;
    int any;
    uint64_t bytes[CGPU_MAX_GPUS];
};
CUresult graph_foresee(void *graph, struct graph_plan *p);  /* before the driver instantiates it: CU_OUT_OF_MEMORY, no room */
void graph_made(CUresult r, void *exec, struct graph_plan *p);  /* after (r: the driver's answer) */
void graph_gone(void *exec);  /* an executable graph destroyed (after the driver) */
int graph_capturing(void *stream, int ptsz);  /* cuMemAllocAsync into it makes a graph's allocation node */

/* What the files above memory.c hand it at load (their constructors): nothing in memory.c calls up. */
extern int (*pools_settle_hook)(void);   /* pools.c: what every pool gave back since, refunded */
void memory_on_fork(void (*fn)(void));   /* a file's reset in a forked child */

/* An allocation of `size` bytes done by `call` (the real driver's), held to memsize on the page's
 * GPU `gpu` (-1: a GPU given whole, not charged). */
#define CHARGED(size, key, call) CHARGED_ON(current_gpu(), size, key, call)
#define CHARGED_ON(gpu, size, key, call)                                                \
    do {                                                                                 \
        int g_ = (gpu);                                                                  \
        if (g_ < 0)                                                                      \
            return (call); /* a GPU given whole: the driver's to hold */                 \
        if (!need_slot())                                                                \
            return CU_OUT_OF_MEMORY;                                                     \
        follow();                                                                        \
        driver_share(g_);                                                                \
        int how_ = take_alloc(g_, (size));                                               \
        if (!how_ && !(settle_all() && (how_ = take_alloc(g_, (size)))))                 \
            return CU_OUT_OF_MEMORY; /* (a pool or a dead process may have given back) */ \
        in_driver++;                                                                     \
        CUresult r_ = (call);                                                            \
        for (int w_ = 0; r_ == CU_OUT_OF_MEMORY && held_elsewhere(w_); w_++)             \
            r_ = (call); /* (the card full inside memsize: page.c, held_elsewhere) */    \
        in_driver--;                                                                     \
        if (r_ != CU_OK) {                                                               \
            untake_alloc(g_, (size), how_);                                              \
            return r_;                                                                   \
        }                                                                                \
        commit(g_, (key), (size), how_);                                                 \
        return CU_OK;                                                                    \
    } while (0)

/* A free done by `call`: what `key` held comes back once the driver has let it go. */
#define RELEASED(key, call)              \
    do {                                 \
        in_driver++;                     \
        CUresult r_ = (call);            \
        in_driver--;                     \
        if (r_ == CU_OK)                 \
            forget(key);                 \
        return r_;                       \
    } while (0)

/* A call that allocates nothing charged here (host memory; a descriptor the driver will refuse). */
#define UNCHARGED(call)         \
    do {                        \
        in_driver++;            \
        CUresult r_ = (call);   \
        in_driver--;            \
        return r_;              \
    } while (0)

#pragma GCC visibility pop

#endif
