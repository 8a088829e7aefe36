"""CuPy (cupy-cuda13x: NVIDIA's CUDA runtime 13 inside, kernels compiled by NVRTC) on the
stand-in driver with libcgpu preloaded and a container's page (issue 20): it counts the device,
memGetInfo shows memsize, an allocation past memsize raises OutOfMemoryError and takes
nothing, the memory pool's frees come back to the page, its elementwise kernels run on the
card; and two CuPy loops under policy 2 at 1:2 get 1:2 of the card through the compute gate."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from pathlib import Path

import pytest

from cgpud.gpus import pages
from real_cuda import env, kernels

MIB = 1 << 20
CGPU = str(Path(sys.executable).parent / "cgpu")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs
    d = build_libs(tmp_path_factory.mktemp("cupy"))
    (d / "cupy-cache").mkdir()  # NVRTC's output, kept for the module (CuPy's own cache)
    return d


@pytest.fixture
def container(tmp_path):
    dirp = tmp_path / "pages"
    pages.create(os.fspath(dirp), [256 * MIB])
    return dirp


def cupy(stubs: Path, tmp: Path, page_dir: Path | None, code: str, timeout: float = 120) -> list[str]:
    e = env(stubs, None, tmp, page_dir=page_dir, preload=page_dir is not None,
            CUPY_CACHE_DIR=os.fspath(stubs / "cupy-cache"))
    prelude = "import os, sys, cupy\nfrom cupy.cuda import runtime\n"
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=e, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


def test_cupy_counts_the_device_and_sees_memsize(stubs, tmp_path, container):
    out = cupy(stubs, tmp_path, container, """
        print(runtime.getDeviceCount(), *runtime.memGetInfo(), runtime.getDeviceProperties(0)["totalGlobalMem"])
        print(cupy.cuda.Device(0).compute_capability, runtime.runtimeGetVersion() // 1000)
    """)
    assert out == ["1", str(256 * MIB), str(256 * MIB), str(256 * MIB), "75", "13"]


def test_cupy_past_memsize_raises_out_of_memory_and_takes_nothing(stubs, tmp_path, container):
    out = cupy(stubs, tmp_path, container, """
        state = os.environ["CGPU_STUB_CUDA_STATE"]
        used = lambda: int.from_bytes(open(state, "rb").read(8), "little") if os.path.exists(state) else 0
        before = used()
        try:
            cupy.empty(256 * 2**20 + 1, dtype=cupy.uint8)
            print("allocated")
        except cupy.cuda.memory.OutOfMemoryError:
            print("OutOfMemoryError")
        print(used() - before, runtime.memGetInfo()[0], cupy.get_default_memory_pool().total_bytes())
        a = cupy.empty(256 * 2**20, dtype=cupy.uint8)  # all of memsize fits
        print(used() - before, runtime.memGetInfo()[0])
    """)
    assert out == ["OutOfMemoryError", "0", str(256 * MIB), "0", str(256 * MIB), "0"], out


def test_the_memory_pools_frees_come_back_to_the_page(stubs, tmp_path, container):
    """Freed arrays stay in CuPy's pool (charged, as on a real card); free_all_blocks gives them
    back: the page's count of the container's bytes drops to zero and the room is there again."""
    out = cupy(stubs, tmp_path, container, """
        from cgpud.gpus import pages
        pool = cupy.get_default_memory_pool()
        arrays = [cupy.empty(32 * 2**20, dtype=cupy.uint8) for _ in range(6)]
        held = pages.used(os.environ["CGPU_PAGE_DIR"])[0]
        del arrays
        pooled = pages.used(os.environ["CGPU_PAGE_DIR"])[0]
        pool.free_all_blocks()
        print(held, pooled, pages.used(os.environ["CGPU_PAGE_DIR"])[0], runtime.memGetInfo()[0], pool.total_bytes())
        b = cupy.empty(256 * 2**20, dtype=cupy.uint8)  # the whole of memsize again
        print(pages.used(os.environ["CGPU_PAGE_DIR"])[0])
    """)
    assert out == [str(192 * MIB), str(192 * MIB), "0", str(256 * MIB), "0", str(256 * MIB)], out


def test_an_elementwise_kernel_compiled_by_nvrtc_runs_on_the_card(stubs, tmp_path, container):
    """An ElementwiseKernel (NVRTC compiles it to a cubin; the runtime loads it as a library) over
    128,000 floats: CuPy launches 1,000 blocks of 128, a kernel of 1 ms on the stand-in."""
    out = cupy(stubs, tmp_path, container, """
        twice = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 2 * x", "twice")
        x = cupy.ones(128000, dtype=cupy.float32)
        n0 = len(open(os.environ["CGPU_STUB_CUDA_LOG"]).readlines())
        for _ in range(3):
            y = twice(x)
        cupy.cuda.Device().synchronize()
        print(n0, os.getpid())
    """)
    n0, pid = int(out[0]), int(out[1])
    ks = kernels(tmp_path)[n0:]
    assert [(p, e - s) for p, s, e in ks] == [(pid, 1_000_000)] * 3, ks


LOOP = """
import sys, time, cupy
twice = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 2 * x", "twice")
x = cupy.ones(128000, dtype=cupy.float32)  # 1,000 blocks of 128: 1 ms of the card a kernel
y = twice(x); cupy.cuda.Device().synchronize()
print("started", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(10):
        y = twice(x)
    cupy.cuda.Device().synchronize()
"""


def test_two_cupy_loops_at_1_to_2_get_1_to_2_of_the_card_through_the_gate(make_daemon, stubs, tmp_path):
    """Policy 2, weights 1 and 2, the daemon's compute gate (`--compute gate`): two `cgpu run`
    instances, libcgpu preloaded by it, each a CuPy loop of 1 ms kernels on the one card. The kernel
    time they get, second by second while both run, is 1:2 (the median second; a loose band)."""
    from test_gate import median_ratio
    (tmp_path / "loop.py").write_text(LOOP)
    d = make_daemon(extra_args=["--libcgpu", os.fspath(stubs / "libcgpu.so"), "--compute", "gate"])
    d.write("0/policy", "2")
    procs = []
    for name, weight in (("cupyone00001", 1), ("cupytwo00002", 2)):
        e = {**os.environ, **env(stubs, None, tmp_path, preload=False, CGPUD_SOCKET=str(d.socket),
                                 CGPU_STUB_CUDA_LOG=os.fspath(tmp_path / f"{name}.kernels"),
                                 CUPY_CACHE_DIR=os.fspath(stubs / "cupy-cache"))}
        cmd = f'CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE" exec {sys.executable} {tmp_path / "loop.py"} 5'
        procs.append(subprocess.Popen([CGPU, "run", "--name", name, "--mem", "1G", "--weight", str(weight), "--",
                                       "sh", "-c", cmd], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        line = p.stdout.readline().strip()
        assert line == "started", line + p.stderr.read()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    logs = [tmp_path / "cupyone00001.kernels", tmp_path / "cupytwo00002.kernels"]
    ks = [[tuple(map(int, line.split())) for line in lg.read_text().splitlines()] for lg in logs]
    t0 = max(min(s for _, s, _ in k) for k in ks) + 300_000_000
    t1 = min(max(e for _, _, e in k) for k in ks) - 300_000_000
    assert t1 - t0 > 2.5e9, (t0, t1)
    ratio = median_ratio(logs, t0, t1)
    assert 1.6 <= ratio <= 2.4, ratio
