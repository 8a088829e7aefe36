"""bench/fills: fills that end in out-of-memory, never a kill, each near memsize (issue 45, items 3, 4,
5, 15; docs/memory.md).

The daemon runs with `--gpus nvml` on the tests' stand-in libnvidia-ml.so.1 and libcuda (native/stubs:
pools in segments of 2 MiB granules, lazy loading at cuModuleGetFunction, local memory at
cuCtxSetLimit, contexts of 500 MiB, a 10 GiB card, NVML 50 ms late), libcgpu for `cgpu run`, the
memory watchdog killing past memsize. Each fill runs in a 2 GiB instance through libcgpu now and,
in the same run, through the libcgpu of main before this work (BEFORE, built from git; fill 4: GRAPH_BEFORE):

1. a fragmented pool: the release threshold at its highest (PyTorch's cudaMallocAsync backend),
   64 MiB blocks until out-of-memory, every other one freed, then 128 MiB blocks and 2 MiB blocks
   until out-of-memory;
2. a raised stack limit: 64 MiB and 2 MiB blocks until out-of-memory, 256 MiB of them freed, then the
   stack raised from 1 KiB by 1 KiB at a time (40 MiB each on the stand-in's T4) until refused;
3. 200 lazily loaded modules of one function after a fill (64 MiB and 2 MiB blocks until
   out-of-memory, 256 MiB of them freed), on a stand-in whose every module's first launch grows the
   card 64 MiB (a shape libcgpu's library rule does not know): each loaded, its function asked for
   and launched, until out-of-memory at any call;
4. graph memory at first replay (item 6): PyTorch's cudaMallocAsync backend under CUDA graphs — 1 GiB of
   eager tensors from the pool (its threshold at its highest), then graphs each captured with five
   128 MiB allocations, then with two of 16 MiB (cuMemAllocAsync into the capture: allocation nodes), instantiated with
   CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, replayed once and kept, until out-of-memory at the
   instantiation or the launch (the stand-in maps a graph's memory at its first launch; each
   executable graph's own 70 MiB is left out, CGPU_STUB_GRAPH_KIB=0: the driver's growth of fill 3's kind).

For each: killed (goal no), NVML's peak for the process against memsize, and NVML's figure at the
out-of-memory that ended it and what the refused call asked for (goal: within 3 % of memsize, none where the
request would have fitted below 97 %).

    .venv/bin/python bench/fills.py [WORD]     (WORD: only the fills whose name has it)
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from common import daemon  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402
from pools import START, build_before, killed, through  # noqa: E402
from test_growth import CONTEXT_MIB, NVML_LAG_MS, cgpu_run, finish, name  # noqa: E402
from test_libcgpu import build_libs  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
BEFORE = "555a060"  # main when issue 45's memory work started
GRAPH_BEFORE = "ac2da6b"  # main before graph memory was charged (fill 4's reference)
MEMSIZE = 2 * GIB

NVML = """
import ctypes, os
_nvml = ctypes.CDLL("libnvidia-ml.so.1"); assert _nvml.nvmlInit_v2() == 0
_hdev = ctypes.c_void_p(); assert _nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(_hdev)) == 0
class _Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
def nvml_mine():
    n, infos = ctypes.c_uint(8), (_Info * 8)()
    assert _nvml.nvmlDeviceGetComputeRunningProcesses_v3(_hdev, ctypes.byref(n), infos) == 0
    return sum(infos[k].used for k in range(n.value) if infos[k].pid == os.getpid())
import time
OK, OOM = d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
peak, end_oom, asked = 0, None, 0
def seen(r, ask=0):
    # r: a call's answer (ask: the bytes it asked for); NVML's figure noted at the out-of-memory
    # that ended the fill (with what was asked), and its peak
    global peak, end_oom, asked
    time.sleep(NVML_LAG)
    now = nvml_mine()
    peak = max(peak, now)
    if r == OOM:  # (the last one: what ended the fill)
        end_oom, asked = now, ask
    return r
def fill_less_256():
    # 64 MiB and 2 MiB blocks until out-of-memory (PyTorch's caching allocator), 256 MiB of them freed
    blocks = []
    for size in (64 * 2**20, 2 * 2**20):
        while seen((r := d.cuMemAlloc(size))[0], size) == OK:
            blocks.append(r[1])
    for b in blocks[:4]:
        ok(d.cuMemFree(b))
def report():
    time.sleep(1.1)  # two looks of the watchdog
    seen(None)
    print("result", peak, end_oom, asked, flush=True)
""".replace("NVML_LAG", str(2 * NVML_LAG_MS / 1000))

FILLS = {
    "fragmented pool": """
        s = ok(d.cuStreamCreate(1)); pool = ok(d.cuDeviceGetMemPool(ok(d.cuDeviceGet(0))))
        ok(d.cuMemPoolSetAttribute(pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(2**64 - 1)))
        blocks = []
        while seen((r := d.cuMemAllocAsync(64 * 2**20, s))[0], 64 * 2**20) == OK:
            blocks.append(r[1])
        for b in blocks[::2]:
            ok(d.cuMemFreeAsync(b, s))
        ok(d.cuStreamSynchronize(s))
        for size in (128 * 2**20, 2 * 2**20):
            while seen(d.cuMemAllocAsync(size, s)[0], size) == OK:
                pass
        report()
    """,
    "stack limit raised": """
        fill_less_256()
        stack = 1024
        while seen(d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE, stack + 1024)[0], 40 * 2**20) == OK:
            stack += 1024
        report()
    """,
    "200 lazily loaded modules after a fill": """
        import os
        os.environ["CGPU_STUB_LIBRARY_FUNCTIONS"] = "1"  # (every module's first launch: +64 MiB, the stand-in's FIRST_USE)
        fill_less_256()
        for i in range(200):
            ptx = (".version 8.0\\n.target sm_75\\n.address_size 64\\n.visible .entry k%d()\\n{\\nret;\\n}\\n" % i).encode()
            r = d.cuModuleLoadData(ptx)
            if seen(r[0], 2 * 2**20) != OK: break
            f = d.cuModuleGetFunction(r[1], b"k%d" % i)
            if seen(f[0], 2 * 2**20) != OK: break
            if seen(d.cuLaunchKernel(f[1], 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)[0], 64 * 2**20) != OK: break
        report()
    """,
    "graph memory at first replay": """
        import os
        os.environ["CGPU_STUB_GRAPH_KIB"] = "0"  # (the graph memory alone, above)
        s = ok(d.cuStreamCreate(1)); pool = ok(d.cuDeviceGetMemPool(ok(d.cuDeviceGet(0))))
        ok(d.cuMemPoolSetAttribute(pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(2**64 - 1)))
        eager = [ok(d.cuMemAllocAsync(64 * 2**20, s)) for _ in range(16)]
        ok(d.cuStreamSynchronize(s))
        graphs = []
        for n, each in ((5, 128 * 2**20), (2, 16 * 2**20)):  # (graphs of 640 MiB until refused, then of 32 MiB)
            while True:
                ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
                got = [d.cuMemAllocAsync(each, s)[0] for _ in range(n)]
                ok(d.cuLaunchKernel(d.CUfunction(), 100, 1, 1, 1, 1, 1, 0, s, 0, 0))
                g = ok(d.cuStreamEndCapture(s))
                if seen(max(got), n * each) != OK: break  # (main's pools refused at the capture)
                r = d.cuGraphInstantiate(g, d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                if seen(r[0], n * each) != OK: break
                if seen(d.cuGraphLaunch(r[1], s)[0], n * each) != OK: break
                ok(d.cuStreamSynchronize(s))
                graphs.append(r[1])
        report()
    """,
}


def fill(run, lib: str | None, code: str) -> str:
    import textwrap

    rc, out, err = finish(cgpu_run(run, name("fl"), "2G", NVML + START + textwrap.dedent(code), first=through(lib)),
                          timeout=180)
    line = next((x.split() for x in out.split("\n") if x.startswith("result")), None)
    if killed(rc):
        return "killed"
    if not line:
        return f"failed rc {rc}: {err.strip()[-300:]}"
    peak, end, ask = int(line[1]), None if line[2] == "None" else int(line[2]), int(line[3])
    at = (f"{end >> 20} MiB ({100 * end / MEMSIZE:.1f} %), asking {ask >> 20} MiB more (to "
          f"{100 * (end + ask) / MEMSIZE:.1f} %)" if end is not None else "none")
    return f"killed no   peak {peak >> 20} MiB ({100 * peak / MEMSIZE:.1f} %)   ended in out-of-memory at {at}"


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="cgpud-fills-") as tmp:
        tmp = Path(tmp)
        libs = build_libs(tmp / "libs")
        old = {BEFORE: build_before(tmp / "before", BEFORE)}
        stub = NvmlStub(libs, tmp / "nvml.conf", cuda_state=tmp / "card.state")
        stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
        stub.write()
        os.environ.update({**stub.env({}), "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card.state"),
                           "CGPU_STUB_CTX_MIB": str(CONTEXT_MIB), "CGPU_STUB_CUDA_MIB": "10240",
                           "CGPU_STUB_NVML_LAG_MS": str(NVML_LAG_MS)})
        with daemon("nvml", ["--libcgpu", os.fspath(libs / "libcgpu.so")], handle=True, devices=("nvidia0",)) as run:
            print(f"fills in a {MEMSIZE >> 20} MiB instance, contexts {CONTEXT_MIB} MiB (goal: killed no; the "
                  f"out-of-memory within 3 % of memsize, >= {MEMSIZE * 97 // 100 >> 20} MiB)")
            for k, (what, code) in enumerate(FILLS.items(), 1):
                if sys.argv[1:] and sys.argv[1] not in what:
                    continue
                print(f"{k}. {what}")
                was = GRAPH_BEFORE if what.startswith("graph") else BEFORE
                if was not in old:
                    old[was] = build_before(tmp / ("before-" + was), was)
                for label, lib in (("now", None), (f"at {was}", old[was])):
                    print(f"   {label:10} {fill(run, lib, code)}", flush=True)


if __name__ == "__main__":
    main()
