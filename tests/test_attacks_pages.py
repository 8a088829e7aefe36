"""Forged usage pages (issue 44; SPEC §9; docs/security.md, "Pages"): the pages' directory is the
container's, read-write, so a root process of it can write any slot. Nothing it writes there may
hold a neighbour past one drain bound at a closing.

The forger here is a process of its own (as a container's process is) that marks a slot of its
instance's usage page gated, draining, `acked` kept one closing behind the gate (rewritten at every
closing), and holds a lock on the slot's byte, the lock the daemon asks about: an open file
description's lock (F_GETLK names no process: l_pid -1), or a POSIX lock of a live process. The
switcher (cgpud.sched.native, one per GPU, as the daemon drives it) switches between the forger's
instance and a neighbour's; each switch away from the forger is timed. Before this, every one of
those switches waited for the forged slot up to the cap (5 s), and changing `acked` cleared the
"given up" mark: the neighbour's gate was shut all but a slice in 5 s."""
from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from cgpud.sched import native
from cgpud.sched.policies import Params
from test_gate import libs  # noqa: F401  (the fixture)
from test_switcher import cancel, wait_step

GIB = 1 << 30
BOUND = 0.05  # the drain bound the switcher is given here (a 25 ms slice's)

FORGER = r"""
import fcntl, mmap, os, struct, sys, time
d, slot, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
PROC_AT, GATED_AT, CLOSINGS_AT, PER_GPU, DRAINING = (int(a) for a in sys.argv[4:9])
fd = os.open(os.path.join(d, "usage"), os.O_RDWR)
lock = struct.pack("=hh4xqqi4x", fcntl.F_RDLCK, 0, PROC_AT, 1, 0)
fcntl.fcntl(fd, fcntl.F_OFD_SETLK if kind == "ofd" else fcntl.F_SETLK, lock)
lf = os.open(os.path.join(d, "limits"), os.O_RDONLY)
lim = mmap.mmap(lf, 0, prot=mmap.PROT_READ)
gated = struct.unpack_from("<I", os.pread(fd, 4, GATED_AT + 4 * (slot // 32)))[0]
os.pwrite(fd, struct.pack("<I", gated | 1 << (slot % 32)), GATED_AT + 4 * (slot // 32))
said = False
while True:  # one closing behind, draining, always
    c = struct.unpack_from("<I", lim, CLOSINGS_AT)[0]
    os.pwrite(fd, struct.pack("<i3I", 4_000_000 + slot, PER_GPU, (c - 1) & 0xFFFFFFFF, 1 | DRAINING), PROC_AT)
    if not said:
        print("forging", flush=True)
        said = True
    time.sleep(0.0005)
"""


def forge(directory: Path, slot: int, kind: str) -> subprocess.Popen:
    """Start a forger of slot `slot` of the usage page in `directory` (its lock: "ofd" or "posix")."""
    p = subprocess.Popen([sys.executable, "-c", FORGER, os.fspath(directory), str(slot), kind,
                          str(pages.USAGE_HEAD.size + slot * pages.PROC.size), str(pages.GATED_OFFSET),
                          str(pages.CLOSINGS_OFFSET), str(pages.GATED_PER_GPU), str(pages.PROC_DRAINING)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "forging", p.stderr.read()
    return p


@pytest.fixture
def forged(tmp_path):
    """Two instances' pages on node GPU 0 (the forger's, a neighbour's) and a switcher for GPU 0 with the
    daemon's drain bound and cap (Params' default); start(kind) starts the forger in the first."""
    dirs = [tmp_path / "forger", tmp_path / "neighbour"]
    for d in dirs:
        pages.create(os.fspath(d), [GIB])
    ps = [native.Page(os.fspath(d), [0]) for d in dirs]
    for p in ps:
        p.set_shared(0, True, 2000)
    limit = Params(slice=BOUND / 2).drain_limit
    sw = native.Switcher(0, BOUND, limit)
    procs = []

    def start(kind: str) -> None:
        procs.append(forge(dirs[0], 3, kind))

    yield start, ps, sw
    sw.close()
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    for p in ps:
        p.thaw(None)
        p.release()


def _switches_away(ps, sw, n: int = 4) -> list[native.Report]:
    """n turns of the forger (index 0), each followed by the neighbour's: the reports of the switches
    that closed the forger's gate (each one's drain is what the neighbour waited)."""
    steps = []
    for _ in range(n):
        steps += [(0.02, 0, 0), (0.02, 1, 0)]
    steps.append((30.0, 0, native.NOTIFY))
    assert sw.submit(1, ps, [True, True], steps)
    ended = wait_step(sw, 1, len(steps) - 1, timeout=8 * 5.0 + 10)
    cancel(sw)
    return [r for r in ended if r.run == 1]


@pytest.mark.parametrize("kind,times", [("ofd", 1), ("posix", 3)])
def test_a_forged_draining_slot_holds_the_neighbour_no_longer_than_one_drain_bound(forged, kind, times):
    """Each switch away from the forger waits one drain bound at most. An OFD lock names no process:
    the slot is forged, the page damaged at once (not read again: never waited for again). A live
    process's lock that keeps its slot draining is given up on at the bound, each time it moves its
    acked past the closing it was given up at; the third time the page is damaged."""
    start, ps, sw = forged
    start(kind)
    away = _switches_away(ps, sw, 7)
    waits = [round(r.drain_ns / 1e9, 3) for r in away]
    assert len(waits) == 7
    assert max(waits) < BOUND + 0.04, f"the neighbour waited {waits} s at the switches (bound {BOUND} s)"
    assert sum(waits) < times * BOUND + 0.06, f"the forged slot was waited for again at later switches: {waits} s"
    assert waits[-1] < 0.01 and waits[-2] < 0.01, f"the page still holds the neighbour: {waits} s"
    if kind == "ofd":  # (said so)
        assert native.GAVE_UP[away[0].why].startswith("forged"), away[0].why
    why = ps[0].damage()
    assert why and ("forged" in why if kind == "ofd" else "past the drain bound" in why), why


def test_a_forged_slot_given_up_on_stays_so_whatever_its_acked_does(tmp_path, forged):
    """The "given up" mark is the daemon's: a slot whose `acked` moves (still behind each closing) is not
    waited for again; it is once it has answered the closing it was given up at."""
    start, ps, sw = forged
    start("ofd")
    page = ps[0]
    page.freeze(0)
    assert page.undrained(0) == [3]
    assert [s for s, _ in page.give_up(0)] == [3]
    for _ in range(3):  # (later closings: the forger moves its acked after each)
        page.thaw(0)
        page.freeze(0)
        assert page.undrained(0) == [], "the forged slot is waited for again after moving its acked"


def test_a_container_cannot_point_the_library_at_pages_of_its_own(make_daemon, libs, tmp_path):  # noqa: F811
    """A process of a container (cgpu-runtime in front of real runc, 1 GiB) that names a page of its
    own in CGPU_PAGE_DIR (made by it, 12 GiB) still gets its container's pages at /run/cgpu: the card
    is 1 GiB to it and one byte past is refused. Before, the library took the environment's word."""
    from test_libcgpu import client_rootfs, run_prepared

    share, rootfs = client_rootfs(libs, tmp_path)
    pages.create(os.fspath(share / "mine"), [12 * GIB])
    r, _, _, _ = run_prepared(make_daemon, libs / "libcgpu.so", tmp_path, rootfs, share,
                              "CGPU_PAGE_DIR=/share/mine /share/client",
                              [{"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}])
    assert r.returncode == 0, r.stdout + r.stderr
    total, fit, past, _ = r.stdout.split()
    assert (int(total), fit, past) == (GIB, "0", "2"), f"the container's own page was obeyed: {r.stdout}"


def _through_closings(libs: Path, tmp: Path, forged: bool, closings: int = 15) -> float:  # noqa: F811
    """A launcher of 1 ms kernels on GPU 0 of a two-GPU page, its gate closed `closings` times (20 ms
    each) as the scheduler closes it; with `forged`, a slot of the page (gated on GPU 1, never waited
    for there) says 2**40 launches. The kernels that started after a closing was answered, per closing."""
    from cgpud.sched.gate import GateFreezer
    from test_gate import kernels

    d = tmp / ("forged" if forged else "honest")
    pages.create(os.fspath(d), [GIB, GIB])
    gate = GateFreezer(os.fspath(d), gpus=[0, 1])
    gate.share(None, True, 2000)
    live = os.open(d / "usage", os.O_RDONLY)  # (a live process's slot, as libcgpu's processes tell one)
    if forged:  # (what a process of the container writes: a rank on GPU 1, far ahead)
        slot = 9
        fcntl.fcntl(live, fcntl.F_OFD_SETLK, struct.pack("=hh4xqqi4x", fcntl.F_RDLCK, 0, pages.USAGE_HEAD.size
                                                         + slot * pages.PROC.size + pages.LIVENESS_BYTE, 1, 0))
        with open(d / "usage", "r+b") as f:
            f.seek(pages.USAGE_HEAD.size + slot * pages.PROC.size)
            f.write(pages.PROC_HEAD.pack(os.getpid(), pages.GATED_PER_GPU, 0, 0b10))
            f.seek(pages.GANG_OFFSET + slot * pages.GANG.size + 8)  # (its launched[1])
            f.write((1 << 40).to_bytes(8, "little"))
            f.seek(pages.GATED_OFFSET)
            f.write((1 << slot).to_bytes(4, "little"))
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_PAGE_DIR": os.fspath(d), "CGPU_STUB_CUDA_DEVICES": "2",
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp / f"card-{d.name}"), "CGPU_STUB_CUDA_LOG": os.fspath(tmp / f"{d.name}.log")}
    p = subprocess.Popen([os.fspath(libs / "launcher"), "30", "1000", "0"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    answered = []
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        for _ in range(closings):
            time.sleep(0.02)
            gate.freeze(0)
            at, t0 = time.monotonic_ns(), time.monotonic()
            while gate.undrained(0):
                assert time.monotonic() - t0 < 2, f"not drained: {gate.undrained(0)}"
                time.sleep(0.0002)
            time.sleep(0.02)
            answered.append((at, time.monotonic_ns()))
            gate.thaw(0)
    finally:
        p.kill()
        p.wait()
        gate.thaw()
        gate.close()
        os.close(live)
    starts = [s for _, s, _ in kernels(tmp / f"{d.name}.log")]
    return sum(1 for s in starts for a, b in answered if a < s < b) / closings


def test_a_forged_ranks_count_lets_no_launch_through_a_closing(libs, tmp_path):  # noqa: F811
    """A gang's catch-up lets a rank that is behind through a closing (the half of a collective a closing
    cut). A forged slot far ahead made every process of the instance such a rank: its launches passed
    each closing, past the answer. Counts more than 2 * GANG_CATCH_UP apart are not ranks of one
    collective: none passes, as with no forged slot."""
    honest, forged = _through_closings(libs, tmp_path, False), _through_closings(libs, tmp_path, True)
    assert forged <= honest + 0.5, f"kernels started after the closing was answered, per closing: {forged} " \
                                   f"(honest: {honest})"
