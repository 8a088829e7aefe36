/*
 * libcgpu, compute: the gate words, and a gang's launches counted (cgpu_compute.h).
 */
#include <limits.h>
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
 * A closing can still fall between two halves of a collective (a thread launched its half, the
 * peer's launch comes after the gate closed): the peer's launch is let through while the helper
 * answers that closing, if its GPU is behind the process's most-launched GPU of the gang (ranks
 * launch the same sequence), at most GANG_CATCH_UP launches per GPU per closing; the helper waits
 * up to GANG_WAIT_NS for them before it drains. GPUs more than 2 * GANG_CATCH_UP launches apart are
 * not ranks of one collective: they count as even from there. */
#define GANG_CATCH_UP 4
#define GANG_WAIT_NS 20000000ll
static int gang_off = -1;  /* CGPU_GANG=0 (read at the first launch) */
static unsigned long launched[CGPU_MAX_GPUS];  /* this process's launches on each page GPU */
static unsigned long base[CGPU_MAX_GPUS];      /* ... when a closing last found them far apart */
static unsigned catch_up_used[CGPU_MAX_GPUS];
static int catch_up_open;                      /* the helper answers a closing: catch-up allowed */
unsigned launching[1 + CGPU_MAX_GPUS];


/* The gate a launch on page GPU `k` waits at (-1: the container's). */
const uint32_t *gate_word(int k)
{
    return k >= 0 ? &limits->gpu_gate[k] : &limits->gate;
}

uint32_t gate_value(int k)
{
    return __atomic_load_n(gate_word(k), __ATOMIC_SEQ_CST);
}

void futex_wake_all(const uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int ganged(void)
{
    return per_gpu && !gang_off;
}

/* How far page GPU `k` is behind this process's most-launched GPU of the gang (counted from `base`). */
static unsigned long behind(int k)
{
    uint32_t on = __atomic_load_n(&mine->gpus, __ATOMIC_SEQ_CST);
    unsigned long most = 0, mine_k = __atomic_load_n(&launched[k], __ATOMIC_SEQ_CST) - base[k];
    for (uint32_t j = 0; j < limits->ngpus; j++)
        if (on & (1u << j)) {
            unsigned long n = __atomic_load_n(&launched[j], __ATOMIC_SEQ_CST) - base[j];
            most = n > most ? n : most;
        }
    return most > mine_k ? most - mine_k : 0;
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
        if (on & (1u << j) && __atomic_load_n(&launching[1 + j], __ATOMIC_SEQ_CST))
            return 0;
    return 1;
}

/* Sleep while `word` still reads `seen` (any change wakes it). */
void futex_wait_on(const uint32_t *word, uint32_t seen)
{
    /* (a read-only shared mapping: the futex is keyed by the file, so the daemon's wake reaches it) */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, NULL, NULL, 0);
}

void gang_init(void)
{
    const char *g = getenv("CGPU_GANG");
    gang_off = g && !strcmp(g, "0");
}

int gang_pass(int k)
{
    if ((gate_value(k) & gate_value(-1) & 1) || catch_up(k)) {
        __atomic_add_fetch(&launched[k], 1, __ATOMIC_SEQ_CST);
        return 1;
    }
    return 0;
}

int gang_catching_up(void)
{
    return __atomic_load_n(&catch_up_open, __ATOMIC_SEQ_CST);
}

void gang_catch_up(uint32_t on)
{
    uint32_t apart = 0;
    for (uint32_t k = 0; k < limits->ngpus; k++)
        if (on & (1u << k) && behind((int)k) > 2 * GANG_CATCH_UP)
            apart = 1;
    if (apart)  /* more apart than collectives in flight: the ranks launch differently; even from here */
        for (uint32_t k = 0; k < limits->ngpus; k++)
            base[k] = __atomic_load_n(&launched[k], __ATOMIC_SEQ_CST);
    memset(catch_up_used, 0, sizeof catch_up_used);
    __atomic_store_n(&catch_up_open, 1, __ATOMIC_SEQ_CST);
    int64_t start = mono_ns(), now = start, woke = 0;
    while (!(settled(on) && caught_up()) && now < start + GANG_WAIT_NS) {
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
    memset(launched, 0, sizeof launched);
    memset(base, 0, sizeof base);
    catch_up_open = 0;
}
