"""The launch path takes no process-wide lock (issue 45, item 10; docs/isolation.md, "The launch
path"): a thread held inside libcgpu's own bookkeeping, or inside the driver, never holds up
another thread's launch or stream-ordered allocation.

Each test holds one thread somewhere (a calloc that grows the allocations' table, under its lock on
main; a cuMemAllocAsync inside the stand-in driver, under pool_lock on main) and has another thread
do its work meanwhile. What is asserted is the order: the other thread's work done while the first
is still held (the test releases the held thread only once it has seen that, or once it has waited
long enough to say the other thread was held up too)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from test_libcgpu import build_libs, compile_c

MIB = 1 << 20

# calloc_hold.so: a calloc of 16 KiB or more by the thread that called calloc_hold_arm() (once) makes
# $CALLOC_HOLD.in and waits for $CALLOC_HOLD.go: a thread held inside a table's growth.
CALLOC_HOLD = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
extern void *__libc_calloc(size_t, size_t);
static pthread_t armed;
static int is_armed;
void calloc_hold_arm(void) { armed = pthread_self(); __atomic_store_n(&is_armed, 1, __ATOMIC_SEQ_CST); }
void *calloc(size_t n, size_t size) {
    if (__atomic_load_n(&is_armed, __ATOMIC_SEQ_CST) && pthread_equal(armed, pthread_self()) && n * size >= 16384) {
        __atomic_store_n(&is_armed, 0, __ATOMIC_SEQ_CST);
        const char *at = getenv("CALLOC_HOLD");
        char in[4200], go[4200];
        snprintf(in, sizeof in, "%s.in", at);
        snprintf(go, sizeof go, "%s.go", at);
        close(open(in, O_WRONLY | O_CREAT | O_CLOEXEC, 0666));
        while (access(go, F_OK)) { struct timespec ms = {0, 1000000}; nanosleep(&ms, NULL); }
    }
    return __libc_calloc(n, size);
}
"""

# held MODE PATH: one thread held at PATH.in (released by PATH.go), another working meanwhile; prints
# "done before-go" (the other thread's work finished while the first was held) or "done after-go".
#   table: the held thread's cuMemAlloc grows libcgpu's allocations' table (its calloc held); the
#          other thread, new, launches a kernel launched before (the launched-functions table read).
#   pool:  the held thread's cuMemAllocAsync grows the default pool (the stand-in pauses inside the
#          call, CGPU_STUB_ALLOC_PAUSE); the other allocates from what the pool keeps (no growth).
HELD = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef unsigned long long dptr;
static void *h, *ctx, *fn, *s1, *s2;
static const char *mode, *path;
static void *f(const char *name) { void *p = dlsym(h, name); if (!p) { fprintf(stderr, "no %s\n", name); exit(3); } return p; }
#define CALL(name, ...) do { int r_ = ((int (*)())f(name))(__VA_ARGS__); if (r_) { fprintf(stderr, "%s: %d\n", name, r_); exit(4); } } while (0)
static int exists(const char *suffix) { char p[4200]; snprintf(p, sizeof p, "%s%s", path, suffix); return access(p, F_OK) == 0; }
static void *held(void *a) {
    (void)a;
    CALL("cuCtxSetCurrent", ctx);
    dptr p;
    if (!strcmp(mode, "table")) {
        ((void (*)(void))dlsym(RTLD_DEFAULT, "calloc_hold_arm"))();
        for (int i = 0; i < 200; i++) CALL("cuMemAlloc_v2", &p, (size_t)4096);
    } else
        CALL("cuMemAllocAsync", &p, (size_t)(64 << 20), s2);
    return NULL;
}
static void *other(void *a) {
    (void)a;
    CALL("cuCtxSetCurrent", ctx);
    dptr p;
    if (!strcmp(mode, "table"))
        for (int i = 0; i < 1000; i++) CALL("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    else
        CALL("cuMemAllocAsync", &p, (size_t)(2 << 20), s1);
    printf("done %s\n", exists(".go") ? "after-go" : "before-go");
    fflush(stdout);
    return NULL;
}
int main(int argc, char **argv) {
    mode = argv[1];
    path = argv[2];
    h = dlopen("libcuda.so.1", RTLD_NOW);
    int dev;
    CALL("cuInit", 0);
    CALL("cuDeviceGet", &dev, 0);
    CALL("cuDevicePrimaryCtxRetain", &ctx, dev);
    CALL("cuCtxSetCurrent", ctx);
    void *mod;
    static const char ptx[] = ".version 8.0\n.target sm_75\n.address_size 64\n.visible .entry k0()\n{\nret;\n}\n";
    CALL("cuModuleLoadData", &mod, ptx);
    CALL("cuModuleGetFunction", &fn, mod, "k0");
    CALL("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);  /* (launched before: remembered) */
    CALL("cuStreamCreate", &s1, 1);
    CALL("cuStreamCreate", &s2, 1);
    dptr p;
    if (!strcmp(mode, "table"))
        for (int i = 0; i < 700; i++) CALL("cuMemAlloc_v2", &p, (size_t)4096);  /* (its table grows at 768) */
    else {  /* the pool keeps 4 MiB: released threshold raised, an allocation freed and synchronized */
        void *pool;
        unsigned long long most = ~0ull;
        CALL("cuDeviceGetMemPool", &pool, dev);
        CALL("cuMemPoolSetAttribute", pool, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &most);
        CALL("cuMemAllocAsync", &p, (size_t)(4 << 20), s1);
        CALL("cuMemFreeAsync", p, s1);
        CALL("cuStreamSynchronize", s1);
        setenv("CGPU_STUB_ALLOC_PAUSE", path, 1);
    }
    pthread_t a, b;
    pthread_create(&a, NULL, held, NULL);
    while (!exists(".in")) usleep(1000);
    pthread_create(&b, NULL, other, NULL);
    pthread_join(b, NULL);
    pthread_join(a, NULL);
    return 0;
}
"""


@pytest.fixture(scope="module")
def held_client(tmp_path_factory) -> tuple[Path, Path]:
    """The libraries, the client and calloc_hold.so."""
    d = build_libs(tmp_path_factory.mktemp("launch-path"))
    (d / "calloc_hold.c").write_text(CALLOC_HOLD)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", os.fspath(d / "calloc_hold.so"),
                    os.fspath(d / "calloc_hold.c"), "-lpthread"], check=True)
    return d, compile_c(d, "held", HELD)


def run_held(libs: Path, client: Path, tmp_path: Path, mode: str, preload: str) -> str:
    """The client in `mode` under libcgpu (`preload` before it); its line, the held thread released
    once the line came (or after 60 s without it: the other thread was held up too)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    hold = tmp_path / "hold"
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
           "LD_PRELOAD": ":".join(p for p in (preload, os.fspath(libs / "libcgpu.so")) if p),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"),
           "CALLOC_HOLD": os.fspath(hold)}
    p = subprocess.Popen([os.fspath(client), mode, os.fspath(hold)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        os.set_blocking(p.stdout.fileno(), False)
        line, waited = "", time.monotonic() + 60  # (a bound on the wait for a held-up thread, not a figure)
        while not line and time.monotonic() < waited and p.poll() is None:
            line = p.stdout.readline()
            time.sleep(0.01)
        (tmp_path / "hold.go").write_text("")
        os.set_blocking(p.stdout.fileno(), True)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, err
    assert (tmp_path / "hold.in").exists(), err  # (the thread was held where the test meant)
    return (line + out).strip()


def test_a_launch_is_not_held_up_by_an_allocation_growing_the_table(held_client, tmp_path):
    """One thread's cuMemAlloc grows libcgpu's allocations' table, its calloc held; meanwhile a new
    thread launches a kernel 1000 times (its function launched before: the lazy-load check reads the
    launched functions' table). On main every launch took the spin lock the allocation holds across
    its calloc and rehash: the launches waited for the allocation ("done after-go")."""
    libs, client = held_client
    assert run_held(libs, client, tmp_path, "table", os.fspath(libs / "calloc_hold.so")) == "done before-go"


def test_a_stream_ordered_allocation_is_not_held_up_by_another_inside_the_driver(held_client, tmp_path):
    """One thread's cuMemAllocAsync grows the default pool and is held inside the driver (the
    stand-in pauses after it took the card's pages); meanwhile another thread's cuMemAllocAsync
    takes 2 MiB of what the pool keeps. On main pool_lock was held across the driver's call: the
    second allocation waited for the first ("done after-go")."""
    libs, client = held_client
    assert run_held(libs, client, tmp_path, "pool", "") == "done before-go"
