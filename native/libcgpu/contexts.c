/*
 * libcgpu, compute: the contexts the process launches in, and their page GPU (cgpu_compute.h).
 */
#include <signal.h>
#include <string.h>
#include <time.h>

#include "cgpu_compute.h"

/* ctx_lock guards the table below, and is held only while it is read or changed, or while the drain
 * uses a context's queues (bounded by the drain's deadline): never across a driver call that may wait
 * for the card (issue 45, item 1: a synchronize under it waited for a collective's half whose peer's
 * launch waited for the lock). The syncer marks the one context it synchronizes (`syncing`) instead;
 * whoever destroys a context waits for that mark to go (ctx_cv), as the driver's destroy would wait
 * for the same work. */
pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ctx_cv = PTHREAD_COND_INITIALIZER;
#define CTXS 64
static CUcontext ctxs[CTXS];
static int ctx_gpu[CTXS];  /* the page's GPU of each (-1: past the page's) */
static CUdevice ctx_dev[CTXS];  /* its CUDA device (-1: not asked: a page with the one gate) */
static int nctxs;
static CUcontext syncing;        /* the context the syncer synchronizes now (NULL: none) */
static CUdevice syncing_dev = -1;
/* captures begun and not ended, by context (handles.c's wrappers of cuStreamBeginCapture and
 * cuStreamEndCapture): a context with one is never synchronized by the syncer */
static struct { CUcontext c; int n; } caps[CTXS];
unsigned contexts_epoch;  /* counts the contexts forgotten: a thread's cache of an older epoch is looked up again */
HOT_TLS CUcontext known_ctx;
HOT_TLS int known_gpu;
HOT_TLS unsigned ctx_known, gpu_known;
/* the calling thread's last few contexts and their page GPUs (issue 45, item 10): a thread that
 * drives several GPUs in turn (DataParallel's, MirroredStrategy's loop) looks them up here, with no
 * lock and no driver call; forgotten all at once when any context is */
#define SEEN 4
static HOT_TLS struct { CUcontext c; int gpu; } seen[SEEN];
HOT_TLS unsigned contexts_seen_epoch;
static HOT_TLS unsigned seen_next;

/* The page GPU the calling thread launches on (its current context's device), -1 for the
 * container's gate: a page without per-GPU gates, or a device past the page's. The current context
 * is the one the thread's last wrapped switch left (contexts_switched), else asked of the driver
 * (cuCtxGetCurrent: a thread that never switched through libcgpu, or a context forgotten since); a
 * context's device is asked once (until a context is destroyed: its address may come back for
 * another device), and the context listed for the drain at its first launch. */
int note_context_slow(void)
{
    unsigned epoch = __atomic_load_n(&contexts_epoch, __ATOMIC_ACQUIRE);  /* (before the context: a later
                                                                           * forgetting makes it asked again) */
    if (contexts_seen_epoch != epoch) {
        memset(seen, 0, sizeof seen);
        contexts_seen_epoch = epoch;
    }
    CUcontext c = known_ctx;
    if (ctx_known != 1 + epoch) {
        c = NULL;
        if (!real.ctx_get || real.ctx_get(&c) != CU_OK || !c) {
            ctx_known = gpu_known = 0;
            return per_gpu ? 0 : -1;  /* (no context: the driver refuses the launch itself) */
        }
        known_ctx = c;
        ctx_known = 1 + epoch;
    }
    for (int i = 0; i < SEEN; i++)
        if (seen[i].c == c) {
            known_gpu = seen[i].gpu;
            gpu_known = 1 + epoch;
            return known_gpu;
        }
    CUdevice dev = -1;
    int k = -1;
    if (per_gpu && real.ctx_get_device && real.ctx_get_device(&dev) == CU_OK)
        k = page_index(dev);
    known_gpu = k;
    gpu_known = 1 + epoch;
    seen[seen_next % SEEN].c = c;
    seen[seen_next++ % SEEN].gpu = k;
    pthread_mutex_lock(&ctx_lock);
    int i = 0;
    while (i < nctxs && ctxs[i] != c)
        i++;
    if (i < nctxs) {
        ctx_gpu[i] = k;  /* (drained with that GPU from now on) */
        ctx_dev[i] = dev;
    } else if (nctxs < CTXS) {  /* (destroyed ones are forgotten: these live) */
        ctx_gpu[nctxs] = k;
        ctx_dev[nctxs] = dev;
        ctxs[nctxs++] = c;
    }
    pthread_mutex_unlock(&ctx_lock);
    return k;
}

/* A wrapped call that may have changed the calling thread's current context returned (whether it
 * succeeded or not): the context the driver left current is asked once, here, off the launch path,
 * and is the thread's known one; its page GPU is looked up at its next launch (seen above, else
 * asked), so a context is still listed for the drain at its first launch, not at a switch. No
 * context current: not known (the next launch asks). */
void contexts_switched(void)
{
    unsigned epoch = __atomic_load_n(&contexts_epoch, __ATOMIC_ACQUIRE);
    CUcontext c = NULL;
    in_driver++;
    int got = real.ctx_get && real.ctx_get(&c) == CU_OK && c;
    in_driver--;
    if (!got) {
        ctx_known = gpu_known = 0;
        return;
    }
    if (c != known_ctx)
        gpu_known = 0;  /* (the same context again: its page GPU, as of its epoch, stays) */
    known_ctx = c;
    ctx_known = 1 + epoch;
}

/* The next epoch (ctx_lock held, or the only thread): never UINT_MAX, whose 1 + is a thread's "not known" */
static void epoch_next(void)
{
    if (__atomic_add_fetch(&contexts_epoch, 1, __ATOMIC_RELEASE) == ~0u)
        __atomic_add_fetch(&contexts_epoch, 1, __ATOMIC_RELEASE);
}

/* The page GPU of context c (ctx_lock held), -2 if it is not known. */
int gpu_of_ctx(CUcontext c)
{
    for (int i = 0; i < nctxs; i++)
        if (ctxs[i] == c)
            return ctx_gpu[i];
    return -2;
}

/* Forget contexts (ctx_lock held): `c` (NULL: every one of CUDA device `dev`; dev -1 with c NULL:
 * every one); those forgotten into gone[] (CTXS at most), their count returned. */
int contexts_forget(CUcontext c, CUdevice dev, CUcontext *gone)
{
    int n = 0;
    for (int i = 0; i < nctxs;) {
        if (c ? ctxs[i] == c : dev < 0 || ctx_dev[i] < 0 || ctx_dev[i] == dev) {
            gone[n++] = ctxs[i];
            nctxs--;
            ctxs[i] = ctxs[nctxs];
            ctx_gpu[i] = ctx_gpu[nctxs];
            ctx_dev[i] = ctx_dev[nctxs];
        } else
            i++;
    }
    epoch_next();
    return n;
}

/* Wait (ctx_lock held) until the syncer is done with context c (NULL: any of device `dev`, -1: any):
 * it synchronizes one at most, and the driver's destroy waits for that work too. */
void contexts_wait(CUcontext c, CUdevice dev)
{
    while (syncing && (c ? syncing == c : dev < 0 || syncing_dev < 0 || syncing_dev == dev))
        pthread_cond_wait(&ctx_cv, &ctx_lock);
}

/* A capture begun (+1) or ended (-1) on a stream of context c (ctx_lock taken). */
void contexts_capture(CUcontext c, int delta)
{
    pthread_mutex_lock(&ctx_lock);
    int i = 0, free_at = -1;
    while (i < CTXS && caps[i].c != c) {
        if (free_at < 0 && !caps[i].n)
            free_at = i;
        i++;
    }
    if (i == CTXS && delta > 0 && free_at >= 0) {
        caps[free_at].c = c;
        i = free_at;
    }
    if (i < CTXS) {
        caps[i].n += delta;
        if (caps[i].n <= 0)
            caps[i].n = 0, caps[i].c = NULL;
    }
    pthread_mutex_unlock(&ctx_lock);
}

/* Whether a stream of context c captures now, as far as the wrappers saw (ctx_lock held). */
static int captured(CUcontext c)
{
    for (int i = 0; i < CTXS; i++)
        if (caps[i].c == c && caps[i].n > 0)
            return 1;
    return 0;
}


/* The contexts' synchronize, by a thread of its own (the syncer): cuCtxSynchronize has no deadline,
 * and the helper answers within one. One request at a time: a closing that finds the syncer still
 * at the one before waits for that (within its deadline) instead of asking again. The syncer is in
 * relaxed capture mode (a synchronize in global mode is a potentially unsafe call that invalidates
 * every global-mode capture of the process's other threads: issue 45, item 2), and never
 * synchronizes a context with a capture on (that invalidates it in every mode: the CUDA Programming
 * Guide, "Prohibited and Unhandled Operations"). */
static pthread_mutex_t sync_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sync_cv = PTHREAD_COND_INITIALIZER;
static int sync_asked = -2, sync_busy;  /* sync_asked: the page GPU asked for (-1: all; -2: none) */
static uint64_t sync_done;               /* requests done */
static pthread_once_t syncer_once = PTHREAD_ONCE_INIT;

/* Synchronize the contexts on page GPU k (-1: all), one at a time, none under the lock. */
static void sync_contexts(int k)
{
    CUcontext todo[CTXS];
    int n = 0;
    pthread_mutex_lock(&ctx_lock);
    for (int i = 0; i < nctxs; i++)
        if (k < 0 || ctx_gpu[i] == k)
            todo[n++] = ctxs[i];
    pthread_mutex_unlock(&ctx_lock);
    for (int j = 0; j < n && real.ctx_push && real.ctx_pop && real.ctx_sync; j++) {
        pthread_mutex_lock(&ctx_lock);
        int i = 0;
        while (i < nctxs && ctxs[i] != todo[j])
            i++;
        int go = i < nctxs && !captured(todo[j]);  /* (still known: not destroyed meanwhile) */
        if (go) {
            syncing = todo[j];
            syncing_dev = ctx_dev[i];
        }
        pthread_mutex_unlock(&ctx_lock);
        if (!go)
            continue;
        CUcontext prev;
        if (real.ctx_push(todo[j]) == CU_OK) {
            real.ctx_sync();
            real.ctx_pop(&prev);
        }
        pthread_mutex_lock(&ctx_lock);
        syncing = NULL;
        syncing_dev = -1;
        pthread_cond_broadcast(&ctx_cv);
        pthread_mutex_unlock(&ctx_lock);
    }
}

static void *syncer(void *arg)
{
    (void)arg;
    int mode = 2;  /* CU_STREAM_CAPTURE_MODE_RELAXED (a driver before capture modes: none is global) */
    if (ev.exchange)
        ev.exchange(&mode);
    pthread_mutex_lock(&sync_lock);
    for (;;) {
        while (sync_asked == -2)
            pthread_cond_wait(&sync_cv, &sync_lock);
        int k = sync_asked;
        sync_asked = -2;
        sync_busy = 1;
        pthread_mutex_unlock(&sync_lock);
        in_driver++;
        sync_contexts(k);
        in_driver--;
        pthread_mutex_lock(&sync_lock);
        sync_busy = 0;
        sync_done++;
        pthread_cond_broadcast(&sync_cv);
    }
    return NULL;
}

static int syncer_ok;
static void start_syncer(void)
{
    int made = -1;  /* (as the helper: more stack when the static TLS does not fit) */
    for (size_t stack = 256 << 10; made && stack <= (64u << 20); stack *= 4)
        made = start_thread(syncer, stack);
    syncer_ok = made == 0;
}

uint64_t contexts_sync_ask(int k)
{
    pthread_once(&syncer_once, start_syncer);
    if (!syncer_ok)
        return 0;
    pthread_mutex_lock(&sync_lock);
    /* (one running now began before this closing: what it finishes may not cover this closing's work;
     * the one asked for now, after it, does) */
    uint64_t want = sync_done + 1 + (sync_busy ? 1 : 0);
    sync_asked = sync_asked == -2 || sync_asked == k ? k : -1;
    pthread_cond_broadcast(&sync_cv);
    pthread_mutex_unlock(&sync_lock);
    return want;
}

int contexts_sync_wait(uint64_t want, int64_t deadline)
{
    if (!want)
        return -1;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    int64_t left = deadline - mono_ns();
    left = left < 0 ? 0 : left > 1000000000000000ll ? 1000000000000000ll : left;  /* (INT64_MAX: none, in effect) */
    int64_t ns = (int64_t)until.tv_nsec + left;
    until.tv_sec += (time_t)(ns / 1000000000);
    until.tv_nsec = (long)(ns % 1000000000);
    pthread_mutex_lock(&sync_lock);
    while (sync_done < want && pthread_cond_timedwait(&sync_cv, &sync_lock, &until) == 0)
        ;
    int r = sync_done >= want ? 0 : -1;
    pthread_mutex_unlock(&sync_lock);
    return r;
}

/* A forked child: no syncer, no context of the parent's, and the locks fresh (a thread of the parent
 * may have held one at the fork: issue 45, item 12). */
void contexts_forked(void)
{
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    ctx_lock = lock;
    sync_lock = lock;
    ctx_cv = cv;
    sync_cv = cv;
    syncer_once = fresh;  /* (no syncer in the child) */
    syncer_ok = 0;
    sync_asked = -2;
    sync_busy = 0;
    nctxs = 0;
    syncing = NULL;
    syncing_dev = -1;
    memset(caps, 0, sizeof caps);
    known_ctx = NULL;
    ctx_known = gpu_known = 0;
    epoch_next();
}
