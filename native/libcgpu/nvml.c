/*
 * libcgpu, NVML: what nvidia-smi and NVML clients see inside a container (docs/isolation.md, "What
 * nvidia-smi shows"): memsize as the card and the container's usage; its own processes only (the
 * running-process lists of every kind and version, the per-process utilisation samples); its own
 * utilisation (the sum of its processes' samples); never a value that depends on a neighbour's use.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cgpu_internal.h"

enum {
    NVML_OK = 0, NVML_UNINITIALIZED = 1, NVML_INVALID_ARGUMENT = 2, NVML_NOT_SUPPORTED = 3, NVML_NOT_FOUND = 6,
    NVML_INSUFFICIENT_SIZE = 7, NVML_FUNCTION_NOT_FOUND = 13, NVML_MEMORY = 20, NVML_UNKNOWN = 999
};

/* total = memsize, used = the container's usage, free = the rest (never negative) */
/* "GPU-8-4-4-4-12" hex digits (NVML's UUID) into 16 bytes; 0 if it is not one */
static int parse_uuid(const char *text, unsigned char *u)
{
    int n = 0;
    if (strncmp(text, "GPU-", 4))
        return 0;
    for (const char *p = text + 4; *p && n < 32; p++) {
        int v = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10
              : *p >= 'A' && *p <= 'F' ? *p - 'A' + 10 : *p == '-' ? -1 : -2;
        if (v == -2)
            return 0;
        if (v >= 0) {
            u[n / 2] = (unsigned char)(n % 2 ? (u[n / 2] | v) : v << 4);
            n++;
        }
    }
    return n == 32;
}

/* The page's GPU of an NVML device: by UUID when the page names it, else by NVML's index. */
static int nvml_page_index(void *dev)
{
    char text[96];
    unsigned char u[16];
    unsigned int idx;
    int k;
    if (has_uuids && real.nvml_uuid && real.nvml_uuid(dev, text, sizeof text) == NVML_OK && parse_uuid(text, u)
        && (k = uuid_to_page(u)) >= 0)
        return k;
    if (!real.nvml_index || real.nvml_index(dev, &idx) != NVML_OK || idx >= limits->ngpus)
        return -1;
    return (int)idx;
}

static int nvml_view(void *dev, unsigned long long *total, unsigned long long *free_, unsigned long long *used_)
{
    static int swept;
    if (!__atomic_exchange_n(&swept, 1, __ATOMIC_ACQ_REL))
        reclaim_dead();  /* (what killed processes held is not the container's any more) */
    int k = nvml_page_index(dev);
    if (k < 0)
        return 0;
    unsigned int idx = (unsigned int)k;
    uint64_t cap = limits->memsize[idx], used = __atomic_load_n(&usage->used[idx], __ATOMIC_ACQUIRE);
    *total = cap;
    *used_ = used > cap ? cap : used;
    *free_ = cap - *used_;
    return 1;
}

int nvmlDeviceGetMemoryInfo(void *dev, nvmlMemory_t *mem)
{
    setup_once();
    if (asked && !limits)
        return NVML_UNKNOWN;
    if (!real.nvml_mem)
        return NVML_NOT_SUPPORTED;
    int r = real.nvml_mem(dev, mem);
    if (r == NVML_OK && limits)
        nvml_view(dev, &mem->total, &mem->free, &mem->used);
    return r;
}

int nvmlDeviceGetMemoryInfo_v2(void *dev, nvmlMemory_v2_t *mem)
{
    setup_once();
    if (asked && !limits)
        return NVML_UNKNOWN;
    if (!real.nvml_mem2)
        return NVML_NOT_SUPPORTED;
    int r = real.nvml_mem2(dev, mem);
    if (r == NVML_OK && limits && nvml_view(dev, &mem->total, &mem->free, &mem->used))
        mem->reserved = 0;
    return r;
}
/* ---- NVML's per-process view: which is this process, and what it holds ---------------------- */

typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } proc_info;
typedef int (*procs_fn)(void *, unsigned int *, proc_info *);
static procs_fn nvml_procs;
static int (*nvml_count)(unsigned int *);
static int (*nvml_handle)(unsigned int, void **);
static int nvml_up;  /* 1 ready, -1 cannot be */
static unsigned int host_pid;  /* this process's PID as NVML names it (0: not known yet; a PID
                                * namespace's process is named by the host's PID) */

static int nvml_ready(void)
{
    if (nvml_up)
        return nvml_up > 0;
    int (*init)(void) = real.nvml && real_dlsym ? (int (*)(void))real_dlsym(real.nvml, "nvmlInit_v2") : NULL;
    if (init) {
        nvml_count = (int (*)(unsigned int *))real_dlsym(real.nvml, "nvmlDeviceGetCount_v2");
        nvml_handle = (int (*)(unsigned int, void **))real_dlsym(real.nvml, "nvmlDeviceGetHandleByIndex_v2");
        nvml_procs = (procs_fn)real_dlsym(real.nvml, "nvmlDeviceGetComputeRunningProcesses_v3");
        if (!nvml_procs)
            nvml_procs = (procs_fn)real_dlsym(real.nvml, "nvmlDeviceGetComputeRunningProcesses_v2");
    }
    nvml_up = init && nvml_count && nvml_handle && nvml_procs && init() == NVML_OK ? 1 : -1;
    return nvml_up > 0;
}

/* NVML's compute processes on page GPU g into `list` (at most `max`): how many, -1 if NVML cannot say. */
static int nvml_list(int g, proc_info *list, unsigned int max)
{
    unsigned int n = 0;
    int found = -1;
    in_driver++;  /* (the whole card's list: ioctl's filter is for the container's callers, not for us) */
    if (nvml_ready() && nvml_count(&n) == NVML_OK)
        for (unsigned int i = 0; i < n; i++) {
            void *dev;
            unsigned int m = max;
            if (nvml_handle(i, &dev) == NVML_OK && nvml_page_index(dev) == g) {
                found = nvml_procs(dev, &m, list) == NVML_OK ? (int)m : -1;
                break;
            }
        }
    in_driver--;
    return found;
}

#define NVML_LIST 1024
static proc_info before_list[NVML_LIST], after_list[NVML_LIST];  /* (under the caller's lock) */
static int before_n = -1;

/* Around this process's first context on page GPU g: the processes NVML lists before it is made,
 * and after. The one that appeared is this process (HAMi-core finds its host PID the same way):
 * unless NVML names it by its own PID, or more than one appeared (another process made its first
 * context at the same moment: not known then). */
void nvml_context_before(int g)
{
    before_n = host_pid ? -1 : nvml_list(g, before_list, NVML_LIST);
}

void nvml_context_after(int g)
{
    if (before_n < 0 || host_pid)
        return;
    int n = nvml_list(g, after_list, NVML_LIST), found = 0;
    unsigned int pid = 0;
    for (int k = 0; k < n; k++) {
        int seen = after_list[k].pid == (unsigned int)getpid();
        for (int j = 0; j < before_n && !seen; j++)
            seen = before_list[j].pid == after_list[k].pid;
        if (after_list[k].pid == (unsigned int)getpid()) {
            pid = after_list[k].pid;
            found = 1;
            break;
        }
        if (!seen) {
            pid = after_list[k].pid;
            found++;
        }
    }
    if (found == 1)
        host_pid = pid;
    before_n = -1;
}

void nvml_forked(void)
{
    host_pid = 0;
}

/* What NVML's per-process view says this process holds on page GPU g (its allocations and what
 * the driver itself uses for it: contexts, local memory, the device heap), UINT64_MAX when NVML
 * cannot tell: no NVML, or this process not among the GPU's (inside a PID namespace NVML names
 * processes by the host's PIDs). */
uint64_t nvml_process_bytes(int g)
{
    static proc_info list[NVML_LIST];  /* (once per process and GPU, under the caller's lock) */
    /* NVML's per-process figure comes a little after the call that changed it: a process whose first
     * context was just made may not be listed yet. While NVML answers but does not list it, it is
     * asked again, every 5 ms for at most 250 ms (once per process and GPU). */
    for (int tries = 0; tries < 50; tries++) {
        int n = nvml_list(g, list, NVML_LIST);
        for (int k = 0; k < n; k++)
            if (list[k].pid == (unsigned int)getpid() || (host_pid && list[k].pid == host_pid))
                return list[k].used;
        if (n < 0)
            break;  /* (no NVML) */
        struct timespec ms5 = {0, 5000000};
        nanosleep(&ms5, NULL);
    }
    return UINT64_MAX;
}

/* ---- the container's own processes --------------------------------------------------------
 *
 * NVML names processes by their pid in the caller's PID namespace (the driver translates them and
 * leaves out those it cannot see: RM's os_find_ns_pid). So a container with a PID namespace of its
 * own is already shown no process of another's; one without (`cgpu run`, hostPID, a runtime told
 * not to make one) is shown the whole host's. A process is the container's when it is in the
 * caller's PID namespace (the same /proc/<pid>/ns/pid: never another namespace's process that
 * happens to have the same number) and holds a slot in the container's usage page (its pid there
 * is its own getpid(), so the pid in this namespace, which the container shows). Anything else is
 * left out. A process of the container that never used CUDA through libcgpu holds no slot and is
 * not shown. */
static int own_process(unsigned int pid)
{
    char path[48];
    struct stat me, it;
    if (!pid || !usage)
        return 0;
    int found = 0;
    for (int k = 0; k < CGPU_MAX_PROCS && !found; k++)
        found = (unsigned int)__atomic_load_n(&usage->procs[k].pid, __ATOMIC_ACQUIRE) == pid;
    snprintf(path, sizeof path, "/proc/%u/ns/pid", pid);
    return found && stat("/proc/self/ns/pid", &me) == 0 && stat(path, &it) == 0 && me.st_ino == it.st_ino
        && me.st_dev == it.st_dev;
}

/* ---- the kernel driver's process list: ioctl -------------------------------------------------
 *
 * What every NVML way to the process list ends in (nvidia-smi's private export table too): an RM
 * control on /dev/nvidiactl, NV_ESC_RM_CONTROL with NV2080_CTRL_CMD_GPU_GET_PIDS, then
 * NV2080_CTRL_CMD_GPU_GET_PID_INFO for the pids it gave. Inside a container the pid table GET_PIDS
 * answers is cut down to the container's own processes (own_process: the rule above), always —
 * with a PID namespace of its own the driver has left out other namespaces' processes already, and
 * what is left is filtered as NVML's exported lists are. GET_PID_INFO is then asked only about them.
 * Numbers and layouts from NVIDIA's open kernel modules (nv_escape.h, nv-ioctl-numbers.h,
 * nvos.h's NVOS54_PARAMETERS, ctrl2080gpu.h). A FINN-serialized control is passed as it is (GET_PIDS'
 * parameters have no embedded pointer: NVML does not serialize it). */
#define NV_IOCTL_MAGIC 'F'
#define NV_ESC_RM_CONTROL 0x2A
#define NVOS54_FLAGS_FINN_SERIALIZED 0x4
#define NV2080_CTRL_CMD_GPU_GET_PIDS 0x2080018dU
#define NV2080_CTRL_CMD_GPU_GET_PID_INFO 0x2080018eU
#define NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT 950u
#define NV_ERR_INVALID_ARGUMENT 0x1f
typedef struct {
    uint32_t hClient, hObject, cmd, flags;
    uint64_t params __attribute__((aligned(8)));
    uint32_t paramsSize, status;
} nvos54;
typedef struct { uint32_t idType, id, pidTblCount, pidTbl[NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT]; } get_pids;
typedef struct {  /* NV2080_CTRL_GPU_PID_INFO: the pid, what is asked, the result, its data (48 bytes), SMC */
    uint32_t pid, index, result, pad;
    uint64_t data[6];
    uint32_t ci, gi;
} pid_info;
_Static_assert(sizeof(nvos54) == 32, "nvos.h's NVOS54_PARAMETERS");
_Static_assert(sizeof(pid_info) == 72, "ctrl2080gpu.h's NV2080_CTRL_GPU_PID_INFO");

/* The parameters' layouts this filter knows, by their exact sizes (ctrl2080gpu.h): another size is
 * another driver's layout, never read at a guessed stride — it is answered as refused, its buffer
 * wiped (fail closed: nothing of another's is left in it). */
#define NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT 200u
typedef struct { uint32_t count; pid_info list[NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT]; } get_pid_info;
_Static_assert(sizeof(get_pids) == 3812, "ctrl2080gpu.h's NV2080_CTRL_GPU_GET_PIDS_PARAMS");
_Static_assert(sizeof(get_pid_info) == 14408, "ctrl2080gpu.h's NV2080_CTRL_GPU_GET_PID_INFO_PARAMS");

static void refuse_unknown(nvos54 *p)
{
    if (p->paramsSize <= (64u << 10))  /* (what the driver could have written: RM controls are small) */
        memset((void *)(uintptr_t)p->params, 0, p->paramsSize);
    p->status = NV_ERR_INVALID_ARGUMENT;
}

/* GET_PID_INFO about another's pid (asked directly, not after GET_PIDS): the driver's "no such". */
static void own_pid_info(nvos54 *p)
{
    if (p->paramsSize != sizeof(get_pid_info)) {
        refuse_unknown(p);
        return;
    }
    uint32_t *count = (uint32_t *)(uintptr_t)p->params;
    pid_info *e = (pid_info *)((char *)count + 8);
    uint32_t room = NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT, n = *count < room ? *count : room;
    for (uint32_t k = 0; k < n; k++)
        if (!own_process(e[k].pid)) {
            e[k].result = NV_ERR_INVALID_ARGUMENT;
            memset(e[k].data, 0, sizeof e[k].data);
        }
}

int nvml_ioctl(int fd, unsigned long request, void *arg)
{
    static int (*next)(int, unsigned long, ...);
    int (*fn)(int, unsigned long, ...) = __atomic_load_n(&next, __ATOMIC_ACQUIRE);
    if (!fn) {
        fn = (int (*)(int, unsigned long, ...))cgpu_next("ioctl");
        __atomic_store_n(&next, fn, __ATOMIC_RELEASE);
    }
    int r = fn ? fn(fd, request, arg) : (int)syscall(SYS_ioctl, fd, request, arg);
    if (_IOC_TYPE(request) != NV_IOCTL_MAGIC || _IOC_NR(request) != NV_ESC_RM_CONTROL
        || _IOC_SIZE(request) != sizeof(nvos54) || !arg || in_driver)
        return r;  /* (everything but an RM control, cheaply: one compare for most) */
    int saved = errno;  /* (the call's: what the filter does below must not change it) */
    nvos54 *p = arg;
    if ((p->cmd != NV2080_CTRL_CMD_GPU_GET_PIDS && p->cmd != NV2080_CTRL_CMD_GPU_GET_PID_INFO)
        || (p->flags & NVOS54_FLAGS_FINN_SERIALIZED) || !p->params)
        return r;
    if (!pages_ready()) {
        errno = saved;
        return r;  /* (not in a container) */
    }
    if (p->cmd == NV2080_CTRL_CMD_GPU_GET_PID_INFO) {
        own_pid_info(p);
        errno = saved;
        return r;
    }
    if (p->paramsSize != sizeof(get_pids)) {
        refuse_unknown(p);
        errno = saved;
        return r;
    }
    /* Whatever the call answered: the table never leaves here holding another's pid. */
    get_pids *q = (get_pids *)(uintptr_t)p->params;
    uint32_t room = NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT;
    uint32_t n = q->pidTblCount < room ? q->pidTblCount : room, kept = 0;
    for (uint32_t k = 0; k < n; k++)
        if (own_process(q->pidTbl[k]))
            q->pidTbl[kept++] = q->pidTbl[k];
    for (uint32_t k = kept; k < n; k++)
        q->pidTbl[k] = 0;
    q->pidTblCount = kept;
    errno = saved;
    return r;
}

/* One list NVML gives (processes, utilisation samples): `call` asks the real NVML with a buffer of
 * `*n` entries (NULL, 0 first) and answers NVML_INSUFFICIENT_SIZE with the count it needs. */
struct list_call {
    void *fn, *dev, *arg;
    unsigned long long stamp;
    int (*call)(struct list_call *, unsigned int *n, void *buf);
};

/* The container's own entries of such a list (entries of `size` bytes, the pid at `pid_at`) into
 * `out` (`*count` entries of room), as NVML answers: NVML_INSUFFICIENT_SIZE and the count needed
 * when out is NULL or short, the count written otherwise; `none` when there is none (NVML_OK with
 * 0 for process lists, NVML_NOT_FOUND for samples). *total: how many entries NVML gave in all. */
static int own_entries(struct list_call *c, unsigned int *count, void *out, size_t size, size_t pid_at, int none,
                       unsigned int *total)
{
    unsigned int n = 0, want = 0;
    char *buf = NULL;
    int r;
    for (int tries = 0;; tries++) {
        want = n;
        r = c->call(c, &want, buf);
        if (r == NVML_OK)
            break;
        if (r != NVML_INSUFFICIENT_SIZE || tries == 8) {
            free(buf);
            return r;
        }
        n = want + 16;  /* (room for processes starting meanwhile) */
        free(buf);
        if (!(buf = calloc(n, size)))
            return NVML_MEMORY;
    }
    unsigned int m = 0;
    for (unsigned int k = 0; k < want; k++) {
        unsigned int pid;
        memcpy(&pid, buf + k * size + pid_at, sizeof pid);
        if (own_process(pid))
            memmove(buf + m++ * size, buf + k * size, size);
    }
    if (total)
        *total = want;
    if (m == 0) {
        *count = 0;
        r = none;
    } else if (!out || *count < m) {
        *count = m;
        r = NVML_INSUFFICIENT_SIZE;
    } else {
        memcpy(out, buf, m * size);
        *count = m;
        r = NVML_OK;
    }
    free(buf);
    return r;
}

static void *real_nvml(const char *name)
{
    setup_once();  /* (the real NVML is loaded there) */
    return real.nvml && real_dlsym ? real_dlsym(real.nvml, name) : NULL;
}

/* Inside a container: 1. Outside (no CGPU_PAGE_DIR, no pages): 0, and *r is NVML_OK: pass through.
 * Asked for isolation that cannot be applied: 0 and *r the error (as for the memory view). */
static int contained(int *r)
{
    setup_once();
    *r = asked && !limits ? NVML_UNKNOWN : NVML_OK;
    return limits != NULL;
}

typedef int (*list_fn)(void *, unsigned int *, void *);
static int call_procs(struct list_call *c, unsigned int *n, void *buf)
{
    return ((list_fn)c->fn)(c->dev, n, buf);
}

/* A running-process list (`size`: v1 16 bytes, v2/v3 24): the container's processes only. */
static int own_procs(const char *name, void *dev, unsigned int *count, void *infos, size_t size)
{
    int r;
    list_fn fn = (list_fn)real_nvml(name);
    int in = contained(&r);
    if (r != NVML_OK)
        return r;
    if (!fn)
        return NVML_FUNCTION_NOT_FOUND;
    if (!in || !count)
        return fn(dev, count, infos);
    struct list_call c = {(void *)fn, dev, NULL, 0, call_procs};
    return own_entries(&c, count, infos, size, 0, NVML_OK, NULL);
}

enum { PROC_V1 = 16, PROC_V2 = 24 };  /* {pid, usedGpuMemory}; v2 (= v3) adds the GPU and compute instance */
#define OWN_PROCS(name, size)                                                                         \
    int name(void *dev, unsigned int *count, void *infos);                                           \
    int name(void *dev, unsigned int *count, void *infos) { return own_procs(#name, dev, count, infos, size); }
OWN_PROCS(nvmlDeviceGetComputeRunningProcesses, PROC_V1)
OWN_PROCS(nvmlDeviceGetComputeRunningProcesses_v2, PROC_V2)
OWN_PROCS(nvmlDeviceGetComputeRunningProcesses_v3, PROC_V2)
OWN_PROCS(nvmlDeviceGetGraphicsRunningProcesses, PROC_V1)
OWN_PROCS(nvmlDeviceGetGraphicsRunningProcesses_v2, PROC_V2)
OWN_PROCS(nvmlDeviceGetGraphicsRunningProcesses_v3, PROC_V2)
OWN_PROCS(nvmlDeviceGetMPSComputeRunningProcesses, PROC_V1)
OWN_PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v2, PROC_V2)
OWN_PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v3, PROC_V2)

/* R550's nvmlDeviceGetRunningProcessDetailList: {version, mode, numProcArrayEntries, procArray},
 * entries of 32 bytes (v2's and the confidential-computing memory). */
typedef struct { unsigned int version, mode, num; void *array; } detail_list;
typedef int (*detail_fn)(void *, detail_list *);
static int call_detail(struct list_call *c, unsigned int *n, void *buf)
{
    detail_list l = *(detail_list *)c->arg;
    l.num = *n;
    l.array = buf;
    int r = ((detail_fn)c->fn)(c->dev, &l);
    *n = l.num;
    return r;
}

int nvmlDeviceGetRunningProcessDetailList(void *dev, detail_list *list);
int nvmlDeviceGetRunningProcessDetailList(void *dev, detail_list *list)
{
    int r;
    detail_fn fn = (detail_fn)real_nvml("nvmlDeviceGetRunningProcessDetailList");
    int in = contained(&r);
    if (r != NVML_OK)
        return r;
    if (!fn)
        return NVML_FUNCTION_NOT_FOUND;
    if (!in || !list)
        return fn(dev, list);
    struct list_call c = {(void *)fn, dev, list, 0, call_detail};
    return own_entries(&c, &list->num, list->array, 32, 0, NVML_OK, NULL);
}

/* ---- utilisation: the container's own -------------------------------------------------------
 *
 * Per process: the driver's samples of the container's processes only (NVML_ERROR_NOT_FOUND when
 * none of them ran: what the driver says when no process did). The card's rates: the sum of the
 * container's processes' samples (SM and memory, at most 100), 0 when none of them ran; never the
 * card's own rates, which are everyone's. */
typedef struct { unsigned int pid; unsigned long long ts; unsigned int sm, mem, enc, dec; } util_sample;
typedef int (*putil_fn)(void *, util_sample *, unsigned int *, unsigned long long);
static int call_putil(struct list_call *c, unsigned int *n, void *buf)
{
    return ((putil_fn)c->fn)(c->dev, buf, n, c->stamp);
}

int nvmlDeviceGetProcessUtilization(void *dev, util_sample *util, unsigned int *count, unsigned long long since);
int nvmlDeviceGetProcessUtilization(void *dev, util_sample *util, unsigned int *count, unsigned long long since)
{
    int r;
    putil_fn fn = (putil_fn)real_nvml("nvmlDeviceGetProcessUtilization");
    int in = contained(&r);
    if (r != NVML_OK)
        return r;
    if (!fn)
        return NVML_FUNCTION_NOT_FOUND;
    if (!in || !count)
        return fn(dev, util, count, since);
    struct list_call c = {(void *)fn, dev, NULL, since, call_putil};
    return own_entries(&c, count, util, sizeof(util_sample), 0, NVML_NOT_FOUND, NULL);
}

typedef struct { unsigned long long ts; unsigned int pid, sm, mem, enc, dec, jpg, ofa; } util_info;
typedef struct { unsigned int version, num; unsigned long long since; util_info *array; } utils_info;
typedef int (*utils_fn)(void *, utils_info *);
static int call_utils(struct list_call *c, unsigned int *n, void *buf)
{
    utils_info u = *(utils_info *)c->arg;
    u.num = *n;
    u.array = buf;
    int r = ((utils_fn)c->fn)(c->dev, &u);
    *n = u.num;
    c->stamp = u.since;
    return r;
}

int nvmlDeviceGetProcessesUtilizationInfo(void *dev, utils_info *info);
int nvmlDeviceGetProcessesUtilizationInfo(void *dev, utils_info *info)
{
    int r;
    utils_fn fn = (utils_fn)real_nvml("nvmlDeviceGetProcessesUtilizationInfo");
    int in = contained(&r);
    if (r != NVML_OK)
        return r;
    if (!fn)
        return NVML_FUNCTION_NOT_FOUND;
    if (!in || !info)
        return fn(dev, info);
    struct list_call c = {(void *)fn, dev, info, info->since, call_utils};
    r = own_entries(&c, &info->num, info->array, sizeof(util_info), 8, NVML_NOT_FOUND, NULL);
    if (r == NVML_OK)
        info->since = c.stamp;
    return r;
}

/* The container's processes' latest samples summed (SM, memory, encoder, decoder; each at most
 * 100), all 0 when none of them ran; NVML_NOT_SUPPORTED without per-process samples (never the
 * card's own figures: they are everyone's). */
static int own_sums(void *dev, unsigned int sum[4])
{
    putil_fn pfn = (putil_fn)real_nvml("nvmlDeviceGetProcessUtilization");
    util_sample own[CGPU_MAX_PROCS];  /* (8 KiB of stack) */
    unsigned int n = CGPU_MAX_PROCS;
    memset(sum, 0, 4 * sizeof *sum);
    if (!pfn)
        return NVML_NOT_SUPPORTED;
    struct list_call c = {(void *)pfn, dev, NULL, 0, call_putil};
    int r = own_entries(&c, &n, own, sizeof *own, 0, NVML_NOT_FOUND, NULL);
    if (r == NVML_NOT_FOUND)
        return NVML_OK;
    if (r != NVML_OK)
        return r == NVML_INSUFFICIENT_SIZE ? NVML_UNKNOWN : r;  /* (more than 256 of its own: never) */
    for (unsigned int k = 0; k < n; k++) {
        sum[0] += own[k].sm, sum[1] += own[k].mem, sum[2] += own[k].enc, sum[3] += own[k].dec;
    }
    for (int k = 0; k < 4; k++)
        sum[k] = sum[k] > 100 ? 100 : sum[k];
    return NVML_OK;
}

typedef struct { unsigned int gpu, memory; } nvml_utilization;
typedef int (*rates_fn)(void *, nvml_utilization *);
int nvmlDeviceGetUtilizationRates(void *dev, nvml_utilization *u);
int nvmlDeviceGetUtilizationRates(void *dev, nvml_utilization *u)
{
    int r;
    rates_fn fn = (rates_fn)real_nvml("nvmlDeviceGetUtilizationRates");
    int in = contained(&r);
    if (r != NVML_OK)
        return r;
    if (!fn)
        return NVML_FUNCTION_NOT_FOUND;
    if (!in || !u)
        return fn(dev, u);
    r = fn(dev, u);  /* (the driver checks the device and says whether the card has rates at all) */
    if (r != NVML_OK)
        return r;
    unsigned int sum[4];
    if ((r = own_sums(dev, sum)) != NVML_OK) {
        memset(u, 0, sizeof *u);
        return r;
    }
    u->gpu = sum[0];
    u->memory = sum[1];
    return NVML_OK;
}

/* The video engines: the sum of the container's processes' encoder (decoder) samples, the driver's
 * sampling period. */
typedef int (*video_fn)(void *, unsigned int *, unsigned int *);
static int own_video(const char *name, int dec, void *dev, unsigned int *util, unsigned int *period)
{
    int r;
    video_fn fn = (video_fn)real_nvml(name);
    int in = contained(&r);
    if (r != NVML_OK)
        return r;
    if (!fn)
        return NVML_FUNCTION_NOT_FOUND;
    if (!in || !util || !period)
        return fn(dev, util, period);
    if ((r = fn(dev, util, period)) != NVML_OK)  /* (the driver's checks, and its sampling period) */
        return r;
    unsigned int sum[4];
    r = own_sums(dev, sum);
    *util = r == NVML_OK ? sum[dec ? 3 : 2] : 0;
    return r;
}

int nvmlDeviceGetEncoderUtilization(void *dev, unsigned int *util, unsigned int *period);
int nvmlDeviceGetEncoderUtilization(void *dev, unsigned int *util, unsigned int *period)
{
    return own_video("nvmlDeviceGetEncoderUtilization", 0, dev, util, period);
}

int nvmlDeviceGetDecoderUtilization(void *dev, unsigned int *util, unsigned int *period);
int nvmlDeviceGetDecoderUtilization(void *dev, unsigned int *util, unsigned int *period)
{
    return own_video("nvmlDeviceGetDecoderUtilization", 1, dev, util, period);
}

/* ---- the card's sensors: power, energy, temperature, fan, performance state, clocks ----------
 *
 * They follow the whole card's load (a neighbour's kernels draw power, heat it, raise its clocks
 * and its performance state), and there is no share of them that is the container's: inside a
 * container they are NVML_ERROR_NOT_SUPPORTED (nvidia-smi prints N/A), after the driver has
 * checked the call (its own errors stay). */
#define HIDDEN_SENSOR(name, params, args)                                                          \
    int name params;                                                                                \
    int name params                                                                                 \
    {                                                                                               \
        int r;                                                                                      \
        int (*fn) params = (int (*) params)real_nvml(#name);                                        \
        int in = contained(&r);                                                                     \
        if (r != NVML_OK)                                                                           \
            return r;                                                                               \
        if (!fn)                                                                                    \
            return NVML_FUNCTION_NOT_FOUND;                                                         \
        r = fn args;                                                                                \
        return in && r == NVML_OK ? NVML_NOT_SUPPORTED : r;                                         \
    }
HIDDEN_SENSOR(nvmlDeviceGetPowerUsage, (void *dev, unsigned int *mw), (dev, mw))
HIDDEN_SENSOR(nvmlDeviceGetTotalEnergyConsumption, (void *dev, unsigned long long *mj), (dev, mj))
HIDDEN_SENSOR(nvmlDeviceGetTemperature, (void *dev, int sensor, unsigned int *c), (dev, sensor, c))
HIDDEN_SENSOR(nvmlDeviceGetFanSpeed, (void *dev, unsigned int *pct), (dev, pct))
HIDDEN_SENSOR(nvmlDeviceGetPerformanceState, (void *dev, int *pstate), (dev, pstate))
HIDDEN_SENSOR(nvmlDeviceGetClockInfo, (void *dev, int type, unsigned int *mhz), (dev, type, mhz))

/* Our wrapper of an NVML name (interpose.c's dlsym asks), NULL if it is not one: every NVML name
 * libcgpu wraps. */
void *nvml_ours(const char *name)
{
    static const struct { const char *name; void *fn; } NAMES[] = {
#define N(f) {#f, (void *)f}
        N(nvmlDeviceGetMemoryInfo), N(nvmlDeviceGetMemoryInfo_v2),
        N(nvmlDeviceGetComputeRunningProcesses), N(nvmlDeviceGetComputeRunningProcesses_v2),
        N(nvmlDeviceGetComputeRunningProcesses_v3), N(nvmlDeviceGetGraphicsRunningProcesses),
        N(nvmlDeviceGetGraphicsRunningProcesses_v2), N(nvmlDeviceGetGraphicsRunningProcesses_v3),
        N(nvmlDeviceGetMPSComputeRunningProcesses), N(nvmlDeviceGetMPSComputeRunningProcesses_v2),
        N(nvmlDeviceGetMPSComputeRunningProcesses_v3), N(nvmlDeviceGetRunningProcessDetailList),
        N(nvmlDeviceGetProcessUtilization), N(nvmlDeviceGetProcessesUtilizationInfo),
        N(nvmlDeviceGetUtilizationRates), N(nvmlDeviceGetEncoderUtilization), N(nvmlDeviceGetDecoderUtilization),
        N(nvmlDeviceGetPowerUsage), N(nvmlDeviceGetTotalEnergyConsumption), N(nvmlDeviceGetTemperature),
        N(nvmlDeviceGetFanSpeed), N(nvmlDeviceGetPerformanceState), N(nvmlDeviceGetClockInfo),
#undef N
    };
    for (size_t i = 0; i < sizeof NAMES / sizeof *NAMES; i++)
        if (!strcmp(name, NAMES[i].name))
            return NAMES[i].fn;
    return NULL;
}
