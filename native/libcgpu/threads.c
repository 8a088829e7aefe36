/*
 * libcgpu, bottom layer: this process's threads as the launch path sees them (cgpu_internal.h,
 * "threads.c"; docs/isolation.md, "The launch path").
 *
 * The launch path takes no process-wide lock and writes no word another thread writes (issue 45,
 * item 10): what other threads must know of a launch — that it is inside the gate of page GPU k
 * (the drain waits for it), or that it reads the module table (a table retired meanwhile is not
 * freed under it) — it says in a record of its own, one cache line per thread. The records are
 * listed once, at each thread's first launch, and never freed: a thread's record is reused by a
 * later thread once it has exited. Whoever needs to know walks the list (the helper at a closing,
 * a writer of the module table at a retirement: seldom).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu_internal.h"

static struct cgpu_thread *threads;  /* the list (pushed at its head, never shortened) */
__thread struct cgpu_thread *cgpu_me __attribute__((tls_model("initial-exec")));
static pthread_key_t exit_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

/* A thread exits: its record is free for the next (nothing of it in flight: it is outside libcgpu). */
static void thread_gone(void *rec)
{
    struct cgpu_thread *t = rec;
    __atomic_store_n(&t->gate, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&t->hazard, NULL, __ATOMIC_RELEASE);
    if (cgpu_me == t)
        cgpu_me = NULL;
    __atomic_store_n(&t->live, 0, __ATOMIC_RELEASE);
}

static void make_key(void)
{
    if (pthread_key_create(&exit_key, thread_gone))
        exit_key = (pthread_key_t)-1;
}

/* The calling thread's record, listed the first time (NULL: no host memory for one). */
struct cgpu_thread *cgpu_thread_slow(void)
{
    struct cgpu_thread *t;
    for (t = __atomic_load_n(&threads, __ATOMIC_ACQUIRE); t; t = t->next) {
        uint32_t free_ = 0;
        if (__atomic_compare_exchange_n(&t->live, &free_, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            break;  /* (an exited thread's: reused) */
    }
    if (!t) {
        void *mem = NULL;
        if (posix_memalign(&mem, 64, sizeof *t))
            return NULL;
        t = mem;
        memset(t, 0, sizeof *t);
        t->live = 1;
        t->next = __atomic_load_n(&threads, __ATOMIC_RELAXED);
        while (!__atomic_compare_exchange_n(&threads, &t->next, t, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
            ;
    }
    pthread_once(&key_once, make_key);
    if (exit_key != (pthread_key_t)-1)
        pthread_setspecific(exit_key, t);  /* (its destructor frees the record for reuse) */
    cgpu_me = t;
    return t;
}

struct cgpu_thread *cgpu_threads(void)
{
    return __atomic_load_n(&threads, __ATOMIC_ACQUIRE);
}

/* ---- the asymmetric fence ----
 * A launch says it is inside the gate (its record) and then reads the gate; the helper reads the
 * closed gate and then the records. Each side needs a full fence between its store and its load
 * (else a launch may read the gate open while the helper misses its record). The launch path's
 * fence, a locked instruction at every launch, is moved to the helper's side: with
 * membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) (Linux 4.14; the userspace RCU's "membarrier"
 * flavour) every running thread of the process passes a full memory barrier before the call
 * returns (a thread not running passed one when it was switched out), so after it the helper sees
 * every record stored before that thread's barrier, and every launch past its barrier sees the gate
 * as the helper saw it. Registered at the helper's start; where the kernel or a seccomp profile
 * refuses it, the launch path keeps its own fence (cgpu_asym 0). */
#ifndef SYS_membarrier
#if defined(__x86_64__)
#define SYS_membarrier 324
#elif defined(__aarch64__)
#define SYS_membarrier 283
#endif
#endif
enum { MEMBARRIER_PRIVATE_EXPEDITED = 1 << 3, MEMBARRIER_REGISTER_PRIVATE_EXPEDITED = 1 << 4 };
int cgpu_asym;

void threads_asym_register(void)
{
#ifdef SYS_membarrier
    if (!__atomic_load_n(&cgpu_asym, __ATOMIC_ACQUIRE)
        && syscall(SYS_membarrier, MEMBARRIER_REGISTER_PRIVATE_EXPEDITED, 0) == 0
        && syscall(SYS_membarrier, MEMBARRIER_PRIVATE_EXPEDITED, 0) == 0)
        __atomic_store_n(&cgpu_asym, 1, __ATOMIC_SEQ_CST);
#endif
}

void threads_fence(void)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#ifdef SYS_membarrier
    if (__atomic_load_n(&cgpu_asym, __ATOMIC_ACQUIRE))
        syscall(SYS_membarrier, MEMBARRIER_PRIVATE_EXPEDITED, 0);
#endif
}

/* Whether a thread is inside a launch past the gate of page GPU k (-1: the container's). A caller
 * that saw the gate closed, then called threads_fence(), and then finds none: every later launch
 * sees it closed (each says where it is, then reads the gate: gate.c, gate_enter). */
int cgpu_launching(int k)
{
    for (struct cgpu_thread *t = cgpu_threads(); t; t = t->next)
        if (__atomic_load_n(&t->gate, __ATOMIC_SEQ_CST) == (uint32_t)(2 + k))
            return 1;
    return 0;
}

/* Whether a thread reads table `p` now (a hazard: it is not freed under the reader). */
int cgpu_hazard(const void *p)
{
    for (struct cgpu_thread *t = cgpu_threads(); t; t = t->next)
        if (__atomic_load_n(&t->hazard, __ATOMIC_SEQ_CST) == p)
            return 1;
    return 0;
}

/* A forked child has one thread, the forking one: every other record is free (what they were in
 * was the parent's). Its memory is its own: no membarrier registration (its helper registers). */
void threads_forked(void)
{
    cgpu_asym = 0;
    for (struct cgpu_thread *t = cgpu_threads(); t; t = t->next)
        if (t != cgpu_me) {
            t->gate = 0;
            t->hazard = NULL;
            t->live = 0;
        }
    if (cgpu_me) {
        cgpu_me->gate = 0;
        cgpu_me->hazard = NULL;
    }
}
