/*
 * cgpu-hook: cgpud's OCI runtime hook, compiled (docs/containers.md).
 *
 *     cgpu-hook [--socket PATH] createRuntime|prestart|poststop|auto   < OCI state
 *
 * A forwarder: it reads the OCI state the runtime gives on stdin, sends it to
 * the daemon's control socket as one line
 *
 *     {"op":"hook","stage":STAGE,"state":<the state as given>}
 *
 * and exits 0 when the daemon says ok, or prints the daemon's message as ONE
 * line on stderr ("cgpu hook: ...") and exits 1: the runtime then fails the
 * container's start with it. The daemon does the work (cgpud/containers/hookd.py:
 * config.json, the ALIYUN_COM_GPU_* contract, placement, the container's own
 * cgroup, register/deregister). `cgpu hook` and `python3 -S -m cgpud.containers.hook`
 * (cgpud/containers/hook.py) forward the same way.
 *
 * One shortcut, the only reading of the container it does: when
 * <bundle>/config.json can be read and does not contain the bytes
 * "ALIYUN_COM_GPU_MEM_CONTAINER=", the container cannot ask for anything and
 * the daemon is not contacted (hooks.d runs the hook for every container).
 *
 * Settings (the hook's own environment, the `env` of its hook entry):
 *   CGPUD_SOCKET             the control socket (default as cgpud/state/paths.py:
 *                            /run/cgpud/cgpud.sock for root)
 *   CGPU_HOOK_PASSTHROUGH=1  daemon unreachable at createRuntime: let the
 *                            container start unmanaged (one line, exit 0)
 *   CGPU_HOOK_TIMEOUT        seconds for the connection and for the answer
 *                            (default 5); the whole hook gives up after
 *                            twice that plus one second, never hangs
 * A poststop that cannot reach the daemon exits 0 with one line: the daemon
 * deregisters containers whose cgroup is gone by itself once it runs.
 *
 * Build: make -C native (native/Makefile; scripts/setup.sh
 * puts it in .venv/bin; hosts: /usr/local/libexec/cgpu-hook).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include "../common/cgpu.h"

#define MAX_STATE (60 * 1024)   /* the daemon takes request lines of up to 64 KiB */

static const char PASSTHROUGH[] = "CGPU_HOOK_PASSTHROUGH";

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "cgpu hook: gave up: no answer from cgpud in time (CGPU_HOOK_TIMEOUT)\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    _exit(1);
}

/* The daemon could not be reached: what to say and whether the start goes on. */
static int unreachable(int removing, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int unreachable(int removing, const char *fmt, ...)
{
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (removing) {
        say("%s; nothing removed now (cgpud deregisters a container whose cgroup is gone once it runs)", msg);
        return 0;
    }
    if (env_yes(PASSTHROUGH)) {
        say("%s; %s=1: container left unmanaged", msg, PASSTHROUGH);
        return 0;
    }
    say("%s (set %s=1 in the hook's env to start containers unmanaged then)", msg, PASSTHROUGH);
    return 1;
}

int main(int argc, char **argv)
{
    cgpu_prog = "cgpu hook";
    static const char *stages[] = {"createRuntime", "prestart", "poststop", "auto"};
    const char *sock_path = NULL, *stage = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc)
            sock_path = argv[++i];
        else if (!strncmp(argv[i], "--socket=", 9))
            sock_path = argv[i] + 9;
        else if (!stage)
            stage = argv[i];
        else {
            say("unexpected argument %s; usage: cgpu-hook [--socket PATH] [createRuntime|prestart|poststop|auto]", argv[i]);
            return 2;
        }
    }
    if (!stage)
        stage = "auto";  /* no stage: the state's status says which */
    int known = 0;
    for (size_t i = 0; stage && i < sizeof stages / sizeof *stages; i++)
        known |= !strcmp(stage, stages[i]);
    if (!known) {
        say("unknown stage %s; one of createRuntime, prestart, poststop, auto", stage ? stage : "(none)");
        return 2;
    }
    char def_sock[PATH_MAX];
    sock_path = socket_path(sock_path, def_sock, sizeof def_sock);
    double timeout = env_seconds("CGPU_HOOK_TIMEOUT", 5.0);
    signal(SIGALRM, on_alarm);
    struct itimerval limit = {{0, 0}, {0, 0}};
    double whole = 2 * timeout + 1;
    limit.it_value.tv_sec = (time_t)whole;
    limit.it_value.tv_usec = (suseconds_t)((whole - (double)(time_t)whole) * 1e6);
    setitimer(ITIMER_REAL, &limit, NULL);

    /* the state */
    static char state[MAX_STATE + 1];
    size_t n = 0;
    for (;;) {
        ssize_t r = read(0, state + n, sizeof state - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            say("cannot read the OCI state on stdin: %s", strerror(errno));
            return 1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
        if (n > MAX_STATE) {
            say("the OCI state on stdin is larger than %d bytes", MAX_STATE);
            return 1;
        }
    }
    char id[1025], status[64], bundle[PATH_MAX];
    struct member want[] = {
        {"id", id, sizeof id, 0, NULL, NULL},
        {"status", status, sizeof status, 0, NULL, NULL},
        {"bundle", bundle, sizeof bundle, 0, NULL, NULL},
    };
    const char *obj, *obj_end;
    if (jobject(state, n, want, 3, &obj, &obj_end)) {
        say("the OCI state on stdin is not a JSON object");
        return 1;
    }
    if (want[0].found != 1 || !id[0]) {
        say("the OCI state on stdin has no \"id\"");
        return 1;
    }
    if (!strcmp(stage, "auto") && (want[1].found != 1 || (strcmp(status, "creating") && strcmp(status, "created")
                                                            && strcmp(status, "stopped")))) {
        say("the OCI state's status is '%s': with no stage (auto) the hook runs at createRuntime or prestart "
            "(creating, created: join) or poststop (stopped: leave)", want[1].found == 1 ? status : "(none)");
        return 1;
    }
    int removing = !strcmp(stage, "poststop") || (!strcmp(stage, "auto") && want[1].found == 1 && !strcmp(status, "stopped"));
    if (want[2].found == 1 && !may_ask(bundle))
        return 0;  /* no ALIYUN_COM_GPU_MEM_CONTAINER in its config.json: left alone */

    /* one request line: the state as given (whitespace outside strings made spaces) */
    size_t cap = (size_t)(obj_end - obj) + strlen(stage) + 64;
    char *req = malloc(cap);
    if (!req) {
        say("out of memory");
        return 1;
    }
    int head = snprintf(req, cap, "{\"op\":\"hook\",\"stage\":\"%s\",\"state\":", stage);
    size_t len = (size_t)head;
    for (const char *p = obj; p < obj_end; p++)
        req[len++] = (*p == '\n' || *p == '\r' || *p == '\t') ? ' ' : *p;
    req[len++] = '}';
    req[len++] = '\n';

    char message[4096];
    int rc = call_daemon(sock_path, req, len, timeout, message, sizeof message);
    free(req);
    if (rc == CALL_UNREACHABLE)
        return unreachable(removing, "%s", message);
    if (rc == CALL_REFUSED) {
        say("%s", message);
        return 1;
    }
    return 0;
}
