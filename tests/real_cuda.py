"""NVIDIA's real CUDA stack from its PyPI wheels (pyproject's test extras), on the stand-in
driver (native/stubs): where the wheels put libcudart 12 and 13 and nvcc, how a program is
built against either runtime, and the environment a process needs to run on the stand-in.

There is no nvcc 12 on PyPI (`nvidia-cuda-nvcc-cu12` holds ptxas and CUDA 12.9's device
headers only): a runtime-12 program is built by nvcc 13.5 against CUDA 12.9's headers
(`nvidia-cuda-runtime-cu12`, `nvidia-cuda-nvcc-cu12`) and linked with libcudart.so.12."""
from __future__ import annotations

import os
import re
import subprocess
import sysconfig
from pathlib import Path

NVIDIA = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
NVCC = NVIDIA / "cu13" / "bin" / "nvcc"
ZIG = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python-zig"
RUNTIMES = {
    12: {"lib": NVIDIA / "cuda_runtime" / "lib", "so": "libcudart.so.12",
         "include": [NVIDIA / "cuda_runtime" / "include", NVIDIA / "cuda_nvcc" / "include"]},
    13: {"lib": NVIDIA / "cu13" / "lib", "so": "libcudart.so.13", "include": []},
}
# The stand-in says a UUID only when told one (CGPU_STUB_CUDA_UUIDS); a real driver always does,
# and the runtime will not start on a device without one.
UUID = "GPU-5a1f0c2e-7d3b-4e8a-9c61-0b2d4f6a8e10"


def build(source: str, out: Path, runtime: int, arch: str = "sm_75", glibc: str | None = None) -> Path:
    """`source` (CUDA C++) built by nvcc into the program `out`, linked with the runtime's shared
    libcudart (`-cudart shared`) and finding it through the environment (see env).

    `glibc` ("2.17"): for an older image than this host (glibc 2.36). nvcc compiles (`-c`, its host
    side by this gcc, without exceptions or thread-safe statics so that it needs no C++ runtime)
    and zig's cc links it against that glibc (as native/Makefile builds libcgpu)."""
    rt = RUNTIMES[runtime]
    work = out.parent / f".{out.name}.build"
    work.mkdir(parents=True, exist_ok=True)
    (work / "libcudart.so").unlink(missing_ok=True)
    (work / "libcudart.so").symlink_to(rt["lib"] / rt["so"])
    src = work / f"{out.name}.cu"
    src.write_text(source)
    cmd = [os.fspath(NVCC), f"-arch={arch}", "-O2"]
    for inc in rt["include"]:
        cmd += ["-I", os.fspath(inc)]
    if glibc is None:
        cmd += ["-cudart", "shared", "-o", os.fspath(out), os.fspath(src), "-L", os.fspath(work)]
    else:
        obj = work / f"{out.name}.o"
        cmd += ["-Xcompiler", "-fno-exceptions,-fno-threadsafe-statics,-fno-asynchronous-unwind-tables",
                "-c", "-o", os.fspath(obj), os.fspath(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if glibc is not None:
        r = subprocess.run([os.fspath(ZIG), "cc", "-target", f"x86_64-linux-gnu.{glibc}", "-o", os.fspath(out),
                            os.fspath(obj), "-L", os.fspath(work), "-lcudart"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return out


def glibc_needed(path: Path) -> tuple[int, ...]:
    """The newest GLIBC_ symbol version `path` needs (objdump -T)."""
    out = subprocess.run(["objdump", "-T", os.fspath(path)], capture_output=True, text=True, check=True).stdout
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9][0-9.]*[0-9])", out)}
    assert versions, out
    return max(versions)


def env(stubs: Path, runtime: int | None, tmp: Path, preload: bool = True, page_dir: Path | None = None,
        **extra: str) -> dict:
    """A process on the stand-in card of `tmp` (its state file, its kernel log `tmp/kernels`): the
    stand-in driver and libcgpu from `stubs`, the runtime's libcudart (None: the program finds its
    own, as CuPy does), libcgpu preloaded unless `preload` is false, and the container's pages."""
    libpath = [os.fspath(stubs)] + ([os.fspath(RUNTIMES[runtime]["lib"])] if runtime else [])
    e = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "LD_LIBRARY_PATH": ":".join(libpath),
         "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card.state"), "CGPU_STUB_CUDA_LOG": os.fspath(tmp / "kernels"),
         "CGPU_STUB_CUDA_UUIDS": UUID}
    if preload:
        e["LD_PRELOAD"] = os.fspath(stubs / "libcgpu.so")
    if page_dir is not None:
        e["CGPU_PAGE_DIR"] = os.fspath(page_dir)
    e.update(extra)
    return e


def card_used(tmp: Path) -> int:
    """The stand-in card's bytes in use (its state file's first word)."""
    p = tmp / "card.state"
    return int.from_bytes(p.read_bytes()[:8], "little") if p.exists() else 0


def kernels(tmp: Path) -> list[tuple[int, int, int]]:
    """(pid, start ns, end ns) of each kernel the stand-in ran."""
    log = tmp / "kernels"
    if not log.exists():
        return []
    return [tuple(map(int, line.split())) for line in log.read_text().splitlines() if line.strip()]
