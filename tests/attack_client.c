/* A tenant's client for tests/test_attacks.py and bench/attacks.py: built static, run inside a
 * root container (busybox has no client for a unix socket). What it prints is what the daemon
 * answered, one line per request.
 *
 *   attack SOCKET LINE...           one connection: each LINE sent with a newline, its answer printed
 *   attack SOCKET --raw BYTES LINE  BYTES sent as they are (no newline added), then LINE; every answer
 *                                   line printed until the daemon closes or 2 s pass
 *   attack SOCKET --big N LINE      a line of N bytes of 'x' then LINE on the same connection
 *   attack SOCKET --flood N         N connections held open at once, a hello on each: prints
 *                                   "answered A refused R closed C" (R: EAGAIN)
 *   attack SOCKET --time N LINE     N times: connect, send LINE, read its answer, close; prints each
 *                                   time in ns (what a client pays: the connection's classification too)
 *   attack SOCKET --orphan LINE     a process connects, forks and exits; once it is reaped, its child
 *                                   sends LINE on that connection and prints the answer
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int dial(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (fd < 0 || strlen(path) >= sizeof a.sun_path)
        return -1;
    strcpy(a.sun_path, path);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

/* Read one line (at most cap-1 bytes) with a deadline; 1 on a line, 0 on close or time out. */
static int read_line(int fd, char *buf, size_t cap, int ms)
{
    size_t n = 0;
    while (n + 1 < cap) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, ms) <= 0)
            break;
        ssize_t r = read(fd, buf + n, 1);
        if (r <= 0)
            break;
        if (buf[n] == '\n') {
            buf[n] = 0;
            return 1;
        }
        n++;
    }
    buf[n] = 0;
    return 0;
}

static char line[1 << 20];

static int ask(int fd, const char *req)
{
    if (send_all(fd, req, strlen(req)) || send_all(fd, "\n", 1))
        return puts("SEND-FAILED"), 1;
    if (!read_line(fd, line, sizeof line, 5000))
        return puts("CLOSED"), 1;
    puts(line);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return fprintf(stderr, "usage: attack SOCKET LINE... | --raw B L | --big N L | --flood N | --orphan L\n"), 2;
    setvbuf(stdout, NULL, _IONBF, 0);
    const char *path = argv[1];
    if (!strcmp(argv[2], "--flood") && argc == 4) {
        int n = atoi(argv[3]), answered = 0, refused = 0, closed = 0;
        for (int i = 0; i < n; i++) {
            int fd = dial(path);  /* (never closed: all held open at once) */
            if (fd < 0 || send_all(fd, "{\"op\": \"hello\"}\n", 16) || !read_line(fd, line, sizeof line, 5000))
                closed++;
            else if (strstr(line, "EAGAIN"))
                refused++;
            else
                answered++;
        }
        printf("answered %d refused %d closed %d\n", answered, refused, closed);
        return 0;
    }
    if (!strcmp(argv[2], "--time") && argc == 5) {
        int n = atoi(argv[3]);
        for (int i = 0; i < n; i++) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            int fd = dial(path);
            if (fd < 0 || send_all(fd, argv[4], strlen(argv[4])) || send_all(fd, "\n", 1) ||
                !read_line(fd, line, sizeof line, 5000) || !strstr(line, "\"ok\": true"))
                return printf("FAILED %s\n", line), 1;
            clock_gettime(CLOCK_MONOTONIC, &t1);
            close(fd);
            printf("%lld\n", (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec));
        }
        return 0;
    }
    if (!strcmp(argv[2], "--orphan") && argc == 4) {
        /* A connects and forks B, then exits and is reaped (its pid free for anyone); B, holding A's
         * connection, asks; this process waits for B through a pipe only B still holds. */
        int done[2];
        if (pipe(done) < 0)
            return 1;
        pid_t a = fork();
        if (a == 0) {
            close(done[0]);
            int fd = dial(path);
            if (fd < 0)
                return printf("CONNECT-FAILED %s\n", strerror(errno)), 1;
            pid_t parent = getpid();
            if (fork() != 0)
                _exit(0);
            for (int i = 0; i < 5000 && !(kill(parent, 0) < 0 && errno == ESRCH); i++)
                usleep(1000);
            _exit(ask(fd, argv[3]));
        }
        close(done[1]);
        waitpid(a, NULL, 0);
        char c;
        while (read(done[0], &c, 1) > 0)
            ;
        return 0;
    }
    int fd = dial(path);
    if (fd < 0)
        return printf("CONNECT-FAILED %s\n", strerror(errno)), 1;
    if (!strcmp(argv[2], "--raw") && argc == 5) {
        send_all(fd, argv[3], strlen(argv[3]));
        send_all(fd, argv[4], strlen(argv[4]));
        send_all(fd, "\n", 1);
        while (read_line(fd, line, sizeof line, 2000))
            puts(line);
        return 0;
    }
    if (!strcmp(argv[2], "--big") && argc == 5) {
        size_t n = (size_t)atol(argv[3]);
        char *big = malloc(n);
        memset(big, 'x', n);
        send_all(fd, big, n);
        send_all(fd, "\n", 1);
        send_all(fd, argv[4], strlen(argv[4]));
        send_all(fd, "\n", 1);
        while (read_line(fd, line, sizeof line, 2000))
            puts(line);
        return 0;
    }
    for (int i = 2; i < argc; i++)
        if (ask(fd, argv[i]))
            return 1;
    return 0;
}
