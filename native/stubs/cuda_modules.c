/*
 * The stand-in driver's modules, libraries, kernels and functions (cuda.h's "Module
 * Management" and "Library Management"): what NVIDIA's CUDA runtime registers its fat binaries
 * through and what CuPy loads NVRTC's output with.
 *
 * An image is read as the driver reads it, only far enough to be strict: a fat binary
 * (fatbinary_section.h: header magic 0xba55ed50, version 1, or the runtime's wrapper of one,
 * magic 0x466243b1, which cuLibraryLoadData is given; entries of kind 1 PTX and 2 ELF,
 * each naming its sm_XY), a cubin (ELF64, machine EM_CUDA 190) or PTX text (".version"). A
 * fat binary must hold an ELF this card runs (the same major architecture, minor not above the
 * card's 7.5) or PTX no newer than the card, else CUDA_ERROR_NO_BINARY_FOR_GPU; anything else
 * is CUDA_ERROR_INVALID_IMAGE. A function's or global's name must be in the image: an ELF's
 * symbol table (STT_FUNC / STT_OBJECT), or PTX's ".entry" / ".global" lines; a compressed
 * entry (flags 0x2000 LZ4, 0x8000 zstd: nvcc 13 packs PTX so, CuPy's own fat binaries every
 * entry) is read through the system's liblz4.so.1 / libzstd.so.1. Else CUDA_ERROR_NOT_FOUND,
 * as the driver says. Nothing runs: a launch takes the
 * card's time (libcuda.c), a global is an address range the copies accept, with no contents.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_stub.h"

#define CARD_MAJOR 7
#define CARD_MINOR 5
enum { MOD_MAGIC = 0x6d6f6475, LIB_MAGIC = 0x6c696272, KERN_MAGIC = 0x6b65726e, FUNC_MAGIC = 0x66756e63 };

struct symbol { char *name; size_t size; CUdeviceptr addr; int object; };
struct module {
    unsigned magic;
    struct symbol *syms;
    int nsyms;
    struct library *library;  /* a library's module: unloaded with it */
    int dev;                  /* the card its code is on */
    uint64_t on_card;         /* the driver's memory it holds there: its image, its functions loaded */
    uint64_t image;           /* its image's bytes (a fat binary's header says it, an ELF's section headers end, PTX's length) */
    int launched;             /* a function of it has been launched (a library's first use) */
};
struct library { unsigned magic; struct module *module; };
struct function {
    unsigned magic;
    struct module *module;
    const char *name;
    int max_dynamic_shared, cache_config;
    int loaded;  /* launched once: its code is on the card (lazy loading, CUDA 12.2's default) */
};
struct kernel { unsigned magic; struct library *library; struct function *function; };

static CUresult load_code(struct function *f);  /* (lazy loading, below) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void **live;  /* every handle given out and not unloaded */
static size_t nlive, caplive;

static void track(void *h)
{
    if (nlive == caplive) {
        caplive = caplive ? caplive * 2 : 256;
        live = realloc(live, caplive * sizeof *live);
    }
    live[nlive++] = h;
}
static void untrack(void *h)
{
    for (size_t i = 0; i < nlive; i++)
        if (live[i] == h) { live[i] = live[--nlive]; return; }
}
static int valid(const void *h, unsigned magic)
{
    if (!h) return 0;
    for (size_t i = 0; i < nlive; i++)
        if (live[i] == h) return *(const unsigned *)h == magic;
    return 0;
}
int stub_function_valid(const void *f)
{
    pthread_mutex_lock(&lock);
    int ok = valid(f, FUNC_MAGIC) || valid(f, KERN_MAGIC);
    pthread_mutex_unlock(&lock);
    return ok;
}

/* ---- reading images ---- */
static CUdeviceptr next_global = 0x7e0000000000ull;

static void add_symbol(struct module *m, const char *name, size_t n, size_t size, int object)
{
    for (int i = 0; i < m->nsyms; i++)
        if (strlen(m->syms[i].name) == n && !strncmp(m->syms[i].name, name, n)) return;
    m->syms = realloc(m->syms, (size_t)(m->nsyms + 1) * sizeof *m->syms);
    struct symbol *s = &m->syms[m->nsyms++];
    s->name = strndup(name, n);
    s->size = size;
    s->object = object;
    s->addr = object ? next_global : 0;
    if (object) next_global += (size + 0xff) & ~(size_t)0xff;
}

/* an ELF64 cubin's functions and objects; -1 if it is not one */
static int read_elf(struct module *m, const unsigned char *p, size_t n)
{
    const Elf64_Ehdr *e = (const void *)p;
    if (n < sizeof *e || memcmp(p, ELFMAG, SELFMAG) || p[EI_CLASS] != ELFCLASS64 || e->e_machine != 190) return -1;
    if (e->e_shoff >= n || e->e_shentsize != sizeof(Elf64_Shdr) || e->e_shoff + (size_t)e->e_shnum * sizeof(Elf64_Shdr) > n)
        return -1;
    const Elf64_Shdr *sh = (const void *)(p + e->e_shoff);
    for (int i = 0; i < e->e_shnum; i++) {
        if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= e->e_shnum) continue;
        const Elf64_Shdr *str = &sh[sh[i].sh_link];
        if (sh[i].sh_offset + sh[i].sh_size > n || str->sh_offset + str->sh_size > n) return -1;
        const Elf64_Sym *sym = (const void *)(p + sh[i].sh_offset);
        for (size_t k = 0; k < sh[i].sh_size / sizeof *sym; k++) {
            int type = ELF64_ST_TYPE(sym[k].st_info);
            if ((type != STT_FUNC && type != STT_OBJECT) || sym[k].st_name >= str->sh_size) continue;
            const char *name = (const char *)p + str->sh_offset + sym[k].st_name;
            size_t len = strnlen(name, str->sh_size - sym[k].st_name);
            if (len) add_symbol(m, name, len, sym[k].st_size, type == STT_OBJECT);
        }
    }
    return 0;
}

/* PTX text: its ".entry" names and ".global" variables; -1 if it is not PTX */
static int read_ptx(struct module *m, const char *p, size_t n, int *version)
{
    const char *end = p + n, *t = memmem(p, n, ".target", 7);
    if (!memmem(p, n, ".version", 8)) return -1;
    if (version && t && (size_t)(end - t) > 11 && !strncmp(t + 7, " sm_", 4)) *version = atoi(t + 11);
    for (const char *q = p; q < end && (q = memmem(q, (size_t)(end - q), ".entry", 6)); q += 6) {
        const char *s = q + 6;
        while (s < end && (*s == ' ' || *s == '\t')) s++;
        const char *e = s;
        while (e < end && *e != '(' && *e != ' ' && *e != '\n' && *e != '\t') e++;
        if (e > s) add_symbol(m, s, (size_t)(e - s), 0, 0);
    }
    for (const char *q = p; q < end && (q = memmem(q, (size_t)(end - q), ".global ", 8)); q += 8) {
        const char *e = q;  /* ".global .align 4 .u32 name[4];": the word before ';', '[' or ' =' */
        while (e < end && *e != ';' && *e != '\n' && *e != '[' && *e != '=') e++;
        const char *s = e;
        while (s > q && s[-1] == ' ') s--;
        const char *name_end = s;
        while (s > q && s[-1] != ' ' && s[-1] != '\t') s--;
        if (name_end > s) add_symbol(m, s, (size_t)(name_end - s), 8, 1);
    }
    return 0;
}

/* A compressed entry's payload, decompressed by the system's libzstd.so.1 or liblz4.so.1 (loaded
 * when first needed), into a buffer to free; NULL if it cannot be. */
static void *decompress(const unsigned char *p, size_t n, size_t size, int zstd)
{
    static void *z, *l;
    static size_t (*zstd_decompress)(void *, size_t, const void *, size_t);
    static unsigned (*zstd_is_error)(size_t);
    static int (*lz4_decompress)(const char *, char *, int, int);
    if (zstd && !z && (z = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL))) {
        zstd_decompress = (size_t (*)(void *, size_t, const void *, size_t))dlsym(z, "ZSTD_decompress");
        zstd_is_error = (unsigned (*)(size_t))dlsym(z, "ZSTD_isError");
    }
    if (!zstd && !l && (l = dlopen("liblz4.so.1", RTLD_NOW | RTLD_LOCAL)))
        lz4_decompress = (int (*)(const char *, char *, int, int))dlsym(l, "LZ4_decompress_safe");
    if (!size || size > (256u << 20)) return NULL;
    void *out = malloc(size);
    if (out && zstd && zstd_decompress && zstd_is_error) {
        size_t got = zstd_decompress(out, size, p, n);
        if (!zstd_is_error(got)) return out;
    } else if (out && !zstd && lz4_decompress && lz4_decompress((const char *)p, out, (int)n, (int)size) >= 0)
        return out;
    stub_trace("a compressed entry (%s) could not be read", zstd ? "zstd" : "lz4");
    free(out);
    return NULL;
}

/* the fat binary's entries; INVALID_IMAGE, NO_BINARY_FOR_GPU or OK */
static CUresult read_fatbin(struct module *m, const unsigned char *p)
{
    struct head { unsigned magic; unsigned short version, header_size; unsigned long long size; };
    struct entry { unsigned short kind, version; unsigned header_size, payload_size, unknown0, compressed_size,
                   unknown1, unknown2, sm, bit_width, unknown3; unsigned long long flags, unknown5, uncompressed; };
    const struct head *h = (const void *)p;
    if (h->magic != 0xba55ed50u || h->version != 1 || h->header_size < sizeof *h) return STUB_INVALID_IMAGE;
    int runs = 0;
    for (size_t off = h->header_size; off + sizeof(struct entry) <= h->header_size + h->size;) {
        const struct entry *e = (const void *)(p + off);
        if (e->header_size < sizeof *e - 8) return STUB_INVALID_IMAGE;
        const unsigned char *payload = p + off + e->header_size;
        int major = (int)e->sm / 10, minor = (int)e->sm % 10, compressed = (e->flags & 0xa000) != 0;
        size_t n = e->payload_size;
        void *plain = NULL;
        int ours = (e->kind == 2 && major == CARD_MAJOR && minor <= CARD_MINOR)
                   || (e->kind == 1 && (int)e->sm <= CARD_MAJOR * 10 + CARD_MINOR);
        if (ours && compressed && (plain = decompress(payload, e->compressed_size, e->uncompressed, e->flags & 0x8000)))
            payload = plain, n = e->uncompressed;
        if (e->kind == 2 && ours) {
            runs = 1;
            int bad = (!compressed || plain) && read_elf(m, payload, n);
            free(plain);
            if (bad) return STUB_INVALID_IMAGE;
        } else if (e->kind == 1 && ours) {
            runs = 1;
            if (!compressed || plain) read_ptx(m, (const char *)payload, strnlen((const char *)payload, n), NULL);
            free(plain);
        } else if (e->kind != 1 && e->kind != 2)
            return STUB_INVALID_IMAGE;
        off += e->header_size + e->payload_size;
    }
    return runs ? STUB_OK : STUB_NO_BINARY_FOR_GPU;
}

static void free_module(struct module *m)
{
    stub_driver_memory(m->dev, -(int64_t)m->on_card);  /* (its code leaves the card) */
    for (int i = 0; i < m->nsyms; i++) free(m->syms[i].name);
    free(m->syms);
    m->magic = 0;
    free(m);
}

/* a module from `image`: a fat binary, a cubin or PTX */
static CUresult load(struct module **out, const void *image)
{
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    if (!out || !image) return STUB_INVALID_VALUE;
    struct module *m = calloc(1, sizeof *m);
    const unsigned char *p = image;
    CUresult r = STUB_OK;
    if (*(const unsigned *)p == 0x466243b1u) {  /* the runtime's __fatBinC_Wrapper_t: version 1 or 2, its fat binary */
        const struct { unsigned magic, version; const void *data, *filename_or_fatbins; } *w = image;
        p = w->version == 1 || w->version == 2 ? w->data : NULL;
        if (!p) { free(m); return STUB_INVALID_IMAGE; }
    }
    if (*(const unsigned *)p == 0xba55ed50u) {
        uint16_t head;
        uint64_t size;
        memcpy(&head, p + 6, 2);
        memcpy(&size, p + 8, 8);
        m->image = head + size;
        r = read_fatbin(m, p);
    } else if (!memcmp(p, ELFMAG, SELFMAG)) {
        const Elf64_Ehdr *e = image;  /* its size: where its section headers end */
        size_t size = e->e_shoff + (size_t)e->e_shnum * sizeof(Elf64_Shdr);
        m->image = size;
        r = read_elf(m, p, size) ? STUB_INVALID_IMAGE : STUB_OK;
    } else {
        int version = 0;
        size_t n = strnlen(image, 64 << 20);
        m->image = n;
        if (read_ptx(m, image, n, &version)) r = STUB_INVALID_IMAGE;
        else if (version > CARD_MAJOR * 10 + CARD_MINOR) r = STUB_NO_BINARY_FOR_GPU;
    }
    if (r) {
        free_module(m);
        return r;
    }
    m->dev = stub_current_device();  /* the image on the card: a few MiB of the driver's own */
    m->on_card = stub_growth("LOAD", 2048);
    if (stub_driver_memory(m->dev, (int64_t)m->on_card)) {
        m->on_card = 0;
        free_module(m);
        return STUB_OUT_OF_MEMORY;
    }
    m->magic = MOD_MAGIC;
    *out = m;
    track(m);
    return STUB_OK;
}

static struct symbol *find(struct module *m, const char *name, int object)
{
    for (int i = 0; i < m->nsyms; i++)
        if (m->syms[i].object == object && !strcmp(m->syms[i].name, name)) return &m->syms[i];
    return NULL;
}

/* ---- modules ---- */
CUresult cuModuleLoadData(struct module **mod, const void *image)
{
    pthread_mutex_lock(&lock);
    CUresult r = load(mod, image);
    pthread_mutex_unlock(&lock);
    stub_trace("cuModuleLoadData %d", r);
    return r;
}
CUresult cuModuleLoadDataEx(struct module **mod, const void *image, unsigned n, int *options, void **values)
{
    if (n && (!options || !values)) return STUB_INVALID_VALUE;
    return cuModuleLoadData(mod, image);
}
CUresult cuModuleLoadFatBinary(struct module **mod, const void *image)
{
    if (image && *(const unsigned *)image != 0xba55ed50u) return STUB_INVALID_IMAGE;
    return cuModuleLoadData(mod, image);
}
static void drop_functions(struct module *m);
CUresult cuModuleUnload(struct module *m)
{
    pthread_mutex_lock(&lock);
    CUresult r = valid(m, MOD_MAGIC) && !m->library ? STUB_OK : STUB_INVALID_HANDLE;
    if (!r) {
        untrack(m);
        drop_functions(m);
        free_module(m);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static struct function *function_of(struct module *m, const char *name)
{
    for (size_t i = 0; i < nlive; i++) {
        struct function *f = live[i];
        if (f->magic == FUNC_MAGIC && f->module == m && !strcmp(f->name, name)) return f;
    }
    struct symbol *s = find(m, name, 0);
    if (!s) return NULL;
    struct function *f = calloc(1, sizeof *f);
    f->magic = FUNC_MAGIC;
    f->module = m;
    f->name = s->name;
    track(f);
    return f;
}
static void drop_functions(struct module *m)
{
    for (size_t i = 0; i < nlive;) {
        struct function *f = live[i];
        if (f->magic == FUNC_MAGIC && f->module == m) {
            untrack(f);
            f->magic = 0;
            free(f);
        } else
            i++;
    }
}

/* cuModuleGetFunction (libcuda.c exports it) */
CUresult stub_module_function(void **out, void *module, const char *name)
{
    struct function **f = (struct function **)out;
    struct module *m = module;
    if (!f || !name) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = STUB_INVALID_HANDLE;
    if (valid(m, MOD_MAGIC)) {
        struct function *fn = function_of(m, name);
        r = !fn ? STUB_NOT_FOUND : load_code(fn);  /* (lazy loading: its code now) */
        if (!r) *f = fn;
    }
    pthread_mutex_unlock(&lock);
    if (r) stub_trace("cuModuleGetFunction %s: %d", name, r);
    return r;
}
CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, struct module *m, const char *name)
{
    if (!name) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = STUB_INVALID_HANDLE;
    if (valid(m, MOD_MAGIC)) {
        struct symbol *s = find(m, name, 1);
        r = s ? STUB_OK : STUB_NOT_FOUND;
        if (s && dptr) *dptr = s->addr;
        if (s && bytes) *bytes = s->size;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuModuleGetFunctionCount(unsigned *count, struct module *m)
{
    if (!count) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = valid(m, MOD_MAGIC) ? STUB_OK : STUB_INVALID_HANDLE;
    if (!r) {
        *count = 0;
        for (int i = 0; i < m->nsyms; i++) *count += !m->syms[i].object;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuModuleGetLoadingMode(int *mode)
{
    if (!mode) return STUB_INVALID_VALUE;
    *mode = 2;  /* CU_MODULE_LAZY_LOADING, CUDA 12's default */
    return STUB_OK;
}

int stub_find_global(CUdeviceptr p, size_t n)
{
    int found = -1;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nlive && found; i++) {
        struct module *m = live[i];
        if (m->magic != MOD_MAGIC) continue;
        for (int k = 0; k < m->nsyms; k++)
            if (m->syms[k].object && p >= m->syms[k].addr && p - m->syms[k].addr <= m->syms[k].size
                && n <= m->syms[k].size - (p - m->syms[k].addr))
                found = 0;
    }
    pthread_mutex_unlock(&lock);
    return found;
}

/* ---- libraries (CUDA 12's context-independent loading) ---- */
CUresult cuLibraryLoadData(struct library **lib, const void *code, int *jit_options, void **jit_values, unsigned njit,
                           int *lib_options, void **lib_values, unsigned nlib)
{
    if (!lib || !code || (njit && (!jit_options || !jit_values)) || (nlib && (!lib_options || !lib_values)))
        return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct module *m;
    CUresult r = load(&m, code);
    if (!r) {
        struct library *l = calloc(1, sizeof *l);
        l->magic = LIB_MAGIC;
        l->module = m;
        m->library = l;
        track(l);
        *lib = l;
    }
    pthread_mutex_unlock(&lock);
    stub_trace("cuLibraryLoadData %d", r);
    return r;
}
CUresult cuLibraryUnload(struct library *l)
{
    pthread_mutex_lock(&lock);
    CUresult r = valid(l, LIB_MAGIC) ? STUB_OK : STUB_INVALID_HANDLE;
    if (!r) {
        for (size_t i = 0; i < nlive;) {
            struct kernel *k = live[i];
            if (k->magic == KERN_MAGIC && k->library == l) {
                untrack(k);
                k->magic = 0;
                free(k);
            } else
                i++;
        }
        untrack(l->module);
        drop_functions(l->module);
        free_module(l->module);
        untrack(l);
        l->magic = 0;
        free(l);
    }
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuLibraryGetModule(struct module **m, struct library *l)
{
    if (!m) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = valid(l, LIB_MAGIC) ? STUB_OK : STUB_INVALID_HANDLE;
    if (!r) *m = l->module;
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuLibraryGetKernel(struct kernel **out, struct library *l, const char *name)
{
    if (!out || !name) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = STUB_INVALID_HANDLE;
    if (valid(l, LIB_MAGIC)) {
        struct function *f = function_of(l->module, name);
        r = !f ? STUB_NOT_FOUND : load_code(f);  /* (lazy loading: its code now) */
        if (r) f = NULL;
        for (size_t i = 0; f && i < nlive; i++) {
            struct kernel *k = live[i];
            if (k->magic == KERN_MAGIC && k->function == f) { *out = k; f = NULL; }
        }
        if (f) {
            struct kernel *k = calloc(1, sizeof *k);
            k->magic = KERN_MAGIC;
            k->library = l;
            k->function = f;
            track(k);
            *out = k;
        }
    }
    pthread_mutex_unlock(&lock);
    if (r) stub_trace("cuLibraryGetKernel %s: %d", name, r);
    return r;
}
CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, struct library *l, const char *name)
{
    pthread_mutex_lock(&lock);
    int ok = valid(l, LIB_MAGIC);
    struct module *m = ok ? l->module : NULL;
    pthread_mutex_unlock(&lock);
    return ok ? cuModuleGetGlobal_v2(dptr, bytes, m, name) : STUB_INVALID_HANDLE;
}
CUresult cuLibraryGetKernelCount(unsigned *count, struct library *l)
{
    pthread_mutex_lock(&lock);
    int ok = valid(l, LIB_MAGIC);
    struct module *m = ok ? l->module : NULL;
    pthread_mutex_unlock(&lock);
    return ok ? cuModuleGetFunctionCount(count, m) : STUB_INVALID_HANDLE;
}

/* a kernel's function in the current context (the stand-in has one module per library) */
static struct function *kernel_function(const void *h)
{
    if (valid(h, FUNC_MAGIC)) return (struct function *)h;
    if (valid(h, KERN_MAGIC)) return ((const struct kernel *)h)->function;
    return NULL;
}
CUresult cuKernelGetFunction(struct function **f, struct kernel *k)
{
    if (!f) return STUB_INVALID_VALUE;
    if (!stub_inited()) return STUB_NOT_INITIALIZED;
    pthread_mutex_lock(&lock);
    CUresult r = valid(k, KERN_MAGIC) ? load_code(k->function) : STUB_INVALID_HANDLE;  /* (in this context) */
    if (!r) *f = k->function;
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuKernelGetLibrary(struct library **l, struct kernel *k)
{
    if (!l) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = valid(k, KERN_MAGIC) ? STUB_OK : STUB_INVALID_HANDLE;
    if (!r) *l = k->library;
    pthread_mutex_unlock(&lock);
    return r;
}
static CUresult get_name(const char **name, const void *h)
{
    if (!name) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct function *f = kernel_function(h);
    if (f) *name = f->name;
    pthread_mutex_unlock(&lock);
    return f ? STUB_OK : STUB_INVALID_HANDLE;
}
CUresult cuFuncGetName(const char **name, struct function *f) { return get_name(name, f); }
CUresult cuKernelGetName(const char **name, struct kernel *k) { return get_name(name, k); }
CUresult cuFuncGetModule(struct module **m, struct function *f)
{
    if (!m) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = valid(f, FUNC_MAGIC) ? STUB_OK : STUB_INVALID_HANDLE;
    if (!r) *m = f->module;
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuFuncIsLoaded(int *state, struct function *f)
{
    if (!state) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct function *fn = kernel_function(f);
    if (fn) *state = fn->loaded ? 1 : 0;  /* CU_FUNCTION_LOADING_STATE_LOADED, _UNLOADED */
    pthread_mutex_unlock(&lock);
    return fn ? STUB_OK : STUB_INVALID_HANDLE;
}
CUresult cuFuncLoad(struct function *f)
{
    return stub_function_valid(f) ? stub_function_loaded(f) : STUB_INVALID_HANDLE;
}

/* Lazy loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2; cuModuleGetLoadingMode
 * says so): "loading a module (cuModuleLoad*() family of functions) will not be loading kernels
 * immediately, instead it will delay loading of a kernel until cuModuleGetFunction() is called"
 * (CUDA C++ Programming Guide, "Lazy Loading"), as cuLibraryGetKernel and cuKernelGetFunction do
 * for a library's kernel; a function not loaded yet (cuModuleEnumerateFunctions' "partially
 * loaded" handles, which "CUDA APIs may load ... automatically", or cuFuncLoad) is loaded at its
 * launch. A function's code goes onto the card in the card's steps (the H100, issue 28): its share
 * of its module's image (the image over its functions) in 2 MiB pages, at least CGPU_STUB_LAZY_KIB
 * (2 MiB). A library's first use — the first launch of any function of a module of
 * CGPU_STUB_LIBRARY_FUNCTIONS functions or more, default 8: cuBLAS, cuDNN, cuFFT, NCCL — takes
 * CGPU_STUB_FIRST_USE_KIB more (64 MiB: its handles, tables, workspaces; +66 MiB at cuBLAS's first
 * matmul on the H100 with its kernel's code). The shape is the stand-in's, not a driver rule:
 * CGPU_STUB_LIBRARY_FUNCTIONS=1 makes every module's first launch a library's first use (issue 45,
 * item 15). Held with its module's; no room on the card: CUDA_ERROR_OUT_OF_MEMORY, as the real
 * driver answers a load it cannot make. An unknown handle is the launch's to refuse. */
static uint64_t code_bytes(const struct module *m)  /* (lock held) */
{
    uint64_t page = 2 << 20, least = stub_growth("LAZY", 2048), funcs = 0;
    for (int i = 0; i < m->nsyms; i++)
        funcs += !m->syms[i].object;
    uint64_t share = funcs ? (m->image / funcs + page - 1) / page * page : 0;
    return share > least ? share : least;
}
static uint64_t first_use_bytes(const struct module *m)  /* (lock held) */
{
    uint64_t funcs = 0;
    for (int i = 0; i < m->nsyms; i++)
        funcs += !m->syms[i].object;
    const char *lib = getenv("CGPU_STUB_LIBRARY_FUNCTIONS");
    return !m->launched && funcs >= (uint64_t)(lib && *lib ? atoi(lib) : 8) ? stub_growth("FIRST_USE", 64 << 10) : 0;
}
static CUresult load_code(struct function *f)  /* (lock held) its code onto the card, once */
{
    if (!f || f->loaded) return STUB_OK;
    uint64_t bytes = code_bytes(f->module);
    if (stub_driver_memory(f->module->dev, (int64_t)bytes)) return STUB_OUT_OF_MEMORY;
    f->loaded = 1;
    f->module->on_card += bytes;
    return STUB_OK;
}
CUresult stub_function_loaded(const void *h)
{
    pthread_mutex_lock(&lock);
    struct function *f = kernel_function(h);
    uint64_t more = f ? first_use_bytes(f->module) : 0;
    CUresult r = load_code(f);
    if (!r && more && stub_driver_memory(f->module->dev, (int64_t)more))
        r = STUB_OUT_OF_MEMORY;
    else if (!r && f) {
        f->module->launched = 1;
        f->module->on_card += more;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* CUfunction_attribute: what a T4 kernel with no registers to speak of reports */
static CUresult attribute(int *v, int attr, const void *h)
{
    if (!v) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct function *f = kernel_function(h);
    CUresult r = f ? STUB_OK : STUB_INVALID_HANDLE;
    if (f) switch (attr) {
        case 0: *v = 1024; break;                    /* MAX_THREADS_PER_BLOCK */
        case 1: case 2: case 3: *v = 0; break;       /* SHARED_SIZE, CONST_SIZE, LOCAL_SIZE _BYTES */
        case 4: *v = 16; break;                      /* NUM_REGS */
        case 5: case 6: *v = 75; break;              /* PTX_VERSION, BINARY_VERSION */
        case 7: *v = 0; break;                       /* CACHE_MODE_CA */
        case 8: *v = f->max_dynamic_shared; break;   /* MAX_DYNAMIC_SHARED_SIZE_BYTES */
        case 9: *v = -1; break;                      /* PREFERRED_SHARED_MEMORY_CARVEOUT */
        case 10: case 11: case 12: case 13: case 14: case 15: *v = 0; break;  /* clusters */
        default: r = STUB_INVALID_VALUE;
        }
    pthread_mutex_unlock(&lock);
    return r;
}
static CUresult set_attribute(int attr, int v, const void *h)
{
    pthread_mutex_lock(&lock);
    struct function *f = kernel_function(h);
    CUresult r = f ? STUB_OK : STUB_INVALID_HANDLE;
    if (f) {
        if (attr == 8 && v >= 0 && v <= 64 * 1024) f->max_dynamic_shared = v;  /* a T4's opt-in limit: 64 KiB */
        else if (attr == 9 && v >= -1 && v <= 100) {}
        else r = STUB_INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
CUresult cuFuncGetAttribute(int *v, int attr, struct function *f) { return attribute(v, attr, f); }
CUresult cuKernelGetAttribute(int *v, int attr, struct kernel *k, int dev)
{
    if (dev < 0 || dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    return attribute(v, attr, k);
}
CUresult cuFuncSetAttribute(struct function *f, int attr, int v) { return set_attribute(attr, v, f); }
CUresult cuKernelSetAttribute(int attr, int v, struct kernel *k, int dev)
{
    if (dev < 0 || dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    return set_attribute(attr, v, k);
}
static CUresult set_cache(const void *h, int config)
{
    if (config < 0 || config > 3) return STUB_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct function *f = kernel_function(h);
    if (f) f->cache_config = config;
    pthread_mutex_unlock(&lock);
    return f ? STUB_OK : STUB_INVALID_HANDLE;
}
CUresult cuFuncSetCacheConfig(struct function *f, int config) { return set_cache(f, config); }
CUresult cuKernelSetCacheConfig(struct kernel *k, int config, int dev)
{
    if (dev < 0 || dev >= stub_device_count()) return STUB_INVALID_DEVICE;
    return set_cache(k, config);
}
CUresult cuFuncSetSharedMemConfig(struct function *f, int config)
{
    if (config < 0 || config > 2) return STUB_INVALID_VALUE;
    return stub_function_valid(f) ? STUB_OK : STUB_INVALID_HANDLE;
}

/* Occupancy: a T4's SM holds 1024 threads and 16 blocks; registers and shared memory do not bind here. */
static int blocks_per_sm(int block, size_t shared)
{
    if (block <= 0) return 0;
    int warps = (block + 31) / 32, by_threads = 32 / warps, by_shared = shared ? (int)(64 * 1024 / shared) : 16;
    int n = by_threads < 16 ? by_threads : 16;
    return n < by_shared ? n : by_shared;
}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, struct function *f, int block, size_t shared,
                                                              unsigned flags)
{
    if (!n || block <= 0 || block > 1024) return STUB_INVALID_VALUE;
    (void)flags;
    if (!stub_function_valid(f)) return STUB_INVALID_HANDLE;
    *n = blocks_per_sm(block, shared);
    return STUB_OK;
}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, struct function *f, int block, size_t shared)
{
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n, f, block, shared, 0);
}
typedef size_t (*shared_of_block)(int);
CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *grid, int *block, struct function *f, shared_of_block fn,
                                                   size_t shared, int limit, unsigned flags)
{
    if (!grid || !block) return STUB_INVALID_VALUE;
    (void)flags;
    if (!stub_function_valid(f)) return STUB_INVALID_HANDLE;
    int best = 32, best_threads = 0;
    for (int b = 32; b <= 1024 && (!limit || b <= limit); b += 32) {
        int t = blocks_per_sm(b, fn ? fn(b) : shared) * b;
        if (t >= best_threads) { best_threads = t; best = b; }
    }
    *block = best;
    *grid = blocks_per_sm(best, fn ? fn(best) : shared) * 40;  /* 40 SMs */
    return STUB_OK;
}
CUresult cuOccupancyMaxPotentialBlockSize(int *grid, int *block, struct function *f, shared_of_block fn, size_t shared,
                                          int limit)
{
    return cuOccupancyMaxPotentialBlockSizeWithFlags(grid, block, f, fn, shared, limit, 0);
}
CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *bytes, struct function *f, int blocks, int block)
{
    if (!bytes || blocks <= 0 || block <= 0) return STUB_INVALID_VALUE;
    if (!stub_function_valid(f)) return STUB_INVALID_HANDLE;
    *bytes = 64 * 1024 / (size_t)blocks;
    return STUB_OK;
}

struct stub_proc { const char *name; void *fn; };
HIDDEN const struct stub_proc STUB_PROCS_MODULES[] = {
#define P(f) {#f, (void *)f}
#define PV(n, f) {n, (void *)f}
    P(cuModuleLoadData), P(cuModuleLoadDataEx), P(cuModuleLoadFatBinary), P(cuModuleUnload),
    PV("cuModuleGetGlobal", cuModuleGetGlobal_v2), P(cuModuleGetFunctionCount),
    P(cuModuleGetLoadingMode), P(cuLibraryLoadData), P(cuLibraryUnload), P(cuLibraryGetModule),
    P(cuLibraryGetKernel), P(cuLibraryGetGlobal), P(cuLibraryGetKernelCount), P(cuKernelGetFunction),
    P(cuKernelGetLibrary), P(cuFuncGetName), P(cuKernelGetName), P(cuFuncGetModule), P(cuFuncIsLoaded), P(cuFuncLoad),
    P(cuFuncGetAttribute), P(cuKernelGetAttribute), P(cuFuncSetAttribute), P(cuKernelSetAttribute),
    P(cuFuncSetCacheConfig), P(cuKernelSetCacheConfig), P(cuFuncSetSharedMemConfig),
    P(cuOccupancyMaxActiveBlocksPerMultiprocessor), P(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags),
    P(cuOccupancyMaxPotentialBlockSize), P(cuOccupancyMaxPotentialBlockSizeWithFlags),
    P(cuOccupancyAvailableDynamicSMemPerBlock),
    {NULL, NULL},
#undef P
#undef PV
};
