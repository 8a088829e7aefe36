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
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_STATE (60 * 1024)   /* the daemon takes request lines of up to 64 KiB */
#define MAX_CONFIG (4 << 20)    /* as cgpud/containers/hookd.py MAX_CONFIG */
#define MAX_REPLY (64 * 1024)
#define MAX_DEPTH 64

static const char MARK[] = "ALIYUN_COM_GPU_MEM_CONTAINER=";
static const char PASSTHROUGH[] = "CGPU_HOOK_PASSTHROUGH";

/* ---- output: one line ------------------------------------------------------ */

static void say(const char *fmt, ...)
{
    char buf[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)buf[i] < 0x20)
            buf[i] = ' ';  /* one line, whatever the message holds */
    fprintf(stderr, "cgpu hook: %.*s\n", (int)len, buf);
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "cgpu hook: gave up: no answer from cgpud in time (CGPU_HOOK_TIMEOUT)\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    _exit(1);
}

/* ---- a small JSON reader: top-level string members, everything else skipped -- */

struct cur { const char *p, *end; };

static void ws(struct cur *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int hex4(const char *p, unsigned *v)
{
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char ch = p[i];
        *v <<= 4;
        if (ch >= '0' && ch <= '9') *v |= (unsigned)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') *v |= (unsigned)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') *v |= (unsigned)(ch - 'A' + 10);
        else return -1;
    }
    return 0;
}

static void put(char *out, size_t cap, size_t *len, int *trunc, unsigned char ch)
{
    if (!out)
        return;
    if (*len + 1 < cap)
        out[(*len)++] = (char)ch;
    else
        *trunc = 1;
}

/* A JSON string at c->p, decoded into out (NUL-terminated; NULL: skip).
 * Returns 0, 1 when it did not fit (or held a NUL), -1 when it is not JSON. */
static int jstring(struct cur *c, char *out, size_t cap)
{
    size_t len = 0;
    int trunc = 0;
    if (c->p >= c->end || *c->p != '"')
        return -1;
    c->p++;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p++;
        if (ch == '"') {
            if (out)
                out[len] = 0;
            return trunc;
        }
        if (ch < 0x20)
            return -1;
        if (ch != '\\') {
            put(out, cap, &len, &trunc, ch);
            continue;
        }
        if (c->p >= c->end)
            return -1;
        ch = (unsigned char)*c->p++;
        switch (ch) {
        case '"': case '\\': case '/': put(out, cap, &len, &trunc, ch); break;
        case 'b': put(out, cap, &len, &trunc, '\b'); break;
        case 'f': put(out, cap, &len, &trunc, '\f'); break;
        case 'n': put(out, cap, &len, &trunc, '\n'); break;
        case 'r': put(out, cap, &len, &trunc, '\r'); break;
        case 't': put(out, cap, &len, &trunc, '\t'); break;
        case 'u': {
            unsigned u, lo;
            if (c->end - c->p < 4 || hex4(c->p, &u))
                return -1;
            c->p += 4;
            if (u >= 0xD800 && u <= 0xDBFF && c->end - c->p >= 6 && c->p[0] == '\\' && c->p[1] == 'u'
                && !hex4(c->p + 2, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                c->p += 6;
            }
            if (u == 0)
                trunc = 1;  /* a NUL cannot be part of a path */
            else if (u < 0x80)
                put(out, cap, &len, &trunc, (unsigned char)u);
            else if (u < 0x800) {
                put(out, cap, &len, &trunc, (unsigned char)(0xC0 | (u >> 6)));
                put(out, cap, &len, &trunc, (unsigned char)(0x80 | (u & 0x3F)));
            } else if (u < 0x10000) {
                put(out, cap, &len, &trunc, (unsigned char)(0xE0 | (u >> 12)));
                put(out, cap, &len, &trunc, (unsigned char)(0x80 | ((u >> 6) & 0x3F)));
                put(out, cap, &len, &trunc, (unsigned char)(0x80 | (u & 0x3F)));
            } else {
                put(out, cap, &len, &trunc, (unsigned char)(0xF0 | (u >> 18)));
                put(out, cap, &len, &trunc, (unsigned char)(0x80 | ((u >> 12) & 0x3F)));
                put(out, cap, &len, &trunc, (unsigned char)(0x80 | ((u >> 6) & 0x3F)));
                put(out, cap, &len, &trunc, (unsigned char)(0x80 | (u & 0x3F)));
            }
            break;
        }
        default:
            return -1;
        }
    }
    return -1;
}

static int jskip(struct cur *c, int depth)
{
    ws(c);
    if (c->p >= c->end || depth > MAX_DEPTH)
        return -1;
    char open = *c->p;
    if (open == '"')
        return jstring(c, NULL, 0) < 0 ? -1 : 0;
    if (open == '{' || open == '[') {
        char close = open == '{' ? '}' : ']';
        c->p++;
        ws(c);
        if (c->p < c->end && *c->p == close) {
            c->p++;
            return 0;
        }
        for (;;) {
            if (open == '{') {
                ws(c);
                if (jstring(c, NULL, 0) < 0)
                    return -1;
                ws(c);
                if (c->p >= c->end || *c->p++ != ':')
                    return -1;
            }
            if (jskip(c, depth + 1))
                return -1;
            ws(c);
            if (c->p >= c->end)
                return -1;
            char ch = *c->p++;
            if (ch == close)
                return 0;
            if (ch != ',')
                return -1;
        }
    }
    const char *start = c->p;  /* a number, true, false or null */
    while (c->p < c->end && (strchr("+-.0123456789eEtruefalsn", *c->p) != NULL) && *c->p)
        c->p++;
    return c->p == start ? -1 : 0;
}

struct member { const char *key; char *out; size_t cap; int found; const char *raw, *raw_end; };

/* Walk a top-level object: string members named in `want` are decoded into
 * their buffers (found = 1, or 2 if it did not fit); every member's raw value
 * is recorded. Returns 0, or -1 when the text is not one JSON object. */
static int jobject(const char *text, size_t n, struct member *want, int nwant, const char **obj_start, const char **obj_end)
{
    struct cur c = {text, text + n};
    ws(&c);
    if (c.p >= c.end || *c.p != '{')
        return -1;
    *obj_start = c.p;
    c.p++;
    ws(&c);
    if (c.p < c.end && *c.p == '}') {
        c.p++;
    } else {
        for (;;) {
            char key[64];
            ws(&c);
            int k = jstring(&c, key, sizeof key);
            if (k < 0)
                return -1;
            ws(&c);
            if (c.p >= c.end || *c.p++ != ':')
                return -1;
            ws(&c);
            const char *vstart = c.p;
            struct member *m = NULL;
            for (int i = 0; i < nwant && k == 0; i++)
                if (strcmp(key, want[i].key) == 0)
                    m = &want[i];
            if (m && c.p < c.end && *c.p == '"' && m->out) {
                int r = jstring(&c, m->out, m->cap);
                if (r < 0)
                    return -1;
                m->found = r ? 2 : 1;
            } else if (jskip(&c, 1)) {
                return -1;
            }
            if (m) {
                m->raw = vstart;
                m->raw_end = c.p;
            }
            ws(&c);
            if (c.p >= c.end)
                return -1;
            char ch = *c.p++;
            if (ch == '}')
                break;
            if (ch != ',')
                return -1;
        }
    }
    *obj_end = c.p;
    ws(&c);
    return c.p == c.end ? 0 : -1;
}

/* ---- the shortcut: can this container ask at all? ---------------------------- */

/* 0: config.json was read whole and does not name the variable; 1 otherwise. */
static int may_ask(const char *bundle)
{
    char path[PATH_MAX];
    if (bundle[0] != '/' || (size_t)snprintf(path, sizeof path, "%s/config.json", bundle) >= sizeof path)
        return 1;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size > MAX_CONFIG) {
        close(fd);
        return 1;
    }
    char *buf = malloc(MAX_CONFIG + 1);
    size_t len = 0;
    int ok = buf != NULL;
    while (ok && len <= MAX_CONFIG) {
        ssize_t r = read(fd, buf + len, MAX_CONFIG + 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            ok = 0;
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    int asks = !ok || len > MAX_CONFIG || memmem(buf, len, MARK, sizeof MARK - 1) != NULL;
    free(buf);
    return asks;
}

/* ---- the socket ---------------------------------------------------------------- */

static void default_socket(char *out, size_t cap)
{
    /* as cgpud/state/paths.py default_socket() */
    if (geteuid() == 0) {
        snprintf(out, cap, "/run/cgpud/cgpud.sock");
        return;
    }
    const char *rt = getenv("XDG_RUNTIME_DIR");
    if (rt && *rt && access(rt, W_OK) == 0)
        snprintf(out, cap, "%s/cgpud.sock", rt);
    else
        snprintf(out, cap, "/tmp/cgpud.sock-%u", (unsigned)geteuid());
}

/* The daemon could not be reached: what to say and whether the start goes on. */
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
    const char *pt = getenv(PASSTHROUGH);
    if (pt && (!strcasecmp(pt, "1") || !strcasecmp(pt, "true") || !strcasecmp(pt, "yes"))) {
        say("%s; %s=1: container left unmanaged", msg, PASSTHROUGH);
        return 0;
    }
    say("%s (set %s=1 in the hook's env to start containers unmanaged then)", msg, PASSTHROUGH);
    return 1;
}

static int send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int main(int argc, char **argv)
{
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
            say("unexpected argument %s; usage: cgpu-hook [--socket PATH] createRuntime|prestart|poststop|auto", argv[i]);
            return 2;
        }
    }
    int known = 0;
    for (size_t i = 0; stage && i < sizeof stages / sizeof *stages; i++)
        known |= !strcmp(stage, stages[i]);
    if (!known) {
        say("unknown stage %s; one of createRuntime, prestart, poststop, auto", stage ? stage : "(none)");
        return 2;
    }
    char def_sock[PATH_MAX];
    if (!sock_path || !*sock_path)
        sock_path = getenv("CGPUD_SOCKET");
    if (!sock_path || !*sock_path) {
        default_socket(def_sock, sizeof def_sock);
        sock_path = def_sock;
    }
    double timeout = 5.0;
    const char *t = getenv("CGPU_HOOK_TIMEOUT");
    if (t && *t) {
        char *end;
        double v = strtod(t, &end);
        if (*end == 0 && v > 0 && v < 3600)
            timeout = v;
    }
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

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        say("socket: %s", strerror(errno));
        return 1;
    }
    struct timeval tv = {(time_t)timeout, (suseconds_t)((timeout - (double)(time_t)timeout) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock_path) >= sizeof addr.sun_path) {
        say("socket path %s is too long", sock_path);
        return 1;
    }
    strcpy(addr.sun_path, sock_path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) {
        int e = errno;
        if (e == ENOENT || e == ECONNREFUSED || e == ENOTDIR)
            return unreachable(removing, "cgpud is not running (nothing answers on %s): start it with `cgpud serve`", sock_path);
        if (e == EACCES || e == EPERM)
            return unreachable(removing, "no permission to reach cgpud on %s", sock_path);
        if (e == EAGAIN || e == ETIMEDOUT)
            return unreachable(removing, "cgpud did not answer on %s in time", sock_path);
        return unreachable(removing, "cannot reach cgpud on %s: %s", sock_path, strerror(e));
    }
    if (send_all(fd, req, len)) {
        if (errno == EAGAIN)
            return unreachable(removing, "cgpud did not answer on %s in time", sock_path);
        return unreachable(removing, "lost the connection to cgpud on %s: %s", sock_path, strerror(errno));
    }
    free(req);

    /* one reply line */
    static char reply[MAX_REPLY + 1];
    size_t got = 0;
    char *nl = NULL;
    while (!nl) {
        if (got >= MAX_REPLY) {
            say("cgpud's answer is longer than %d bytes", MAX_REPLY);
            return 1;
        }
        ssize_t r = recv(fd, reply + got, MAX_REPLY - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return unreachable(removing, "cgpud did not answer on %s in time", sock_path);
        if (r < 0)
            return unreachable(removing, "lost the connection to cgpud on %s: %s", sock_path, strerror(errno));
        if (r == 0)
            return unreachable(removing, "cgpud closed the connection on %s", sock_path);
        nl = memchr(reply + got, '\n', (size_t)r);
        got += (size_t)r;
    }
    close(fd);
    char message[4096], error[64];
    struct member ans[] = {
        {"ok", NULL, 0, 0, NULL, NULL},
        {"message", message, sizeof message, 0, NULL, NULL},
        {"error", error, sizeof error, 0, NULL, NULL},
    };
    const char *a, *a_end;
    if (jobject(reply, (size_t)(nl - reply), ans, 3, &a, &a_end) || !ans[0].raw) {
        say("cgpud answered something that is not a reply on %s", sock_path);
        return 1;
    }
    if (ans[0].raw_end - ans[0].raw == 4 && !memcmp(ans[0].raw, "true", 4))
        return 0;
    if (ans[1].found)
        say("%s", message);
    else
        say("cgpud refused (%s)", ans[2].found ? error : "no reason given");
    return 1;
}
