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
void stub_called(const char *name)
{
    const char *path = getenv("CGPU_STUB_CUDA_CALLS");
    int fd = path && *path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666) : -1;
    if (fd >= 0) {
        if (write(fd, name, strlen(name)) < 0 || write(fd, "\n", 1) < 0) { /* (a log, best effort) */ }
        close(fd);
    }
}
