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
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
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
} nvmlProcessInfo_t;  /* nvmlProcessInfo_v2_t; _v3 has the same layout */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct {
    unsigned int version, mode, numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;
#define nvmlProcessDetailList_v1 (sizeof(nvmlProcessDetailList_v1_t) | (1u << 24))

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned long long timeStamp;
    unsigned int pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct {
    unsigned int version, processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_v1_t;
#define nvmlProcessesUtilizationInfo_v1 (sizeof(nvmlProcessesUtilizationInfo_v1_t) | (1u << 24))

struct gpu {
    int present;
    unsigned int minor, util, memutil;
    unsigned long long total, used;
    char uuid[96], name[96];
    unsigned int power, temp, fan, pstate, clock, enc, dec;
    unsigned long long energy;
    char fail_fn[8][96];
    int fail_rc[8];
    int nfail;
    int lost, noecc;
};

#define MAX_EVENTS 1024
struct event {
    unsigned int gpu;
    unsigned long long type, data;
};

enum { COMPUTE, GRAPHICS, MPS };  /* NVML's process modes (nvmlProcessMode_t) */
struct proc {
    unsigned int gpu, pid;
    unsigned long long bytes;
    int kind;
};

struct putil {
    unsigned int gpu, pid, sm, mem, enc, dec;
};

/* What the file says, read again at every call: one copy per thread, as the real library may be called
 * from several threads at once (the daemon's memory watchdog and its health watch do). */
static __thread struct {
    int init_rc;
    char driver[80];
    struct gpu gpus[MAX_GPUS];
    int ngpus;
    struct proc procs[MAX_PROCS];
    int nprocs;
    struct putil putils[MAX_PROCS];
    int nputils;
    struct ran { unsigned int gpu, pid; unsigned long long ns; } rans[MAX_PROCS];  /* `cuda`: measured */
    int nrans;
    struct event events[MAX_EVENTS];
    int nevents;
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

/* ---- the kernel driver's part: RM controls through ioctl --------------------------------- */
#define NV_IOCTL_MAGIC 'F'
#define NV_ESC_RM_CONTROL 0x2A
typedef struct {
    uint32_t hClient, hObject, cmd, flags;
    uint64_t params __attribute__((aligned(8)));  /* NvP64 */
    uint32_t paramsSize, status;
} NVOS54_PARAMETERS;
#define NV_RM_CONTROL _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_CONTROL, NVOS54_PARAMETERS)
#define NV2080_CTRL_CMD_GPU_GET_PIDS 0x2080018dU
#define NV2080_CTRL_CMD_GPU_GET_PID_INFO 0x2080018eU
#define NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT 950
#define NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT 200
#define NV2080_CTRL_GPU_GET_PIDS_ID_TYPE_CLASS 0
#define NV2080_CTRL_GPU_PID_INFO_INDEX_VIDEO_MEMORY_USAGE 0
#define NV_OK 0
#define NV_ERR_INVALID_ARGUMENT 0x1f
#define NV_ERR_INVALID_OBJECT_HANDLE 0x33
typedef struct {
    uint32_t idType, id, pidTblCount;
    uint32_t pidTbl[NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT];
} NV2080_CTRL_GPU_GET_PIDS_PARAMS;
typedef struct {
    uint32_t pid, index, result;
    struct { uint64_t memPrivate, memSharedOwned, memSharedDuped, protectedMemPrivate, protectedMemSharedOwned,
             protectedMemSharedDuped; } data __attribute__((aligned(8)));
    struct { uint32_t computeInstanceId, gpuInstanceId; } smcSubscription;
} NV2080_CTRL_GPU_PID_INFO;
typedef struct {
    uint32_t pidInfoListCount;
    NV2080_CTRL_GPU_PID_INFO pidInfoList[NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT] __attribute__((aligned(8)));
} NV2080_CTRL_GPU_GET_PID_INFO_PARAMS;
_Static_assert(sizeof(NVOS54_PARAMETERS) == 32, "nvos.h's NVOS54_PARAMETERS");
_Static_assert(sizeof(NV2080_CTRL_GPU_PID_INFO) == 72, "ctrl2080gpu.h's NV2080_CTRL_GPU_PID_INFO");

/* The classes whose clients' processes GET_PIDS lists: a T4's compute and 3D classes (cl2080.h's
 * TURING_COMPUTE_A, TURING_A); MPS clients by the stand-in's own id. */
enum { CLASS_COMPUTE = 0xc5c0, CLASS_GRAPHICS = 0xc597, CLASS_MPS = 0x90f1 };
#define SUBDEVICE(i) (0x5c000000u | (unsigned)(i))  /* the subdevice handle of GPU i */
#define CLIENT 0xc1d00001u

/* The kernel's answer to an RM control, from the scripted file. */
static void rm_kernel(NVOS54_PARAMETERS *p) {
    unsigned i = p->hObject & 0xffff;
    p->status = NV_OK;
    if ((p->hObject & 0xffff0000u) != 0x5c000000u || i >= MAX_GPUS || !cfg.gpus[i].present) {
        p->status = NV_ERR_INVALID_OBJECT_HANDLE;
        return;
    }
    if (p->cmd == NV2080_CTRL_CMD_GPU_GET_PIDS && p->paramsSize == sizeof(NV2080_CTRL_GPU_GET_PIDS_PARAMS)) {
        NV2080_CTRL_GPU_GET_PIDS_PARAMS *q = (void *)(uintptr_t)p->params;
        int kind = q->id == CLASS_COMPUTE ? COMPUTE : q->id == CLASS_GRAPHICS ? GRAPHICS
                 : q->id == CLASS_MPS ? MPS : -1;
        if (q->idType != NV2080_CTRL_GPU_GET_PIDS_ID_TYPE_CLASS || kind < 0) {
            p->status = NV_ERR_INVALID_ARGUMENT;
            return;
        }
        q->pidTblCount = 0;
        for (int k = 0; k < cfg.nprocs && q->pidTblCount < NV2080_CTRL_GPU_GET_PIDS_MAX_COUNT; k++)
            if (cfg.procs[k].gpu == i && cfg.procs[k].kind == kind)
                q->pidTbl[q->pidTblCount++] = cfg.procs[k].pid;
    } else if (p->cmd == NV2080_CTRL_CMD_GPU_GET_PID_INFO
               && p->paramsSize == sizeof(NV2080_CTRL_GPU_GET_PID_INFO_PARAMS)) {
        NV2080_CTRL_GPU_GET_PID_INFO_PARAMS *q = (void *)(uintptr_t)p->params;
        if (q->pidInfoListCount > NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT) {
            p->status = NV_ERR_INVALID_ARGUMENT;
            return;
        }
        for (unsigned e = 0; e < q->pidInfoListCount; e++) {
            NV2080_CTRL_GPU_PID_INFO *x = &q->pidInfoList[e];
            memset(&x->data, 0, sizeof x->data);
            x->result = NV_ERR_INVALID_ARGUMENT;  /* (a pid with nothing on this GPU) */
            for (int k = 0; k < cfg.nprocs && x->index == NV2080_CTRL_GPU_PID_INFO_INDEX_VIDEO_MEMORY_USAGE; k++)
                if (cfg.procs[k].gpu == i && cfg.procs[k].pid == x->pid) {
                    x->data.memPrivate += cfg.procs[k].bytes;
                    x->result = NV_OK;
                }
            x->smcSubscription.computeInstanceId = x->smcSubscription.gpuInstanceId = 0xFFFFFFFFu;
        }
    } else
        p->status = NV_ERR_INVALID_ARGUMENT;
}

/* An RM control on GPU i's subdevice: the kernel's part, then the real ioctl call (see the top). */
static uint32_t rm_control(unsigned i, uint32_t cmd, void *params, uint32_t size) {
    static int ctl = -1;
    if (ctl < 0)
        ctl = open("/dev/null", O_RDWR | O_CLOEXEC);
    NVOS54_PARAMETERS p = {CLIENT, SUBDEVICE(i), cmd, 0, (uint64_t)(uintptr_t)params, size, 0};
    rm_kernel(&p);
    if (ioctl(ctl, NV_RM_CONTROL, &p) < 0) { /* (ENOTTY: /dev/null is not the driver; its part is done) */ }
    return p.status;
}

static nvmlReturn_t list_pids(unsigned gi, int kind, NV2080_CTRL_GPU_GET_PIDS_PARAMS *pp,
                              NV2080_CTRL_GPU_GET_PID_INFO_PARAMS *ip, unsigned int *count, void *infos, size_t size);

/* The processes of one kind on GPU g, as the driver lists them: with too small a buffer (or
 * none), NVML_ERROR_INSUFFICIENT_SIZE and how many there are; none at all is NVML_SUCCESS with 0.
 * `size` is the caller's struct (v1: pid and memory; v2 and v3: also the GPU and compute
 * instance, NVML_VALUE_NOT_AVAILABLE without MIG). The pids come from GET_PIDS, their memory from
 * GET_PID_INFO: a pid the first left out is not there. */
static nvmlReturn_t list_procs(void *dev, const char *fn, int kind, unsigned int *count, void *infos, size_t size) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, fn, &rc);
    if (!g)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned gi = (unsigned)(g - cfg.gpus);
    struct { NV2080_CTRL_GPU_GET_PIDS_PARAMS pids; NV2080_CTRL_GPU_GET_PID_INFO_PARAMS info; } *q;
    q = calloc(1, sizeof *q);
    if (!q)
        return NVML_ERROR_UNKNOWN;
    rc = list_pids(gi, kind, &q->pids, &q->info, count, infos, size);
    free(q);
    return rc;
}

static nvmlReturn_t list_pids(unsigned gi, int kind, NV2080_CTRL_GPU_GET_PIDS_PARAMS *pp,
                              NV2080_CTRL_GPU_GET_PID_INFO_PARAMS *ip, unsigned int *count, void *infos, size_t size) {
    pp->idType = NV2080_CTRL_GPU_GET_PIDS_ID_TYPE_CLASS;
    pp->id = kind == COMPUTE ? CLASS_COMPUTE : kind == GRAPHICS ? CLASS_GRAPHICS : CLASS_MPS;
    if (rm_control(gi, NV2080_CTRL_CMD_GPU_GET_PIDS, pp, sizeof *pp) != NV_OK)
        return NVML_ERROR_UNKNOWN;
    unsigned n = pp->pidTblCount < NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT ? pp->pidTblCount
                                                                          : NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT;
    ip->pidInfoListCount = n;
    for (unsigned k = 0; k < n; k++) {
        ip->pidInfoList[k].pid = pp->pidTbl[k];
        ip->pidInfoList[k].index = NV2080_CTRL_GPU_PID_INFO_INDEX_VIDEO_MEMORY_USAGE;
    }
    if (n && rm_control(gi, NV2080_CTRL_CMD_GPU_GET_PID_INFO, ip, sizeof *ip) != NV_OK)
        return NVML_ERROR_UNKNOWN;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++) {
        unsigned int pid = ip->pidInfoList[k].pid;
        unsigned long long bytes = ip->pidInfoList[k].result == NV_OK ? ip->pidInfoList[k].data.memPrivate : 0;
        if (size == sizeof(nvmlProcessInfo_v1_t))
            ((nvmlProcessInfo_v1_t *)infos)[k] = (nvmlProcessInfo_v1_t){pid, bytes};
        else if (size == sizeof(nvmlProcessInfo_t))
            ((nvmlProcessInfo_t *)infos)[k] = (nvmlProcessInfo_t){pid, bytes, 0xFFFFFFFFu, 0xFFFFFFFFu};
        else
            ((nvmlProcessDetail_v1_t *)infos)[k] = (nvmlProcessDetail_v1_t){pid, bytes, 0xFFFFFFFFu, 0xFFFFFFFFu, 0};
    }
    *count = n;
    return NVML_SUCCESS;
}

/* nvidia-smi's way to the process list (issue 28, on an H100): not an exported name but the private table
 * nvmlInternalGetExportTable gives for an id. The real table's layout is NVIDIA's own; the
 * stand-in's is {size, the compute processes of a device (v2's entries), the memory of one pid on
 * a device (GET_PID_INFO asked directly)}, under its own id. */
static nvmlReturn_t table_procs(void *dev, unsigned int *count, nvmlProcessInfo_t *infos) {
    return list_procs(dev, "nvmlInternalGetExportTable", COMPUTE, count, infos, sizeof *infos);
}
static nvmlReturn_t table_pid_memory(void *dev, unsigned int pid, unsigned long long *bytes) {
    nvmlReturn_t rc;
    struct gpu *g = device(dev, "nvmlInternalGetExportTable", &rc);
    if (!g)
        return rc;
    if (!bytes)
        return NVML_ERROR_INVALID_ARGUMENT;
    NV2080_CTRL_GPU_GET_PID_INFO_PARAMS *q = calloc(1, sizeof *q);
    if (!q)
        return NVML_ERROR_UNKNOWN;
    q->pidInfoListCount = 1;
    q->pidInfoList[0].pid = pid;
    q->pidInfoList[0].index = NV2080_CTRL_GPU_PID_INFO_INDEX_VIDEO_MEMORY_USAGE;
    rc = rm_control((unsigned)(g - cfg.gpus), NV2080_CTRL_CMD_GPU_GET_PID_INFO, q, sizeof *q) != NV_OK
             ? NVML_ERROR_UNKNOWN : q->pidInfoList[0].result != NV_OK ? NVML_ERROR_NOT_FOUND : NVML_SUCCESS;
    *bytes = rc == NVML_SUCCESS ? q->pidInfoList[0].data.memPrivate : 0;
    free(q);
    return rc;
}
static const struct {
    size_t size;
    nvmlReturn_t (*compute_procs)(void *, unsigned int *, nvmlProcessInfo_t *);
    nvmlReturn_t (*pid_memory)(void *, unsigned int, unsigned long long *);
} TABLE = {sizeof TABLE, table_procs, table_pid_memory};
static const unsigned char TABLE_ID[16] = "cgpud-nvml-procs";
nvmlReturn_t nvmlInternalGetExportTable(const void **table, const void *id) {
    if (!table || !id)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memcmp(id, TABLE_ID, sizeof TABLE_ID)) {
        *table = NULL;
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *table = &TABLE;
    return NVML_SUCCESS;
}

#define PROCS(name, kind, type)                                                                     \
    nvmlReturn_t name(void *dev, unsigned int *count, type *infos) {                               \
        return list_procs(dev, #name, kind, count, infos, sizeof(type));                           \
    }
/* Built with -DSTUB_OLD_DRIVER it has no _v3, as drivers before R510. */
PROCS(nvmlDeviceGetComputeRunningProcesses, COMPUTE, nvmlProcessInfo_v1_t)
PROCS(nvmlDeviceGetComputeRunningProcesses_v2, COMPUTE, nvmlProcessInfo_t)
PROCS(nvmlDeviceGetGraphicsRunningProcesses, GRAPHICS, nvmlProcessInfo_v1_t)
PROCS(nvmlDeviceGetGraphicsRunningProcesses_v2, GRAPHICS, nvmlProcessInfo_t)
PROCS(nvmlDeviceGetMPSComputeRunningProcesses, MPS, nvmlProcessInfo_v1_t)
PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v2, MPS, nvmlProcessInfo_t)
#ifndef STUB_OLD_DRIVER
PROCS(nvmlDeviceGetComputeRunningProcesses_v3, COMPUTE, nvmlProcessInfo_t)
PROCS(nvmlDeviceGetGraphicsRunningProcesses_v3, GRAPHICS, nvmlProcessInfo_t)
PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v3, MPS, nvmlProcessInfo_t)

/* R550's one call for all three (mode: compute, graphics, MPS). */
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(void *dev, nvmlProcessDetailList_v1_t *list) {
    if (!list)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (list->version != nvmlProcessDetailList_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (list->mode > MPS)
        return NVML_ERROR_INVALID_ARGUMENT;
    return list_procs(dev, "nvmlDeviceGetRunningProcessDetailList", (int)list->mode, &list->numProcArrayEntries,
                      list->procArray, sizeof(nvmlProcessDetail_v1_t));
}
#endif

static unsigned long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (unsigned long long)t.tv_sec * 1000000 + (unsigned long long)t.tv_nsec / 1000;
}

/* What the card had run for each process at each answer (a ring): the measured utilisation is the
 * kernel time from the answer the caller's timestamp names to now, over that time. */
#define NSEEN 4096
static struct seen { unsigned long long stamp, ns; unsigned int gpu, pid; } seen[NSEEN];
static unsigned nseen;
static __thread struct putil measured[MAX_PROCS];
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;  /* (the history is every thread's) */

static int measure(unsigned gpu, unsigned long long since, unsigned long long now, struct putil **out, int n) {
    pthread_mutex_lock(&seen_lock);
    for (int k = 0; k < cfg.nrans; k++) {
        struct ran *r = &cfg.rans[k];
        if (r->gpu != gpu)
            continue;
        const struct seen *then = NULL, *oldest = NULL;
        for (unsigned i = 0; i < NSEEN && i < nseen; i++) {
            const struct seen *e = &seen[i];
            if (e->gpu != gpu || e->pid != r->pid || e->ns > r->ns)
                continue;
            if (!oldest || e->stamp < oldest->stamp)
                oldest = e;
            if (e->stamp <= since && (!then || e->stamp > then->stamp))
                then = e;
        }
        then = then ? then : oldest;
        seen[nseen++ % NSEEN] = (struct seen){now, r->ns, gpu, r->pid};
        if (!then || now <= then->stamp || n >= MAX_PROCS)
            continue;
        unsigned long long pct = (r->ns - then->ns) / 10 / (now - then->stamp);  /* ns / (µs * 1000) * 100 */
        measured[n] = (struct putil){gpu, r->pid, pct > 100 ? 100 : (unsigned)pct, 0, 0, 0};
        out[n] = &measured[n];
        n++;
    }
    pthread_mutex_unlock(&seen_lock);
    return n;
}

/* The processes' utilisation samples on a GPU newer than `since` (CPU time in µs) into `out`;
 * their number, or -1 and *rc. */
static int samples(void *dev, const char *fn, unsigned long long since, struct putil **out, nvmlReturn_t *rc,
                   unsigned long long *stamp) {
    struct gpu *g = device(dev, fn, rc);
    if (!g)
        return -1;
    *stamp = now_us();
    int n = 0;
    if (since < *stamp)
        for (int k = 0; k < cfg.nputils; k++)
            if (&cfg.gpus[cfg.putils[k].gpu] == g)
                out[n++] = &cfg.putils[k];
    return measure((unsigned)(g - cfg.gpus), since, *stamp, out, n);
}

/* A NULL buffer or too small: NVML_ERROR_INSUFFICIENT_SIZE and how many; no samples:
 * NVML_ERROR_NOT_FOUND (nvml.h). */
nvmlReturn_t nvmlDeviceGetProcessUtilization(void *dev, nvmlProcessUtilizationSample_t *util, unsigned int *count,
                                             unsigned long long lastSeenTimeStamp) {
    struct putil *found[MAX_PROCS];
    unsigned long long stamp;
    nvmlReturn_t rc;
    int n = samples(dev, "nvmlDeviceGetProcessUtilization", lastSeenTimeStamp, found, &rc, &stamp);
    if (n < 0)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n == 0)
        return NVML_ERROR_NOT_FOUND;
    if (!util || *count < (unsigned)n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int k = 0; k < n; k++)
        util[k] = (nvmlProcessUtilizationSample_t){found[k]->pid, stamp, found[k]->sm, found[k]->mem, found[k]->enc,
                                                   found[k]->dec};
    *count = n;
    return NVML_SUCCESS;
}

#ifndef STUB_OLD_DRIVER
/* R550's form: a versioned struct (NVML_ERROR_ARGUMENT_VERSION_MISMATCH for another version). */
nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(void *dev, nvmlProcessesUtilizationInfo_v1_t *info) {
    struct putil *found[MAX_PROCS];
    unsigned long long stamp;
    nvmlReturn_t rc;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    int n = samples(dev, "nvmlDeviceGetProcessesUtilizationInfo", info->lastSeenTimeStamp, found, &rc, &stamp);
    if (n < 0)
        return rc;
    if (n == 0)
        return NVML_ERROR_NOT_FOUND;
    if (!info->procUtilArray || info->processSamplesCount < (unsigned)n) {
        info->processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int k = 0; k < n; k++)
        info->procUtilArray[k] = (nvmlProcessUtilizationInfo_v1_t){stamp, found[k]->pid, found[k]->sm, found[k]->mem,
                                                                   found[k]->enc, found[k]->dec, 0, 0};
    info->processSamplesCount = n;
    info->lastSeenTimeStamp = stamp;
    return NVML_SUCCESS;
}
#endif

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
