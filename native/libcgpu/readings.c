/*
 * libcgpu, memory: the daemon's readings of the driver's own memory applied to the slots (cgpu_memory.h;
 * docs/memory.md, "The driver's own memory"), below memory.c (which calls it; it calls nothing of the
 * memory files).
 *
 * After its context the driver's memory for a process grows through no call we see (modules loaded
 * at a kernel's first launch, library handles, graph instantiation: +66 and +70 MiB on an H100,
 * issue 28). The daemon's watchdog writes NVML's figure for the process into its record every look,
 * with what the process had allocated through us just before; the driver's own is the difference.
 * The process holds the larger of its own account and NVML's figure plus what it allocated since.
 * Less than before is given back only when two readings in a row say so (a free between the
 * daemon's two reads makes one reading low). The growth between two readings sizes the headroom.
 *
 * Who applies a reading (issue 45, item 7): a growth, the process itself at its next call (the
 * driver took it for that process: its next allocation is refused for it). A shrink, whichever
 * process of the instance looks first — the slot's own at its next call, or a sibling at its
 * cuMemGetInfo or before refusing an allocation — so a process asleep after its reading lowered
 * its charge leaves its siblings the room at once (before, they got out-of-memory and a low
 * cuMemGetInfo until it woke). How far each slot's readings were applied is in the page (struct
 * cgpu_usage_follow); on an older page, in this process for its own slot only, as before.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "cgpu_memory.h"

static struct cgpu_follow own;  /* (an older page's: this process's own slot) */

/* `delta` of the driver's own memory charged to slot k on GPU g. A shrink only as far as the slot
 * holds it (a dead slot's, given back meanwhile by its reclaimer, holds nothing): 1 done, else 0. */
static int charge_slot(unsigned k, int g, int64_t delta)
{
    uint64_t *held = &usage->procs[k].held[g];
    if (delta < 0) {
        uint64_t h = __atomic_load_n(held, __ATOMIC_ACQUIRE), d = (uint64_t)-delta;
        do {
            if (h < d)
                return 0;
        } while (!__atomic_compare_exchange_n(held, &h, h - d, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    } else
        __atomic_add_fetch(held, (uint64_t)delta, __ATOMIC_ACQ_REL);
    __atomic_add_fetch(&usage->used[g], (uint64_t)delta, __ATOMIC_ACQ_REL);
    if (drv)
        __atomic_add_fetch(&drv->procs[k].driver[g], (uint64_t)delta, __ATOMIC_ACQ_REL);
    return 1;
}

void charge_driver(int g, int64_t delta)
{
    charge_slot((unsigned)(mine - usage->procs), g, delta);
}

/* The slot's progress, taken (never waited for: a live holder applies it now; a dead one's is taken
 * over). */
static int progress_lock(struct cgpu_follow *f)
{
    uint32_t me = (uint32_t)getpid(), held = 0;
    if (__atomic_compare_exchange_n(&f->lock, &held, me, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 1;
    if (held == me || kill((pid_t)held, 0) == 0 || errno != ESRCH)
        return 0;
    return __atomic_compare_exchange_n(&f->lock, &held, me, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static void progress_unlock(struct cgpu_follow *f)
{
    __atomic_store_n(&f->lock, 0, __ATOMIC_RELEASE);
}

static struct cgpu_follow *progress(unsigned k, int self)
{
    return follows ? &follows->procs[k] : self ? &own : NULL;
}

int readings_new(unsigned k, int self)
{
    struct cgpu_follow *f = progress(k, self);
    if (!f || !drv)
        return 0;
    uint32_t seq = __atomic_load_n(&drv->procs[k].seq, __ATOMIC_ACQUIRE);
    uint64_t claim = idents ? __atomic_load_n(&idents->procs[k].claim, __ATOMIC_ACQUIRE) : 0;
    return seq && !(seq & 1)
           && (__atomic_load_n(&f->applied, __ATOMIC_ACQUIRE) != seq || __atomic_load_n(&f->claim, __ATOMIC_ACQUIRE) != claim);
}

unsigned readings_apply(unsigned k, int self)
{
    struct cgpu_follow *f = progress(k, self);
    struct cgpu_driver *r = drv ? &drv->procs[k] : NULL;
    int32_t pid = __atomic_load_n(&usage->procs[k].pid, __ATOMIC_ACQUIRE);
    if (!f || !r || pid <= 0 || !readings_new(k, self))
        return 0;
    uint32_t seq = __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE);
    uint64_t claim = idents ? __atomic_load_n(&idents->procs[k].claim, __ATOMIC_ACQUIRE) : 0;
    uint64_t nvml[CGPU_MAX_GPUS], allocs[CGPU_MAX_GPUS];
    int32_t rpid = __atomic_load_n(&r->pid, __ATOMIC_ACQUIRE);
    uint64_t rclaim = idents ? __atomic_load_n(&idents->procs[k].read_claim, __ATOMIC_ACQUIRE) : 0;
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        nvml[g] = __atomic_load_n(&r->nvml[g], __ATOMIC_ACQUIRE);
        allocs[g] = __atomic_load_n(&r->allocs[g], __ATOMIC_ACQUIRE);
    }
    if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != seq || rpid != pid || rclaim != claim)
        return 0;  /* (being written, or a reading of the slot's previous process: its pid may be this
                    * one's, an exec'd image's or a reused pid's; its claim is not) */
    if (!progress_lock(f))
        return 0;
    if (f->claim != claim) {  /* (the slot's previous taking's progress) */
        f->applied = f->read_before = 0;
        memset(f->last_want, 0, sizeof f->last_want);
        f->claim = claim;
    }
    unsigned gpus = 0;
    for (int g = 0; !self && f->applied != seq && g < (int)limits->ngpus; g++)
        if (nvml[g] && nvml[g] - (nvml[g] > allocs[g] ? allocs[g] : nvml[g])
                           > __atomic_load_n(&r->driver[g], __ATOMIC_ACQUIRE)) {
            progress_unlock(f);
            return 0;  /* (a growth: the slot's own process applies it, at its next call) */
        }
    if (f->applied != seq) {
        f->applied = seq;
        for (int g = 0; g < (int)limits->ngpus; g++) {
            if (!nvml[g])
                continue;  /* (NVML lists it on no such GPU) */
            uint64_t want = nvml[g] > allocs[g] ? nvml[g] - allocs[g] : 0;
            uint64_t have = __atomic_load_n(&r->driver[g], __ATOMIC_ACQUIRE);
            uint64_t keep = want > f->last_want[g] ? want : f->last_want[g];
            f->last_want[g] = want;
            if (want > have) {
                uint64_t grew = want - have, step = __atomic_load_n(&drv->step[g], __ATOMIC_ACQUIRE);
                charge_slot(k, g, (int64_t)grew);
                while ((f->read_before & (1u << g)) && grew > step  /* (the first reading's may be its whole context) */
                       && !__atomic_compare_exchange_n(&drv->step[g], &step, grew, 0, __ATOMIC_ACQ_REL,
                                                       __ATOMIC_ACQUIRE))
                    ;
            } else if (keep < have)
                charge_slot(k, g, -(int64_t)(have - keep));
            f->read_before |= 1u << g;
            gpus |= 1u << g;
        }
    }
    progress_unlock(f);
    return gpus;
}

void readings_siblings(void)
{
    if (!follows || !drv || !usage)
        return;
    for (unsigned k = 0; k < CGPU_MAX_PROCS; k++)
        if (&usage->procs[k] != mine && __atomic_load_n(&usage->procs[k].pid, __ATOMIC_ACQUIRE) > 0)
            readings_apply(k, 0);
}

void readings_forked(void)
{
    memset(&own, 0, sizeof own);
}
