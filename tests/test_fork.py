"""A forked child of a process that uses CUDA (issue 45, item 12): the library's locks are the
parent's threads' at the fork, and a child must not inherit one held: its own first launch would
wait for a thread that does not exist in it, for good. The child starts with them free (each part's
reset at pthread_atfork's child handler).

No GPU here: the stand-in driver; the parent's drain holds the contexts' lock while it waits for
its stream's last event (up to the drain bound: set to 1 s by the daemon here, so the parent's
helper holds it for 750 ms), and the parent forks then."""
from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from cgpud.sched.gate import GateFreezer
from test_graphs import stopped
from test_libcgpu import build_libs, compile_c

FORKER = r"""
/* forker: a context, a kernel of 1 s into a stream of its own; prints "launched", reads a line, forks:
   the child calls cuInit and launches a kernel of 10 µs, synchronizes, and exits 0; the parent waits
   for it (10 s at most) and prints "child ok" or "child hung". */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *ctx, *s;
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    if (!h || init(0)) return 2;
    if (((int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, 0)) return 3;
    ((int (*)(void *))dlsym(h, "cuCtxSetCurrent"))(ctx);
    if (((int (*)(void **, unsigned))dlsym(h, "cuStreamCreate"))(&s, 1)) return 4;
    l_t launch = (l_t)dlsym(h, "cuLaunchKernel");
    if (launch(NULL, 1000000, 1, 1, 1, 1, 1, 0, s, NULL, NULL)) return 5;
    printf("launched\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 6;
    pid_t c = fork();
    if (c == 0) {
        alarm(20);
        init(0);  /* (whatever the driver answers a forked child: it must answer) */
        launch(NULL, 10, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        _exit(0);
    }
    for (int i = 0; i < 1000; i++) {
        int st;
        if (waitpid(c, &st, WNOHANG) == c) {
            printf(WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "child ok\n" : "child failed\n");
            return 0;
        }
        struct timespec t = {0, 10000000};
        nanosleep(&t, NULL);
    }
    kill(c, SIGKILL);
    printf("child hung\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    d = build_libs(tmp_path_factory.mktemp("fork"))
    compile_c(d, "forker", FORKER)
    return d


def test_a_child_forked_while_the_drain_holds_a_lock_is_not_stuck_on_it(libs, tmp_path):
    """The parent's gate closes while its 1 s kernel runs (its drain waits for it, holding the
    contexts' lock); the parent forks 100 ms later; the gate opens 300 ms after. The child's own
    launch goes through (after the gate opened). Before, the child's first launch waited for the
    contexts' lock its parent's helper held at the fork: for good (killed after 10 s)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    gate.share(None, True, 2000)
    gate.bound(1_000_000)
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card")}
    p = subprocess.Popen([os.fspath(libs / "forker")], env=env, text=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1)
    try:
        assert p.stdout.readline().strip() == "launched", p.stderr.read()
        gate.freeze()
        time.sleep(0.1)
        p.stdin.write("fork\n")
        p.stdin.flush()
        time.sleep(0.3)
        gate.thaw()
        ready, _, _ = select.select([p.stdout], [], [], 30)
        said = p.stdout.readline().strip() if ready else ""
    finally:
        stopped(p, gate, None)
    assert said == "child ok", said


MAKING = r"""
/* making: a thread retains the primary context (the process's first on the GPU: libcgpu holds its
   driver's-memory lock across the call, which the stand-in pauses, CGPU_STUB_CTX_PAUSE); the main
   thread forks meanwhile: the child allocates (libcgpu's first allocation of a process takes that
   lock) and exits 0 whatever the driver answered; the parent lets its thread go, waits for the
   child (10 s at most) and prints "child ok", "child failed" or "child hung". */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static void *h, *ctx;
static void *retain(void *arg) {
    ((int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, 0);
    return arg;
}
static void nap(void) { struct timespec t = {0, 10000000}; nanosleep(&t, NULL); }
int main(int argc, char **argv) {
    char in[4200], go[4200];
    snprintf(in, sizeof in, "%s.in", argv[1]);
    snprintf(go, sizeof go, "%s.go", argv[1]);
    h = dlopen("libcuda.so.1", RTLD_NOW);
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    if (!h || init(0)) return 2;
    pthread_t t;
    pthread_create(&t, NULL, retain, NULL);
    while (access(in, F_OK)) nap();  /* (the retain is inside the driver now) */
    pid_t c = fork();
    if (c == 0) {
        alarm(20);
        unsetenv("CGPU_STUB_CTX_PAUSE");
        unsigned long long p;
        init(0);  /* (whatever the driver answers a forked child: it must answer) */
        ((int (*)(unsigned long long *, size_t))dlsym(h, "cuMemAlloc_v2"))(&p, 1 << 20);
        _exit(0);
    }
    fclose(fopen(go, "w"));
    pthread_join(t, NULL);
    for (int i = 0; i < 1000; i++) {
        int st;
        if (waitpid(c, &st, WNOHANG) == c) {
            printf(WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "child ok\n" : "child failed\n");
            return 0;
        }
        nap();
    }
    kill(c, SIGKILL);
    printf("child hung\n");
    return 0;
}
"""


def test_a_child_forked_while_a_context_is_being_made_is_not_stuck_on_the_memory_lock(libs, tmp_path):
    """A thread makes the process's first context on the GPU (libcgpu holds its lock of the driver's
    own memory across the call: NVML's list of processes before and after); another forks meanwhile.
    The child's first allocation needs that lock: it answers (issue 45, item 12). Before, the
    child waited for a lock whose holder does not exist in it: for good (killed after 10 s)."""
    compile_c(libs, "making", MAKING)
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"),
           "CGPU_STUB_CTX_PAUSE": os.fspath(tmp_path / "pause")}
    r = subprocess.run([os.fspath(libs / "making"), os.fspath(tmp_path / "pause")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "child ok", (r.stdout, r.stderr)
