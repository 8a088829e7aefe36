"""Green contexts (CUDA 12.4; issue 45, item 8): a green context launches through the CUcontext
cuCtxFromGreenCtx gives for it; libcgpu notes that context at its launches (its drain synchronizes
it), and must forget it at cuGreenCtxDestroy, as it forgets a context at cuCtxDestroy: a destroyed
context used by the library's thread is undefined behaviour in the driver.

No GPU here: the stand-in's green contexts (native/stubs/cuda_contexts.c, from the CUDA Driver API
reference's "Green Contexts"), and its strict handles (CGPU_STUB_STRICT_HANDLES=1: a destroyed
context used aborts the process, saying which call)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from cgpud.sched.gate import GateFreezer
from test_graphs import stopped

GREEN = r"""
/* green MODE: a green context on device 0, made current through cuCtxFromGreenCtx, 20 kernels of
   1 ms launched in it, then destroyed (the primary context current again). MODE use: its CUcontext
   pushed afterwards (the stand-in's rule); MODE launch: prints "destroyed", then launches 1 ms
   kernels in the primary context until a line comes on stdin, then "done". */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <sys/select.h>
#include <time.h>
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
#define F(type, name) __typeof__(type) name = (__typeof__(type))dlsym(h, #name)
int main(int argc, char **argv) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *primary, *green, *gctx, *was;
    if (!h || ((int (*)(unsigned))dlsym(h, "cuInit"))(0)) { fprintf(stderr, "cuInit\n"); return 2; }
    F(int (*)(void **, int), cuDevicePrimaryCtxRetain);
    F(int (*)(void *), cuCtxSetCurrent);
    F(int (*)(void *), cuCtxPushCurrent_v2);
    F(int (*)(void **), cuCtxPopCurrent_v2);
    F(int (*)(void **, void *, int, unsigned), cuGreenCtxCreate);
    F(int (*)(void **, void *), cuCtxFromGreenCtx);
    F(int (*)(void *), cuGreenCtxDestroy);
    F(int (*)(void), cuCtxSynchronize);
    F(l_t, cuLaunchKernel);
    char desc[64] = {0};  /* (the stand-in takes any resource descriptor) */
    if (cuDevicePrimaryCtxRetain(&primary, 0) || cuCtxSetCurrent(primary)) return 3;
    if (cuGreenCtxCreate(&green, desc, 0, 1) || cuCtxFromGreenCtx(&gctx, green) || gctx == primary) return 4;
    if (cuCtxSetCurrent(gctx)) return 5;
    for (int i = 0; i < 20; i++)
        if (cuLaunchKernel(NULL, 1000, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 6;
    if (cuCtxSynchronize() || cuCtxSetCurrent(primary) || cuGreenCtxDestroy(green)) return 7;
    if (!strcmp(argv[1], "use")) {
        int r = cuCtxPushCurrent_v2(gctx);
        cuCtxPopCurrent_v2(&was);
        printf("%d\n", r);
        return 0;
    }
    printf("destroyed\n");
    fflush(stdout);
    char line[16];
    for (;;) {
        if (cuLaunchKernel(NULL, 1000, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 8;
        struct timespec t = {0, 1000000};
        nanosleep(&t, NULL);
        fd_set r;
        FD_ZERO(&r);
        FD_SET(0, &r);
        struct timeval z = {0, 0};
        if (select(1, &r, NULL, NULL, &z) > 0 && fgets(line, sizeof line, stdin)) break;
    }
    cuCtxSynchronize();
    printf("done\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs, compile_c
    d = build_libs(tmp_path_factory.mktemp("green"))
    compile_c(d, "green", GREEN)
    return d


def env_of(libs: Path, tmp: Path) -> dict:
    return {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CGPU_STUB_STRICT_HANDLES": "1"}


def test_the_stand_in_refuses_a_destroyed_green_contexts_handle(libs, tmp_path):
    """Without libcgpu: a green context's CUcontext is its own (not the primary one's), its kernels
    run, and once it is destroyed its CUcontext pushed is the driver's undefined behaviour: the
    strict stand-in aborts, saying so."""
    r = subprocess.run([os.fspath(libs / "green"), "use"], env=env_of(libs, tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "cuCtxPushCurrent used a destroyed green context" in r.stderr, (r.returncode, r.stderr)
    env = dict(env_of(libs, tmp_path), CGPU_STUB_STRICT_HANDLES="0")
    r = subprocess.run([os.fspath(libs / "green"), "use"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["709"], (r.stdout, r.stderr)  # CUDA_ERROR_CONTEXT_IS_DESTROYED


def test_a_destroyed_green_context_is_never_used_by_the_library(libs, tmp_path):
    """Through libcgpu, the GPU not shared (every drain synchronizes the contexts it launched in):
    kernels launched in a green context, the green context destroyed, then the primary context's
    kernels while the gate closes 10 times. The process ends well: the drains synchronize the live
    context only. Before, the green context's CUcontext stayed in the library's list: the first
    drain after the destroy pushed it (the strict stand-in aborted the process)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    gate.share(None, False, 2000)
    env = dict(env_of(libs, tmp_path), LD_PRELOAD=os.fspath(libs / "libcgpu.so"),
               CGPU_PAGE_DIR=os.fspath(tmp_path / "pages"))
    p = subprocess.Popen([os.fspath(libs / "green"), "launch"], env=env, text=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "destroyed", p.stderr.read()
        for _ in range(10):
            gate.freeze()
            t0 = time.monotonic()
            while not gate.is_frozen() and p.poll() is None and time.monotonic() - t0 < 5:
                time.sleep(0.0005)
            gate.thaw()
            time.sleep(0.01)
        out, err = p.communicate("stop\n", timeout=60)
    finally:
        stopped(p, gate, None)  # (killed if it is still there; the gate opened and let go)
    assert p.returncode == 0 and out.split() == ["done"], (p.returncode, err)
