/*
 * The stand-in libnvidia-ml.so.1's process lists (split from libnvidia-ml.c, whose top says how they
 * go through the kernel driver: RM controls by ioctl) and the processes' utilisation.
 */
#include "nvml_stub.h"

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
