/* A stand-in libnvidia-ml.so.1 for tests on machines without a GPU.
 *
 * It implements the NVML entry points that cgpud's NVML backend makes the
 * real pynvml binding resolve, with values a test scripts in a text file
 * named by $CGPU_NVML_STUB. The file is read again on every call, so a test
 * can change a process's used memory while the daemon runs (replace it
 * atomically: write a temporary file, then rename).
 *
 *   init <rc>                     what nvmlInit* returns (default 0)
 *   driver <version>
 *   gpu <i> <minor> <total> <used> <util> <memutil> <uuid> <name...>
 *   proc <i> <pid> <bytes>        a compute process on GPU i
 *   fail <i> <function> <rc>      that device call returns rc for GPU i
 *   cuda <state file> [offset]    also every live process the stand-in libcuda's state file
 *                                 (libcuda.c) says holds memory on card i, as on GPU i: what
 *                                 its allocations and its contexts take (the driver's view);
 *                                 its PID plus `offset`, as NVML names a container's processes
 *                                 by the host's PIDs
 *
 * Built by tests/nvml_stub.py with gcc -shared -Wl,-soname,libnvidia-ml.so.1.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_PROCS 256

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

struct gpu {
    int present;
    unsigned int minor, util, memutil;
    unsigned long long total, used;
    char uuid[96], name[96];
    char fail_fn[8][96];
    int fail_rc[8];
    int nfail;
};

struct proc {
    unsigned int gpu, pid;
    unsigned long long bytes;
};

static struct {
    int init_rc;
    char driver[80];
    struct gpu gpus[MAX_GPUS];
    int ngpus;
    struct proc procs[MAX_PROCS];
    int nprocs;
} cfg;

static int refcount;
/* Handles are pointers into this array: stable across re-reads of the file. */
static char handles[MAX_GPUS];

static void cuda_processes(const char *line);

static void load(void) {
    memset(&cfg, 0, sizeof cfg);
    strcpy(cfg.driver, "550.54.15");
    const char *path = getenv("CGPU_NVML_STUB");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        unsigned int i, a, b, c;
        unsigned long long x, y;
        int n = 0, rc;
        char word[96];
        if (sscanf(line, "init %d", &rc) == 1) {
            cfg.init_rc = rc;
        } else if (sscanf(line, "driver %79s", cfg.driver) == 1) {
        } else if (sscanf(line, "gpu %u %u %llu %llu %u %u %95s %n", &i, &a, &x, &y, &b, &c, word, &n) == 7 && n > 0
                   && i < MAX_GPUS) {
            struct gpu *g = &cfg.gpus[i];
            g->present = 1;
            g->minor = a;
            g->total = x;
            g->used = y;
            g->util = b;
            g->memutil = c;
            snprintf(g->uuid, sizeof g->uuid, "%s", word);
            snprintf(g->name, sizeof g->name, "%s", line + n);
            if ((int)i + 1 > cfg.ngpus)
                cfg.ngpus = i + 1;
        } else if (sscanf(line, "proc %u %u %llu", &i, &a, &x) == 3 && i < MAX_GPUS && cfg.nprocs < MAX_PROCS) {
            cfg.procs[cfg.nprocs++] = (struct proc){i, a, x};
        } else if (strncmp(line, "cuda ", 5) == 0) {
            cuda_processes(line + 5);
        } else if (sscanf(line, "fail %u %63s %d", &i, word, &rc) == 3 && i < MAX_GPUS && cfg.gpus[i].nfail < 8) {
            struct gpu *g = &cfg.gpus[i];
            snprintf(g->fail_fn[g->nfail], sizeof g->fail_fn[0], "%s", word);
            g->fail_rc[g->nfail++] = rc;
        }
    }
    fclose(f);
}

/* The stand-in libcuda's record per (process, card) of the bytes it holds there (libcuda.c:
 * from byte 256 of its state file, 1024 records of {int32 pid, int32 card, uint64 bytes}). */
static void cuda_processes(const char *line) {
    struct { int pid, dev; unsigned long long bytes; } r[1024];
    char state[4096];
    unsigned int offset = 0;
    if (sscanf(line, "%4095s %u", state, &offset) < 1)
        return;
    FILE *f = fopen(state, "rb");
    size_t n = f && fseek(f, 256, SEEK_SET) == 0 ? fread(r, sizeof r[0], 1024, f) : 0;
    if (f)
        fclose(f);
    for (size_t k = 0; k < n && cfg.nprocs < MAX_PROCS; k++)
        if (r[k].pid > 0 && r[k].bytes && r[k].dev >= 0 && r[k].dev < MAX_GPUS && kill(r[k].pid, 0) == 0)
            cfg.procs[cfg.nprocs++] = (struct proc){(unsigned)r[k].dev, (unsigned)r[k].pid + offset, r[k].bytes};
}

/* Load the file, check initialisation and the handle; the GPU or NULL (*rc says why). */
static struct gpu *device(void *handle, const char *fn, nvmlReturn_t *rc) {
    load();
    *rc = NVML_SUCCESS;
    if (refcount <= 0) {
        *rc = NVML_ERROR_UNINITIALIZED;
        return NULL;
    }
    char *h = handle;
    if (h < handles || h >= handles + MAX_GPUS || !cfg.gpus[h - handles].present) {
        *rc = NVML_ERROR_INVALID_ARGUMENT;
        return NULL;
    }
    struct gpu *g = &cfg.gpus[h - handles];
    for (int k = 0; k < g->nfail; k++)
        if (strcmp(g->fail_fn[k], fn) == 0) {
            *rc = g->fail_rc[k];
            return NULL;
        }
    return g;
}

static nvmlReturn_t init(void) {
    load();
    if (cfg.init_rc != NVML_SUCCESS)
        return cfg.init_rc;
    refcount++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return init(); }
nvmlReturn_t nvmlInit_v2(void) { return init(); }
nvmlReturn_t nvmlInit(void) { return init(); }

nvmlReturn_t nvmlShutdown(void) {
    if (refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    refcount--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t rc) {
    switch (rc) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy(char *out, unsigned int len, const char *s) {
    if (!out || strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, s);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int len) {
    load();
    if (refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy(version, len, cfg.driver);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    load();
    if (refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = cfg.ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device_out) {
    load();
    if (refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!device_out || index >= MAX_GPUS || !cfg.gpus[index].present)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct gpu *g = &cfg.gpus[index];
    for (int k = 0; k < g->nfail; k++)
        if (strcmp(g->fail_fn[k], "nvmlDeviceGetHandleByIndex_v2") == 0)
            return g->fail_rc[k];
    *device_out = &handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(void *dev, char *name, unsigned int len) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetName", &rc);
    return g ? copy(name, len, g->name) : rc;
}

nvmlReturn_t nvmlDeviceGetUUID(void *dev, char *uuid, unsigned int len) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetUUID", &rc);
    return g ? copy(uuid, len, g->uuid) : rc;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(void *dev, unsigned int *minor) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetMinorNumber", &rc);
    if (!g)
        return rc;
    *minor = g->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *dev, nvmlMemory_t *mem) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetMemoryInfo", &rc);
    if (!g)
        return rc;
    unsigned long long used = g->used;
    for (int k = 0; k < cfg.nprocs; k++)
        if (&cfg.gpus[cfg.procs[k].gpu] == g)
            used += cfg.procs[k].bytes;
    mem->total = g->total;
    mem->used = used < g->total ? used : g->total;
    mem->free = g->total - mem->used;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *dev, nvmlMemory_v2_t *mem) {
    nvmlMemory_t m;
    nvmlReturn_t rc = nvmlDeviceGetMemoryInfo(dev, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    mem->total = m.total;
    mem->reserved = 0;
    mem->free = m.free;
    mem->used = m.used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(void *dev, unsigned int *index) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetIndex", &rc);
    if (!g)
        return rc;
    *index = (unsigned int)(g - cfg.gpus);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(void *dev, nvmlUtilization_t *util) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetUtilizationRates", &rc);
    if (!g)
        return rc;
    util->gpu = g->util;
    util->memory = g->memutil;
    return NVML_SUCCESS;
}

/* As the driver does: with too small a buffer (or none), say how many there are.
 * Built with -DSTUB_OLD_DRIVER it is _v2 only, as drivers before R510 are. */
#ifdef STUB_OLD_DRIVER
#define PROCS_FN "nvmlDeviceGetComputeRunningProcesses_v2"
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *dev, unsigned int *count, nvmlProcessInfo_t *infos) {
#else
#define PROCS_FN "nvmlDeviceGetComputeRunningProcesses_v3"
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *dev, unsigned int *count, nvmlProcessInfo_t *infos) {
#endif
    nvmlReturn_t rc;
    struct gpu *g = device(dev, PROCS_FN, &rc);
    if (!g)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (int k = 0; k < cfg.nprocs; k++)
        if (&cfg.gpus[cfg.procs[k].gpu] == g)
            n++;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int j = 0;
    for (int k = 0; k < cfg.nprocs; k++)
        if (&cfg.gpus[cfg.procs[k].gpu] == g)
            infos[j++] = (nvmlProcessInfo_t){cfg.procs[k].pid, cfg.procs[k].bytes, 0xFFFFFFFFu, 0xFFFFFFFFu};
    *count = n;
    return NVML_SUCCESS;
}
