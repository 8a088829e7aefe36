/*
 * libcgpu, the pages (cgpu_page.h): mapping the container's pages, a process slot of its own,
 * a dead process's memory back to the container, and which GPU of the page a CUDA device is.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cgpu_internal.h"

#ifndef F_OFD_GETLK  /* (Linux 3.15; glibc's headers name them from 2.20, the build's are 2.17's) */
#define F_OFD_GETLK 36
#define F_OFD_SETLK 37
#endif

const struct cgpu_limits *limits;
int per_gpu;
int has_uuids;
static int dev_page[64];   /* per CUDA device: its page GPU once known; -2 not asked yet, -3 no UUID */
static int uuids_in_page(void);
struct cgpu_usage *usage;
struct cgpu_usage_driver *drv;
struct cgpu_usage_busy *gpu_time;
struct cgpu_usage_ident *idents;
struct cgpu_usage_follow *follows;
struct cgpu_proc *mine;
int asked;
char why[8192];
char page_dir[4096];

static int alive(int32_t pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH);
}

/* ---- who a slot's process is: its start time and PID namespace (cgpu_page.h, struct cgpu_ident) -- */

/* The start time of process `pid` as this process's /proc shows it (field 22 of its stat, clock
 * ticks after boot): 0 when there is no such process, UINT64_MAX when it cannot be told. */
static uint64_t start_of(int32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ESRCH ? 0 : UINT64_MAX;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    int e = errno;
    close(fd);
    if (n <= 0)
        return n < 0 && e == ESRCH ? 0 : UINT64_MAX;
    buf[n] = 0;
    const char *at = strrchr(buf, ')');  /* "pid (comm) S ppid ...": fields 3 on after the name */
    for (int field = 2; at && field < 22; field++)
        at = strchr(at + 1, ' ');
    if (!at)
        return UINT64_MAX;
    char *end;
    unsigned long long v = strtoull(at + 1, &end, 10);
    return end == at + 1 ? UINT64_MAX : (uint64_t)v;
}

static uint64_t my_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* 1: the slot's record says it was taken by another process than the one `pid` is now (gone, or a
 * pid reused), as far as this process can tell (its PID namespace the slot's); else 0. */
static int slot_reused(const struct cgpu_proc *p, int32_t pid)
{
    if (!idents)
        return 0;
    const struct cgpu_ident *id = &idents->procs[p - usage->procs];
    uint64_t start = __atomic_load_n(&id->start, __ATOMIC_ACQUIRE), ns = __atomic_load_n(&id->pidns, __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&id->pid, __ATOMIC_ACQUIRE) != pid || !start || !ns || ns != my_pidns())
        return 0;  /* (not recorded, being recorded, or another namespace's pid) */
    uint64_t now = start_of(pid);
    return now != UINT64_MAX && now != start;
}

/* This process's record in its new slot `k` (before the slot shows its pid). */
static void record_ident(unsigned k)
{
    if (!idents)
        return;
    struct cgpu_ident *id = &idents->procs[k];
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t claim = (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
    uint64_t start = start_of(getpid());
    __atomic_store_n(&id->pid, (int32_t)getpid(), __ATOMIC_RELEASE);
    __atomic_store_n(&id->start, start == UINT64_MAX ? 0 : start, __ATOMIC_RELEASE);
    __atomic_store_n(&id->pidns, my_pidns(), __ATOMIC_RELEASE);
    __atomic_store_n(&id->claim, claim | 1, __ATOMIC_RELEASE);
}

/* This process's slot's claim (0: none, or an older cgpud's page): a daemon reading is its own only
 * when it carries it. */
uint64_t my_claim(void)
{
    return idents && mine ? __atomic_load_n(&idents->procs[mine - usage->procs].claim, __ATOMIC_ACQUIRE) : 0;
}

/* ---- a slot's liveness: an open-file-description lock (cgpu_page.h, CGPU_SLOTS_LOCKED) ---------
 *
 * Held by the process on its slot's byte CGPU_LIVENESS_BYTE through a descriptor of its own, closed
 * at exec (the exec'd image has no CUDA state: its charges go) and in a forked child (page_forked:
 * the child's copy would keep the parent's lock alive). The kernel drops it when the process dies,
 * however it dies: a SIGKILLed sibling's slot, an exec'd process's, a reused pid's are found dead. */
static int live_fd = -1;   /* the usage page, for the locks */
static int held_byte = -1; /* the slot whose byte this process locks */

static off_t liveness_byte(const struct cgpu_proc *p)
{
    return (off_t)((const char *)p - (const char *)usage) + CGPU_LIVENESS_BYTE;
}

static int liveness_fd(void)
{
    if (live_fd < 0) {
        char path[4200];
        snprintf(path, sizeof path, "%s/usage", page_dir);
        live_fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    return live_fd;
}

/* 1: locked (by this process now), 0: not possible (no descriptor, a file system without locks). */
static int lock_byte(const struct cgpu_proc *p, short type)
{
    int fd = liveness_fd();
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = liveness_byte(p), .l_len = 1};
    return fd >= 0 && fcntl(fd, F_OFD_SETLK, &l) == 0;
}

/* Is a slot's process alive? Where its instance's processes hold liveness locks: exactly while
 * someone locks its byte; elsewhere (an older libcgpu's page): by its pid, as before. */
static int slot_alive(const struct cgpu_proc *p, int32_t pid)
{
    if (drv && (__atomic_load_n(&drv->flags, __ATOMIC_ACQUIRE) & CGPU_SLOTS_LOCKED)) {
        int fd = liveness_fd();
        struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = liveness_byte(p), .l_len = 1};
        if (fd >= 0 && fcntl(fd, F_OFD_GETLK, &l) == 0)  /* (locked: still dead if its pid is another's now,
                                                            * whoever holds its byte) */
            return l.l_type != F_UNLCK && !slot_reused(p, pid);
    }
    return alive(pid) && !slot_reused(p, pid);
}

/* What a slot's process held back to the container, and the slot free. */
static void release(struct cgpu_proc *p)
{
    unsigned k = (unsigned)(p - usage->procs);
    __atomic_fetch_and(&usage->gated_slots[k / 32], ~(1u << (k % 32)), __ATOMIC_ACQ_REL);
    if (drv)  /* (the driver's share is in held: it goes with it) */
        for (int g = 0; g < CGPU_MAX_GPUS; g++)
            __atomic_store_n(&drv->procs[k].driver[g], 0, __ATOMIC_RELEASE);
    for (int g = 0; g < CGPU_MAX_GPUS; g++) {
        uint64_t held = __atomic_exchange_n(&p->held[g], 0, __ATOMIC_ACQ_REL);
        if (held)
            __atomic_sub_fetch(&usage->used[g], held, __ATOMIC_ACQ_REL);
    }
    if (idents) {  /* (its record goes before the slot is free) */
        struct cgpu_ident *id = &idents->procs[k];
        __atomic_store_n(&id->claim, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&id->start, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&id->pid, 0, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&p->pid, 0, __ATOMIC_RELEASE);
    if (p == mine && held_byte >= 0) {  /* (this process's own slot, given back at its exit) */
        lock_byte(p, F_UNLCK);
        held_byte = -1;
    }
}

/* A dead process's memory back to the container: clear its slot first (one finder wins). */
static void reclaim(struct cgpu_proc *p)
{
    int32_t pid = __atomic_load_n(&p->pid, __ATOMIC_ACQUIRE);
    if (pid <= 0 || p == mine || slot_alive(p, pid)
        || !__atomic_compare_exchange_n(&p->pid, &pid, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    release(p);
}

/* Map `size` bytes of the page `name`, or `least` of an older, shorter one (*got: what was mapped). */
static void *map_least(const char *dir, const char *name, size_t size, size_t least, size_t *got, int writable)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, sizeof why, "%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) || (size_t)st.st_size < least) {
        snprintf(why, sizeof why, "%s is not a cgpud page (%lld bytes, %zu wanted)", path,
                 (long long)st.st_size, size);
        close(fd);
        return NULL;
    }
    size = (size_t)st.st_size < size ? least : size;
    *got = size;
    void *p = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(why, sizeof why, "%s: cannot map it: %s", path, strerror(errno));
        return NULL;
    }
    return p;
}

/* A free slot of the usage page for this process (NULL if all are taken). */
static struct cgpu_proc *claim_slot(void)
{
    for (int i = 0; i < CGPU_MAX_PROCS; i++) {
        int32_t zero = 0;
        if (__atomic_load_n(&usage->procs[i].pid, __ATOMIC_RELAXED) != 0)
            continue;
        /* its liveness lock first: a reader never sees the slot taken and its byte unlocked; then the
         * slot held as being taken (-1: nobody else takes or reclaims it) while its record is written,
         * so a reader never sees this pid beside the record of the slot's previous process */
        int locked = drv && lock_byte(&usage->procs[i], F_RDLCK);
        if (__atomic_compare_exchange_n(&usage->procs[i].pid, &zero, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            struct cgpu_proc *p = &usage->procs[i];
            record_ident((unsigned)i);
            __atomic_store_n(&p->pid, (int32_t)getpid(), __ATOMIC_RELEASE);
            if (locked) {
                held_byte = i;
                __atomic_fetch_or(&drv->flags, CGPU_SLOTS_LOCKED, __ATOMIC_ACQ_REL);
            }
            if (drv)
                for (int g = 0; g < CGPU_MAX_GPUS; g++)
                    __atomic_store_n(&drv->procs[i].driver[g], 0, __ATOMIC_RELEASE);
            __atomic_store_n(&p->gated, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&p->acked, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&p->gpus, 0, __ATOMIC_RELEASE);
            return p;
        }
        if (locked)
            lock_byte(&usage->procs[i], F_UNLCK);
    }
    return NULL;
}

/* Give back what dead processes held, their slots free again. */
void reclaim_dead(void)
{
    for (int i = 0; i < CGPU_MAX_PROCS; i++)
        reclaim(&usage->procs[i]);
}

/* This process's slot, taken when it first uses CUDA (cuInit, its first allocation or launch),
 * not when the library is loaded or the process forked: a child that never uses CUDA (Python
 * multiprocessing's, a DataLoader worker) takes none, and one that leaves by _exit is found
 * dead and its slot taken back whenever a slot is needed and none is free. 0: none left. */
static pthread_mutex_t slot_lock = PTHREAD_MUTEX_INITIALIZER;
int need_slot_slow(void)
{
    if (__atomic_load_n(&mine, __ATOMIC_ACQUIRE))
        return 1;
    pthread_mutex_lock(&slot_lock);
    struct cgpu_proc *p = __atomic_load_n(&mine, __ATOMIC_ACQUIRE);
    if (!p) {
        reclaim_dead();  /* (the dead first: this pid's own before an exec, a SIGKILLed sibling's) */
        p = claim_slot();
    }
    __atomic_store_n(&mine, p, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&slot_lock);
    if (!p) {
        static int said;
        if (!__atomic_exchange_n(&said, 1, __ATOMIC_ACQ_REL))
            fprintf(stderr, "cgpu: %s/usage has no free process slot (%d processes use the GPU): "
                    "CUDA is refused to this process\n", page_dir, CGPU_MAX_PROCS);
    }
    return p != NULL;
}

/* `size` bytes at offset `at` of the usage file, mapped shared (the offset need not be a page's: the
 * pages around it with it); NULL where the file ends before them (an older cgpud's page). */
void *usage_block(size_t at, size_t size)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/usage", page_dir);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat st;
    void *block = NULL;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), from = at / page * page;
    if (!fstat(fd, &st) && (size_t)st.st_size >= at + size) {
        void *p = mmap(NULL, at - from + size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)from);
        if (p != MAP_FAILED)
            block = (char *)p + (at - from);
    }
    close(fd);
    return block;
}

/* The usage file's ident block (after the gang block). An older cgpud's page ends before it: idents
 * stays NULL. */
static void map_idents(void)
{
    size_t at = sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver) + sizeof(struct cgpu_usage_busy)
                + sizeof(struct cgpu_usage_gang);
    idents = usage_block(at, sizeof(struct cgpu_usage_ident));
    if (idents && drv)  /* (and the readings' progress after it: a page of before issue 45 ends before it) */
        follows = usage_block(at + sizeof(struct cgpu_usage_ident), sizeof(struct cgpu_usage_follow));
}

/* The driver said out of memory to an allocation inside memsize: the card is full, and where memsizes
 * do not overcommit it, of another instance's process past its own memsize — one outside the
 * library (issue 44), which the daemon's watchdog fails at its next look (every 0.5 s). Where the
 * watchdog watches this container, wait for that look, 100 ms at a time, 1.5 s in all, and ask
 * again: 1 to ask again (docs/memory.md, "Memory taken outside the library"). */
int held_elsewhere(int attempt)
{
    if (attempt >= 15 || !drv || !__atomic_load_n(&drv->watched, __ATOMIC_ACQUIRE))
        return 0;
    struct timespec t = {0, 100000000};
    nanosleep(&t, NULL);
    return 1;
}

void page_setup(void)
{
    /* A container's pages (cgpu-runtime's and the hook's mount: a read-only mount point no process of
     * the container can remove) win over the environment, which the container's processes write
     * (issue 44: CGPU_PAGE_DIR naming a page of its own made a process ungated and unlimited).
     * CGPU_PAGE_DIR names the pages only where there are none at /run/cgpu: outside an instance
     * (`cgpu run` on the host, the tests' harness). */
    const char *dir = getenv("CGPU_PAGE_DIR");
    if (access("/run/cgpu/limits", F_OK) == 0)
        dir = "/run/cgpu";
    asked = dir && *dir;
    if (!asked)
        return;
    snprintf(page_dir, sizeof page_dir, "%s", dir);
    size_t got = 0;
    limits = map_least(dir, "limits", sizeof *limits, CGPU_LIMITS_SHARED_GATE, &got, 0);
    per_gpu = got == sizeof *limits;
    for (int i = 0; i < 64; i++)
        dev_page[i] = -2;
    if (limits && (limits->magic != CGPU_MAGIC || limits->version != CGPU_VERSION
                   || limits->ngpus == 0 || limits->ngpus > CGPU_MAX_GPUS)) {
        snprintf(why, sizeof why, "%s/limits is %s", dir,
                 limits->magic != CGPU_MAGIC ? "not a cgpud page (foreign magic)"
                 : limits->version != CGPU_VERSION ? "of another version of cgpud: restart the container"
                 : "malformed (its GPU count)");
        limits = NULL;
    }
    if (!limits)
        return;
    size_t full = sizeof *usage + sizeof *drv;  /* (an older cgpud's page ends at struct cgpu_usage) */
    usage = map_least(dir, "usage", full + sizeof *gpu_time, sizeof *usage, &got, 1);
    if (usage && got != full + sizeof *gpu_time) {  /* (a page before the GPU time's block: with the driver's, or not) */
        munmap(usage, got);
        usage = map_least(dir, "usage", full, sizeof *usage, &got, 1);
    }
    drv = usage && got >= full ? (struct cgpu_usage_driver *)(usage + 1) : NULL;
    gpu_time = usage && got == full + sizeof *gpu_time ? (struct cgpu_usage_busy *)(drv + 1) : NULL;
    if (usage && (usage->magic != CGPU_MAGIC || usage->version != CGPU_VERSION)) {
        snprintf(why, sizeof why, "%s/usage is not a cgpud usage page of this version", dir);
        usage = NULL;
    }
    if (!usage) {
        limits = NULL;
        drv = NULL;
        gpu_time = NULL;
        return;
    }
    why[0] = 0;
    has_uuids = limits && uuids_in_page();
    if (gpu_time)
        map_idents();
}

/* ---- set up: the driver loaded, then the pages ---------------------------------------------- */

static pthread_once_t once = PTHREAD_ONCE_INIT;
int cgpu_set_up;  /* setup has run (read without pthread_once's call on the allocators' and launches' paths) */
void (*cgpu_on_fork)(void);

static pthread_once_t pages_once = PTHREAD_ONCE_INIT;

/* The pages alone, without loading the driver: what ioctl's filter needs (it may run inside the
 * real NVML, which must not be made to load libcuda from there). */
int pages_ready(void)
{
    pthread_once(&pages_once, page_setup);
    return limits != NULL;
}

static void setup(void)
{
    driver_load();
    pthread_once(&pages_once, page_setup);
    if (asked && cgpu_on_fork)
        pthread_atfork(NULL, NULL, cgpu_on_fork);
    __atomic_store_n(&cgpu_set_up, 1, __ATOMIC_RELEASE);
}

void setup_once(void)
{
    pthread_once(&once, setup);
}

int isolated_slow(void)
{
    pthread_once(&once, setup);
    return limits != NULL;
}

/* At exit the driver frees what the process held: so does its page. */
__attribute__((destructor)) static void give_back(void)
{
    if (mine && usage)
        release(mine);
}

/* A forked child holds nothing: the slot is the parent's; it takes its own if it uses CUDA (and the
 * slots' lock fresh: a parent's thread may have held it at the fork, issue 45, item 12). */
void page_forked(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    slot_lock = fresh;
    mine = NULL;
    if (live_fd >= 0)  /* (the parent's description: its locks are the parent's) */
        close(live_fd);
    live_fd = -1;
    held_byte = -1;
}

/* The page's GPU of a CUDA device. With the GPUs' UUIDs in the page: the one whose UUID the
 * driver gives the device, whatever order CUDA numbers them in (CUDA_DEVICE_ORDER). Without
 * them, from a driver that cannot say a UUID, or for a UUID the page does not name (a MIG
 * device's is its own): device k is GPU k of the page, -1 past the page's (a GPU given whole),
 * as before UUIDs: a device is never less held for them. */

static int uuids_in_page(void)
{
    static const unsigned char zero[16];
    if (!per_gpu)
        return 0;
    for (uint32_t k = 0; k < limits->ngpus; k++)
        if (memcmp(limits->uuid[k], zero, 16))
            return 1;
    return 0;
}

int uuid_to_page(const unsigned char *u)
{
    for (uint32_t k = 0; k < limits->ngpus; k++)
        if (!memcmp(limits->uuid[k], u, 16))
            return (int)k;
    return -1;
}

int page_index(int dev)
{
    if (dev < 0)
        return -1;
    if (dev < 64 && real.device_uuid && has_uuids) {
        int k = __atomic_load_n(&dev_page[dev], __ATOMIC_RELAXED);
        if (k == -2) {
            unsigned char u[16];
            k = real.device_uuid(u, dev) == CU_OK ? uuid_to_page(u) : -3;
            k = k == -1 ? -3 : k;
            __atomic_store_n(&dev_page[dev], k, __ATOMIC_RELAXED);
        }
        if (k != -3)
            return k;
    }
    return (uint32_t)dev < limits->ngpus ? dev : -1;
}

/* The page's GPU of the calling thread's current context (see page_index). */
int current_gpu(void)
{
    CUdevice dev = 0;
    if (!real.ctx_get_device || real.ctx_get_device(&dev) != CU_OK)
        return 0;  /* (no context yet: the driver refuses the allocation itself) */
    return page_index(dev);
}