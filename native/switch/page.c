/*
 * libcgpu-switch.so, the pages: a container's `limits` and `usage` pages and its `drained` FIFO as
 * the daemon holds them (struct page, page.h): its gates closed and opened, who has not drained a
 * closing and who is given up on, its processes' GPU time, and what is found damaged or forged
 * (docs/isolation.md, "The pages"; docs/security.md, "Pages"). The switcher (cgpu-switch.c) and the
 * daemon's Python (cgpud/sched/native.py) share each page by counted references; every operation
 * takes its lock.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "page.h"

#define GATED_PER_GPU 2u

static void wake_all(uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

/* Give-ups of a live process (alive and not answering, or draining past the cap) that make a page
 * damaged, STRIKES within STRIKE_NS: libcgpu answers every closing within its drain bound, so a
 * page whose slots keep the gate waiting so is forged (docs/security.md, "Pages and leaving the
 * library"): its queued work is then not waited for. (Within a window: an honest process that a
 * loaded machine kept from answering now and then is not taken for one.) */
#define STRIKES 3
#define STRIKE_NS 10000000000ll

/* A live slot given up on: 1 when it is the STRIKES-th within STRIKE_NS. With the page's lock held. */
static int struck_locked(struct page *p)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int64_t now = (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
    unsigned n = p->strikes++;
    p->strike_at[n % STRIKES] = now;
    return n + 1 >= STRIKES && now - p->strike_at[(n + 1) % STRIKES] < STRIKE_NS;  /* (the STRIKES-1-th before) */
}

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
unsigned ngpus(struct page *p)
{
    unsigned n = load(&p->lim->ngpus);
    return n < 1 ? 1 : n > CGPU_MAX_GPUS ? CGPU_MAX_GPUS : n;
}

/* The page GPUs a freeze or thaw of node GPU `gpu` (-1: all) is about, as a mask. */
uint32_t ks(struct page *p, int gpu)
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

void freeze_locked(struct page *p, int gpu)
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

void thaw_locked(struct page *p, int gpu)
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
int closed_on_locked(struct page *p, int gpu)
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

/* How long a closing of a damaged page is waited for, its queued work not asked about: as long as
 * libcgpu lets a process queue ahead (its budget), the longest an honest page's drain lasts. 0 for a
 * page that is read. */
int64_t blind_ns(struct page *p)
{
    pthread_mutex_lock(&p->mu);
    uint32_t us = load(&p->lim->queue_budget_us);
    int64_t ns = !p->damage[0] || !p->per_gpu ? 0 : (int64_t)(us ? us : CGPU_QUEUE_BUDGET_US_DEFAULT) * 1000;
    pthread_mutex_unlock(&p->mu);
    return ns;
}

EXPORT int cg_page_undrained(struct page *p, int gpu, int *out, int max)
{
    pthread_mutex_lock(&p->mu);
    int n = undrained_locked(p, gpu, out, NULL, max);
    pthread_mutex_unlock(&p->mu);
    return n;
}


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
 * were given up at. A forged slot, or the STRIKES-th live process given up on within STRIKE_NS, makes the page
 * damaged: nothing of it is read from then on, so what it says holds nobody's gate again (a
 * closing waits for it one drain bound at most, STRIKES times in a row). Returns how
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
        else if ((w == SILENT || w == TOO_LONG) && struck_locked(p))
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
