"""The calling thread's current context, kept by libcgpu (issue 45's first figure; docs/isolation.md,
"The launch path"): the calls that change it (cuCtxSetCurrent, cuCtxPushCurrent, cuCtxPopCurrent,
cuCtxCreate, ...) are wrapped on every path a client reaches the driver by (its exported names,
dlsym, cuGetProcAddress by version), and a launch takes its GPU from what they left, with no driver
call; a thread that never switched through libcgpu asks the driver once.

No GPU here: the stand-in's two cards (CGPU_STUB_CUDA_DEVICES=2), each its primary context, and its
log of cuCtxGetCurrent calls (CGPU_STUB_CUDA_CTX_CALLS)."""
from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from cgpud.sched.gate import GateFreezer
from test_gate import wait_drained
from test_graphs import stopped

CLIENT = r"""
/* ctxsw gate|count sym|dlsym|proc: two devices' primary contexts, switched between by
   cuCtxSetCurrent, cuCtxPushCurrent, cuCtxPopCurrent and cuCtxCreate found by PATH (sym: the
   exported names, linked; dlsym: dlsym of libcuda.so.1; proc: cuGetProcAddress_v2 by version),
   kernels launched after each switch.
   gate: after each switch one launch, then its name on stdout, then a line awaited on stdin.
   count: after each switch (and in a new thread that never switched) N launches between two
   lines "mark" written to $CGPU_STUB_CUDA_CTX_CALLS. */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
int cuCtxSetCurrent(void *);
int cuCtxPushCurrent_v2(void *);
int cuCtxPopCurrent_v2(void **);
int cuCtxCreate_v2(void **, unsigned, int);
static int (*set)(void *), (*push)(void *), (*pop)(void **), (*create)(void **, unsigned, int);
static l_t launch;
static int gate;
enum { N = 100 };
static void mark(void)
{
    int fd = open(getenv("CGPU_STUB_CUDA_CTX_CALLS"), O_WRONLY | O_APPEND | O_CREAT, 0666);
    if (fd < 0 || write(fd, "mark\n", 5) != 5) exit(9);
    close(fd);
}
static void launched(const char *what)
{
    char line[16];
    if (!gate) mark();
    for (int i = 0; i < (gate ? 1 : N); i++)
        if (launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) { fprintf(stderr, "launch after %s\n", what); exit(4); }
    if (!gate) { mark(); return; }
    printf("%s\n", what);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) exit(5);
}
static void *fresh(void *arg) { (void)arg; launched("fresh"); return NULL; }
int main(int argc, char **argv) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *c0, *c1, *was, *made;
    gate = !strcmp(argv[1], "gate");
    if (!h || ((int (*)(unsigned))dlsym(h, "cuInit"))(0)) { fprintf(stderr, "cuInit\n"); return 2; }
    launch = (l_t)dlsym(h, "cuLaunchKernel");
    int (*retain)(void **, int) = (int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain");
    if (retain(&c0, 0) || retain(&c1, 1) || c0 == c1) { fprintf(stderr, "retain\n"); return 2; }
    if (!strcmp(argv[2], "sym")) {
        set = cuCtxSetCurrent, push = cuCtxPushCurrent_v2, pop = cuCtxPopCurrent_v2, create = cuCtxCreate_v2;
    } else if (!strcmp(argv[2], "dlsym")) {
        set = (int (*)(void *))dlsym(h, "cuCtxSetCurrent");
        push = (int (*)(void *))dlsym(h, "cuCtxPushCurrent_v2");
        pop = (int (*)(void **))dlsym(h, "cuCtxPopCurrent_v2");
        create = (int (*)(void **, unsigned, int))dlsym(h, "cuCtxCreate_v2");
    } else {
        int (*gp)(const char *, void **, int, unsigned long long, int *) =
            (int (*)(const char *, void **, int, unsigned long long, int *))dlsym(h, "cuGetProcAddress_v2");
        if (gp("cuCtxSetCurrent", (void **)&set, 12000, 0, NULL) || gp("cuCtxPushCurrent", (void **)&push, 12000, 0, NULL)
            || gp("cuCtxPopCurrent", (void **)&pop, 12000, 0, NULL) || gp("cuCtxCreate", (void **)&create, 3020, 0, NULL))
            { fprintf(stderr, "cuGetProcAddress\n"); return 2; }
    }
    if (!set || !push || !pop || !create) { fprintf(stderr, "not found\n"); return 2; }
    if (set(c0)) return 3;
    launched("start");  /* (device 0) */
    if (set(c1)) return 3;
    launched("set");    /* device 1 */
    if (push(c0)) return 3;
    launched("push");   /* device 0 */
    if (pop(&was) || was != c0) return 3;
    launched("pop");    /* device 1 again */
    if (create(&made, 0, 0)) return 3;
    launched("create"); /* device 0 */
    if (!gate) {
        pthread_t t;
        pthread_create(&t, NULL, fresh, NULL);
        pthread_join(t, NULL);
    }
    return 0;
}
"""

SWITCHES = ["start", "set", "push", "pop", "create"]
DEVICE_AFTER = {"start": 0, "set": 1, "push": 0, "pop": 1, "create": 0}  # (the client's switches in turn)
NODE_GPUS = [3, 5]  # (the page's GPUs 0 and 1, as the node names them)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs
    d = build_libs(tmp_path_factory.mktemp("ctxsw"))
    (d / "ctxsw.c").write_text(CLIENT)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(d / "ctxsw"), os.fspath(d / "ctxsw.c"), "-L", os.fspath(d), "-lcuda",
                    "-ldl", "-lpthread"], check=True)
    return d


def two_gpus(tmp_path: Path) -> GateFreezer:
    """A container's pages of two GPUs, gated per GPU (its GPUs shared: launches bounded)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30, 1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"), gpus=NODE_GPUS)
    assert gate.drives_gpus
    gate.share(None, True, 2000)
    return gate


def client_env(libs: Path, tmp_path: Path) -> dict:
    return {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
            "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_DEVICES": "2",
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"), "CGPU_GANG": "0",
            "CGPU_STUB_CUDA_CTX_CALLS": os.fspath(tmp_path / "ctx-calls")}


def line_within(p: subprocess.Popen, seconds: float) -> str:
    """The client's next line, or "" if none came within `seconds` (it waits at a closed gate)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.1)[0]:
            return p.stdout.readline().strip()
        if p.poll() is not None:
            return ""
    return ""


def through_gates(p: subprocess.Popen, gate: GateFreezer, said: list[str], devices: list[int]) -> None:
    """Drive a client that, after each of its switches, launches once, says `said[i]` (then on device
    `devices[i]`) and waits for a line: before its next switch, the gate of the GPU it is on closes
    (drained) and the other's opens. A launch gated by the GPU it switched away from would wait at
    that closed gate: its line never comes."""
    try:
        for i, (what, dev) in enumerate(zip(said, devices)):
            got = line_within(p, 30)
            assert got == what, (f"the launch after {what} did not run: the gate of node GPU "
                                 f"{NODE_GPUS[1 - dev]}, closed, held it", got, p.poll())
            if i + 1 < len(said):
                gate.thaw(NODE_GPUS[1 - dev])
                gate.freeze(NODE_GPUS[dev])  # (the GPU the next switch leaves)
                wait_drained(gate, timeout=30)
            p.stdin.write("go\n")
            p.stdin.flush()
        assert p.wait(timeout=30) == 0, p.stderr.read()
    finally:
        stopped(p, gate, None)  # (killed if it is still there; the gate opened and let go)


@pytest.mark.parametrize("path", ["sym", "dlsym", "proc"])
def test_a_launch_after_a_switch_waits_at_the_gate_of_the_gpu_switched_to(libs, tmp_path, path):
    """Each switch (cuCtxSetCurrent, cuCtxPushCurrent, cuCtxPopCurrent, cuCtxCreate: found through the
    exported names, dlsym or cuGetProcAddress by version) goes from one GPU to the other; before the
    launch after it, the gate of the GPU it left is closed and the other's open: the launch runs.
    A switch libcgpu missed would leave the launch at the closed gate of the GPU before."""
    gate = two_gpus(tmp_path)
    p = subprocess.Popen([os.fspath(libs / "ctxsw"), "gate", path], env=client_env(libs, tmp_path), text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    through_gates(p, gate, SWITCHES, [DEVICE_AFTER[s] for s in SWITCHES])


@pytest.mark.parametrize("path", ["sym", "dlsym", "proc"])
def test_launches_after_a_switch_ask_the_driver_for_the_context_at_most_once(libs, tmp_path, path):
    """100 launches after each switch, and 100 in a new thread that never switched: each run of them
    asks the stand-in's cuCtxGetCurrent at most once (the thread that never switched: once, at its
    first launch). Before, every launch asked it."""
    gate = two_gpus(tmp_path)
    try:
        r = subprocess.run([os.fspath(libs / "ctxsw"), "count", path], env=client_env(libs, tmp_path),
                           capture_output=True, text=True, timeout=60)
    finally:
        gate.close()
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "ctx-calls").read_text().split()
    marks = [i for i, c in enumerate(calls) if c == "mark"]
    assert len(marks) == 2 * (len(SWITCHES) + 1), calls
    asked = [sum(c == "cuCtxGetCurrent" for c in calls[a:b]) for a, b in zip(marks[::2], marks[1::2])]
    assert max(asked) <= 1, dict(zip([*SWITCHES, "a thread that never switched"], asked))
