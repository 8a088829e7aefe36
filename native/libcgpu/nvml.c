/*
 * libcgpu, NVML: what nvidia-smi and NVML clients see (memsize as the card, the container's usage).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cgpu_internal.h"

enum { NVML_OK = 0, NVML_UNINITIALIZED = 1, NVML_NOT_SUPPORTED = 3, NVML_UNKNOWN = 999 };

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
    int (*init)(void) = real.nvml ? (int (*)(void))real_dlsym(real.nvml, "nvmlInit_v2") : NULL;
    if (real.nvml) {
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
    if (!nvml_ready() || nvml_count(&n) != NVML_OK)
        return -1;
    for (unsigned int i = 0; i < n; i++) {
        void *dev;
        unsigned int m = max;
        if (nvml_handle(i, &dev) == NVML_OK && nvml_page_index(dev) == g)
            return nvml_procs(dev, &m, list) == NVML_OK ? (int)m : -1;
    }
    return -1;
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
    int n = nvml_list(g, list, NVML_LIST);
    for (int k = 0; k < n; k++)
        if (list[k].pid == (unsigned int)getpid() || (host_pid && list[k].pid == host_pid))
            return list[k].used;
    return UINT64_MAX;
}
