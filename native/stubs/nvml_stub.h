/*
 * What the stand-in libnvidia-ml.so.1's files share (native/stubs: libnvidia-ml.c the library, its
 * configuration file and the devices; nvml_processes.c the process lists through the kernel driver's
 * RM controls, and the processes' utilisation). Nothing here is exported: hidden.
 */
#ifndef CGPU_NVML_STUB_H
#define CGPU_NVML_STUB_H
#define HIDDEN __attribute__((visibility("hidden")))
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
struct nvml_cfg {
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
};
extern HIDDEN __thread struct nvml_cfg cfg;  /* what the file says (libnvidia-ml.c), read again at every call */

/* ---- libnvidia-ml.c ---- */
extern HIDDEN char handles[MAX_GPUS];  /* a GPU's handle: a pointer into it */
/* load the file, check initialisation and the handle: the GPU or NULL (*rc says why) */
HIDDEN struct gpu *device(void *handle, const char *fn, nvmlReturn_t *rc);
#endif
