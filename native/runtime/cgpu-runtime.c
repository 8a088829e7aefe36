/*
 * cgpu-runtime: an OCI runtime that wraps the real one (docs/containers.md,
 * "Docker and containerd"), the way NVIDIA's container runtime does.
 *
 *     cgpu-runtime [runc's global options] COMMAND [options] [ID]
 *
 * Every command and argument goes to the real runtime unchanged (execv: the
 * real runtime replaces this process). One command is looked at first:
 * `create` (and `run`), whose bundle's config.json may ask for cgpud
 * (ALIYUN_COM_GPU_MEM_CONTAINER). Then, before the real runtime sees it, the
 * daemon is asked to prepare the bundle (the control op `prepare`: it checks
 * the environment and adds cgpud's hooks to config.json, atomically); a
 * refusal fails the create with the daemon's one line, and so does a daemon
 * that cannot be reached: a container that asked for isolation never runs
 * without it (CGPU_HOOK_PASSTHROUGH=1 lets it start unmanaged instead).
 * A container whose config.json does not name the variable (nor, in a Kubernetes container, any other
 * of the contract's or NVIDIA_VISIBLE_DEVICES: common/cgpu.c may_ask) costs one read of
 * it, with no daemon round trip.
 *
 * The real runtime: $CGPU_RUNTIME_REAL, else `runtime = PATH` in
 * $CGPU_RUNTIME_CONFIG (default /etc/cgpud/runtime.conf; e.g.
 * /usr/bin/nvidia-container-runtime on GPU hosts, so NVIDIA's hook still
 * mounts the driver), else `runc` on PATH.
 * The socket: $CGPUD_SOCKET, else the default (/run/cgpud/cgpud.sock as root).
 * CGPU_HOOK_TIMEOUT (seconds, default 5) bounds each wait for the daemon.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../common/cgpu.h"

#define DEFAULT_CONFIG "/etc/cgpud/runtime.conf"

/* runc's (and crun's) global options that take a value as the next argument */
static const char *const GLOBAL_VALUED[] = {"--log", "--log-format", "--root", "--criu", "--rootless",
                                            "--log-level", "--cgroup-manager", NULL};

static int valued(const char *arg, const char *const *names)
{
    for (int i = 0; names[i]; i++)
        if (!strcmp(arg, names[i]))
            return 1;
    return 0;
}

/* Is `path` this very program? (PATH may hold us under the real runtime's name.) */
static int is_self(const char *path)
{
    char self[PATH_MAX], other[PATH_MAX];
    return realpath("/proc/self/exe", self) && realpath(path, other) && !strcmp(self, other);
}

static const char *on_path(const char *name, char *buf, size_t cap)
{
    const char *path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    while (*path) {
        const char *colon = strchr(path, ':');
        size_t n = colon ? (size_t)(colon - path) : strlen(path);
        if (n && (size_t)snprintf(buf, cap, "%.*s/%s", (int)n, path, name) < cap && access(buf, X_OK) == 0
            && !is_self(buf))
            return buf;
        path += n + (colon ? 1 : 0);
    }
    return NULL;
}

/* The real runtime's path, or NULL with the reason said. */
static const char *real_runtime(char *buf, size_t cap)
{
    const char *env = getenv("CGPU_RUNTIME_REAL");
    if (env && *env)
        return env;
    const char *conf = getenv("CGPU_RUNTIME_CONFIG");
    if (!conf || !*conf)
        conf = DEFAULT_CONFIG;
    FILE *f = fopen(conf, "re");
    if (f) {
        char line[PATH_MAX + 64];
        while (fgets(line, sizeof line, f)) {
            char *p = line;
            while (*p == ' ' || *p == '\t')
                p++;
            if (strncmp(p, "runtime", 7))
                continue;
            p += 7;
            while (*p == ' ' || *p == '\t')
                p++;
            if (*p++ != '=')
                continue;
            while (*p == ' ' || *p == '\t' || *p == '"')
                p++;
            size_t n = strcspn(p, "\"\r\n#");
            while (n && (p[n - 1] == ' ' || p[n - 1] == '\t'))
                n--;
            if (n && n < cap) {
                memcpy(buf, p, n);
                buf[n] = 0;
                fclose(f);
                return buf;
            }
        }
        fclose(f);
    }
    const char *found = on_path("runc", buf, cap);
    if (!found)
        say("no real OCI runtime: runc is not on PATH; name one in CGPU_RUNTIME_REAL or as `runtime = PATH` in %s",
            conf);
    return found;
}

/* A JSON string literal of `s` into out; -1 when it does not fit. */
static int jquote(char *out, size_t cap, const char *s)
{
    size_t n = 0;
    if (cap < 3)
        return -1;
    out[n++] = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        int k;
        if (*p == '"' || *p == '\\')
            k = snprintf(esc, sizeof esc, "\\%c", *p);
        else if (*p < 0x20)
            k = snprintf(esc, sizeof esc, "\\u%04x", *p);
        else
            k = snprintf(esc, sizeof esc, "%c", *p);
        if (n + (size_t)k + 2 > cap)
            return -1;
        memcpy(out + n, esc, (size_t)k);
        n += (size_t)k;
    }
    out[n++] = '"';
    out[n] = 0;
    return 0;
}

/* The real runtime's log (`--log`, `--log-format`): where containerd's shim
 * reads why a create failed (the last error), and so what `docker run` and
 * `kubectl describe pod` show. NULL: none given. */
static const char *log_path, *log_format = "text";

/* Say it on stderr, and as an error record in the runtime's log. */
static void refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void refuse(const char *fmt, ...)
{
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    say("%s", msg);
    if (!log_path)
        return;
    FILE *f = fopen(log_path, "ae");
    if (!f)
        return;
    char line[sizeof msg + 64], q[3 * sizeof line], when[64];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    snprintf(line, sizeof line, "%s: %s", cgpu_prog, msg);
    if (jquote(q, sizeof q, line))
        snprintf(q, sizeof q, "\"%s: refused\"", cgpu_prog);
    if (!strcmp(log_format, "json"))
        fprintf(f, "{\"level\":\"error\",\"msg\":%s,\"time\":\"%s\"}\n", q, when);
    else
        fprintf(f, "time=\"%s\" level=error msg=%s\n", when, q);
    fclose(f);
}

/* Ask the daemon to prepare the bundle of a container that may ask for cgpud.
 * 0: go on; 1: fail the create (said). */
static int prepare(const char *bundle, const char *id)
{
    char abs[PATH_MAX];
    if (bundle[0] != '/') {
        if (!realpath(bundle, abs)) {
            refuse("bundle %s: %s", bundle, strerror(errno));
            return 1;
        }
        bundle = abs;
    }
    if (!may_ask(bundle))
        return 0;  /* its config.json names nothing of ours (may_ask): not ours */
    static char qb[2 * PATH_MAX * 3], qi[4096 * 3], req[sizeof qb + sizeof qi + 64];
    if (jquote(qb, sizeof qb, bundle) || jquote(qi, sizeof qi, id)) {
        refuse("bundle path or container id too long");
        return 1;
    }
    int len = snprintf(req, sizeof req, "{\"op\":\"prepare\",\"bundle\":%s,\"id\":%s}\n", qb, qi);
    char sockbuf[PATH_MAX], message[4096];
    const char *sock = socket_path(NULL, sockbuf, sizeof sockbuf);
    int rc = call_daemon(sock, req, (size_t)len, env_seconds("CGPU_HOOK_TIMEOUT", 5.0), message, sizeof message);
    if (rc == CALL_OK)
        return 0;
    if (rc == CALL_REFUSED) {
        refuse("%s", message);
        return 1;
    }
    if (env_yes("CGPU_HOOK_PASSTHROUGH")) {
        say("%s; CGPU_HOOK_PASSTHROUGH=1: container %s starts unmanaged", message, id);
        return 0;
    }
    refuse("%s; container %s asks for cgpud and is not started (CGPU_HOOK_PASSTHROUGH=1 starts such containers "
           "unmanaged while cgpud is down)", message, id);
    return 1;
}

int main(int argc, char **argv)
{
    cgpu_prog = "cgpu-runtime";
    int cmd = 1;  /* the command: the first argument that is not a global option or its value */
    while (cmd < argc && argv[cmd][0] == '-') {
        const char *a = argv[cmd];
        if (!strncmp(a, "--log=", 6))
            log_path = a + 6;
        else if (!strncmp(a, "--log-format=", 13))
            log_format = a + 13;
        if (valued(a, GLOBAL_VALUED) && cmd + 1 < argc) {
            if (!strcmp(a, "--log"))
                log_path = argv[cmd + 1];
            else if (!strcmp(a, "--log-format"))
                log_format = argv[cmd + 1];
            cmd++;
        }
        cmd++;
    }
    if (cmd < argc && (!strcmp(argv[cmd], "create") || !strcmp(argv[cmd], "run"))) {
        const char *bundle = ".";
        const char *id = argc - 1 > cmd && argv[argc - 1][0] != '-' ? argv[argc - 1] : "";
        for (int i = cmd + 1; i < argc; i++) {
            if ((!strcmp(argv[i], "--bundle") || !strcmp(argv[i], "-b")) && i + 1 < argc)
                bundle = argv[++i];
            else if (!strncmp(argv[i], "--bundle=", 9))
                bundle = argv[i] + 9;
            else if (!strncmp(argv[i], "-b=", 3))
                bundle = argv[i] + 3;
        }
        if (prepare(bundle, id))
            return 1;
    }
    char buf[PATH_MAX];
    const char *real = real_runtime(buf, sizeof buf);
    if (!real)
        return 1;
    argv[0] = (char *)real;
    execv(real, argv);
    say("cannot run the real runtime %s: %s", real, strerror(errno));
    return 1;
}
