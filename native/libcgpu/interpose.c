/*
 * libcgpu: the in-container interception library (docs/isolation.md), loaded
 * into a container's processes (LD_PRELOAD or /etc/ld.so.preload).
 *
 * This file is the top layer: only the exported names (cuInit, cuGetProcAddress, dlsym, ioctl,
 * the table of every wrapped form) and what a fork resets; the wrappers are memory.c's, gate.c's
 * and nvml.c's, the real driver driver.c's (cgpu_internal.h). The library holds GPU memory to the
 * container's memsize (less a headroom for the driver's growth where the daemon watches NVML), to
 * the byte and across all its processes, and shows memsize as the card:
 *   - every allocator here — cuMemAlloc_v2, cuMemAllocPitch_v2 (charged for
 *     512-byte rows), cuMemAllocManaged, cuMemAllocAsync,
 *     cuMemAllocFromPoolAsync, cuMemCreate (device memory: location
 *     CU_MEM_LOCATION_TYPE_DEVICE or _DEVICE_LOCALITY_DOMAIN; host memory is
 *     not charged), cuArrayCreate_v2, cuArray3DCreate_v2 and
 *     cuMipmappedArrayCreate (every level) —
 *     charges the container's usage page BEFORE the real call
 *     (a compare-and-swap loop: racing processes can never pass memsize),
 *     allocates, and gives the charge back if the driver fails;
 *     past memsize: CUDA_ERROR_OUT_OF_MEMORY, nothing allocated; a handle imported from another
 *     process (cuMemImportFromShareableHandle) is charged at its mapping (vmm.c);
 *   - cuMemFree_v2, cuMemFreeAsync, cuMemRelease, cuArrayDestroy and
 *     cuMipmappedArrayDestroy give it back, and so does a process's exit; a process
 *     killed without a chance to is given back by the next process that
 *     starts (its slot's pid is gone);
 *   - cuMemGetInfo_v2 -> (memsize - headroom - used, memsize), never an error when over;
 *     cuDeviceTotalMem_v2 -> memsize; nvmlDeviceGetMemoryInfo and _v2 ->
 *     total memsize, used the container's usage, free the rest (nvidia-smi);
 *     the real NVML is CGPU_REAL_LIBNVML, else libnvidia-ml.so.1.
 * It interposes the exported names, `dlsym` itself (what a client that
 * dlopens libcuda.so.1 finds), and cuGetProcAddress / _v2 (how CUDA >= 11.3
 * and NVIDIA's cuda-bindings resolve the driver), wrapping a returned
 * cuGetProcAddress. The real driver is dlopen'ed (driver.c): CGPU_REAL_LIBCUDA, else
 * libcuda.so.1.
 *
 * Fail closed: with CGPU_PAGE_DIR set (the container asked for isolation) but
 * its pages missing, foreign or of another version, cuInit returns
 * CUDA_ERROR_NOT_INITIALIZED and one line on stderr says why; the process
 * never runs unisolated. A process of a container whose pages are mounted at
 * /run/cgpu uses those, whatever CGPU_PAGE_DIR says (it may have cleared or
 * rewritten its environment; /etc/ld.so.preload loaded the library);
 * CGPU_PAGE_DIR names the pages only where /run/cgpu has none (outside an
 * instance); anywhere else it passes everything through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cgpu_internal.h"
#include "cgpu_work.h"

/* What every exported CUDA wrapper here is (memory.c, gate.c; NVML's are nvml.c's). */
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, void *);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *, size_t, void *);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, void *);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *, size_t, void *, void *);
CUresult cuGetProcAddress(const char *, void **, int, uint64_t);
CUresult cuGetProcAddress_v2(const char *, void **, int, uint64_t, int *);
CUresult cuMemFreeAsync(CUdeviceptr, void *);
CUresult cuArrayCreate_v2(CUdeviceptr *, const void *);
CUresult cuArrayDestroy(CUdeviceptr);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, void *, void *);
CUresult cuMemPoolCreate(void **, const void *);
CUresult cuMemPoolDestroy(void *);
CUresult cuMemPoolTrimTo(void *, size_t);
CUresult cuMemCreate(CUdeviceptr *, size_t, const void *, unsigned long long);
CUresult cuMemRelease(CUdeviceptr);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxCreate(CUcontext *, unsigned, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuCtxCreate_v3(CUcontext *, void *, int, unsigned, CUdevice);
CUresult cuCtxCreate_v4(CUcontext *, void *, unsigned, CUdevice);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRetainAllocationHandle(CUdeviceptr *, void *);
CUresult cuMemImportFromShareableHandle(CUdeviceptr *, void *, int);
CUresult cuArray3DCreate_v2(CUdeviceptr *, const void *);
CUresult cuMipmappedArrayCreate(CUdeviceptr *, const void *, unsigned);
CUresult cuMipmappedArrayDestroy(CUdeviceptr);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                        void **);
CUresult cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                             void **, void **);
CUresult cuLaunchCooperativeKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   void *, void **);
CUresult cuLaunchCooperativeKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        void *, void **);
CUresult cuLaunchKernelEx(const void *, void *, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const void *, void *, void **, void **);
CUresult cuGraphLaunch(void *, void *);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, void *);
CUresult cuMemsetD8Async_ptsz(CUdeviceptr, unsigned char, size_t, void *);
CUresult cuMemsetD16Async(CUdeviceptr, unsigned short, size_t, void *);
CUresult cuMemsetD16Async_ptsz(CUdeviceptr, unsigned short, size_t, void *);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned, size_t, void *);
CUresult cuMemsetD32Async_ptsz(CUdeviceptr, unsigned, size_t, void *);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, void *);
CUresult cuMemcpyAsync_ptsz(CUdeviceptr, CUdeviceptr, size_t, void *);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, void *);
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr, CUdeviceptr, size_t, void *);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, void *);
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr, const void *, size_t, void *);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, void *);
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *, CUdeviceptr, size_t, void *);
CUresult cuGraphInstantiate(void **, void *, void **, char *, size_t);
CUresult cuGraphInstantiate_v2(void **, void *, void **, char *, size_t);
CUresult cuGraphInstantiateWithFlags(void **, void *, unsigned long long);
CUresult cuGraphInstantiateWithParams(void **, void *, void *);
CUresult cuGraphInstantiateWithParams_ptsz(void **, void *, void *);
CUresult cuGraphExecDestroy(void *);
CUresult cuGraphUpload(void *, void *);
CUresult cuGraphUpload_ptsz(void *, void *);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuGraphAddNode(void **, void *, const void *, size_t, void *);
CUresult cuGraphAddNode_v2(void **, void *, const void *, const void *, size_t, void *);
CUresult cuStreamDestroy(void *);
CUresult cuStreamDestroy_v2(void *);
CUresult cuCtxDestroy(void *);
CUresult cuCtxDestroy_v2(void *);
CUresult cuCtxDetach(void *);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxPushCurrent(void *);
CUresult cuCtxPushCurrent_v2(void *);
CUresult cuCtxPopCurrent(void **);
CUresult cuCtxPopCurrent_v2(void **);
CUresult cuDevicePrimaryCtxRelease(int);
CUresult cuDevicePrimaryCtxRelease_v2(int);
CUresult cuDevicePrimaryCtxReset(int);
CUresult cuDevicePrimaryCtxReset_v2(int);
CUresult cuGraphLaunch_ptsz(void *, void *);
CUresult cuGreenCtxDestroy(void *);
CUresult cuStreamBeginCapture(void *);
CUresult cuStreamBeginCapture_ptsz(void *);
CUresult cuStreamBeginCapture_v2(void *, int);
CUresult cuStreamBeginCapture_v2_ptsz(void *, int);
CUresult cuStreamBeginCaptureToGraph(void *, void *, const void *, const void *, size_t, int);
CUresult cuStreamBeginCaptureToGraph_ptsz(void *, void *, const void *, const void *, size_t, int);
CUresult cuStreamEndCapture(void *, void **);
CUresult cuStreamEndCapture_ptsz(void *, void **);
CUresult cuModuleLoad(void **, const char *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleLoadDataEx(void **, const void *, unsigned, void *, void **);
CUresult cuModuleLoadFatBinary(void **, const void *);
CUresult cuLibraryLoadData(void **, const void *, void *, void **, unsigned, void *, void **, unsigned);
CUresult cuLibraryLoadFromFile(void **, const char *, void *, void **, unsigned, void *, void **, unsigned);
CUresult cuModuleGetFunction(void **, void *, const char *);
CUresult cuLibraryGetKernel(void **, void *, const char *);
CUresult cuKernelGetFunction(void **, void *);
CUresult cuModuleUnload(void *);
CUresult cuLibraryUnload(void *);
CUresult cuCtxSetLimit(int, size_t);
CUresult cuStreamSynchronize(void *);
CUresult cuStreamSynchronize_ptsz(void *);
CUresult cuCtxSynchronize(void);
CUresult cuEventSynchronize(void *);

/* A forked child holds nothing yet, has no helper thread, and needs a slot of its own: each part
 * forgets what was its parent's (page.c registers this with pthread_atfork when it sets up). */
static void forked(void)
{
    threads_forked();
    nvml_forked();
    gate_forked();
    memory_forked();
    page_forked();
}

__attribute__((constructor)) static void layers(void)
{
    cgpu_on_fork = forked;
}

CUresult cuInit(unsigned flags)
{
    if (in_driver)
        return real.init ? real.init(flags) : CU_NOT_INITIALIZED;
    setup_once();
    if (asked && !limits) {
        fprintf(stderr, "cgpu: GPU isolation was asked for but cannot be applied (%s): CUDA is not started\n", why);
        return CU_NOT_INITIALIZED;
    }
    if (limits) {  /* the process starts using CUDA: dead processes' memory back, a slot of its own */
        reclaim_dead();
        if (!need_slot())
            return CU_NOT_INITIALIZED;
    }
    return real.init ? real.init(flags) : CU_NOT_INITIALIZED;
}

/* ---- the kernel driver: ioctl ---------------------------------------------------------------
 *
 * Every NVML way to the process list ends in libc's ioctl on /dev/nvidiactl (nvidia-smi's own goes
 * through a private export table no wrapper of an exported name sees: issue 28, on an H100). nvml.c looks at
 * the few requests it filters after the call; everything else goes straight through. ioctl's third
 * argument is one pointer-sized word whatever the request (the kernel's ABI), read as such. */
int ioctl(int fd, unsigned long request, ...)
{
    va_list ap;
    va_start(ap, request);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    return nvml_ioctl(fd, request, arg);
}

/* ---- how clients find the functions -------------------------------------------- */

/* Every form of every name wrapped here, as the driver's cuGetProcAddress chooses among them by
 * (name, version, flags): `since` the CUDA version that brought the form (cudaTypedefs.h's
 * PFN_<name>_v<since>), `ptsz` its per-thread-default-stream form. `ours` NULL: a form left to
 * the driver (CUDA 2.0's 32-bit ones, whose arguments our wrappers do not take). Read from
 * cudaTypedefs.h of CUDA 13.5: CUDA 13 brought no new form of these names. */
#define KNOWN_CUDA 13050
static const struct form {
    const char *name;
    int since, ptsz;
    const char *export;
    void *ours;
} FORMS[] = {
    {"cuInit", 2000, 0, "cuInit", (void *)cuInit},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc", NULL}, {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2", (void *)cuMemAlloc_v2},
    {"cuMemFree", 2000, 0, "cuMemFree", NULL}, {"cuMemFree", 3020, 0, "cuMemFree_v2", (void *)cuMemFree_v2},
    {"cuMemGetInfo", 2000, 0, "cuMemGetInfo", NULL},
    {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2", (void *)cuMemGetInfo_v2},
    {"cuDeviceTotalMem", 2000, 0, "cuDeviceTotalMem", NULL},
    {"cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2", (void *)cuDeviceTotalMem_v2},
    {"cuMemAllocPitch", 2000, 0, "cuMemAllocPitch", NULL},
    {"cuMemAllocPitch", 3020, 0, "cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, "cuMemAllocAsync_ptsz", (void *)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, "cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, "cuMemFreeAsync_ptsz", (void *)cuMemFreeAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, 0, "cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, 1, "cuMemAllocFromPoolAsync_ptsz", (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemPoolCreate", 11020, 0, "cuMemPoolCreate", (void *)cuMemPoolCreate},
    {"cuMemPoolDestroy", 11020, 0, "cuMemPoolDestroy", (void *)cuMemPoolDestroy},
    {"cuMemPoolTrimTo", 11020, 0, "cuMemPoolTrimTo", (void *)cuMemPoolTrimTo},
    {"cuArrayCreate", 2000, 0, "cuArrayCreate", NULL},
    {"cuArrayCreate", 3020, 0, "cuArrayCreate_v2", (void *)cuArrayCreate_v2},
    {"cuArray3DCreate", 2000, 0, "cuArray3DCreate", NULL},
    {"cuArray3DCreate", 3020, 0, "cuArray3DCreate_v2", (void *)cuArray3DCreate_v2},
    {"cuArrayDestroy", 2000, 0, "cuArrayDestroy", (void *)cuArrayDestroy},
    {"cuMipmappedArrayCreate", 5000, 0, "cuMipmappedArrayCreate", (void *)cuMipmappedArrayCreate},
    {"cuMipmappedArrayDestroy", 5000, 0, "cuMipmappedArrayDestroy", (void *)cuMipmappedArrayDestroy},
    {"cuDevicePrimaryCtxRetain", 7000, 0, "cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuCtxCreate", 2000, 0, "cuCtxCreate", (void *)cuCtxCreate},
    {"cuCtxCreate", 3020, 0, "cuCtxCreate_v2", (void *)cuCtxCreate_v2},
    {"cuCtxCreate", 11040, 0, "cuCtxCreate_v3", (void *)cuCtxCreate_v3},
    {"cuCtxCreate", 12050, 0, "cuCtxCreate_v4", (void *)cuCtxCreate_v4},
    {"cuMemCreate", 10020, 0, "cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", 10020, 0, "cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", 10020, 0, "cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", 10020, 0, "cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemRetainAllocationHandle", 11000, 0, "cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle},
    {"cuMemImportFromShareableHandle", 10020, 0, "cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle},
    {"cuLaunchKernel", 4000, 0, "cuLaunchKernel", (void *)cuLaunchKernel},
    {"cuLaunchKernel", 7000, 1, "cuLaunchKernel_ptsz", (void *)cuLaunchKernel_ptsz},
    {"cuLaunchCooperativeKernel", 9000, 0, "cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel},
    {"cuLaunchCooperativeKernel", 9000, 1, "cuLaunchCooperativeKernel_ptsz", (void *)cuLaunchCooperativeKernel_ptsz},
    {"cuLaunchKernelEx", 11060, 0, "cuLaunchKernelEx", (void *)cuLaunchKernelEx},
    {"cuLaunchKernelEx", 11060, 1, "cuLaunchKernelEx_ptsz", (void *)cuLaunchKernelEx_ptsz},
    {"cuGraphLaunch", 10000, 0, "cuGraphLaunch", (void *)cuGraphLaunch},
    {"cuGraphLaunch", 10000, 1, "cuGraphLaunch_ptsz", (void *)cuGraphLaunch_ptsz},
    {"cuModuleLoad", 2000, 0, "cuModuleLoad", (void *)cuModuleLoad},
    {"cuModuleLoadData", 2000, 0, "cuModuleLoadData", (void *)cuModuleLoadData},
    {"cuModuleLoadDataEx", 2010, 0, "cuModuleLoadDataEx", (void *)cuModuleLoadDataEx},
    {"cuModuleLoadFatBinary", 2000, 0, "cuModuleLoadFatBinary", (void *)cuModuleLoadFatBinary},
    {"cuLibraryLoadData", 12000, 0, "cuLibraryLoadData", (void *)cuLibraryLoadData},
    {"cuLibraryLoadFromFile", 12000, 0, "cuLibraryLoadFromFile", (void *)cuLibraryLoadFromFile},
    {"cuModuleGetFunction", 2000, 0, "cuModuleGetFunction", (void *)cuModuleGetFunction},
    {"cuLibraryGetKernel", 12000, 0, "cuLibraryGetKernel", (void *)cuLibraryGetKernel},
    {"cuKernelGetFunction", 12000, 0, "cuKernelGetFunction", (void *)cuKernelGetFunction},
    {"cuModuleUnload", 2000, 0, "cuModuleUnload", (void *)cuModuleUnload},
    {"cuLibraryUnload", 12000, 0, "cuLibraryUnload", (void *)cuLibraryUnload},
    {"cuCtxSetLimit", 3010, 0, "cuCtxSetLimit", (void *)cuCtxSetLimit},
    {"cuStreamSynchronize", 2000, 0, "cuStreamSynchronize", (void *)cuStreamSynchronize},
    {"cuStreamSynchronize", 7000, 1, "cuStreamSynchronize_ptsz", (void *)cuStreamSynchronize_ptsz},
    {"cuCtxSynchronize", 2000, 0, "cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuEventSynchronize", 2000, 0, "cuEventSynchronize", (void *)cuEventSynchronize},
    {"cuMemsetD8Async", 3020, 0, "cuMemsetD8Async", (void *)cuMemsetD8Async},
    {"cuMemsetD8Async", 7000, 1, "cuMemsetD8Async_ptsz", (void *)cuMemsetD8Async_ptsz},
    {"cuMemsetD16Async", 3020, 0, "cuMemsetD16Async", (void *)cuMemsetD16Async},
    {"cuMemsetD16Async", 7000, 1, "cuMemsetD16Async_ptsz", (void *)cuMemsetD16Async_ptsz},
    {"cuMemsetD32Async", 3020, 0, "cuMemsetD32Async", (void *)cuMemsetD32Async},
    {"cuMemsetD32Async", 7000, 1, "cuMemsetD32Async_ptsz", (void *)cuMemsetD32Async_ptsz},
    {"cuMemcpyAsync", 4000, 0, "cuMemcpyAsync", (void *)cuMemcpyAsync},
    {"cuMemcpyAsync", 7000, 1, "cuMemcpyAsync_ptsz", (void *)cuMemcpyAsync_ptsz},
    {"cuMemcpyDtoDAsync", 2000, 0, "cuMemcpyDtoDAsync", NULL},
    {"cuMemcpyDtoDAsync", 3020, 0, "cuMemcpyDtoDAsync_v2", (void *)cuMemcpyDtoDAsync_v2},
    {"cuMemcpyDtoDAsync", 7000, 1, "cuMemcpyDtoDAsync_v2_ptsz", (void *)cuMemcpyDtoDAsync_v2_ptsz},
    {"cuMemcpyHtoDAsync", 2000, 0, "cuMemcpyHtoDAsync", NULL},
    {"cuMemcpyHtoDAsync", 3020, 0, "cuMemcpyHtoDAsync_v2", (void *)cuMemcpyHtoDAsync_v2},
    {"cuMemcpyHtoDAsync", 7000, 1, "cuMemcpyHtoDAsync_v2_ptsz", (void *)cuMemcpyHtoDAsync_v2_ptsz},
    {"cuMemcpyDtoHAsync", 2000, 0, "cuMemcpyDtoHAsync", NULL},
    {"cuMemcpyDtoHAsync", 3020, 0, "cuMemcpyDtoHAsync_v2", (void *)cuMemcpyDtoHAsync_v2},
    {"cuMemcpyDtoHAsync", 7000, 1, "cuMemcpyDtoHAsync_v2_ptsz", (void *)cuMemcpyDtoHAsync_v2_ptsz},
    {"cuGraphInstantiate", 10000, 0, "cuGraphInstantiate", (void *)cuGraphInstantiate},
    {"cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2", (void *)cuGraphInstantiate_v2},
    {"cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags", (void *)cuGraphInstantiateWithFlags},
    {"cuGraphInstantiateWithFlags", 11040, 0, "cuGraphInstantiateWithFlags", (void *)cuGraphInstantiateWithFlags},
    {"cuGraphInstantiateWithParams", 12000, 0, "cuGraphInstantiateWithParams", (void *)cuGraphInstantiateWithParams},
    {"cuGraphInstantiateWithParams", 12000, 1, "cuGraphInstantiateWithParams_ptsz",
     (void *)cuGraphInstantiateWithParams_ptsz},
    {"cuGraphExecDestroy", 10000, 0, "cuGraphExecDestroy", (void *)cuGraphExecDestroy},
    {"cuGraphUpload", 11010, 0, "cuGraphUpload", (void *)cuGraphUpload},
    {"cuGraphUpload", 11010, 1, "cuGraphUpload_ptsz", (void *)cuGraphUpload_ptsz},
    {"cuDeviceGraphMemTrim", 11040, 0, "cuDeviceGraphMemTrim", (void *)cuDeviceGraphMemTrim},
    {"cuGraphAddNode", 12020, 0, "cuGraphAddNode", (void *)cuGraphAddNode},
    {"cuGraphAddNode", 12030, 0, "cuGraphAddNode_v2", (void *)cuGraphAddNode_v2},
    {"cuStreamDestroy", 2000, 0, "cuStreamDestroy", (void *)cuStreamDestroy},
    {"cuStreamDestroy", 4000, 0, "cuStreamDestroy_v2", (void *)cuStreamDestroy_v2},
    {"cuCtxDestroy", 2000, 0, "cuCtxDestroy", (void *)cuCtxDestroy},
    {"cuCtxDestroy", 4000, 0, "cuCtxDestroy_v2", (void *)cuCtxDestroy_v2},
    {"cuCtxDetach", 2000, 0, "cuCtxDetach", (void *)cuCtxDetach},
    {"cuCtxSetCurrent", 4000, 0, "cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuCtxPushCurrent", 2000, 0, "cuCtxPushCurrent", (void *)cuCtxPushCurrent},
    {"cuCtxPushCurrent", 4000, 0, "cuCtxPushCurrent_v2", (void *)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", 2000, 0, "cuCtxPopCurrent", (void *)cuCtxPopCurrent},
    {"cuCtxPopCurrent", 4000, 0, "cuCtxPopCurrent_v2", (void *)cuCtxPopCurrent_v2},
    {"cuDevicePrimaryCtxRelease", 7000, 0, "cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease},
    {"cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuDevicePrimaryCtxReset", 7000, 0, "cuDevicePrimaryCtxReset", (void *)cuDevicePrimaryCtxReset},
    {"cuDevicePrimaryCtxReset", 11000, 0, "cuDevicePrimaryCtxReset_v2", (void *)cuDevicePrimaryCtxReset_v2},
    {"cuGreenCtxDestroy", 12040, 0, "cuGreenCtxDestroy", (void *)cuGreenCtxDestroy},
    {"cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture", (void *)cuStreamBeginCapture},
    {"cuStreamBeginCapture", 10000, 1, "cuStreamBeginCapture_ptsz", (void *)cuStreamBeginCapture_ptsz},
    {"cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2", (void *)cuStreamBeginCapture_v2},
    {"cuStreamBeginCapture", 10010, 1, "cuStreamBeginCapture_v2_ptsz", (void *)cuStreamBeginCapture_v2_ptsz},
    {"cuStreamBeginCaptureToGraph", 12030, 0, "cuStreamBeginCaptureToGraph", (void *)cuStreamBeginCaptureToGraph},
    {"cuStreamBeginCaptureToGraph", 12030, 1, "cuStreamBeginCaptureToGraph_ptsz",
     (void *)cuStreamBeginCaptureToGraph_ptsz},
    {"cuStreamEndCapture", 10000, 0, "cuStreamEndCapture", (void *)cuStreamEndCapture},
    {"cuStreamEndCapture", 10000, 1, "cuStreamEndCapture_ptsz", (void *)cuStreamEndCapture_ptsz},
    {"cuLaunch", 2000, 0, "cuLaunch", (void *)cuLaunch},
    {"cuLaunchGrid", 2000, 0, "cuLaunchGrid", (void *)cuLaunchGrid},
#define WORK_FORM_ASYNC(e, n, v, p, params, args, stream, bytes) {n, v, p, #e, (void *)e},
#define WORK_FORM_SYNC(e, n, v, p, params, args, bytes) {n, v, p, #e, (void *)e},
    WORK_ASYNC(WORK_FORM_ASYNC) WORK_SYNC(WORK_FORM_SYNC)
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
};

/* Our wrapper of an exported name (what dlsym finds), NULL if it is not wrapped. */
static void *ours(const char *name)
{
    for (size_t i = 0; i < sizeof FORMS / sizeof *FORMS; i++)
        if (!strcmp(name, FORMS[i].export))
            return FORMS[i].ours;
    return !strncmp(name, "nvml", 4) ? nvml_ours(name) : NULL;  /* (nvml.c's table: NVML's names) */
}

/* The form the driver gives for (name, version, flags): the newest one not newer than `version`,
 * the per-thread-default-stream one when flags ask for it (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM). */
static const struct form *chosen(const char *name, int version, uint64_t flags)
{
    const struct form *best = NULL;
    for (size_t i = 0; i < sizeof FORMS / sizeof *FORMS; i++) {
        const struct form *f = &FORMS[i];
        if (strcmp(name, f->name) || f->since > version || (f->ptsz && !(flags & 2)))
            continue;
        if (!best || f->ptsz > best->ptsz || (f->ptsz == best->ptsz && f->since > best->since))
            best = f;
    }
    return best;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    if (in_driver)  /* (the driver asking itself, or loading) */
        return real.getproc2 ? real.getproc2(symbol, pfn, version, flags, status)
             : real.getproc ? real.getproc(symbol, pfn, version, flags) : CU_NOT_INITIALIZED;
    setup_once();
    CUresult r = real.getproc2 ? real.getproc2(symbol, pfn, version, flags, status)
               : real.getproc ? real.getproc(symbol, pfn, version, flags) : CU_NOT_INITIALIZED;
    if (r != CU_OK || !symbol || !pfn || !*pfn)
        return r;
    const struct form *f = chosen(symbol, version, flags);
    if (!f || !f->ours)
        return r;  /* not ours to wrap: exactly what the driver gave */
    if (version > KNOWN_CUDA && *pfn != sym(f->export)) {
        /* a CUDA newer than this library knows may have brought a newer form: never wrap it with
         * an older one's arguments */
        static int said;
        if (!__atomic_exchange_n(&said, 1, __ATOMIC_ACQ_REL))
            fprintf(stderr, "cgpu: %s asked for at CUDA version %d, newer than this libcgpu knows (%d): "
                    "passed through unwrapped; update libcgpu\n", symbol, version, KNOWN_CUDA);
        return r;
    }
    *pfn = f->ours;
    return r;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* ---- dlsym -------------------------------------------------------------------------------
 *
 * dlsym's answer for RTLD_NEXT (and RTLD_DEFAULT in a library opened RTLD_LOCAL) depends on who
 * calls it: glibc looks at its return address. So our dlsym must hand over to libc's with the
 * caller's return address still in place, whatever the compiler does (at -O0 a C call through a
 * pointer is no tail call, and libc would search from libcgpu). It is a few instructions of
 * assembly: ask cgpu_dlsym_ours (C), which answers our wrapper for a name we wrap (where the
 * handle's object has it), and otherwise jump (not call) to libc's dlsym with the caller's
 * arguments. It takes no lock and sets nothing up: it is lazy (a process that only calls dlsym
 * never loads libcuda or NVML) and re-entrant (a driver's constructor may call it while we load
 * the driver). */
void *cgpu_dlsym_ours(void *handle, const char *name);
void *cgpu_dlsym_ours(void *handle, const char *name)
{
    driver_next_dlsym();
    if (!name || !((name[0] == 'c' && name[1] == 'u') || !strncmp(name, "nvml", 4)))
        return NULL;
    void *fn = ours(name);
    return fn && cgpu_next_dlsym(handle, name) ? fn : NULL;  /* only where the real library has it */
}

#if defined(__x86_64__)
__asm__(".pushsection .text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "    push %rdi\n"
        "    push %rsi\n"
        "    sub $8, %rsp\n"                   /* (the stack 16-byte aligned at the call) */
        "    call cgpu_dlsym_ours\n"
        "    add $8, %rsp\n"
        "    pop %rsi\n"
        "    pop %rdi\n"
        "    test %rax, %rax\n"
        "    jz 1f\n"
        "    ret\n"
        "1:  jmp *cgpu_next_dlsym(%rip)\n"      /* libc's, with the caller's return address */
        ".size dlsym, .-dlsym\n"
        ".popsection\n");
#elif defined(__aarch64__)
__asm__(".pushsection .text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        "dlsym:\n"
        "    stp x29, x30, [sp, #-32]!\n"
        "    mov x29, sp\n"
        "    stp x0, x1, [sp, #16]\n"
        "    bl cgpu_dlsym_ours\n"
        "    mov x2, x0\n"
        "    ldp x0, x1, [sp, #16]\n"
        "    ldp x29, x30, [sp], #32\n"
        "    cbz x2, 1f\n"
        "    mov x0, x2\n"
        "    ret\n"
        "1:  adrp x16, cgpu_next_dlsym\n"
        "    ldr x16, [x16, #:lo12:cgpu_next_dlsym]\n"
        "    br x16\n"                          /* libc's, with the caller's return address */
        ".size dlsym, .-dlsym\n"
        ".popsection\n");
#else
#error "libcgpu's dlsym is written for x86_64 and aarch64"
#endif
