/*
 * The stand-in's logs, for whoever writes a test or adds to the stand-in (the bottom of its layers:
 * calls nothing else of it). CGPU_STUB_CUDA_TRACE=path: a line per name cuGetProcAddress does not
 * know and per export table asked for (cuda_export.c), per attribute unknown (cuda_device.c), ...
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_stub.h"

void stub_trace(const char *fmt, ...)
{
    const char *path = getenv("CGPU_STUB_CUDA_TRACE");
    if (!path || !*path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(f, "%d ", (int)getpid());
    vfprintf(f, fmt, ap);
    fputc('\n', f);
    va_end(ap);
    fclose(f);
}
/* With CGPU_STUB_CUDA_CALLS set, the entry points that have a per-thread-stream (_ptsz) or an
 * older form append their name to it: which one a lookup gave is seen; and cuEventRecord: how
 * many events a library records is seen. */
static void log_call(const char *path, const char *name)
{
    int fd = path && *path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666) : -1;
    if (fd >= 0) {
        if (write(fd, name, strlen(name)) < 0 || write(fd, "\n", 1) < 0) { /* (a log, best effort) */ }
        close(fd);
    }
}
void stub_called(const char *name) { log_call(getenv("CGPU_STUB_CUDA_CALLS"), name); }

/* With CGPU_STUB_CUDA_CTX_CALLS set, each cuCtxGetCurrent appends its name to it: how often a library
 * asks the driver for the current context (tests/test_current_context.py). Its own log, read once:
 * unset, it costs the call a load and a branch (bench/gate.py's reference is that call). */
static const char *ctx_calls = (const char *)-1;
void stub_ctx_asked(void)
{
    const char *path = __atomic_load_n(&ctx_calls, __ATOMIC_RELAXED);
    if (__builtin_expect(path == NULL, 1))
        return;
    if (path == (const char *)-1) {
        path = getenv("CGPU_STUB_CUDA_CTX_CALLS");
        path = path && *path ? path : NULL;
        __atomic_store_n(&ctx_calls, path, __ATOMIC_RELAXED);
    }
    log_call(path, "cuCtxGetCurrent");
}
