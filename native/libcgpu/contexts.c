/*
 * libcgpu, compute: the contexts the process launches in, and their page GPU (cgpu_compute.h).
 */
#include "cgpu_compute.h"

pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctxs[64];
static int ctx_gpu[64];  /* the page's GPU of each (-1: past the page's) */
static int nctxs;
HOT_TLS CUcontext known_ctx;
HOT_TLS int known_gpu;

/* The page GPU the calling thread launches on (its current context's device), -1 for the
 * container's gate: a page without per-GPU gates, or a device past the page's. The device is
 * asked at every launch (a context's address may come back for another device once destroyed). */
int note_context(void)
{
    CUcontext c = NULL;
    if (!real.ctx_get || real.ctx_get(&c) != CU_OK || !c)
        return per_gpu ? 0 : -1;  /* (no context: the driver refuses the launch itself) */
    CUdevice dev = -1;
    int k = -1;
    if (per_gpu && real.ctx_get_device && real.ctx_get_device(&dev) == CU_OK)
        k = page_index(dev);
    if (c == known_ctx && k == known_gpu)
        return k;
    known_ctx = c;
    known_gpu = k;
    pthread_mutex_lock(&ctx_lock);
    int i = 0;
    while (i < nctxs && ctxs[i] != c)
        i++;
    if (i < nctxs)
        ctx_gpu[i] = k;  /* (drained with that GPU from now on) */
    else if (nctxs < (int)(sizeof ctxs / sizeof *ctxs)) {
        ctx_gpu[nctxs] = k;
        ctxs[nctxs++] = c;
    }
    pthread_mutex_unlock(&ctx_lock);
    return k;
}

/* The page GPU of context c (ctx_lock held), -2 if it is not known. */
int gpu_of_ctx(CUcontext c)
{
    for (int i = 0; i < nctxs; i++)
        if (ctxs[i] == c)
            return ctx_gpu[i];
    return -2;
}


void contexts_sync(int k)
{
    for (int i = 0; i < nctxs && real.ctx_push && real.ctx_pop && real.ctx_sync; i++) {
        CUcontext prev;
        if ((k < 0 || ctx_gpu[i] == k) && real.ctx_push(ctxs[i]) == CU_OK) {
            real.ctx_sync();
            real.ctx_pop(&prev);
        }
    }
}

void contexts_forked(void)
{
    nctxs = 0;
    known_ctx = NULL;
}
