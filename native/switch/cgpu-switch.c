/*
 * libcgpu-switch.so: the daemon's native part of the compute gate (docs/isolation.md),
 * loaded by cgpud/sched/native.py through ctypes.
 *
 * 1. Pages. A container's `limits` and `usage` pages and its `drained` FIFO, opened once (the
 *    limits mapped, the usage read with pread: see struct page), shared (counted references)
 *    by the Python GateFreezer that owns the
 *    instance and by the switcher threads that drive its gates. Every operation on a page
 *    takes its lock: the gate words, the count of closings, which of its GPUs' gates are
 *    closed and with which closing, and the processes given up on.
 *
 * 2. The switcher. One thread per GPU carries out a batch of steps the scheduler (trio,
 *    cgpud/sched/loop.py) planned: at each step it closes the gates of the instances that
 *    must stop, waits (bounded) until their processes have drained the work they queued,
 *    opens the gate of the one that runs, and sleeps to the step's end. The switch is then
 *    three futex wakes and a poll, not a trio wake-up and the Python between; and trio
 *    wakes once a batch, not once a slice. A step's times are reported back: the scheduler
 *    charges what really happened.
 *
 * Nothing here decides who runs: it only does, at the times it is told, what it is told.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../libcgpu/cgpu_page.h"

#define EXPORT __attribute__((visibility("default")))
enum { SWITCH_DRAIN = 0, SWITCH_AHEAD = 1, SWITCH_OVERLAP = 2 };
#define GATED_PER_GPU 2u

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void wake_all(uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

/* ---- pages ------------------------------------------------------------------------------ */

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
    int strikes;                 /* slots given up on alive (not answering, or draining past the cap) */
    int hold_fd;                 /* its cgroup's freeze file, once a process of it used the GPU outside the
                                    library (cg_page_hold; -1: none): frozen whenever a gate of it is closed */
    char hold_on[16], hold_off[16];
};

/* Give-ups of a live process (alive and not answering, or draining past the cap) that make a page
 * damaged: libcgpu answers every closing within its drain bound, so a page whose slots keep the
 * gate waiting so is forged (docs/security.md, "Pages"): its queued work is then not waited for. */
#define STRIKES 3

/* The usage page's head as the daemon reads it (struct cgpu_usage up to its slots). */
struct usage_head {
    uint32_t magic, version;
    uint64_t used[CGPU_MAX_GPUS];
    uint32_t gated_slots[CGPU_MAX_PROCS / 32];
};
_Static_assert(offsetof(struct usage_head, gated_slots) == offsetof(struct cgpu_usage, gated_slots)
               && sizeof(struct usage_head) <= offsetof(struct cgpu_usage, procs), "struct usage_head");

/* Where slot `slot`'s struct cgpu_proc starts in the usage page. */
static off_t slot_at(unsigned slot)
{
    return (off_t)offsetof(struct cgpu_usage, procs) + (off_t)slot * (off_t)sizeof(struct cgpu_proc);
}

/* The usage page is damaged (the first reason stays); with the page's lock held. */
static void damaged_locked(struct page *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void damaged_locked(struct page *p, const char *fmt, ...)
{
    if (p->damage[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->damage, sizeof p->damage, fmt, ap);
    va_end(ap);
}

/* `name` in the directory `dir` (O_PATH), as an O_PATH descriptor, when it is a file of `type`
 * (S_IFREG, S_IFIFO): never a symbolic link, and nothing else is opened at all (a device node the
 * container made there is only looked at). -1, errno set: ELOOP a symbolic link, EINVAL another kind. */
static int at_path(int dir, const char *name, mode_t type)
{
    int at = openat(dir, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (at < 0)
        return -1;
    int e = fstat(at, &st) ? errno : (st.st_mode & S_IFMT) == type ? 0 : S_ISLNK(st.st_mode) ? ELOOP : EINVAL;
    if (e) {
        close(at);
        errno = e;
        return -1;
    }
    return at;
}

/* The file an O_PATH descriptor names, opened with `flags` (the same file, whatever its name names now). */
static int reopen(int at, int flags)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", at);
    return open(path, flags | O_CLOEXEC | O_NOCTTY);
}

static const char *open_error(int e)
{
    return e == ELOOP ? "it is a symbolic link" : e == EINVAL ? "it is not a regular file" : strerror(e);
}

/* Open the pages in `dir`. gpus/n: the node GPU of each page GPU (n 0: none known). On
 * failure NULL, *why says why and *gone is 1 when the pages are not there. A usage page that
 * cannot be read as one opens damaged (cg_page_damage says why): the gates are in the limits page. */
EXPORT struct page *cg_page_open(const char *dir, const int *gpus, int n, char *why, size_t whylen, int *gone)
{
    struct stat st;
    *gone = 0;
    struct page *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(why, whylen, "out of memory");
        return NULL;
    }
    p->fifo = p->keep = p->usage_fd = p->dir = p->hold_fd = -1;
    p->procs = malloc(sizeof(struct cgpu_proc) * CGPU_MAX_PROCS);
    if (!p->procs) {
        snprintf(why, whylen, "out of memory");
        goto fail;
    }
    p->dir = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    int at = p->dir < 0 ? -1 : at_path(p->dir, "limits", S_IFREG);
    int fd = at < 0 ? -1 : reopen(at, O_RDWR);
    if (fd < 0) {
        *gone = errno == ENOENT;
        snprintf(why, whylen, "%s/limits%s%s", dir, *gone ? " is gone" : ": ", *gone ? "" : open_error(errno));
        if (at >= 0) close(at);
        goto fail;
    }
    close(at);
    if (fstat(fd, &st) || (size_t)st.st_size < CGPU_LIMITS_SHARED_GATE) {
        snprintf(why, whylen, "%s/limits is not a cgpud limits page", dir);
        close(fd);
        goto fail;
    }
    p->per_gpu = (size_t)st.st_size >= sizeof(struct cgpu_limits);
    p->lim_size = p->per_gpu ? sizeof(struct cgpu_limits) : CGPU_LIMITS_SHARED_GATE;
    void *m = mmap(NULL, p->lim_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        snprintf(why, whylen, "%s/limits: %s", dir, strerror(errno));
        goto fail;
    }
    p->lim = m;
    uint32_t magic = p->lim->magic;  /* (0: prepared, its memsizes not yet written) */
    if ((magic != CGPU_MAGIC && magic != 0) || p->lim->version != CGPU_VERSION) {
        snprintf(why, whylen, "%s/limits is not a cgpud limits page of version %u", dir, CGPU_VERSION);
        goto fail;
    }
    at = at_path(p->dir, "drained", S_IFIFO);
    if (at >= 0) {
        p->fifo = reopen(at, O_RDONLY | O_NONBLOCK);
        if (p->fifo >= 0)  /* our own writer (of the same FIFO): it never reads as hung up between the processes' writes */
            p->keep = reopen(at, O_WRONLY | O_NONBLOCK);
        close(at);
    }
    if (p->fifo < 0 || p->keep < 0) {
        snprintf(why, whylen, "%s/drained: %s", dir, errno == EINVAL ? "it is not a FIFO" : open_error(errno));
        goto fail;
    }
    at = at_path(p->dir, "usage", S_IFREG);
    p->usage_fd = at < 0 ? -1 : reopen(at, O_RDONLY);
    if (at >= 0) close(at);
    if (p->usage_fd < 0)
        damaged_locked(p, "it cannot be opened: %s", open_error(errno));
    else if (fstat(p->usage_fd, &st) || (size_t)st.st_size < sizeof(struct cgpu_usage))
        damaged_locked(p, "it is %lld bytes, shorter than a usage page (%zu)", (long long)st.st_size,
                       sizeof(struct cgpu_usage));
    else {
        p->usage_size = st.st_size;
        size_t busy_at = sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver);
        if ((size_t)st.st_size >= busy_at + sizeof(struct cgpu_usage_busy))
            p->busy_at = (off_t)busy_at;
    }
    p->ngpus_known = n > 0 && n <= CGPU_MAX_GPUS ? n : 0;
    for (int k = 0; k < p->ngpus_known; k++)
        p->gpus[k] = gpus[k];
    p->drives = p->per_gpu && p->ngpus_known > 0;
    pthread_mutex_init(&p->mu, NULL);
    p->refs = 1;
    return p;
fail:  /* (what was opened or mapped so far) */
    if (p->fifo >= 0) close(p->fifo);
    if (p->keep >= 0) close(p->keep);
    if (p->dir >= 0) close(p->dir);
    if (p->lim) munmap(p->lim, p->lim_size);
    free(p->procs);
    free(p);
    return NULL;
}

EXPORT void cg_page_ref(struct page *p)
{
    __atomic_add_fetch(&p->refs, 1, __ATOMIC_ACQ_REL);
}

EXPORT void cg_page_release(struct page *p)
{
    if (!p || __atomic_sub_fetch(&p->refs, 1, __ATOMIC_ACQ_REL))
        return;
    close(p->fifo);
    close(p->keep);
    if (p->usage_fd >= 0)
        close(p->usage_fd);
    if (p->hold_fd >= 0)
        close(p->hold_fd);
    close(p->dir);
    munmap(p->lim, p->lim_size);
    free(p->procs);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

EXPORT int cg_page_per_gpu(struct page *p) { return p->per_gpu; }
EXPORT int cg_page_drives(struct page *p) { return p->drives; }
EXPORT int cg_page_fifo(struct page *p) { return p->fifo; }

static uint32_t load(const uint32_t *w) { return __atomic_load_n(w, __ATOMIC_SEQ_CST); }
static void store(uint32_t *w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_SEQ_CST); }

/* The page's GPUs (read each time: a prepared page learns them when it is filled). */
static unsigned ngpus(struct page *p)
{
    unsigned n = load(&p->lim->ngpus);
    return n < 1 ? 1 : n > CGPU_MAX_GPUS ? CGPU_MAX_GPUS : n;
}

/* The page GPUs a freeze or thaw of node GPU `gpu` (-1: all) is about, as a mask. */
static uint32_t ks(struct page *p, int gpu)
{
    if (gpu < 0 || !p->drives)
        return (uint32_t)((1ull << ngpus(p)) - 1);
    for (int k = 0; k < p->ngpus_known; k++)
        if (p->gpus[k] == gpu)
            return 1u << k;
    return 0;
}

static void open_gate(uint32_t *w)
{
    uint32_t g = load(w);
    if (!(g & 1))
        store(w, g + 1);
    wake_all(w);  /* (also when it was open: a waiter that read an old value wakes and looks again) */
}

/* The instance's cgroup frozen (on) or thawed, where it is held so (cg_page_hold). */
static void hold_locked(struct page *p, int on)
{
    const char *v = on ? p->hold_on : p->hold_off;
    if (p->hold_fd >= 0 && pwrite(p->hold_fd, v, strlen(v), 0) < 0) { /* (its cgroup gone: its processes too) */ }
}

static void freeze_locked(struct page *p, int gpu)
{
    /* The container's gate first: a helper thread woken by the count of closings below must find
     * it closed, or a gang's launches on its other GPUs could pass it in between (libcgpu/gate.c) */
    uint32_t g = load(&p->lim->gate);
    if (g & 1) {
        store(&p->lim->gate, g + 1);
        wake_all(&p->lim->gate);  /* the helper threads of an older libcgpu: drain and answer */
    }
    if (p->per_gpu) {
        uint32_t m = ks(p, gpu);
        for (unsigned k = 0; k < CGPU_MAX_GPUS; k++) {
            if (!(m >> k & 1))
                continue;
            uint32_t g = load(&p->lim->gpu_gate[k]);
            if (g & 1)
                store(&p->lim->gpu_gate[k], g + 1);
            if (!(p->closed_mask >> k & 1)) {  /* count one more closing; it wakes the helper threads */
                uint32_t c = load(&p->lim->closings) + 1;
                store(&p->lim->closings, c);
                wake_all(&p->lim->closings);
                p->closed[k] = c;
                p->closed_mask |= 1u << k;
            }
        }
    }
    p->frozen = 1;
    hold_locked(p, 1);
}

static void thaw_locked(struct page *p, int gpu)
{
    if (p->per_gpu) {
        uint32_t m = ks(p, gpu);
        for (unsigned k = 0; k < CGPU_MAX_GPUS; k++)
            if (m >> k & 1) {
                p->closed_mask &= ~(1u << k);
                p->gang_ready &= ~(1u << k);
                open_gate(&p->lim->gpu_gate[k]);
            }
    }
    if (!p->closed_mask) {
        open_gate(&p->lim->gate);
        hold_locked(p, 0);
    }
    p->frozen = p->closed_mask != 0;
}

/* Close the container's gate on node GPU `gpu` (-1, or a page that is not driven per GPU: all). */
EXPORT void cg_page_freeze(struct page *p, int gpu)
{
    pthread_mutex_lock(&p->mu);
    freeze_locked(p, gpu);
    pthread_mutex_unlock(&p->mu);
}

EXPORT void cg_page_thaw(struct page *p, int gpu)
{
    pthread_mutex_lock(&p->mu);
    thaw_locked(p, gpu);
    pthread_mutex_unlock(&p->mu);
}

/* The daemon's drain bound (µs), which the container's libcgpu answers a closing within (three
 * quarters of it: docs/isolation.md, "The drain bound"). */
EXPORT void cg_page_bound(struct page *p, uint32_t bound_us)
{
    pthread_mutex_lock(&p->mu);
    if (load(&p->lim->drain_bound_us) != bound_us)
        store(&p->lim->drain_bound_us, bound_us);
    pthread_mutex_unlock(&p->mu);
}

/* Whether another instance is active on node GPU `gpu` (-1: all the page's GPUs) now: the page's
 * `shared` bits, which bound the container's queued work there to `budget_us` (libcgpu/gate.c). */
EXPORT void cg_page_share(struct page *p, int gpu, int on, uint32_t budget_us)
{
    if (!p->per_gpu)
        return;  /* (an older cgpud's page: its library bounds nothing) */
    pthread_mutex_lock(&p->mu);
    uint32_t m = ks(p, gpu), bits = load(&p->lim->shared);
    store(&p->lim->queue_budget_us, budget_us);
    store(&p->lim->shared, on ? bits | m : bits & ~m);
    pthread_mutex_unlock(&p->mu);
}

EXPORT int cg_page_frozen(struct page *p)
{
    pthread_mutex_lock(&p->mu);
    int f = p->frozen;
    pthread_mutex_unlock(&p->mu);
    return f;
}

/* Whether node GPU `gpu`'s gate is closed (a page not driven per GPU: whether it is frozen). */
static int closed_on_locked(struct page *p, int gpu)
{
    if (!p->drives)
        return p->frozen;
    uint32_t m = ks(p, gpu);
    return m && (p->closed_mask & m) == m;
}

EXPORT int cg_page_closed_on(struct page *p, int gpu)
{
    pthread_mutex_lock(&p->mu);
    int c = closed_on_locked(p, gpu);
    pthread_mutex_unlock(&p->mu);
    return c;
}

/* `acked` answers a closing older than `closing` (counts that wrap). */
static int before(uint32_t acked, uint32_t closing)
{
    return (uint32_t)(acked - closing) >= 0x80000000u;
}

/* A slot's head (struct cgpu_proc's first fields), as read. */
struct head {
    int32_t pid;
    uint32_t gated, acked, gpus;
};

/* A read of the usage page came up short (`got` bytes; -1: an error). With the page's lock held. */
static void cut_locked(struct page *p, ssize_t got)
{
    int e = errno;
    struct stat st;
    if (got < 0)
        damaged_locked(p, "it cannot be read: %s", strerror(e));
    else if (!fstat(p->usage_fd, &st))
        damaged_locked(p, "it was cut to %lld bytes (%lld when the daemon opened it)", (long long)st.st_size,
                       (long long)p->usage_size);
    else
        damaged_locked(p, "it was cut short");
}

/* The launching processes of the usage page (its gated_slots): their slots into slots[] and their
 * heads into heads[] (CGPU_MAX_PROCS each), read with pread; their count, or -1 when the page is
 * damaged (found so now or before: nothing of it is read). With the page's lock held. */
static int gated_locked(struct page *p, unsigned *slots, struct head *heads)
{
    if (p->damage[0])
        return -1;
    struct usage_head h;
    ssize_t got = pread(p->usage_fd, &h, sizeof h, 0);
    if (got != (ssize_t)sizeof h)
        return cut_locked(p, got), -1;
    if (h.magic != CGPU_MAGIC || h.version != CGPU_VERSION) {
        damaged_locked(p, "its head is not a usage page's (magic 0x%08x, version %u)", h.magic, h.version);
        return -1;
    }
    int n = 0;
    for (unsigned w = 0; w < CGPU_MAX_PROCS / 32; w++)
        for (uint32_t bits = h.gated_slots[w]; bits; bits &= bits - 1)
            slots[n++] = w * 32 + (unsigned)__builtin_ctz(bits);
    if (!n)
        return 0;
    /* their slots in one read, from the first to the last (libcgpu takes the first free ones) */
    size_t len = (size_t)(slots[n - 1] - slots[0] + 1) * sizeof(struct cgpu_proc);
    got = pread(p->usage_fd, p->procs, len, slot_at(slots[0]));
    if (got != (ssize_t)len)
        return cut_locked(p, got), -1;
    for (int i = 0; i < n; i++) {
        const struct cgpu_proc *s = &p->procs[slots[i] - slots[0]];
        heads[i] = (struct head){s->pid, s->gated, s->acked, s->gpus};
    }
    return n;
}

/* The slots of launching processes that have not drained the current closing (of node GPU
 * `gpu`'s gate; -1: of any), leaving out those given up on; written to out[max] (and their heads
 * to hout[max], when given), counted. A damaged page has none. */
static int undrained_locked(struct page *p, int gpu, int *out, struct head *hout, int max)
{
    uint32_t shared = load(&p->lim->gate);
    uint32_t closing = gpu < 0 || !p->drives ? p->closed_mask : p->closed_mask & ks(p, gpu);
    if ((shared & 1) && !closing)
        return 0;
    unsigned slots[CGPU_MAX_PROCS];
    struct head hs[CGPU_MAX_PROCS];
    int g = gated_locked(p, slots, hs), n = 0;
    for (int i = 0; i < g; i++) {
        unsigned slot = slots[i];
        struct head h = hs[i];
        if (h.pid <= 0)
            continue;
        /* Given up on: waited for again once it has answered the closing it was given up at (or a later
         * one), or is another process; only the daemon sets and clears this mark. A slot that merely
         * changes its `acked` (a forger kept just behind the gate) stays given up on. */
        if (p->stale[slot] && (!before(h.acked, p->stale_acked[slot]) || p->stale_pid[slot] != h.pid))
            p->stale[slot] = 0;
        if (p->stale[slot])
            continue;
        if (h.gated == GATED_PER_GPU) {
            int wait = 0;
            for (unsigned k = 0; k < CGPU_MAX_GPUS && !wait; k++)
                wait = (closing >> k & 1) && (h.gpus >> k & 1) && before(h.acked, p->closed[k]);
            if (!wait)
                continue;
        } else if (!h.gated || (shared & 1) || h.acked == shared)
            continue;
        if (n < max) {
            if (out)
                out[n] = (int)slot;
            if (hout)
                hout[n] = h;
        }
        n++;
    }
    return n;
}

#define GPU_NS_MAX (1ull << 62)  /* more GPU time than any process can have got (146 years) */

/* The GPU time (ns) the page's launching processes got on node GPU `gpu` (-1: all), as libcgpu
 * counts it (docs/scheduler.md, "The charge"): the sum of their slots' counters, to be read as a
 * difference. -1: not known — an older cgpud's page, no launching process, one whose library does
 * not count, or a damaged page (then its instance is charged the time its gate was open). */
static int64_t gpu_ns_locked(struct page *p, int gpu)
{
    if (!p->busy_at || p->distrust[0])
        return -1;
    unsigned slots[CGPU_MAX_PROCS];
    struct head hs[CGPU_MAX_PROCS];
    int n = gated_locked(p, slots, hs);
    uint32_t mask = ks(p, gpu);
    int64_t sum = 0;
    int timed = 0;
    for (int i = 0; i < n; i++) {
        if (hs[i].pid <= 0)
            continue;
        struct cgpu_busy b;
        ssize_t got = pread(p->usage_fd, &b, sizeof b, p->busy_at + (off_t)(slots[i] * sizeof b));
        if (got != (ssize_t)sizeof b)
            return cut_locked(p, got), -1;
        if (!b.timed || b.pid != hs[i].pid)
            return -1;
        timed = 1;
        for (unsigned k = 0; k < CGPU_MAX_GPUS; k++)
            if (mask >> k & 1) {
                if (b.ns[k] > GPU_NS_MAX || __builtin_add_overflow(sum, (int64_t)b.ns[k], &sum)) {
                    damaged_locked(p, "slot %u's GPU time count is %llu ns on its GPU %u, more than its processes "
                                   "can have got", slots[i], (unsigned long long)b.ns[k], k);
                    return -1;
                }
            }
    }
    return timed ? sum : -1;
}

/* The daemon found the page's GPU time count below what it measures itself (cgpud/sched/gputime.py,
 * ChargeCheck: NVML's per-process utilisation): from now on the count is not read (cg_page_gpu_ns
 * -1: its instance is charged the time its gate is open) until the page is opened again. The rest
 * of the page is read as before (its processes' drains are still waited for). 1 the first time. */
EXPORT int cg_page_distrust(struct page *p, const char *why)
{
    pthread_mutex_lock(&p->mu);
    int first = !p->distrust[0];
    if (first)
        snprintf(p->distrust, sizeof p->distrust, "%s", why && *why ? why : "not believed");
    pthread_mutex_unlock(&p->mu);
    return first;
}

EXPORT int64_t cg_page_gpu_ns(struct page *p, int gpu)
{
    pthread_mutex_lock(&p->mu);
    int64_t ns = gpu_ns_locked(p, gpu);
    pthread_mutex_unlock(&p->mu);
    return ns;
}

/* Look at the usage page's file again (cut shorter than it was when opened, or its name no
 * longer naming the file read here: replaced) and say why the page is damaged, once: 1 with the
 * reason in why[len] the first time it is asked after the page was found damaged, else 0. */
EXPORT int cg_page_damage(struct page *p, char *why, size_t len)
{
    pthread_mutex_lock(&p->mu);
    struct stat mine, named;
    if (!p->damage[0] && !fstat(p->usage_fd, &mine)) {
        if (mine.st_size < p->usage_size)
            damaged_locked(p, "it was cut to %lld bytes (%lld when the daemon opened it)", (long long)mine.st_size,
                           (long long)p->usage_size);
        else if (!fstatat(p->dir, "usage", &named, AT_SYMLINK_NOFOLLOW)
                 && (named.st_ino != mine.st_ino || named.st_dev != mine.st_dev))
            damaged_locked(p, "it was replaced by another %s", S_ISREG(named.st_mode) ? "file" : "kind of file");
        /* (gone: its instance is being removed, or will not find it; the file read here stays as it was) */
    }
    int tell = p->damage[0] && !p->damage_told;
    if (tell) {
        snprintf(why, len, "%s", p->damage);
        p->damage_told = 1;
    }
    pthread_mutex_unlock(&p->mu);
    return tell;
}

/* Whether process `pid` (the daemon's PID namespace) holds the lock of a slot of the page: it runs
 * libcgpu with a live slot, as the kernel says (the lock's holder), not as the page does. */
EXPORT int cg_page_holds(struct page *p, int pid)
{
    pthread_mutex_lock(&p->mu);
    int found = 0;
    for (unsigned slot = 0; p->usage_fd >= 0 && slot < CGPU_MAX_PROCS && !found; slot++) {
        struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot_at(slot), .l_len = 1};
        found = fcntl(p->usage_fd, F_GETLK, &l) == 0 && l.l_type != F_UNLCK && l.l_pid == pid;
    }
    pthread_mutex_unlock(&p->mu);
    return found;
}

/* A process of the instance uses the GPU outside the library (no gate holds it): from now on its
 * cgroup is frozen whenever a gate of the page is closed (the freeze file `fd`, the values `on` and
 * `off` written to it: cgroup.freeze's 1 and 0, freezer.state's FROZEN and THAWED), and the page is
 * damaged (`why`): its processes, frozen at a closing, cannot answer it. 1 the first time. */
EXPORT int cg_page_hold(struct page *p, int fd, const char *on, const char *off, const char *why)
{
    pthread_mutex_lock(&p->mu);
    int first = p->hold_fd < 0 && strlen(on) < sizeof p->hold_on && strlen(off) < sizeof p->hold_off;
    if (first && (p->hold_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) >= 0) {
        snprintf(p->hold_on, sizeof p->hold_on, "%s", on);
        snprintf(p->hold_off, sizeof p->hold_off, "%s", off);
        damaged_locked(p, "%s", why && *why ? why : "a process of it uses the GPU outside the library");
        if (p->frozen)
            hold_locked(p, 1);
    } else
        first = 0;
    pthread_mutex_unlock(&p->mu);
    return first;
}

EXPORT int cg_page_undrained(struct page *p, int gpu, int *out, int max)
{
    pthread_mutex_lock(&p->mu);
    int n = undrained_locked(p, gpu, out, NULL, max);
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* Why a slot that has not answered is not waited for (cg_page_give_up's `why`). */
enum { WAITING = 0, DEAD = 1, STOPPED = 2, SILENT = 3, TOO_LONG = 4, FORGED = 5 };

/* Does process `pid` read the boot clock this process does (its time namespace is ours)? Its
 * /proc/<pid>/stat start time is then comparable with what its libcgpu recorded. */
static int same_clock(pid_t pid)
{
    char path[64];
    struct stat a, b;
    snprintf(path, sizeof path, "/proc/%d/ns/time", (int)pid);
    if (stat("/proc/self/ns/time", &a) || stat(path, &b))
        return errno == ENOENT && access("/proc/self/ns/time", F_OK) != 0;  /* (a kernel without time namespaces) */
    return a.st_ino == b.st_ino && a.st_dev == b.st_dev;
}

/* The state of the process holding slot `slot`'s lock (libcgpu/drain.c): DEAD (none holds it: the
 * process is gone), STOPPED (its holder is stopped or traced), FORGED (the lock is not a process's
 * POSIX lock the kernel names: an open file description's lock, F_GETLK's l_pid -1, or 0, a holder
 * outside the daemon's PID namespace — libcgpu's helper takes a POSIX lock, and the daemon sees the
 * host's PIDs), else WAITING (alive). A page whose usage file cannot be asked: alive. */
static int holder_state(struct page *p, unsigned slot)
{
    if (p->usage_fd < 0)
        return WAITING;
    struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                      .l_start = slot_at(slot),
                      .l_len = 1};
    if (fcntl(p->usage_fd, F_GETLK, &l) < 0)
        return WAITING;
    if (l.l_type == F_UNLCK)
        return DEAD;
    if (l.l_pid <= 0)
        return FORGED;  /* (an OFD lock: -1; a holder outside the daemon's PID namespace: 0) */
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)l.l_pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? DEAD : WAITING;  /* (gone since the kernel named it) */
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return WAITING;
    buf[n] = 0;
    const char *paren = strrchr(buf, ')');  /* "pid (comm) S ...": the state after the command's name */
    char st = paren && paren[1] == ' ' ? paren[2] : '?';
    if (st == 'Z' || st == 'X')
        return DEAD;
    /* The holder's pid was asked a moment ago: the process read now is the slot's only if it started
     * when the slot says (cgpu_page.h, struct cgpu_ident), else that pid is another's now (a reused
     * pid is never waited for). (Where its clock of boot is not ours, its record cannot be compared.) */
    const char *at = paren;
    for (int field = 2; at && field < 22; field++)
        at = strchr(at + 1, ' ');
    struct cgpu_ident id;
    off_t id_at = (off_t)(sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver) + sizeof(struct cgpu_usage_busy)
                          + sizeof(struct cgpu_usage_gang) + slot * sizeof(struct cgpu_ident));
    if (at && p->usage_size >= id_at + (off_t)sizeof id && same_clock(l.l_pid)
        && pread(p->usage_fd, &id, sizeof id, id_at) == (ssize_t)sizeof id && id.start
        && strtoull(at + 1, NULL, 10) != id.start)
        return DEAD;
    return st == 'T' || st == 't' ? STOPPED : WAITING;
}

/* The closing a slot that has not drained waits to answer (the latest of its closed GPUs'; an
 * older library's: the shared gate word it must ack). */
static uint32_t awaited_locked(struct page *p, const struct head *h)
{
    if (h->gated != GATED_PER_GPU)
        return load(&p->lim->gate);
    uint32_t c = 0;
    int any = 0;
    for (unsigned k = 0; k < CGPU_MAX_GPUS; k++)
        if ((p->closed_mask >> k & 1) && (h->gpus >> k & 1) && (!any || before(c, p->closed[k])))
            c = p->closed[k], any = 1;
    return c;
}

/* Give up on the undrained slots that cannot answer: the dead, the stopped, the forged and (a
 * process alive whose helper thread is not draining) the silent; with `all`, every one (a drain
 * past its cap). Those given up on are not waited for again until they answer the closing they
 * were given up at. A forged slot, or the STRIKES-th live process given up on, makes the page
 * damaged: nothing of it is read from then on, so what it says holds nobody's gate again (a
 * closing waits for it one drain bound at most, STRIKES times in the page's life). Returns how
 * many; their slots and reasons in out/why[max]. */
static int give_up_locked(struct page *p, int gpu, int all, int *out, int *why, int max)
{
    int slots[CGPU_MAX_PROCS];
    struct head hs[CGPU_MAX_PROCS];
    int n = undrained_locked(p, gpu, slots, hs, CGPU_MAX_PROCS), given = 0;
    for (int i = 0; i < n && i < CGPU_MAX_PROCS; i++) {
        int w = holder_state(p, (unsigned)slots[i]);
        struct cgpu_proc now;  /* (its draining bit as it is after the look at its holder: it may have just begun) */
        if (w == WAITING && pread(p->usage_fd, &now, sizeof now, slot_at((unsigned)slots[i])) == (ssize_t)sizeof now
            && now.pid == hs[i].pid)
            hs[i].gpus = now.gpus;
        if (w == WAITING)
            w = !(hs[i].gpus & CGPU_PROC_DRAINING) ? SILENT : all ? TOO_LONG : WAITING;
        if (w == WAITING)
            continue;  /* alive and draining: waited for */
        if (w == FORGED)
            damaged_locked(p, "slot %d is forged: the lock on it is no live process's (%s)", slots[i],
                           "an open file description's lock, or a holder outside the daemon's PID namespace");
        else if ((w == SILENT || w == TOO_LONG) && ++p->strikes >= STRIKES)
            damaged_locked(p, "%d of its slots kept a closing waiting past the drain bound, alive (the last slot "
                           "%d: %s): libcgpu answers within it", p->strikes, slots[i],
                           w == SILENT ? "not draining" : "draining on");
        p->stale[slots[i]] = 1;
        p->stale_pid[slots[i]] = hs[i].pid;
        p->stale_acked[slots[i]] = awaited_locked(p, &hs[i]);
        if (given < max) {
            if (out)
                out[given] = slots[i];
            if (why)
                why[given] = w;
        }
        given++;
    }
    return given;
}

/* Past the bound: give up on the undrained slots that cannot answer (see give_up_locked; `all`:
 * on every one). The others are alive and draining. */
EXPORT int cg_page_give_up(struct page *p, int gpu, int all, int *out, int *why, int max)
{
    pthread_mutex_lock(&p->mu);
    int n = give_up_locked(p, gpu, all, out, why, max);
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* Empty the FIFO (its bytes only wake us; the page says who drained), up to a pipe's default
 * 64 KiB a call: a container's process that keeps it full cannot hold the caller here (what is
 * left wakes it again, and each wait is bounded on its own). */
EXPORT void cg_page_consume(struct page *p)
{
    char buf[4096];
    for (int i = 0; i < 16 && read(p->fifo, buf, sizeof buf) == (ssize_t)sizeof buf; i++)
        ;
}

/* ---- the switcher ------------------------------------------------------------------------ */

#define NOTIFY 1u  /* step flag: tell the scheduler when this step starts */

struct step {
    int64_t len_ns;   /* how long it lasts from the moment its gate opens */
    int32_t run;      /* the universe index of the instance that runs (-1: nobody) */
    uint32_t flags;
};

struct report {
    /* its switch began (the step before it was due to end), its gate opened, it ended (0: not yet):
     * a step is in force from its start to the next one's start (its queued work drains meanwhile) */
    int64_t begin, start, end;
    int64_t owned;              /* when the card was its own: its start, or (a gate opened ahead) the drain before it done */
    int64_t drained;            /* when its queued work was done (the next switch's closing answered;
                                 * its end when that closed nothing): what is charged to it ends here,
                                 * the rest of the switch (opening the next gate) is nobody's */
    int64_t drain_ns;           /* of the switch: waiting for the stopped instances' queued work */
    int64_t late_ns;            /* how late it ended, past its due time */
    int32_t batch, step;        /* which step of which batch */
    int32_t gave_up;            /* the universe index of an instance not waited for past the bound (-1) */
    int32_t closed;             /* how many gates its switch closed */
    int32_t why;                /* why `gave_up` was given up on: DEAD, STOPPED, SILENT or TOO_LONG */
    int32_t longer;             /* how many times the bound passed while a live process drained on */
    int32_t run;                /* the universe index of its runner (-1: nobody) */
    int64_t gpu_ns;             /* the GPU time its runner's processes got from its start to `drained` (-1: not known) */
    int64_t gpu_at;             /* (the runner's count at its start: -1 not known) */
    const struct page *runner;  /* (its runner's page, to know it again in the next batch) */
};

struct batch {
    int32_t id;
    int nuni;
    struct page **uni;  /* the gated instances of this GPU (a reference each) */
    uint8_t *active;    /* which of them use the GPU: those not running are held at their gate */
    int nsteps;
    struct step *steps;
};

#define REPORTS 1024

struct sw {
    pthread_t thread;
    pthread_mutex_t mu;
    int gpu;
    int64_t bound_ns, cap_ns;  /* a drain: who cannot answer is given up on after bound_ns; who drains, after cap_ns */
    int mode;                  /* when the next gate opens: SWITCH_DRAIN, SWITCH_AHEAD or SWITCH_OVERLAP */
    int64_t lead_ns;           /* SWITCH_AHEAD: how long before the drain's expected end */
    int64_t align_ns;          /* a gang's turns aligned: the step in force runs on at most this long (0: not) */
    struct page *running;      /* the runner of the step in force (NULL: nobody, or none in force) */
    const struct page *running_next;  /* the runner of the step after it, where its batch says (NULL: not known) */
    int64_t running_until;     /* when the step in force is due to end (0: not known yet) */
    int policy;                /* the scheduling policy and priority of the daemon's thread that made it */
    struct sched_param param;
    int cmd;                  /* eventfd: the scheduler has something for the thread */
    int note;                 /* eventfd: the thread has something for the scheduler */
    struct batch *cur, *next; /* the batch being carried out, and the one after it */
    int pos;                  /* the step of `cur` carried out now (-1: none yet) */
    int cancel, stopping, idle;
    struct report reports[REPORTS];
    unsigned head, tail;      /* reports [tail, head) not taken yet; the last one may still be open */
};

static void free_batch(struct batch *b)
{
    if (!b) return;
    for (int i = 0; i < b->nuni; i++)
        cg_page_release(b->uni[i]);
    free(b->uni);
    free(b->active);
    free(b->steps);
    free(b);
}

static void notify(struct sw *s)
{
    uint64_t one = 1;
    if (write(s->note, &one, sizeof one) < 0) { /* (a counter: it cannot fill up in practice) */ }
}

static void drain_fd(int fd)
{
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0) { /* (nonblocking: nothing there) */ }
}

/* Sleep until `until` (CLOCK_MONOTONIC ns) or until the scheduler writes `cmd`. */
static void sleep_or_cmd(struct sw *s, int64_t until)
{
    int64_t left = until - now_ns();
    if (left <= 0)
        return;
    struct timespec t = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
    struct pollfd pf = {.fd = s->cmd, .events = POLLIN};
    if (ppoll(&pf, 1, until == INT64_MAX ? NULL : &t, NULL) > 0)
        drain_fd(s->cmd);
}

/* Wait until the pages `uni[i]` for i in `which` have drained node GPU `gpu`'s closing. Each
 * time the bound passes, who cannot answer is given up on (dead, stopped, or alive and not
 * draining: cg_page_give_up); a live process that drains is waited for on, up to the cap from
 * `begin` (then given up on too, and the wait ends whatever the pages say). Returns the first index given up on (-1: none), *why its reason,
 * and *longer how many times the bound passed while someone drained on. */
static void open_others(struct sw *s, struct batch *b, int run);

static int wait_drained(struct sw *s, struct batch *b, const int *which, int n, int64_t begin, int *why, int *longer,
                        int64_t open_at, int run, int64_t *opened)
{
    struct pollfd pf[CGPU_MAX_PROCS + 1];
    int idx[CGPU_MAX_PROCS];
    int64_t deadline = begin + s->bound_ns, cap = begin + s->cap_ns;
    int late = -1;
    *why = 0;
    *longer = 0;
    for (;;) {
        int m = 0, shared = 0;
        for (int i = 0; i < n && m < CGPU_MAX_PROCS; i++) {
            struct page *p = b->uni[which[i]];
            if (cg_page_undrained(p, s->gpu, NULL, 0) > 0) {
                pf[m] = (struct pollfd){.fd = p->fifo, .events = POLLIN};
                idx[m++] = which[i];
                shared |= p->drives && ngpus(p) > 1;  /* another GPU's switcher may take its FIFO's byte */
            }
        }
        if (!m)
            return late;
        int64_t now = now_ns();
        if (!*opened && now >= open_at) {  /* (the next gate, ahead of the drain's end) */
            open_others(s, b, run);
            *opened = now = now_ns();
        }
        if (now >= deadline) {
            int waiting = 0;
            for (int i = 0; i < m; i++) {
                int slots[1], w[1];
                if (cg_page_give_up(b->uni[idx[i]], s->gpu, now >= cap, slots, w, 1) > 0 && late < 0) {
                    late = idx[i];
                    *why = w[0];
                }
                waiting |= cg_page_undrained(b->uni[idx[i]], s->gpu, NULL, 0) > 0;
            }
            if (!waiting || now >= cap)  /* (past the cap, nobody: a slot whose values keep changing cannot hold it on) */
                return late;
            (*longer)++;  /* alive and draining: on, one more bound */
            deadline = now + s->bound_ns;
            continue;
        }
        int64_t left = deadline - now;
        if (shared && left > 1000000)
            left = 1000000;  /* (look again every ms) */
        if (!*opened && open_at - now < left)
            left = open_at - now;
        pf[m] = (struct pollfd){.fd = s->cmd, .events = POLLIN};  /* (the daemon stopping) */
        struct timespec t = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        if (ppoll(pf, (nfds_t)m + 1, &t, NULL) > 0) {
            for (int i = 0; i < m; i++)
                if (pf[i].revents)
                    cg_page_consume(b->uni[idx[i]]);
            if (pf[m].revents) {
                drain_fd(s->cmd);
                pthread_mutex_lock(&s->mu);
                int stop = s->stopping;
                pthread_mutex_unlock(&s->mu);
                if (stop)
                    return late;
            }
        }
    }
}

/* The report of the step in force (not ended yet), or NULL; with the switcher's lock held. */
static struct report *open_report_locked(struct sw *s)
{
    struct report *r = s->head != s->tail ? &s->reports[(s->head - 1) % REPORTS] : NULL;
    return r && !r->end ? r : NULL;
}

/* Open everyone else this GPU knows: the runner `run`, and the idle. */
static void open_others(struct sw *s, struct batch *b, int run)
{
    for (int i = 0; i < b->nuni; i++) {
        if (b->active[i] && i != run)
            continue;
        struct page *p = b->uni[i];
        pthread_mutex_lock(&p->mu);
        if (closed_on_locked(p, s->gpu))
            thaw_locked(p, s->gpu);
        pthread_mutex_unlock(&p->mu);
    }
}

/* No step in force any more (a cancel, the end): its runner's reference dropped; with s->mu held
 * (a page's lock is never held while its switcher's is taken). */
static void forget_running(struct sw *s)
{
    struct page *p = s->running;
    s->running = NULL;
    if (p) {
        pthread_mutex_lock(&p->mu);
        p->gang_leaving &= ~ks(p, s->gpu);
        pthread_mutex_unlock(&p->mu);
        cg_page_release(p);
    }
}

/* The switchers of this daemon, by node GPU (a gang's turns are aligned only with a GPU whose
 * switcher carries its slices). */
#define MAX_NODE_GPUS 64
static pthread_mutex_t switchers_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sw *switchers[MAX_NODE_GPUS];

static int carrying(int gpu)
{
    int on = 0;
    pthread_mutex_lock(&switchers_mu);
    struct sw *o = gpu >= 0 && gpu < MAX_NODE_GPUS ? switchers[gpu] : NULL;
    if (o) {
        pthread_mutex_lock(&o->mu);
        on = !o->idle && !o->stopping;
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&switchers_mu);
    return on;
}

/* Whether node GPU `gpu`'s switcher runs `p` in its step in force, and that step ends p's turn
 * there by `by` (the step after it another's, or not known yet): what a turn's end waits for. */
static int ends_on(int gpu, const struct page *p, int64_t by)
{
    int on = 0;
    pthread_mutex_lock(&switchers_mu);
    struct sw *o = gpu >= 0 && gpu < MAX_NODE_GPUS ? switchers[gpu] : NULL;
    if (o) {
        pthread_mutex_lock(&o->mu);
        on = o->running == p && !o->idle && !o->stopping && o->running_next != p && o->running_until
             && o->running_until <= by;
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&switchers_mu);
    return on;
}

/* The end of a gang's turn here, aligned: the step that would close it waits (the gang runs on)
 * while a switcher of another of its GPUs still runs its turn there, due to end it within `align`,
 * and is not ready to end it yet, at most `align` (a gang closed on one GPU is closed on all: the
 * rest of its turn on the others would stand idle, its neighbours held there). A GPU whose plan
 * goes on with the gang (it is alone there) is not waited for: its turn there has no end to meet. */
static void align_gang_end(struct sw *s, struct batch *b, int pos, int64_t align)
{
    const struct step *st = &b->steps[pos];
    pthread_mutex_lock(&s->mu);
    struct page *p = s->running;
    pthread_mutex_unlock(&s->mu);
    if (!p || !p->drives || (st->run >= 0 && st->run < b->nuni && b->uni[st->run] == p))
        return;  /* (nobody ran, no gang, or it runs on) */
    pthread_mutex_lock(&p->mu);
    uint32_t me = ks(p, s->gpu), others = 0;
    int known = p->ngpus_known;
    if (me && !(p->closed_mask & me) && ngpus(p) > 1) {
        for (int k = 0; k < known; k++)
            if (!(me >> k & 1) && !(p->closed_mask >> k & 1))
                others |= 1u << k;
        p->gang_leaving |= me;
    }
    pthread_mutex_unlock(&p->mu);
    int64_t until = now_ns() + align;
    while (others) {
        for (int k = 0; k < known; k++)  /* (moved on, or not ending its turn soon) */
            if (others >> k & 1 && !ends_on(p->gpus[k], p, until))
                others &= ~(1u << k);
        pthread_mutex_lock(&p->mu);
        uint32_t on = others & ~p->gang_leaving & ~p->closed_mask;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_lock(&s->mu);
        int stop = s->cancel || s->stopping;
        pthread_mutex_unlock(&s->mu);
        int64_t now = now_ns();
        if (!on || stop || now >= until)
            return;
        sleep_or_cmd(s, now + 100000 < until ? now + 100000 : until);
    }
}

/* A gang's turns aligned across its GPUs (docs/isolation.md, "Gangs"). A gang (an instance whose
 * gates are driven per GPU, on several) runs only while it holds every GPU it is active on: where
 * each GPU's switcher opened it at its own time, it ran only in the intersection of its turns,
 * and a collective's half queued on one GPU spun until the other GPU's turn came. So before the
 * step that opens a gang, the step in force here runs on (its holder is charged what it ran: the
 * ring pays it back) until every other GPU where the gang is held closed by a switcher is ready
 * to open it too (its switcher waits here as well, or has opened it), at most align_ns (one
 * slice): the gang's turns then start together on all its GPUs, and the plans' phases stay in
 * step. Neighbours' shares are their policy's: each ring charges what really ran. */
static void align_gang(struct sw *s, struct batch *b, int pos)
{
    const struct step *st = &b->steps[pos];
    pthread_mutex_lock(&s->mu);
    int64_t align = s->align_ns;
    pthread_mutex_unlock(&s->mu);
    if (align <= 0)
        return;
    align_gang_end(s, b, pos, align);
    if (st->run < 0 || st->run >= b->nuni || !b->uni[st->run]->drives)
        return;
    struct page *p = b->uni[st->run];
    pthread_mutex_lock(&p->mu);
    uint32_t me = ks(p, s->gpu), others = 0;
    if (me && p->closed_mask & me && ngpus(p) > 1) {
        p->gang_ready |= me;
        others = p->closed_mask & ~me;
    }
    pthread_mutex_unlock(&p->mu);
    for (unsigned k = 0; k < CGPU_MAX_GPUS && others; k++)  /* (a GPU whose switcher carries nothing: not waited for) */
        if (others >> k & 1 && ((int)k >= p->ngpus_known || !carrying(p->gpus[k])))
            others &= ~(1u << k);
    if (!others)
        return;
    int64_t until = now_ns() + align;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        uint32_t held = p->closed_mask & others & ~p->gang_ready;
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_lock(&s->mu);
        int stop = s->cancel || s->stopping;
        pthread_mutex_unlock(&s->mu);
        int64_t now = now_ns();
        if (!held || stop || now >= until)
            return;
        sleep_or_cmd(s, now + 100000 < until ? now + 100000 : until);  /* (look again every 100 µs) */
    }
}

/* Carry out one step of `b`. */
static void run_step(struct sw *s, struct batch *b, int pos)
{
    const struct step *st = &b->steps[pos];
    int64_t begin = now_ns();
    pthread_mutex_lock(&s->mu);
    struct report *prev = open_report_locked(s);  /* in force until this step's gate opens: its work drains meanwhile */
    pthread_mutex_unlock(&s->mu);
    /* close: the active instances that do not run now */
    int closing[CGPU_MAX_PROCS], nclose = 0;
    for (int i = 0; i < b->nuni; i++) {
        if (!b->active[i] || i == st->run)
            continue;
        struct page *p = b->uni[i];
        pthread_mutex_lock(&p->mu);
        if (!closed_on_locked(p, s->gpu)) {
            freeze_locked(p, s->gpu);
            if (nclose < CGPU_MAX_PROCS)
                closing[nclose++] = i;
        }
        pthread_mutex_unlock(&p->mu);
    }
    int gave_up = -1, why = 0, longer = 0;
    int64_t drained = begin, start = 0;
    if (nclose) {  /* (also before an idle step: the work that runs on is the stopped ones', charged to them) */
        pthread_mutex_lock(&s->mu);
        int mode = s->mode;
        int64_t lead = s->lead_ns, expect = 0;
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < nclose; i++)
            if (b->uni[closing[i]]->drain_mean_ns > expect)
                expect = b->uni[closing[i]]->drain_mean_ns;
        int64_t open_at = mode == SWITCH_OVERLAP ? begin
                        : mode == SWITCH_AHEAD && expect ? begin + expect - lead : INT64_MAX;  /* (no mean yet: as drain) */
        gave_up = wait_drained(s, b, closing, nclose, begin, &why, &longer, open_at, st->run, &start);
        drained = now_ns();
        for (int i = 0; i < nclose; i++) {  /* (a running mean, 1/4 weight) */
            struct page *p = b->uni[closing[i]];
            p->drain_mean_ns += (drained - begin - p->drain_mean_ns) / 4;
        }
    }
    if (!start) {
        /* The step starts now: a launcher woken on this CPU may run before this thread takes the time again. */
        start = now_ns();
        open_others(s, b, st->run);
    }
    /* the GPU time counts: the previous runner's at its end (its work drained), this runner's at its start */
    int64_t prev_ns = -1;
    for (int i = 0; prev && prev->runner && prev->gpu_at >= 0 && i < b->nuni; i++)
        if (b->uni[i] == prev->runner)  /* (still in this batch's universe: alive) */
            prev_ns = cg_page_gpu_ns(b->uni[i], s->gpu);
    int64_t at_ns = st->run >= 0 && st->run < b->nuni ? cg_page_gpu_ns(b->uni[st->run], s->gpu) : -1;
    pthread_mutex_lock(&s->mu);
    if (prev) {
        prev->end = start;
        prev->drained = nclose ? drained : start;
        prev->gpu_ns = prev_ns >= 0 ? (prev_ns > prev->gpu_at ? prev_ns - prev->gpu_at : 0) : -1;
    }
    struct page *was = s->running;  /* (a reference each: the batch that named it may be gone) */
    s->running = st->run >= 0 && st->run < b->nuni ? b->uni[st->run] : NULL;
    const struct step *after = pos + 1 < b->nsteps ? &b->steps[pos + 1] : NULL;
    s->running_next = after && after->run >= 0 && after->run < b->nuni ? b->uni[after->run] : NULL;
    s->running_until = 0;
    if (s->running)
        cg_page_ref(s->running);
    if (s->head - s->tail >= REPORTS)
        s->tail++;  /* (the scheduler has not read them for REPORTS steps: the oldest go) */
    s->reports[s->head++ % REPORTS] = (struct report){
        .begin = begin, .start = start, .owned = nclose && drained > start ? drained : start,
        .drain_ns = nclose ? drained - begin : 0,
        .batch = b->id, .step = pos, .gave_up = gave_up, .closed = nclose, .why = why, .longer = longer,
        .run = st->run, .gpu_ns = -1, .gpu_at = at_ns, .runner = st->run >= 0 && st->run < b->nuni ? b->uni[st->run] : NULL};
    pthread_mutex_unlock(&s->mu);
    if (was) {  /* (its turn here is over: not leaving any more) */
        pthread_mutex_lock(&was->mu);
        was->gang_leaving &= ~ks(was, s->gpu);
        pthread_mutex_unlock(&was->mu);
        cg_page_release(was);
    }
    if (st->flags & NOTIFY)
        notify(s);
}

static void *switcher(void *arg)
{
    struct sw *s = arg;
    char name[16];
    snprintf(name, sizeof name, "cgpu-switch%d", s->gpu);
    pthread_setname_np(pthread_self(), name);  /* (what top -H and /proc/PID/task show) */
    /* The daemon's priority (real-time where it may: cgpud/sched/priority.py). It runs with
     * SCHED_RESET_ON_FORK, which a new thread does not inherit the policy through: this thread ran
     * at normal priority, behind the very workloads it switches (under four CPU hogs its steps
     * ended up to 74 ms late and a gang's turns on its two GPUs drifted apart). */
    if (s->policy != SCHED_OTHER)
        sched_setscheduler(0, s->policy, &s->param);  /* (0: this thread) */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  /* wake at the step's end, not up to 50 µs after */
    pthread_mutex_lock(&s->mu);
    for (;;) {
        if (s->stopping)
            break;
        if (s->cancel) {  /* end the step now, drop the batches; the gates stay as they are */
            struct report *r = open_report_locked(s);
            if (r)
                r->end = r->drained = now_ns();
            free_batch(s->cur);
            free_batch(s->next);
            s->cur = s->next = NULL;
            s->pos = -1;
            s->cancel = 0;
            forget_running(s);
            s->idle = 1;
            notify(s);
            continue;
        }
        struct batch *b = s->cur;
        if (b && s->pos + 1 >= b->nsteps && s->next) {  /* on to the next batch */
            struct batch *n = s->next;
            /* gates of instances the new batch no longer has: open (idle, or gone) */
            for (int i = 0; i < b->nuni; i++) {
                int kept = 0;
                for (int j = 0; j < n->nuni && !kept; j++)
                    kept = n->uni[j] == b->uni[i];
                if (!kept)
                    cg_page_thaw(b->uni[i], s->gpu);
            }
            free_batch(b);
            s->cur = b = n;
            s->next = NULL;
            s->pos = -1;
        }
        if (!b || s->pos + 1 >= b->nsteps) {  /* nothing more to do: hold the gates as they are */
            s->idle = 1;
            pthread_mutex_unlock(&s->mu);
            notify(s);
            sleep_or_cmd(s, INT64_MAX);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        s->idle = 0;
        int pos = ++s->pos;
        pthread_mutex_unlock(&s->mu);
        align_gang(s, b, pos);
        run_step(s, b, pos);
        pthread_mutex_lock(&s->mu);
        int64_t until = s->reports[(s->head - 1) % REPORTS].start + b->steps[pos].len_ns;  /* (its length from its gate opening) */
        s->running_until = until;
        while (!s->cancel && !s->stopping && now_ns() < until) {
            pthread_mutex_unlock(&s->mu);
            sleep_or_cmd(s, until);
            pthread_mutex_lock(&s->mu);
        }
        struct report *r = &s->reports[(s->head - 1) % REPORTS];
        int64_t t = now_ns();
        if (!s->cancel && !s->stopping && t > until)
            r->late_ns = t - until;
    }
    s->idle = 1;
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* A switcher for node GPU `gpu`; `bound_ns`: how long a switch waits for a stopped instance's
 * queued work before it asks who cannot answer; `cap_ns`: the longest it waits for one that drains.
 * NULL (errno set) when its thread cannot start. */
EXPORT struct sw *cg_sw_new(int gpu, int64_t bound_ns, int64_t cap_ns)
{
    struct sw *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->gpu = gpu;
    s->bound_ns = bound_ns;
    s->cap_ns = cap_ns;
    s->pos = -1;
    s->idle = 1;
    /* (the kernel's, of the calling thread: glibc's pthread_getschedparam keeps what it read first,
     * and the daemon sets its priority with the plain system call) */
    s->policy = sched_getscheduler(0);
    if (s->policy < 0 || sched_getparam(0, &s->param))
        s->policy = SCHED_OTHER;
    s->policy &= ~SCHED_RESET_ON_FORK;
    pthread_mutex_init(&s->mu, NULL);
    s->cmd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->note = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  /* signals stay with the daemon's own thread */
    int e = s->cmd < 0 || s->note < 0 ? errno : pthread_create(&s->thread, NULL, switcher, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!e) {
        pthread_mutex_lock(&switchers_mu);
        if (gpu >= 0 && gpu < MAX_NODE_GPUS)
            switchers[gpu] = s;
        pthread_mutex_unlock(&switchers_mu);
    }
    if (e) {
        if (s->cmd >= 0) close(s->cmd);
        if (s->note >= 0) close(s->note);
        free(s);
        errno = e;
        return NULL;
    }
    return s;
}

/* The descriptor that reads ready when the switcher has something to say (a step that asked
 * for it started, it ran out of steps, a cancel is done). cg_sw_ack empties it. */
EXPORT int cg_sw_fd(struct sw *s) { return s->note; }
/* When the next gate opens at a switch: SWITCH_DRAIN once the stopped ones' queued work is done;
 * SWITCH_AHEAD `lead_ns` before their drain is expected to end (their running mean), so that the
 * next one's first launches are queued as the tail ends; SWITCH_OVERLAP at the closing. */
EXPORT void cg_sw_mode(struct sw *s, int mode, int64_t lead_ns)
{
    pthread_mutex_lock(&s->mu);
    s->mode = mode;
    s->lead_ns = lead_ns;
    pthread_mutex_unlock(&s->mu);
}
EXPORT void cg_sw_ack(struct sw *s) { drain_fd(s->note); }
/* A gang's turns aligned across its GPUs (align_gang): the step before a gang's runs on at most
 * `ns` for its other GPUs' switchers (0: not aligned). */
EXPORT void cg_sw_align(struct sw *s, int64_t ns)
{
    pthread_mutex_lock(&s->mu);
    s->align_ns = ns;
    pthread_mutex_unlock(&s->mu);
}

static void poke(struct sw *s)
{
    uint64_t one = 1;
    if (write(s->cmd, &one, sizeof one) < 0) { /* (a counter) */ }
}

/* Hand the switcher a batch: `nuni` pages (each given a reference of its own) with whether
 * each is active, and `nsteps` steps. It follows the batch being carried out (or starts now
 * when there is none). Returns 0, or -1 when a batch is already waiting (refused). */
EXPORT int cg_sw_submit(struct sw *s, int32_t id, int nuni, struct page *const *uni, const uint8_t *active,
                        int nsteps, const struct step *steps)
{
    struct batch *b = calloc(1, sizeof *b);
    if (!b || nsteps <= 0)
        return free(b), -1;
    b->id = id;
    b->nuni = nuni;
    b->uni = calloc((size_t)(nuni ? nuni : 1), sizeof *b->uni);
    b->active = calloc((size_t)(nuni ? nuni : 1), 1);
    b->steps = malloc((size_t)nsteps * sizeof *b->steps);
    if (!b->uni || !b->active || !b->steps) {
        b->nuni = 0;
        free_batch(b);
        return -1;
    }
    for (int i = 0; i < nuni; i++) {
        cg_page_ref(uni[i]);
        b->uni[i] = uni[i];
        b->active[i] = active[i];
    }
    b->nsteps = nsteps;
    memcpy(b->steps, steps, (size_t)nsteps * sizeof *steps);
    pthread_mutex_lock(&s->mu);
    int busy = s->next != NULL;
    if (!busy) {
        if (s->cur)  /* (after the batch being carried out, or its last step, running now) */
            s->next = b;
        else {
            s->cur = b;
            s->pos = -1;
        }
        s->idle = 0;
    }
    pthread_mutex_unlock(&s->mu);
    if (busy) {
        free_batch(b);
        return -1;
    }
    poke(s);
    return 0;
}

/* End the step being carried out now and drop the batches; the gates stay as they are.
 * Returns at once: cg_sw_idle says when it is done (cg_sw_fd reads ready then). */
EXPORT void cg_sw_cancel(struct sw *s)
{
    pthread_mutex_lock(&s->mu);
    s->cancel = 1;
    s->idle = 0;
    pthread_mutex_unlock(&s->mu);
    poke(s);
}

EXPORT int cg_sw_idle(struct sw *s)
{
    pthread_mutex_lock(&s->mu);
    int i = s->idle && !s->cancel;
    pthread_mutex_unlock(&s->mu);
    return i;
}

/* Take the reports of the steps that have ended (up to `max`), oldest first; `*current`
 * gets the open one (the step in force), if any, and the function returns how many ended. */
EXPORT int cg_sw_take(struct sw *s, struct report *out, int max, struct report *current, int *has_current)
{
    pthread_mutex_lock(&s->mu);
    int n = 0;
    while (s->tail != s->head && n < max) {
        struct report *r = &s->reports[s->tail % REPORTS];
        if (!r->end)
            break;
        out[n++] = *r;
        s->tail++;
    }
    struct report *r = open_report_locked(s);
    *has_current = r != NULL;
    if (r)
        *current = *r;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* Stop the thread and free the switcher (the gates stay as they are: open them first). */
EXPORT void cg_sw_free(struct sw *s)
{
    pthread_mutex_lock(&switchers_mu);
    if (s->gpu >= 0 && s->gpu < MAX_NODE_GPUS && switchers[s->gpu] == s)
        switchers[s->gpu] = NULL;
    pthread_mutex_unlock(&switchers_mu);
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_mutex_unlock(&s->mu);
    poke(s);
    pthread_join(s->thread, NULL);
    free_batch(s->cur);
    free_batch(s->next);
    forget_running(s);
    close(s->cmd);
    close(s->note);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

EXPORT size_t cg_sizeof_report(void) { return sizeof(struct report); }
EXPORT size_t cg_sizeof_step(void) { return sizeof(struct step); }
