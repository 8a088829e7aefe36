/*
 * libcgpu: every other path that puts work on the card (issue 45, item 9), one list for gate.c's
 * wrappers (the gate, and the bound where the work goes into a stream) and interpose.c's table of
 * forms (dlsym, cuGetProcAddress). Read from cudaTypedefs.h of CUDA 13 (PFN_<name>_v<since>, its
 * _ptsz / _ptds per-thread forms) and cuda.h (the exported names).
 *
 * WORK_ASYNC(X): X(export, name, since, ptsz, (params), (args), stream, bytes): into `stream`;
 * WORK_SYNC(X):  X(export, name, since, ptsz, (params), (args), bytes): the call returns once done.
 */
#ifndef CGPU_WORK_H
#define CGPU_WORK_H

struct cgpu_mem_location { int type, id; };  /* cuda.h's CUmemLocation, passed by value */

#define WORK_ASYNC(X)                                                                                          \
    X(cuLaunchGridAsync, "cuLaunchGridAsync", 2000, 0, (void *f, int w, int h, void *s), (f, w, h, s), s, 0)   \
    X(cuMemcpyPeerAsync, "cuMemcpyPeerAsync", 4000, 0,                                                         \
      (CUdeviceptr d, void *dc, CUdeviceptr src, void *sc, size_t n, void *s), (d, dc, src, sc, n, s), s, n)   \
    X(cuMemcpyPeerAsync_ptsz, "cuMemcpyPeerAsync", 7000, 1,                                                    \
      (CUdeviceptr d, void *dc, CUdeviceptr src, void *sc, size_t n, void *s), (d, dc, src, sc, n, s), s, n)   \
    X(cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, 0, (const void *p, void *s), (p, s), s, 0)                  \
    X(cuMemcpy2DAsync_v2_ptsz, "cuMemcpy2DAsync", 7000, 1, (const void *p, void *s), (p, s), s, 0)             \
    X(cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", 3020, 0, (const void *p, void *s), (p, s), s, 0)                  \
    X(cuMemcpy3DAsync_v2_ptsz, "cuMemcpy3DAsync", 7000, 1, (const void *p, void *s), (p, s), s, 0)             \
    X(cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync", 4000, 0, (const void *p, void *s), (p, s), s, 0)             \
    X(cuMemcpy3DPeerAsync_ptsz, "cuMemcpy3DPeerAsync", 7000, 1, (const void *p, void *s), (p, s), s, 0)        \
    X(cuMemcpyBatchAsync, "cuMemcpyBatchAsync", 12080, 0,                                                      \
      (CUdeviceptr *d, CUdeviceptr *src, size_t *n, size_t c, void *a, size_t *ai, size_t na, size_t *fail, void *s), \
      (d, src, n, c, a, ai, na, fail, s), s, c)                                                                \
    X(cuMemcpyBatchAsync_ptsz, "cuMemcpyBatchAsync", 12080, 1,                                                 \
      (CUdeviceptr *d, CUdeviceptr *src, size_t *n, size_t c, void *a, size_t *ai, size_t na, size_t *fail, void *s), \
      (d, src, n, c, a, ai, na, fail, s), s, c)                                                                \
    X(cuMemcpyBatchAsync_v2, "cuMemcpyBatchAsync", 13000, 0,                                                   \
      (CUdeviceptr *d, CUdeviceptr *src, size_t *n, size_t c, void *a, size_t *ai, size_t na, void *s),        \
      (d, src, n, c, a, ai, na, s), s, c)                                                                      \
    X(cuMemcpyBatchAsync_v2_ptsz, "cuMemcpyBatchAsync", 13000, 1,                                              \
      (CUdeviceptr *d, CUdeviceptr *src, size_t *n, size_t c, void *a, size_t *ai, size_t na, void *s),        \
      (d, src, n, c, a, ai, na, s), s, c)                                                                      \
    X(cuMemsetD2D8Async, "cuMemsetD2D8Async", 3020, 0,                                                         \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, void *s), (d, p, v, w, h, s), s, w * h)   \
    X(cuMemsetD2D8Async_ptsz, "cuMemsetD2D8Async", 7000, 1,                                                    \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, void *s), (d, p, v, w, h, s), s, w * h)   \
    X(cuMemsetD2D16Async, "cuMemsetD2D16Async", 3020, 0,                                                       \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, void *s), (d, p, v, w, h, s), s, w * h)  \
    X(cuMemsetD2D16Async_ptsz, "cuMemsetD2D16Async", 7000, 1,                                                  \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, void *s), (d, p, v, w, h, s), s, w * h)  \
    X(cuMemsetD2D32Async, "cuMemsetD2D32Async", 3020, 0,                                                       \
      (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h, void *s), (d, p, v, w, h, s), s, w * h)        \
    X(cuMemsetD2D32Async_ptsz, "cuMemsetD2D32Async", 7000, 1,                                                  \
      (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h, void *s), (d, p, v, w, h, s), s, w * h)        \
    X(cuMemPrefetchAsync, "cuMemPrefetchAsync", 8000, 0, (CUdeviceptr d, size_t n, int dev, void *s),          \
      (d, n, dev, s), s, n)                                                                                    \
    X(cuMemPrefetchAsync_ptsz, "cuMemPrefetchAsync", 8000, 1, (CUdeviceptr d, size_t n, int dev, void *s),     \
      (d, n, dev, s), s, n)                                                                                    \
    X(cuMemPrefetchAsync_v2, "cuMemPrefetchAsync", 12020, 0,                                                   \
      (CUdeviceptr d, size_t n, struct cgpu_mem_location l, unsigned fl, void *s), (d, n, l, fl, s), s, n)     \
    X(cuMemPrefetchAsync_v2_ptsz, "cuMemPrefetchAsync", 12020, 1,                                              \
      (CUdeviceptr d, size_t n, struct cgpu_mem_location l, unsigned fl, void *s), (d, n, l, fl, s), s, n)     \
    X(cuStreamWriteValue32, "cuStreamWriteValue32", 8000, 0, (void *s, CUdeviceptr a, unsigned v, unsigned f), \
      (s, a, v, f), s, 4)                                                                                      \
    X(cuStreamWriteValue32_ptsz, "cuStreamWriteValue32", 8000, 1,                                              \
      (void *s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f), s, 4)                                    \
    X(cuStreamWriteValue32_v2, "cuStreamWriteValue32", 11070, 0,                                               \
      (void *s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f), s, 4)                                    \
    X(cuStreamWriteValue32_v2_ptsz, "cuStreamWriteValue32", 11070, 1,                                          \
      (void *s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f), s, 4)                                    \
    X(cuStreamWriteValue64, "cuStreamWriteValue64", 9000, 0,                                                   \
      (void *s, CUdeviceptr a, unsigned long long v, unsigned f), (s, a, v, f), s, 8)                          \
    X(cuStreamWriteValue64_ptsz, "cuStreamWriteValue64", 9000, 1,                                              \
      (void *s, CUdeviceptr a, unsigned long long v, unsigned f), (s, a, v, f), s, 8)                          \
    X(cuStreamWriteValue64_v2, "cuStreamWriteValue64", 11070, 0,                                               \
      (void *s, CUdeviceptr a, unsigned long long v, unsigned f), (s, a, v, f), s, 8)                          \
    X(cuStreamWriteValue64_v2_ptsz, "cuStreamWriteValue64", 11070, 1,                                          \
      (void *s, CUdeviceptr a, unsigned long long v, unsigned f), (s, a, v, f), s, 8)                          \
    X(cuStreamBatchMemOp, "cuStreamBatchMemOp", 8000, 0, (void *s, unsigned c, void *ops, unsigned f),        \
      (s, c, ops, f), s, c)                                                                                    \
    X(cuStreamBatchMemOp_ptsz, "cuStreamBatchMemOp", 8000, 1, (void *s, unsigned c, void *ops, unsigned f),   \
      (s, c, ops, f), s, c)                                                                                    \
    X(cuStreamBatchMemOp_v2, "cuStreamBatchMemOp", 11070, 0, (void *s, unsigned c, void *ops, unsigned f),    \
      (s, c, ops, f), s, c)                                                                                    \
    X(cuStreamBatchMemOp_v2_ptsz, "cuStreamBatchMemOp", 11070, 1, (void *s, unsigned c, void *ops, unsigned f), \
      (s, c, ops, f), s, c)

#define WORK_SYNC(X)                                                                                           \
    X(cuMemcpy, "cuMemcpy", 4000, 0, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), n)                   \
    X(cuMemcpy_ptds, "cuMemcpy", 7000, 1, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), n)              \
    X(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, 0, (CUdeviceptr d, const void *h, size_t n), (d, h, n), n)        \
    X(cuMemcpyHtoD_v2_ptds, "cuMemcpyHtoD", 7000, 1, (CUdeviceptr d, const void *h, size_t n), (d, h, n), n)   \
    X(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, 0, (void *h, CUdeviceptr d, size_t n), (h, d, n), n)              \
    X(cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", 7000, 1, (void *h, CUdeviceptr d, size_t n), (h, d, n), n)         \
    X(cuMemcpyDtoD_v2, "cuMemcpyDtoD", 3020, 0, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), n)        \
    X(cuMemcpyDtoD_v2_ptds, "cuMemcpyDtoD", 7000, 1, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), n)   \
    X(cuMemcpyPeer, "cuMemcpyPeer", 4000, 0, (CUdeviceptr d, void *dc, CUdeviceptr s, void *sc, size_t n),    \
      (d, dc, s, sc, n), n)                                                                                    \
    X(cuMemcpyPeer_ptds, "cuMemcpyPeer", 7000, 1, (CUdeviceptr d, void *dc, CUdeviceptr s, void *sc, size_t n), \
      (d, dc, s, sc, n), n)                                                                                    \
    X(cuMemcpy2D_v2, "cuMemcpy2D", 3020, 0, (const void *p), (p), 0)                                          \
    X(cuMemcpy2D_v2_ptds, "cuMemcpy2D", 7000, 1, (const void *p), (p), 0)                                     \
    X(cuMemcpy3D_v2, "cuMemcpy3D", 3020, 0, (const void *p), (p), 0)                                          \
    X(cuMemcpy3D_v2_ptds, "cuMemcpy3D", 7000, 1, (const void *p), (p), 0)                                     \
    X(cuMemsetD8_v2, "cuMemsetD8", 3020, 0, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n), n)          \
    X(cuMemsetD8_v2_ptds, "cuMemsetD8", 7000, 1, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n), n)     \
    X(cuMemsetD16_v2, "cuMemsetD16", 3020, 0, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n), n)       \
    X(cuMemsetD16_v2_ptds, "cuMemsetD16", 7000, 1, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n), n)  \
    X(cuMemsetD32_v2, "cuMemsetD32", 3020, 0, (CUdeviceptr d, unsigned v, size_t n), (d, v, n), n)             \
    X(cuMemsetD32_v2_ptds, "cuMemsetD32", 7000, 1, (CUdeviceptr d, unsigned v, size_t n), (d, v, n), n)        \
    X(cuMemsetD2D8_v2, "cuMemsetD2D8", 3020, 0, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h), \
      (d, p, v, w, h), w * h)                                                                                  \
    X(cuMemsetD2D16_v2, "cuMemsetD2D16", 3020, 0,                                                              \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h), (d, p, v, w, h), w * h)                 \
    X(cuMemsetD2D32_v2, "cuMemsetD2D32", 3020, 0, (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h),   \
      (d, p, v, w, h), w * h)

/* the legacy launches (CUDA 2.0's execution control, deprecated, still exported): gate.c's by hand */
CUresult cuLaunch(void *f);
CUresult cuLaunchGrid(void *f, int w, int h);
#define WORK_DECLARE_ASYNC(e, n, v, p, params, args, stream, bytes) CUresult e params;
#define WORK_DECLARE_SYNC(e, n, v, p, params, args, bytes) CUresult e params;
WORK_ASYNC(WORK_DECLARE_ASYNC)
WORK_SYNC(WORK_DECLARE_SYNC)

#endif
