/*
 * libcgpu, compute: the gate words, and a gang's launches counted (cgpu_compute.h).
 */
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu_compute.h"

/* ---- a gang: a container's GPUs opened and closed together (docs/isolation.md, "Gangs") ----
 *
 * A collective kernel (NCCL's all-reduce, ...) on one GPU spins until its peers on the
 * container's other GPUs have run: with gates per GPU, a container open on one GPU and closed on
 * another would spin away its slice there, and the drain of the open one would wait for a kernel
 * that cannot end. So a launch on GPU k waits for GPU k's gate and the container's gate, which
 * the daemon keeps closed while any of the container's GPUs' gates is (cgpu_page.h): the
 * container's launches run only while it holds all the GPUs it is active on. (GPUs it does not
 * use are never held closed: an idle instance is not.) CGPU_GANG=0 in the container: each GPU on
 * its own (for processes that share nothing across GPUs; it changes only the container's own time).
 *
 * A closing can still fall between two halves of a collective (a rank launched its half, the
 * peer's launch comes after the gate closed): the peer's launch is let through while its helper
 * answers that closing, if its GPU is behind the instance's most-launched GPU of the gang (ranks
 * launch the same sequence), at most GANG_CATCH_UP launches per GPU per closing; the helper waits
 * up to GANG_WAIT_NS (and never past its drain bound) for them before it drains. The ranks may be
 * threads of one process or processes of the container, one per GPU, as torchrun and DeepSpeed
 * start them (issue 34): every process counts its launches per GPU in its slot of the usage file's
 * gang block (cgpu_page.h), and "behind" compares with every gated slot's counts. A page of an older
 * cgpud has no such block: a process then compares only its own GPUs. GPUs more than
 * 2 * GANG_CATCH_UP launches apart are not ranks of one collective: each process counts its own
 * as even from there (each helper rebases its slot, so the instance's counts meet again). What
 * runs so is the instance's own work, charged to it by its timing events. */
#define GANG_CATCH_UP 4
#define GANG_WAIT_NS 20000000ll
static int gang_off = -1;  /* CGPU_GANG=0 (read at the first launch) */
static struct cgpu_usage_gang *shared_gang;   /* the usage file's gang block (NULL: an older cgpud's page) */
static struct cgpu_gang own_gang;              /* this process's counts where there is none */
static struct cgpu_gang *my_gang = &own_gang;  /* this process's slot's, or own_gang */
static unsigned catch_up_used[CGPU_MAX_GPUS];
static int catch_up_open;                      /* the helper answers a closing: catch-up allowed */
unsigned launching[1 + CGPU_MAX_GPUS];

/* Whether a thread of this process is inside a launch on page GPU k (-1: the container's gate): in
 * its record (threads.c), or counted here (a thread with no record). */
int launches_in_flight(int k)
{
    return cgpu_launching(k) || __atomic_load_n(&launching[1 + k], __ATOMIC_SEQ_CST);
}


void futex_wake_all(const uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* A gang (ganged(), cgpu_compute.h): gates per GPU, CGPU_GANG not 0, and more than one GPU in the
 * page (a page of one GPU has no gang: its container's gate closes and opens with that GPU's). Set
 * at the first launch (gang_init): the launch path reads a word. */
int gang_on;

static uint64_t count(const struct cgpu_gang *g, uint32_t j)
{
    return __atomic_load_n(&g->launched[j], __ATOMIC_SEQ_CST) - __atomic_load_n(&g->base[j], __ATOMIC_SEQ_CST);
}

/* The instance's counts: the most and the fewest launches counted on any GPU of any gated slot (of
 * this process alone without the shared block); 0 and 0 when nobody launched. */
static void spread(uint64_t *most, uint64_t *fewest)
{
    *most = 0;
    *fewest = UINT64_MAX;
    for (uint32_t s = 0; s < (shared_gang ? CGPU_MAX_PROCS : 1); s++) {
        const struct cgpu_proc *p = shared_gang ? &usage->procs[s] : mine;
        const struct cgpu_gang *g = shared_gang ? &shared_gang->procs[s] : my_gang;
        if (shared_gang && (!(__atomic_load_n(&usage->gated_slots[s / 32], __ATOMIC_RELAXED) >> (s % 32) & 1)
                            || !__atomic_load_n(&p->pid, __ATOMIC_RELAXED)))
            continue;
        uint32_t on = __atomic_load_n(&p->gpus, __ATOMIC_SEQ_CST) & ~CGPU_PROC_DRAINING;
        for (uint32_t j = 0; j < limits->ngpus; j++)
            if (on & (1u << j)) {
                uint64_t n = count(g, j);
                *most = n > *most ? n : *most;
                *fewest = n < *fewest ? n : *fewest;
            }
    }
    if (*fewest == UINT64_MAX)
        *fewest = 0;
}

/* How far page GPU `k` of this process is behind the instance's most-launched GPU of the gang; 0
 * when more than 2 * GANG_CATCH_UP apart: no collective in flight spans that many launches, so it is
 * no rank of one (issue 44: a slot of the usage page, the container's to write, that says 2^40
 * launches made every process of the instance a rank behind, let through each closing). */
static uint64_t behind(int k)
{
    uint64_t most, fewest, mine_k = count(my_gang, (uint32_t)k);
    spread(&most, &fewest);
    return most > mine_k && most - mine_k <= 2 * GANG_CATCH_UP ? most - mine_k : 0;
}

/* A launch on GPU k let through a closed gate: it completes a collective a closing cut in half. */
static int catch_up(int k)
{
    if (!__atomic_load_n(&catch_up_open, __ATOMIC_SEQ_CST) || !behind(k))
        return 0;
    return __atomic_add_fetch(&catch_up_used[k], 1, __ATOMIC_SEQ_CST) <= GANG_CATCH_UP;
}

/* Whether the GPUs this process launches on are even (or caught up as far as allowed). */
static int caught_up(void)
{
    uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST);
    for (uint32_t j = 0; j < limits->ngpus; j++)
        if (on & (1u << j) && behind((int)j) && __atomic_load_n(&catch_up_used[j], __ATOMIC_SEQ_CST) < GANG_CATCH_UP)
            return 0;
    return 1;
}

/* No launch of this process on the GPUs `on` is in flight (one that passed the gate before it
 * closed counts its GPU only once it returns: only then are the counts to compare). */
static int settled(uint32_t on)
{
    for (uint32_t j = 0; j < limits->ngpus; j++)
        if (on & (1u << j) && launches_in_flight((int)j))
            return 0;
    return 1;
}

/* Sleep while `word` still reads `seen` (any change wakes it). */
void futex_wait_on(const uint32_t *word, uint32_t seen)
{
    /* (a read-only shared mapping: the futex is keyed by the file, so the daemon's wake reaches it) */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, NULL, NULL, 0);
}

/* The usage file's gang block, mapped (NULL: an older cgpud's page). */
static void map_gang(void)
{
    shared_gang = usage_block(sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver)
                              + sizeof(struct cgpu_usage_busy), sizeof(struct cgpu_usage_gang));
}

void gang_init(void)
{
    const char *g = getenv("CGPU_GANG");
    gang_off = g && !strcmp(g, "0");
    __atomic_store_n(&gang_on, per_gpu && !gang_off && limits->ngpus > 1, __ATOMIC_RELAXED);
    static pthread_once_t mapped = PTHREAD_ONCE_INIT;
    if (per_gpu)
        pthread_once(&mapped, map_gang);
    struct cgpu_gang *mg = shared_gang && mine ? &shared_gang->procs[mine - usage->procs] : &own_gang;
    for (uint32_t j = 0; j < CGPU_MAX_GPUS; j++)  /* (a slot another process had: its counts are not ours) */
        __atomic_store_n(&mg->base[j], __atomic_load_n(&mg->launched[j], __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
    my_gang = mg;
}

int gang_pass(int k)
{
    if ((gate_value(k) & gate_value(-1) & 1) || catch_up(k)) {
        __atomic_add_fetch(&my_gang->launched[k], 1, __ATOMIC_SEQ_CST);
        return 1;
    }
    return 0;
}

/* The GPUs the instance's gated processes launch on (this process's alone without the shared block). */
static uint32_t instance_gpus(void)
{
    uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST);
    for (uint32_t s = 0; shared_gang && s < CGPU_MAX_PROCS; s++)
        if (__atomic_load_n(&usage->gated_slots[s / 32], __ATOMIC_RELAXED) >> (s % 32) & 1
            && __atomic_load_n(&usage->procs[s].pid, __ATOMIC_RELAXED))
            on |= __atomic_load_n(&usage->procs[s].gpus, __ATOMIC_SEQ_CST);
    return on & ~CGPU_PROC_DRAINING;
}

int gang_catching_up(void)
{
    return __atomic_load_n(&catch_up_open, __ATOMIC_SEQ_CST);
}

void gang_catch_up(uint32_t on, int64_t deadline)
{
    uint32_t all = instance_gpus();
    if (!(all & (all - 1)) || !on)
        return;  /* (the instance on one GPU: no collective to complete) */
    uint64_t most, fewest;
    spread(&most, &fewest);
    if (most - fewest > 2 * GANG_CATCH_UP)  /* more apart than collectives in flight: not ranks of one; even from here */
        for (uint32_t k = 0; k < CGPU_MAX_GPUS; k++)
            __atomic_store_n(&my_gang->base[k], __atomic_load_n(&my_gang->launched[k], __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
    memset(catch_up_used, 0, sizeof catch_up_used);
    threads_fence();  /* (the records as of the closing; what a launch let through since stores is seen within
                       * the loop's looks, and the drain's own fence sees every one before it waits) */
    __atomic_store_n(&catch_up_open, 1, __ATOMIC_SEQ_CST);
    int64_t start = mono_ns(), now = start, woke = 0;
    int64_t until = start + GANG_WAIT_NS < deadline ? start + GANG_WAIT_NS : deadline;
    while (!(settled(on) && caught_up()) && now < until) {
        if (now >= woke + 50000) {  /* the launches waiting: look again (every 50 µs) */
            futex_wake_all(&limits->gate);
            for (uint32_t k = 0; k < limits->ngpus; k++)
                if (on & (1u << k))
                    futex_wake_all(&limits->gpu_gate[k]);
            woke = now;
        }
        if (now - start < 200000)
            sched_yield();  /* (a peer's launch is usually microseconds away) */
        else {
            struct timespec t = {0, 50000};
            nanosleep(&t, NULL);
        }
        now = mono_ns();
    }
    __atomic_store_n(&catch_up_open, 0, __ATOMIC_SEQ_CST);  /* (the drain then waits for those in flight) */
}

void gang_forked(void)
{
    memset(launching, 0, sizeof launching);
    memset(&own_gang, 0, sizeof own_gang);
    my_gang = &own_gang;  /* (the parent's slot's counts are the parent's: the child's own at its first launch) */
    catch_up_open = 0;
}
