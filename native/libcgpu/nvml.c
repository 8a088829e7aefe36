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
/* What NVML's per-process view says this process holds on page GPU g (its allocations and what
 * the driver itself uses for it: contexts, local memory, the device heap), UINT64_MAX when NVML
 * cannot tell: no NVML, or this process not among the GPU's (inside a PID namespace NVML names
 * processes by the host's PIDs). */
uint64_t nvml_process_bytes(int g)
{
    typedef int (*init_fn_)(void);
    typedef int (*count_fn_)(unsigned int *);
    typedef int (*handle_fn_)(unsigned int, void **);
    typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } proc_info;
    typedef int (*procs_fn_)(void *, unsigned int *, proc_info *);
    if (!real.nvml)
        return UINT64_MAX;
    init_fn_ init = (init_fn_)real_dlsym(real.nvml, "nvmlInit_v2");
    count_fn_ count = (count_fn_)real_dlsym(real.nvml, "nvmlDeviceGetCount_v2");
    handle_fn_ handle = (handle_fn_)real_dlsym(real.nvml, "nvmlDeviceGetHandleByIndex_v2");
    procs_fn_ procs = (procs_fn_)real_dlsym(real.nvml, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!procs)
        procs = (procs_fn_)real_dlsym(real.nvml, "nvmlDeviceGetComputeRunningProcesses_v2");
    unsigned int n = 0;
    if (!init || !count || !handle || !procs || init() != NVML_OK || count(&n) != NVML_OK)
        return UINT64_MAX;
    static proc_info list[1024];  /* (once per process and GPU, under the caller's lock) */
    for (unsigned int i = 0; i < n; i++) {
        void *dev;
        unsigned int m = sizeof list / sizeof *list;
        if (handle(i, &dev) != NVML_OK || nvml_page_index(dev) != g || procs(dev, &m, list) != NVML_OK)
            continue;
        for (unsigned int k = 0; k < m; k++)
            if (list[k].pid == (unsigned int)getpid())
                return list[k].used;
    }
    return UINT64_MAX;
}
