/*
 * The per-container pages libcgpu and the daemon share (docs/isolation.md):
 * the single definition of their layout; cgpud/gpus/pages.py writes and reads
 * the same bytes (a test compares the two).
 *
 * <dir>/limits  written by the daemon, mapped READ-ONLY into the container:
 *               what the container may not change (its memsize per GPU) and
 *               its compute gate (odd: open, even: closed; every change adds
 *               one; kernel launches wait on it with a futex while it is even).
 * <dir>/usage   mapped read-write: what its processes hold, per GPU in all and
 *               per process (a slot per pid, so a dead process's memory is
 *               given back by whoever finds it dead), and per process whether
 *               it launches kernels (`gated`) and the closed gate value whose
 *               work it has finished (`acked`: its queued kernels are done).
 * <dir>/drained a FIFO the daemon reads: a process writes a byte to it when
 *               it has set `acked`, so the daemon wakes without polling.
 */
#ifndef CGPU_PAGE_H
#define CGPU_PAGE_H

#include <stdint.h>

#define CGPU_MAGIC 0x55504743u  /* "CGPU" little-endian */
#define CGPU_VERSION 2u
#define CGPU_MAX_GPUS 16
#define CGPU_MAX_PROCS 256

struct cgpu_limits {
    uint32_t magic, version, ngpus, reserved;
    uint64_t memsize[CGPU_MAX_GPUS];
    uint32_t gate, reserved2;
};

struct cgpu_proc {
    int32_t pid;  /* 0: free */
    uint32_t gated;  /* 1: it launches kernels (its helper thread answers the gate) */
    uint32_t acked;  /* the closed gate value it has drained its work for */
    uint32_t reserved;
    uint64_t held[CGPU_MAX_GPUS];
};

struct cgpu_usage {
    uint32_t magic, version;
    uint64_t used[CGPU_MAX_GPUS];
    uint32_t gated_slots[CGPU_MAX_PROCS / 32];  /* bit k: procs[k] is gated (the daemon reads only those) */
    struct cgpu_proc procs[CGPU_MAX_PROCS];
};

#endif
