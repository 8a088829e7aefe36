/*
 * The stand-in card's executor, this process's side (issue 45's house: cuda_exec.c split by
 * subject, no behaviour changed): its contexts on the cards and their streams' queues, an MPS
 * client's lanes, what the driver's entry points call (a launch, a hold, a synchronize, a query),
 * events (marks), and the process's exit. What the card does with the queues — the shared file,
 * time-slicing, switches, collectives, the kernel log — is cuda_exec.c's, below this file.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cuda_exec.h"

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
