"""The driver's own memory as it grows (issue 28, docs/memory.md): after its context the driver's
memory for a process grows through no allocation call — modules loaded at a kernel's first
launch, libraries, graph instantiation — and NVML's per-process view shows it. The stand-in
libcuda grows as the H100 did (native/stubs: 2 MiB per module load and per function's first
launch, 70 MiB per instantiated graph; a cuBLAS-like module of 33 kernels: +66 MiB at its first
use), and the daemon's NVML watchdog (--mem-action kill) watches `cgpu run` instances whose
processes carry libcgpu. A process going through libcgpu must end in out-of-memory, never in a
kill; one that goes around it is still killed, and the log says which it was."""
from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_libcgpu import PRELUDE, build_libs

MIB = 1 << 20
GIB = 1 << 30
CONTEXT_MIB = 500
NVML_LAG_MS = 50  # NVML's per-process figure a little after the call that changed it (the stand-in's lag)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    return build_libs(tmp_path_factory.mktemp("growth"))


@pytest.fixture
def watched(make_daemon, libs, tmp_path, monkeypatch):
    """A daemon on the NVML stand-in (its processes are the stand-in libcuda's, by their PIDs, their
    figures 50 ms late) with libcgpu for `cgpu run` and the memory watchdog killing past memsize;
    contexts of 500 MiB."""
    from nvml_stub import NvmlStub, StubGpu

    stub = NvmlStub(libs, tmp_path / "nvml.conf", cuda_state=tmp_path / "card.state")
    stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
    stub.write()
    for k, v in {**stub.env({}), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
                 "CGPU_STUB_CTX_MIB": str(CONTEXT_MIB), "CGPU_STUB_NVML_LAG_MS": str(NVML_LAG_MS)}.items():
        monkeypatch.setenv(k, v)
    d = make_daemon(gpus="nvml", start=False, extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so")])
    d.dev_dir.mkdir()
    (d.dev_dir / "nvidia0").write_text("")
    d.start()
    return d


_made = itertools.count()


def name(tag: str) -> str:
    """An instance name of this run's own (12 characters)."""
    return f"{tag}{os.getpid() % 100000:05d}{next(_made):03d}".ljust(12, "x")[:12]


def cgpu_run(d, inst: str, mem: str, code: str, *, around: bool = False, first: str = "") -> subprocess.Popen:
    """`cgpu run --mem MEM` of a cuda-bindings program; around: the program unsets LD_PRELOAD
    (and re-executes itself without libcgpu) first; `first`: code run before anything loads CUDA."""
    prog = PRELUDE + textwrap.dedent(code)
    if around:
        prog = ("import os, sys\nif os.environ.pop('LD_PRELOAD', None) is not None:\n"
                "    os.execv(sys.executable, [sys.executable, '-c', sys.argv[-1], sys.argv[-1]])\n") + prog
    prog = textwrap.dedent(first) + prog
    return subprocess.Popen([os.fspath(Path(sys.executable).parent / "cgpu"), "run", "--name", inst, "--mem", mem,
                             "--", sys.executable, "-c", prog, prog],
                            env={**os.environ, "CGPUD_SOCKET": os.fspath(d.socket)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@contextlib.contextmanager
def neighbour(d, mem: str = "2G"):
    """A neighbour instance whose process holds 1 GiB of the card while the block runs (its pid)."""
    p = cgpu_run(d, name("nb"), mem, """
        import os, time
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        held = ok(d.cuMemAlloc(2**30))
        print("holding", os.getpid(), flush=True)
        time.sleep(60)
    """)
    try:
        said = p.stdout.readline().split()
        assert said[:1] == ["holding"], p.stderr.read()
        yield int(said[1])
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # (cgpu run and the program it runs)
        p.wait()


def finish(p: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


CONTEXT = """
import os, time
E = d.CUresult
ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
PTX = (".version 8.0\\n.target sm_75\\n.address_size 64\\n"
       + "".join(f".visible .entry k{i}()\\n{{\\nret;\\n}}\\n" for i in range(33))).encode()
refused = []
def first_use():
    # a cuBLAS-like module of 33 kernels, loaded at import; its first matmul (+66 MiB on the H100):
    # refused with out-of-memory where that does not fit (as the driver refuses a lazy load; libcgpu
    # foresees it, issue 34 item 7), the module kept for a later first use
    mod = ok(d.cuModuleLoadData(PTX))
    r = d.cuLaunchKernel(ok(d.cuModuleGetFunction(mod, b"k1")), 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)[0]
    if r == E.CUDA_ERROR_OUT_OF_MEMORY:
        refused.append(r)
        return mod
    assert r == E.CUDA_SUCCESS, r
    ok(d.cuCtxSynchronize())
    return mod
import ctypes
_nvml = ctypes.CDLL("libnvidia-ml.so.1"); assert _nvml.nvmlInit_v2() == 0
_hdev = ctypes.c_void_p(); assert _nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(_hdev)) == 0
class _Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
def nvml_mine():
    # NVML's figure for this process: what the watchdog judges by
    n, infos = ctypes.c_uint(8), (_Info * 8)()
    assert _nvml.nvmlDeviceGetComputeRunningProcesses_v3(_hdev, ctypes.byref(n), infos) == 0
    return sum(infos[k].used for k in range(n.value) if infos[k].pid == os.getpid())
def charged():
    # what libcgpu charges this process (its slot in the instance's page), the latest reading applied
    from cgpud.gpus import pages
    ok(d.cuMemGetInfo())
    return pages.slots(os.environ["CGPU_PAGE_DIR"])[0][os.getpid()].held[0]
def graph(mod, s):
    # a graph captured and instantiated (+70 MiB of the driver's own)
    ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(d.cuLaunchKernel(ok(d.cuModuleGetFunction(mod, b"k0")), 10, 1, 1, 1, 1, 1, 0, s, 0, 0))
    return ok(d.cuGraphInstantiate(ok(d.cuStreamEndCapture(s)), 0))
"""

# Each fills what it is told is free as its framework does at its defaults, then uses the card.
FILLS = {
    # JAX: XLA_PYTHON_CLIENT_MEM_FRACTION (0.75) of what is free, preallocated; XLA's autotuning
    # then takes what is left for its candidates' scratch and launches each once; command buffers
    # (CUDA graphs).
    "jax": """
        free, total = ok(d.cuMemGetInfo())
        pool = ok(d.cuMemAlloc(int(free * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))))
        scratch = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))
        mod = first_use()
        ok(d.cuMemFree(scratch))
        s = ok(d.cuStreamCreate(1))
        ok(d.cuGraphLaunch(graph(mod, s), s)); ok(d.cuStreamSynchronize(s))
    """,
    # TensorFlow (allow_growth off): what is free less its reserve for the system (225 MiB under
    # 2 GiB free, else the larger of 300 MiB and 5 %), then cuBLAS and cuDNN loaded at first use.
    "tensorflow": """
        free, total = ok(d.cuMemGetInfo())
        reserve = 225 * 2**20 if free < 2**31 else max(300 * 2**20, free // 20)
        pool = ok(d.cuMemAlloc(free - reserve))
        mod = first_use()
    """,
    # vLLM: gpu_memory_utilization (0.9) of the total less what is in use after profiling for the
    # KV cache, then its CUDA graphs captured (two batch sizes here).
    "vllm": """
        free, total = ok(d.cuMemGetInfo())
        mod = first_use()
        free, total = ok(d.cuMemGetInfo())
        kv = ok(d.cuMemAlloc(int(total * float(os.environ.get("VLLM_GPU_MEMORY_UTILIZATION", "0.9"))) - (total - free)))
        s = ok(d.cuStreamCreate(1))
        for _ in range(2):
            ok(d.cuGraphLaunch(graph(mod, s), s)); ok(d.cuStreamSynchronize(s))
    """,
}

# PyTorch's caching allocator near the limit: 64 MiB blocks until out-of-memory, then 1 MiB ones.
PYTORCH_FILL = """
blocks = []
for size in (64 * 2**20, 2**20):
    while (r := d.cuMemAlloc(size))[0] == E.CUDA_SUCCESS:
        blocks.append(size)
    assert r[0] == E.CUDA_ERROR_OUT_OF_MEMORY, r
"""

# A graph of a cuBLAS-like module used before (USE_FIRST) captured and replayed for a second.
USE_FIRST = "mod = first_use()\n"
GRAPH_LOOP = """
s = ok(d.cuStreamCreate(1))
ex = graph(mod, s)
end = time.monotonic() + 1.2
while time.monotonic() < end:
    ok(d.cuGraphLaunch(ex, s)); ok(d.cuStreamSynchronize(s))
"""

# Then it grows as a framework does when it needs more: 1 MiB at a time until out-of-memory.
TOP_UP = """
time.sleep(1.1)  # two looks of the watchdog
while (r := d.cuMemAlloc(2**20)[0]) == E.CUDA_SUCCESS:
    pass
time.sleep(1.1)
print("alive", r.name, flush=True)
print("charged", charged(), "nvml", nvml_mine(), flush=True)
"""

AFTER = """
time.sleep(1.6)  # three looks of the watchdog
more = d.cuMemAlloc(64 * 2**20)[0]
load = d.cuModuleLoadData(PTX)[0]
print("alive", more.name, load.name, flush=True)
print("charged", charged(), "nvml", nvml_mine(), flush=True)
"""


@pytest.mark.parametrize("fill", sorted(FILLS))
def test_a_framework_filling_what_it_is_told_is_free_ends_in_out_of_memory_never_a_kill(watched, fill):
    """JAX at its defaults was killed on the H100 (NVML 2172649472 bytes, libcgpu 2139145736); on
    main the stand-in's growth kills each of these the same way. Now the driver's growth is charged
    (the watchdog's readings), a process through libcgpu is not killed for it, and when it asks for
    more its allocation is refused with out-of-memory: it lives."""
    inst = name(fill[:3])
    rc, out, err = finish(cgpu_run(watched, inst, "2G", CONTEXT + textwrap.dedent(FILLS[fill]) + TOP_UP))
    log = watched.log_text()
    assert rc == 0, (rc, out, err, log[-3000:])
    lines = out.split("\n")
    assert lines[0].split() == ["alive", "CUDA_ERROR_OUT_OF_MEMORY"], out
    assert "SIGKILL sent" not in log
    # the charge follows what the driver holds (its growth included), whatever the watchdog's allowance:
    # within 1 % of memsize of NVML's figure (a libcgpu that ignores the readings is short by the growth,
    # 66 to 206 MiB here)
    _, held, _, nvml = lines[1].split()
    assert abs(int(held) - int(nvml)) <= 2 * GIB // 100, out


def test_a_graph_loop_after_a_fill_with_a_neighbour_ends_in_out_of_memory(watched):
    """PyTorch capturing and replaying CUDA graphs while a neighbour shares the GPU was killed on the
    H100 (NVML 2308964352, libcgpu 2139095040). Here: a neighbour instance holds 1 GiB; the process
    uses a cuBLAS-like module, fills its 2 GiB as PyTorch's caching allocator does (64 MiB blocks
    until out-of-memory, then 1 MiB ones), captures a graph and replays it for a second. It is not
    killed; what it asks then — an allocation, a module load — is refused with out-of-memory; and
    what it could fill is at least memsize − the context − the first use − 3 % (the headroom)."""
    with neighbour(watched):
        rc, out, err = finish(cgpu_run(watched, name("gr"), "2G", CONTEXT + USE_FIRST + PYTORCH_FILL + GRAPH_LOOP
                                       + 'print("filled", sum(blocks), flush=True)\n' + AFTER))
    log = watched.log_text()
    assert rc == 0, (rc, out, err, log[-3000:])
    lines = out.split("\n")
    assert lines[1].split() == ["alive", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_OUT_OF_MEMORY"], out
    # (the first use's 66 MiB, the stand-in's as the H100's, held before the fill)
    assert int(lines[0].split()[1]) >= 2 * GIB - CONTEXT_MIB * MIB - 66 * MIB - 2 * GIB * 3 // 100
    assert "SIGKILL sent" not in log
    _, held, _, nvml = lines[2].split()
    assert abs(int(held) - int(nvml)) <= 2 * GIB // 100, out


# Six modules of one function of 64 MiB of code each (PTX padded to 64 MiB), loaded before the fill as
# a library is at import; after the fill each is launched: its code goes onto the card at that launch.
NEW_CODE = """
BIG = [(".version 8.0\\n.target sm_75\\n.address_size 64\\n.visible .entry big%d()\\n{\\nret;\\n}\\n" % i).encode()
       for i in range(6)]
BIG = [b + b"/" * (64 * 2**20 - 1 - len(b)) for b in BIG]  # (a comment: 64 MiB of code)
big = [ok(d.cuModuleLoadData(b)) for b in BIG]  # (lazy loading: the code at cuModuleGetFunction, after the fill)
del BIG
"""

NEW_LAUNCHES = """
time.sleep(1.1)  # two looks of the watchdog
peak, results = nvml_mine(), []
for i, m in enumerate(big):
    got = d.cuModuleGetFunction(m, b"big%d" % i)
    results.append(got[0].name if got[0] != E.CUDA_SUCCESS else d.cuLaunchKernel(got[1], 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)[0].name)
    peak = max(peak, nvml_mine())
    time.sleep(0.3)
    peak = max(peak, nvml_mine())
time.sleep(1.1)
print("launched", *results, flush=True)
print("peak", max(peak, nvml_mine()), flush=True)
"""


def test_new_code_after_a_fill_is_refused_at_its_launch_before_nvml_passes_memsize(watched):
    """Issue 34, item 7: a process that fills its 2 GiB instance (PyTorch's way) and then asks for and
    launches six new functions of 64 MiB of code each (lazy loading: the code goes onto the card at
    cuModuleGetFunction, issue 45 item 4) is answered CUDA_ERROR_OUT_OF_MEMORY there, as the real
    driver answers a lazy load that does not fit, before NVML's figure for it passes memsize (+1 %):
    it is never killed. On main the six launches passed, NVML's figure reached memsize + 350 MiB and
    the watchdog killed it."""
    rc, out, err = finish(cgpu_run(watched, name("nc"), "2G", CONTEXT + NEW_CODE + PYTORCH_FILL + NEW_LAUNCHES))
    log = watched.log_text()
    assert rc == 0, (rc, out, err, log[-3000:])
    lines = out.split("\n")
    assert lines[0].split()[0] == "launched" and "CUDA_ERROR_OUT_OF_MEMORY" in lines[0].split(), out
    assert int(lines[1].split()[1]) <= 2 * GIB + 2 * GIB // 100, out
    assert "SIGKILL sent" not in log


def test_a_process_around_the_library_is_still_killed_and_the_log_says_so(watched):
    """A process of the instance that unsets LD_PRELOAD and takes more than memsize is killed as
    before; the log says it went around the library (it has no slot in the instance's page)."""
    inst = name("ar")
    rc, out, err = finish(cgpu_run(watched, inst, "1G", """
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        big = ok(d.cuMemAlloc(3 * 2**29))
        import time; time.sleep(20)
        print("alive")
    """, around=True))
    log = watched.log_text()
    assert rc != 0 and "alive" not in out, (rc, out, err)
    assert f"memory watchdog: {inst} on GPU 0" in log
    assert "went around the library: it has no slot in the instance's page" in log, log[-3000:]


# ---- the stand-in's growth --------------------------------------------------------------------


def test_the_stand_ins_driver_memory_grows_through_no_allocation_call(libs, tmp_path):
    """Without libcgpu: NVML's figure for the process (the stand-in's, read through its v3 call)
    and the card's free memory move together, in the steps this test sets (not the stand-in's
    defaults): LOAD at a module's load; a function's code (LAZY, its share of a small image being
    less) at cuModuleGetFunction (lazy loading: CUDA's Lazy Loading documentation, issue 45 item 4);
    at a library's first launch (a module of 8 functions or more) FIRST_USE, nothing at its second
    launch, LAZY when a second function is asked for; GRAPH at a graph's instantiation; and back
    when the graph and the module go. No allocation is made."""
    from nvml_stub import NvmlStub, StubGpu

    LOAD, LAZY, FIRST_USE, GRAPH = 3, 5, 61, 70  # MiB (the H100: +66 at cuBLAS's first matmul, +70 per graph)
    stub = NvmlStub(libs, tmp_path / "nvml.conf", cuda_state=tmp_path / "card.state")
    stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
    stub.write()
    env = {**stub.env({}), "PATH": os.environ["PATH"], "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
           "CGPU_STUB_LOAD_KIB": str(LOAD << 10), "CGPU_STUB_LAZY_KIB": str(LAZY << 10),
           "CGPU_STUB_FIRST_USE_KIB": str(FIRST_USE << 10), "CGPU_STUB_GRAPH_KIB": str(GRAPH << 10)}
    r = subprocess.run([sys.executable, "-c", PRELUDE + CONTEXT + textwrap.dedent("""
        import ctypes
        nvml = ctypes.CDLL("libnvidia-ml.so.1"); assert nvml.nvmlInit_v2() == 0
        dev = ctypes.c_void_p(); assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0
        class Info(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                        ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
        def seen():
            n, infos = ctypes.c_uint(8), (Info * 8)()
            assert nvml.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(n), infos) == 0
            mine = [infos[k].used >> 20 for k in range(n.value) if infos[k].pid == os.getpid()]
            return (mine or [0])[0], (ok(d.cuMemGetInfo())[1] - ok(d.cuMemGetInfo())[0]) >> 20
        steps = [seen()]
        mod = ok(d.cuModuleLoadData(PTX)); steps.append(seen())
        f = ok(d.cuModuleGetFunction(mod, b"k1")); steps.append(seen())
        ok(d.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)); steps.append(seen())
        ok(d.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)); steps.append(seen())
        s = ok(d.cuStreamCreate(1)); ex = graph(mod, s); steps.append(seen())  # (k0: a new function too)
        ok(d.cuGraphExecDestroy(ex)); steps.append(seen())
        ok(d.cuModuleUnload(mod)); steps.append(seen())
        print(steps)
    """)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    launched = LOAD + LAZY + FIRST_USE
    graphed = launched + LAZY + GRAPH  # (asking for k0 loads it: a second function)
    steps = [0, LOAD, LOAD + LAZY, launched, launched, graphed, graphed - GRAPH, 0]
    assert r.stdout.strip() == str([(n, n) for n in steps])


# ---- the watchdog's rule, on the model with real processes (no daemon) ------------------------


@pytest.fixture
def page_watchdog(tmp_path):
    """A watchdog (kill) over one 1 GiB instance whose usage page is in tmp_path; slot(k, pid,
    held) writes a process slot as libcgpu would; sleepers are killed at the end."""
    from cgpud.core.model import GpuInfo, Node
    from cgpud.gpus import pages
    from cgpud.gpus.memwatch import MemWatchdog

    where = tmp_path / "pages"
    pages.create(os.fspath(where), [GIB])
    node = Node([GpuInfo(0, "GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab", "Tesla T4", 15 * GIB)])
    inst = node.create_instance(0, "instanceaaaa", memsize=GIB)
    made: list[subprocess.Popen] = []
    wd = MemWatchdog(node, lambda pid, gpu: inst if any(p.pid == pid for p in made) else None,
                     page=lambda i: (os.fspath(where), 0))

    def slot(k: int, pid: int, held: int) -> None:
        with open(where / "usage", "r+b") as f:
            f.seek(pages.USAGE_HEAD.size + k * pages.PROC.size)
            f.write(pages.PROC.pack(pid, 0, 0, 0, held, *[0] * (pages.MAX_GPUS - 1)))

    def sleeper() -> int:
        made.append(subprocess.Popen(["sleep", "60"]))
        return made[-1].pid
    yield wd, slot, sleeper, made, where
    for p in made:
        p.kill()
        p.wait()


def _look(procs: dict[int, int]):
    from cgpud.gpus.nvml import GpuSample

    return [GpuSample(0, procs, sum(procs.values()), 15 * GIB, 0, 0)]


def test_the_watchdog_tells_the_drivers_growth_from_memory_around_the_library(page_watchdog, caplog):
    """Past memsize, a process with a slot whose NVML figure passes what libcgpu charges it by no
    more than the growth allowance (256 MiB here) is left running, its reading written into its
    slot (NVML's figure, what it had allocated); one without a slot, or past the allowance, is
    killed, and the log says which it was."""
    from cgpud.gpus import pages

    wd, slot, sleeper, made, where = page_watchdog
    lib, around, greedy = sleeper(), sleeper(), sleeper()
    slot(0, lib, 900 * MIB)
    slot(1, greedy, 50 * MIB)
    # the driver's growth: 150 MiB past libcgpu's 900 (the instance at 1050 MiB of 1024)
    assert wd.check(_look({lib: 1050 * MIB})) == []
    assert made[0].poll() is None
    assert "went through libcgpu: NVML says 1101004800 bytes, libcgpu charges 943718400" in caplog.text
    slots, readings = pages.slots(os.fspath(where))
    with open(where / "usage", "rb") as f:
        raw = f.read()
    record = pages.DRIVER.unpack_from(raw, pages.DRIVER_OFFSET)
    assert readings and record[0] % 2 == 0 and record[1] == lib
    assert record[2] == 1050 * MIB and record[2 + pages.MAX_GPUS] == 900 * MIB
    # libcgpu has charged it (its slot holds all NVML sees): still past memsize, still left running
    slot(0, lib, 1050 * MIB)
    assert wd.check(_look({lib: 1050 * MIB})) == [] and made[0].poll() is None
    # a process without a slot takes 200 MiB more: it is failed, not the one through libcgpu
    assert wd.check(_look({lib: 1050 * MIB, around: 200 * MIB})) == [(0, "instanceaaaa", around)]
    assert made[1].wait(5) == -signal.SIGKILL and made[0].poll() is None
    assert "it went around the library: it has no slot in the instance's page" in caplog.text
    # one with a slot 300 MiB past what libcgpu charges it: more than the allowance
    assert wd.check(_look({lib: 1050 * MIB, greedy: 350 * MIB})) == [(0, "instanceaaaa", greedy)]
    assert made[2].wait(5) == -signal.SIGKILL and made[0].poll() is None
    assert "libcgpu charges it 52428800, 314572800 bytes less, more than the driver's growth allowance" in caplog.text


def test_a_page_that_lies_buys_no_more_than_the_allowance(page_watchdog):
    """The page is the container's to write: slots that claim more than NVML sees (held 4 GiB), or
    one written for a process that went around the library, buy the instance at most the
    allowance (256 MiB) past memsize before a process is failed."""
    wd, slot, sleeper, made, where = page_watchdog
    liar, faker = sleeper(), sleeper()
    slot(0, liar, 4 * GIB)
    slot(1, faker, GIB)
    assert wd.check(_look({liar: 900 * MIB})) == []  # (under memsize)
    assert wd.check(_look({liar: 900 * MIB, faker: GIB + 200 * MIB})) == [(0, "instanceaaaa", faker)]
    assert made[1].wait(5) == -signal.SIGKILL and made[0].poll() is None
    assert wd.check(_look({liar: GIB + 200 * MIB})) == []  # (within the allowance: tolerated)
    assert wd.check(_look({liar: GIB + 300 * MIB})) == [(0, "instanceaaaa", liar)]
    assert made[0].wait(5) == -signal.SIGKILL


def test_a_free_that_nvml_shows_late_does_not_make_a_process_look_around_the_library(page_watchdog):
    """NVML's per-process figure comes a little after the call that changed it: a process through
    libcgpu that frees 500 MiB just before a look is refunded in its slot (500 MiB left) while NVML
    still shows the 1000 MiB it held, plus 100 MiB of the driver's growth — past a 1 GiB memsize.
    It is judged by the larger of its charge now and at the previous look (1000 MiB): within the
    allowance, left running. On main it was judged by 500 MiB: 600 MiB "around the library",
    killed."""
    wd, slot, sleeper, made, where = page_watchdog
    lib = sleeper()
    slot(0, lib, 1000 * MIB)
    assert wd.check(_look({lib: 1000 * MIB})) == []
    slot(0, lib, 500 * MIB)
    assert wd.check(_look({lib: 1100 * MIB})) == []
    assert made[0].poll() is None
    # a look later NVML has caught up with the free: nothing past memsize
    assert wd.check(_look({lib: 600 * MIB})) == []


def test_a_librarys_first_launch_after_a_fill_is_refused_before_the_card_passes_memsize(libs, tmp_path):
    """A process fills what a watched 2 GiB instance calls free, then launches a cuBLAS-like module's
    first kernel (the stand-in, as the H100, takes 66 MiB at it): the launch is refused with
    out-of-memory and the card holds no more than memsize for it (on main the launch passed with 2 MiB
    foreseen and the card held 2096 MiB: NVML's figure 48 MiB past memsize, left to the watchdog's
    allowance). With the fill freed the same launch passes, the 64 MiB it took charged at once (its
    kernel's 2 MiB of code went at cuModuleGetFunction, before the fill: lazy loading)."""
    from cgpud.gpus import pages

    where = tmp_path / "pages"
    pages.create(os.fspath(where), [2 * GIB])
    pages.mark_watched(os.fspath(where))  # (a watchdog reads NVML for it: the growth is charged at once)
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"), "CGPU_STUB_CUDA_MIB": "16384",
           "CGPU_PAGE_DIR": os.fspath(where), "PATH": os.environ["PATH"]}
    code = PRELUDE + textwrap.dedent("""
        import os
        E = d.CUresult
        card = lambda: int.from_bytes(open(os.environ["CGPU_STUB_CUDA_STATE"], "rb").read(8), "little")
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        PTX = (".version 8.0\\n.target sm_75\\n.address_size 64\\n"
               + "".join(f".visible .entry k{i}()\\n{{\\nret;\\n}}\\n" for i in range(33))).encode()
        k1 = ok(d.cuModuleGetFunction(ok(d.cuModuleLoadData(PTX)), b"k1"))
        fill = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))
        r = d.cuLaunchKernel(k1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)[0]
        print(r.name, card(), flush=True)
        ok(d.cuMemFree(fill))
        before, on_card = ok(d.cuMemGetInfo())[0], card()
        r = d.cuLaunchKernel(k1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)[0]
        ok(d.cuCtxSynchronize())
        print(r.name, card() - on_card, before - ok(d.cuMemGetInfo())[0], flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    refused, grown = r.stdout.split("\n")[:2]
    assert refused.split()[0] == "CUDA_ERROR_OUT_OF_MEMORY", r.stdout
    assert int(refused.split()[1]) <= 2 * GIB, "the card holds more than memsize for it"
    name_, card_grew, charged = grown.split()
    assert name_ == "CUDA_SUCCESS" and int(card_grew) == 64 * MIB, r.stdout
    assert int(charged) >= 64 * MIB, "the first use is charged at once"


def lazy_env(libs, tmp_path, **more) -> dict:
    """A watched 2 GiB instance's page (its growth charged at once) on a 16 GiB stand-in card."""
    from cgpud.gpus import pages

    where = tmp_path / "pages"
    pages.create(os.fspath(where), [2 * GIB])
    pages.mark_watched(os.fspath(where))
    return {"LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"), "CGPU_STUB_CUDA_MIB": "16384",
            "CGPU_PAGE_DIR": os.fspath(where), "PATH": os.environ["PATH"], **more}


LAZY_PRELUDE = PRELUDE + """
import os
E = d.CUresult
card = lambda: int.from_bytes(open(os.environ["CGPU_STUB_CUDA_STATE"], "rb").read(8), "little")
ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
def one(name, size=0):
    # a module of one function (size: its image's bytes, a comment making it up)
    b = (".version 8.0\\n.target sm_75\\n.address_size 64\\n.visible .entry %s()\\n{\\nret;\\n}\\n" % name).encode()
    return ok(d.cuModuleLoadData(b + b"/" * max(0, size - 1 - len(b))))
"""


def test_lazy_loading_after_a_fill_is_refused_at_get_function_and_unload_forgets(libs, tmp_path):
    """Issue 45, item 4: with lazy loading a function's code goes onto the card at cuModuleGetFunction
    (CUDA's Lazy Loading documentation). A process fills what its watched 2 GiB instance calls free,
    then asks for a function of 64 MiB of code: out-of-memory there, the card holding no more than
    memsize (on main cuModuleGetFunction was not wrapped: the card went 64 MiB past it, and the
    first-use check at the launch found the code loaded). Freed, it is given; a module unloaded and
    another loaded (Triton and torch.compile do so all day) is looked at afresh."""
    code = LAZY_PRELUDE + textwrap.dedent("""
        big = one("big", 64 * 2**20)
        fill = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))
        r = d.cuModuleGetFunction(big, b"big")[0]
        print(r.name, card(), flush=True)
        ok(d.cuMemFree(fill))
        f = ok(d.cuModuleGetFunction(big, b"big")); ok(d.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
        ok(d.cuCtxSynchronize()); ok(d.cuModuleUnload(big))
        again = one("big", 64 * 2**20)  # (the driver may give it the unloaded one's handle)
        fill = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))
        print(d.cuModuleGetFunction(again, b"big")[0].name, card(), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=lazy_env(libs, tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, again = (line.split() for line in r.stdout.split("\n")[:2])
    assert first[0] == "CUDA_ERROR_OUT_OF_MEMORY" and int(first[1]) <= 2 * GIB, r.stdout
    assert again[0] == "CUDA_ERROR_OUT_OF_MEMORY" and int(again[1]) <= 2 * GIB, r.stdout


def test_growth_of_any_modules_shape_after_a_fill_ends_in_out_of_memory(libs, tmp_path):
    """Issue 45, item 15: on a stand-in whose every module's first launch grows the card by 64 MiB
    (CGPU_STUB_LIBRARY_FUNCTIONS=1: one-function modules, not the 8 of libcgpu's library rule), a
    process asks for six one-function kernels, fills what its watched 2 GiB instance calls free, and
    launches them. The first growth is nobody's to foresee: it passes, is measured and charged at
    once; every later first launch must find room for that step, and is refused with out-of-memory,
    as is the next allocation. The card passes memsize by at most that one step (within the
    watchdog's allowance for a process that went through libcgpu: no kill); on main the six launches
    passed and the card held memsize + 6 x 64 MiB (the watchdog's kill)."""
    code = LAZY_PRELUDE + textwrap.dedent("""
        fs = [ok(d.cuModuleGetFunction(one("k%d" % i), b"k%d" % i)) for i in range(6)]
        fill = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))
        results = [d.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)[0].name for f in fs]
        print(*results, flush=True)
        print(d.cuMemAlloc(2**20)[0].name, card(), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=lazy_env(libs, tmp_path, CGPU_STUB_LIBRARY_FUNCTIONS="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    launched, after = (line.split() for line in r.stdout.split("\n")[:2])
    assert launched == ["CUDA_SUCCESS"] + ["CUDA_ERROR_OUT_OF_MEMORY"] * 5, r.stdout
    assert after[0] == "CUDA_ERROR_OUT_OF_MEMORY" and int(after[1]) <= 2 * GIB + 64 * MIB, r.stdout


def test_a_raised_stack_limit_after_a_fill_is_refused_not_killed(libs, tmp_path):
    """Issue 45, item 5: CU_LIMIT_STACK_SIZE is each GPU thread's stack, and the driver backs every
    resident thread's (the stand-in's T4: 40 x 1024 threads, 40 MiB per KiB; an H100 264 MiB). A
    process fills what its watched 2 GiB instance calls free and raises the stack from 1 to 8 KiB:
    cuCtxSetLimit answers out-of-memory, the limit and the card unchanged (on main it was not
    wrapped: the card took 280 MiB past memsize, the watchdog's kill). Freed, the same call passes,
    its 280 MiB charged at once; the printf FIFO and malloc heap are charged their sizes."""
    code = LAZY_PRELUDE + textwrap.dedent("""
        L = d.CUlimit
        charged = lambda: ok(d.cuMemGetInfo())[0]
        fill = ok(d.cuMemAlloc(ok(d.cuMemGetInfo())[0]))
        r = d.cuCtxSetLimit(L.CU_LIMIT_STACK_SIZE, 8192)[0]
        print(r.name, ok(d.cuCtxGetLimit(L.CU_LIMIT_STACK_SIZE)), card(), flush=True)
        ok(d.cuMemFree(fill))
        before, on_card = charged(), card()
        ok(d.cuCtxSetLimit(L.CU_LIMIT_STACK_SIZE, 8192))
        print(card() - on_card, before - charged(), flush=True)
        before = charged()
        ok(d.cuCtxSetLimit(L.CU_LIMIT_MALLOC_HEAP_SIZE, 8 * 2**20 + 64 * 2**20))
        print(before - charged(), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=lazy_env(libs, tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    refused, raised, heap = (line.split() for line in r.stdout.split("\n")[:3])
    assert refused[:2] == ["CUDA_ERROR_OUT_OF_MEMORY", "1024"] and int(refused[2]) <= 2 * GIB, r.stdout
    assert raised == [str(280 * MIB), str(280 * MIB)], r.stdout
    assert heap == [str(64 * MIB)], r.stdout
