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
 *   proc <i> <pid> <bytes> [kind] a process on GPU i: kind compute (default), graphics or mps
 *                                 (an MPS client: NVML lists it among the MPS compute processes)
 *   putil <i> <pid> <sm> <mem> <enc> <dec>   a process's utilisation sample on GPU i (percent,
 *                                 stamped with the time it is read)
 *   fail <i> <function> <rc>      that device call returns rc for GPU i
 *   sensors <i> <power mW> <temp C> <fan %> <pstate> <sm clock MHz> <energy mJ> <enc %> <dec %>
 *                                 what the card's sensors say (everyone's load shows in them)
 *   cuda <state file> [offset]    also every live process the stand-in libcuda's state file
 *                                 (libcuda.c) says holds memory on card i, as on GPU i: what
 *                                 its allocations and its contexts take (the driver's view);
 *                                 its PID plus `offset`, as NVML names a container's processes
 *                                 by the host's PIDs. And each process's utilisation
 *                                 (nvmlDeviceGetProcessUtilization): what the stand-in card's
 *                                 executor ran for it (cuda_exec.c's ".ran" file, measured
 *                                 there), its kernel time over the time since the call whose
 *                                 timestamp the caller passes (the latest this library answered
 *                                 at or before it; the oldest it keeps for 0)
 *   event <i> xid <code>          a critical Xid error on GPU i (nvmlEventTypeXidCriticalError, the
 *                                 event's data the Xid); `event <i> ecc`: a double-bit ECC error
 *                                 (nvmlEventTypeDoubleBitEccError). Each event line is one event,
 *                                 delivered once to each event set that registered GPU i for its
 *                                 type before the line appeared: append lines, never remove them
 *   lost <i>                      GPU i fell off the bus: every call on it returns
 *                                 NVML_ERROR_GPU_IS_LOST (and so does nvmlEventSetWait_v2 once its
 *                                 pending events are out); remove the line to reset the GPU
 *   noecc <i>                     GPU i has no ECC (a GeForce, or ECC off): its supported event types
 *                                 lack the ECC ones, and registering them is NVML_ERROR_NOT_SUPPORTED
 *
 * Process lists go through the kernel driver, as the real NVML's do (issue 28, on an H100): each of them
 * (the v1/v2/v3 functions, R550's detail list, and the private export table's process entry,
 * nvmlInternalGetExportTable, which nvidia-smi uses) is libc's `ioctl` on the control device with
 * NV_ESC_RM_CONTROL: NV2080_CTRL_CMD_GPU_GET_PIDS for the pids, then
 * NV2080_CTRL_CMD_GPU_GET_PID_INFO for their memory — NVIDIA's numbers and layouts (its open kernel
 * modules: nv_escape.h, nv-ioctl-numbers.h, nvos.h's NVOS54_PARAMETERS, ctrl2080gpu.h). There is no
 * /dev/nvidiactl here and no CUSE to make one: the stand-in does the kernel's part (it fills the
 * parameters from this file) and then makes the real `ioctl` call on /dev/null, whose ENOTTY it
 * takes as the driver's answer. Whatever interposes `ioctl` (libcgpu) sees the call and, after it,
 * the parameters exactly as the driver leaves them; only a filter that acts before the call would
 * be fooled, and a filter has nothing to act on before the driver answers.
 *
 * Built by tests/nvml_stub.py with gcc -shared -Wl,-soname,libnvidia-ml.so.1.
 */
#include "nvml_stub.h"

__thread struct nvml_cfg cfg;
static int refcount;
/* Handles are pointers into this array: stable across re-reads of the file. */
char handles[MAX_GPUS];

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
        unsigned int i, a, b, c, e, d, ve, vd;
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
        } else if ((n = sscanf(line, "proc %u %u %llu %95s", &i, &a, &x, word)) >= 3 && i < MAX_GPUS
                   && cfg.nprocs < MAX_PROCS) {
            int kind = n == 3 || !strcmp(word, "compute") ? COMPUTE : !strcmp(word, "graphics") ? GRAPHICS
                     : !strcmp(word, "mps") ? MPS : -1;
            if (kind >= 0)
                cfg.procs[cfg.nprocs++] = (struct proc){i, a, x, kind};
        } else if (sscanf(line, "putil %u %u %u %u %u %u", &i, &a, &b, &c, &e, &d) == 6 && i < MAX_GPUS
                   && cfg.nputils < MAX_PROCS) {
            cfg.putils[cfg.nputils++] = (struct putil){i, a, b, c, e, d};
        } else if (sscanf(line, "sensors %u %u %u %u %u %u %llu %u %u", &i, &a, &b, &c, &e, &d, &x, &ve, &vd) == 9
                   && i < MAX_GPUS) {
            struct gpu *g = &cfg.gpus[i];
            g->power = a, g->temp = b, g->fan = c, g->pstate = e, g->clock = d, g->energy = x;
            g->enc = ve, g->dec = vd;
        } else if (sscanf(line, "event %u %95s %u", &i, word, &a) >= 2 && i < MAX_GPUS && cfg.nevents < MAX_EVENTS) {
            if (!strcmp(word, "xid") && sscanf(line, "event %*u %*s %u", &a) == 1)
                cfg.events[cfg.nevents++] = (struct event){i, 0x8ULL, a};  /* nvmlEventTypeXidCriticalError */
            else if (!strcmp(word, "ecc"))
                cfg.events[cfg.nevents++] = (struct event){i, 0x2ULL, 0};  /* nvmlEventTypeDoubleBitEccError */
        } else if (sscanf(line, "lost %u", &i) == 1 && i < MAX_GPUS) {
            cfg.gpus[i].lost = 1;
        } else if (sscanf(line, "noecc %u", &i) == 1 && i < MAX_GPUS) {
            cfg.gpus[i].noecc = 1;
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
    static struct { int pid, dev; unsigned long long bytes; } r[1024];
    static struct { unsigned long long before, changed; } lag[1024];  /* (after the records: libcuda.c) */
    char state[4096];
    unsigned int offset = 0;
    if (sscanf(line, "%4095s %u", state, &offset) < 1)
        return;
    FILE *f = fopen(state, "rb");
    size_t n = f && fseek(f, 256, SEEK_SET) == 0 ? fread(r, sizeof r[0], 1024, f) : 0;
    size_t nl = f && n == 1024 ? fread(lag, sizeof lag[0], 1024, f) : 0;
    if (f)
        fclose(f);
    /* CGPU_STUB_NVML_LAG_MS: a process's figure is what it was before its last change until that long
     * after it (the driver's per-process accounting is read a little after the call that changed it) */
    const char *ms = getenv("CGPU_STUB_NVML_LAG_MS");
    unsigned long long lag_ns = ms && *ms ? strtoull(ms, NULL, 10) * 1000000ull : 0, now = 0;
    struct timespec t;
    if (lag_ns && clock_gettime(CLOCK_MONOTONIC, &t) == 0)
        now = (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
    for (size_t k = 0; k < n && cfg.nprocs < MAX_PROCS; k++) {
        unsigned long long bytes = r[k].bytes;
        if (lag_ns && k < nl && now - lag[k].changed < lag_ns)
            bytes = lag[k].before;
        if (r[k].pid > 0 && bytes && r[k].dev >= 0 && r[k].dev < MAX_GPUS && kill(r[k].pid, 0) == 0)
            cfg.procs[cfg.nprocs++] = (struct proc){(unsigned)r[k].dev, (unsigned)r[k].pid + offset, bytes,
                                                    COMPUTE};
    }
    /* the GPU time the card ran for each process (cuda_exec.c's ".ran": {int32 pid, int32 card, uint64 ns}) */
    char ran[4200];
    struct { int pid, dev; unsigned long long ns; } rn[512];
    snprintf(ran, sizeof ran, "%s.ran", state);
    f = fopen(ran, "rb");
    n = f ? fread(rn, sizeof rn[0], 512, f) : 0;
    if (f)
        fclose(f);
    for (size_t k = 0; k < n && cfg.nrans < MAX_PROCS; k++)
        if (rn[k].pid > 0 && rn[k].dev >= 0 && rn[k].dev < MAX_GPUS && kill(rn[k].pid, 0) == 0)
            cfg.rans[cfg.nrans++] = (struct ran){(unsigned)rn[k].dev, (unsigned)rn[k].pid + offset, rn[k].ns};
}

/* Load the file, check initialisation and the handle; the GPU or NULL (*rc says why). */
struct gpu *device(void *handle, const char *fn, nvmlReturn_t *rc) {
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
    if (g->lost) {
        *rc = NVML_ERROR_GPU_IS_LOST;
        return NULL;
    }
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
    case 10: return "Timeout";
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
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
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

/* The card's sensors (nvml.h's units: mW, mJ, °C, %, MHz). */
#define SENSOR(name, type, expr, ...)                                                               \
    nvmlReturn_t name(void *dev, ##__VA_ARGS__) {                                                   \
        nvmlReturn_t rc;                                                                            \
        struct gpu *g = device(dev, #name, &rc);                                                    \
        if (!g)                                                                                     \
            return rc;                                                                              \
        if (!out)                                                                                   \
            return NVML_ERROR_INVALID_ARGUMENT;                                                     \
        *out = (type)(expr);                                                                        \
        return NVML_SUCCESS;                                                                        \
    }
SENSOR(nvmlDeviceGetPowerUsage, unsigned int, g->power, unsigned int *out)
SENSOR(nvmlDeviceGetTotalEnergyConsumption, unsigned long long, g->energy, unsigned long long *out)
SENSOR(nvmlDeviceGetFanSpeed, unsigned int, g->fan, unsigned int *out)
SENSOR(nvmlDeviceGetPerformanceState, int, g->pstate, int *out)

nvmlReturn_t nvmlDeviceGetTemperature(void *dev, int sensor, unsigned int *out) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetTemperature", &rc);
    if (!g)
        return rc;
    if (sensor != 0 || !out)  /* NVML_TEMPERATURE_GPU is the only sensor */
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = g->temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(void *dev, int type, unsigned int *out) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetClockInfo", &rc);
    if (!g)
        return rc;
    if (type < 0 || type > 3 || !out)  /* graphics, SM, memory, video */
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = type == 2 ? 5001 : g->clock;
    return NVML_SUCCESS;
}

/* The video engines' utilisation over the last sampling period (167 ms on a T4). */
static nvmlReturn_t video(void *dev, const char *fn, int dec, unsigned int *util, unsigned int *period) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, fn, &rc);
    if (!g)
        return rc;
    if (!util || !period)
        return NVML_ERROR_INVALID_ARGUMENT;
    *util = dec ? g->dec : g->enc;
    *period = 167000;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetEncoderUtilization(void *dev, unsigned int *util, unsigned int *period) {
    return video(dev, "nvmlDeviceGetEncoderUtilization", 0, util, period);
}
nvmlReturn_t nvmlDeviceGetDecoderUtilization(void *dev, unsigned int *util, unsigned int *period) {
    return video(dev, "nvmlDeviceGetDecoderUtilization", 1, util, period);
}

/* ---- events (nvml.h: nvmlEventSetCreate .. nvmlEventSetFree) ------------------------------- */
#define EVENT_SINGLE_ECC 0x1ULL
#define EVENT_DOUBLE_ECC 0x2ULL
#define EVENT_PSTATE 0x4ULL
#define EVENT_XID 0x8ULL
#define EVENT_CLOCK 0x10ULL
#define EVENT_SUPPORTED (EVENT_SINGLE_ECC | EVENT_DOUBLE_ECC | EVENT_PSTATE | EVENT_XID | EVENT_CLOCK)

typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct event_set {
    unsigned long long magic;
    unsigned long long mask[MAX_GPUS];  /* the types registered per GPU (0: not registered) */
    int from[MAX_GPUS];                 /* the first event line it gets of each GPU: those after registering */
    int next;                           /* the next event line to look at */
};
#define SET_MAGIC 0x6367707564657674ULL

static unsigned long long supported(const struct gpu *g) {
    return g->noecc ? EVENT_SUPPORTED & ~(EVENT_SINGLE_ECC | EVENT_DOUBLE_ECC) : EVENT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(void *dev, unsigned long long *types) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceGetSupportedEventTypes", &rc);
    if (!g)
        return rc;
    if (!types)
        return NVML_ERROR_INVALID_ARGUMENT;
    *types = supported(g);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(struct event_set **set) {
    load();
    if (refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct event_set *s = calloc(1, sizeof *s);
    if (!s)
        return NVML_ERROR_UNKNOWN;
    s->magic = SET_MAGIC;
    s->next = cfg.nevents;
    *set = s;
    return NVML_SUCCESS;
}

static int valid_set(const struct event_set *s) { return s && s->magic == SET_MAGIC; }

/* All of the types or none: a type the GPU does not support is NVML_ERROR_NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceRegisterEvents(void *dev, unsigned long long types, struct event_set *set) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlDeviceRegisterEvents", &rc);
    if (!g)
        return rc;
    if (!valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~supported(g))
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned i = (unsigned)(g - cfg.gpus);
    if (!set->mask[i])
        set->from[i] = cfg.nevents;
    set->mask[i] |= types;
    return NVML_SUCCESS;
}

/* The next event for the set, or NVML_ERROR_TIMEOUT after `timeoutms`; a registered GPU that is lost
 * makes it NVML_ERROR_GPU_IS_LOST once its events are out (as the driver's wait does). */
nvmlReturn_t nvmlEventSetWait_v2(struct event_set *set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!valid_set(set) || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        load();
        if (refcount <= 0)
            return NVML_ERROR_UNINITIALIZED;
        while (set->next < cfg.nevents) {
            struct event *e = &cfg.events[set->next++];
            if ((set->mask[e->gpu] & e->type) && set->next - 1 >= set->from[e->gpu]) {
                *data = (nvmlEventData_t){&handles[e->gpu], e->type, e->data, 0xFFFFFFFFu, 0xFFFFFFFFu};
                return NVML_SUCCESS;
            }
        }
        for (unsigned i = 0; i < MAX_GPUS; i++)
            if (set->mask[i] && cfg.gpus[i].lost)
                return NVML_ERROR_GPU_IS_LOST;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long ms = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (ms >= (long long)timeoutms)
            return NVML_ERROR_TIMEOUT;
        struct timespec nap = {0, 5 * 1000000L};
        nanosleep(&nap, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait(struct event_set *set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(struct event_set *set) {
    if (!valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}
