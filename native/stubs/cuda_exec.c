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

#include "cuda_exec.h"


static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* (flock is the open file's: not between threads) */
struct card *cards;
static int fd = -1;
pid_t mapped_by;
uint64_t me;  /* this process's token (a forked child draws its own) */
static int ran_fd = -1;  /* the ".ran" file: what the card ran for each context (NVML's per-process utilisation) */
int log_fd = -1;

uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
void sleep_until(uint64_t ns)
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
uint64_t launch_ns(void) { static int64_t v = -1; if (v < 0) v = (int64_t)env_us("CGPU_STUB_LAUNCH_US", 5); return (uint64_t)v; }
uint64_t depth(void)
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
uint64_t stamp_of(struct card *k, struct ctx *c, uint64_t t)
{
    static int64_t jitter = -1;
    if (jitter < 0) jitter = (int64_t)env_n("CGPU_STUB_STAMP_JITTER_NS", 1000);
    if (exact()) return t;
    uint64_t v = t + (jitter ? draw(k) % (uint64_t)(jitter + 1) : 0);
    v -= v % STAMP_NS;
    if (v < c->last_stamp) v = c->last_stamp;
    return c->last_stamp = v;
}
uint64_t event_card_ns(void)
{
    static int64_t v = -1;
    if (v < 0) v = exact() ? 0 : (int64_t)env_n("CGPU_STUB_EVENT_NS", 1000);
    return (uint64_t)v;
}
uint64_t event_host_ns(void)
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
int attach(void)
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
void enter(void)
{
    pthread_mutex_lock(&lock);
    flock(fd, LOCK_EX);
}
void leave(void)
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
struct entry *entry_of(const struct ctx *c, uint64_t seq) { return &bulk_of(c)->ring[seq % RING]; }
struct entry *head_entry(const struct ctx *c) { return entry_of(c, c->head); }
int has_work(const struct card *k, int i) { return k->busy >> i & 1; }

/* As many of c's logged pieces as fit in buf, as log lines (taken from its record). */
size_t take_lines(struct ctx *c, char *buf, size_t cap)
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
uint64_t next_event(struct card *k)
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
int hold_live(int dev, int i)
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
int ncards(void) { return stub_mps_client() ? NCARDS : stub_device_count(); }  /* (an MPS client: its lanes too) */
void advance(uint64_t t)
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

