/*
 * libcgpu, compute: the GPU-time charge (docs/scheduler.md, "The charge: GPU time"). A run of a
 * stream's queued work is bracketed by timing events (queue.c); the GPU time between two of them,
 * once the later is complete, is added to the slot's counter of the run's GPU, which the daemon
 * charges the step by.
 */
#include "cgpu_compute.h"

int64_t charge_run(int gpu, void *from, void *to)
{
    float ms = 0;
    if (!ev.elapsed || !from || !to)
        return 0;
    int mode = 2, relaxed = ev.exchange && ev.exchange(&mode) == CU_OK;  /* (another thread's global capture) */
    int got = ev.elapsed(&ms, from, to) == CU_OK;
    if (relaxed)
        ev.exchange(&mode);
    if (!got || ms <= 0)
        return 0;
    int64_t ns = (int64_t)((double)ms * 1e6);  /* (the driver's clock, not the host's) */
    if (gpu_time && mine && gpu >= 0 && gpu < CGPU_MAX_GPUS)
        __atomic_add_fetch(&gpu_time->procs[mine - usage->procs].ns[gpu], (uint64_t)ns, __ATOMIC_RELAXED);
    return ns;
}

void charge_timed(void)
{
    if (!gpu_time || !mine)
        return;
    unsigned k = (unsigned)(mine - usage->procs);
    gpu_time->procs[k].pid = mine->pid;
    __atomic_store_n(&gpu_time->procs[k].timed, 1, __ATOMIC_SEQ_CST);
}
