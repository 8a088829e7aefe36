"""Stream-ordered memory pools (issue 34, item 2; docs/memory.md, "Stream-ordered pools").

A pool keeps the physical memory it reserved up to its release threshold after cuMemFreeAsync (the
driver's default threshold is 0: it gives everything back at the next synchronization; RMM's async
resource sets it to the device's memory and primes the pool with free/2; PyTorch's cudaMallocAsync
backend raises it). The stand-in libcuda's pools (native/stubs/cuda_pools.c) do that, in the card's
2 MiB pages, and NVML's per-process figure shows what they reserve; libcgpu charges a pool by its
reservation. Expected figures are worked out here from the sizes asked and 2 MiB pages."""
from __future__ import annotations

import json
import os

import textwrap

import pytest

from cgpud.gpus import pages
from test_libcgpu import ROOT, build_libs, py

MIB = 1 << 20


def run(env: dict, *parts: str):
    """A cuda-bindings program of `parts`, each dedented on its own."""
    return py(env, "".join(textwrap.dedent(p) for p in parts))


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build_libs(tmp_path_factory.mktemp("pools"))


@pytest.fixture
def card(libs, tmp_path):
    """A 16 GiB stand-in card of this test's own, its NVML (per-process figures from the card's
    records), and a container's page directory."""
    from nvml_stub import NvmlStub, StubGpu

    stub = NvmlStub(libs, tmp_path / "nvml.conf", cuda_state=tmp_path / "card.state")
    stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
    stub.write()
    env = {**stub.env({}), "PATH": os.environ["PATH"], "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
           "CGPU_STUB_CUDA_MIB": "16384", "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"),
           "LD_PRELOAD": os.fspath(libs / "libcgpu.so")}
    return env, tmp_path / "pages", libs


SEEN = """
import ctypes, os
nvml = ctypes.CDLL("libnvidia-ml.so.1"); assert nvml.nvmlInit_v2() == 0
hdev = ctypes.c_void_p(); assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(hdev)) == 0
class Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
def nvml_mine():
    n, infos = ctypes.c_uint(8), (Info * 8)()
    assert nvml.nvmlDeviceGetComputeRunningProcesses_v3(hdev, ctypes.byref(n), infos) == 0
    return sum(infos[k].used for k in range(n.value) if infos[k].pid == os.getpid())
def on_card():
    with open(os.environ["CGPU_STUB_CUDA_STATE"], "rb") as f:
        return int.from_bytes(f.read(8), "little")
A = d.CUmemPool_attribute
def attr(pool, a):
    return int(ok(d.cuMemPoolGetAttribute(pool, getattr(A, "CU_MEMPOOL_ATTR_" + a))))
def set_threshold(pool, n):
    ok(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(n)))
"""


def test_the_stand_ins_pools_keep_their_memory_up_to_the_release_threshold(card):
    """Without libcgpu: an allocation of 5 MiB + 1 from the default pool reserves 3 pages (6 MiB) of
    the card; after its cuMemFreeAsync the pool (and the card, and NVML's per-process figure) keeps
    them until a synchronization (threshold 0). With the threshold raised (RMM, PyTorch) it keeps them
    through synchronizations, reuses them (an allocation that fits takes nothing more from the card),
    and cuMemPoolTrimTo gives back what is unused down to what it is asked to keep."""
    env, _, libs = card
    env = {k: v for k, v in env.items() if k not in ("CGPU_PAGE_DIR", "LD_PRELOAD")}
    r = run(env, SEEN, """
        ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
        s = ok(d.cuStreamCreate(1)); pool = ok(d.cuDeviceGetMemPool(dev))
        def look():
            return [attr(pool, "RESERVED_MEM_CURRENT"), attr(pool, "USED_MEM_CURRENT"), on_card(), nvml_mine()]
        out = {}
        p = ok(d.cuMemAllocAsync(5 * 2**20 + 1, s)); out["allocated"] = look()
        ok(d.cuMemFreeAsync(p, s)); out["freed"] = look()
        ok(d.cuStreamSynchronize(s)); out["synchronized"] = look()
        set_threshold(pool, 2**63)
        p = ok(d.cuMemAllocAsync(40 * 2**20, s)); ok(d.cuMemFreeAsync(p, s)); ok(d.cuStreamSynchronize(s))
        out["kept"] = look()
        p = ok(d.cuMemAllocAsync(30 * 2**20, s)); out["reused"] = look()
        ok(d.cuMemPoolTrimTo(pool, 0)); out["trimmed in use"] = look()
        ok(d.cuMemFreeAsync(p, s)); ok(d.cuMemPoolTrimTo(pool, 4 * 2**20)); out["trimmed"] = look()
        print(json.dumps(out))
    """.replace("out = {}", "import json\n        out = {}"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"allocated": [6 * MIB, 6 * MIB, 6 * MIB, 6 * MIB],
                   "freed": [6 * MIB, 0, 6 * MIB, 6 * MIB],
                   "synchronized": [0, 0, 0, 0],
                   "kept": [40 * MIB, 0, 40 * MIB, 40 * MIB],
                   "reused": [40 * MIB, 30 * MIB, 40 * MIB, 40 * MIB],
                   "trimmed in use": [30 * MIB, 30 * MIB, 30 * MIB, 30 * MIB],
                   "trimmed": [4 * MIB, 0, 4 * MIB, 4 * MIB]}


RMM = """
import json
ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
s = ok(d.cuStreamCreate(1)); pool = ok(d.cuDeviceGetMemPool(dev))
OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
# RMM's cuda_async_memory_resource: the release threshold at the device's memory, the pool primed
# with half of what is free (allocated and freed at once)
set_threshold(pool, ok(d.cuDeviceTotalMem(dev)))
free, total = ok(d.cuMemGetInfo())
ok(d.cuMemFreeAsync(ok(d.cuMemAllocAsync(free // 2, s)), s)); ok(d.cuStreamSynchronize(s))
"""


def test_a_primed_pool_is_charged_by_its_reservation_and_the_container_never_holds_more_than_memsize(card):
    """RMM-style priming of 128 MiB in a 256 MiB container: the pool keeps the 128 MiB after the
    free. libcgpu charges them (the card never holds more than memsize): a plain 129 MiB allocation is
    refused, 128 MiB fit; the pool's reuse of what it keeps is not charged again (128 MiB from the
    pool fit with the container otherwise full); past what it keeps, the pool is refused with
    out-of-memory. On main the pool's memory was refunded at the free and the 129 MiB allocation
    passed: the container held 257 MiB of a 256 MiB memsize."""
    env, dirp, _ = card
    memsize = 256 * MIB
    pages.create(os.fspath(dirp), [memsize])
    r = run(env, SEEN, RMM, """
        out = {"free after priming": ok(d.cuMemGetInfo())[0], "card": on_card()}
        out["129 MiB refused"] = d.cuMemAlloc(129 * 2**20)[0] == OOM
        plain = ok(d.cuMemAlloc(128 * 2**20))
        out["full"] = [ok(d.cuMemGetInfo())[0], on_card()]
        reuse = ok(d.cuMemAllocAsync(128 * 2**20, s))
        out["reused"] = [ok(d.cuMemGetInfo())[0], on_card()]
        out["past refused"] = d.cuMemAllocAsync(2**20, s)[0] == OOM
        out["card at the end"] = on_card()
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"free after priming": memsize - 128 * MIB, "card": 128 * MIB, "129 MiB refused": True,
                   "full": [0, memsize], "reused": [0, memsize], "past refused": True, "card at the end": memsize}
    assert pages.used(os.fspath(dirp))[0] == 0, "what the pool held comes back when the process ends"


def test_a_fragmented_pool_never_takes_the_container_past_memsize(card):
    """Issue 45, item 3: the release threshold at its highest (PyTorch's cudaMallocAsync backend), four
    quarters of a 256 MiB memsize from the pool, the first and third freed: the pool holds 128 MiB
    unused, but in two pieces, and a half needs one range (the stand-in's pool fragments, as the
    card's does), so the pool grows by 128 MiB. libcgpu took "size <= reserved - used" for a reuse
    and held nothing: the card reached 384 MiB (1.25 x memsize once a context is counted, and the
    watchdog's kill). Now the half holds its worst case; the pool gives back what it does not use
    first (cuMemPoolTrimTo), so the half fits and the card holds memsize; past it, out-of-memory."""
    env, dirp, _ = card
    memsize = 256 * MIB
    pages.create(os.fspath(dirp), [memsize])
    r = run(env, SEEN, """
        import json
        ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
        s = ok(d.cuStreamCreate(1)); pool = ok(d.cuDeviceGetMemPool(dev))
        set_threshold(pool, 2**64 - 1)
        q = [ok(d.cuMemAllocAsync(64 * 2**20, s)) for _ in range(4)]
        ok(d.cuMemFreeAsync(q[0], s)); ok(d.cuMemFreeAsync(q[2], s)); ok(d.cuStreamSynchronize(s))
        out = {"kept": [attr(pool, "RESERVED_MEM_CURRENT"), on_card()]}
        half = d.cuMemAllocAsync(128 * 2**20, s)
        out["half"] = [half[0] == d.CUresult.CUDA_SUCCESS, on_card(), attr(pool, "RESERVED_MEM_CURRENT")]
        out["past"] = [d.cuMemAllocAsync(2 * 2**20, s)[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY, on_card()]
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"kept": [256 * MIB, 256 * MIB], "half": [True, memsize, memsize],
                                    "past": [True, memsize]}
    assert pages.used(os.fspath(dirp))[0] == 0


def test_what_a_pool_gives_back_at_a_synchronize_is_seen_by_a_sibling_at_once(card):
    """Issue 45, item 7: a pool gives back what it keeps above its release threshold (0 by default)
    at a synchronization (the Programming Guide's stream-ordered allocator). A process frees 128 MiB
    of a 256 MiB container's pool and synchronizes its stream, then makes no other call: its sibling
    is told the 256 MiB are free and gets 200 MiB. Before, the refund waited for the first process's
    next memory call: the sibling was told 128 MiB and refused 200 MiB (a false out-of-memory)."""
    import subprocess
    import sys

    from test_libcgpu import PRELUDE

    env, dirp, _ = card
    memsize = 256 * MIB
    pages.create(os.fspath(dirp), [memsize])
    owner = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent("""
        ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
        s = ok(d.cuStreamCreate(1))
        ok(d.cuMemFreeAsync(ok(d.cuMemAllocAsync(128 * 2**20, s)), s)); ok(d.cuStreamSynchronize(s))
        print("synchronized", flush=True)
        sys.stdin.read()
    """)], env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert owner.stdout.readline().strip() == "synchronized", owner.stderr.read()
        r = run(env, """
            ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
            print(ok(d.cuMemGetInfo())[0], d.cuMemAlloc(200 * 2**20)[0] == d.CUresult.CUDA_SUCCESS)
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [str(memsize), "True"], r.stdout
    finally:
        owner.communicate("", timeout=30)


def test_a_reading_of_the_pools_memory_does_not_charge_its_reuse_twice(card):
    """The daemon's reading of the driver's memory (NVML's figure for the process, what its slot had
    allocated just before) after RMM-style priming: NVML shows the pool's 128 MiB. libcgpu charges
    the pool by its reservation, so the reading finds no growth of the driver's own and the pool's
    reuse is not charged again: 128 MiB from the pool, then 128 MiB of plain allocations, fit in
    256 MiB. On main the reading charged the cached 128 MiB as the driver's growth and the reuse
    again: out-of-memory at half of memsize."""
    env, dirp, _ = card
    memsize = 256 * MIB
    pages.create(os.fspath(dirp), [memsize])
    r = run({**env, "CGPUD_ROOT": os.fspath(ROOT)}, SEEN, RMM, """
        import struct, sys
        sys.path.insert(0, os.environ["CGPUD_ROOT"])
        from cgpud.gpus import pages
        where = os.environ["CGPU_PAGE_DIR"]
        slots, _ = pages.slots(where)
        slot = slots[os.getpid()]
        # the daemon's look: the slot read first, then NVML
        allocs = max(0, slot.held[0] - slot.driver[0])
        seen = nvml_mine()
        pages.write_reading(where, slot.index, os.getpid(), [seen] + [0] * 15, [allocs] + [0] * 15)
        reuse = d.cuMemAllocAsync(128 * 2**20, s)[0]
        plain = d.cuMemAlloc(128 * 2**20)[0]
        print(json.dumps([seen, reuse == d.CUresult.CUDA_SUCCESS, plain == d.CUresult.CUDA_SUCCESS,
                          ok(d.cuMemGetInfo())[0]]))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [128 * MIB, True, True, 0]


def test_a_host_pool_is_not_device_memory_and_a_stream_on_another_gpu_is_charged_there(card):
    """A pool made on the host (CU_MEM_LOCATION_TYPE_HOST) holds host memory: 64 MiB from it in a
    16 MiB container are not charged (main charged them and refused). cuMemAllocAsync on a stream
    of GPU 1, with GPU 0's context current, takes from GPU 1's pool and is charged to GPU 1's
    memsize (main charged GPU 0's, and refused 100 MiB there)."""
    env, dirp, _ = card
    pages.create(os.fspath(dirp), [16 * MIB, 128 * MIB])
    r = run({**env, "CGPU_STUB_CUDA_DEVICES": "2"}, SEEN, """
        import json
        ok(d.cuInit(0))
        c0, c1 = (ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(i)))) for i in (0, 1))
        ok(d.cuCtxSetCurrent(c0))
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        props.location.id = 0
        host = ok(d.cuMemPoolCreate(props))
        s0 = ok(d.cuStreamCreate(1))
        h = d.cuMemAllocFromPoolAsync(64 * 2**20, host, s0)
        out = [h[0] == d.CUresult.CUDA_SUCCESS, ok(d.cuMemGetInfo())[0]]
        ok(d.cuCtxSetCurrent(c1)); s1 = ok(d.cuStreamCreate(1)); ok(d.cuCtxSetCurrent(c0))
        a = d.cuMemAllocAsync(100 * 2**20, s1)
        out += [a[0] == d.CUresult.CUDA_SUCCESS, ok(d.cuMemGetInfo())[0]]
        ok(d.cuCtxSetCurrent(c1)); out.append(ok(d.cuMemGetInfo())[0])
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [True, 16 * MIB, True, 16 * MIB, 28 * MIB]


def test_the_stand_ins_nvml_figure_for_a_process_lags_its_driver_calls(card):
    """With CGPU_STUB_NVML_LAG_MS (here 5 s, far longer than the program takes to look), NVML's
    per-process figure right after a 64 MiB allocation is still what it was before (0), and becomes
    64 MiB later, without another call (main's stand-in showed it at once)."""
    env, _, _ = card
    env = {k: v for k, v in env.items() if k not in ("CGPU_PAGE_DIR", "LD_PRELOAD")}
    r = run({**env, "CGPU_STUB_NVML_LAG_MS": "5000"}, SEEN, """
        import time
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        p = ok(d.cuMemAlloc(64 * 2**20))
        first = nvml_mine()
        while (later := nvml_mine()) == first:
            time.sleep(0.05)
        print(first, later)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", str(64 * MIB)]


def test_the_stand_ins_card_hands_out_memory_in_2_mib_pages(card):
    """Without libcgpu: 3 MiB + 1 byte take 2 pages (4 MiB) of the card and of NVML's per-process
    figure; three allocations of 1000 bytes are packed into one page of their own (2 MiB); 1 MiB more
    fits that page with them; another 1 MiB does not (a second page); freed, all goes back. (Main's
    stand-in counted bytes.)"""
    env, _, _ = card
    env = {k: v for k, v in env.items() if k not in ("CGPU_PAGE_DIR", "LD_PRELOAD")}
    r = run(env, SEEN, """
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        out = []
        big = ok(d.cuMemAlloc(3 * 2**20 + 1)); out.append([on_card(), nvml_mine()])
        small = [ok(d.cuMemAlloc(1000)) for _ in range(3)]; out.append([on_card(), nvml_mine()])
        more = ok(d.cuMemAlloc(2**20)); out.append([on_card(), nvml_mine()])
        again = ok(d.cuMemAlloc(2**20)); out.append([on_card(), nvml_mine()])
        for p in [big, more, again] + small:
            ok(d.cuMemFree(p))
        out.append([on_card(), nvml_mine()])
        print(out)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str([[4 * MIB] * 2, [6 * MIB] * 2, [6 * MIB] * 2, [8 * MIB] * 2, [0, 0]])
