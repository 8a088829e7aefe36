/*
 * A stand-in libcuda.so.1 for the tests: no GPU here (native/Makefile, `stubs`).
 *
 * One card of CGPU_STUB_CUDA_MIB MiB (default 15109, a T4) whose memory is shared
 * by every process using it: its state is a file (CGPU_STUB_CUDA_STATE, default
 * /tmp/cgpu-stub-cuda.state) holding the bytes in use, changed under flock (card.c).
 * It answers what the CUDA driver API's clients need: cuInit, versions, devices, contexts,
 * launches, error names; its device memory (allocations, pools' wrappers, VMM, arrays,
 * cuMemGetInfo) is stubs/cuda_memory.c's, and what cuGetProcAddress (cuda_export.c) gives for them.
 *
 * Kernels: a launch (cuLaunchKernel, _ptsz, cooperative, cuLaunchKernelEx) takes gridX*gridY*gridZ
 * microseconds of the card (a graph, cuGraphLaunch: each of its kernels; stream capture and graphs,
 * and the driver's capture rules, are stubs/cuda_graphs.c's). It returns at once into its stream's
 * queue, and the card's executor (stubs/cuda_exec.c) runs the kernels one at a time for everyone,
 * time-slicing between processes with work, a switch costing idle time; cuCtxSynchronize /
 * cuStreamSynchronize wait for exactly their work. With CGPU_STUB_CUDA_LOG set, each piece of a
 * kernel that ran appends "pid start_ns end_ns" (CLOCK_MONOTONIC) to it; CGPU_STUB_CUDA_FAST=1 makes
 * launches free and instant (to time what an interposer adds). cuInit opens
 * CGPU_STUB_CUDA_DEVICE (a comma-separated list: each), if set, and keeps it open, as the real
 * driver keeps /dev/nvidiaN: the daemon sees the process use the GPU. CGPU_STUB_COLLECTIVE=1:
 * every kernel of the process is half of a collective across cards 0 and 1 (cuda_exec.c).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <signal.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "cuda_stub.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101, NOT_SUPPORTED = 801,
       NOT_FOUND = 500 };

/* With CGPU_STUB_CUDA_CTOR_DLSYM=1 its constructor calls dlsym, as a driver may while it loads. */
__attribute__((constructor)) static void loaded(void)
{
    const char *c = getenv("CGPU_STUB_CUDA_CTOR_DLSYM");
    if (c && *c == '1' && (!dlsym(RTLD_DEFAULT, "getenv") || !dlsym(RTLD_NEXT, "malloc")))
        abort();
}

CUresult cuInit(unsigned flags)
{
    static int device = -1;
    const char *dev = getenv("CGPU_STUB_CUDA_DEVICE");
    (void)flags;
    if (device < 0 && dev && *dev)  /* (a comma-separated list: each of them, a process on several GPUs) */
        for (const char *p = dev; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
            char one[4096];
            snprintf(one, sizeof one, "%.*s", (int)strcspn(p, ","), p);
            int fd = open(one, O_RDONLY | O_CLOEXEC);
            device = device < 0 ? fd : device;
        }
    CUresult r = stub_mps_connect();  /* (a control daemon in CUDA_MPS_PIPE_DIRECTORY: an MPS client) */
    if (r != OK) return r;
    stub_set_inited();
    return OK;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return INVALID_VALUE; *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!stub_inited()) return NOT_INITIALIZED; *n = stub_device_count(); return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= stub_device_count()) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
/* Device d's UUID: the d-th of CGPU_STUB_CUDA_UUIDS ("GPU-8-4-4-4-12" hex, comma separated), as a
 * real driver says the UUIDs nvidia-smi shows; without it, CUDA_ERROR_NOT_SUPPORTED. */
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d)
{
    const char *list = getenv("CGPU_STUB_CUDA_UUIDS");
    if (!uuid) return INVALID_VALUE;
    if (d < 0 || d >= stub_device_count()) return INVALID_DEVICE;
    if (!list || !*list) return NOT_SUPPORTED;
    for (int i = 0; i < d && list; i++)
        list = (list = strchr(list, ',')) ? list + 1 : NULL;
    if (!list || strncmp(list, "GPU-", 4)) return INVALID_VALUE;
    int n = 0;
    for (const char *p = list + 4; *p && *p != ',' && n < 32; p++) {
        int v = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
        if (v < 0) continue;  /* (the dashes) */
        uuid[n / 2] = (unsigned char)(n % 2 ? (uuid[n / 2] | v) : v << 4);
        n++;
    }
    return n == 32 ? OK : INVALID_VALUE;
}
CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    if (d < 0 || d >= stub_device_count()) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Stand-in Tesla T4");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!stub_inited()) return NOT_INITIALIZED;
    if (d < 0 || d >= stub_device_count()) return INVALID_DEVICE;
    *bytes = stub_card_bytes();
    return OK;
}
typedef void *CUfunction;
/* a kernel of gx * gy * gz µs (the driver's own: no exported name called, no interposer crossed) */
static CUresult launch_grid(CUfunction f, unsigned gx, unsigned gy, unsigned gz, void *stream)
{
    uint64_t us = (uint64_t)gx * (gy ? gy : 1) * (gz ? gz : 1);
    CUresult r = stub_inited() ? stub_function_loaded(f) : OK;  /* (lazy loading: its code reaches the card now) */
    if (r) return r;
    return stub_capture_launch(stream, &us, 1, &r) ? r : stub_run_kernel(us, stream);  /* (into a capture: recorded) */
}
CUresult cuModuleGetFunction(CUfunction *f, void *module, const char *name) { return stub_module_function(f, module, name); }
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra)
{
    (void)bx; (void)by; (void)bz; (void)shmem; (void)params; (void)extra;
    return launch_grid(f, gx, gy, gz, stream);
}
/* (the per-thread default stream's form: its NULL is the thread's stream, CU_STREAM_PER_THREAD) */
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shmem, void *stream, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream ? stream : (void *)2, params, extra);
}
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shmem, void *stream, void **params)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, NULL);
}
/* The legacy launches (the CUDA Driver API reference, "Execution Control [DEPRECATED]"): cuLaunch
 * "invokes the kernel f on a 1 x 1 x 1 grid of blocks", cuLaunchGrid on a grid_width x grid_height
 * one, cuLaunchGridAsync the same into a stream (its block shape set by cuFuncSetBlockShape before) */
CUresult cuLaunchGridAsync(CUfunction f, int w, int h, void *stream)
{
    if (w <= 0 || h <= 0) return INVALID_VALUE;
    return launch_grid(f, (unsigned)w, (unsigned)h, 1, stream);
}
CUresult cuLaunchGrid(CUfunction f, int w, int h) { return w <= 0 || h <= 0 ? INVALID_VALUE : launch_grid(f, (unsigned)w, (unsigned)h, 1, NULL); }
CUresult cuLaunch(CUfunction f) { return launch_grid(f, 1, 1, 1, NULL); }
/* cuda.h's CUlaunchConfig and CUlaunchAttribute (an id, padded to 8 bytes, then a 64-byte value) */
typedef struct { unsigned id; char pad[4]; union { char bytes[64]; int i; } value; } launch_attr;
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void *hStream;
    launch_attr *attrs;
    unsigned numAttrs;
} launch_config;
enum { ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6, ATTR_PROGRAMMATIC_EVENT = 7 };
CUresult cuLaunchKernelEx(const launch_config *c, CUfunction f, void **params, void **extra)
{
    (void)params; (void)extra;
    if (!c || (c->numAttrs && !c->attrs)) return INVALID_VALUE;
    int pdl = 0;  /* (Hopper's programmatic dependent launch: cuda_exec.c) */
    for (unsigned i = 0; i < c->numAttrs; i++) {
        if (c->attrs[i].id == ATTR_PROGRAMMATIC_STREAM_SERIALIZATION) pdl = c->attrs[i].value.i != 0;
        if (c->attrs[i].id == ATTR_PROGRAMMATIC_EVENT) return NOT_SUPPORTED;  /* (not modelled: said, not ignored) */
    }
    uint64_t us = (uint64_t)c->gridDimX * (c->gridDimY ? c->gridDimY : 1) * (c->gridDimZ ? c->gridDimZ : 1);
    CUresult r = stub_inited() ? stub_function_loaded(f) : OK;
    if (r) return r;
    return stub_capture_launch(c->hStream, &us, 1, &r) ? r : stub_run_kernel_as(us, c->hStream, pdl);
}
CUresult cuGraphLaunch(void *exec, void *stream) { return stub_graph_launch(exec, stream); }  /* cuda_graphs.c */

typedef void *CUstream;
CUresult cuStreamCreate(CUstream *s, unsigned flags);  /* cuda_graphs.c, as cuStreamDestroy_v2 */
CUresult cuStreamDestroy_v2(CUstream s);
CUresult cuStreamSynchronize(CUstream s)
{
    if (stub_stream_dead(s, "cuStreamSynchronize")) return STUB_INVALID_HANDLE;
    CUresult r = stub_capture_forbids(s);
    r = r ? r : stub_exec_sync(stub_current_device(), s, 0);
    if (!r) stub_pools_settle(stub_stream_device(s));  /* (pools release what they keep above their thresholds) */
    return r;
}
CUresult cuStreamSynchronize_ptsz(CUstream s) { return cuStreamSynchronize(s ? s : (CUstream)2); }
CUresult cuGetErrorName(CUresult e, const char **s)
{
    *s = e == OK ? "CUDA_SUCCESS" : e == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
       : e == NOT_INITIALIZED ? "CUDA_ERROR_NOT_INITIALIZED" : e == INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE"
       : "CUDA_ERROR_UNKNOWN";
    return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

/* The driver's own `fn`, as a real cuGetProcAddress gives it: a hidden alias binds here, never to an
 * interposer's same-named export (the plain address would be libcgpu's when it is preloaded). */
#define OWN(fn) extern __typeof__(fn) own_##fn __attribute__((alias(#fn), visibility("hidden")))
OWN(cuInit);
OWN(cuDriverGetVersion);
OWN(cuDeviceGetCount);
OWN(cuDeviceGet);
OWN(cuDeviceGetName);
OWN(cuDeviceTotalMem_v2);
OWN(cuDeviceGetUuid_v2);
OWN(cuDeviceGetUuid);
OWN(cuGetErrorName);
OWN(cuGetErrorString);
OWN(cuStreamSynchronize);
OWN(cuModuleGetFunction);
OWN(cuLaunchKernel);
OWN(cuLaunchKernel_ptsz);
OWN(cuLaunchCooperativeKernel);
OWN(cuLaunch);
OWN(cuLaunchGrid);
OWN(cuLaunchGridAsync);
OWN(cuLaunchKernelEx);
OWN(cuGraphLaunch);

/* What cuGetProcAddress (cuda_export.c) answers for this file's names, as the real driver does, by
 * (name, version, flags): each form of a name from the CUDA version that introduced it (cudaTypedefs.h's PFN_<name>_v<version>), and
 * its per-thread-default-stream form (_ptsz) for CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM. */
HIDDEN const struct stub_versioned STUB_VERSIONED_LIBCUDA[] = {
    {"cuInit", 2000, 0, (void *)own_cuInit},
    {"cuDriverGetVersion", 2020, 0, (void *)own_cuDriverGetVersion},
    {"cuDeviceGetCount", 2000, 0, (void *)own_cuDeviceGetCount},
    {"cuDeviceGet", 2000, 0, (void *)own_cuDeviceGet},
    {"cuDeviceGetName", 2000, 0, (void *)own_cuDeviceGetName},
    {"cuDeviceTotalMem", 3020, 0, (void *)own_cuDeviceTotalMem_v2},
    {"cuDeviceGetUuid", 9020, 0, (void *)own_cuDeviceGetUuid},
    {"cuDeviceGetUuid", 11040, 0, (void *)own_cuDeviceGetUuid_v2},
    {"cuGetErrorName", 6000, 0, (void *)own_cuGetErrorName},
    {"cuGetErrorString", 6000, 0, (void *)own_cuGetErrorString},
    {"cuStreamSynchronize", 2000, 0, (void *)own_cuStreamSynchronize},
    {"cuStreamSynchronize", 7000, 1, (void *)cuStreamSynchronize_ptsz},
    {"cuModuleGetFunction", 2000, 0, (void *)own_cuModuleGetFunction},
    {"cuLaunchKernel", 4000, 0, (void *)own_cuLaunchKernel},
    {"cuLaunchKernel", 7000, 1, (void *)own_cuLaunchKernel_ptsz},
    {"cuLaunchCooperativeKernel", 9000, 0, (void *)own_cuLaunchCooperativeKernel},
    {"cuLaunch", 2000, 0, (void *)own_cuLaunch},
    {"cuLaunchGrid", 2000, 0, (void *)own_cuLaunchGrid},
    {"cuLaunchGridAsync", 2000, 0, (void *)own_cuLaunchGridAsync},
    {"cuLaunchKernelEx", 11060, 0, (void *)own_cuLaunchKernelEx},
    {"cuGraphLaunch", 10000, 0, (void *)own_cuGraphLaunch},
    {NULL, 0, 0, NULL},
};
