/*
 * What cgpud's C programs share (native/common/cgpu.h): one-line messages, a
 * small JSON reader, the "can this container ask at all?" shortcut, and one
 * request/reply over the daemon's control socket.
 */
#define _GNU_SOURCE
#include "cgpu.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

const char *cgpu_prog = "cgpu";
static const char MARK[] = "ALIYUN_COM_GPU_MEM_CONTAINER=";
/* A Kubernetes container (containerd's CRI plugin sets this annotation; a pod cannot): one that
 * names any of K8S_MARKS is the daemon's to read too, as the kubelet allotted it
 * (cgpud/containers/allotted.py): a contract variable its pod set fails it, GPUs it names are narrowed. */
static const char KUBE[] = "io.kubernetes.cri.container-type";
static const char *const K8S_MARKS[] = {"ALIYUN_COM_GPU_", "CGPU_DISABLE=", "cgpu.aliyun.com/allocation-", NULL};
/* ... and NVIDIA_VISIBLE_DEVICES, but for a privileged container, whose value is believed (as
 * nvidia-container-toolkit does; allotted.py privileged): cgpud's own DaemonSet pod names `all` and
 * starts before the daemon answers (asked, a restart of it failed closed: "cgpud is not running"). */
static const char NVD[] = "NVIDIA_VISIBLE_DEVICES=";

/* ---- output: one line ------------------------------------------------------ */

void say(const char *fmt, ...)
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
    fprintf(stderr, "%s: %.*s\n", cgpu_prog, (int)len, buf);
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

int jobject(const char *text, size_t n, struct member *want, int nwant, const char **obj_start, const char **obj_end)
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

/* Whether config.json's process.capabilities.bounding names CAP_SYS_ADMIN: privileged, or granted it
 * (read from that array alone: a tenant writes the same string in its args or environment freely). */
static int privileged_spec(const char *buf, size_t len)
{
    static const char *const path[] = {"process", "capabilities", "bounding"};
    static const char CAP[] = "\"CAP_SYS_ADMIN\"";
    const char *p = buf, *e = buf + len, *s, *t;
    for (int i = 0; i < 3; i++) {
        struct member m = {path[i], NULL, 0, 0, NULL, NULL};
        if (jobject(p, (size_t)(e - p), &m, 1, &s, &t) || !m.raw)
            return 0;
        p = m.raw;
        e = m.raw_end;
    }
    return memmem(p, (size_t)(e - p), CAP, sizeof CAP - 1) != NULL;
}

/* 0: config.json was read whole and does not name the variable (nor, in a Kubernetes container, any
 * of K8S_MARKS, nor NVIDIA_VISIBLE_DEVICES unless it is privileged); 1 otherwise. */
int may_ask(const char *bundle)
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
    if (!asks && memmem(buf, len, KUBE, sizeof KUBE - 1)) {
        for (int i = 0; K8S_MARKS[i] && !asks; i++)
            asks = memmem(buf, len, K8S_MARKS[i], strlen(K8S_MARKS[i])) != NULL;
        if (!asks && memmem(buf, len, NVD, sizeof NVD - 1))
            asks = !privileged_spec(buf, len);
    }
    free(buf);
    return asks;
}

/* ---- the socket ---------------------------------------------------------------- */

void default_socket(char *out, size_t cap)
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

/* Send one request line to the daemon on `sock_path` and read one reply line.
 * CALL_OK: it said ok; CALL_REFUSED: it refused, `message` says why (its
 * message, or its errno name); CALL_UNREACHABLE: no answer, `message` says
 * what went wrong. `timeout` bounds the connection and each wait. */
int call_daemon(const char *sock_path, const char *req, size_t len, double timeout, char *message, size_t cap)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(message, cap, "socket: %s", strerror(errno));
        return CALL_UNREACHABLE;
    }
    struct timeval tv = {(time_t)timeout, (suseconds_t)((timeout - (double)(time_t)timeout) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock_path) >= sizeof addr.sun_path) {
        snprintf(message, cap, "socket path %s is too long", sock_path);
        close(fd);
        return CALL_UNREACHABLE;
    }
    strcpy(addr.sun_path, sock_path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) {
        int e = errno;
        close(fd);
        if (e == ENOENT || e == ECONNREFUSED || e == ENOTDIR)
            snprintf(message, cap, "cgpud is not running (nothing answers on %s): start it with `cgpud serve`", sock_path);
        else if (e == EACCES || e == EPERM)
            snprintf(message, cap, "no permission to reach cgpud on %s", sock_path);
        else if (e == EAGAIN || e == ETIMEDOUT)
            snprintf(message, cap, "cgpud did not answer on %s in time", sock_path);
        else
            snprintf(message, cap, "cannot reach cgpud on %s: %s", sock_path, strerror(e));
        return CALL_UNREACHABLE;
    }
    if (send_all(fd, req, len)) {
        int e = errno;
        close(fd);
        if (e == EAGAIN)
            snprintf(message, cap, "cgpud did not answer on %s in time", sock_path);
        else
            snprintf(message, cap, "lost the connection to cgpud on %s: %s", sock_path, strerror(e));
        return CALL_UNREACHABLE;
    }
    static char reply[MAX_REPLY + 1];
    size_t got = 0;
    char *nl = NULL;
    while (!nl) {
        if (got >= MAX_REPLY) {
            close(fd);
            snprintf(message, cap, "cgpud's answer is longer than %d bytes", MAX_REPLY);
            return CALL_REFUSED;
        }
        ssize_t r = recv(fd, reply + got, MAX_REPLY - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = errno;
            close(fd);
            if (r < 0 && (e == EAGAIN || e == EWOULDBLOCK))
                snprintf(message, cap, "cgpud did not answer on %s in time", sock_path);
            else if (r < 0)
                snprintf(message, cap, "lost the connection to cgpud on %s: %s", sock_path, strerror(e));
            else
                snprintf(message, cap, "cgpud closed the connection on %s", sock_path);
            return CALL_UNREACHABLE;
        }
        nl = memchr(reply + got, '\n', (size_t)r);
        got += (size_t)r;
    }
    close(fd);
    char error[64];
    struct member ans[] = {
        {"ok", NULL, 0, 0, NULL, NULL},
        {"message", message, cap, 0, NULL, NULL},
        {"error", error, sizeof error, 0, NULL, NULL},
    };
    const char *a, *a_end;
    if (jobject(reply, (size_t)(nl - reply), ans, 3, &a, &a_end) || !ans[0].raw) {
        snprintf(message, cap, "cgpud answered something that is not a reply on %s", sock_path);
        return CALL_REFUSED;
    }
    if (ans[0].raw_end - ans[0].raw == 4 && !memcmp(ans[0].raw, "true", 4))
        return CALL_OK;
    if (!ans[1].found)
        snprintf(message, cap, "cgpud refused (%s)", ans[2].found ? error : "no reason given");
    return CALL_REFUSED;
}

/* The socket: CGPUD_SOCKET, else the default for this user. */
const char *socket_path(const char *given, char *buf, size_t cap)
{
    if (given && *given)
        return given;
    const char *env = getenv("CGPUD_SOCKET");
    if (env && *env)
        return env;
    default_socket(buf, cap);
    return buf;
}

/* Seconds from an environment variable (0 < v < 3600), else `dflt`. */
double env_seconds(const char *name, double dflt)
{
    const char *t = getenv(name);
    if (t && *t) {
        char *end;
        double v = strtod(t, &end);
        if (*end == 0 && v > 0 && v < 3600)
            return v;
    }
    return dflt;
}

/* Whether an environment variable says yes (1, true, yes). */
int env_yes(const char *name)
{
    const char *v = getenv(name);
    return v && (!strcasecmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes"));
}
