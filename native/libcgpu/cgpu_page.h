/*
 * The per-container pages libcgpu and the daemon share (docs/isolation.md):
 * the single definition of their layout; cgpud/gpus/pages.py writes and reads
 * the same bytes (a test compares the two).
 *
 * <dir>/limits  written by the daemon, mapped READ-ONLY into the container:
 *               what the container may not change (its memsize per GPU) and
 *               its compute gates, one per GPU and one for the container (odd:
 *               open, even: closed; every change adds one; a kernel launch waits
 *               on its GPU's with a futex while it is even).
 * <dir>/usage   mapped read-write: what its processes hold, per GPU in all and
 *               per process (a slot per pid, so a dead process's memory is
 *               given back by whoever finds it dead), and per process whether
 *               it launches kernels (`gated`), on which GPUs (`gpus`), and the
 *               closing whose work it has finished (`acked`: its queued kernels
 *               are done). A process that launches holds a read lock (fcntl, its
 *               own) on its slot's first byte: the daemon tells a dead process
 *               (no lock) and a stopped one (the holder's state) from one draining.
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
#define CGPU_QUEUE_BUDGET_US_DEFAULT 2000u
#define CGPU_PROC_DRAINING 0x80000000u  /* in cgpu_proc.gpus (GPUs are bits 0 to CGPU_MAX_GPUS - 1) */
/* In cgpu_usage_driver.flags: every process with a slot holds an open-file-description read lock
 * (F_OFD_SETLK) on byte CGPU_LIVENESS_BYTE of its slot, on a descriptor closed at exec, for as long
 * as it lives: a slot whose byte nobody locks is a dead (or exec'd) process's, whatever its pid says
 * (a pid reused, a pid namespace the reader does not share). The lock is taken before the slot. */
#define CGPU_SLOTS_LOCKED 1u
#define CGPU_LIVENESS_BYTE 4

struct cgpu_limits {
    /* drain_bound_us: the daemon's drain bound (two of its slices: it gives up on a process that has
     * not answered a closing within it), which libcgpu's helper answers within (0: not said, an
     * older cgpud's page: 20 ms, the default's); written by the daemon (docs/isolation.md, "The
     * drain bound"). */
    uint32_t magic, version, ngpus, drain_bound_us;
    uint64_t memsize[CGPU_MAX_GPUS];
    /* gate: the container's gate, closed while any of its GPUs' is. queue_budget_us: how much GPU
     * time a process may have queued ahead on a shared GPU (0: CGPU_QUEUE_BUDGET_US_DEFAULT). */
    uint32_t gate, queue_budget_us;
    /* Per-GPU gates (a page made by an older cgpud ends above, CGPU_LIMITS_SHARED_GATE bytes:
     * its container has the one gate). gpu_gate[k]: GPU k of the page, odd open, even closed;
     * `closings` counts the closings of any of them (the helper threads wait on it). shared: bit k,
     * another instance is active on GPU k's node GPU now: the container's processes keep at most
     * queue_budget_us of work queued ahead there (docs/scheduler.md, "Queued work"); alone, none. */
    uint32_t closings, shared;
    uint32_t gpu_gate[CGPU_MAX_GPUS];
    /* uuid[k]: GPU k's UUID (all zero: not known). The driver's device with that UUID is GPU k
     * of the page, however CUDA numbers the container's devices; without UUIDs, device k is. */
    uint8_t uuid[CGPU_MAX_GPUS][16];
};
#define CGPU_LIMITS_SHARED_GATE (4 * 4 + 8 * CGPU_MAX_GPUS + 2 * 4)

struct cgpu_proc {
    int32_t pid;  /* 0: free */
    uint32_t gated;  /* it launches kernels, its helper thread answering: 1 the container's gate, 2 per GPU */
    uint32_t acked;  /* 1: the closed gate value it has drained its work for; 2: the `closings` count */
    uint32_t gpus;   /* 2: bit k, it launches on GPU k (it is waited for when that GPU's gate closes);
                      * bit 31 (CGPU_PROC_DRAINING): its helper thread is draining a closing now */
    uint64_t held[CGPU_MAX_GPUS];
};

struct cgpu_usage {
    uint32_t magic, version;
    uint64_t used[CGPU_MAX_GPUS];
    uint32_t gated_slots[CGPU_MAX_PROCS / 32];  /* bit k: procs[k] is gated (the daemon reads only those) */
    struct cgpu_proc procs[CGPU_MAX_PROCS];
};

/* The driver's own memory (docs/memory.md, "The driver's own memory"), in the usage file right after
 * struct cgpu_usage (a page made by an older cgpud ends before it: its processes are charged
 * without the daemon's readings). The daemon's watchdog reads NVML's per-process figure every
 * look and writes it into the process's record; libcgpu charges the larger of its own account and
 * that figure plus what it allocated since, and keeps `step`'s headroom free. */
struct cgpu_driver {
    uint32_t seq;       /* the daemon: odd while it writes a reading, even once it is whole */
    int32_t pid;        /* the daemon: the slot's pid it read (a reading for a process gone is not another's) */
    uint64_t nvml[CGPU_MAX_GPUS];    /* the daemon: NVML's figure for the process at its last reading */
    uint64_t allocs[CGPU_MAX_GPUS];  /* the daemon: the slot's held less driver, read just before NVML */
    uint64_t driver[CGPU_MAX_GPUS];  /* libcgpu: of the slot's held, what it charges for the driver's own */
};

struct cgpu_usage_driver {
    uint32_t watched;   /* the daemon: 1 once its watchdog reads NVML for the container (libcgpu keeps headroom) */
    uint32_t flags;     /* libcgpu: CGPU_SLOTS_LOCKED once its processes hold their slots' liveness locks */
    uint64_t step[CGPU_MAX_GPUS];  /* libcgpu: the largest growth of the driver's memory between two
                                    * readings seen in any of the container's processes */
    struct cgpu_driver procs[CGPU_MAX_PROCS];  /* per slot of struct cgpu_usage's procs */
};

/* The GPU time each process got (docs/scheduler.md, "The charge: GPU time"), in the usage file right
 * after struct cgpu_usage_driver (a page made by an older cgpud ends before it: its instances are
 * charged the time their gates were open). libcgpu brackets each run of a stream's queued work with
 * timing events and adds end - start to `ns` of the run's GPU once the end is known complete; the
 * daemon charges a step the growth of its instance's slots' counters over it. Never reset (a slot
 * taken by another process counts on): the daemon reads differences. */
struct cgpu_busy {
    uint32_t timed;     /* libcgpu: 1, this slot's process counts its GPU time (an older library: 0) */
    int32_t pid;        /* libcgpu: the slot's pid when it set `timed` */
    uint64_t ns[CGPU_MAX_GPUS];  /* libcgpu: GPU ns its runs took, per GPU of the page */
};

struct cgpu_usage_busy {
    struct cgpu_busy procs[CGPU_MAX_PROCS];  /* per slot of struct cgpu_usage's procs */
};

/* A gang's launches (docs/isolation.md, "Gangs"; issue 34), in the usage file right after struct
 * cgpu_usage_busy (a page made by an older cgpud ends before it: a process then counts only its
 * own launches, and a collective cut by a closing between two processes' ranks is not caught up).
 * Written by libcgpu only, each process its own slot's; read by the container's other processes:
 * the ranks of a job (a process per GPU) launch the same sequence, so a rank behind the instance's
 * most-launched one at a closing is one whose half of a collective has not been launched yet. */
struct cgpu_gang {
    uint64_t launched[CGPU_MAX_GPUS];  /* launches the slot's process passed the gate with, per page GPU */
    uint64_t base[CGPU_MAX_GPUS];      /* ... when a closing last found the instance's counts far apart */
};

struct cgpu_usage_gang {
    struct cgpu_gang procs[CGPU_MAX_PROCS];  /* per slot of struct cgpu_usage's procs */
};

/* Who a slot's process is, beyond its pid (issue 34, item 6), in the usage file right after struct
 * cgpu_usage_gang (a page made by an older cgpud ends before it: its slots are told by pid and lock
 * alone). Written by libcgpu when it takes the slot, before the slot's pid; cleared when the slot is
 * given back. A reader that shares the slot's PID namespace (`pidns`) finds the slot's process dead
 * when its pid is gone or started at another time than `start` (a reused pid), even while its
 * liveness byte is locked (a descriptor that outlived it in a child made without fork's handlers);
 * a reader in another namespace (the daemon, the switcher) compares `start` with the process it
 * found by other means (the lock's holder, NVML's pid). `claim` is the taking's own: a daemon
 * reading carries the claim of the slot it read (`read_claim`), so a slot's next process (an exec'd
 * image, a reused pid) never takes its predecessor's reading for its own. */
struct cgpu_ident {
    int32_t pid;         /* libcgpu: the pid it was taken for (as in cgpu_proc.pid) */
    uint32_t reserved;
    uint64_t start;      /* libcgpu: the process's start time, /proc/<pid>/stat field 22 (clock ticks after boot) */
    uint64_t pidns;      /* libcgpu: the inode of its PID namespace (/proc/self/ns/pid) */
    uint64_t claim;      /* libcgpu: this taking's token (CLOCK_MONOTONIC ns, never 0) */
    uint64_t read_claim; /* the daemon: the claim of the slot its last reading (struct cgpu_driver) is for,
                          * written inside that reading's seq */
};

struct cgpu_usage_ident {
    struct cgpu_ident procs[CGPU_MAX_PROCS];  /* per slot of struct cgpu_usage's procs */
};

/* How far the daemon's readings (struct cgpu_driver) were applied to each slot (issue 45, item 7), in
 * the usage file right after struct cgpu_usage_ident (a page made by an older cgpud ends before it:
 * each process applies its own readings at its next call, and its siblings see a shrink only then).
 * libcgpu's own, written by any of the instance's processes: whichever looks first applies a slot's
 * newest reading, so a reading that lowers a sleeping process's charge frees the room for its
 * siblings at once (docs/memory.md, "The driver's own memory"). Valid for the slot's taking whose
 * claim it carries (another: as if empty). `lock`: the pid applying a reading now (0: none; taken
 * by compare-and-swap, never waited for; a dead holder's is taken over). */
struct cgpu_follow {
    uint32_t lock;
    uint32_t applied;      /* the seq of the slot's reading applied last */
    uint64_t claim;        /* the slot's claim this is for */
    uint32_t read_before;  /* bit g: a reading was applied on GPU g (the next one's growth is a step) */
    uint32_t reserved;
    uint64_t last_want[CGPU_MAX_GPUS];  /* the driver's own memory the last applied reading said */
};

struct cgpu_usage_follow {
    struct cgpu_follow procs[CGPU_MAX_PROCS];  /* per slot of struct cgpu_usage's procs */
};

#endif
