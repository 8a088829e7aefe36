/*
 * The stand-in libcuda as an MPS client (issue 37; docs/mps.md "The stand-in's MPS"), at the card
 * model's bottom beside the logs: it calls nothing else of the stand-in.
 *
 * NVIDIA's rules (nvidia-cuda-mps-control(1), the MPS guide's "Appendix: Environment Variables"):
 * - When CUDA is first initialized (cuInit) the driver connects to the control daemon through
 *   CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps). If that fails (no daemon there) the
 *   program runs as it would without MPS. If it succeeds, the daemon starts a server if none runs
 *   and the client connects to it; a client the daemon cannot serve fails its initialization.
 * - The client's limits are the server's defaults (set_default_active_thread_percentage,
 *   set_default_device_pinned_mem_limit, as they were when the server started), which the
 *   client's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=2G,1=1G"
 *   per device ordinal, or one value for every device) can only tighten.
 * - The stand-in's control daemon (native/stubs/nvidia-cuda-mps-control) listens on
 *   <pipe dir>/control; its server holds the cards as NVIDIA's device plugin sets them for MPS
 *   (EXCLUSIVE_PROCESS compute mode): while it runs, a process that is not its client cannot make a
 *   context (CUDA_ERROR_DEVICE_UNAVAILABLE). The server's hold is a POSIX lock on
 *   <CGPU_STUB_CUDA_STATE>.mps, which the server process takes and the kernel drops with it.
 *
 * The protocol (one line each way, kept open for the client's life): "client <pid> <uid>\n", then
 * "server <server pid> <percentage> <bytes on device 0> ... <bytes on device 15>\n" (0: no
 * limit) or "error <reason>\n".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "cuda_stub.h"

#define NDEV 16
static pid_t state_pid;      /* the process the state below is of (a forked child connects again) */
static int client;           /* connected to a server */
static CUresult connected;   /* what the connection gave cuInit (a failure: every cuInit of the process) */
static int conn_fd = -1;
static unsigned percentage = 100;
static uint64_t limit[NDEV];  /* 0: none */

/* "2G", "512M", "1024K", "4096" (bytes); optional B after the unit: bytes, or 0 if bad */
static uint64_t parse_size(const char *s, const char **end)
{
    char *e;
    errno = 0;
    unsigned long long v = strtoull(s, &e, 10);
    if (errno || e == s) return 0;
    int shift = *e == 'G' || *e == 'g' ? 30 : *e == 'M' || *e == 'm' ? 20 : *e == 'K' || *e == 'k' ? 10
              : *e == 'T' || *e == 't' ? 40 : 0;
    if (shift) e++;
    if (shift && (*e == 'B' || *e == 'b')) e++;
    *end = e;
    return (uint64_t)v << shift;
}

/* CUDA_MPS_PINNED_DEVICE_MEM_LIMIT into lim[]: 0, or -1 if malformed */
static int parse_limits(const char *s, uint64_t lim[NDEV])
{
    const char *e;
    if (!strchr(s, '=')) {  /* one value: every device */
        uint64_t v = parse_size(s, &e);
        if (!v || *e) return -1;
        for (int d = 0; d < NDEV; d++) lim[d] = v;
        return 0;
    }
    for (const char *p = s; *p;) {
        char *q;
        long d = strtol(p, &q, 10);
        if (q == p || *q != '=' || d < 0) return -1;
        uint64_t v = parse_size(q + 1, &e);
        if (!v || (*e && *e != ',')) return -1;
        if (d < NDEV) lim[d] = v;
        p = *e ? e + 1 : e;
    }
    return 0;
}

static uint64_t tighter(uint64_t a, uint64_t b) { return !a ? b : !b ? a : a < b ? a : b; }

static CUresult connect_once(void);
CUresult stub_mps_connect(void)
{
    if (state_pid != getpid()) {
        state_pid = getpid();
        connected = connect_once();
    }
    return connected;
}
static CUresult connect_once(void)
{
    client = 0;
    if (conn_fd >= 0) close(conn_fd);
    conn_fd = -1;
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    dir = dir && *dir ? dir : "/tmp/nvidia-mps";
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(a.sun_path, sizeof a.sun_path, "%s/control", dir) >= sizeof a.sun_path) return STUB_OK;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return STUB_OK;
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {  /* no control daemon: a process without MPS */
        close(fd);
        return STUB_OK;
    }
    char line[1024];
    int n = snprintf(line, sizeof line, "client %d %d\n", (int)getpid(), (int)getuid());
    size_t got = 0;
    if (write(fd, line, (size_t)n) != n) goto failed;
    while (got < sizeof line - 1) {
        ssize_t r = read(fd, line + got, 1);
        if (r <= 0) goto failed;
        if (line[got++] == '\n') break;
    }
    line[got] = 0;
    unsigned long long pct, lim[NDEV];
    int server;
    if (sscanf(line, "server %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu",
               &server, &pct, &lim[0], &lim[1], &lim[2], &lim[3], &lim[4], &lim[5], &lim[6], &lim[7], &lim[8], &lim[9],
               &lim[10], &lim[11], &lim[12], &lim[13], &lim[14], &lim[15]) != 2 + NDEV)
        goto failed;
    percentage = pct >= 1 && pct <= 100 ? (unsigned)pct : 100;
    for (int d = 0; d < NDEV; d++) limit[d] = lim[d];
    const char *p = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (p && *p) {  /* (only tightens: the server's default stays the most) */
        char *e;
        double v = strtod(p, &e);
        if (e == p || *e || v <= 0 || v > 100) {
            fprintf(stderr, "stand-in libcuda: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s is not a percentage in (0, 100]\n", p);
            close(fd);
            return STUB_INVALID_VALUE;
        }
        unsigned u = (unsigned)(v + 0.999999);
        percentage = u < percentage ? u : percentage;
    }
    const char *m = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    if (m && *m) {
        uint64_t mine[NDEV] = {0};
        if (parse_limits(m, mine)) {
            fprintf(stderr, "stand-in libcuda: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%s is not \"<ordinal>=<size>,...\" "
                            "or one size (sizes as 2G, 512M)\n", m);
            close(fd);
            return STUB_INVALID_VALUE;
        }
        for (int d = 0; d < NDEV; d++) limit[d] = tighter(limit[d], mine[d]);
    }
    conn_fd = fd;  /* (kept: the daemon sees the client until it ends) */
    client = 1;
    return STUB_OK;
failed:
    close(fd);
    return STUB_MPS_CONNECTION_FAILED;
}

int stub_mps_client(void) { return client && state_pid == getpid(); }
unsigned stub_mps_percentage(void) { return stub_mps_client() ? percentage : 100; }
uint64_t stub_mps_mem_limit(int dev)
{
    return stub_mps_client() && dev >= 0 && dev < NDEV && limit[dev] ? limit[dev] : UINT64_MAX;
}

/* A context on card `dev` for a process that is not the server's client: refused while a server
 * holds the cards (exclusive-process). */
CUresult stub_mps_context(int dev)
{
    (void)dev;
    if (stub_mps_client()) return STUB_OK;
    const char *s = getenv("CGPU_STUB_CUDA_STATE");
    char path[4096];
    snprintf(path, sizeof path, "%s.mps", s && *s ? s : "/tmp/cgpu-stub-cuda.state");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return STUB_OK;
    struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    int held = !fcntl(fd, F_GETLK, &l) && l.l_type != F_UNLCK;
    close(fd);
    return held ? STUB_DEVICE_UNAVAILABLE : STUB_OK;
}
