/*
 * libcgpu, NVML: what nvidia-smi and NVML clients see (memsize as the card, the container's usage).
 */
#include <string.h>

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