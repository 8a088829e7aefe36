/*
 * libcgpu-switch.so: a container's pages as the daemon holds them (switch/page.c), shared with the
 * switcher threads (switch/cgpu-switch.c). Internal to the library (hidden); EXPORT: the ctypes
 * interface (cgpud/sched/native.py).
 */
#ifndef CGPU_SWITCH_PAGE_H
#define CGPU_SWITCH_PAGE_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "../libcgpu/cgpu_page.h"

#define EXPORT __attribute__((visibility("default")))

/* The usage page is never mapped here: the file is writable from the container (its mount of the
 * pages' directory is read-write), and a mapping of a file cut short behind our back is a SIGBUS in
 * the daemon at the next access. Every read of it is a pread, and a short one, a foreign head or
 * a file that is no longer the one the name says marks the page damaged: from then on nothing of
 * it is read (its processes' queued work is not waited for, its GPU time is not known: its
 * instance is charged the time its gate is open) until the page is opened again (docs/isolation.md,
 * "The pages"). The limits page is mapped (the gates' futexes need it): the container's mount of it
 * is read-only, and a mount point, so no process of the container can cut it or replace it. */
struct page {
    pthread_mutex_t mu;
    int refs;
    struct cgpu_limits *lim;
    size_t lim_size;
    int per_gpu;                 /* the page has a gate per GPU (else: the container's one gate) */
    int dir;                     /* the pages' directory (O_PATH): where `usage` must name the file we read */
    int usage_fd;                /* the usage file (read with pread; its processes' locks: who is alive) */
    off_t usage_size;            /* its size when opened: a page made by an older cgpud ends earlier */
    off_t busy_at;               /* where the GPU time of each slot's process starts in it (0: an older cgpud's page) */
    char damage[320];            /* why the usage page is not read any more ("": it is whole) */
    int damage_told;             /* cg_page_damage has said so */
    char distrust[320];          /* why its GPU time count is not believed (the daemon's check, cg_page_distrust;
                                    "": it is): from then on its instance is charged the time its gate is open */
    struct cgpu_proc *procs;     /* (a buffer for the slots read at once) */
    int fifo, keep;              /* the drained FIFO: our read end, and a writer of our own */
    int64_t drain_mean_ns;       /* how long its drains last (a running mean, for SWITCH_AHEAD) */
    int gpus[CGPU_MAX_GPUS];     /* the node GPU of each page GPU */
    int ngpus_known;             /* how many of gpus[] are known (0: none) */
    int drives;                  /* per-GPU gates driven one node GPU at a time */
    uint32_t closed[CGPU_MAX_GPUS];  /* page GPU k closed: the count of closings its closing made */
    uint32_t closed_mask;
    int frozen;
    uint32_t gang_ready;         /* page GPUs whose switcher waits to open it (a gang's turns aligned: align_gang) */
    uint32_t gang_leaving;       /* page GPUs whose switcher waits to close it, its turn there over (align_gang) */
    uint8_t stale[CGPU_MAX_PROCS];   /* a slot given up on: its pid, and the closing it was given up at */
    int32_t stale_pid[CGPU_MAX_PROCS];
    uint32_t stale_acked[CGPU_MAX_PROCS];
    unsigned strikes;            /* slots given up on alive (not answering, or draining past the cap) */
    int64_t strike_at[3];        /* when the last three were (page.c, STRIKES) */
    int hold_fd;                 /* its cgroup's freeze file, once a process of it used the GPU outside the
                                    library (cg_page_hold; -1: none): frozen whenever a gate of it is closed */
    char hold_on[16], hold_off[16];
};

/* The page's GPUs, and those a freeze or thaw of node GPU `gpu` (-1: all) is about, as a mask. */
unsigned ngpus(struct page *p);
uint32_t ks(struct page *p, int gpu);
/* Its gates closed or opened on node GPU `gpu` (-1: all), and whether closed there; with p->mu held. */
void freeze_locked(struct page *p, int gpu);
void thaw_locked(struct page *p, int gpu);
int closed_on_locked(struct page *p, int gpu);
/* A damaged page's closing: waited for this long, its queued work not asked about (0: read). */
int64_t blind_ns(struct page *p);

EXPORT void cg_page_ref(struct page *p);
EXPORT void cg_page_release(struct page *p);
EXPORT void cg_page_thaw(struct page *p, int gpu);
EXPORT int64_t cg_page_gpu_ns(struct page *p, int gpu);
EXPORT int cg_page_undrained(struct page *p, int gpu, int *out, int max);
EXPORT int cg_page_give_up(struct page *p, int gpu, int all, int *out, int *why, int max);
EXPORT void cg_page_consume(struct page *p);

/* Why a slot that has not answered is not waited for (cg_page_give_up's `why`). */
enum { WAITING = 0, DEAD = 1, STOPPED = 2, SILENT = 3, TOO_LONG = 4, FORGED = 5 };
#endif
