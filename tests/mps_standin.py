"""The stand-in MPS (issue 37; docs/mps.md "The stand-in's MPS"): its control daemon
(native/stubs/nvidia-cuda-mps-control) run in a pipe directory of a test's own, and a small C
client of the stand-in libcuda, found with dlopen as any program finds libcuda.so.1. Shared by
tests/test_mps_standin.py and tests/test_gpu_check.py."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTROL = ROOT / "native" / "stubs" / "nvidia-cuda-mps-control"

SOURCE = r"""
/* mps-client MODE ...
 *   alloc MIB...    cuInit, cuCtxCreate on device 0, then cuMemAlloc of each size (a negative one: free
 *                   the allocation that many before); prints "init R", "ctx R", then "alloc R" per size
 *   burst N US      cuInit, cuCtxCreate, N launches of US µs, cuCtxSynchronize; prints "done"
 *   twice           cuInit, and if it failed, cuInit again (prints "init R" for each) */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static void *h;
static void *sym(const char *n) { void *f = dlsym(h, n); if (!f) { fprintf(stderr, "no %s\n", n); exit(2); } return f; }
int main(int argc, char **argv)
{
    if (argc < 2 || !(h = dlopen("libcuda.so.1", RTLD_NOW))) return 2;
    int r = ((int (*)(unsigned))sym("cuInit"))(0);
    printf("init %d\n", r);
    if (r && !strcmp(argv[1], "twice")) printf("init %d\n", ((int (*)(unsigned))sym("cuInit"))(0));
    if (r) return 0;
    void *ctx;
    r = ((int (*)(void **, unsigned, int))sym("cuCtxCreate_v2"))(&ctx, 0, 0);
    printf("ctx %d\n", r);
    if (r) return 0;
    if (!strcmp(argv[1], "alloc")) {
        int (*alloc)(unsigned long long *, size_t) = (int (*)(unsigned long long *, size_t))sym("cuMemAlloc_v2");
        int (*release)(unsigned long long) = (int (*)(unsigned long long))sym("cuMemFree_v2");
        unsigned long long p[64] = {0};
        for (int i = 2; i < argc && i < 64; i++) {
            long mib = atol(argv[i]);
            if (mib < 0) {
                printf("free %d\n", release(p[i + mib]));
                continue;
            }
            printf("alloc %d\n", alloc(&p[i], (size_t)mib << 20));
        }
    } else if (!strcmp(argv[1], "burst") && argc == 4) {
        int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                      void **) = sym("cuLaunchKernel");
        for (int i = 0; i < atoi(argv[2]); i++)
            if ((r = launch(NULL, (unsigned)atoi(argv[3]), 1, 1, 1, 1, 1, 0, NULL, NULL, NULL))) {
                printf("launch %d\n", r);
                return 0;
            }
        ((int (*)(void))sym("cuCtxSynchronize"))();
        printf("done\n");
    }
    return 0;
}
"""


def build(where: Path) -> Path:
    """The stand-in drivers and the client, built into `where`."""
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "stubs", f"STUBS={where}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (where / "mps-client.c").write_text(SOURCE)
    subprocess.run(["gcc", "-O1", "-Wall", "-o", os.fspath(where / "mps-client"), os.fspath(where / "mps-client.c"),
                    "-ldl"], check=True)
    return where


class Mps:
    """A stand-in control daemon's environment: its pipe and log directories, the card's state."""

    def __init__(self, libs: Path, tmp: Path, name: str = "mps"):
        self.libs, self.tmp = libs, tmp
        self.pipe, self.logs = tmp / f"{name}-pipe", tmp / f"{name}-log"
        self.env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
                    "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CUDA_MPS_PIPE_DIRECTORY": os.fspath(self.pipe),
                    "CUDA_MPS_LOG_DIRECTORY": os.fspath(self.logs)}

    def control(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([os.fspath(CONTROL), *args], input=stdin, env=self.env, capture_output=True, text=True,
                              timeout=30)

    def start(self) -> None:
        r = self.control("-d")
        assert r.returncode == 0, r.stderr

    def stop(self) -> None:
        if (self.pipe / "control").exists():
            self.control(stdin="quit\n")

    def client(self, *args: str, **env: str) -> dict[str, list[int]]:
        """The client's results by what they are ("init", "ctx", "alloc", ...), in order."""
        r = subprocess.run([os.fspath(self.libs / "mps-client"), *args], env={**self.env, **env},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out: dict[str, list[int]] = {}
        for line in r.stdout.splitlines():
            what, _, value = line.partition(" ")
            out.setdefault(what, []).append(int(value) if value else 0)
        return out
