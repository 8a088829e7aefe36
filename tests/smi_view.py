"""What `nvidia-smi` reads, through NVIDIA's nvidia-ml-py, as a scene of a container and its
neighbours on one stand-in card (tests/test_nvml_view.py and bench/nvml_view.py share it).

`VIEW` is the reader: the NVML calls nvidia-smi makes for its default screen (device count, name,
memory info, utilisation rates, fan, temperature, performance state, power draw, compute and
graphics processes), for
`--query-gpu=memory.total,memory.used,utilization.gpu` and `--query-compute-apps=pid,used_memory`,
and the other process and utilisation calls a monitor makes (MPS processes, every version of the
lists, R550's detail list, the per-process utilisation samples of both forms, the video engines'
utilisation, the SM clock and the energy counter), then
cuMemGetInfo as a CUDA program in the same container sees it. It prints one JSON object: value
name -> value (an NVML error as "error: <name>"; sample timestamps are left out: they are the
clock's, not anyone's usage).

`Scene` holds the rest: the stand-in libcuda.so.1 (one card shared through its state file) and
NVML (native/stubs; it lists every process the card's state file says holds memory, as the
driver does), a container's pages (cgpud.gpus.pages) and processes of its own holding memory
through libcgpu, and neighbours: processes that are not the container's (live ones, in the same
PID namespace, as under `cgpu run` or hostPID) holding memory on the card, listed as compute,
graphics and MPS processes, with utilisation samples, and the card's own rates.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from cgpud.gpus import pages
from nvml_stub import MIB, NvmlStub, StubGpu

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
CARD_MIB = 15360  # a T4 as NVML says it

VIEW = textwrap.dedent(r"""
    import ctypes, json, sys
    import pynvml as N
    out = {}
    def put(key, fn, *args):
        try:
            out[key] = fn(*args)
        except N.NVMLError as e:
            out[key] = "error: " + str(e)
    def procs(ps):
        return sorted([p.pid, p.usedGpuMemory] for p in ps)
    class V1(ctypes.Structure):  # nvmlProcessInfo_v1_t: what the unversioned calls fill
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
    def v1(name, h):
        fn = N._nvmlGetFunctionPointer(name)
        n = ctypes.c_uint(0)
        r = fn(h, ctypes.byref(n), None)
        if r == N.NVML_SUCCESS:
            return []
        if r != N.NVML_ERROR_INSUFFICIENT_SIZE:
            raise N.NVMLError(r)
        buf = (V1 * n.value)()
        N._nvmlCheckReturn(fn(h, ctypes.byref(n), buf))
        return sorted([buf[k].pid, buf[k].usedGpuMemory] for k in range(n.value))
    N.nvmlInit()
    n = N.nvmlDeviceGetCount()
    out["count"] = n
    for i in range(n):
        h = N.nvmlDeviceGetHandleByIndex(i)
        g = f"gpu{i}."
        put(g + "name", N.nvmlDeviceGetName, h)
        m = N.nvmlDeviceGetMemoryInfo(h)
        out[g + "memory.total"], out[g + "memory.used"], out[g + "memory.free"] = m.total, m.used, m.free
        m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
        out[g + "memory_v2"] = [m2.total, m2.reserved, m2.used, m2.free]
        put(g + "utilization.gpu", lambda: N.nvmlDeviceGetUtilizationRates(h).gpu)
        put(g + "utilization.memory", lambda: N.nvmlDeviceGetUtilizationRates(h).memory)
        put(g + "utilization.encoder", lambda: N.nvmlDeviceGetEncoderUtilization(h)[0])
        put(g + "utilization.decoder", lambda: N.nvmlDeviceGetDecoderUtilization(h)[0])
        # the default screen's Fan, Temp, Perf, Pwr:Usage; --query-gpu's clocks.sm, energy
        put(g + "fan.speed", N.nvmlDeviceGetFanSpeed, h)
        put(g + "temperature.gpu", N.nvmlDeviceGetTemperature, h, N.NVML_TEMPERATURE_GPU)
        put(g + "pstate", N.nvmlDeviceGetPerformanceState, h)
        put(g + "power.draw", N.nvmlDeviceGetPowerUsage, h)
        put(g + "clocks.sm", N.nvmlDeviceGetClockInfo, h, N.NVML_CLOCK_SM)
        put(g + "total_energy_consumption", N.nvmlDeviceGetTotalEnergyConsumption, h)
        for kind in ("Compute", "Graphics", "MPSCompute"):
            fn = f"nvmlDeviceGet{kind}RunningProcesses"
            put(g + fn, v1, fn, h)
            put(g + fn + "_v2", lambda: procs(getattr(N, fn + "_v2")(h)))
            put(g + fn + "_v3", lambda: procs(getattr(N, fn + "_v3")(h)))
        for mode in (0, 1, 2):
            put(g + f"detail{mode}", lambda: procs(N.nvmlDeviceGetRunningProcessDetailList(h, N.nvmlProcessDetailList_v1, mode)))
        put(g + "process_utilization",
            lambda: sorted([s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil] for s in N.nvmlDeviceGetProcessUtilization(h, 0)))
        put(g + "processes_utilization_info",
            lambda: sorted([s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil, s.jpgUtil, s.ofaUtil]
                           for s in N.nvmlDeviceGetProcessesUtilizationInfo(h, 0)))
    N.nvmlShutdown()
    from cuda.bindings import driver as d
    assert d.cuInit(0)[0] == 0
    r, dev = d.cuDeviceGet(0)
    r, ctx = d.cuDevicePrimaryCtxRetain(dev)
    d.cuCtxSetCurrent(ctx)
    r, free, total = d.cuMemGetInfo()
    out["cuMemGetInfo"] = [int(free), int(total)] if r == 0 else "error: " + str(r)
    print(json.dumps(out))
""")

# A process holding GPU memory: `alloc <bytes>` allocates (answers "ok <pid>"), EOF ends it.
HOLDER = textwrap.dedent(r"""
    import os, sys
    from cuda.bindings import driver as d
    assert d.cuInit(0)[0] == 0
    r, dev = d.cuDeviceGet(0)
    r, ctx = d.cuDevicePrimaryCtxRetain(dev)
    d.cuCtxSetCurrent(ctx)
    for line in sys.stdin:
        r, p = d.cuMemAlloc(int(line.split()[1]))
        print("ok" if r == 0 else f"failed {r}", os.getpid(), flush=True)
""")


def query_gpu(view: dict, i: int = 0) -> list:
    """nvidia-smi --query-gpu=memory.total,memory.used,utilization.gpu (MiB, MiB, %)."""
    g = f"gpu{i}."
    return [view[g + "memory.total"] // MIB, view[g + "memory.used"] // MIB, view[g + "utilization.gpu"]]


def query_compute_apps(view: dict, i: int = 0) -> list:
    """nvidia-smi --query-compute-apps=pid,used_memory (pid, MiB)."""
    return [[pid, used // MIB] for pid, used in view[f"gpu{i}.nvmlDeviceGetComputeRunningProcesses_v3"]]


class Scene:
    """A container (its pages at `pages`, memsize `memsize`) and its neighbours on one card."""

    def __init__(self, libs: Path, where: Path, memsize: int = 4 * GIB):
        self.libs, self.where, self.memsize = libs, where, memsize
        self.stub = NvmlStub(libs, where / "nvml.conf", cuda_state=where / "card.state")
        self.stub.gpus = [StubGpu("GPU-5e4b1c2a-0000-4000-8000-0000000000a1", "Tesla T4", CARD_MIB * MIB)]
        self.stub.write()
        self.pages = where / "pages"
        pages.create(os.fspath(self.pages), [memsize])
        self.procs: list[subprocess.Popen] = []

    def env(self, contained: bool) -> dict:
        env = self.stub.env({"PATH": os.environ["PATH"]})
        env.update(CGPU_STUB_CUDA_STATE=os.fspath(self.where / "card.state"), CGPU_STUB_CUDA_MIB=str(CARD_MIB),
                   CGPU_REAL_LIBNVML=os.fspath(self.libs / "libnvidia-ml.so.1"))
        env["LD_LIBRARY_PATH"] = os.fspath(self.libs)
        if contained:
            env.update(LD_PRELOAD=os.fspath(self.libs / "libcgpu.so"), CGPU_PAGE_DIR=os.fspath(self.pages))
        return env

    def holder(self, contained: bool, **env) -> subprocess.Popen:
        """A process holding memory on the card (`alloc` it), the container's or a neighbour's."""
        p = subprocess.Popen([sys.executable, "-c", HOLDER], env={**self.env(contained), **env},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def alloc(self, p: subprocess.Popen, n: int) -> None:
        p.stdin.write(f"alloc {n}\n")
        p.stdin.flush()
        answer = p.stdout.readline().split()
        assert answer and answer[0] == "ok", answer

    def idle(self) -> int:
        """A live process that is not the container's (no slot in its page): a neighbour's pid."""
        p = subprocess.Popen(["sleep", "600"])
        self.procs.append(p)
        return p.pid

    def view(self, contained: bool = True) -> dict:
        r = subprocess.run([sys.executable, "-c", VIEW], env=self.env(contained), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
            if p.poll() is None:
                p.kill()
            p.wait(10)
