"""Memory shared between processes through cuMem shareable handles (issue 45, item 11): NCCL's cuMem
buffers, PyTorch's expandable segments shared with another process, RL weight sync. The exporter
makes the memory (cuMemCreate), exports a POSIX file descriptor and passes it over a unix socket
(SCM_RIGHTS, as NVIDIA's memMapIPCDrv sample does); the importer imports and maps it. The driver
frees the memory once every holder released its handle and unmapped it (cuMemRelease's reference).

No GPU here: the stand-in driver keeps such memory on its card until its last holder lets go
(native/stubs/card.c); two Python processes on NVIDIA's cuda-bindings are the programs."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cgpud.gpus import pages
from test_libcgpu import MIB, PRELUDE, VMM, build_libs

SHARED = 32 * MIB
MEMSIZE = 64 * MIB

HOLDER = PRELUDE + textwrap.dedent(VMM) + textwrap.dedent("""
    import socket
    FD = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    p.requestedHandleTypes = FD
    def say(*what):
        print(*what, flush=True)
    def told():
        return sys.stdin.readline().strip()
    def unmapped(h, va, size):
        ok(d.cuMemRelease(h))
        ok(d.cuMemUnmap(va, size))
        ok(d.cuMemAddressFree(va, size))
    M, S, AT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    MIB = 1 << 20
""")

EXPORTER = HOLDER + textwrap.dedent("""
    h, va = mapped(M)
    fd = ok(d.cuMemExportToShareableHandle(h, FD, 0))
    before = [used(), on_card()]
    s = socket.socket(socket.AF_UNIX)
    s.connect(AT)
    socket.send_fds(s, [b"h"], [fd])
    os.close(fd)
    say("sent", *before)
    assert told() == "release"
    unmapped(h, va, M)                        # the exporter lets go; the importer still maps it
    say("released", used(), on_card())
    more = ok(d.cuMemGetInfo())[0]            # what the instance may still take, as it is told
    past = d.cuMemAlloc(S - M + 2 * MIB)[0]   # what would take the card past memsize with the shared memory
    fits = d.cuMemAlloc(S - M)[0]             # all the room there is
    say("allocated", more, past.name, fits.name, used(), on_card())
""")

IMPORTER = HOLDER + textwrap.dedent("""
    s = socket.socket(socket.AF_UNIX)
    s.bind(AT)
    s.listen(1)
    say("listening")
    c, _ = s.accept()
    _, (fd,), _, _ = socket.recv_fds(c, 16, 1)
    h = ok(d.cuMemImportFromShareableHandle(fd, FD))
    os.close(fd)
    va = int(ok(d.cuMemAddressReserve(M, 0, 0, 0)))
    ok(d.cuMemMap(va, M, 0, h, 0))
    ok(d.cuMemSetAccess(va, M, [a], 1))
    say("mapped", used(), on_card())
    while (cmd := told()) == "look":          # after the exporter died: what the card keeps, whose it shows
        ok(d.cuMemGetInfo())                  # (the stand-in gives a dead process's memory back here)
        with open(os.environ["CGPU_STUB_CUDA_STATE"], "rb") as f:
            f.seek(256)                       # (card.c's records: {int32 pid, int32 card, uint64 bytes})
            raw = f.read(1024 * 16)
        mine = sum(int.from_bytes(raw[i + 8:i + 16], "little") for i in range(0, len(raw), 16)
                   if int.from_bytes(raw[i:i + 4], "little") == os.getpid())
        say("looked", on_card(), mine)
    assert cmd == "drop"
    unmapped(h, va, M)
    say("dropped", used(), on_card())
""")


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    return build_libs(tmp_path_factory.mktemp("ipc"))


class Pair:
    """The importer (listening first) and the exporter, each a Python process on cuda-bindings,
    driven a line at a time."""

    def __init__(self, env: dict, tmp: Path):
        at = os.fspath(tmp / "ipc.sock")
        args = [str(SHARED), str(MEMSIZE), at]
        self.importer = self._start(IMPORTER, args, env)
        assert self.read(self.importer) == ["listening"]
        self.exporter = self._start(EXPORTER, args, env)

    @staticmethod
    def _start(script: str, args: list[str], env: dict) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", script, *args], env=env, text=True, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1)

    @staticmethod
    def read(p: subprocess.Popen) -> list[str]:
        line = p.stdout.readline()
        if not line:
            p.wait(timeout=30)
            raise AssertionError(f"exited {p.returncode}: {p.stderr.read()}")
        return line.split()

    @staticmethod
    def tell(p: subprocess.Popen, what: str) -> None:
        p.stdin.write(what + "\n")
        p.stdin.flush()

    def close(self) -> None:
        for p in (self.importer, self.exporter):
            if p.poll() is None:
                p.kill()
            p.wait()


def run_pair(env: dict, tmp: Path) -> dict[str, list[int | str]]:
    """Export, import and map; the exporter releases and allocates; the importer drops. Each step's
    words (the page's usage, the card's, the allocations' answers)."""
    pair = Pair(env, tmp)
    said = {}
    try:
        said["sent"] = pair.read(pair.exporter)
        said["mapped"] = pair.read(pair.importer)
        pair.tell(pair.exporter, "release")
        said["released"] = pair.read(pair.exporter)
        said["allocated"] = pair.read(pair.exporter)
        pair.tell(pair.importer, "drop")
        said["dropped"] = pair.read(pair.importer)
    finally:
        pair.close()
    return {k: [int(w) if w.isdigit() else w for w in v[1:]] for k, v in said.items()}


def test_the_stand_in_keeps_exported_memory_until_its_last_holder_lets_go(libs, tmp_path):
    """Without libcgpu: the exporter's release and unmap leave the memory on the card while the
    importer maps it; the importer's release and unmap free it."""
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
           "CGPU_PAGE_DIR": "", "PATH": os.environ["PATH"]}
    pages.create(os.fspath(tmp_path / "pages"), [MEMSIZE])  # (read by the scripts' used(); nothing charges it)
    env["CGPU_PAGE_DIR"] = os.fspath(tmp_path / "pages")
    said = run_pair(env, tmp_path)
    assert said["sent"][1] == SHARED and said["mapped"][1] == SHARED
    assert said["released"][1] == SHARED, said  # the importer still maps it: on the card
    assert said["allocated"][1:3] == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    assert said["dropped"][1] == 2 * (MEMSIZE - SHARED) + 2 * MIB, said  # (the exporter's allocations only)


def test_an_exporters_release_never_lets_the_instance_pass_memsize_while_an_importer_maps(libs, tmp_path):
    """One instance of 64 MiB: the exporter shares 32 MiB, the importer maps them, the exporter
    lets go and allocates again. Every holder is charged what it holds (docs/memory.md, "Memory
    shared between processes"): the importer from its mapping, so the exporter gets the 32 MiB
    left and no more (out-of-memory 2 MiB past), and the card never holds more than memsize for the
    instance. Before, the importer was charged nothing and the exporter was refunded at its release:
    it allocated 34 MiB more, the card held 66 MiB of a 64 MiB instance (the watchdog's kill on a
    card)."""
    pages.create(os.fspath(tmp_path / "pages"), [MEMSIZE])
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"), "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"),
           "PATH": os.environ["PATH"]}
    said = run_pair(env, tmp_path)
    assert said["sent"] == [SHARED, SHARED], said
    assert said["mapped"] == [2 * SHARED, SHARED], said  # both hold it: both charged (the cost of not knowing)
    assert said["released"] == [SHARED, SHARED], said    # the importer's charge stays
    more, past, fits, used, on_card = said["allocated"]
    assert more == MEMSIZE - SHARED, said
    assert (past, fits) == ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_SUCCESS"), said
    assert used == MEMSIZE and on_card == MEMSIZE, said
    assert said["dropped"] == [MEMSIZE - SHARED, MEMSIZE - SHARED], said  # the last holder let go: freed, refunded


def test_the_stand_in_keeps_exported_memory_when_its_exporter_dies_while_an_importer_maps_it(libs, tmp_path):
    """Without libcgpu: the exporter is SIGKILLed while the importer maps its memory. The card keeps
    it (the importer's handle and mapping hold it) and NVML's per-process view shows it on the
    importer now; the importer's release and unmap free it. (A stand-in that gave a dead exporter's
    memory back with the rest of its own would be kinder than the card.)"""
    pages.create(os.fspath(tmp_path / "pages"), [MEMSIZE])
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "PATH": os.environ["PATH"]}
    pair = Pair(env, tmp_path)
    try:
        assert pair.read(pair.exporter)[0] == "sent"
        assert pair.read(pair.importer) == ["mapped", "0", str(SHARED)]
        pair.exporter.kill()
        pair.exporter.wait()
        pair.tell(pair.importer, "look")
        assert pair.read(pair.importer) == ["looked", str(SHARED), str(SHARED)]
        pair.tell(pair.importer, "drop")
        assert pair.read(pair.importer) == ["dropped", "0", "0"]
    finally:
        pair.close()
