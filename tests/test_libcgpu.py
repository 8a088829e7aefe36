"""libcgpu, the in-container interception library (native/libcgpu), first
part: GPU memory held to memsize and memsize shown as the card.

No GPU here: a stand-in libcuda.so.1 (native/stubs/libcuda.c, one card shared
by its processes) is the driver; NVIDIA's own `cuda-bindings` (which finds the
driver through cuGetProcAddress_v2) and a small C client that uses plain
dlopen + dlsym are the clients. The container's pages are made as the daemon
makes them (cgpud.gpus.pages)."""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

from pathlib import Path

import pytest

from cgpud.gpus import pages

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
V100 = 16160 * MIB


_BUILT: list[Path] = []  # the session's one build (a dozen modules use it: one make, not a dozen)


def build_libs(d: Path) -> Path:
    """The stand-in libcuda.so.1 and libnvidia-ml.so.1 and libcgpu.so, in `d`: built from this
    checkout's sources by the session's first caller (make -B), copied to each caller's own `d`."""
    if not _BUILT:
        first = Path(tempfile.mkdtemp(prefix="cgpu-test-libs-"))
        atexit.register(shutil.rmtree, first, True)
        r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "stubs", "libcgpu",
                            f"STUBS={first}", f"LIB={first}"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        _BUILT.append(first)
    d.mkdir(parents=True, exist_ok=True)
    for f in _BUILT[0].iterdir():
        if f.is_symlink():
            (d / f.name).unlink(missing_ok=True)
            (d / f.name).symlink_to(os.readlink(f))
        else:
            shutil.copy2(f, d / f.name)
    return d


def compile_c(d: Path, name: str, source: str) -> Path:
    """A test's own C client, `name`, built in `d` from `source` (dlopen'ing the driver)."""
    (d / f"{name}.c").write_text(source)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(d / name), os.fspath(d / f"{name}.c"), "-ldl", "-lpthread"],
                   check=True)
    return d / name


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    return build_libs(tmp_path_factory.mktemp("libcgpu"))


@pytest.fixture
def card(libs, tmp_path):
    """A V100-sized stand-in card of this test's own, and a container's page directory."""
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"), "CGPU_STUB_CUDA_MIB": str(V100 // MIB),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "PATH": os.environ["PATH"]}
    return env, tmp_path / "pages"


PRELUDE = """
import sys
from cuda.bindings import driver as d
def ok(r):
    assert r[0] == d.CUresult.CUDA_SUCCESS, r
    return r[1:] if len(r) > 2 else (r[1] if len(r) == 2 else None)
"""


def py(env: dict, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_seed_000s_v100_shows_its_memsize_as_the_card(card):
    """4 GiB of a 16160 MiB V100 counted as 15 (seed 000): memsize 4309 MiB, what
    nvidia-smi and TensorFlow show there (totalMemory: 4.21GiB)."""
    env, dirp = card
    memsize = V100 * 4 // 15
    pages.create(os.fspath(dirp), [memsize])
    r = py(env, """
        ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0))
        total = ok(d.cuDeviceTotalMem(dev)); free, total2 = ok(d.cuMemGetInfo())
        print(total, free, total2)
    """)
    assert r.returncode == 0, r.stderr
    total, free, total2 = map(int, r.stdout.split())
    assert total == total2 == free == memsize
    assert total // MIB == 4309 and f"{total / (1 << 30):.2f}" == "4.21"


def test_allocations_fit_to_the_byte_and_fail_one_byte_past(card):
    env, dirp = card
    pages.create(os.fspath(dirp), [64 * MIB])
    r = py(env, """
        ok(d.cuInit(0))
        a = ok(d.cuMemAlloc(64 * 2**20 - 100))
        e = d.cuMemAlloc(101)[0]
        b = ok(d.cuMemAlloc(100))
        free, total = ok(d.cuMemGetInfo())
        ok(d.cuMemFree(a))
        after = ok(d.cuMemGetInfo())
        print(e == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY, free, total, after[0])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "0", str(64 * MIB), str(64 * MIB - 100)]
    assert pages.used(os.fspath(dirp))[0] == 0, "every process's memory is given back when it ends"


def test_a_container_on_two_gpus_is_held_to_each_ones_memsize(card):
    """Its page lists its GPUs in the order CUDA numbers them: an allocation is charged to the
    device of the calling thread's context, and its free gives it back there, whichever context
    frees it; each device shows its own memsize."""
    env, dirp = card
    pages.create(os.fspath(dirp), [64 * MIB, 128 * MIB])
    r = py({**env, "CGPU_STUB_CUDA_DEVICES": "2"}, """
        ok(d.cuInit(0))
        c0, c1 = (ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(i)))) for i in (0, 1))
        ok(d.cuCtxSetCurrent(c1))
        big = ok(d.cuMemAlloc(128 * 2**20))           # all of GPU 1
        past1 = d.cuMemAlloc(1)[0]
        info1 = ok(d.cuMemGetInfo())
        ok(d.cuCtxSetCurrent(c0))
        small = ok(d.cuMemAlloc(64 * 2**20))          # all of GPU 0: GPU 1's use is not counted here
        past0 = d.cuMemAlloc(1)[0]
        info0 = ok(d.cuMemGetInfo())
        ok(d.cuMemFree(big))                          # GPU 1's, freed from GPU 0's context
        ok(d.cuCtxSetCurrent(c1))
        again = ok(d.cuMemAlloc(128 * 2**20))
        oom = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        totals = [ok(d.cuDeviceTotalMem(ok(d.cuDeviceGet(i)))) for i in (0, 1)]
        ok(d.cuMemFree(again)); ok(d.cuCtxSetCurrent(c0))
        p = d.CUmemAllocationProp()                   # cuMemCreate names its device: GPU 1, from GPU 0's context
        p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = 1
        h = ok(d.cuMemCreate(128 * 2**20, p, 0))
        past_vmm = d.cuMemCreate(1, p, 0)[0]
        ok(d.cuMemRelease(h))
        print(past1 == oom, past0 == oom, *info1, *info0, *totals, past_vmm == oom)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "0", str(128 * MIB), "0", str(64 * MIB), str(64 * MIB),
                                str(128 * MIB), "True"], r.stdout + r.stderr


def test_a_page_naming_its_gpus_uuids_is_matched_by_uuid_not_by_cudas_numbers(card):
    """The page's GPU 0 is CUDA's device 1 and its GPU 1 device 0 (CUDA numbers a container's
    GPUs in its own order): with the UUIDs in the page each device gets its own GPU's memsize,
    by cuDeviceTotalMem and at its allocations. A device whose UUID the page does not name
    (a MIG device's is its own), or a driver that cannot say UUIDs: by number, as before."""
    env, dirp = card
    u0, u1, other = (f"GPU-5e4b1c2a-0000-4000-8000-00000000000{k}" for k in (0, 1, 9))
    pages.create(os.fspath(dirp), [64 * MIB, 128 * MIB], [u1, u0])
    code = """
        ok(d.cuInit(0))
        totals = [ok(d.cuDeviceTotalMem(ok(d.cuDeviceGet(i)))) for i in (0, 1)]
        c0, c1 = (ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(i)))) for i in (0, 1))
        ok(d.cuCtxSetCurrent(c0))
        a = d.cuMemAlloc(128 * 2**20)[0] == d.CUresult.CUDA_SUCCESS
        ok(d.cuCtxSetCurrent(c1))
        b = d.cuMemAlloc(64 * 2**20 + 1)[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        print(*totals, a, b)
    """
    r = py({**env, "CGPU_STUB_CUDA_DEVICES": "2", "CGPU_STUB_CUDA_UUIDS": f"{u0},{u1}"}, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(128 * MIB), str(64 * MIB), "True", "True"], r.stdout + r.stderr
    # device 1's UUID is not the page's: by its number (GPU 1 of the page), never unheld
    r = py({**env, "CGPU_STUB_CUDA_DEVICES": "2", "CGPU_STUB_CUDA_UUIDS": f"{u1},{other}"}, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(64 * MIB), str(128 * MIB), "False", "False"], r.stdout + r.stderr
    # no UUIDs from the driver: by CUDA's numbers, as a page without UUIDs
    r = py({**env, "CGPU_STUB_CUDA_DEVICES": "2"}, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(64 * MIB), str(128 * MIB), "False", "False"], r.stdout + r.stderr


def test_nvml_matches_a_page_naming_its_gpus_uuids_by_uuid(card, libs, tmp_path):
    """NVML numbers the GPUs its own way too: its GPU with the page's GPU 1's UUID shows GPU 1's memsize."""
    from nvml_stub import NvmlStub, StubGpu

    env, dirp = card
    u0, u1 = (f"GPU-5e4b1c2a-0000-4000-8000-00000000000{k}" for k in (0, 1))
    stub = NvmlStub(libs, tmp_path / "nvml.conf")
    stub.gpus = [StubGpu(u, "Tesla V100-SXM2-16GB", V100) for u in (u0, u1)]
    stub.write()
    pages.create(os.fspath(dirp), [64 * MIB, 128 * MIB], [u1, u0])
    r = py({**env, "CGPU_NVML_STUB": os.fspath(stub.config)}, """
        import pynvml
        pynvml.nvmlInit()
        print(*(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in (0, 1)))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(128 * MIB), str(64 * MIB)], r.stdout + r.stderr


def test_racing_processes_never_pass_memsize_together(card):
    """Four processes allocate 1 MiB pieces at once until refused: together they hold what a watched
    instance may fill (memsize less the headroom: 1 %, 2 MiB), never a byte more, and the card, which
    hands out 2 MiB pages, agrees (issue 45, item 14: charged by the byte, processes ending with an odd
    count held a page each for their last piece, and the card held 202 MiB of a 200 MiB page)."""
    env, dirp = card
    pages.create(os.fspath(dirp), [200 * MIB])
    pages.mark_watched(os.fspath(dirp))  # (the watchdog judges the pages NVML shows)
    code = """
        import os
        ok(d.cuInit(0)); n = 0
        while d.cuMemAlloc(2**20)[0] == d.CUresult.CUDA_SUCCESS:
            n += 1
        print(n, flush=True)
        sys.stdin.read()  # hold it until told
    """
    procs = [subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    counts = [int(p.stdout.readline()) for p in procs]
    assert sum(counts) == 198, counts
    assert pages.used(os.fspath(dirp))[0] == 198 * MIB
    state = int.from_bytes((Path(env["CGPU_STUB_CUDA_STATE"])).read_bytes()[:8], "little")
    assert state == 198 * MIB, "the card holds what the page says"
    for p in procs:
        p.communicate("", timeout=30)


def test_small_allocations_are_charged_the_pages_the_card_gives_them(card):
    """Issue 45, item 14: the driver hands device memory out in 2 MiB pages, and a process's pieces
    under a page are packed in pages of its own, so processes each holding one 1 MiB piece hold a
    page each. Charged by the byte, nine of them fitted in a watched 10 MiB instance (memsize less
    its 1 % headroom) while the card held 18 MiB (the race of
    test_racing_processes_never_pass_memsize_together, made certain): charged by the page, four fit,
    the fifth is refused, and the card holds what the page says, under memsize."""
    env, dirp = card
    pages.create(os.fspath(dirp), [10 * MIB])
    pages.mark_watched(os.fspath(dirp))  # (the watchdog judges the pages NVML shows)
    code = """
        ok(d.cuInit(0)); print(d.cuMemAlloc(2**20)[0] == d.CUresult.CUDA_SUCCESS, flush=True)
        sys.stdin.read()
    """
    procs, held = [], []
    for _ in range(10):
        p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(p)
        held.append(p.stdout.readline().strip())
    try:
        state = int.from_bytes((Path(env["CGPU_STUB_CUDA_STATE"])).read_bytes()[:8], "little")
        assert held == ["True"] * 4 + ["False"] * 6, held
        assert state == pages.used(os.fspath(dirp))[0] == 8 * MIB, "the card holds what the page says"
    finally:
        for p in procs:
            p.communicate("", timeout=30)


def test_a_killed_processs_memory_comes_back(card):
    env, dirp = card
    pages.create(os.fspath(dirp), [100 * MIB])
    holder = subprocess.Popen([sys.executable, "-c", PRELUDE + "ok(d.cuInit(0)); ok(d.cuMemAlloc(60 * 2**20));"
                               "print('held', flush=True); import time; time.sleep(60)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert pages.used(os.fspath(dirp))[0] == 60 * MIB
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    r = py(env, "ok(d.cuInit(0)); print(ok(d.cuMemGetInfo())[0])")
    assert r.returncode == 0 and int(r.stdout) == 100 * MIB, r.stderr + r.stdout
    assert pages.used(os.fspath(dirp))[0] == 0 and holder.pid not in pages.held_by(os.fspath(dirp))


@pytest.mark.parametrize("damage, words", [
    ("missing", "No such file or directory"),
    ("magic", "foreign magic"),
    ("version", "another version of cgpud"),
    ("short", "is not a cgpud page"),
])
def test_asked_for_isolation_but_no_usable_page_fails_closed(card, damage, words):
    env, dirp = card
    if damage != "missing":
        pages.create(os.fspath(dirp), [MIB])
        limits = dirp / "limits"
        raw = bytearray(limits.read_bytes())
        limits.chmod(0o644)
        if damage == "magic":
            raw[0:4] = b"XXXX"
        elif damage == "version":
            raw[4:8] = (99).to_bytes(4, "little")
        else:
            raw = raw[:10]
        limits.write_bytes(bytes(raw))
    r = py(env, "print(d.cuInit(0)[0] == d.CUresult.CUDA_ERROR_NOT_INITIALIZED)")
    assert r.stdout.strip() == "True", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cgpu: GPU isolation was asked for but cannot be applied")
    assert words in lines[0]


def test_a_process_not_asking_for_isolation_sees_the_whole_card(card):
    env, _ = card
    env = {k: v for k, v in env.items() if k != "CGPU_PAGE_DIR"}
    r = py(env, "ok(d.cuInit(0)); print(ok(d.cuDeviceTotalMem(ok(d.cuDeviceGet(0)))))")
    assert r.returncode == 0 and int(r.stdout) == V100, r.stderr


C_CLIENT = r"""
#include <dlfcn.h>
#include <stdio.h>
typedef int (*i_t)(unsigned); typedef int (*a_t)(unsigned long long *, size_t); typedef int (*t_t)(size_t *, int);
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { puts("no libcuda"); return 2; }
    i_t init = (i_t)dlsym(h, "cuInit"); a_t alloc = (a_t)dlsym(h, "cuMemAlloc_v2");
    t_t total = (t_t)dlsym(h, "cuDeviceTotalMem_v2");
    unsigned long long p; size_t t;
    if (init(0)) return 3;
    total(&t, 0);
    int fit = alloc(&p, 8 << 20);
    int past = alloc(&p, 1);
    printf("%zu %d %d\n", t, fit, past);
    return 0;
}
"""


def test_a_c_client_with_plain_dlsym_is_held_too(card, tmp_path):
    env, dirp = card
    pages.create(os.fspath(dirp), [8 * MIB])
    (tmp_path / "client.c").write_text(C_CLIENT)
    r = subprocess.run(["gcc", "-o", os.fspath(tmp_path / "client"), os.fspath(tmp_path / "client.c"), "-ldl"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([os.fspath(tmp_path / "client")], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.stdout.split() == [str(8 * MIB), "0", "2"], "8 MiB fit; one byte more is CUDA_ERROR_OUT_OF_MEMORY (2)"


def test_the_python_layout_is_the_headers(tmp_path):
    prog = tmp_path / "sizes.c"
    prog.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "cgpu_page.h"\n'
                    'int main(void){printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\\n", sizeof(struct cgpu_limits),'
                    ' sizeof(struct cgpu_usage), offsetof(struct cgpu_usage, procs), sizeof(struct cgpu_proc),'
                    ' sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver),'
                    ' sizeof(struct cgpu_usage) + offsetof(struct cgpu_usage_driver, procs), sizeof(struct cgpu_driver),'
                    ' sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver) + sizeof(struct cgpu_usage_busy),'
                    ' sizeof(struct cgpu_busy), sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver)'
                    ' + sizeof(struct cgpu_usage_busy) + sizeof(struct cgpu_usage_gang), sizeof(struct cgpu_gang));'
                    ' return 0;}\n')
    r = subprocess.run(["gcc", f"-I{ROOT / 'native' / 'libcgpu'}", "-o", os.fspath(tmp_path / "sizes"),
                        os.fspath(prog)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = subprocess.run([os.fspath(tmp_path / "sizes")], capture_output=True, text=True).stdout.split()
    assert list(map(int, out)) == [pages.LIMITS.size, pages.USAGE_V2_SIZE, pages.USAGE_HEAD.size, pages.PROC.size,
                                   pages.DRIVER_SIZE, pages.DRIVER_OFFSET, pages.DRIVER.size, pages.USAGE_SIZE,
                                   pages.BUSY.size, pages.IDENT_OFFSET, pages.GANG.size]


def test_nvml_shows_memsize_and_the_containers_usage(card, libs, tmp_path):
    """What nvidia-smi reads: nvmlDeviceGetMemoryInfo and _v2, through NVIDIA's nvidia-ml-py."""
    from nvml_stub import NvmlStub, StubGpu

    env, dirp = card
    stub = NvmlStub(libs, tmp_path / "nvml.conf")
    stub.gpus = [StubGpu("GPU-5e4b1c2a-0000-4000-8000-000000000001", "Tesla V100-SXM2-16GB", V100, used=3 << 30)]
    stub.write()
    memsize = V100 * 4 // 15
    pages.create(os.fspath(dirp), [memsize])
    r = py({**env, "CGPU_NVML_STUB": os.fspath(stub.config)}, """
        import pynvml
        ok(d.cuInit(0)); ok(d.cuMemAlloc(100 * 2**20))
        pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(h); m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        print(m.total, m.used, m.free, m2.total, m2.used, m2.free)
    """)
    assert r.returncode == 0, r.stderr
    total, used, free, total2, used2, free2 = map(int, r.stdout.split())
    assert (total, used, free) == (memsize, 100 * MIB, memsize - 100 * MIB) == (total2, used2, free2)
    assert total // MIB == 4309


def test_every_allocator_is_held_to_memsize_and_given_back(card):
    """Pitched, managed, stream-ordered and array allocations count against the
    same memsize, fail past it, and come back at their frees — a stream-ordered one
    at the synchronization after its free, when its pool (release threshold 0, the
    driver's default) gives its memory back to the card."""
    env, dirp = card
    pages.create(os.fspath(dirp), [16 * MIB])
    r = py(env, """
        OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        ok(d.cuInit(0)); s = ok(d.cuStreamCreate(0))
        p, pitch = ok(d.cuMemAllocPitch(1000, 4096, 4))          # 1024-byte rows: 4 MiB
        m = ok(d.cuMemAllocManaged(4 * 2**20, 1))
        a = ok(d.cuMemAllocAsync(4 * 2**20, s))
        desc = d.CUDA_ARRAY_DESCRIPTOR(); desc.Width = 2**20; desc.Height = 1
        desc.Format = d.CUarray_format.CU_AD_FORMAT_FLOAT; desc.NumChannels = 1
        arr = ok(d.cuArrayCreate(desc))                            # 4 MiB
        full = ok(d.cuMemGetInfo())
        refused = [d.cuMemAllocManaged(1, 1)[0] == OOM, d.cuMemAllocAsync(1, s)[0] == OOM,
                   d.cuArrayCreate(desc)[0] == OOM, d.cuMemAllocPitch(1, 1, 1)[0] == OOM]
        ok(d.cuMemFree(p)); ok(d.cuMemFree(m)); ok(d.cuMemFreeAsync(a, s)); ok(d.cuArrayDestroy(arr))
        kept = ok(d.cuMemGetInfo())[0]
        ok(d.cuStreamSynchronize(s))
        print(pitch, full[0], all(refused), kept, ok(d.cuMemGetInfo())[0])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1024", "0", "True", str(12 * MIB), str(16 * MIB)]


def test_pool_vmm_3d_and_mipmapped_allocators_are_held_to_memsize_to_the_byte(card):
    """cuMemCreate (device memory), cuArray3DCreate and
    cuMipmappedArrayCreate: each fits in exactly its size of room (the container's
    last byte) and is refused with CUDA_ERROR_OUT_OF_MEMORY with one byte less,
    nothing allocated on the card; its free gives it all back. The sizes are
    worked out here from the descriptors, not taken from the library."""
    env, dirp = card
    env = {**env, "CGPU_STUB_PAGE_KIB": "0"}  # (the card in bytes: it holds exactly what was allocated)
    memsize = 16 * MIB
    pages.create(os.fspath(dirp), [memsize])
    r = py(env, f"""
        import json, os
        M = {memsize}; OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        def on_card():
            with open(os.environ["CGPU_STUB_CUDA_STATE"], "rb") as f:
                return int.from_bytes(f.read(8), "little")
        def free_now():
            return ok(d.cuMemGetInfo())[0]
        def room(n):  # leave exactly n bytes of memsize: what holds the rest
            return ok(d.cuMemAlloc(M - n)) if n < M else None
        def let_go(pad):
            if pad is not None:
                ok(d.cuMemFree(pad))
        def held(size, alloc, free):  # in `size` bytes of room it fits, taking the last; in size - 1 not
            pad = room(size)
            h = ok(alloc())
            full = [free_now(), on_card()]
            ok(free(h))
            back = free_now()
            let_go(pad)
            pad = room(size - 1)
            e = alloc()[0]
            refused = [e == OOM, on_card(), free_now()]
            let_go(pad)
            return full + [back] + refused + [free_now(), on_card()]

        ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); s = ok(d.cuStreamCreate(0))
        pool = ok(d.cuDeviceGetDefaultMemPool(dev))
        F = d.CUarray_format
        def desc(w, h, depth, fmt, ch, flags=0):
            a = d.CUDA_ARRAY3D_DESCRIPTOR()
            a.Width, a.Height, a.Depth, a.Format, a.NumChannels, a.Flags = w, h, depth, fmt, ch, flags
            return a
        def prop(kind):
            p = d.CUmemAllocationProp()
            p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            p.location.type = getattr(d.CUmemLocationType, "CU_MEM_LOCATION_TYPE_" + kind)
            p.location.id = 0
            return p
        LT = d.CUmemLocationType
        cases = {{
            "cuMemCreate device, all": (M, lambda: d.cuMemCreate(M, prop("DEVICE"), 0), d.cuMemRelease),
            "cuMemCreate device, 2 MiB": (2 * 2**20, lambda: d.cuMemCreate(2 * 2**20, prop("DEVICE"), 0),
                                          d.cuMemRelease),
            "cuMemCreate locality domain": (4 * 2**20,
                                            lambda: d.cuMemCreate(4 * 2**20, prop("DEVICE_LOCALITY_DOMAIN"), 0),
                                            d.cuMemRelease),
            # 256 x 128 x 32 of float4: 16 MiB
            "3-D, all": (M, lambda: d.cuArray3DCreate(desc(256, 128, 32, F.CU_AD_FORMAT_FLOAT, 4)),
                         d.cuArrayDestroy),
            # 2-D (depth 0 counts as 1): 1000 x 3 of 2 x int16
            "3-D, depth 0": (12000, lambda: d.cuArray3DCreate(desc(1000, 3, 0, F.CU_AD_FORMAT_SIGNED_INT16, 2)),
                             d.cuArrayDestroy),
            # 1-D: 5 MiB + 3 bytes of uint8
            "3-D, 1-D": (5 * 2**20 + 3, lambda: d.cuArray3DCreate(desc(5 * 2**20 + 3, 0, 0,
                                                                          F.CU_AD_FORMAT_UNSIGNED_INT8, 1)),
                         d.cuArrayDestroy),
            # 64x32x16 + 32x16x8 + 16x8x4 + 8x4x2 + 4x2x1 floats
            "mipmapped 3-D": (4 * (32768 + 4096 + 512 + 64 + 8),
                              lambda: d.cuMipmappedArrayCreate(desc(64, 32, 16, F.CU_AD_FORMAT_FLOAT, 1), 5),
                              d.cuMipmappedArrayDestroy),
            # 4x16x8 + 2x8x4 + 1x4x2 + 1x2x1 + 1x1x1 floats: a side at 1 stays 1
            "mipmapped, a side at 1": (4 * (512 + 64 + 8 + 2 + 1),
                                       lambda: d.cuMipmappedArrayCreate(desc(4, 16, 8, F.CU_AD_FORMAT_FLOAT, 1), 5),
                                       d.cuMipmappedArrayDestroy),
            # 1-D, 2 x uint8: 8 + 4 + 2 + 1 texels
            "mipmapped 1-D": (2 * 15, lambda: d.cuMipmappedArrayCreate(desc(8, 0, 0, F.CU_AD_FORMAT_UNSIGNED_INT8,
                                                                           2), 4),
                              d.cuMipmappedArrayDestroy),
            # 6 layers of 512x256, 256x128, 128x64, half: the layers are not halved
            "mipmapped layered": (2 * 6 * (512 * 256 + 256 * 128 + 128 * 64),
                                  lambda: d.cuMipmappedArrayCreate(desc(512, 256, 6, F.CU_AD_FORMAT_HALF, 1,
                                                                        d.CUDA_ARRAY3D_LAYERED), 3),
                                  d.cuMipmappedArrayDestroy),
        }}
        out = {{name: [size] + held(size, alloc, free) for name, (size, alloc, free) in cases.items()}}

        # host memory made by cuMemCreate is not the card's: not charged even with no room
        pad = room(0)
        hh = ok(d.cuMemCreate(M, prop("HOST"), 0))
        out["host"] = [free_now(), on_card()]
        ok(d.cuMemRelease(hh)); let_go(pad)
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    import json
    out = json.loads(r.stdout)
    host = out.pop("host")
    assert len(out) == 10  # (pools: by their reservation, in 2 MiB pages: tests/test_pools.py)
    for name, (size, *seen) in out.items():
        # full: nothing free, the card holds memsize; freed: size back;
        # one byte less room: refused, the card holds only the padding; at the end nothing held
        assert seen == [0, memsize, size, True, memsize - size + 1, size - 1, memsize, 0], name
    assert host == [0, memsize], "host memory is not charged to the container"
    assert pages.used(os.fspath(dirp))[0] == 0


def test_the_pool_vmm_3d_and_mipmapped_allocators_are_ours_through_dlsym(card, libs):
    """A client that dlopens libcuda.so.1 and looks the allocators up by name gets libcgpu's."""
    env, dirp = card
    pages.create(os.fspath(dirp), [MIB])
    names = ["cuMemAllocFromPoolAsync", "cuMemCreate", "cuMemRelease", "cuArray3DCreate_v2",
             "cuMipmappedArrayCreate", "cuMipmappedArrayDestroy"]
    r = py(env, f"""
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1"); ours = ctypes.CDLL({os.fspath(libs / "libcgpu.so")!r})
        addr = lambda lib, n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
        print(*[addr(cuda, n) == addr(ours, n) for n in {names!r}])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"] * len(names)


# ---- in a container: cgpu-runtime puts the library and the pages in ------------------------------

MOUNT_CLIENT = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*i_t)(unsigned); typedef int (*a_t)(unsigned long long *, size_t); typedef int (*t_t)(size_t *, int);
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("no libcuda: %s\n", dlerror()); return 2; }
    i_t init = (i_t)dlsym(h, "cuInit"); a_t alloc = (a_t)dlsym(h, "cuMemAlloc_v2");
    t_t total = (t_t)dlsym(h, "cuDeviceTotalMem_v2");
    unsigned long long p; size_t t = 0;
    int r = init(0);
    if (r) { printf("cuInit %d\n", r); return 3; }
    total(&t, 0);
    int fit = alloc(&p, t);
    int past = alloc(&p, 1);
    printf("%zu %d %d %s\n", t, fit, past, getenv("CGPU_PAGE_DIR"));
    return 0;
}
"""


def run_prepared(make_daemon, lib: Path, tmp_path: Path, rootfs: Path, share: Path, script: str,
                 extra_mounts: list[dict], env: dict | None = None,
                 timeout: float = 60) -> tuple[subprocess.CompletedProcess, dict, object, str]:
    """`script` (sh) in a container of `rootfs` run by cgpu-runtime in front of real runc, the
    daemon preparing it with `lib` as its libcgpu; its /share is `share`; `env`: more of the
    container's environment."""
    import json

    from test_runc import compiled_hook
    from test_runtime import wrapper

    d = make_daemon(extra_args=["--hook-path", compiled_hook(), "--libcgpu", os.fspath(lib)])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", os.fspath(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": os.fspath(rootfs), "readonly": False}
    spec["process"].update(terminal=False, args=["/bin/sh", "-c", script], env=[
        "PATH=/usr/bin:/bin", "LD_LIBRARY_PATH=/share/lib", "CGPU_STUB_CUDA_STATE=/share/card",
        "ALIYUN_COM_GPU_MEM_CONTAINER=1"] + [f"{k}={v}" for k, v in (env or {}).items()])
    spec["mounts"] += extra_mounts + [{"destination": "/share", "type": "bind", "source": os.fspath(share),
                                       "options": ["rbind", "rw"]}]
    (bundle / "config.json").write_text(json.dumps(spec))
    cid = "cafe" + os.urandom(30).hex()
    host_env = {"PATH": os.environ["PATH"], "CGPUD_SOCKET": os.fspath(d.socket)}
    root = ["--root", os.fspath(tmp_path / "runc-root")]
    r = subprocess.run([wrapper(), *root, "run", "--bundle", os.fspath(bundle), cid], capture_output=True,
                       text=True, env=host_env, stdin=subprocess.DEVNULL, timeout=timeout)
    subprocess.run([wrapper(), *root, "delete", "-f", cid], capture_output=True, env=host_env, timeout=30)
    return r, json.loads((bundle / "config.json").read_text()), d, cid


def client_rootfs(libs: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A share (the stand-in libcuda, MOUNT_CLIENT built) and a rootfs of the host's /usr (bind it)."""
    share = tmp_path / "share"
    (share / "lib").mkdir(parents=True)
    subprocess.run(["cp", os.fspath(libs / "libcuda.so.1"), os.fspath(share / "lib" / "libcuda.so.1")], check=True)
    (tmp_path / "client.c").write_text(MOUNT_CLIENT)
    subprocess.run(["gcc", "-o", os.fspath(share / "client"), os.fspath(tmp_path / "client.c"), "-ldl"], check=True)
    rootfs = tmp_path / "rootfs"
    for sub in ("usr", "proc", "dev", "sys", "run", "tmp", "share"):
        (rootfs / sub).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{link}", rootfs / link)
    return share, rootfs


def test_a_container_prepared_by_cgpu_runtime_gets_the_library_and_its_limit(make_daemon, libs, tmp_path):
    """cgpu-runtime in front of real runc: the daemon's `prepare` makes the container's pages and
    mounts the library and them; the hook fills its memsize; the container's own process (a C
    client, its libcuda the stand-in) sees 1 GiB as the card and is refused one byte past it."""
    share, rootfs = client_rootfs(libs, tmp_path)
    # the second run clears its environment (no LD_PRELOAD, no CGPU_PAGE_DIR): /etc/ld.so.preload
    # loads the library still, and it finds the pages where cgpu-runtime mounts them
    r, prepared, d, cid = run_prepared(
        make_daemon, libs / "libcgpu.so", tmp_path, rootfs, share,
        "/share/client; env -i LD_LIBRARY_PATH=/share/lib CGPU_STUB_CUDA_STATE=/share/card /share/client",
        [{"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == [str(1 << 30), "0", "2", "/run/cgpu", str(1 << 30), "0", "2", "(null)"], \
        r.stdout + r.stderr
    mounts = {m["destination"]: m for m in prepared["mounts"]}
    assert mounts["/run/cgpu/limits"]["options"] == ["bind", "ro"], "only usage is writable by the container"
    assert mounts["/etc/ld.so.preload"]["options"] == ["bind", "ro"]
    assert not (d.socket.parent / "pages" / cid[:12]).exists(), "its pages went with it"


def test_libcgpu_needs_nothing_newer_than_glibc_2_17(libs):
    """Built by zig cc for glibc 2.17: every GLIBC_ version it needs is 2.17 or older."""
    out = subprocess.run(["objdump", "-T", os.fspath(libs / "libcgpu.so")], capture_output=True, text=True,
                         check=True).stdout
    import re
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9][0-9.]*)", out)}
    assert versions and max(versions) <= (2, 17), sorted(versions)


def test_the_build_fails_if_libcgpu_would_need_a_newer_glibc(tmp_path):
    """A compiler that links against this machine's glibc (2.36) in zig's place: the build stops,
    says why, and leaves no library behind."""
    fake = tmp_path / "zig"
    fake.write_text("#!/bin/sh\nshift 3\nexec gcc \"$@\"\n")  # drops `cc -target <triple>`
    fake.chmod(0o755)
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "libcgpu", f"LIB={tmp_path / 'lib'}",
                        f"ZIG={fake}"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "newer than 2.17: it would break older images; not installed" in r.stderr, r.stderr
    assert not list((tmp_path / "lib").iterdir())


@contextlib.contextmanager
def debian_root(suite: str, tmp_path: Path):
    """Debian `suite`'s root filesystem (scripts/rootfs.sh's cache) under an overlay of this test's
    own: the container writes nothing into the cache."""
    r = subprocess.run([os.fspath(ROOT / "scripts" / "rootfs.sh"), suite], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    layers = {k: tmp_path / f"overlay-{suite}" / k for k in ("upper", "work", "root")}
    for p in layers.values():
        p.mkdir(parents=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={r.stdout.strip()},"
                    f"upperdir={layers['upper']},workdir={layers['work']}", os.fspath(layers["root"])], check=True)
    try:
        yield layers["root"]
    finally:
        subprocess.run(["umount", "-l", os.fspath(layers["root"])], check=True)


@pytest.fixture
def bullseye(tmp_path):
    """Debian bullseye (glibc 2.31), an overlay of this test's own (debian_root)."""
    with debian_root("bullseye", tmp_path) as root:
        yield root


def old_glibc_stub(lib: Path) -> Path:
    """The stand-in libcuda.so.1 built by zig for glibc 2.17 into the directory `lib` (for an
    older image than this host's glibc 2.36)."""
    cc = f"{ROOT / '.venv' / 'bin' / 'python-zig'} cc -target x86_64-linux-gnu.2.17"
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), f"{lib / 'libcuda.so.1'}",
                        f"STUBS={lib}", f"CC={cc}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return lib / "libcuda.so.1"


@pytest.mark.timeout(900)  # (a fresh machine's first scripts/rootfs.sh bullseye runs debootstrap: minutes)
def test_an_older_glibc_image_starts_and_is_held(make_daemon, libs, bullseye, tmp_path):
    """A Debian bullseye image (glibc 2.31) with libcgpu in its /etc/ld.so.preload, as cgpu-runtime
    prepares it: its shell and its tools start (the library built for 2.31 + would stop every
    process), and a CUDA client built for glibc 2.17 (with the stand-in) is held to memsize."""
    zig = os.fspath(ROOT / ".venv" / "bin" / "python-zig")
    share = tmp_path / "share"
    (share / "lib").mkdir(parents=True)
    old_glibc_stub(share / "lib")
    (tmp_path / "client.c").write_text(MOUNT_CLIENT)
    subprocess.run([zig, "cc", "-target", "x86_64-linux-gnu.2.17", "-o", os.fspath(share / "client"),
                    os.fspath(tmp_path / "client.c"), "-ldl"], check=True)
    r, prepared, d, cid = run_prepared(
        make_daemon, libs / "libcgpu.so", tmp_path, bullseye, share,
        "cat /etc/ld.so.preload; ldd --version | head -1; ls /run/cgpu >/dev/null && echo shell-ok; /share/client", [])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "/run/cgpu-lib/libcgpu.so", "the preload file cgpu-runtime mounts"
    assert lines[1].endswith("2.31"), lines[1]
    assert lines[2] == "shell-ok"
    assert lines[3].split() == [str(1 << 30), "0", "2", "/run/cgpu"], r.stdout + r.stderr


# ---- issue 20: what the real stack does that the first stand-in was kind about ------------------------


def test_ten_thousand_live_allocations_all_come_back_when_freed(card):
    """The allocation table never drops one: 10,000 allocations live at once (more than the
    first table's 8,192 slots), all freed, leave nothing charged."""
    env, dirp = card
    pages.create(os.fspath(dirp), [64 * MIB])
    r = py(env, """
        import os
        from cgpud.gpus import pages
        ok(d.cuInit(0))
        ps = [ok(d.cuMemAlloc(4096)) for _ in range(10000)]
        held = pages.used(os.environ["CGPU_PAGE_DIR"])[0]
        for p in ps:
            ok(d.cuMemFree(p))
        print(held, pages.used(os.environ["CGPU_PAGE_DIR"])[0], ok(d.cuMemGetInfo())[0])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(10000 * 4096), "0", str(64 * MIB)]


VMM = """
    import os
    from cgpud.gpus import pages
    OOM, INVALID = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY, d.CUresult.CUDA_ERROR_INVALID_VALUE
    def used():
        return pages.used(os.environ["CGPU_PAGE_DIR"])[0]
    def on_card():
        with open(os.environ["CGPU_STUB_CUDA_STATE"], "rb") as f:
            return int.from_bytes(f.read(8), "little")
    ok(d.cuInit(0))
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    a = d.CUmemAccessDesc()
    a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = 0
    a.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    def mapped(size):  # create, reserve, map, set access: what PyTorch's expandable segments do
        h = ok(d.cuMemCreate(size, p, 0))
        va = int(ok(d.cuMemAddressReserve(size, 0, 0, 0)))
        ok(d.cuMemMap(va, size, 0, h, 0))
        ok(d.cuMemSetAccess(va, size, [a], 1))
        return h, va
"""


def test_vmm_memory_is_charged_until_released_and_unmapped(card):
    """The driver frees cuMemCreate's physical memory at its release AND its last unmap:
    released while mapped it is still the container's (PyTorch's expandable segments,
    PaddlePaddle and the CUDA samples release right after mapping)."""
    env, dirp = card
    M = 16 * MIB
    pages.create(os.fspath(dirp), [M])
    r = py(env, VMM + f"""
    M = {M}
    h, va = mapped(M)
    ok(d.cuMemRelease(h))                                  # released, still mapped: still there
    out = [used(), on_card(), ok(d.cuMemGetInfo())[0], d.cuMemAlloc(1)[0] == OOM]
    ok(d.cuMemUnmap(va, M))                                # the last mapping gone: now it is freed
    out += [used(), on_card(), ok(d.cuMemGetInfo())[0]]
    ok(d.cuMemAddressFree(va, M))
    # mapped twice, released, unmapped one at a time: freed at the last unmap
    h = ok(d.cuMemCreate(M, p, 0))
    va = int(ok(d.cuMemAddressReserve(2 * M, 0, 0, 0)))
    ok(d.cuMemMap(va, M, 0, h, 0)); ok(d.cuMemMap(va + M, M, 0, h, 0))
    ok(d.cuMemRelease(h))
    ok(d.cuMemUnmap(va, M))
    out += [used()]
    ok(d.cuMemUnmap(va + M, M))
    out += [used()]
    # a handle retained from its address needs its own release too
    h, va = mapped(M)
    h2 = ok(d.cuMemRetainAllocationHandle(va + 4096))
    ok(d.cuMemRelease(h)); ok(d.cuMemUnmap(va, M))
    out += [used()]
    ok(d.cuMemRelease(h2))
    out += [used(), on_card()]
    print(*out)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(M), str(M), "0", "True", "0", "0", str(M), str(M), "0", str(M), "0", "0"], \
        r.stdout


def test_the_stand_in_is_as_strict_as_the_driver_about_vmm(libs, tmp_path):
    """Without libcgpu: unmapping what is not mapped, mapping a released handle or into no
    reservation, releasing twice, or freeing a reservation still mapped are refused."""
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
           "PATH": os.environ["PATH"]}
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(VMM.replace("from cgpud.gpus import pages", "")
                                                                         + """
    M = 2 * 2**20
    h, va = mapped(M)
    out = [d.cuMemUnmap(va + M, M)[0] == INVALID,            # nothing mapped there
           d.cuMemUnmap(va, M // 2)[0] == INVALID,           # part of a mapping
           d.cuMemAddressFree(va, M)[0] == INVALID,          # still mapped
           d.cuMemMap(va, M, 0, h, 0)[0] == INVALID,         # mapped already
           d.cuMemMap(12345 << 21, M, 0, h, 0)[0] == INVALID]  # not reserved
    ok(d.cuMemRelease(h))
    out += [d.cuMemRelease(h)[0] == INVALID, on_card() == M]  # released twice; mapped: still on the card
    va2 = int(ok(d.cuMemAddressReserve(M, 0, 0, 0)))
    out += [d.cuMemMap(va2, M, 0, h, 0)[0] == INVALID]        # a released handle is not mapped again
    ok(d.cuMemUnmap(va, M))
    out += [on_card() == 0, d.cuMemUnmap(va, M)[0] == INVALID]
    print(*out)
    """)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"] * 10, r.stdout


FORKER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
typedef int (*i_t)(unsigned); typedef int (*a_t)(unsigned long long *, size_t);
int main(int argc, char **argv) {
    int quiet = atoi(argv[1]), busy = atoi(argv[2]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    i_t init = (i_t)dlsym(h, "cuInit"); a_t alloc = (a_t)dlsym(h, "cuMemAlloc_v2");
    unsigned long long p;
    if (init(0) || alloc(&p, 1 << 20)) return 3;
    for (int i = 0; i < quiet; i++) {      /* children that never use CUDA and leave by _exit */
        pid_t c = fork();
        if (c == 0) _exit(0);
        waitpid(c, NULL, 0);
    }
    int fine = 0;
    for (int i = 0; i < busy; i++) {       /* children that allocate, then leave by _exit */
        pid_t c = fork();
        if (c == 0) _exit(alloc(&p, 4096) ? 1 : 0);
        int st;
        waitpid(c, &st, 0);
        fine += WIFEXITED(st) && WEXITSTATUS(st) == 0;
    }
    printf("%d\n", fine);
    fflush(stdout);
    getchar();  /* hold on until told */
    return 0;
}
"""


def test_forked_children_that_exit_leave_no_slot_taken(card, tmp_path):
    """A child takes a slot when it first uses CUDA, not at fork: 1,000 children that leave by
    _exit without using it take none; 300 that allocate (more than the page's 256 slots) all
    get one, the dead ones' slots taken back as they are needed."""
    env, dirp = card
    pages.create(os.fspath(dirp), [64 * MIB])
    (tmp_path / "forker.c").write_text(FORKER)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(tmp_path / "forker"), os.fspath(tmp_path / "forker.c"), "-ldl"],
                   check=True)
    for quiet, busy, fine in ((1000, 0, 0), (0, 300, 300)):
        p = subprocess.Popen([os.fspath(tmp_path / "forker"), str(quiet), str(busy)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert int(p.stdout.readline()) == fine
        taken = pages.held_by(os.fspath(dirp))
        alive = [pid for pid in taken if os.path.exists(f"/proc/{pid}")]
        assert alive == [p.pid], taken
        if not busy:
            assert list(taken) == [p.pid], "a child that never used CUDA took no slot"
        p.communicate("", timeout=30)


def test_python_multiprocessing_children_take_no_slot(card):
    """multiprocessing's children (fork, leaving through os._exit) of a process using CUDA."""
    env, dirp = card
    pages.create(os.fspath(dirp), [64 * MIB])
    r = py(env, """
        import multiprocessing, os
        from cgpud.gpus import pages
        ok(d.cuInit(0)); ok(d.cuMemAlloc(2**20))
        ctx = multiprocessing.get_context("fork")
        for _ in range(300):
            c = ctx.Process(target=os.getpid)
            c.start(); c.join()
            assert c.exitcode == 0
        print(*pages.held_by(os.environ["CGPU_PAGE_DIR"]), os.getpid())
    """, timeout=120)
    assert r.returncode == 0, r.stderr
    pids = r.stdout.split()
    assert pids == [pids[-1]] * 2, "only the parent holds a slot"


GETPROC = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
typedef int (*gp_t)(const char *, void **, int, unsigned long long, int *);
typedef int (*i_t)(unsigned); typedef int (*aa_t)(unsigned long long *, size_t, void *);
typedef int (*fa_t)(unsigned long long, void *); typedef int (*pool_t)(void **, int);
typedef int (*pa_t)(unsigned long long *, size_t, void *, void *); typedef int (*info1_t)(unsigned *, unsigned *);
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    gp_t gp = (gp_t)dlsym(h, "cuGetProcAddress_v2");
    void *f; int st;
    enum { LEGACY = 1, PER_THREAD = 2 };
    gp("cuInit", &f, 12000, 0, &st); ((i_t)f)(0);
    unsigned long long p, q;
    /* per-thread-default-stream forms stay theirs, and are still charged */
    gp("cuMemAllocAsync", &f, 12000, PER_THREAD, &st); int a = ((aa_t)f)(&p, 3 << 20, 0);
    gp("cuMemFreeAsync", &f, 12000, PER_THREAD, &st); void *free_ptsz = f;
    void *pool; gp("cuDeviceGetDefaultMemPool", &f, 12000, 0, &st); ((pool_t)f)(&pool, 0);
    gp("cuMemAllocFromPoolAsync", &f, 12000, PER_THREAD, &st); int b = ((pa_t)f)(&q, 4 << 20, pool, 0);
    int past = ((pa_t)f)(&q, 1, pool, 0);           /* memsize is 8 MiB: full (the pool's pages: 3 MiB took 4) */
    printf("%d %d %d\n", a, b, past);
    ((fa_t)free_ptsz)(p, 0);
    gp("cuMemFreeAsync", &f, 12000, LEGACY, &st); ((fa_t)f)(q, 0);
    /* cuMemGetInfo asked for at CUDA 2.0 is the 32-bit one: two unsigned ints, nothing past them */
    struct { unsigned free, guard1, total, guard2; } m = {0, 0xdeadbeef, 0, 0xdeadbeef};
    int r = gp("cuMemGetInfo", &f, 2000, 0, &st);
    int info = ((info1_t)f)(&m.free, &m.total);
    printf("%d %d %x %x\n", r, info, m.guard1, m.guard2);
    /* asked for below the version that brought it: the driver's answer, not ours */
    f = (void *)1;
    r = gp("cuMemAllocAsync", &f, 11000, 0, &st);
    printf("%d %p %d\n", r, f, st);
    return 0;
}
"""


def test_cugetprocaddress_wraps_exactly_what_the_driver_returns(card, tmp_path):
    """By (name, version, flags): the per-thread-stream forms of the stream-ordered allocators
    are not swapped for the legacy-stream ones (the stand-in logs which ran), and are charged;
    cuMemGetInfo at version 2000 is CUDA 2.0's 32-bit one, passed through; a name asked for
    below its version gets the driver's CUDA_ERROR_NOT_FOUND."""
    env, dirp = card
    pages.create(os.fspath(dirp), [8 * MIB])
    calls = tmp_path / "calls"
    (tmp_path / "gp.c").write_text(GETPROC)
    subprocess.run(["gcc", "-o", os.fspath(tmp_path / "gp"), os.fspath(tmp_path / "gp.c"), "-ldl"], check=True)
    r = subprocess.run([os.fspath(tmp_path / "gp")], env={**env, "CGPU_STUB_CUDA_CALLS": os.fspath(calls)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["0", "0", "2"], "3 MiB (4 in 2 MiB pages) + 4 MiB fit in 8, one byte more is refused"
    assert lines[1].split() == ["0", "0", "deadbeef", "deadbeef"], "the 32-bit cuMemGetInfo wrote only its two"
    assert lines[2].split() == ["500", "(nil)", "2"], "CUDA_ERROR_NOT_FOUND, VERSION_NOT_SUFFICIENT"
    assert calls.read_text().split() == ["cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync_ptsz",  # (past: refused)
                                         "cuMemFreeAsync_ptsz", "cuMemFreeAsync", "cuMemGetInfo"]


NEXT_A = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
const char *which(void) { return "a"; }
void *next_which(void) { return dlsym(RTLD_NEXT, "which"); }  /* the one after this library: b's */
"""
NEXT_B = 'const char *which(void) { return "b"; }\n'
NEXT_MAIN = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
typedef const char *(*w_t)(void);
void *next_which(void);
int main(void) {
    void *n = next_which();
    printf("%s ", n ? ((w_t)n)() : "none");
    dlsym(RTLD_DEFAULT, "printf");                 /* a process that merely calls dlsym */
    FILE *m = fopen("/proc/self/maps", "r");
    char line[4096]; int cuda = 0, nvml = 0;
    while (fgets(line, sizeof line, m)) { cuda |= !!strstr(line, "libcuda"); nvml |= !!strstr(line, "libnvidia-ml"); }
    printf("%d %d\n", cuda, nvml);
    return 0;
}
"""


def test_dlsym_is_correct_at_any_optimisation_and_loads_no_driver(card, tmp_path):
    """libcgpu built with -O0 (no tail call to lean on): a library's dlsym(RTLD_NEXT) still finds
    the definition after that library, not after libcgpu; and a process that only calls dlsym
    gets neither libcuda nor NVML loaded into it."""
    env, dirp = card
    pages.create(os.fspath(dirp), [MIB])
    lib = tmp_path / "o0"
    r = subprocess.run(["make", "-s", "-B", "-C", os.fspath(ROOT / "native"), "libcgpu", f"LIB={lib}",
                        "LIBCGPU_OPT=-O0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name, src in (("a", NEXT_A), ("b", NEXT_B)):
        (tmp_path / f"{name}.c").write_text(src)
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", os.fspath(tmp_path / f"lib{name}.so"),
                        os.fspath(tmp_path / f"{name}.c"), "-ldl"], check=True)
    (tmp_path / "main.c").write_text(NEXT_MAIN)
    subprocess.run(["gcc", "-o", os.fspath(tmp_path / "main"), os.fspath(tmp_path / "main.c"), f"-L{tmp_path}",
                    "-Wl,--no-as-needed", "-la", "-lb", "-ldl", f"-Wl,-rpath,{tmp_path}"], check=True)
    for preload in (lib / "libcgpu.so", env["LD_PRELOAD"]):
        r = subprocess.run([os.fspath(tmp_path / "main")], env={**env, "LD_PRELOAD": os.fspath(preload)},
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["b", "0", "0"], (preload, r.stdout)


def test_a_driver_whose_constructor_calls_dlsym_does_not_deadlock(card):
    """The stand-in's constructor calls dlsym (CGPU_STUB_CUDA_CTOR_DLSYM) while libcgpu is loading
    it at the first CUDA call: it comes back, and the process is held as ever."""
    env, dirp = card
    pages.create(os.fspath(dirp), [8 * MIB])
    r = py({**env, "CGPU_STUB_CUDA_CTOR_DLSYM": "1"}, """
        ok(d.cuInit(0))
        print(ok(d.cuDeviceTotalMem(ok(d.cuDeviceGet(0)))), d.cuMemAlloc(8 * 2**20 + 1)[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    """, timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(8 * MIB), "True"]


@pytest.mark.parametrize("offset", [0, 400000], ids=["same PIDs", "NVML names host PIDs"])
def test_a_process_filling_what_it_is_told_is_free_is_not_killed(make_daemon, libs, tmp_path, monkeypatch, offset):
    """The driver's own memory (a context: 300 MiB of the stand-in's card, CGPU_STUB_CTX_MIB, which
    NVML's per-process view shows) is the container's too: a `cgpu run --mem 1G` process that
    allocates all cuMemGetInfo calls free (memsize less the context, less the headroom kept for the
    driver's growth) gets CUDA_ERROR_OUT_OF_MEMORY one MiB further, and the
    daemon's NVML watchdog (--mem-action kill) never sees it past memsize. Also where NVML names the
    process by another PID (a container's process by the host's): libcgpu finds which is its own
    as the one that appeared with its first context (the stand-in NVML adds `offset` to every PID;
    the watchdog's own view is then of no process of this instance: it is the library's figure
    that is checked, through cuMemGetInfo)."""
    from nvml_stub import NvmlStub, StubGpu

    stub = NvmlStub(libs, tmp_path / "nvml.conf", cuda_state=tmp_path / "card.state", cuda_pid_offset=offset)
    stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
    stub.write()
    for k, v in {**stub.env({}), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
                 "CGPU_STUB_CTX_MIB": "300"}.items():
        monkeypatch.setenv(k, v)
    d = make_daemon(gpus="nvml", start=False, extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so")])
    d.dev_dir.mkdir()
    (d.dev_dir / "nvidia0").write_text("")
    d.start()
    code = PRELUDE + textwrap.dedent("""
        import time
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        free, total = ok(d.cuMemGetInfo())
        got = [ok(d.cuMemAlloc(free))]
        more = d.cuMemAlloc(2**20)[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        print(free, total, more, ok(d.cuMemGetInfo())[0], flush=True)
        time.sleep(2)  # four looks of the watchdog
        print("alive", flush=True)
    """)
    name = f"fill{os.getpid() % 100000:05d}abc"
    r = subprocess.run([os.fspath(Path(sys.executable).parent / "cgpu"), "run", "--name", name, "--mem", "1G", "--",
                        sys.executable, "-c", code], env={**os.environ, "CGPUD_SOCKET": os.fspath(d.socket)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    headroom = (1 << 30) // 100  # (kept for the driver's growth: 1 % of memsize before any is seen, docs/memory.md)
    free = ((1 << 30) - 300 * MIB - headroom) // (2 * MIB) * (2 * MIB)  # (whole pages: what the card gives, issue 45)
    assert r.stdout.split() == [str(free), str(1 << 30), "True", "0", "alive"], r.stdout
    assert f"memory watchdog: {name}" not in d.log_text()
