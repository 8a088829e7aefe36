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


def test_an_allocation_straddling_the_daemons_reading_is_charged_once(card, tmp_path):
    """The daemon reads the slots, then NVML. A 200 MiB allocation whose driver call is in flight
    across that reading (the stand-in pauses inside it, its memory taken from the card: NVML shows
    it) is in the slot already, so the reading finds no growth of the driver's own: cuMemGetInfo
    after the call says 56 MiB free of 256 (on main the slot said nothing of it until the call
    returned: the reading charged it as the driver's growth and the call again, 200 MiB twice —
    nothing free)."""
    env, dirp = card
    where = os.fspath(dirp)
    pause = tmp_path / "pause"
    p = start({**env, "CGPU_STUB_ALLOC_PAUSE": os.fspath(pause)}, """
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        big = ok(d.cuMemAlloc(200 * 2**20))
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
    """)
    try:
        while not (tmp_path / "pause.in").exists():
            assert p.poll() is None, p.stderr.read()
            os.sched_yield()
        # the daemon's look, while the call is in flight: the slot first, then NVML (the card's record)
        slots, _ = pages.slots(where)
        slot = slots[p.pid]
        allocs = max(0, slot.held[0] - slot.driver[0])
        nvml = 200 * MIB  # (what the stand-in's card holds for the process now: NVML's per-process figure)
        with open(env["CGPU_STUB_CUDA_STATE"], "rb") as f:
            assert int.from_bytes(f.read(8), "little") == nvml
        pages.write_reading(where, slot.index, p.pid, [nvml] + [0] * (pages.MAX_GPUS - 1),
                            [allocs] + [0] * (pages.MAX_GPUS - 1))
        (tmp_path / "pause.go").write_text("")
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    assert out.split() == ["free", str(56 * MIB)], err


BIG_TLS = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
static __thread char big[1 << 20];  /* static TLS: 1 MiB in every thread, the helper's too */
typedef int (*i_t)(unsigned); typedef int (*d_t)(int *, int); typedef int (*c_t)(void **, int);
typedef int (*s_t)(void *); typedef int (*m_t)(void **, const void *); typedef int (*f_t)(void **, void *, const char *);
typedef int (*l_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
typedef int (*y_t)(void);
int main(void) {
    memset(big, 1, sizeof big);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    int dev; void *ctx, *mod, *fn;
    ((i_t)dlsym(h, "cuInit"))(0);
    ((d_t)dlsym(h, "cuDeviceGet"))(&dev, 0);
    ((c_t)dlsym(h, "cuDevicePrimaryCtxRetain"))(&ctx, dev);
    ((s_t)dlsym(h, "cuCtxSetCurrent"))(ctx);
    const char *ptx = ".version 8.0\n.target sm_75\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
    ((m_t)dlsym(h, "cuModuleLoadData"))(&mod, ptx);
    ((f_t)dlsym(h, "cuModuleGetFunction"))(&fn, mod, "k");
    int r = ((l_t)dlsym(h, "cuLaunchKernel"))(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    ((y_t)dlsym(h, "cuCtxSynchronize"))();
    printf("%d %d\n", r, big[12345]);
    fflush(stdout);
    getchar();
    return 0;
}
"""


def test_the_gates_helper_thread_starts_under_a_megabyte_of_static_tls(card, tmp_path):
    """A program with 1 MiB of static TLS (__thread arrays) launches a kernel: its slot says its helper
    thread answers the gate (`gated`). On main the helper's 64 KiB stack could not hold the TLS:
    pthread_create failed and the process ran ungated, silently."""
    env, dirp = card
    (tmp_path / "tls.c").write_text(BIG_TLS)
    subprocess.run(["gcc", "-o", os.fspath(tmp_path / "tls"), os.fspath(tmp_path / "tls.c"), "-ldl"], check=True)
    p = subprocess.Popen([os.fspath(tmp_path / "tls")], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().split() == ["0", "1"], p.stderr.read()
        slots, _ = pages.slots(os.fspath(dirp))
        raw = (dirp / "usage").read_bytes()
        gated = pages.PROC_HEAD.unpack_from(raw, pages.USAGE_HEAD.size + slots[p.pid].index * pages.PROC.size)[1]
        assert gated != 0, "its helper thread answers the gate"
    finally:
        p.kill()
        p.wait()


def test_the_daemon_gives_back_a_dead_process_slot_at_its_look(card):
    """A process holds 100 MiB and is SIGKILLed, no other process of the container running: the
    watchdog's look (its snapshot of the pages, every 0.5 s) gives the 100 MiB back to the instance
    and frees the slot (on main nothing did until a process of the container took a slot)."""
    from cgpud.gpus.memwatch import MemWatchdog

    env, dirp = card
    holder = start(env, HOLDER)
    try:
        assert holder.stdout.readline().split() == ["holding"], holder.stderr.read()
        assert pages.used(os.fspath(dirp))[0] == 100 * MIB
    finally:
        holder.kill()
        holder.wait()
    assert pages.used(os.fspath(dirp))[0] == 100 * MIB, "nothing in the container gave it back"
    MemWatchdog.snapshot([(0, "instanceaaaa", os.fspath(dirp), 0)])
    assert pages.used(os.fspath(dirp))[0] == 0
    assert pages.slots(os.fspath(dirp))[0] == {}


# ---- a slot's process by its start time and its claim, beyond its pid and lock (cgpu_page.h, struct cgpu_ident)

def stat_start(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (proc(5)), read here independently of cgpud's code."""
    raw = open(f"/proc/{pid}/stat").read()
    return int(raw[raw.rindex(")") + 2:].split()[19])


def reading_for(where: str, pid: int, driver: int) -> None:
    """The daemon's reading for pid's slot now: NVML's figure its 100 MiB plus `driver` of the driver's own."""
    slot = pages.slots(where)[0][pid]
    pages.write_reading(where, slot.index, pid, [100 * MIB + driver] + [0] * (pages.MAX_GPUS - 1),
                        [100 * MIB] + [0] * (pages.MAX_GPUS - 1), slot.claim)


def test_an_execd_image_in_its_old_slot_takes_no_reading_of_the_old_image(card):
    """A process holds 100 MiB and the daemon's reading says the driver holds 60 MiB more for it: it
    sees 96 MiB free. It execs; the new image (same pid, same start time) takes the same slot and
    finds all 256 MiB free: the reading was the old image's (on main, the reading's pid being its own,
    it charged the old image's 60 MiB to the new one: 196 MiB free)."""
    env, dirp = card
    after = PRELUDE + textwrap.dedent("""
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
    """)
    p = start(env, f"""
        import os
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        held = ok(d.cuMemAlloc(100 * 2**20))
        print("holding", flush=True)
        sys.stdin.readline()
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
        os.execv(sys.executable, [sys.executable, "-c", {after!r}])
    """)
    try:
        assert p.stdout.readline().split() == ["holding"], p.stderr.read()
        reading_for(os.fspath(dirp), p.pid, 60 * MIB)
        out, err = p.communicate("\n", timeout=60)
    finally:
        p.kill()
        p.wait()
    assert out.split() == ["free", str(96 * MIB), "free", str(256 * MIB)], err


def spawn_as(pid: int, env: dict, code: str) -> subprocess.Popen:
    """A process started with pid `pid` (a reused pid: the kernel's next pid set to it first, as CRIU
    does; another process of the host may take it first, so it is tried until it comes)."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = start(env, code)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    raise AssertionError(f"pid {pid} was never given again")


def test_a_reused_pid_takes_neither_the_slot_nor_the_reading_of_its_dead_predecessor(card):
    """A process holds 100 MiB, with the daemon's reading of 60 MiB more of the driver's, and is
    SIGKILLed; a new process gets the same pid (really: the kernel gives it again) and the same slot:
    it finds all 256 MiB free (on main it took the dead one's reading, its pid matching: 196 MiB)."""
    env, dirp = card
    holder = start(env, HOLDER)
    try:
        assert holder.stdout.readline().split() == ["holding"], holder.stderr.read()
        reading_for(os.fspath(dirp), holder.pid, 60 * MIB)
    finally:
        holder.kill()
        holder.wait()
    asker = spawn_as(holder.pid, env, """
        sys.stdin.readline()  # (CUDA only once it has the pid)
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
    """)
    try:
        out, err = asker.communicate("\n", timeout=60)
    finally:
        asker.kill()
        asker.wait()
    assert out.split() == ["free", str(256 * MIB)], err


def forge(dirp, slot: int, pid: int, start: int, lock: bool):
    """Slot `slot` written for `pid` holding 100 MiB, its record saying it started at `start`; with
    `lock`, its liveness byte locked by a descriptor of this test (one that outlived its process:
    a child made without fork's handlers). The page says its processes lock their slots."""
    import fcntl
    import struct

    usage = dirp / "usage"
    with open(usage, "r+b") as f:
        raw = bytearray(f.read())
        pages.PROC.pack_into(raw, pages.USAGE_HEAD.size + slot * pages.PROC.size, pid, 0, 0, 0, 100 * MIB,
                             *[0] * (pages.MAX_GPUS - 1))
        head = pages.USAGE_HEAD.unpack_from(raw, 0)
        pages.USAGE_HEAD.pack_into(raw, 0, head[0], head[1], head[2] + 100 * MIB, *head[3:])
        struct.pack_into("<I", raw, pages.SLOT_FLAGS_OFFSET, pages.SLOTS_LOCKED)
        pages.IDENT.pack_into(raw, pages.IDENT_OFFSET + slot * pages.IDENT.size, pid, 0, start,
                              os.stat("/proc/self/ns/pid").st_ino, 12345, 0)
        f.seek(0)
        f.write(raw)
    if not lock:
        return None
    fd = os.open(usage, os.O_RDONLY)
    at = pages.USAGE_HEAD.size + slot * pages.PROC.size + pages.LIVENESS_BYTE
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("=hh4xqqi4x", fcntl.F_RDLCK, os.SEEK_SET, at, 1, 0))
    return fd


@pytest.mark.parametrize("reclaimer", ["libcgpu", "daemon"])
@pytest.mark.parametrize("right", [False, True], ids=["reused", "its own"])
def test_a_locked_slot_whose_pid_started_at_another_time_is_dead(card, reclaimer, right):
    """A slot whose liveness byte is locked (by a descriptor that outlived its process) for a live pid
    (this test's) holding 100 MiB: with the start time of that pid in its record it is alive and
    keeps its charge; with another (the pid reused) libcgpu's next process and the daemon's look find
    it dead and give the 100 MiB back (on main the lock alone said alive: the charge stayed)."""
    from cgpud.gpus.memwatch import MemWatchdog

    env, dirp = card
    where = os.fspath(dirp)
    fd = forge(dirp, 5, os.getpid(), stat_start(os.getpid()) + (0 if right else 1), lock=True)
    try:
        assert pages.used(where)[0] == 100 * MIB
        if reclaimer == "daemon":
            MemWatchdog.snapshot([(0, "instanceaaaa", where, 0)])
            free = 256 * MIB - pages.used(where)[0]
        else:
            r = subprocess.run([sys.executable, "-c", PRELUDE + "ok(d.cuInit(0)); print(ok(d.cuMemGetInfo())[0])\n"],
                               env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            free = int(r.stdout)
    finally:
        os.close(fd)
    assert free == (156 if right else 256) * MIB
    assert (os.getpid() in pages.slots(where)[0]) == right


@pytest.mark.parametrize("right", [False, True], ids=["reused", "its own"])
def test_the_switcher_never_waits_for_a_pid_that_started_at_another_time(tmp_path, right):
    """A launching slot that has not answered a closing, its helper draining, its lock held by a live
    process: with that process's start time in its record the switcher waits for it; with another (its
    pid is another process's now) it gives up on it as dead (on main it was waited for to the cap)."""
    from cgpud.sched import native

    d = tmp_path / "c"
    pages.create(os.fspath(d), [256 * MIB])
    usage = d / "usage"
    code = (f"import fcntl, time; f = open({os.fspath(usage)!r}, 'rb'); "
            f"fcntl.lockf(f, fcntl.LOCK_SH, 1, {pages.USAGE_HEAD.size}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        raw = bytearray(usage.read_bytes())
        pages.PROC_HEAD.pack_into(raw, pages.USAGE_HEAD.size, holder.pid, pages.GATED_PER_GPU, 0,
                                  1 | pages.PROC_DRAINING)
        raw[pages.GATED_OFFSET] = 1
        pages.IDENT.pack_into(raw, pages.IDENT_OFFSET, holder.pid, 0, stat_start(holder.pid) + (0 if right else 1),
                              os.stat("/proc/self/ns/pid").st_ino, 12345, 0)
        usage.write_bytes(bytes(raw))
        page = native.Page(os.fspath(d), [0])
        try:
            page.freeze(0)
            assert page.undrained(0) == [0]
            assert page.give_up(0) == ([] if right else [(0, "dead")])
        finally:
            page.thaw(0)
            page.release()
    finally:
        holder.kill()
        holder.wait()


def test_the_python_ident_block_is_the_headers(tmp_path):
    """struct cgpu_usage_ident's place and size in the usage file, as cgpu_page.h lays it out."""
    prog = tmp_path / "ident.c"
    prog.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "cgpu_page.h"\n'
                    'int main(void){printf("%zu %zu %zu %zu\\n", sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver)'
                    ' + sizeof(struct cgpu_usage_busy) + sizeof(struct cgpu_usage_gang), sizeof(struct cgpu_ident),'
                    ' offsetof(struct cgpu_ident, read_claim), sizeof(struct cgpu_usage) + sizeof(struct cgpu_usage_driver)'
                    ' + sizeof(struct cgpu_usage_busy) + sizeof(struct cgpu_usage_gang) + sizeof(struct cgpu_usage_ident));'
                    ' return 0;}\n')
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    subprocess.run(["gcc", f"-I{root / 'native' / 'libcgpu'}", "-o", os.fspath(tmp_path / "ident"), os.fspath(prog)],
                   check=True)
    out = subprocess.run([os.fspath(tmp_path / "ident")], capture_output=True, text=True, check=True).stdout.split()
    assert list(map(int, out)) == [pages.IDENT_OFFSET, pages.IDENT.size, 32, pages.IDENT_END]


def test_a_reading_that_lowers_a_sleeping_processs_charge_frees_the_room_for_its_siblings(card):
    """A holds 100 MiB and a reading says the driver holds 60 MiB more for it: charged 160 MiB of the
    256 MiB instance. Two readings in a row then say the driver's 60 MiB are gone, while A sleeps. Its
    sibling B, looking between the two (cuMemGetInfo), still sees 96 MiB free (one reading low is not
    believed); after the second it sees 156 MiB and allocates 150 MiB (issue 45, item 7). Before,
    the shrink waited for A's next call: B got 96 MiB and out-of-memory."""
    env, dirp = card
    where = os.fspath(dirp)

    def said(p: subprocess.Popen) -> list[str]:
        line = p.stdout.readline().split()
        if not line:  # (it failed: what it said, once it is gone)
            p.stdin.close()
            line = ["exited:", p.stderr.read()]
        return line
    a = start(env, """
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        held = ok(d.cuMemAlloc(100 * 2**20))
        print("holding", flush=True)
        sys.stdin.readline()
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
        sys.stdin.readline()
        print("free", ok(d.cuMemGetInfo())[0], flush=True)
    """)
    b = None
    try:
        assert said(a) == ["holding"]
        reading_for(where, a.pid, 60 * MIB)
        a.stdin.write("\n")
        a.stdin.flush()
        assert said(a) == ["free", str(96 * MIB)]  # A applied it: 160 MiB
        reading_for(where, a.pid, 0)                        # A sleeps; the driver's 60 MiB are gone
        b = start(env, """
            ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
            print("free", ok(d.cuMemGetInfo())[0], flush=True)
            sys.stdin.readline()
            print("free", ok(d.cuMemGetInfo())[0], d.cuMemAlloc(150 * 2**20)[0].name, flush=True)
            sys.stdin.readline()
        """)
        assert said(b) == ["free", str(96 * MIB)]  # one reading: not yet
        reading_for(where, a.pid, 0)                        # the second in a row
        b.stdin.write("\n")
        b.stdin.flush()
        assert said(b) == ["free", str(156 * MIB), "CUDA_SUCCESS"]
        assert pages.used(where)[0] == 250 * MIB
        a.stdin.write("\n")
        a.stdin.flush()
        assert said(a) == ["free", str(6 * MIB)]  # A's own look: nothing twice
    finally:
        for p in (a, b) if b else (a,):
            p.kill()
            p.wait()
