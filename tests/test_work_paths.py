"""Every path that puts work on the card passes the gate (issue 45, item 9): the legacy launches
(cuLaunch, cuLaunchGrid, cuLaunchGridAsync), the 2-D, 3-D, peer and batched copies, the 2-D
memsets, prefetches, a stream's memory operations, and the synchronous copies and memsets. Each,
called while the container's gate is closed, returns only once it opens (the asynchronous ones
also keep their stream's bound: gate.c's GATED, as a kernel). Before, each went straight to the
driver: its work ran in the next container's slice.

No GPU here: the stand-in driver (native/stubs/: libcuda.c's legacy launches, cuda_device.c's
copies, memsets and stream memory operations, with the checks NVIDIA's reference documents)."""
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

CALLER = r"""
/* caller NAME: a context, 1 MiB on the card (and 1 MiB managed), a stream; prints "ready", reads a
   line, calls NAME once with arguments the driver takes, prints its result. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef unsigned long long P;
#define CALL(type, ...) r = ((type)fn)(__VA_ARGS__)
int main(int argc, char **argv) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW), *ctx, *s;
    if (!h || ((int (*)(unsigned))dlsym(h, "cuInit"))(0)) return 2;
    if (((int (*)(void **, int))dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, 0)) return 3;
    ((int (*)(void *))dlsym(h, "cuCtxSetCurrent"))(ctx);
    P d, m;
    if (((int (*)(P *, size_t))dlsym(h, "cuMemAlloc_v2"))(&d, 1 << 20)) return 4;
    if (((int (*)(P *, size_t, unsigned))dlsym(h, "cuMemAllocManaged"))(&m, 1 << 20, 1)) return 4;
    if (((int (*)(void **, unsigned))dlsym(h, "cuStreamCreate"))(&s, 1)) return 5;
    void *fn = dlsym(h, argv[1]);
    if (!fn) return 6;
    static char host[1 << 20], desc[256], ops[48 * 2];
    static uint64_t word;
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 7;
    const char *n = argv[1];
    int r = -1;
    if (!strcmp(n, "cuLaunch")) CALL(int (*)(void *), NULL);
    else if (!strcmp(n, "cuLaunchGrid")) CALL(int (*)(void *, int, int), NULL, 10, 1);
    else if (!strcmp(n, "cuLaunchGridAsync")) CALL(int (*)(void *, int, int, void *), NULL, 10, 1, s);
    else if (!strcmp(n, "cuMemcpyPeerAsync")) CALL(int (*)(P, void *, P, void *, size_t, void *), d, ctx, d + 4096, ctx, 4096, s);
    else if (!strcmp(n, "cuMemcpy2DAsync_v2") || !strcmp(n, "cuMemcpy3DAsync_v2")) CALL(int (*)(void *, void *), desc, s);
    else if (!strcmp(n, "cuMemcpy2D_v2")) CALL(int (*)(void *), desc);
    else if (!strcmp(n, "cuMemsetD2D8Async")) CALL(int (*)(P, size_t, unsigned char, size_t, size_t, void *), d, 1024, 0, 512, 16, s);
    else if (!strcmp(n, "cuMemsetD2D8_v2")) CALL(int (*)(P, size_t, unsigned char, size_t, size_t), d, 1024, 0, 512, 16);
    else if (!strcmp(n, "cuMemPrefetchAsync")) CALL(int (*)(P, size_t, int, void *), m, 4096, 0, s);
    else if (!strcmp(n, "cuStreamWriteValue32_v2")) CALL(int (*)(void *, P, unsigned, unsigned), s, (P)(uintptr_t)&word, 1, 0);
    else if (!strcmp(n, "cuStreamWriteValue64_v2")) CALL(int (*)(void *, P, uint64_t, unsigned), s, (P)(uintptr_t)&word, 1, 0);
    else if (!strcmp(n, "cuStreamBatchMemOp_v2")) CALL(int (*)(void *, unsigned, void *, unsigned), s, 2, ops, 0);
    else if (!strcmp(n, "cuMemcpyHtoD_v2")) CALL(int (*)(P, const void *, size_t), d, host, 4096);
    else if (!strcmp(n, "cuMemcpyDtoH_v2")) CALL(int (*)(void *, P, size_t), host, d, 4096);
    else if (!strcmp(n, "cuMemcpy")) CALL(int (*)(P, P, size_t), d, (P)(uintptr_t)host, 4096);
    else if (!strcmp(n, "cuMemsetD8_v2")) CALL(int (*)(P, unsigned char, size_t), d, 0, 4096);
    printf("%d\n", r);
    return 0;
}
"""

PATHS = ["cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync", "cuMemcpyPeerAsync", "cuMemcpy2DAsync_v2",
         "cuMemcpy3DAsync_v2", "cuMemcpy2D_v2", "cuMemsetD2D8Async", "cuMemsetD2D8_v2", "cuMemPrefetchAsync",
         "cuStreamWriteValue32_v2", "cuStreamWriteValue64_v2", "cuStreamBatchMemOp_v2", "cuMemcpyHtoD_v2",
         "cuMemcpyDtoH_v2", "cuMemcpy", "cuMemsetD8_v2"]


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs, compile_c
    d = build_libs(tmp_path_factory.mktemp("work"))
    compile_c(d, "caller", CALLER)
    return d


def line_within(p: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline().strip() if ready else ""


@pytest.mark.parametrize("name", PATHS)
def test_work_called_while_the_gate_is_closed_waits_for_it_to_open(libs, tmp_path, name):
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card")}
    without = subprocess.run([os.fspath(libs / "caller"), name], env=dict(env, LD_PRELOAD="", CGPU_PAGE_DIR=""),
                             input="go\n", capture_output=True, text=True, timeout=30)
    assert without.returncode == 0 and without.stdout.split() == ["ready", "0"], (without.returncode, without.stdout)
    p = subprocess.Popen([os.fspath(libs / "caller"), name], env=env, text=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1)
    try:
        assert line_within(p, 30) == "ready", p.stderr.read()
        gate.freeze()
        p.stdin.write("go\n")
        p.stdin.flush()
        early = line_within(p, 0.3)
        assert early == "", f"{name} returned {early} while the gate was closed: its work went to the card"
        opened = time.monotonic()
        gate.thaw()
        assert line_within(p, 10) == "0", p.stderr.read()
        assert time.monotonic() - opened < 5
    finally:
        stopped(p, gate, None)  # (killed if it is still there; the gate opened and let go)
