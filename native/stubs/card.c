/*
 * The stand-in card model's bottom (cuda_stub.h has the layers): the cards and their memory, and
 * what this process's driver knows of them. It calls nothing else of the stand-in.
 *
 * CGPU_STUB_CUDA_DEVICES cards of CGPU_STUB_CUDA_MIB MiB each (default 1 of 15109, a T4), whose
 * memory is shared by every process using them: their state is a file (CGPU_STUB_CUDA_STATE,
 * default /tmp/cgpu-stub-cuda.state) holding each card's bytes in use, changed under flock, and a
 * record per (process, card) of what it holds (NVML's per-process view, libnvidia-ml.c, reads
 * it). The driver's own memory for a process (modules' code, a graph's resources) is taken here
 * too. And the process's driver state: cuInit called, each thread's current card.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "cuda_stub.h"

/* ---- this process's driver: cuInit called, each thread's current card ---- */
static int inited;
static __thread int cur_dev;
int stub_inited(void) { return inited; }
void stub_set_inited(void) { inited = 1; }
int stub_current_device(void) { return cur_dev; }
void stub_set_current_device(int dev) { cur_dev = dev; }

/* ---- this process's contexts: one per card, by generation (issue 34, cuda_stub.h) ---- */
static unsigned ctx_gen[16];
static int ctx_dead[16], ctx_refs[16];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
unsigned stub_ctx_gen(int dev) { return dev >= 0 && dev < 16 ? __atomic_load_n(&ctx_gen[dev], __ATOMIC_SEQ_CST) : 0; }
int stub_ctx_alive(int dev, unsigned gen)
{
    return dev >= 0 && dev < 16 && gen == __atomic_load_n(&ctx_gen[dev], __ATOMIC_SEQ_CST)
        && !__atomic_load_n(&ctx_dead[dev], __ATOMIC_SEQ_CST);
}
int stub_ctx_dead(int dev) { return dev >= 0 && dev < 16 && __atomic_load_n(&ctx_dead[dev], __ATOMIC_SEQ_CST); }
void stub_ctx_retain(int dev)
{
    if (dev < 0 || dev >= 16) return;
    pthread_mutex_lock(&ctx_lock);
    ctx_dead[dev] = 0;
    ctx_refs[dev]++;
    pthread_mutex_unlock(&ctx_lock);
}
int stub_ctx_release(int dev)
{
    if (dev < 0 || dev >= 16) return 0;
    pthread_mutex_lock(&ctx_lock);
    int last = ctx_refs[dev] > 0 && !--ctx_refs[dev] && !ctx_dead[dev];
    pthread_mutex_unlock(&ctx_lock);
    return last;
}
void stub_ctx_kill(int dev)
{
    if (dev < 0 || dev >= 16) return;
    pthread_mutex_lock(&ctx_lock);
    if (!ctx_dead[dev]) {
        ctx_dead[dev] = 1;
        ctx_refs[dev] = 0;
        __atomic_add_fetch(&ctx_gen[dev], 1, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&ctx_lock);
}
/* A test's pause inside a call: with <var>=<path> set, the call makes <path>.in and waits for
 * <path>.go before it goes on (whatever the calling library holds meanwhile, a test can see). */
void stub_paused(const char *var)
{
    const char *at = getenv(var);
    char in[4200], go[4200];
    if (!at || !*at) return;
    snprintf(in, sizeof in, "%s.in", at);
    snprintf(go, sizeof go, "%s.go", at);
    int fd = open(in, O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) close(fd);
    while (access(go, F_OK) != 0) {
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}
/* CGPU_STUB_ALLOC_PAUSE=<path>: an allocation that has its memory from the card (NVML shows it)
 * pauses inside the call: a test reads the process as the daemon does while the call is in flight
 * (an allocation straddling a reading), or sees what other threads do meanwhile (a stream-ordered
 * allocation that grew its pool pauses so too, the stand-in's pools unlocked: cuda_pools.c). */
void stub_alloc_pause(void) { stub_paused("CGPU_STUB_ALLOC_PAUSE"); }
void stub_misuse(const char *call, const char *what)
{
    const char *strict = getenv("CGPU_STUB_STRICT_HANDLES");
    if (!strict || *strict != '1') return;
    fprintf(stderr, "stand-in libcuda: %s used %s (undefined behaviour in the driver): aborting\n", call, what);
    abort();
}

/* ---- the cards ---- */
uint64_t stub_card_bytes(void)
{
    const char *m = getenv("CGPU_STUB_CUDA_MIB");
    return (uint64_t)(m && *m ? strtoull(m, NULL, 10) : 15109) << 20;
}

/* CGPU_STUB_CUDA_DEVICES cards (default 1), each of the same size; a thread's current
 * device is its current context's (cuCtxSetCurrent, cuCtxCreate, cuCtxPushCurrent),
 * device 0 until it makes one current. In the state file, card d keeps its bytes in use
 * at 16*d and when it is next free at 16*d + 8. */
int stub_device_count(void)
{
    const char *n = getenv("CGPU_STUB_CUDA_DEVICES");
    int v = n && *n ? atoi(n) : 1;
    return v < 1 ? 1 : v > 16 ? 16 : v;
}

/* ---- their memory ---- */
/* The state file and the kernel log, opened once per process and kept (a launch is then
 * a lock, a read and a write, as cheap as a stand-in can make it). A forked child opens
 * its own: flock's lock belongs to the open file, which the child would share. */
static pthread_mutex_t kernel_files_lock = PTHREAD_MUTEX_INITIALIZER;
static int kernel_state_fd = -1, kernel_log_fd = -1;
static pid_t kernel_files_pid;
static char kernel_files_named[2][4096];  /* the paths they were opened by (the environment may change) */

static int kernel_files(int *log_fd)
{
    const char *p = getenv("CGPU_STUB_CUDA_STATE"), *log = getenv("CGPU_STUB_CUDA_LOG");
    p = p && *p ? p : "/tmp/cgpu-stub-cuda.state";
    log = log ? log : "";
    pthread_mutex_lock(&kernel_files_lock);
    if (kernel_files_pid != getpid() || strcmp(p, kernel_files_named[0]) || strcmp(log, kernel_files_named[1])) {
        if (kernel_state_fd >= 0) close(kernel_state_fd);
        if (kernel_log_fd >= 0) close(kernel_log_fd);
        kernel_state_fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        kernel_log_fd = *log ? open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666) : -1;
        snprintf(kernel_files_named[0], sizeof kernel_files_named[0], "%s", p);
        snprintf(kernel_files_named[1], sizeof kernel_files_named[1], "%s", log);
        kernel_files_pid = kernel_state_fd >= 0 ? getpid() : 0;
    }
    int fd = kernel_state_fd;
    *log_fd = kernel_log_fd;
    pthread_mutex_unlock(&kernel_files_lock);
    return fd;
}

/* The card's state file: card d keeps its bytes in use at 16*d and when it is next free at
 * 16*d + 8; after the records, per record {what it held before its last change, when it changed
 * (CLOCK_MONOTONIC ns)}: NVML's figure lags by CGPU_STUB_NVML_LAG_MS; from PROC_AT, a record per (process, card) of what it holds there, so that, as the
 * real driver does, what a dead process held comes back to the card (looked for when an
 * allocation would not fit, and when someone asks) and NVML's per-process view can show it
 * (libnvidia-ml.c's `cuda` line). */
#define PROC_AT 256
#define NRECORDS 1024
struct record { int32_t pid, dev; uint64_t bytes; };

static int state_fd(void)
{
    int log_fd;
    return kernel_files(&log_fd);  /* (opened once per process, kept) */
}

static uint64_t read_word(int fd, off_t at)
{
    uint64_t v = 0;
    return pread(fd, &v, sizeof v, at) == sizeof v ? v : 0;
}

static int alive_pid(int32_t pid) { return pid > 0 && !(kill(pid, 0) && errno == ESRCH); }

/* Under the lock: add `delta` to process `pid`'s record for card `dev`. */
static void note_held_by(int fd, int32_t pid, int dev, int64_t delta)
{
    static pid_t cached_pid;
    static int cached[16];
    pid_t me = getpid();
    struct record r;
    if (cached_pid != me) {
        cached_pid = me;
        for (int d = 0; d < 16; d++) cached[d] = -1;
    }
    int i = pid == me ? cached[dev] : -1;
    if (i < 0 || pread(fd, &r, sizeof r, PROC_AT + i * (off_t)sizeof r) != sizeof r || r.pid != pid || r.dev != dev) {
        static struct record all[NRECORDS];
        ssize_t n = pread(fd, all, sizeof all, PROC_AT);
        int free_at = -1;
        i = -1;
        for (int k = 0; k < NRECORDS; k++) {
            int there = n > 0 && k < n / (ssize_t)sizeof *all;
            if (there && all[k].pid == pid && all[k].dev == dev) { i = k; break; }
            if (free_at < 0 && (!there || all[k].pid == 0)) free_at = k;
        }
        if (i < 0 && (i = free_at) < 0)
            return;  /* (no record left: the card's total still counts it) */
        if (pread(fd, &r, sizeof r, PROC_AT + i * (off_t)sizeof r) != sizeof r || r.pid != pid || r.dev != dev)
            r = (struct record){pid, dev, 0};
        if (pid == me) cached[dev] = i;
    }
    /* NVML's figure lags (libnvidia-ml.c, CGPU_STUB_NVML_LAG_MS): what the record said before this
     * change, and when it changed, after the records */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t before[2] = {r.pid == pid ? r.bytes : 0, (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec};
    if (pwrite(fd, before, sizeof before, PROC_AT + NRECORDS * (off_t)sizeof r + i * (off_t)sizeof before)
        != sizeof before) { /* (best effort) */ }
    r.bytes = delta < 0 && (uint64_t)-delta > r.bytes ? 0 : r.bytes + (uint64_t)delta;
    if (!r.bytes) r.pid = 0;
    if (pwrite(fd, &r, sizeof r, PROC_AT + i * (off_t)sizeof r) != sizeof r) { /* (best effort) */ }
    if (!r.bytes && pid == me) cached[dev] = -1;
}
static void note_held(int fd, int dev, int64_t delta) { note_held_by(fd, getpid(), dev, delta); }

/* ---- memory shared between processes (cuMemExportToShareableHandle, cuda_memory.c) ----
 * NVIDIA's driver API reference, cuMemRelease: "The memory allocation will be freed when all
 * outstanding mappings to the memory are unmapped and when all outstanding references to the handle
 * (including it's shareable counterparts) are also released", and "Each time a recipient process
 * imports a shareable handle, it needs to pair it with cuMemRelease". So an exported allocation is
 * kept on the card, from byte SHARED_AT of the state file, with every process holding it (a holder:
 * a process whose own handle of it is neither released nor unmapped everywhere, once per import)
 * and its owner, the one holder whose record (NVML's per-process view) shows its bytes: its creator
 * while the creator holds it, then another holder (the stand-in's reading of the driver's
 * accounting: the memory shows once, on a process that holds it; docs/memory.md, "Memory shared
 * between processes"). It leaves the card when its last holder lets go, or dies. */
#define SHARED_AT (1 << 16)
#define NSHARED 256
#define SHARED_HOLDERS 14  /* (the stand-in's bound: an import past it is CUDA_ERROR_INVALID_VALUE) */
struct shared { uint64_t id, bytes; int32_t dev, owner; int32_t holders[SHARED_HOLDERS]; };

static int shared_read(int fd, int k, struct shared *e)
{
    if (pread(fd, e, sizeof *e, SHARED_AT + k * (off_t)sizeof *e) != sizeof *e) memset(e, 0, sizeof *e);
    return e->id != 0;
}
static void shared_write(int fd, int k, const struct shared *e)
{
    if (pwrite(fd, e, sizeof *e, SHARED_AT + k * (off_t)sizeof *e) != sizeof *e) { /* (best effort) */ }
}
/* Under the lock: `e`'s holders less those `gone` says are gone; its owner, if gone, is the first left
 * (its bytes moved to that one's record); none left: the entry is cleared, and the bytes leave the
 * card with the last (*freed: 1; a dead owner's record gives them back itself when swept). */
static void shared_settle(int fd, int k, struct shared *e, int (*gone)(int32_t pid, void *arg), void *arg,
                          int owner_swept)
{
    int n = 0;
    for (int j = 0; j < SHARED_HOLDERS; j++)
        if (e->holders[j] && !gone(e->holders[j], arg)) e->holders[n++] = e->holders[j];
    for (int j = n; j < SHARED_HOLDERS; j++) e->holders[j] = 0;
    int owner_left = 0;
    for (int j = 0; j < n; j++) owner_left |= e->holders[j] == e->owner;
    if (!n) {  /* the last holder let go: the memory leaves the card (unless the sweep gives it back) */
        if (!owner_swept) {
            uint64_t used = read_word(fd, 16 * e->dev);
            used = e->bytes > used ? 0 : used - e->bytes;
            if (pwrite(fd, &used, sizeof used, 16 * e->dev) != sizeof used) { /* (best effort) */ }
            note_held_by(fd, e->owner, e->dev, -(int64_t)e->bytes);
        }
        memset(e, 0, sizeof *e);
    } else if (!owner_left) {  /* its owner let go: another holder shows it */
        note_held_by(fd, e->owner, e->dev, -(int64_t)e->bytes);
        e->owner = e->holders[0];
        note_held_by(fd, e->owner, e->dev, (int64_t)e->bytes);
    }
    shared_write(fd, k, e);
}
static int is_dead(int32_t pid, void *arg) { (void)arg; return !alive_pid(pid); }

/* Under the lock: give back what dead processes held (what they shared with living ones moved to
 * one of those first: its memory stays on the card). */
static void sweep_dead(int fd)
{
    static struct record r[NRECORDS];
    struct shared e;
    for (int k = 0; k < NSHARED; k++)
        if (shared_read(fd, k, &e)) {
            int any = 0;
            for (int j = 0; j < SHARED_HOLDERS; j++) any |= e.holders[j] && !alive_pid(e.holders[j]);
            if (any) shared_settle(fd, k, &e, is_dead, NULL, !alive_pid(e.owner));
        }
    ssize_t n = pread(fd, r, sizeof r, PROC_AT);
    for (ssize_t i = 0; n > 0 && i < n / (ssize_t)sizeof *r; i++)
        if (r[i].pid > 0 && !alive_pid(r[i].pid)) {
            uint64_t used = read_word(fd, 16 * r[i].dev);
            used = r[i].bytes > used ? 0 : used - r[i].bytes;
            struct record none = {0, 0, 0};
            if (pwrite(fd, &used, sizeof used, 16 * r[i].dev) != sizeof used
                || pwrite(fd, &none, sizeof none, PROC_AT + i * (off_t)sizeof none) != sizeof none)
                return;
        }
}

static pthread_mutex_t card_lock = PTHREAD_MUTEX_INITIALIZER;  /* (flock on one open file: not between threads) */
/* add `delta` to the bytes in use on card `dev` if it has room; 0 or -1 (*used_out: the bytes in use after) */
int stub_card_memory(int dev, int64_t delta, uint64_t *used_out)
{
    int fd = state_fd();
    if (fd < 0)
        return -1;
    pthread_mutex_lock(&card_lock);
    /* an MPS client's pinned device memory limit (cuda_mps.c): what it holds on the card, no more */
    static pid_t mine_pid;
    static uint64_t mine[16];
    if (mine_pid != getpid()) {
        mine_pid = getpid();
        memset(mine, 0, sizeof mine);
    }
    if (delta > 0 && dev >= 0 && dev < 16 && mine[dev] + (uint64_t)delta > stub_mps_mem_limit(dev)) {
        pthread_mutex_unlock(&card_lock);
        return -1;
    }
    flock(fd, LOCK_EX);
    uint64_t used = read_word(fd, 16 * dev);
    if ((delta > 0 && used + (uint64_t)delta > stub_card_bytes()) || (delta == 0 && used_out)) {
        sweep_dead(fd);  /* (a dead process's memory is the card's again) */
        used = read_word(fd, 16 * dev);
    }
    int rc = 0;
    if (delta > 0 && used + (uint64_t)delta > stub_card_bytes())
        rc = -1;
    else if (delta) {
        used = delta < 0 && (uint64_t)-delta > used ? 0 : used + (uint64_t)delta;
        if (pwrite(fd, &used, sizeof used, 16 * dev) != sizeof used)
            rc = -1;
        else
            note_held(fd, dev, delta);
    }
    if (used_out)
        *used_out = used;
    if (!rc && delta && dev >= 0 && dev < 16)
        mine[dev] = delta < 0 && (uint64_t)-delta > mine[dev] ? 0 : mine[dev] + (uint64_t)delta;
    flock(fd, LOCK_UN);
    pthread_mutex_unlock(&card_lock);
    return rc;
}

/* The card's state file locked for a change of its shared memory (-1: none). */
static int shared_lock(void)
{
    int fd = state_fd();
    if (fd < 0) return -1;
    pthread_mutex_lock(&card_lock);
    flock(fd, LOCK_EX);
    return fd;
}
static void shared_unlock(int fd)
{
    flock(fd, LOCK_UN);
    pthread_mutex_unlock(&card_lock);
}
uint64_t stub_shared_export(int dev, uint64_t bytes)
{
    int fd = shared_lock();
    if (fd < 0) return 0;
    struct shared e;
    uint64_t id = 0;
    for (int k = 0; k < NSHARED && !id; k++)
        if (!shared_read(fd, k, &e)) {
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);  /* (an id never reused while a process may hold an old one) */
            e = (struct shared){.id = ((uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec) << 8 | (uint64_t)k,
                                .bytes = bytes, .dev = dev, .owner = getpid(), .holders = {getpid()}};
            shared_write(fd, k, &e);
            id = e.id;
        }
    shared_unlock(fd);
    return id;
}
int stub_shared_hold(uint64_t id, int *dev, uint64_t *bytes)
{
    int fd = shared_lock(), rc = -1;
    if (fd < 0) return -1;
    struct shared e;
    sweep_dead(fd);
    for (int k = 0; k < NSHARED; k++)
        if (shared_read(fd, k, &e) && e.id == id) {
            for (int j = 0; j < SHARED_HOLDERS && rc; j++)
                if (!e.holders[j]) {
                    e.holders[j] = getpid();
                    shared_write(fd, k, &e);
                    *dev = e.dev;
                    *bytes = e.bytes;
                    rc = 0;
                }
            break;
        }
    shared_unlock(fd);
    return rc;
}
static int is_me_once(int32_t pid, void *arg)
{
    int *left = arg;
    return pid == getpid() && (*left)-- > 0;
}
void stub_shared_drop(uint64_t id)
{
    int fd = shared_lock(), once = 1;
    if (fd < 0) return;
    struct shared e;
    for (int k = 0; k < NSHARED; k++)
        if (shared_read(fd, k, &e) && e.id == id) {
            shared_settle(fd, k, &e, is_me_once, &once, 0);
            break;
        }
    shared_unlock(fd);
}

/* CGPU_STUB_CUDA_FAST=1: allocations do not touch the card's file either (to time what an
 * interposer adds): the card is then as large as it is said to be, for this process alone. */
int stub_memory_is_free(void)
{
    static int fast = -1;
    if (fast < 0) {
        const char *f = getenv("CGPU_STUB_CUDA_FAST");
        fast = f && *f == '1';
    }
    return fast;
}
/* The driver's memory grows after a context is made, through no allocation call (issue 28, on
 * an H100: +66 MiB at cuBLAS's first matmul, its kernels loaded lazily; +70 MiB at a graph's
 * instantiation; a few MiB at a library's or module's load): cuda_modules.c and cuda_graphs.c take
 * it here, from the card, into the process's record (NVML's per-process view). */
int stub_driver_memory(int dev, int64_t delta)
{
    if (!delta || stub_memory_is_free()) return 0;
    return stub_card_memory(dev, delta, NULL);
}
uint64_t stub_growth(const char *name, uint64_t kib)
{
    char var[64];
    snprintf(var, sizeof var, "CGPU_STUB_%s_KIB", name);
    const char *v = getenv(var);
    return (v && *v ? strtoull(v, NULL, 10) : kib) << 10;
}
