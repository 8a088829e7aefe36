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
    CUresult (*get_function)(void **, void *, const char *);  /* cuModuleGetFunction */
    CUresult (*kernel_function)(void **, void *);             /* cuKernelGetFunction (CUDA 12.0) */
    CUresult (*library_kernel)(void **, void *, const char *); /* cuLibraryGetKernel (CUDA 12.0) */
    CUresult (*library_module)(void **, void *);              /* cuLibraryGetModule (CUDA 12.0) */
    CUresult (*kernel_library)(void **, void *);              /* cuKernelGetLibrary (CUDA 12.5) */
    CUresult (*unload)(void *);                               /* cuModuleUnload */
    CUresult (*library_unload)(void *);                       /* cuLibraryUnload (CUDA 12.0) */
    CUresult (*set_limit)(int, size_t);                       /* cuCtxSetLimit */
    CUresult (*get_limit)(size_t *, int);                     /* cuCtxGetLimit */
    CUresult (*attribute)(int *, int, CUdevice);              /* cuDeviceGetAttribute */
} pd;
static pthread_once_t pd_once = PTHREAD_ONCE_INIT;
static void pd_load(void)
{
    setup_once();  /* (the driver loaded first) */
    pd.is_loaded = (CUresult (*)(int *, void *))sym("cuFuncIsLoaded");
    pd.func_module = (CUresult (*)(void **, void *))sym("cuFuncGetModule");
    pd.func_count = (CUresult (*)(unsigned *, void *))sym("cuModuleGetFunctionCount");
    pd.get_function = (CUresult (*)(void **, void *, const char *))sym("cuModuleGetFunction");
    pd.kernel_function = (CUresult (*)(void **, void *))sym("cuKernelGetFunction");
    pd.library_kernel = (CUresult (*)(void **, void *, const char *))sym("cuLibraryGetKernel");
    pd.library_module = (CUresult (*)(void **, void *))sym("cuLibraryGetModule");
    pd.kernel_library = (CUresult (*)(void **, void *))sym("cuKernelGetLibrary");
    pd.unload = (CUresult (*)(void *))sym("cuModuleUnload");
    pd.library_unload = (CUresult (*)(void *))sym("cuLibraryUnload");
    pd.set_limit = (CUresult (*)(int, size_t))sym("cuCtxSetLimit");
    pd.get_limit = (CUresult (*)(size_t *, int))sym("cuCtxGetLimit");
    pd.attribute = (CUresult (*)(int *, int, CUdevice))sym("cuDeviceGetAttribute");
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

/* The module tables' own lock (not the allocations': an allocation's table growth, a calloc and a
 * rehash under mem_lock, never holds up a module call or a launch); a launch reads the launched
 * functions' table without it (below, "functions launched"). */
static pthread_mutex_t modules_lock = PTHREAD_MUTEX_INITIALIZER;
static void mod_lock(void)
{
    pthread_mutex_lock(&modules_lock);
}
static void mod_unlock(void)
{
    pthread_mutex_unlock(&modules_lock);
}

static struct table module_bytes;  /* a module (or library) loaded through us -> its image's bytes */
static void loaded_module(void *m, size_t size)
{
    mod_lock();
    struct entry *e = m ? table_find(&module_bytes, (uint64_t)(uintptr_t)m) : NULL;
    if (m && !e)
        e = table_add(&module_bytes, (uint64_t)(uintptr_t)m);
    if (e) {
        e->size = size;
        e->maps = 0;  /* (none of its functions launched yet: a library's first use is to come) */
    }
    mod_unlock();
}

/* A library's module: what its functions name (cuFuncGetModule), so it is looked up by that. */
static void *library_module(void *l)
{
    void *m = NULL;
    pthread_once(&pd_once, pd_load);
    in_driver++;
    if (!l || !pd.library_module || pd.library_module(&m, l) != CU_OK)
        m = NULL;
    in_driver--;
    return m;
}

static void loaded_library(void *l, size_t size)
{
    loaded_module(l, size);
    loaded_module(library_module(l), size);
}

#define LOADED(size, out, call) LOADED_AS(loaded_module, size, out, call)
#define LOADED_AS(record, size, out, call)         \
    do {                                           \
        size_t n_ = (size);                        \
        if (!loadable(n_))                         \
            return CU_OUT_OF_MEMORY;               \
        in_driver++;                               \
        CUresult r_ = (call);                      \
        in_driver--;                               \
        if (r_ == CU_OK && (out))                  \
            record(*(out), n_);                    \
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
    LOADED_AS(loaded_library, image_bytes(code), l, real.library_load_data(l, code, jit, jit_values, njit, options, values, n));
}

CUresult cuLibraryLoadFromFile(void **l, const char *path, void *jit, void **jit_values, unsigned njit, void *options,
                               void **values, unsigned n)
{
    PASS_THROUGH(real.library_load_file, l, path, jit, jit_values, njit, options, values, n);
    LOADED_AS(loaded_library, file_bytes(path), l, real.library_load_file(l, (const void *)path, jit, jit_values, njit, options, values, n));
}

/* ---- lazy loading and a launch's first use (issues 34 and 45) ----------------------------------
 *
 * With lazy loading (CUDA_MODULE_LOADING=LAZY, Linux's default since CUDA 12.2) "loading a module
 * (cuModuleLoad*() family of functions) will not be loading kernels immediately, instead it will
 * delay loading of a kernel until cuModuleGetFunction() is called" (CUDA C++ Programming Guide,
 * "Lazy Loading"); cuLibraryGetKernel and cuKernelGetFunction are the library API's counterparts,
 * and a function not loaded yet (cuModuleEnumerateFunctions' "partially loaded" ones, a CUkernel
 * launched as it is) is loaded at its launch. A library's first use (its handles, tables and
 * workspaces: +66 MiB at cuBLAS's first matmul on the H100) comes at its first launch. All of it is
 * the driver's own memory, through no allocation call. So each of these calls must find room within
 * memsize (the headroom included) for what it may take, or it is answered CUDA_ERROR_OUT_OF_MEMORY
 * as the driver answers a load that does not fit, nothing done: the function's share of its
 * module's image (the image over the module's functions, in 2 MiB pages, at least a page); at the
 * first launch of a library-sized module (CGPU_LIBRARY_FUNCTIONS functions or more, default 8)
 * CGPU_FIRST_USE_MIB more (default 64); and, whatever the module's shape, never less than the
 * largest growth measured at such a call before (memory.c). What the driver then took is measured,
 * not guessed — at the call, or for a launch at the process's next call — and charged where the
 * watchdog reads the instance: a CUkernel launched with no module to look up, or a library's
 * hundreds of modules, are charged what their loads took, never 64 MiB each. */
/* (functions launched through us: `launched` below) */
static struct table got_fns;     /* (module or library, name) asked for before (handle: the module) */

static uint64_t env_count(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    char *end;
    unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
    return v && *v && !*end ? (uint64_t)n : dflt;
}

static void remember(struct table *t, uint64_t key, void *m)
{
    mod_lock();
    struct entry *e = table_find(t, key);
    if (!e && (e = table_add(t, key)))
        e->handle = (uint64_t)(uintptr_t)m;
    mod_unlock();
}

static int remembered(struct table *t, uint64_t key)
{
    mod_lock();
    int known = table_find(t, key) != NULL;
    mod_unlock();
    return known;
}

/* (module or library h, function name): a key of its own (FNV-1a over the name, the handle mixed in) */
static uint64_t name_key(const void *h, const char *name)
{
    uint64_t k = 1469598103934665603ull ^ (uint64_t)(uintptr_t)h;
    for (const char *c = name ? name : ""; *c; c++)
        k = (k ^ (unsigned char)*c) * 1099511628211ull;
    return k ? k : 1;
}

/* A function of module m was launched through us: its library's first use is behind it. */
static void module_used(void *m)
{
    if (!m)
        return;
    mod_lock();
    struct entry *e = table_find(&module_bytes, (uint64_t)(uintptr_t)m);
    if (!e)
        e = table_add(&module_bytes, (uint64_t)(uintptr_t)m);
    if (e)
        e->maps = 1;
    mod_unlock();
}

/* A function's code: its share of module m's image, in pages, at least one; *first: m is of a
 * library's size and none of its functions was launched yet; *used: one was. */
static uint64_t code_bytes(void *m, int *first, int *used)
{
    unsigned n = 0;
    uint64_t bytes = MEM_PAGE;
    *first = *used = 0;
    in_driver++;
    int counted = m && pd.func_count && pd.func_count(&n, m) == CU_OK && n;
    in_driver--;
    mod_lock();
    struct entry *e = m ? table_find(&module_bytes, (uint64_t)(uintptr_t)m) : NULL;
    uint64_t image = e ? e->size : 0;
    *used = e && e->maps;
    mod_unlock();
    if (counted) {
        uint64_t share = (image / n + MEM_PAGE - 1) / MEM_PAGE * MEM_PAGE;
        bytes = share > bytes ? share : bytes;
        *first = !*used && n >= env_count("CGPU_LIBRARY_FUNCTIONS", 8);
    }
    return bytes;
}

/* Room for `bytes` of the driver's own on the current GPU (a launch: never less than the largest
 * step a launch took before): CU_OK with the growth's watch begun (w->g < 0: nothing to watch), else
 * CU_OUT_OF_MEMORY. */
static CUresult load_room(struct growth *w, uint64_t bytes, int launch)
{
    int g = current_gpu();
    w->g = -1;
    if (g < 0)
        return CU_OK;  /* (a GPU given whole) */
    if (!need_slot())
        return CU_OUT_OF_MEMORY;
    uint64_t step = launch ? growth_step(g) : 0;
    if (!driver_room(g, bytes > step ? bytes : step))
        return CU_OUT_OF_MEMORY;
    growth_begin(g, w);
    return CU_OK;
}

static __thread uint64_t last_got;  /* this thread's last key asked for (a runtime asking per launch: no lock) */
static __thread unsigned last_unloads;  /* ... valid while no module was unloaded since */
static unsigned unloads;
#define LAST_GOT(k) ((k) == last_got && last_unloads == __atomic_load_n(&unloads, __ATOMIC_ACQUIRE))

/* A function (or kernel) handle asked for by `key` of module m: its code loaded now (lazy
 * loading), the first time; measured. */
#define GETS(key, m, call)                                                  \
    do {                                                                    \
        uint64_t k_ = (key);                                                \
        void *m_ = (m);                                                     \
        struct growth w_ = {.g = -1};                                       \
        int first_, used_;                                                  \
        if (!LAST_GOT(k_) && !remembered(&got_fns, k_)) {                   \
            CUresult lr_ = load_room(&w_, code_bytes(m_, &first_, &used_), 0); \
            if (lr_ != CU_OK)                                               \
                return lr_;                                                 \
        }                                                                   \
        in_driver++;                                                        \
        CUresult r_ = (call);                                               \
        in_driver--;                                                        \
        growth_end(&w_, 0);                                                 \
        if (r_ == CU_OK && !LAST_GOT(k_)) {                                 \
            last_unloads = __atomic_load_n(&unloads, __ATOMIC_ACQUIRE);     \
            remember(&got_fns, k_, m_);                                     \
            last_got = k_;                                                  \
        }                                                                   \
        return r_;                                                          \
    } while (0)

CUresult cuModuleGetFunction(void **f, void *m, const char *name)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.get_function, f, m, name);
    GETS(name_key(m, name), m, pd.get_function(f, m, name));
}

CUresult cuLibraryGetKernel(void **k, void *l, const char *name)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.library_kernel, k, l, name);
    GETS(name_key(l, name), library_module(l), pd.library_kernel(k, l, name));
}

/* (a kernel's library: cuKernelGetLibrary, CUDA 12.5; before it, none known) */
static void *kernel_module(void *k)
{
    void *l = NULL;
    in_driver++;
    if (!pd.kernel_library || pd.kernel_library(&l, k) != CU_OK)
        l = NULL;
    in_driver--;
    return l ? library_module(l) : NULL;
}

CUresult cuKernelGetFunction(void **f, void *k)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.kernel_function, f, k);
    GETS(name_key(k, "") ^ (uint64_t)current_gpu(), kernel_module(k), pd.kernel_function(f, k));
}

/* Unloaded: what was known of the module (or library) and its functions goes with it (the driver
 * may give a later function the same handle). What its code held comes back in the readings. */
static void fn_forget(void *m);  /* (below: the launched functions') */
static void forget_module(void *h, void *m)
{
    mod_lock();
    fn_forget(m);
    for (size_t i = 0; i < got_fns.cap;) {
        struct entry *e = &got_fns.e[i];
        if (e->used && m && e->handle == (uint64_t)(uintptr_t)m)
            table_erase(&got_fns, e);  /* (an entry may move into slot i: looked at again) */
        else
            i++;
    }
    __atomic_add_fetch(&unloads, 1, __ATOMIC_ACQ_REL);  /* (every thread's last key asked for: stale) */
    void *keys[] = {h, m};
    for (int i = 0; i < 2; i++) {
        struct entry *e = keys[i] ? table_find(&module_bytes, (uint64_t)(uintptr_t)keys[i]) : NULL;
        if (e)
            table_erase(&module_bytes, e);
    }
    mod_unlock();
}

CUresult cuModuleUnload(void *m)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.unload, m);
    in_driver++;
    CUresult r = pd.unload(m);
    in_driver--;
    if (r == CU_OK)
        forget_module(m, m);
    return r;
}

CUresult cuLibraryUnload(void *l)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.library_unload, l);
    void *m = library_module(l);
    in_driver++;
    CUresult r = pd.library_unload(l);
    in_driver--;
    if (r == CU_OK)
        forget_module(l, m);
    return r;
}

/* ---- the context's limits (issue 45, item 5) ----------------------------------------------------
 *
 * cuCtxSetLimit's CU_LIMIT_STACK_SIZE "controls the stack size in bytes of each GPU thread" (the
 * driver API reference): the driver backs the stack of every thread the card holds resident, local
 * memory of the stack times the multiprocessors times the threads each holds — hundreds of MiB per
 * KiB on an H100 (132 x 2048 threads) — and CU_LIMIT_MALLOC_HEAP_SIZE and CU_LIMIT_PRINTF_FIFO_SIZE
 * are a heap and a FIFO of their size: the driver's own memory, through no allocation call. Raising
 * one must find room for the difference within memsize (the headroom included), or it is answered
 * CUDA_ERROR_OUT_OF_MEMORY (one of cuCtxSetLimit's documented answers), the limit unchanged; what
 * the driver took is measured and charged as a load's. */
enum { LIMIT_STACK = 0, LIMIT_PRINTF_FIFO = 1, LIMIT_MALLOC_HEAP = 2 };
enum { ATTR_MULTIPROCESSORS = 16, ATTR_THREADS_PER_MULTIPROCESSOR = 39 };

static uint64_t limit_growth(int limit, size_t value)
{
    size_t now = 0;
    int sms = 0, threads = 0;
    CUdevice dev = 0;
    if (limit != LIMIT_STACK && limit != LIMIT_PRINTF_FIFO && limit != LIMIT_MALLOC_HEAP)
        return 0;
    in_driver++;
    int known = pd.get_limit && pd.get_limit(&now, limit) == CU_OK;
    if (limit == LIMIT_STACK && known)
        known = real.ctx_get_device && real.ctx_get_device(&dev) == CU_OK && pd.attribute
                && pd.attribute(&sms, ATTR_MULTIPROCESSORS, dev) == CU_OK
                && pd.attribute(&threads, ATTR_THREADS_PER_MULTIPROCESSOR, dev) == CU_OK;
    in_driver--;
    if (!known || value <= now)
        return 0;  /* (lowered, or not known: the measure and the readings charge it) */
    uint64_t more = value - now;
    return limit == LIMIT_STACK ? more * (uint64_t)(sms > 0 ? sms : 0) * (uint64_t)(threads > 0 ? threads : 0) : more;
}

CUresult cuCtxSetLimit(int limit, size_t value)
{
    pthread_once(&pd_once, pd_load);
    PASS_THROUGH(pd.set_limit, limit, value);
    int g = current_gpu();
    struct growth w = {.g = -1};
    if (g >= 0) {
        uint64_t more = limit_growth(limit, value);
        if (!need_slot() || (more && !driver_room(g, more)))
            return CU_OUT_OF_MEMORY;
        growth_begin(g, &w);
    }
    in_driver++;
    CUresult r = pd.set_limit(limit, value);
    in_driver--;
    growth_end(&w, 0);
    return r;
}

/* ---- functions launched (issue 45, item 10: the launch path takes no process-wide lock) ----------
 *
 * Every kernel launch asks whether its function was launched through us before (lazy_room): a
 * table of them, read with no lock. A writer (under modules_lock) adds in place, into an empty
 * slot (its module first, then its key, released); it grows, and forgets an unloaded module's
 * functions, by a new table copied from the current one and published with one atomic store. A
 * reader says which table it reads in its thread's record (a hazard, threads.c) before it reads
 * it, and looks the table up again: a table retired meanwhile is freed only once no record names
 * it (the hazard pointers of Michael, 2004). A reader never waits for a writer's calloc or copy;
 * a miss is looked again under the lock. Each thread also keeps its last CGPU_FN_CACHE functions seen
 * (an unload forgets them all, cgpu_fn_epoch): a launch of one of those reads no shared table at all. */
struct fn_table {
    size_t cap, n;  /* (cap a power of two; n entries in use) */
    struct fn_slot { uint64_t f, m; } s[];  /* f 0: empty */
};
static struct fn_table *launched;  /* (read by launches without a lock) */
#define RETIRED 64
static struct fn_table *retired[RETIRED];  /* (modules_lock) tables replaced, a reader maybe on them */
/* (cgpu_internal.h: both read first by the launch itself, lazy_room) */
unsigned cgpu_fn_epoch;  /* counts the forgettings: every thread's cache of an older one is stale */
__thread struct cgpu_fn_seen cgpu_fn_cache[CGPU_FN_CACHE] __attribute__((tls_model("initial-exec")));

static size_t fn_home(const struct fn_table *t, uint64_t f)
{
    return (size_t)(f * 0x9E3779B97F4A7C15ull >> 32) & (t->cap - 1);
}

static int fn_in(const struct fn_table *t, uint64_t f)
{
    if (!t)
        return 0;
    for (size_t i = fn_home(t, f), n = 0; n < t->cap; i = (i + 1) & (t->cap - 1), n++) {
        uint64_t k = __atomic_load_n(&t->s[i].f, __ATOMIC_ACQUIRE);
        if (k == f)
            return 1;
        if (!k)
            return 0;
    }
    return 0;
}

static void fn_place(struct fn_table *t, uint64_t f, uint64_t m)
{
    size_t i = fn_home(t, f);
    while (t->s[i].f)
        i = (i + 1) & (t->cap - 1);
    __atomic_store_n(&t->s[i].m, m, __ATOMIC_RELAXED);
    __atomic_store_n(&t->s[i].f, f, __ATOMIC_RELEASE);
    t->n++;
}

/* (modules_lock) a copy of the current table with room for `more`, without module `gone`'s functions */
static struct fn_table *fn_copy(size_t more, uint64_t gone)
{
    const struct fn_table *old = launched;
    size_t n = old ? old->n : 0, cap = 1024;
    while ((n + more + 1) * 4 > cap * 3)
        cap *= 2;
    struct fn_table *t = calloc(1, sizeof *t + cap * sizeof t->s[0]);
    if (!t)
        return NULL;
    t->cap = cap;
    for (size_t i = 0; old && i < old->cap; i++)
        if (old->s[i].f && !(gone && old->s[i].m == gone))
            fn_place(t, old->s[i].f, old->s[i].m);
    return t;
}

/* (modules_lock) t becomes the current table; the one before is freed once no reader is on it */
static void fn_publish(struct fn_table *t)
{
    struct fn_table *old = __atomic_exchange_n(&launched, t, __ATOMIC_SEQ_CST);
    for (int i = 0; old && i < RETIRED; i++)
        if (!retired[i]) {
            retired[i] = old;
            old = NULL;
        }
    (void)old;  /* (no room to keep it, 64 retired tables all still read: left, never freed under a reader) */
    for (int i = 0; i < RETIRED; i++)
        if (retired[i] && !cgpu_hazard(retired[i])) {
            free(retired[i]);
            retired[i] = NULL;
        }
}

static void fn_remember(uint64_t f, void *m)
{
    mod_lock();
    struct fn_table *t = launched;
    if (!fn_in(t, f)) {
        if (t && (t->n + 1) * 4 <= t->cap * 3)
            fn_place(t, f, (uint64_t)(uintptr_t)m);
        else if ((t = fn_copy(1, 0))) {
            fn_place(t, f, (uint64_t)(uintptr_t)m);
            fn_publish(t);
        }
    }
    mod_unlock();
}

/* (modules_lock) module m's functions forgotten, and every thread's cache */
static void fn_forget(void *m)
{
    struct fn_table *t = m ? fn_copy(0, (uint64_t)(uintptr_t)m) : NULL;
    if (t)
        fn_publish(t);
    __atomic_add_fetch(&cgpu_fn_epoch, 1, __ATOMIC_SEQ_CST);
}

/* Whether f was launched through us before: no lock, no write to a word another thread writes. */
static int fn_launched(uint64_t f)
{
    unsigned epoch = __atomic_load_n(&cgpu_fn_epoch, __ATOMIC_ACQUIRE), c = (unsigned)(f >> 4) % CGPU_FN_CACHE;
    if (cgpu_fn_cache[c].f == f && cgpu_fn_cache[c].epoch == epoch)
        return 1;
    struct cgpu_thread *me = cgpu_self();
    int known;
    if (__builtin_expect(me != NULL, 1)) {
        struct fn_table *t;
        do {
            t = __atomic_load_n(&launched, __ATOMIC_ACQUIRE);
            __atomic_store_n(&me->hazard, t, __ATOMIC_SEQ_CST);
        } while (t != __atomic_load_n(&launched, __ATOMIC_SEQ_CST));
        known = fn_in(t, f);
        __atomic_store_n(&me->hazard, NULL, __ATOMIC_RELEASE);
    } else {  /* (no record for this thread: under the lock) */
        mod_lock();
        known = fn_in(launched, f);
        mod_unlock();
    }
    if (known) {
        cgpu_fn_cache[c].f = f;
        cgpu_fn_cache[c].epoch = epoch;
    }
    return known;
}

/* Before a kernel launch of `f`: what its first launch may grow the card by must fit (above); the
 * growth measured at the process's next call. */
CUresult lazy_room_slow(void *f)
{
    if (in_driver || !f || !isolated())
        return CU_OK;  /* (not isolated: the launch's own wrapper decides) */
    if (__builtin_expect(fn_launched((uint64_t)(uintptr_t)f), 1))
        return CU_OK;
    pthread_once(&pd_once, pd_load);
    int state = 0, first, used;
    void *m = NULL;
    in_driver++;
    int loaded = pd.is_loaded && pd.is_loaded(&state, f) == CU_OK && state == 1;  /* CU_FUNCTION_LOADING_STATE_LOADED */
    if (!pd.func_module || pd.func_module(&m, f) != CU_OK)
        m = NULL;
    in_driver--;
    uint64_t bytes = code_bytes(m, &first, &used);
    bytes = (loaded ? 0 : bytes) + (first ? env_count("CGPU_FIRST_USE_MIB", 64) << 20 : 0);
    int g = current_gpu();
    if ((loaded && used) || g < 0 || !need_slot()) {
        fn_remember((uint64_t)(uintptr_t)f, m);
        return CU_OK;
    }
    struct growth w;
    CUresult r = load_room(&w, bytes, 1);
    if (r != CU_OK)
        return r;
    growth_pending(&w);
    fn_remember((uint64_t)(uintptr_t)f, m);
    module_used(m);
    return CU_OK;
}

static void modules_forked(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;  /* (a parent's thread may have held it at the fork) */
    modules_lock = fresh;
    last_got = 0;
    launched = NULL;  /* (the parent's, and those retired: left, as a reader of the parent's may be on them) */
    memset(retired, 0, sizeof retired);
    __atomic_add_fetch(&cgpu_fn_epoch, 1, __ATOMIC_SEQ_CST);
    table_drop(&got_fns);
    table_drop(&module_bytes);
}

__attribute__((constructor)) static void modules_hooks(void)
{
    memory_on_fork(modules_forked);
}
