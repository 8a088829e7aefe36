"""A process's slot in its container's usage page is alive by an open-file-description lock, not by
its pid (issue 34, item 6; cgpu_page.h, CGPU_SLOTS_LOCKED; docs/memory.md, "When memory is
returned"). A SIGKILLed sibling's charge comes back at the next allocation refused or cuMemGetInfo
of a live process (it stayed until a new process took a slot); an exec'd process's old charge goes
(its pid lives on); a slot whose pid is alive but whose byte nobody locks (a reused pid) is dead."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cgpud.gpus import pages
from test_libcgpu import PRELUDE, build_libs

MIB = 1 << 20


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build_libs(tmp_path_factory.mktemp("slots"))


@pytest.fixture
def card(libs, tmp_path):
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card.state"), "CGPU_STUB_CUDA_MIB": "16384",
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "PATH": os.environ["PATH"]}
    pages.create(os.fspath(tmp_path / "pages"), [256 * MIB])
    return env, tmp_path / "pages"


def start(env: dict, code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


HOLDER = """
ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
held = ok(d.cuMemAlloc(100 * 2**20))
print("holding", flush=True)
sys.stdin.readline()
"""

ASK = """
ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
print("free", ok(d.cuMemGetInfo())[0], flush=True)
sys.stdin.readline()
print("free", ok(d.cuMemGetInfo())[0], flush=True)
"""


def test_a_sigkilled_siblings_charge_comes_back_to_a_live_process(card):
    """Two processes of one 256 MiB container: one holds 100 MiB and is SIGKILLed. The other, which
    had its slot before, sees all 256 MiB free at its next cuMemGetInfo (on main the dead one's
    100 MiB stayed charged until some process took a new slot)."""
    env, dirp = card
    holder = start(env, HOLDER)
    assert holder.stdout.readline().split() == ["holding"], holder.stderr.read()
    asker = start(env, ASK)
    try:
        assert asker.stdout.readline().split() == ["free", str(156 * MIB)], asker.stderr.read()
        holder.kill()
        holder.wait()
        asker.stdin.write("\n")
        asker.stdin.flush()
        assert asker.stdout.readline().split() == ["free", str(256 * MIB)], asker.stderr.read()
    finally:
        for p in (holder, asker):
            p.kill()
            p.wait()


def test_an_execd_process_leaves_no_charge_behind(card):
    """A process holds 100 MiB and execs a new image (its pid lives on, its CUDA state does not): the
    new image, asking, finds all 256 MiB free (on main the old slot, alive by its pid, kept 100 MiB
    charged for as long as the pid lived)."""
    env, _ = card
    after = PRELUDE + textwrap.dedent("""
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(f"""
        import os
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        held = ok(d.cuMemAlloc(100 * 2**20))
        os.execv(sys.executable, [sys.executable, "-c", {after!r}])
    """)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["free", str(256 * MIB)]


def test_a_slot_whose_pid_lives_but_whose_byte_nobody_locks_is_dead(card, libs):
    """A slot written for a live pid (a reused pid: here this test's own) that holds 100 MiB, its
    liveness byte unlocked, in a page whose processes hold their liveness locks: a new process finds
    it dead and has all 256 MiB (on main a live pid kept the charge)."""
    env, dirp = card
    where = os.fspath(dirp)
    # one process through libcgpu first: the page says its processes lock their slots
    r = subprocess.run([sys.executable, "-c", PRELUDE + "ok(d.cuInit(0)); ok(d.cuMemGetInfo())\n"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with open(dirp / "usage", "r+b") as f:
        raw = bytearray(f.read())
        drv = pages.USAGE_HEAD.size + pages.MAX_PROCS * pages.PROC.size
        assert int.from_bytes(raw[drv + 4:drv + 8], "little") & 1, "CGPU_SLOTS_LOCKED"
        pages.PROC.pack_into(raw, pages.USAGE_HEAD.size + 5 * pages.PROC.size, os.getpid(), 0, 0, 0, 100 * MIB,
                             *[0] * (pages.MAX_GPUS - 1))
        used = pages.USAGE_HEAD.unpack_from(raw, 0)
        pages.USAGE_HEAD.pack_into(raw, 0, used[0], used[1], 100 * MIB, *used[3:])
        f.seek(0)
        f.write(raw)
    assert pages.used(where)[0] == 100 * MIB
    r = subprocess.run([sys.executable, "-c", PRELUDE + "ok(d.cuInit(0)); print(ok(d.cuMemGetInfo())[0])\n"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(256 * MIB)]
    assert pages.used(where)[0] == 0
