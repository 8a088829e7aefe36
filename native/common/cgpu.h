/*
 * What cgpud's C programs (the hook forwarder, the runtime wrapper) share:
 * native/common/cgpu.c.
 */
#ifndef CGPU_COMMON_H
#define CGPU_COMMON_H

#include <stddef.h>

#define MAX_CONFIG (4 << 20)    /* bytes of config.json read at most, as cgpud/containers/hookd.py MAX_CONFIG */
#define MAX_REPLY (64 * 1024)
#define MAX_DEPTH 64

enum { CALL_OK = 0, CALL_REFUSED = 1, CALL_UNREACHABLE = 2 };

extern const char *cgpu_prog;   /* the prefix of every message: "cgpu hook", "cgpu-runtime" */

/* One line on stderr, "<prog>: <message>", control characters made spaces. */
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A top-level JSON object's members: string members named in `want` are
 * decoded into their buffers (found = 1, or 2 if it did not fit); each named
 * member's raw value is recorded. 0, or -1 when the text is not one object. */
struct member { const char *key; char *out; size_t cap; int found; const char *raw, *raw_end; };
int jobject(const char *text, size_t n, struct member *want, int nwant, const char **obj_start, const char **obj_end);

/* 0: <bundle>/config.json was read whole and does not name
 * ALIYUN_COM_GPU_MEM_CONTAINER (the container cannot ask for anything); 1 otherwise. */
int may_ask(const char *bundle);

void default_socket(char *out, size_t cap);
const char *socket_path(const char *given, char *buf, size_t cap);
int call_daemon(const char *sock_path, const char *req, size_t len, double timeout, char *message, size_t cap);
double env_seconds(const char *name, double dflt);
int env_yes(const char *name);

#endif
