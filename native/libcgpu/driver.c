/*
 * libcgpu, the bottom layer: the real driver's and NVML's entry points and their loading (once,
 * at the first CUDA or NVML call, not at load), the C library's dlsym and the next object's
 * symbols, and whether this thread is inside the real driver. Everything above (page.c, memory.c,
 * gate.c, nvml.c, and interpose.c's exported names) calls down into this; it calls nothing above.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "cgpu_internal.h"

struct real_driver real;
struct driver_events ev;
dlsym_fn real_dlsym;
__thread int in_driver __attribute__((tls_model("initial-exec")));

/* libc's dlsym (the one after us), found once without any lock: dlsym may be called from
 * anywhere, a driver's constructor while we load it included. glibc 2.34 moved dlsym into libc
 * at GLIBC_2.34 and kept the old one at the architecture's first version: GLIBC_2.2.5 on x86_64,
 * GLIBC_2.17 on aarch64 (an arm64 image with glibc < 2.34 has only that one). Each known version
 * is asked, this architecture's first; where none answers (a C library we do not know), dlsym
 * answers NULL (one line on stderr, once), ioctl goes to the kernel itself (nvml.c), and CUDA
 * through libcgpu fails at cuInit: never an abort in a process that only wanted dlsym or ioctl. */
void *(*cgpu_next_dlsym)(void *, const char *);
static void *no_dlsym(void *handle, const char *name)
{
    static int said;
    if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
        fprintf(stderr, "cgpu: cannot find the C library's dlsym (no dlsym at GLIBC_2.34, "
                        "GLIBC_2.17 or GLIBC_2.2.5): dlsym answers NULL and CUDA is off in this process\n");
    return NULL;
}
void driver_next_dlsym(void)
{
    if (__atomic_load_n(&cgpu_next_dlsym, __ATOMIC_ACQUIRE))
        return;
#if defined(__aarch64__)
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.2.5"};
#else
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
#endif
    dlsym_fn f = NULL;
    for (unsigned i = 0; !f && i < sizeof versions / sizeof *versions; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    real_dlsym = f;  /* (NULL: sym() finds nothing, the driver is not used) */
    __atomic_store_n(&cgpu_next_dlsym, f ? f : no_dlsym, __ATOMIC_RELEASE);
}

void *cgpu_next(const char *name)
{
    driver_next_dlsym();
    return cgpu_next_dlsym(RTLD_NEXT, name);  /* (called from libcgpu: the object after it, libc) */
}

void *sym(const char *name)
{
    return real.lib && real_dlsym ? real_dlsym(real.lib, name) : NULL;
}

/* The real driver (CGPU_REAL_LIBCUDA, else libcuda.so.1) and NVML (CGPU_REAL_LIBNVML, else
 * libnvidia-ml.so.1), dlopened, and the functions libcgpu wraps or uses. Called once (page.c's
 * setup). */
void driver_load(void)
{
    driver_next_dlsym();
    in_driver++;  /* (the driver's constructors may call back into us while it loads: straight through) */
    const char *path = getenv("CGPU_REAL_LIBCUDA");
    real.lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    real.init = (init_fn)sym("cuInit");
    real.alloc = (alloc_fn)sym("cuMemAlloc_v2");
    real.free = (free_fn)sym("cuMemFree_v2");
    real.info = (info_fn)sym("cuMemGetInfo_v2");
    real.total = (total_fn)sym("cuDeviceTotalMem_v2");
    real.getproc = (getproc_fn)sym("cuGetProcAddress");
    real.getproc2 = (getproc2_fn)sym("cuGetProcAddress_v2");
    real.pitch = (pitch_fn)sym("cuMemAllocPitch_v2");
    real.managed = (managed_fn)sym("cuMemAllocManaged");
    real.alloc_async = (alloc_async_fn)sym("cuMemAllocAsync");
    real.free_async = (free_async_fn)sym("cuMemFreeAsync");
    real.alloc_async_ptsz = (alloc_async_fn)sym("cuMemAllocAsync_ptsz");
    real.free_async_ptsz = (free_async_fn)sym("cuMemFreeAsync_ptsz");
    real.pool_alloc_ptsz = (pool_alloc_fn)sym("cuMemAllocFromPoolAsync_ptsz");
    real.array = (array_fn)sym("cuArrayCreate_v2");
    real.array_free = (free_fn)sym("cuArrayDestroy");
    real.launch = (launch_fn)sym("cuLaunchKernel");
    real.launch_ptsz = (launch_fn)sym("cuLaunchKernel_ptsz");
    real.launch_coop = (launch_coop_fn)sym("cuLaunchCooperativeKernel");
    real.launch_coop_ptsz = (launch_coop_fn)sym("cuLaunchCooperativeKernel_ptsz");
    real.launch_ex = (launch_ex_fn)sym("cuLaunchKernelEx");
    real.launch_ex_ptsz = (launch_ex_fn)sym("cuLaunchKernelEx_ptsz");
    real.graph_launch = (graph_launch_fn)sym("cuGraphLaunch");
    real.graph_launch_ptsz = (graph_launch_fn)sym("cuGraphLaunch_ptsz");
    real.ctx_get = (ctx_get_fn)sym("cuCtxGetCurrent");
    real.ctx_get_device = (ctx_device_fn)sym("cuCtxGetDevice");
    real.device_uuid = (device_uuid_fn)sym("cuDeviceGetUuid_v2");
    if (!real.device_uuid)
        real.device_uuid = (device_uuid_fn)sym("cuDeviceGetUuid");
    real.ctx_push = (ctx_push_fn)sym("cuCtxPushCurrent_v2");
    real.ctx_pop = (ctx_get_fn)sym("cuCtxPopCurrent_v2");
    real.ctx_sync = (ctx_sync_fn)sym("cuCtxSynchronize");
    real.primary_retain = (primary_retain_fn)sym("cuDevicePrimaryCtxRetain");
    real.ctx_create2 = (ctx_create2_fn)sym("cuCtxCreate_v2");
    real.ctx_create3 = (ctx_create3_fn)sym("cuCtxCreate_v3");
    real.ctx_create4 = (ctx_create4_fn)sym("cuCtxCreate_v4");
    real.pool_alloc = (pool_alloc_fn)sym("cuMemAllocFromPoolAsync");
    real.mem_create = (mem_create_fn)sym("cuMemCreate");
    real.mem_release = (free_fn)sym("cuMemRelease");
    real.mem_map = (mem_map_fn)sym("cuMemMap");
    real.mem_unmap = (mem_unmap_fn)sym("cuMemUnmap");
    real.mem_retain = (mem_retain_fn)sym("cuMemRetainAllocationHandle");
    real.array3d = (array_fn)sym("cuArray3DCreate_v2");
    real.mipmap = (mipmap_fn)sym("cuMipmappedArrayCreate");
    real.mipmap_free = (free_fn)sym("cuMipmappedArrayDestroy");
    real.module_load = (module_load_fn)sym("cuModuleLoad");
    real.module_load_data = (module_load_fn)sym("cuModuleLoadData");
    real.module_load_data_ex = (module_load_ex_fn)sym("cuModuleLoadDataEx");
    real.module_load_fatbin = (module_load_fn)sym("cuModuleLoadFatBinary");
    real.library_load_data = (library_load_fn)sym("cuLibraryLoadData");
    real.library_load_file = (library_load_fn)sym("cuLibraryLoadFromFile");
    ev.create = (event_create_fn)sym("cuEventCreate");
    ev.record = (event_record_fn)sym("cuEventRecord");
    ev.query = (event_fn)sym("cuEventQuery");
    ev.sync = (event_fn)sym("cuEventSynchronize");
    ev.destroy = (event_fn)sym("cuEventDestroy_v2");
    ev.capturing = (capturing_fn)sym("cuStreamIsCapturing");
    ev.stream_query = (event_fn)sym("cuStreamQuery");
    ev.exchange = (exchange_fn)sym("cuThreadExchangeStreamCaptureMode");
    ev.elapsed = (elapsed_fn)sym("cuEventElapsedTime");
    if (!ev.elapsed)
        ev.elapsed = (elapsed_fn)sym("cuEventElapsedTime_v2");
    in_driver--;
    const char *npath = getenv("CGPU_REAL_LIBNVML");
    in_driver++;
    real.nvml = dlopen(npath && *npath ? npath : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    in_driver--;
    if (real.nvml && real_dlsym) {
        real.nvml_mem = (nvml_mem_fn)real_dlsym(real.nvml, "nvmlDeviceGetMemoryInfo");
        real.nvml_mem2 = (nvml_mem2_fn)real_dlsym(real.nvml, "nvmlDeviceGetMemoryInfo_v2");
        real.nvml_index = (nvml_index_fn)real_dlsym(real.nvml, "nvmlDeviceGetIndex");
        real.nvml_uuid = (nvml_uuid_fn)real_dlsym(real.nvml, "nvmlDeviceGetUUID");
    }
}
