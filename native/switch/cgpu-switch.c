/*
 * libcgpu-switch.so: the daemon's native part of the compute gate (docs/isolation.md),
 * loaded by cgpud/sched/native.py through ctypes.
 *
 * 1. Pages (switch/page.c). A container's `limits` and `usage` pages and its `drained` FIFO, opened once (the
 *    limits mapped, the usage read with pread: see struct page), shared (counted references)
 *    by the Python GateFreezer that owns the
 *    instance and by the switcher threads that drive its gates. Every operation on a page
 *    takes its lock: the gate words, the count of closings, which of its GPUs' gates are
 *    closed and with which closing, and the processes given up on.
 *
 * 2. The switcher (here). One thread per GPU carries out a batch of steps the scheduler (trio,
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

#include "page.h"

enum { SWITCH_DRAIN = 0, SWITCH_AHEAD = 1, SWITCH_OVERLAP = 2 };

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
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
    int64_t deadline = begin + s->bound_ns, cap = begin + s->cap_ns, blind = 0;
    int late = -1;
    *why = 0;
    *longer = 0;
    for (int i = 0; i < n; i++) {  /* (a damaged page: its budget's time, not its word) */
        int64_t ns = blind_ns(b->uni[which[i]]);
        blind = ns > blind ? ns : blind;
    }
    blind = begin + (blind < s->bound_ns ? blind : s->bound_ns);
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
        int64_t now = now_ns();
        if (!m && now >= blind)
            return late;
        if (!m) {  /* (only a damaged page's time left) */
            sleep_or_cmd(s, blind);
            pthread_mutex_lock(&s->mu);
            int stop = s->stopping;
            pthread_mutex_unlock(&s->mu);
            if (stop)
                return late;
            continue;
        }
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
