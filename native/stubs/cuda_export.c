/*
 * The stand-in driver's private export tables (cuGetExportTable), and the names of the driver
 * API that only NVIDIA's CUDA runtime and the libraries on it ask cuGetProcAddress for.
 *
 * libcudart does not reach the driver through cuda.h alone: at its start it asks
 * cuGetExportTable(&table, &uuid) for tables of functions that cuda.h does not name, each
 * known by a UUID, and calls them by their index. What they are is public knowledge from
 * ZLUDA (github.com/vosen/ZLUDA: dark_api/src/lib.rs lists the tables, their lengths and the
 * functions' arguments; zluda/src/impl/driver.rs answers them): the facts below come from
 * there, the code is ours. A table starts with its own size in bytes (slot 0) unless said;
 * a slot the runtime is not known to call is NULL, as ZLUDA leaves it. A UUID the stand-in
 * does not know gets CUDA_ERROR_INVALID_VALUE, as in ZLUDA.
 *
 *   6bd5fb6c-5bf4-e74a-8987-d93912fd9df9  the runtime's interface, 13 slots: [1] a module from
 *       a fat binary's wrapper, [2] a device's primary context without making it active,
 *       [6] and [8] modules from fat binaries with more arguments (refused unless those are
 *       zero, NULL, NULL), [7] a notice taking one word, [12] load the compilers.
 *   42d85a81-23f6-cb47-8298-f6e78a3aecdc  the tools' thread-local storage, 4 slots: [2] the
 *       calling thread's current context (as cuCtxGetCurrent).
 *   21318c60-9714-3248-8ca6-41ff7324c8f2  contexts' identity: the driver's table is long; the
 *       stand-in's has 5 slots, [4] cuCtxGetId (what cuBLAS is known to call).
 *   a094798c-2e74-2e74-93f2-0800200c0a66  the tools' callback hooks, 7 slots: [2] and [6]
 *       give the runtime a buffer of the driver's (1024 and 14 words) and its length.
 *   c693336e-1121-df11-a8c3-68f355d89593  context-local storage (no size slot): [0] put
 *       (context, key, value, destructor), [1] delete, [2] get (CUDA_ERROR_INVALID_HANDLE for
 *       a key never put); context NULL is the current one.
 *   0ca50b8c-1004-929a-89a7-d0df10e77286  context creation bypassing the tools, 2 slots:
 *       CUDA_ERROR_NOT_SUPPORTED (ZLUDA does not build it either).
 *   195bcbf4-d67d-024a-acc5-1d29cea631ae  heap access, 3 slots: not supported.
 *   b10541e1-f7c7-c74a-9f64-f223be99f1e2  extended device attributes, 26 slots: not supported.
 *   d4082055-bde6-704b-8d34-ba123c66e1f2  the integrity check, 3 slots: [1] (version, unix
 *       seconds, 16-byte result) an HMAC-MD2 with a fixed key over the driver version, the
 *       check's version, pid, thread, the addresses of two tables and of the check itself,
 *       the time, and every device's UUID and PCI domain, bus and device; versions ending in
 *       0 and 1 get fixed answers. The runtime refuses a driver whose answer is wrong.
 *   263e8860-7cd2-6143-92f6-bbd5006dfa7e  context checks, 4 slots: [2] (context, &flags,
 *       &pointer) flags 0; [3] 0.
 *
 * CGPU_STUB_CUDA_TRACE=path appends a line per name cuGetProcAddress does not know and per
 * table asked for: what to add when a new runtime asks for more.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_stub.h"

typedef struct { unsigned char bytes[16]; } CUuuid;
typedef void *CUcontext;

/* ---- the runtime's interface ---- */
CUresult cuModuleLoadData(void **module, const void *image);
CUresult cuModuleLoadFatBinary(void **module, const void *image);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, int dev);

/* __fatBinC_Wrapper_t (fatbinary_section.h): magic 0x466243b1, version 1 or 2, the fat binary */
struct fatbin_wrapper { unsigned magic, version; const void *data, *filename_or_fatbins; };

static CUresult rt_module_from_wrapper(void **module, const struct fatbin_wrapper *w)
{
    if (!module || !w) return STUB_INVALID_VALUE;
    if (w->magic != 0x466243b1u || (w->version != 1 && w->version != 2) || !w->data) return STUB_INVALID_IMAGE;
    return cuModuleLoadFatBinary(module, w->data);
}
static CUresult rt_primary_ctx(CUcontext *ctx, int dev)
{
    stub_trace("runtime interface: primary context of %d", dev);
    if (!ctx) return STUB_INVALID_VALUE;
    return cuDevicePrimaryCtxRetain(ctx, dev);  /* (the stand-in's contexts are their device: never made current here) */
}
static CUresult rt_module_from_wrapper_ext(void **module, const struct fatbin_wrapper *w, void *a3, void *a4, unsigned a5)
{
    if (a3 || a4 || a5) return STUB_NOT_SUPPORTED;
    return rt_module_from_wrapper(module, w);
}
static void rt_notice(size_t word) { (void)word; }
static CUresult rt_module_from_fatbin_ext(const void *fatbin, void **module, void *a3, void *a4, unsigned a5)
{
    if (a3 || a4 || a5) return STUB_NOT_SUPPORTED;
    if (!module || !fatbin) return STUB_INVALID_VALUE;
    return cuModuleLoadFatBinary(module, fatbin);
}
static CUresult rt_load_compilers(void) { return STUB_OK; }

static const void *CUDART_INTERFACE[13] = {
    (void *)(13 * sizeof(void *)), (void *)rt_module_from_wrapper, (void *)rt_primary_ctx, NULL, NULL, NULL,
    (void *)rt_module_from_wrapper_ext, (void *)rt_notice, (void *)rt_module_from_fatbin_ext, NULL, NULL, NULL,
    (void *)rt_load_compilers,
};

/* ---- the tools' ---- */
CUresult cuCtxGetCurrent(CUcontext *ctx);
static CUresult tools_current_context(CUcontext *ctx) { return ctx ? cuCtxGetCurrent(ctx) : STUB_INVALID_VALUE; }
static const void *TOOLS_TLS[4] = {(void *)(4 * sizeof(void *)), NULL, (void *)tools_current_context};

/* ---- contexts' identity: [4] is cuCtxGetId; the driver's longer table is cut to what is known ---- */
CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id);
static const void *CONTEXT_IDENTITY[5] = {(void *)(5 * sizeof(void *)), NULL, NULL, NULL, (void *)cuCtxGetId};
static unsigned tools_buffer1[1024], tools_buffer2[14];
static void tools_buffer_1(void **p, size_t *n) { stub_trace("tools buffer 1"); *p = tools_buffer1; *n = sizeof tools_buffer1 / sizeof *tools_buffer1; }
static void tools_buffer_2(void **p, size_t *n) { stub_trace("tools buffer 2"); *p = tools_buffer2; *n = sizeof tools_buffer2 / sizeof *tools_buffer2; }
static const void *TOOLS_HOOKS[7] = {
    (void *)(7 * sizeof(void *)), NULL, (void *)tools_buffer_1, NULL, NULL, NULL, (void *)tools_buffer_2,
};

/* ---- context-local storage: per device's (primary) context, keys the runtime's own ---- */
typedef void (*cls_dtor)(CUcontext, void *, void *);
static struct { CUcontext ctx; void *key, *value; cls_dtor dtor; } cls[256];
static pthread_mutex_t cls_lock = PTHREAD_MUTEX_INITIALIZER;

CUresult cuCtxGetCurrent(CUcontext *ctx);
static CUresult cls_context(CUcontext *ctx)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (*ctx) {
        uintptr_t d = (uintptr_t)*ctx;
        return d >= 1 && d <= (uintptr_t)stub_device_count() ? STUB_OK : STUB_INVALID_CONTEXT;
    }
    cuCtxGetCurrent(ctx);
    return *ctx ? STUB_OK : STUB_INVALID_CONTEXT;
}
static CUresult cls_put(CUcontext ctx, void *key, void *value, cls_dtor dtor)
{
    CUresult r = cls_context(&ctx);
    if (r) return r;
    pthread_mutex_lock(&cls_lock);
    int free_slot = -1;
    for (int i = 0; i < 256; i++) {
        if (cls[i].ctx == ctx && cls[i].key == key) {
            cls[i].value = value;
            cls[i].dtor = dtor;
            pthread_mutex_unlock(&cls_lock);
            return STUB_OK;
        }
        if (!cls[i].ctx && free_slot < 0) free_slot = i;
    }
    if (free_slot >= 0) {
        cls[free_slot].ctx = ctx;
        cls[free_slot].key = key;
        cls[free_slot].value = value;
        cls[free_slot].dtor = dtor;
    }
    pthread_mutex_unlock(&cls_lock);
    return free_slot >= 0 ? STUB_OK : STUB_OUT_OF_MEMORY;
}
static CUresult cls_delete(CUcontext ctx, void *key)
{
    CUresult r = cls_context(&ctx);
    if (r) return r;
    pthread_mutex_lock(&cls_lock);
    for (int i = 0; i < 256; i++)
        if (cls[i].ctx == ctx && cls[i].key == key) cls[i].ctx = NULL;
    pthread_mutex_unlock(&cls_lock);
    return STUB_OK;
}
static CUresult cls_get(void **value, CUcontext ctx, void *key)
{
    if (!value) return STUB_INVALID_VALUE;
    CUresult r = cls_context(&ctx);
    if (r) return r;
    r = STUB_INVALID_HANDLE;
    pthread_mutex_lock(&cls_lock);
    for (int i = 0; i < 256; i++)
        if (cls[i].ctx == ctx && cls[i].key == key) {
            *value = cls[i].value;
            r = STUB_OK;
        }
    pthread_mutex_unlock(&cls_lock);
    return r;
}
static const void *CONTEXT_STORAGE[4] = {(void *)cls_put, (void *)cls_delete, (void *)cls_get, NULL};

/* ---- what the stand-in does not do ---- */
static CUresult not_supported(void) { return STUB_NOT_SUPPORTED; }
static const void *CTX_CREATE_BYPASS[2] = {(void *)(2 * sizeof(void *)), (void *)not_supported};
static const void *HEAP_ACCESS[3] = {(void *)(3 * sizeof(void *)), (void *)not_supported, (void *)not_supported};
static const void *DEVICE_EXTENDED[26] = {
    (void *)(26 * sizeof(void *)), NULL, NULL, NULL, NULL, (void *)not_supported, NULL, NULL, NULL, NULL, NULL, NULL,
    NULL, (void *)not_supported,
};

/* ---- context checks ---- */
static CUresult context_check(CUcontext ctx, unsigned *flags, const void **p)
{
    (void)ctx; (void)p;
    if (!flags) return STUB_INVALID_VALUE;
    *flags = 0;
    return STUB_OK;
}
static unsigned context_check3(void) { return 0; }
static const void *CONTEXT_CHECKS[4] = {(void *)(4 * sizeof(void *)), NULL, (void *)context_check, (void *)context_check3};

/* ---- the integrity check: HMAC over MD2 (RFC 1319's S-box, 16-byte blocks) ---- */
static const unsigned char MD2_S[256] = {
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199, 115, 140,
    152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66, 111, 24, 138, 23, 229, 18,
    190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47, 238, 122, 169, 104, 121, 145, 21, 178, 7, 63,
    148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93, 154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3,
    255, 25, 48, 179, 72, 165, 181, 209, 215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182,
    118, 252, 107, 226, 156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2,
    27, 96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81, 175, 58,
    195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205, 244, 65, 129, 77, 82,
    106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74, 120, 136, 149, 139, 227, 99, 232, 109,
    233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14, 102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10,
    49, 68, 80, 180, 143, 237, 31, 26, 219, 153, 141, 51, 159, 17, 131, 20,
};
struct md2 { unsigned char x[48], checksum[16], block[16]; unsigned n; unsigned char last; };

static void md2_byte(struct md2 *m, unsigned char b)
{
    m->block[m->n] = b;
    m->last = m->checksum[m->n] ^= MD2_S[b ^ m->last];
    if (++m->n < 16) return;
    m->n = 0;
    for (int j = 0; j < 16; j++) {
        m->x[16 + j] = m->block[j];
        m->x[32 + j] = m->x[16 + j] ^ m->x[j];
    }
    unsigned t = 0;
    for (int j = 0; j < 18; j++) {
        for (int k = 0; k < 48; k++) t = m->x[k] ^= MD2_S[t];
        t = (t + j) & 0xff;
    }
}
static void md2_bytes(struct md2 *m, const void *p, size_t n, unsigned char mask)
{
    for (size_t i = 0; i < n; i++) md2_byte(m, ((const unsigned char *)p)[i] ^ mask);
}
static void md2_final(struct md2 *m, unsigned char out[16])
{
    unsigned char pad = (unsigned char)(16 - m->n), sum[16];
    for (unsigned i = pad; i; i--) md2_byte(m, pad);
    memcpy(sum, m->checksum, 16);
    md2_bytes(m, sum, 16, 0);
    memcpy(out, m->x, 16);
}

CUresult cuDriverGetVersion(int *v);
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, int d);
CUresult cuDeviceGetAttribute(int *v, int attr, int dev);
static const void *INTEGRITY[3];

static CUresult integrity_check(unsigned version, unsigned long long seconds, unsigned long long result[2])
{
    if (!result) return STUB_INVALID_VALUE;
    if (version % 10 == 0 || version % 10 == 1) {
        result[0] = version % 10 ? 0x1841181c03cb675cull : 0x3341181c03cb675cull;
        result[1] = 0x8ed383aa1f4cd1e8ull;
        return STUB_OK;
    }
    static const unsigned char key[16] = {0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52,
                                          0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f};
    struct { unsigned driver, version, pid, thread; const void *cudart_table, *check_table, *check_fn;
             unsigned long long seconds; } in;
    memset(&in, 0, sizeof in);
    int drv = 0;
    cuDriverGetVersion(&drv);
    in.driver = (unsigned)drv;
    in.version = version;
    in.pid = (unsigned)getpid();
    in.thread = (unsigned)(uintptr_t)pthread_self();
    in.cudart_table = CUDART_INTERFACE;
    in.check_table = INTEGRITY;
    in.check_fn = INTEGRITY[1];
    in.seconds = seconds;
    struct md2 m;
    memset(&m, 0, sizeof m);
    md2_bytes(&m, key, 16, 0x36);
    md2_bytes(&m, &in, sizeof in, 0);
    for (int d = 0; d < stub_device_count(); d++) {
        struct { unsigned char uuid[16]; int domain, bus, device; } dev;
        memset(&dev, 0, sizeof dev);
        cuDeviceGetUuid_v2(dev.uuid, d);  /* (zero where the stand-in has none) */
        cuDeviceGetAttribute(&dev.domain, 50, d);
        cuDeviceGetAttribute(&dev.bus, 33, d);
        cuDeviceGetAttribute(&dev.device, 34, d);
        md2_bytes(&m, &dev, sizeof dev, 0);
    }
    unsigned char inner[16];
    md2_final(&m, inner);
    memset(&m, 0, sizeof m);
    md2_bytes(&m, key, 16, 0x5c);
    md2_bytes(&m, inner, 16, 0);
    md2_final(&m, (unsigned char *)result);
    return STUB_OK;
}
static const void *INTEGRITY[3] = {(void *)(3 * sizeof(void *)), (void *)integrity_check, NULL};

static const struct { unsigned char uuid[16]; const void *table; const char *name; } TABLES[] = {
    {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     CUDART_INTERFACE, "runtime interface"},
    {{0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc},
     TOOLS_TLS, "tools TLS"},
    {{0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66},
     TOOLS_HOOKS, "tools callback hooks"},
    {{0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93},
     CONTEXT_STORAGE, "context-local storage"},
    {{0x0c, 0xa5, 0x0b, 0x8c, 0x10, 0x04, 0x92, 0x9a, 0x89, 0xa7, 0xd0, 0xdf, 0x10, 0xe7, 0x72, 0x86},
     CTX_CREATE_BYPASS, "context create bypass"},
    {{0x19, 0x5b, 0xcb, 0xf4, 0xd6, 0x7d, 0x02, 0x4a, 0xac, 0xc5, 0x1d, 0x29, 0xce, 0xa6, 0x31, 0xae},
     HEAP_ACCESS, "heap access"},
    {{0xb1, 0x05, 0x41, 0xe1, 0xf7, 0xc7, 0xc7, 0x4a, 0x9f, 0x64, 0xf2, 0x23, 0xbe, 0x99, 0xf1, 0xe2},
     DEVICE_EXTENDED, "extended device attributes"},
    {{0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     INTEGRITY, "integrity check"},
    {{0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2},
     CONTEXT_IDENTITY, "context identity"},
    {{0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     CONTEXT_CHECKS, "context checks"},
};

CUresult cuGetExportTable(const void **table, const CUuuid *id)
{
    if (!table || !id) return STUB_INVALID_VALUE;
    for (size_t i = 0; i < sizeof TABLES / sizeof *TABLES; i++)
        if (!memcmp(TABLES[i].uuid, id->bytes, 16)) {
            stub_trace("export table %s", TABLES[i].name);
            *table = TABLES[i].table;
            return STUB_OK;
        }
    const unsigned char *u = id->bytes;
    stub_trace("export table unknown %02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
               u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    *table = NULL;
    return STUB_NOT_FOUND;
}

/* ---- cuGetProcAddress: libcuda.c's names, cuda_graphs.c's, and the rest ---- */
struct stub_proc { const char *name; void *fn; };
extern HIDDEN const struct stub_proc STUB_PROCS_MODULES[], STUB_PROCS_DEVICE[], STUB_PROCS_POOLS[];
static const struct stub_proc STUB_PROCS_EXPORT[] = {
    {"cuGetExportTable", (void *)cuGetExportTable}, {NULL, NULL},
};

/* a name libcuda.c's table does not know, or NULL */
static void *more_proc(const char *symbol, int version, uint64_t flags)
{
    if (!strcmp(symbol, "cuStreamGetCaptureInfo")) return stub_capture_info(version);  /* three forms by version */
    const struct stub_proc *lists[] = {STUB_PROCS_EXPORT, STUB_PROCS_MODULES, STUB_PROCS_DEVICE, STUB_PROCS_POOLS};
    char ptsz[256];  /* (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: a name's _ptsz form where it has one) */
    snprintf(ptsz, sizeof ptsz, "%s_ptsz", symbol);
    for (size_t l = 0; flags & 2 && l < sizeof lists / sizeof *lists; l++)
        for (const struct stub_proc *p = lists[l]; p->name; p++)
            if (!strcmp(p->name, ptsz)) return p->fn;
    for (size_t l = 0; l < sizeof lists / sizeof *lists; l++)
        for (const struct stub_proc *p = lists[l]; p->name; p++)
            if (!strcmp(p->name, symbol)) return p->fn;
    stub_trace("proc unknown %s %d %llu", symbol, version, (unsigned long long)flags);
    return NULL;
}

/* The form of a name of libcuda.c's or cuda_memory.c's for (version, flags); NULL, with *named 1
 * when the name is there but no form of it is (the version too old). */
static void *versioned_proc(const char *symbol, int version, uint64_t flags, int *named)
{
    const struct stub_versioned *best = NULL, *tables[] = {STUB_VERSIONED_LIBCUDA, STUB_VERSIONED_MEMORY};
    *named = 0;
    for (size_t t = 0; t < sizeof tables / sizeof *tables; t++)
        for (const struct stub_versioned *v = tables[t]; v->name; v++) {
            if (strcmp(symbol, v->name)) continue;
            *named = 1;
            if (v->since > version || (v->ptsz && !(flags & 2))) continue;
            if (!best || v->ptsz > best->ptsz || (v->ptsz == best->ptsz && v->since > best->since))
                best = v;
        }
    return best ? best->fn : NULL;
}

/* What cuGetProcAddress answers, as the real driver does, by (name, version, flags): each form of a
 * name from the CUDA version that introduced it (cudaTypedefs.h's PFN_<name>_v<version>), and
 * its per-thread-default-stream form (_ptsz) for CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    if (!symbol || !pfn || flags > 2) return STUB_INVALID_VALUE;  /* DEFAULT 0, LEGACY_STREAM 1, PER_THREAD 2 */
    if (!strcmp(symbol, "cuGetProcAddress")) {
        *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
        if (status) *status = 0;
        return STUB_OK;
    }
    if ((*pfn = stub_graphs_proc(symbol, version))) {  /* cuda_graphs.c: streams, capture and graphs */
        if (status) *status = 0;
        return STUB_OK;
    }
    int named = 0;
    if ((*pfn = stub_contexts_proc(symbol, version, &named))) {  /* cuda_contexts.c: contexts, green ones */
        if (status) *status = 0;
        return STUB_OK;
    }
    if (!named && (*pfn = versioned_proc(symbol, version, flags, &named))) {
        if (status) *status = 0;  /* CU_GET_PROC_ADDRESS_SUCCESS */
        return STUB_OK;
    }
    if (named) {
        if (status) *status = 2;  /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
        return STUB_NOT_FOUND;
    }
    if ((*pfn = more_proc(symbol, version, flags))) {  /* what the real runtime asks for */
        if (status) *status = 0;
        return STUB_OK;
    }
    if (status) *status = 1;  /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return STUB_NOT_FOUND;
}
