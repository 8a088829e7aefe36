"""libcgpu on aarch64 nodes (Grace Hopper, GB200, Graviton): issue 34 item 8.

The aarch64 build (`make -C native cross`: zig cross-builds the programs, libcgpu and the
stand-in drivers for aarch64 glibc 2.17) runs under qemu-aarch64-static in an arm64 image with
glibc 2.31 (Debian bullseye, scripts/rootfs.sh's cache, made once by scripts/setup.sh). There
glibc's dlsym is only at GLIBC_2.17, aarch64's first version: a libcgpu that asked for 2.34 and
x86_64's 2.2.5 aborted every process at its first dlsym or ioctl."""
from __future__ import annotations

import os
import re
import subprocess

from pathlib import Path

import pytest

from cgpud.gpus import pages

ROOT = Path(__file__).resolve().parent.parent
ZIG = os.fspath(ROOT / ".venv" / "bin" / "python-zig")
QEMU = "qemu-aarch64-static"
MIB = 1 << 20

# dlsym and ioctl, the calls every process makes through libcgpu; with an argument, the stand-in
# driver: its card's size and one allocation past memsize.
CLIENT = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>
typedef int (*i_t)(unsigned); typedef int (*a_t)(unsigned long long *, size_t); typedef int (*t_t)(size_t *, int);
int main(int argc, char **argv) {
    void *p = dlsym(RTLD_DEFAULT, "getpid");
    printf("dlsym %s\n", !p ? "null" : ((pid_t (*)(void))p)() == getpid() ? "getpid" : "wrong");
    int fd = open("/dev/null", O_RDONLY);
    struct winsize ws;
    errno = 0;
    int r = ioctl(fd, TIOCGWINSZ, &ws);
    printf("ioctl %d %s\n", r, errno == ENOTTY ? "ENOTTY" : strerror(errno));
    if (argc < 2)
        return 0;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("no libcuda: %s\n", dlerror()); return 2; }
    i_t init = (i_t)dlsym(h, "cuInit"); a_t alloc = (a_t)dlsym(h, "cuMemAlloc_v2");
    t_t total = (t_t)dlsym(h, "cuDeviceTotalMem_v2");
    if (!init || !alloc || !total) { printf("cuda nosym\n"); return 0; }
    unsigned long long a, b;
    size_t t = 0;
    int ri = init(0);
    total(&t, 0);
    int fit = alloc(&a, t / 2), past = alloc(&b, t / 2 + MIB_ONE);
    printf("cuda %d %zu %d %d\n", ri, t, fit, past);
    return 0;
}
""".replace("MIB_ONE", str(MIB))

# A C library whose dlsym libcgpu cannot find: dlvsym answers NULL for every version.
NO_DLVSYM = r"""
#include <stddef.h>
void *dlvsym(void *handle, const char *name, const char *version) { return NULL; }
"""


def zig_cc(out: Path, src: Path, *flags: str) -> None:
    r = subprocess.run([ZIG, "cc", "-target", "aarch64-linux-gnu.2.17", "-O1", "-o", os.fspath(out), os.fspath(src),
                        *flags], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """The aarch64 build of the whole native/ (make -C native cross) and the clients."""
    d = tmp_path_factory.mktemp("aarch64")
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "cross", "CROSS_ARCH=aarch64",
                        f"OUT={d}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (d / "client.c").write_text(CLIENT)
    zig_cc(d / "client", d / "client.c", "-ldl")
    (d / "nodlvsym.c").write_text(NO_DLVSYM)
    zig_cc(d / "libnodlvsym.so", d / "nodlvsym.c", "-shared", "-fPIC")
    return d


@pytest.fixture(scope="module")
def arm64_root() -> Path:
    """Debian bullseye for arm64 (glibc 2.31): scripts/rootfs.sh's cache (scripts/setup.sh made it)."""
    r = subprocess.run([os.fspath(ROOT / "scripts" / "rootfs.sh"), "bullseye", "minbase", "arm64"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def qemu(root: Path, prog: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    """`prog` run by qemu-aarch64-static with `root`'s dynamic loader and C library, `env` its
    whole environment."""
    e = [a for k, v in env.items() for a in ("-E", f"{k}={v}")]
    return subprocess.run([QEMU, "-L", os.fspath(root), *e, os.fspath(prog), *args], env={}, capture_output=True,
                          text=True, timeout=60)


def test_the_image_is_arm64_with_glibc_2_31(build, arm64_root):
    """The ground the other tests stand on: the root filesystem's C library is aarch64's glibc 2.31
    (run, it names its own release), and the builds are aarch64 code."""
    libc = arm64_root / "lib" / "aarch64-linux-gnu" / "libc.so.6"
    r = qemu(arm64_root, libc, env={})
    assert r.returncode == 0, r.stderr
    assert "release version 2.31" in r.stdout.splitlines()[0], r.stdout
    for f in ("libcgpu.so", "cgpu-hook", "cgpu-runtime", "libcgpu-switch.so", "stubs/libcuda.so.1",
              "stubs/libnvidia-ml.so.1", "client"):
        head = (build / f).read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, f  # EM_AARCH64


def test_symbol_versions_are_aarch64s(build):
    """Every GLIBC_ version the aarch64 libcgpu needs is 2.17, aarch64's first (x86_64's 2.2.5
    does not exist there), and it exports dlsym and ioctl unversioned, as on x86_64."""
    out = subprocess.run(["objdump", "-T", os.fspath(build / "libcgpu.so")], capture_output=True, text=True,
                         check=True).stdout
    assert set(re.findall(r"GLIBC_[0-9.]+", out)) == {"GLIBC_2.17"}, out
    exported = {line.split()[-1] for line in out.splitlines() if " g " in line and ".text" in line}
    assert {"dlsym", "ioctl", "cuInit", "cuMemAlloc_v2"} <= exported


def test_the_native_programs_run_under_glibc_2_31(build, arm64_root):
    """The aarch64 hook and runtime wrapper need nothing past GLIBC_2.17 and run in the arm64 image:
    the hook refuses an OCI state without an id in its one line; cgpu-runtime hands a command it
    does not prepare to runc (this host's), which answers as it does itself."""
    for f in ("cgpu-hook", "cgpu-runtime", "libcgpu-switch.so", "stubs/libcuda.so.1", "stubs/libnvidia-ml.so.1"):
        out = subprocess.run(["objdump", "-T", os.fspath(build / f)], capture_output=True, text=True,
                             check=True).stdout
        assert set(re.findall(r"GLIBC_[0-9.]+", out)) <= {"GLIBC_2.17"}, (f, out)
    e = ["-E", f"PATH={os.environ['PATH']}"]
    r = subprocess.run([QEMU, "-L", os.fspath(arm64_root), os.fspath(build / "cgpu-hook")], input="{}",
                       capture_output=True, text=True, timeout=60, env={})
    assert r.returncode == 1 and r.stderr.strip() == 'cgpu hook: the OCI state on stdin has no "id"', r.stderr
    r = subprocess.run([QEMU, "-L", os.fspath(arm64_root), *e, os.fspath(build / "cgpu-runtime"), "--version"],
                       capture_output=True, text=True, timeout=60, env={})
    native = subprocess.run(["runc", "--version"], capture_output=True, text=True, check=True)
    assert r.returncode == 0 and r.stdout == native.stdout, r.stdout + r.stderr


def test_dlsym_and_ioctl_work_under_glibc_2_31(build, arm64_root):
    """A process of the arm64 image with libcgpu preloaded: dlsym finds libc's getpid, ioctl answers
    the kernel's ENOTTY, and it exits 0 (libcgpu looked for dlsym at GLIBC_2.34 and GLIBC_2.2.5
    only and aborted)."""
    r = qemu(arm64_root, build / "client", env={"LD_PRELOAD": os.fspath(build / "libcgpu.so")})
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["dlsym getpid", "ioctl -1 ENOTTY"], r.stdout + r.stderr
    assert r.stderr == ""


def test_a_c_library_without_a_known_dlsym_is_refused_gracefully(build, arm64_root):
    """Where no version of dlsym can be found (dlvsym answers NULL for each), no abort: one line on
    stderr, dlsym answers NULL (the driver's names too), ioctl still reaches the kernel, exit 0."""
    r = qemu(arm64_root, build / "client", "cuda", env={
        "LD_PRELOAD": f"{build / 'libnodlvsym.so'}:{build / 'libcgpu.so'}",
        "LD_LIBRARY_PATH": os.fspath(build / "stubs")})
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[:2] == ["dlsym null", "ioctl -1 ENOTTY"], r.stdout + r.stderr
    assert lines == ["dlsym null", "ioctl -1 ENOTTY", "cuda nosym"], r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "cannot find the C library's dlsym" in r.stderr, r.stderr


def test_the_stand_in_driver_holds_memsize_under_qemu(build, arm64_root, tmp_path):
    """The aarch64 stand-in libcuda behind the aarch64 libcgpu, a 64 MiB memsize on a 1 GiB card:
    the card shows 64 MiB, half of it fits, one MiB past the rest is CUDA_ERROR_OUT_OF_MEMORY (2)."""
    pages.create(os.fspath(tmp_path / "pages"), [64 * MIB])
    r = qemu(arm64_root, build / "client", "cuda", env={
        "LD_PRELOAD": os.fspath(build / "libcgpu.so"), "LD_LIBRARY_PATH": os.fspath(build / "stubs"),
        "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"),
        "CGPU_STUB_CUDA_MIB": "1024"})
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.splitlines()[2] == f"cuda 0 {64 * MIB} 0 2", r.stdout + r.stderr


def test_x86_64_is_refused_gracefully_too(tmp_path):
    """The same on this x86_64 host (glibc 2.36): no dlsym at any version, no abort."""
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "libcgpu", "stubs", f"LIB={tmp_path}",
                        f"STUBS={tmp_path}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (tmp_path / "client.c").write_text(CLIENT)
    (tmp_path / "nodlvsym.c").write_text(NO_DLVSYM)
    subprocess.run(["gcc", "-o", os.fspath(tmp_path / "client"), os.fspath(tmp_path / "client.c"), "-ldl"], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", os.fspath(tmp_path / "libnodlvsym.so"),
                    os.fspath(tmp_path / "nodlvsym.c")], check=True)
    r = subprocess.run([os.fspath(tmp_path / "client"), "cuda"], capture_output=True, text=True, timeout=60,
                       env={"LD_PRELOAD": f"{tmp_path / 'libnodlvsym.so'}:{tmp_path / 'libcgpu.so'}",
                            "LD_LIBRARY_PATH": os.fspath(tmp_path)})
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["dlsym null", "ioctl -1 ENOTTY", "cuda nosym"], r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "cannot find the C library's dlsym" in r.stderr, r.stderr
