/*
 * The stand-in card's executor: how kernels queue and run (issue 27). As unkind as the card the
 * probe measured (an H100, docs/isolation.md "How it is tested"):
 *
 * - A launch returns at once into its stream's queue (CGPU_STUB_QUEUE_DEPTH entries, default 1024:
 *   the H100 took 1030 launches of a 2.6 ms matmul before the 1031st blocked). Only a full queue
 *   blocks the launcher, until an entry of that stream completes. A context (a process on a card)
 *   holds at most RING queued entries over all its streams.
 * - One executor per card, shared by every process using it: kernels run one at a time, each
 *   context's in the order they were launched (so its streams are in order with one another, and
 *   cuStreamWaitEvent within a context holds by itself).
 * - The card time-slices between contexts that have work ready: the context on the card runs
 *   until its timeslice ends while another has work (CGPU_STUB_TIMESLICE_US, default 1024: the
 *   open kernel module's default for a channel group, kfifoChannelGroupGetDefaultTimeslice_GV100,
 *   NV_RAMRL_ENTRY_TSG_TIMESLICE_TIMEOUT_128 << SCALE_3 µs, for Volta through Hopper; NVIDIA's
 *   `nvidia-smi compute-policy --set-timeslice` names its levels but documents no figures), then
 *   the running kernel is preempted (it resumes where it stopped) and the card goes round-robin
 *   to the next context with work. Alone, a context runs on through its timeslices' ends.
 * - Each switch between contexts leaves the card idle CGPU_STUB_SWITCH_US (default 100 µs: the
 *   save and restore of a context); a kernel launched onto an idle card starts CGPU_STUB_LAUNCH_US
 *   later (default 5 µs: the launch's latency).
 * - Kernels are never lost: a process's exit waits for its queued work (its log then whole); a
 *   process killed leaves its queue, which is dropped when found dead (a context torn down).
 *
 * No daemon: the card's state is a file beside CGPU_STUB_CUDA_STATE (".exec"), mapped by every
 * process, and the simulation is advanced lazily, under flock, by whoever calls (a launch, a
 * synchronize, a query): it works out what the card did from the last advance until now. Waits
 * (synchronize, an event, a full queue) sleep until the earliest the awaited work can end, spin
 * its last SPIN_NS (as the driver's default scheduling spins), and advance again.
 *
 * The kernel log (CGPU_STUB_CUDA_LOG, "pid start_ns end_ns" per line, CLOCK_MONOTONIC): a line per
 * contiguous piece a kernel ran (one piece unless a timeslice's end cut it), so summing end -
 * start over a process's lines gives its kernel time. The advancer may be another process, so
 * the pieces wait in the owner's record of the file and the owner writes them to its own log
 * (whatever its mount namespace) at its next call into the driver and at exit.
 *
 * Collectives (CGPU_STUB_COLLECTIVE=1): each kernel of the process on card 0 or 1 is half of one
 * with its next on the other card, as an all-reduce's ranks are; CGPU_STUB_COLLECTIVE=<name>: the
 * ranks are processes, one per card (torchrun's, DeepSpeed's), each process's n-th kernel pairing
 * with the n-th of the process of the same name on the other card (NCCL's rendezvous). A half that starts holds its card,
 * spinning and never preempted, until its peer has started; both end `us` after the later start.
 * Each half is logged "pid start end dev us" (its time spinning: end - start - us).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_stub.h"

#define NCARDS 16
#define NCTX 32        /* contexts (processes) per card */
#define RING 4096      /* queued entries per context, all streams together */
#define NSTREAMS 16    /* streams told apart per context (more share a record) */
#define NPIECES 4096   /* logged pieces waiting for their owner to write them */
#define NEVER UINT64_MAX
#define SPIN_NS 200000ull
#define EXEC_MAGIC 0x6367707565786533ull  /* "cgpuexe3" */
#define STAMP_NS 512ull  /* the card's timestamps' resolution (cuEventElapsedTime's documented ~0.5 µs) */

/* cum: ns of entries 0..this; stamp: the card's timestamp of its end (an event's time: inexact);
 * ov: ns its first piece overlapped the entry before (a programmatic dependent launch) */
struct entry { uint64_t ns, cum, ready, end, stamp, ov; uint32_t stream, coll, kind, pad; };
enum { K_KERNEL = 0, K_MARK = 1, K_PDL = 2 };  /* kind: a kernel; an event's record; a kernel launched programmatic-dependent */
struct sstream { uint64_t id, last, enq, done; };  /* last: seq + 1 of its last entry (0: none) */
struct piece { uint64_t start, end, us; int32_t dev, coll; };
struct ctx {
    uint64_t owner;        /* its process's token (pids are no names across PID namespaces; 0: free) */
    uint64_t head, tail;   /* entries [head, tail) queued; head runs first */
    uint64_t left;         /* ns the head entry has left once it started (0: not started; NEVER: a half spinning) */
    uint64_t coll_enq, coll_start, checked;
    uint64_t group;        /* its collectives' group: its halves pair with the other card's context of the same group */
    uint64_t piece_w, piece_r, lost;
    int32_t pid, pad2;     /* the owner's pid (as it sees it: its log's lines say so) */
    uint64_t last_stamp;   /* its newest timestamp (the card writes them in order: never earlier) */
    char log[240];         /* the owner's log (CGPU_STUB_CUDA_LOG), for when its pieces overflow */
    struct sstream streams[NSTREAMS];
};
/* A context's queue and its pieces, after the cards (the records above stay on a few pages) */
struct bulk { struct piece pieces[NPIECES]; struct entry ring[RING]; };
enum { IDLE = 0, SWITCH = 1, RUN = 2 };
struct card {
    uint64_t magic, t;     /* simulated up to t */
    int32_t cur, state;    /* cur: the context on the card (-1: none yet) */
    int32_t next, pad;     /* SWITCH: the context being switched to */
    uint64_t until, piece_start, slice_end;
    uint32_t busy, pad2;   /* contexts with queued work */
    uint64_t rng;          /* the card's own inexactness (slices, switches, timestamps): xorshift64 */
    struct ctx ctx[NCTX];
};

#define MAP_SIZE (sizeof(struct card) * NCARDS + sizeof(struct bulk) * NCARDS * NCTX)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* (flock is the open file's: not between threads) */
static struct card *cards;
static int fd = -1;
static pid_t mapped_by;
static uint64_t me;  /* this process's token (a forked child draws its own) */
static int ran_fd = -1;  /* the ".ran" file: what the card ran for each context (NVML's per-process utilisation) */
static int log_fd = -1;

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
static void sleep_until(uint64_t ns)
{
    struct timespec t = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR)
        ;
}
static uint64_t env_us(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    return (v && *v ? strtoull(v, NULL, 10) : dflt) * 1000ull;
}
static uint64_t timeslice(void) { static uint64_t v; if (!v) v = env_us("CGPU_STUB_TIMESLICE_US", 1024); return v ? v : 1000; }
static uint64_t switch_ns(void) { static int64_t v = -1; if (v < 0) v = (int64_t)env_us("CGPU_STUB_SWITCH_US", 100); return (uint64_t)v; }
static uint64_t launch_ns(void) { static int64_t v = -1; if (v < 0) v = (int64_t)env_us("CGPU_STUB_LAUNCH_US", 5); return (uint64_t)v; }
static uint64_t depth(void)
{
    static uint64_t v;
    if (!v) {
        const char *d = getenv("CGPU_STUB_QUEUE_DEPTH");
        v = d && *d ? strtoull(d, NULL, 10) : 1024;
        v = v < 1 ? 1 : v > RING ? RING : v;
    }
    return v;
}

/* ---- the card's inexactness (issue 35: an exact stand-in was kinder than the card) ----
 * The card's own time-slicing is not an exact 1024 µs and 100 µs: a slice ends within
 * CGPU_STUB_SLICE_JITTER_PCT % of it (default 10: the scheduler's timer and the running kernel's
 * preemption point), a switch takes CGPU_STUB_SWITCH_US ± CGPU_STUB_SWITCH_JITTER_PCT % (default 50:
 * a context's save and restore depend on what it holds). An event's timestamp is written after the
 * work before it ends (0 to CGPU_STUB_STAMP_JITTER_NS later, default 1000) at the card's timer's
 * resolution (STAMP_NS), never before the context's last one. An event's record costs the card
 * CGPU_STUB_EVENT_NS (default 1000: its own entry in the stream, a bubble between the kernels around
 * it) and the host CGPU_STUB_EVENT_HOST_NS (default 2000: a driver call writing the push buffer).
 * CGPU_STUB_EXACT=1: none of these (the earlier, exact card). Drawn from the card's own xorshift64. */
static int exact(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("CGPU_STUB_EXACT");
        v = e && *e == '1';
    }
    return v;
}
static uint64_t env_n(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : dflt;
}
static uint64_t draw(struct card *k)
{
    uint64_t x = k->rng ? k->rng : 0x9e3779b97f4a7c15ull;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return k->rng = x;
}
static uint64_t spread(struct card *k, uint64_t v, uint64_t pct)  /* v ± pct % of it, uniformly */
{
    uint64_t j = exact() ? 0 : v * (pct > 100 ? 100 : pct) / 100;
    return j ? v - j + draw(k) % (2 * j + 1) : v;
}
static uint64_t slice_len(struct card *k)
{
    static int64_t pct = -1;
    if (pct < 0) pct = (int64_t)env_n("CGPU_STUB_SLICE_JITTER_PCT", 10);
    return spread(k, timeslice(), (uint64_t)pct);
}
static uint64_t switch_len(struct card *k)
{
    static int64_t pct = -1;
    if (pct < 0) pct = (int64_t)env_n("CGPU_STUB_SWITCH_JITTER_PCT", 50);
    return spread(k, switch_ns(), (uint64_t)pct);
}
static uint64_t stamp_of(struct card *k, struct ctx *c, uint64_t t)
{
    static int64_t jitter = -1;
    if (jitter < 0) jitter = (int64_t)env_n("CGPU_STUB_STAMP_JITTER_NS", 1000);
    if (exact()) return t;
    uint64_t v = t + (jitter ? draw(k) % (uint64_t)(jitter + 1) : 0);
    v -= v % STAMP_NS;
    if (v < c->last_stamp) v = c->last_stamp;
    return c->last_stamp = v;
}
static uint64_t event_card_ns(void)
{
    static int64_t v = -1;
    if (v < 0) v = exact() ? 0 : (int64_t)env_n("CGPU_STUB_EVENT_NS", 1000);
    return (uint64_t)v;
}
static uint64_t event_host_ns(void)
{
    static int64_t v = -1;
    if (v < 0) v = exact() ? 0 : (int64_t)env_n("CGPU_STUB_EVENT_HOST_NS", 2000);
    return (uint64_t)v;
}
/* A programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, Hopper on)
 * starts while the kernel before it in its stream still runs: by the primary's trigger it has
 * done its prologue, so the pair overlaps by min(CGPU_STUB_PDL_US (default 10), half of either).
 * Only straight after that kernel: anything between them in the stream (an event's record, a
 * hold, another stream's work) serializes them, as on the card. */
static uint64_t pdl_ns(void)
{
    static int64_t v = -1;
    if (v < 0) v = (int64_t)env_us("CGPU_STUB_PDL_US", 10);
    return (uint64_t)v;
}

/* ---- the shared file ---- */

/* Map the card file (once per process; a forked child maps its own: flock is the open file's). */
static int attach_locked(void);
static int attach(void)
{
    if (__atomic_load_n(&mapped_by, __ATOMIC_ACQUIRE) == getpid() && cards)
        return 0;
    pthread_mutex_lock(&lock);  /* (threads racing to the first call: one maps, the others wait) */
    int r = attach_locked();
    pthread_mutex_unlock(&lock);
    return r;
}
static int attach_locked(void)
{
    if (cards && mapped_by == getpid())
        return 0;
    if (cards) {
        munmap(cards, MAP_SIZE);
        close(fd);
        if (log_fd >= 0) close(log_fd);
        cards = NULL;
        log_fd = -1;
    }
    const char *s = getenv("CGPU_STUB_CUDA_STATE"), *log = getenv("CGPU_STUB_CUDA_LOG");
    char path[4096];
    snprintf(path, sizeof path, "%s.exec", s && *s ? s : "/tmp/cgpu-stub-cuda.state");
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    size_t size = MAP_SIZE;
    flock(fd, LOCK_EX);
    struct stat st;
    uint64_t magic = 0;
    if (fstat(fd, &st) || (size_t)st.st_size < size || pread(fd, &magic, sizeof magic, 0) != sizeof magic
        || magic != EXEC_MAGIC) {  /* a new card (sparse: its pages come as they are used) */
        int bad = ftruncate(fd, 0) || ftruncate(fd, (off_t)size);
        uint64_t m = EXEC_MAGIC;
        int32_t none = -1;
        for (int d = 0; !bad && d < NCARDS; d++) {
            off_t at = (off_t)(sizeof(struct card) * d);
            bad = pwrite(fd, &m, sizeof m, at + (off_t)offsetof(struct card, magic)) != sizeof m
                  || pwrite(fd, &none, sizeof none, at + (off_t)offsetof(struct card, cur)) != sizeof none;
        }
        if (bad) {
            flock(fd, LOCK_UN);
            close(fd);
            return -1;
        }
    }
    flock(fd, LOCK_UN);
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return -1;
    }
    cards = m;
    if (ran_fd >= 0) close(ran_fd);
    snprintf(path, sizeof path, "%s.ran", s && *s ? s : "/tmp/cgpu-stub-cuda.state");
    ran_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    int r = open("/dev/urandom", O_RDONLY | O_CLOEXEC);  /* (no getrandom: the stand-in builds for glibc 2.17 too) */
    if (r < 0 || read(r, &me, sizeof me) != sizeof me || !me)
        me = ((uint64_t)getpid() << 32) ^ now_ns() ^ (uint64_t)(uintptr_t)&me;
    if (r >= 0) close(r);
    log_fd = log && *log ? open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666) : -1;
    __atomic_store_n(&mapped_by, getpid(), __ATOMIC_RELEASE);
    return 0;
}
static void enter(void)
{
    pthread_mutex_lock(&lock);
    flock(fd, LOCK_EX);
}
static void leave(void)
{
    flock(fd, LOCK_UN);
    pthread_mutex_unlock(&lock);
}

/* ---- the simulation (under the lock) ---- */

static struct bulk *bulk_of(const struct ctx *c)
{
    size_t dev = (size_t)((const char *)c - (const char *)cards) / sizeof(struct card);
    size_t i = (size_t)(c - cards[dev].ctx);
    return (struct bulk *)((char *)cards + sizeof(struct card) * NCARDS) + dev * NCTX + i;
}
static struct entry *entry_of(const struct ctx *c, uint64_t seq) { return &bulk_of(c)->ring[seq % RING]; }
static struct entry *head_entry(const struct ctx *c) { return entry_of(c, c->head); }
static int has_work(const struct card *k, int i) { return k->busy >> i & 1; }

/* As many of c's logged pieces as fit in buf, as log lines (taken from its record). */
static size_t take_lines(struct ctx *c, char *buf, size_t cap)
{
    size_t len = 0;
    while (c->piece_r < c->piece_w && len + 100 < cap) {
        struct piece *p = &bulk_of(c)->pieces[c->piece_r++ % NPIECES];
        len += (size_t)(p->coll ? snprintf(buf + len, cap - len, "%d %llu %llu %d %llu\n", c->pid,
                                           (unsigned long long)p->start, (unsigned long long)p->end, p->dev,
                                           (unsigned long long)p->us)
                                : snprintf(buf + len, cap - len, "%d %llu %llu\n", c->pid,
                                           (unsigned long long)p->start, (unsigned long long)p->end));
    }
    return len;
}

/* c's record of pieces is full (its owner has not called for a long time: waiting at a gate, or
 * frozen): the advancer writes them to the owner's log itself, where it can open it. */
static void spill(struct ctx *c)
{
    int f = c->log[0] ? open(c->log, O_WRONLY | O_APPEND | O_CLOEXEC) : -1;
    char buf[8192];
    size_t len;
    while (f >= 0 && (len = take_lines(c, buf, sizeof buf)))
        if (write(f, buf, len) < 0) break;
    if (f >= 0) close(f);
}

/* The GPU time the card gave each context, measured here (not said by anyone): the ".ran" file beside
 * the card's, a record {int32 pid, int32 card, uint64 ns} per context (card * NCTX + its index), its ns
 * summed over every piece the card ran for it; a context taken by another process starts again from
 * 0. The stand-in NVML's nvmlDeviceGetProcessUtilization reads it (libnvidia-ml.c's `cuda` line). */
static void note_ran(const struct ctx *c, int dev, uint64_t ns)
{
    struct { int32_t pid, dev; uint64_t ns; } r;
    off_t at = (off_t)((size_t)dev * NCTX + (size_t)(c - cards[dev].ctx)) * (off_t)sizeof r;
    if (ran_fd < 0 || dev < 0 || dev >= NCARDS)
        return;
    if (pread(ran_fd, &r, sizeof r, at) != sizeof r || r.pid != c->pid || r.dev != dev)
        r.pid = c->pid, r.dev = dev, r.ns = 0;
    r.ns += ns;
    if (pwrite(ran_fd, &r, sizeof r, at) != sizeof r) { /* (best effort: NVML then sees less) */ }
}

static void add_piece(struct ctx *c, uint64_t start, uint64_t end, int dev, uint64_t us, int coll, uint64_t ov)
{
    note_ran(c, dev, end > start + ov ? end - start - ov : 0);  /* (ov: overlapped, the card's time counted once) */
    if (c->piece_w - c->piece_r >= NPIECES)
        spill(c);
    if (c->piece_w - c->piece_r >= NPIECES) {
        c->lost++;
        return;
    }
    bulk_of(c)->pieces[c->piece_w++ % NPIECES] = (struct piece){start, end, us, dev, coll};
}

/* The first slice boundary at or after `x` (a context alone runs on through its slices' ends). */
static uint64_t boundary(const struct card *k, uint64_t x)
{
    if (x <= k->slice_end)
        return k->slice_end;
    uint64_t ts = timeslice();
    return k->slice_end + (x - k->slice_end + ts - 1) / ts * ts;
}

/* The earliest another context than k->cur has work ready (NEVER: none). */
static uint64_t contender(const struct card *k)
{
    uint64_t r = NEVER;
    for (int i = 0; i < NCTX; i++)
        if (i != k->cur && has_work(k, i)) {
            uint64_t ready = head_entry(&k->ctx[i])->ready;
            r = ready < r ? ready : r;
        }
    return r;
}

/* The next context after `from` (round-robin) with work ready by `t`, -1 if none. */
static int next_ready(struct card *k, int from, uint64_t t, int skip_from)
{
    for (int n = 1; n <= NCTX; n++) {
        int i = ((from < 0 ? -1 : from) + n) % NCTX;
        if (skip_from && i == from) continue;
        if (has_work(k, i) && head_entry(&k->ctx[i])->ready <= t)
            return i;
    }
    return -1;
}

/* When card k next changes state (NEVER: not by itself). */
static uint64_t next_event(struct card *k)
{
    if (k->state == SWITCH)
        return k->until;
    if (k->state == RUN) {
        struct ctx *c = &k->ctx[k->cur];
        if (c->left == NEVER)
            return NEVER;  /* a half of a collective spinning for its peer: not preempted */
        uint64_t end = k->piece_start + c->left, other = head_entry(c)->coll ? NEVER : contender(k);
        uint64_t pre = other == NEVER ? NEVER : boundary(k, other > k->piece_start ? other : k->piece_start);
        return pre < end ? pre : end;
    }
    uint64_t r = NEVER;
    for (int i = 0; i < NCTX; i++)
        if (has_work(k, i) && head_entry(&k->ctx[i])->ready < r)
            r = head_entry(&k->ctx[i])->ready;
    return r;
}

static struct ctx *peer_ctx(int dev, uint64_t group, int *at)
{
    if (dev > 1) return NULL;
    struct card *p = &cards[1 - dev];
    for (int i = 0; i < NCTX; i++)
        if (p->ctx[i].owner && p->ctx[i].group == group) {
            if (at) *at = i;
            return &p->ctx[i];
        }
    return NULL;
}

/* Context i of card `dev` gets the card at t: its head entry starts (or goes on where it stopped). */
static void start(int dev, int i, uint64_t t)
{
    struct card *k = &cards[dev];
    struct ctx *c = &k->ctx[i];
    struct entry *e = head_entry(c);
    k->state = RUN;
    k->cur = i;
    k->piece_start = t;
    if (c->left)
        return;  /* (preempted before: it goes on) */
    c->left = e->ns;
    e->ov = 0;
    if (e->kind == K_PDL && c->head) {  /* straight after its stream's kernel that just ended: overlaps its tail */
        struct entry *p = entry_of(c, c->head - 1);
        if (p->stream == e->stream && p->kind != K_MARK && p->ns && !p->coll && p->end == t) {
            uint64_t ov = pdl_ns();
            ov = ov < p->ns / 2 ? ov : p->ns / 2;
            ov = ov < e->ns / 2 ? ov : e->ns / 2;
            e->ov = ov;
            c->left = e->ns - ov;
        }
    }
    if (!e->coll)
        return;
    c->coll_start = t;
    c->left = NEVER;
    int pi;
    struct ctx *pc = peer_ctx(dev, c->group, &pi);
    struct card *pk = dev <= 1 ? &cards[1 - dev] : NULL;
    if (pc && pc->head < pc->tail && pc->left == NEVER && pk->state == RUN && pk->cur == pi
        && head_entry(pc)->coll == e->coll) {  /* the pair is complete: both end together */
        uint64_t pns = head_entry(pc)->ns, end = (t > pc->coll_start ? t : pc->coll_start) + (e->ns > pns ? e->ns : pns);
        c->left = end - t;
        pc->left = end - pk->piece_start;
    }
}

/* Card `dev` at t with its current context's head entry over: on with it, another, or idle. */
static void after(int dev, uint64_t t)
{
    struct card *k = &cards[dev];
    int cur = k->cur;
    struct ctx *c = &k->ctx[cur];
    int mine = has_work(k, cur) && head_entry(c)->ready <= t;
    uint64_t other = contender(k);
    int due = other <= t && boundary(k, other) <= t;  /* its slice is over and another waits */
    if (mine && !due) {
        start(dev, cur, t);
        return;
    }
    int n = next_ready(k, cur, t, 1);
    if (n >= 0) {
        k->state = SWITCH;
        k->next = n;
        k->until = t + switch_len(k);
        return;
    }
    if (mine) {  /* (no other ready after all) */
        start(dev, cur, t);
        return;
    }
    k->state = IDLE;
}

/* Card `dev`'s next change, at t. */
static void step(int dev, uint64_t t)
{
    struct card *k = &cards[dev];
    if (k->state == SWITCH) {
        k->slice_end = t + slice_len(k);
        start(dev, k->next, t);
        return;
    }
    if (k->state == IDLE) {
        int n = k->cur >= 0 && has_work(k, k->cur) && head_entry(&k->ctx[k->cur])->ready <= t
                    ? k->cur : next_ready(k, k->cur, t, 0);
        if (n < 0) return;
        if (n != k->cur && k->cur >= 0 && switch_ns()) {
            k->state = SWITCH;
            k->next = n;
            k->until = t + switch_len(k);
            return;
        }
        k->slice_end = t + slice_len(k);
        start(dev, n, t);
        return;
    }
    struct ctx *c = &k->ctx[k->cur];
    struct entry *e = head_entry(c);
    if (c->left != NEVER && t >= k->piece_start + c->left) {  /* the entry is over */
        if (e->coll)
            add_piece(c, c->coll_start, t, dev, e->ns / 1000, 1, 0);
        else if (e->ns && e->kind != K_MARK)  /* (a hold, released, or an event's record: no kernel) */
            add_piece(c, k->piece_start - e->ov, t, dev, 0, 0, e->ov);
        e->end = t;
        e->stamp = stamp_of(k, c, t);
        c->left = 0;
        c->streams[e->stream].done++;
        if (++c->head == c->tail)
            k->busy &= ~(1u << k->cur);
        after(dev, t);
        return;
    }
    /* its slice is over and another context has work: preempted, the card switches */
    if (t > k->piece_start && head_entry(c)->kind != K_MARK)
        add_piece(c, k->piece_start - e->ov, t, dev, 0, 0, e->ov);
    e->ov = 0;  /* (its overlap was its first piece's) */
    c->left -= t - k->piece_start;
    int n = next_ready(k, k->cur, t, 1);
    if (n < 0) {  /* (cannot be: a contender was ready) */
        k->piece_start = t;
        return;
    }
    k->state = SWITCH;
    k->next = n;
    k->until = t + switch_len(k);
}

/* A context's owner holds a write lock (fcntl's, the process's own: gone with it, whatever its PID
 * namespace) on one byte of the file past the cards, from the context's making to its exit. */
static off_t live_at(int dev, int i) { return (off_t)MAP_SIZE + dev * NCTX + i; }
static int hold_live(int dev, int i)
{
    struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = live_at(dev, i), .l_len = 1};
    return fcntl(fd, F_SETLK, &l);
}
static int alive(int dev, int i)
{
    struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = live_at(dev, i), .l_len = 1};
    return fcntl(fd, F_GETLK, &l) || l.l_type != F_UNLCK;
}

/* Contexts whose process is gone: their queue dropped, their record free (checked once a ms). */
static void sweep(int dev, uint64_t t)
{
    struct card *k = &cards[dev];
    for (int i = 0; i < NCTX; i++) {
        struct ctx *c = &k->ctx[i];
        if (!c->owner || c->owner == me || t - c->checked < 1000000) continue;
        c->checked = t;
        if (alive(dev, i)) continue;
        if (k->cur == i && k->state == RUN) {
            k->state = IDLE;
        }
        if (k->state == SWITCH && k->next == i)
            k->state = IDLE;
        c->owner = 0;
        c->head = c->tail;
        c->left = 0;
        k->busy &= ~(1u << i);
    }
}

/* What every card did from its last advance until `t`, in time order across cards (collectives
 * pair halves on two). */
static int ncards(void) { return stub_mps_client() ? NCARDS : stub_device_count(); }  /* (an MPS client: its lanes too) */
static void advance(uint64_t t)
{
    int n = ncards();
    for (int d = 0; d < n; d++)
        sweep(d, t);
    for (;;) {
        int best = -1;
        uint64_t bt = NEVER;
        for (int d = 0; d < n; d++) {
            uint64_t e = next_event(&cards[d]);
            if (e < bt) {
                bt = e;
                best = d;
            }
        }
        if (best < 0 || bt > t)
            break;
        if (bt < cards[best].t) bt = cards[best].t;
        cards[best].t = bt;
        step(best, bt);
    }
    for (int d = 0; d < n; d++)
        if (cards[d].t < t) cards[d].t = t;
}

/* ---- this process's contexts ---- */

/* CGPU_STUB_COLLECTIVE=1: the process's own halves pair (one process on cards 0 and 1); any other
 * name: a group of processes, one per card, as a job's ranks (each process's n-th collective on
 * card 0 pairs with the n-th of the group's process on card 1). */
static uint64_t collective_group(void)
{
    const char *g = getenv("CGPU_STUB_COLLECTIVE");
    if (!g || !*g || !strcmp(g, "1") || !strcmp(g, "0")) return me;
    uint64_t h = 1469598103934665603ull;  /* (FNV-1a) */
    for (; *g; g++) h = (h ^ (unsigned char)*g) * 1099511628211ull;
    return h | 1;
}

static int ctx_at[NCARDS] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
static pid_t ctx_pid;

/* This process's context on card `dev` (made if `make`), NULL if none (or no room). */
static struct ctx *my_ctx(int dev, int make)
{
    if (ctx_pid != getpid()) {
        for (int d = 0; d < NCARDS; d++) ctx_at[d] = -1;
        ctx_pid = getpid();
    }
    struct card *k = &cards[dev];
    if (ctx_at[dev] >= 0 && k->ctx[ctx_at[dev]].owner == me)
        return &k->ctx[ctx_at[dev]];
    int free_at = -1;
    for (int i = 0; i < NCTX; i++) {
        if (k->ctx[i].owner == me) {
            ctx_at[dev] = i;
            return &k->ctx[i];
        }
        if (free_at < 0 && make && !k->ctx[i].owner && !has_work(k, i) && !hold_live(dev, i)) free_at = i;
    }
    if (!make || free_at < 0)
        return NULL;
    struct ctx *c = &k->ctx[free_at];
    uint64_t seq = c->tail;  /* (sequence numbers go on: a stale event of another never matches) */
    memset(c, 0, sizeof *c);
    c->owner = me;
    c->group = collective_group();
    c->pid = (int32_t)getpid();
    const char *log = getenv("CGPU_STUB_CUDA_LOG");
    if (log && strlen(log) < sizeof c->log) strcpy(c->log, log);
    c->head = c->tail = seq;
    c->checked = now_ns();
    ctx_at[dev] = free_at;
    return c;
}

static uint64_t stream_id(const void *s)
{
    if ((uintptr_t)s == 2)  /* CU_STREAM_PER_THREAD */
        return 0x2000000000000000ull | (uint64_t)syscall(SYS_gettid);
    return !s ? 1 : (uint64_t)(uintptr_t)s;  /* (NULL: the legacy stream, 1) */
}

/* The record of stream `id` in context c: its own, a free one, one with no work left, else shared. */
static int stream_of(struct ctx *c, uint64_t id)
{
    int idle = -1;
    for (int i = 0; i < NSTREAMS; i++) {
        if (c->streams[i].id == id) return i;
        if (!c->streams[i].id) {
            c->streams[i].id = id;
            return i;
        }
        if (idle < 0 && c->streams[i].enq == c->streams[i].done) idle = i;
    }
    if (idle >= 0) {
        c->streams[idle].id = id;
        return idle;
    }
    return (int)(id % NSTREAMS);
}

/* What a synchronize, a query or an event in `stream` waits for: the entries before this ticket.
 * The legacy stream (NULL, CU_STREAM_LEGACY) waits for the work of every (blocking) stream
 * launched before; another stream for its own. */
static uint64_t ticket_of(struct ctx *c, const void *stream)
{
    return !stream || (uintptr_t)stream == 1 ? c->tail : c->streams[stream_of(c, stream_id(stream))].last;
}

/* Write this process's logged pieces to its log (outside the lock). */
static void flush(void)
{
    if (log_fd < 0) return;
    char buf[8192];
    for (int d = 0; d < ncards() && d < NCARDS; d++) {
        int at = ctx_pid == getpid() ? ctx_at[d] : -1;
        if (at < 0 || __atomic_load_n(&cards[d].ctx[at].piece_w, __ATOMIC_RELAXED)
                          == __atomic_load_n(&cards[d].ctx[at].piece_r, __ATOMIC_RELAXED))
            continue;  /* (nothing to write: no lock taken) */
        for (;;) {
            enter();
            struct ctx *c = my_ctx(d, 0);
            size_t len = c ? take_lines(c, buf, sizeof buf) : 0;
            leave();
            if (!len) break;
            if (write(log_fd, buf, len) < 0) break;  /* (a log, best effort) */
        }
    }
}

/* The earliest the entry `seq` of context c on card `dev` can end, from t (a lower bound: others'
 * work only delays it). */
static uint64_t earliest(int dev, struct ctx *c, uint64_t seq, uint64_t t)
{
    struct card *k = &cards[dev];
    struct entry *h = head_entry(c), *e = entry_of(c, seq);
    if (c->left == NEVER || h->ready == NEVER) return t + 1000000;  /* (a collective: its peer decides; a hold: the host) */
    uint64_t rest = e->cum - h->cum + (c->left ? c->left : h->ns);
    uint64_t from = t;
    int running = k->state == RUN && &k->ctx[k->cur] == c;
    if (running)
        from = k->piece_start > t ? k->piece_start : t;
    else {
        uint64_t ne = next_event(k);
        from = ne != NEVER && ne > t ? ne : t;
        if (h->ready > from) from = h->ready;
    }
    return from + rest - (running && t > k->piece_start ? t - k->piece_start : 0);
}

/* Wait until context `c`'s entries before `ticket` are done (`stream` >= 0: until that stream has
 * fewer than depth() queued and the context has room, a launch's wait). */
static int wait_for(int dev, uint64_t ticket, int stream, uint64_t deadline)
{
    for (;;) {
        uint64_t t = now_ns(), until;
        if (deadline && t > deadline)
            return -1;
        enter();
        advance(t);
        struct ctx *c = my_ctx(dev, 0);
        int done = !c || (stream < 0 ? c->head >= ticket
                                     : c->streams[stream].enq - c->streams[stream].done < depth() && c->tail - c->head < RING);
        until = done ? 0 : earliest(dev, c, stream < 0 ? ticket - 1 : c->head, t);
        leave();
        if (until < t + 20000) until = t + 20000;  /* (not a tight loop on the lock) */
        if (done) break;
        flush();
        uint64_t now = now_ns();
        if (until > now + SPIN_NS) {
            uint64_t wake = until - SPIN_NS;
            sleep_until(wake < now + 2000000 ? wake : now + 2000000);
        } else
            while (now_ns() < until)
                ;
    }
    flush();
    return 0;
}

/* ---- an MPS client's lane (issue 37, docs/mps.md "The stand-in's MPS") ----
 * MPS runs its clients' kernels concurrently in the server's one context, each on its active thread
 * percentage of the SMs. Here each client's work on card d goes to a lane of its own: one of the
 * card records past the cards (from the last down), with the client's only context, so it never
 * waits for another client's timeslice; its kernels take 100 / percentage as long (fewer SMs), or
 * S / percentage while the clients with work on card d have percentages summing to S > 100 (they
 * share the SMs then). A lane card keeps its client's percentage in `pad` and its card + 1 in `pad2`. */
static int lane_of[NCARDS];
static pid_t lanes_pid;
static int lane(int dev)
{
    if (!stub_mps_client() || dev < 0 || dev >= stub_device_count() || attach()) return dev;
    if (lanes_pid != getpid()) {
        lanes_pid = getpid();
        memset(lane_of, 0, sizeof lane_of);
    }
    if (lane_of[dev]) return lane_of[dev];
    enter();
    advance(now_ns());  /* (the dead clients' lanes swept) */
    int got = -1;
    for (int l = NCARDS - 1; l >= stub_device_count() && got < 0; l--) {
        struct card *k = &cards[l];
        int used = k->busy != 0;
        for (int i = 0; i < NCTX && !used; i++) used = k->ctx[i].owner != 0;
        if (used) continue;
        k->state = IDLE;
        k->cur = -1;
        k->pad = (int32_t)stub_mps_percentage();
        k->pad2 = (uint32_t)dev + 1;
        if (my_ctx(l, 1)) got = l;
    }
    leave();
    if (got < 0) return NCARDS;  /* (no lane left: the stand-in's client limit, 16 - cards per server) */
    lane_of[dev] = got;
    return got;
}
/* a kernel's ns on a lane: stretched by its share of the SMs (under the lock) */
static uint64_t lane_ns(int l, uint64_t ns)
{
    if (l < stub_device_count() || l >= NCARDS || !cards[l].pad2) return ns;
    uint64_t sum = (uint64_t)cards[l].pad;
    for (int o = stub_device_count(); o < NCARDS; o++)
        if (o != l && cards[o].pad2 == cards[l].pad2 && cards[o].busy) sum += (uint64_t)cards[o].pad;
    return ns * (sum > 100 ? sum : 100) / (uint64_t)(cards[l].pad > 0 ? cards[l].pad : 1);
}

/* ---- what the driver's entry points call (cuda_stub.h) ---- */

/* An entry of `ns` into `stream` on card `dev` (held: it waits on the host until released, its
 * ready time NEVER till then); *seq_out its sequence number. */
static CUresult enqueue(int dev, const void *stream, uint64_t ns, int coll, int held, uint32_t kind, uint64_t *seq_out)
{
    dev = lane(dev);
    if (dev < 0 || dev >= NCARDS || (coll && dev > 1)) return STUB_INVALID_VALUE;
    if (attach()) return STUB_OUT_OF_MEMORY;
    uint64_t id = stream_id(stream);
    for (;;) {
        uint64_t t = now_ns();
        enter();
        advance(t);
        struct ctx *c = my_ctx(dev, 1);
        if (!c) {
            leave();
            return STUB_OUT_OF_MEMORY;  /* (no context left on the card) */
        }
        int s = stream_of(c, id);
        if (c->streams[s].enq - c->streams[s].done >= depth() || c->tail - c->head >= RING) {
            leave();
            wait_for(dev, 0, s, 0);  /* a full queue: the launch blocks until an entry completes */
            continue;
        }
        struct card *k = &cards[dev];
        uint64_t seq = c->tail;
        struct entry *prev = seq ? entry_of(c, seq - 1) : NULL;
        struct entry *e = entry_of(c, seq);
        stub_exec_overwritten(dev, seq);  /* (events waiting on the entry this one replaces: resolved first) */
        *e = (struct entry){.ns = kind == K_MARK ? ns : lane_ns(dev, ns), .ready = held ? NEVER : t + launch_ns(),
                            .stream = (uint32_t)s, .coll = coll ? (uint32_t)++c->coll_enq : 0,
                            .kind = coll ? K_KERNEL : kind};
        if (seq_out) *seq_out = seq;
        e->cum = (prev ? prev->cum : 0) + e->ns;  /* (only differences between queued entries count) */
        c->tail = seq + 1;
        c->streams[s].enq++;
        c->streams[s].last = seq + 1;
        k->busy |= 1u << (c - k->ctx);
        leave();
        flush();
        return STUB_OK;
    }
}

CUresult stub_exec_launch(int dev, const void *stream, uint64_t us, int coll)
{
    return enqueue(dev, stream, us * 1000, coll, 0, K_KERNEL, NULL);
}

/* A point in `stream` where it waits on the host (cuStreamWaitValue32/64, cuLaunchHostFunc): the
 * stream's later work (the context's: its entries run in launch order) runs only once released. */
CUresult stub_exec_hold(int dev, const void *stream, uint64_t *seq)
{
    return enqueue(dev, stream, 0, 0, 1, K_KERNEL, seq);
}

void stub_exec_release(int dev, uint64_t seq)
{
    dev = lane(dev);
    if (dev < 0 || dev >= NCARDS || attach()) return;
    uint64_t t = now_ns();
    enter();
    advance(t);
    struct ctx *c = my_ctx(dev, 0);
    if (c && seq >= c->head && seq < c->tail && entry_of(c, seq)->ready == NEVER) {
        entry_of(c, seq)->ready = t;
        cards[dev].busy |= 1u << (c - cards[dev].ctx);
    }
    leave();
    flush();
}

/* Whether everything before entry `seq` of this process's context on card `dev` is done. */
int stub_exec_reached(int dev, uint64_t seq)
{
    dev = lane(dev);
    if (dev < 0 || dev >= NCARDS || attach()) return 1;
    enter();
    advance(now_ns());
    struct ctx *c = my_ctx(dev, 0);
    int reached = !c || c->head >= seq;
    leave();
    flush();
    return reached;
}

/* Wait for this process's work on card `dev`: all of it (stream NULL_ALL), or one stream's. */
CUresult stub_exec_sync(int dev, const void *stream, int all)
{
    dev = lane(dev);
    if (dev < 0 || dev >= NCARDS) return STUB_INVALID_VALUE;
    if (attach()) return STUB_OK;
    enter();
    struct ctx *c = my_ctx(dev, 0);
    uint64_t ticket = !c ? 0 : all ? c->tail : ticket_of(c, stream);
    leave();
    if (ticket) wait_for(dev, ticket, -1, 0);
    else flush();
    return STUB_OK;
}

/* Whether the stream's work on card `dev` is done (all: the context's). */
int stub_exec_idle(int dev, const void *stream, int all)
{
    dev = lane(dev);
    if (dev < 0 || dev >= NCARDS || attach()) return 1;
    enter();
    advance(now_ns());
    struct ctx *c = my_ctx(dev, 0);
    int idle = !c || c->head >= (all ? c->tail : ticket_of(c, stream));
    leave();
    flush();
    return idle;
}

/* ---- marks (events): a point in a stream, done when the card reaches it ---- */

static pthread_mutex_t marks_lock = PTHREAD_MUTEX_INITIALIZER;
static struct stub_mark **pending;  /* this process's unresolved marks (their entry may be overwritten) */
static size_t npending, cap_pending;

static void forget(struct stub_mark *m)  /* (marks_lock held) */
{
    for (size_t i = 0; i < npending; i++)
        if (pending[i] == m) {
            pending[i] = pending[--npending];
            return;
        }
}

/* Under the lock: m is resolved if the card reached it (its time then known). */
static int resolve(struct stub_mark *m)
{
    if (m->done) return 1;
    struct ctx *c = my_ctx(m->dev, 0);
    if (!c || c->head >= m->ticket) {  /* (its time: the card's timestamp of its record's entry) */
        if (c && m->ticket && c->tail - (m->ticket - 1) <= RING)
            m->at = entry_of(c, m->ticket - 1)->stamp;
        m->done = 1;
    }
    return m->done;
}

void stub_exec_overwritten(int dev, uint64_t seq)  /* (the exec lock held) */
{
    if (seq < RING) return;
    pthread_mutex_lock(&marks_lock);
    for (size_t i = 0; i < npending;)
        if (pending[i]->dev == dev && pending[i]->ticket && pending[i]->ticket - 1 <= seq - RING) {
            struct stub_mark *m = pending[i];
            resolve(m);  /* (done: the entry it waits for was complete before its slot is taken) */
            pending[i] = pending[--npending];
        } else
            i++;
    pthread_mutex_unlock(&marks_lock);
}

/* Record m in `stream` on card `dev`: done when the work launched into the stream before it is. */
CUresult stub_exec_mark(struct stub_mark *m, int dev, const void *stream)
{
    dev = lane(dev);
    if (dev < 0 || dev >= NCARDS) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&marks_lock);
    forget(m);
    pthread_mutex_unlock(&marks_lock);
    uint64_t t = now_ns();
    *m = (struct stub_mark){.dev = dev, .at = t - t % STAMP_NS, .recorded = 1};
    if (attach()) {
        m->done = 1;
        return STUB_OK;
    }
    for (uint64_t host = t + event_host_ns(); now_ns() < host;)
        ;  /* (the driver call's own time on the host) */
    enter();
    advance(now_ns());
    struct ctx *c = my_ctx(dev, 0);
    int behind = c && c->head < ticket_of(c, stream);
    if (!behind) {  /* the stream's work all done: reached at once */
        m->at = c ? stamp_of(&cards[dev], c, now_ns()) : m->at;
        m->done = 1;
        leave();
        return STUB_OK;
    }
    leave();
    /* Behind work: its record is an entry of the stream (it costs the card time; a programmatic
     * dependent launch after it no longer follows its kernel straight) */
    uint64_t seq = 0;
    CUresult r = enqueue(dev, stream, event_card_ns(), 0, 0, K_MARK, &seq);
    if (r) return r;
    enter();
    advance(now_ns());
    c = my_ctx(dev, 0);
    m->ticket = c ? seq + 1 : 0;
    if (!resolve(m)) {
        pthread_mutex_lock(&marks_lock);
        if (npending == cap_pending) {
            size_t cap = cap_pending * 2 + 16;
            struct stub_mark **more = realloc(pending, cap * sizeof *more);
            if (more) {
                pending = more;
                cap_pending = cap;
            }
        }
        if (npending < cap_pending) pending[npending++] = m;
        pthread_mutex_unlock(&marks_lock);
    }
    leave();
    return STUB_OK;
}

/* Whether m is done (advancing the card first). */
int stub_exec_mark_done(struct stub_mark *m)
{
    if (!m->recorded || m->done) return 1;
    if (attach()) return 1;
    enter();
    advance(now_ns());
    int done = resolve(m);
    if (done) {
        pthread_mutex_lock(&marks_lock);
        forget(m);
        pthread_mutex_unlock(&marks_lock);
    }
    leave();
    flush();
    return done;
}

void stub_exec_mark_wait(struct stub_mark *m)
{
    if (stub_exec_mark_done(m)) return;
    wait_for(m->dev, m->ticket, -1, 0);
    stub_exec_mark_done(m);
}

void stub_exec_mark_drop(struct stub_mark *m)
{
    pthread_mutex_lock(&marks_lock);
    forget(m);
    pthread_mutex_unlock(&marks_lock);
}

/* At exit: this process's queued work finishes (its log then whole), its records freed; work that
 * cannot end (a half of a collective whose peer never came) is given up after EXIT_WAIT_NS, and
 * dropped once the process is gone. */
#define EXIT_WAIT_NS 30000000000ull
__attribute__((destructor)) static void at_exit(void)
{
    if (!cards || mapped_by != getpid()) return;
    for (int d = 0; d < NCARDS; d++) {
        enter();
        struct ctx *c = my_ctx(d, 0);
        uint64_t ticket = c ? c->tail : 0;
        leave();
        if (c && wait_for(d, ticket, -1, now_ns() + EXIT_WAIT_NS))
            fprintf(stderr, "stand-in libcuda: the process's queued work on card %d did not end within %d s of its "
                            "exit (a collective's peer never launched?): dropped\n", d, (int)(EXIT_WAIT_NS / 1000000000));
    }
    flush();
    enter();
    for (int d = 0; d < NCARDS; d++) {
        struct ctx *c = my_ctx(d, 0);
        if (c && c->lost)
            fprintf(stderr, "stand-in libcuda: %llu pieces of kernels on card %d not logged (CGPU_STUB_CUDA_LOG: "
                            "its record full, the log not reachable)\n", (unsigned long long)c->lost, d);
        if (c && c->head == c->tail) c->owner = 0;
    }
    leave();
}

/* ---- a launch (libcuda.c's cuLaunchKernel and the others, cuda_graphs.c's cuGraphLaunch) ----
 * CGPU_STUB_COLLECTIVE=1 (or a group's name): every kernel of the process is half of a collective
 * across cards 0 and 1 (above). CGPU_STUB_CUDA_FAST=1: launches free and instant (to time what an interposer adds). */
static int collective(void)
{
    const char *c = getenv("CGPU_STUB_COLLECTIVE");
    return c && *c && strcmp(c, "0");  /* (1: the process's own halves; a name: a group of processes, above) */
}

/* a kernel of `us` µs launched by this process into `stream` on the thread's current card (pdl: a
 * programmatic dependent launch, overlapping the tail of the kernel straight before it in the stream) */
CUresult stub_run_kernel_as(uint64_t us, const void *stream, int pdl)
{
    const char *fast = getenv("CGPU_STUB_CUDA_FAST");
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (fast && *fast == '1') return STUB_OK;
    int coll = collective();
    int dev = stub_current_device();
    if (coll && dev > 1) return STUB_INVALID_VALUE;
    if (dev < 0 || dev >= NCARDS) return STUB_INVALID_VALUE;
    if (attach()) return STUB_OUT_OF_MEMORY;
    return enqueue(dev, stream, us * 1000, coll, 0, pdl && !coll ? K_PDL : K_KERNEL, NULL);
}
CUresult stub_run_kernel(uint64_t us, const void *stream) { return stub_run_kernel_as(us, stream, 0); }
