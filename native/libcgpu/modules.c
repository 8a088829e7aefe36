/*
 * libcgpu, memory: modules and libraries, and a launch's lazy load (cgpu_memory.h).
 */
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>

#include "cgpu_memory.h"

/* The driver's functions about modules and functions (NULL: a driver without them). */
static struct {
    CUresult (*is_loaded)(int *, void *);        /* cuFuncIsLoaded (CUDA 12.4) */
    CUresult (*func_module)(void **, void *);    /* cuFuncGetModule (CUDA 11.0) */
    CUresult (*func_count)(unsigned *, void *);  /* cuModuleGetFunctionCount (CUDA 12.4) */
} pd;
static pthread_once_t pd_once = PTHREAD_ONCE_INIT;
static void pd_load(void)
{
    setup_once();  /* (the driver loaded first) */
    pd.is_loaded = (CUresult (*)(int *, void *))sym("cuFuncIsLoaded");
    pd.func_module = (CUresult (*)(void **, void *))sym("cuFuncGetModule");
    pd.func_count = (CUresult (*)(unsigned *, void *))sym("cuModuleGetFunctionCount");
}

/* ---- modules and libraries -----------------------------------------------------------------
 *
 * Their code goes to the card (at the load, or at a kernel's first launch with lazy loading): the
 * driver's own memory, which the readings charge once NVML shows it. A load that would take the
 * container past memsize is refused here: CUDA_ERROR_OUT_OF_MEMORY, nothing loaded. Its size is
 * the image's: a fat binary's header says it (the runtime's wrapper points at one), an ELF cubin
 * ends with its section headers, PTX is text; a file, its length. */
static size_t image_bytes(const void *image)
{
    const unsigned char *p = image;
    uint32_t magic;
    if (!p)
        return 0;
    if (strnlen(image, 4) < 4)
        return strlen(image);  /* (not 4 bytes of header: a short text, read no further) */
    memcpy(&magic, p, 4);
    if (magic == 0x466243b1u) {  /* __fatBinC_Wrapper_t {magic, version, data, ...} */
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        return data ? image_bytes(data) : 0;
    }
    if (magic == 0xba55ed50u) {  /* fatbinary_section.h: {magic, version u16, header_size u16, size u64} */
        uint16_t head;
        uint64_t size;
        memcpy(&head, p + 6, 2);
        memcpy(&size, p + 8, 8);
        return head + size;
    }
    if (!memcmp(p, "\177ELF", 4) && p[4] == 2) {  /* ELF64: e_shoff (40), e_shentsize (58), e_shnum (60) */
        uint64_t shoff;
        uint16_t entsize, num;
        memcpy(&shoff, p + 40, 8);
        memcpy(&entsize, p + 58, 2);
        memcpy(&num, p + 60, 2);
        return shoff + (size_t)entsize * num;
    }
    return strnlen(image, 64 << 20);  /* PTX */
}

static size_t file_bytes(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 ? (size_t)st.st_size : 0;
}

/* May `size` bytes of the driver's own go to the current GPU now? (Not charged: the readings do.) */
static int loadable(size_t size)
{
    int g = current_gpu();
    if (g < 0)
        return 1;  /* (a GPU given whole) */
    if (!need_slot())
        return 0;
    follow();
    driver_share(g);
    uint64_t used = __atomic_load_n(&usage->used[g], __ATOMIC_ACQUIRE), m = limits->memsize[g];
    return used <= m && size <= m - used;
}

static struct table module_bytes;  /* a module loaded through us -> its image's bytes */
static void loaded_module(void *m, size_t size)
{
    mem_lock();
    struct entry *e = m ? table_find(&module_bytes, (uint64_t)(uintptr_t)m) : NULL;
    if (m && !e)
        e = table_add(&module_bytes, (uint64_t)(uintptr_t)m);
    if (e) {
        e->size = size;
        e->maps = 0;  /* (none of its functions launched yet: a library's first use is to come) */
    }
    mem_unlock();
}

#define LOADED(size, out, call)                    \
    do {                                           \
        size_t n_ = (size);                        \
        if (!loadable(n_))                         \
            return CU_OUT_OF_MEMORY;               \
        in_driver++;                               \
        CUresult r_ = (call);                      \
        in_driver--;                               \
        if (r_ == CU_OK && (out))                  \
            loaded_module(*(out), n_);             \
        return r_;                                 \
    } while (0)

CUresult cuModuleLoad(void **m, const char *path)
{
    PASS_THROUGH(real.module_load, m, path);
    LOADED(file_bytes(path), m, real.module_load(m, path));
}

CUresult cuModuleLoadData(void **m, const void *image)
{
    PASS_THROUGH(real.module_load_data, m, image);
    LOADED(image_bytes(image), m, real.module_load_data(m, image));
}

CUresult cuModuleLoadDataEx(void **m, const void *image, unsigned n, void *options, void **values)
{
    PASS_THROUGH(real.module_load_data_ex, m, image, n, options, values);
    LOADED(image_bytes(image), m, real.module_load_data_ex(m, image, n, options, values));
}

CUresult cuModuleLoadFatBinary(void **m, const void *image)
{
    PASS_THROUGH(real.module_load_fatbin, m, image);
    LOADED(image_bytes(image), m, real.module_load_fatbin(m, image));
}

CUresult cuLibraryLoadData(void **l, const void *code, void *jit, void **jit_values, unsigned njit, void *options,
                           void **values, unsigned n)
{
    PASS_THROUGH(real.library_load_data, l, code, jit, jit_values, njit, options, values, n);
    LOADED(image_bytes(code), l, real.library_load_data(l, code, jit, jit_values, njit, options, values, n));
}

CUresult cuLibraryLoadFromFile(void **l, const char *path, void *jit, void **jit_values, unsigned njit, void *options,
                               void **values, unsigned n)
{
    PASS_THROUGH(real.library_load_file, l, path, jit, jit_values, njit, options, values, n);
    LOADED(file_bytes(path), l, real.library_load_file(l, (const void *)path, jit, jit_values, njit, options, values, n));
}

/* ---- a launch's lazy load (issue 34, item 7) ---------------------------------------------------
 *
 * With lazy loading (CUDA 12.2's default) a function's code goes onto the card at its first launch:
 * the driver's own memory, tens of MiB at a library's first use. A process that filled its instance
 * and then launches new code would take NVML's figure past memsize before any reading charges it
 * (and be killed by the watchdog). So a launch of a function not known loaded (cuFuncIsLoaded; else
 * its first launch through us) must find room for its code on the instance's GPU — its share of its
 * module's image (the image over the module's functions, in 2 MiB pages, at least one page) within
 * memsize, the headroom included — or it is answered CUDA_ERROR_OUT_OF_MEMORY, as the real driver
 * answers a lazy load that does not fit, and nothing is launched. Where the daemon's watchdog reads
 * NVML for the instance, that much is charged at once as the driver's own (the next readings settle
 * it to what the driver really took).
 *
 * A library's first use takes more than its code: the first launch of any function of a module of
 * a library's size (CGPU_LIBRARY_FUNCTIONS functions or more, default 8: cuBLAS, cuDNN, cuFFT,
 * NCCL) is foreseen CGPU_FIRST_USE_MIB more (default 64: the H100 grew 66 MiB at cuBLAS's first
 * matmul, its kernel's code one 2 MiB page of it), for its handles, tables and workspaces. */
static struct table loaded_fns;  /* functions known on the card */

static uint64_t env_count(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    char *end;
    unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
    return v && *v && !*end ? (uint64_t)n : dflt;
}

static void loaded_fn(void *f)
{
    mem_lock();
    if (!table_find(&loaded_fns, (uint64_t)(uintptr_t)f))
        table_add(&loaded_fns, (uint64_t)(uintptr_t)f);
    mem_unlock();
}

/* A function of module m was launched through us: its library's first use is behind it. */
static void module_used(void *m)
{
    if (!m)
        return;
    mem_lock();
    struct entry *e = table_find(&module_bytes, (uint64_t)(uintptr_t)m);
    if (!e)
        e = table_add(&module_bytes, (uint64_t)(uintptr_t)m);
    if (e)
        e->maps = 1;
    mem_unlock();
}

CUresult lazy_room(void *f)
{
    if (in_driver || !f || !isolated())
        return CU_OK;  /* (not isolated: the launch's own wrapper decides) */
    mem_lock();
    int known = table_find(&loaded_fns, (uint64_t)(uintptr_t)f) != NULL;
    mem_unlock();
    if (__builtin_expect(known, 1))
        return CU_OK;
    pthread_once(&pd_once, pd_load);
    int state = 0;
    uint64_t bytes = MEM_PAGE;
    void *m = NULL, *first = NULL;  /* first: a library's module whose first use this launch is */
    unsigned n = 0;
    in_driver++;
    if (pd.is_loaded && pd.is_loaded(&state, f) == CU_OK && state == 1)
        bytes = 0;  /* (CU_FUNCTION_LOADING_STATE_LOADED: on the card already) */
    else if (pd.func_module && pd.func_count && pd.func_module(&m, f) == CU_OK && m
             && pd.func_count(&n, m) == CU_OK && n) {
        mem_lock();
        struct entry *e = table_find(&module_bytes, (uint64_t)(uintptr_t)m);
        uint64_t image = e ? e->size : 0;
        int used = e && e->maps;
        mem_unlock();
        uint64_t share = (image / n + MEM_PAGE - 1) / MEM_PAGE * MEM_PAGE;
        bytes = share > bytes ? share : bytes;
        if (!used && n >= env_count("CGPU_LIBRARY_FUNCTIONS", 8)) {
            bytes += env_count("CGPU_FIRST_USE_MIB", 64) << 20;
            first = m;
        }
    }
    in_driver--;
    int g = current_gpu();
    if (!bytes || g < 0 || !need_slot()) {
        loaded_fn(f);
        module_used(first);
        return CU_OK;
    }
    if (!driver_room(g, bytes))
        return CU_OUT_OF_MEMORY;
    if (drv && __atomic_load_n(&drv->watched, __ATOMIC_ACQUIRE))
        charge_driver(g, (int64_t)bytes);
    loaded_fn(f);
    module_used(first);
    return CU_OK;
}

void modules_forked(void)
{
    table_drop(&loaded_fns);
    table_drop(&module_bytes);
}
