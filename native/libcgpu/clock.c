/*
 * libcgpu, compute: the clocks, the bounded wait for an event, and the library's threads (cgpu_compute.h).
 */
#include <sched.h>
#include <signal.h>
#include <time.h>

#include "cgpu_compute.h"

int64_t drain_bound_ns(void)
{
    uint32_t us = limits ? __atomic_load_n(&limits->drain_bound_us, __ATOMIC_RELAXED) : 0;
    if (!us)
        us = 20000;  /* (an older cgpud's page: its default, two 10 ms slices) */
    int64_t ns = (int64_t)us * 750;  /* three quarters of it, in ns */
    return ns < 1000000 ? 1000000 : ns > 5000000000ll ? 5000000000ll : ns;  /* (1 ms to the daemon's 5 s cap) */
}

int64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000ll + t.tv_nsec;
}

/* The launch path's clock, for its one question (were the launches into a stream a tick apart?):
 * the CPU's own counter (x86-64's TSC, aarch64's virtual counter: 9 ns on the machine it was
 * written on, where a vDSO clock_gettime took 21) in ns by a rate measured against CLOCK_MONOTONIC
 * over the first 20 ms it is asked; CLOCK_MONOTONIC until then and on other CPUs. Only its own
 * readings are compared with one another (it drifts from CLOCK_MONOTONIC by the rate's error). */
static inline uint64_t counter(void)
{
#if defined(__x86_64__)
    return __builtin_ia32_rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ volatile("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    return 0;
#endif
}
static uint64_t counter0, counter_rate;  /* counter_rate: ns per count << 24 (0: not known) */
static int64_t counter0_ns;
static int counter_state;                /* 0: not begun, 1: being set, 2: sampling from counter0, 3: known */
int64_t launch_ns(void)
{
    uint64_t rate = __atomic_load_n(&counter_rate, __ATOMIC_ACQUIRE);
    if (__builtin_expect(rate != 0, 1))
        return counter0_ns + (int64_t)(((unsigned __int128)(counter() - counter0) * rate) >> 24);
    int64_t now = mono_ns();
    int st = __atomic_load_n(&counter_state, __ATOMIC_ACQUIRE), busy = 1;
    if (st == 0 && counter() && __atomic_compare_exchange_n(&counter_state, &st, busy, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        counter0 = counter();
        counter0_ns = mono_ns();
        __atomic_store_n(&counter_state, 2, __ATOMIC_RELEASE);
    } else if (st == 2 && now - counter0_ns >= 20000000
               && __atomic_compare_exchange_n(&counter_state, &st, busy, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        uint64_t c = counter();
        int64_t t = mono_ns();
        rate = c > counter0 ? (uint64_t)(((unsigned __int128)(uint64_t)(t - counter0_ns) << 24) / (c - counter0)) : 0;
        __atomic_store_n(&counter_rate, rate, __ATOMIC_RELEASE);
        __atomic_store_n(&counter_state, rate ? 3 : 0, __ATOMIC_RELEASE);
    }
    return now;
}


/* (polled: the first 50 µs yielding, as the driver's default spin does, then asleep between looks,
 * 20 µs doubling up to 200 µs: the wake-up is tens to a couple of hundred µs after the event, about
 * as the driver's blocking sync, and the looks cost little CPU beside the application's threads) */
CUresult event_wait(void *event, int64_t deadline)
{
    int64_t start = mono_ns(), now = start, nap = 20000;
    for (;;) {
        CUresult r = ev.query(event);
        if (r != 600)
            return CU_OK;  /* (done, or an error: nothing to wait for) */
        now = mono_ns();
        if (now >= deadline)
            return 600;
        if (now - start < 50000)
            sched_yield();
        else {
            int64_t left = deadline - now;
            struct timespec t = {0, (long)(left < nap ? left : nap)};
            nanosleep(&t, NULL);
            nap = nap < 100000 ? nap * 2 : 200000;
        }
    }
}

/* A detached thread of the library's running fn: signals blocked in it (they stay with the
 * process's own threads). 0, or pthread_create's error. */
int start_thread(void *(*fn)(void *), size_t stack)
{
    pthread_t t;
    pthread_attr_t a;
    sigset_t all, old;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, stack);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int r = pthread_create(&t, &a, fn, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
    return r;
}
