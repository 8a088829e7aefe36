"""Activity detection on real processes: a process of the instance opens the
simulated GPU's device file -> active at the next check; it closes it, or is
killed -> idle at the next check. Nothing else counts."""
from __future__ import annotations

import os
import statistics
import subprocess
import time

import pytest

from cgpud.sched.activity import MEMBER_RECHECK, ActivityMonitor
from cgpud.sched.enforce import KIND_CGROUP2, KIND_FREEZER, KIND_SIGNAL
from cgpud.sched.enforce_api import Activity

from test_enforce import lab, wait_until  # noqa: F401  (lab is a fixture)

# A process that opens/closes a path on command and answers with the time
# (CLOCK_MONOTONIC, the same clock in every process) once the call returned.
HOLDER = """
import os, sys, time
fds = {}
for line in sys.stdin:
    cmd, _, path = line.strip().partition(" ")
    if cmd == "open":
        fds[path] = os.open(path, os.O_RDONLY)
    elif cmd == "close":
        os.close(fds.pop(path))
    elif cmd == "chroot":
        os.chroot(path)
    print(time.monotonic(), flush=True)
"""


class Holder:
    def __init__(self, lab, *groups: str, new_session: bool = True) -> None:
        self.proc = lab.spawn(*groups, code=HOLDER, new_session=new_session,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def do(self, cmd: str, path: str = "") -> float:
        """Send one command; the monotonic time at which it was done."""
        self.proc.stdin.write(f"{cmd} {path}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())


@pytest.fixture
def devices(tmp_path) -> list[str]:
    """Two simulated GPUs' device files, as the daemon makes them (--dev-dir)."""
    (tmp_path / "dev").mkdir()
    paths = [str(tmp_path / "dev" / f"simgpu{i}") for i in range(2)]
    for p in paths:
        with open(p, "w") as f:
            f.write("GPU-test\n")
    return paths


@pytest.fixture
def monitor(devices):
    mon = ActivityMonitor({0: devices[0], 1: devices[1]}, fanotify=True)
    yield mon
    mon.close()


def test_open_is_seen_at_the_next_check_and_close_too(lab, monitor, devices, capsys):
    assert monitor.using_fanotify, "fanotify is not available: the daemon runs as root with CAP_SYS_ADMIN"
    g = lab.group(KIND_CGROUP2)
    h = Holder(lab, g)
    monitor.watch(0, "a", cgroups=[g])
    monitor.watch(1, "a", cgroups=[g])  # the same container on another GPU
    assert not monitor.active(0, "a") and not monitor.active(1, "a")

    opened, closed = [], []
    for _ in range(20):
        h.do("open", devices[0])
        assert monitor.active(0, "a"), "not active at the first check after open() returned"
        assert not monitor.active(1, "a"), "GPU 0's device made the instance on GPU 1 active"
        h.do("close", devices[0])
        assert not monitor.active(0, "a"), "still active at the first check after close() returned"
    # latency: how long after the open()/close() a check loop sees it
    for _ in range(20):
        h.proc.stdin.write(f"open {devices[0]}\n")
        h.proc.stdin.flush()
        while not monitor.active(0, "a"):
            pass
        seen = time.monotonic()
        opened.append(seen - float(h.proc.stdout.readline()))
        h.proc.stdin.write(f"close {devices[0]}\n")
        h.proc.stdin.flush()
        while monitor.active(0, "a"):
            pass
        seen = time.monotonic()
        closed.append(seen - float(h.proc.stdout.readline()))
    with capsys.disabled():
        print(f"\n  open -> seen active: median {statistics.median(opened) * 1e6:.0f} µs, max {max(opened) * 1e6:.0f} µs;"
              f" close -> seen idle: median {statistics.median(closed) * 1e6:.0f} µs, max {max(closed) * 1e6:.0f} µs"
              " (negative: seen before the child could report)")


def test_only_the_instance_processes_count(lab, monitor, devices):
    g = lab.group(KIND_CGROUP2)
    member = Holder(lab, g)
    stranger = Holder(lab)
    monitor.watch(0, "a", cgroups=[g])
    stranger.do("open", devices[0])
    assert not monitor.active(0, "a")
    member.do("open", str(os.path.dirname(devices[0])))  # a directory: not the device
    member.do("open", devices[1])                         # another GPU's device
    assert not monitor.active(0, "a")
    member.do("open", devices[0])
    assert monitor.active(0, "a")
    stranger.do("close", devices[0])
    assert monitor.active(0, "a")


def test_instances_by_process_group_pid_and_v1_group(lab, monitor, devices):
    v1 = lab.group(KIND_FREEZER)
    by_pgid, by_pid, by_v1 = Holder(lab), Holder(lab), Holder(lab, v1)
    monitor.watch_target(0, "pgid", {"kind": KIND_SIGNAL, "pgid": by_pgid.pid})
    monitor.watch(0, "pid", pids=[by_pid.pid])
    monitor.watch_target(0, "v1", {"kind": KIND_FREEZER, "path": v1})
    for h, name in ((by_pgid, "pgid"), (by_pid, "pid"), (by_v1, "v1")):
        h.do("open", devices[0])
        assert monitor.snapshot() == {(0, n): n == name for n in ("pgid", "pid", "v1")}
        h.do("close", devices[0])
        assert not monitor.active(0, name)
    monitor.unwatch(0, "v1")
    by_v1.do("open", devices[0])
    assert not monitor.active(0, "v1"), "an instance no longer watched is idle"


def test_a_killed_holder_goes_idle_and_a_forked_holder_keeps_it_active(lab, monitor, devices):
    g = lab.group(KIND_CGROUP2)
    h = Holder(lab, g)
    monitor.watch(0, "a", cgroups=[g])
    h.do("open", devices[0])
    assert monitor.active(0, "a")
    h.proc.kill()
    h.proc.wait()
    assert not monitor.active(0, "a"), "still active after the holder was killed and reaped"
    # a descriptor inherited by a child: the parent's exit leaves the child holding it
    parent = lab.spawn(g, code=f"import os, time\nfd = os.open({devices[0]!r}, os.O_RDONLY)\n"
                                "if os.fork() == 0:\n    time.sleep(600)\n", stdin=subprocess.DEVNULL)
    assert parent.wait(10) == 0
    assert wait_until(lambda: monitor.active(0, "a"), 1), "the child holding the device is not seen"


def test_a_device_node_no_mark_covers_is_found_by_the_rescan(lab, tmp_path, capsys):
    """A container's own mknod'd /dev/nvidia0: same device number, another
    inode. The round robin finds it within rescan_interval."""
    (tmp_path / "host").mkdir()
    (tmp_path / "ctr").mkdir()
    host, ctr = tmp_path / "host" / "nvidia0", tmp_path / "ctr" / "nvidia0"
    for node in (host, ctr):
        os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))  # a char device (1,3: /dev/null's driver)
    mon = ActivityMonitor({0: str(host)}, fanotify=True, rescan_interval=0.2)
    try:
        g = lab.group(KIND_CGROUP2)
        h = Holder(lab, g)
        mon.watch(0, "a", cgroups=[g])
        assert not mon.active(0, "a")  # the round robin's first turn is at once: spend it
        t = h.do("open", str(ctr))
        assert not mon.active(0, "a"), "seen at once: then a mark covers it, and this test tests nothing"
        assert wait_until(lambda: mon.active(0, "a"), 1.0, step=0), "not seen within 5 rescan intervals"
        with capsys.disabled():
            print(f"\n  unmarked inode: seen by the rescan after {(time.monotonic() - t) * 1000:.0f} ms"
                  f" (rescan_interval {mon.rescan_interval} s)")
        h.do("open", str(host))  # a second holder, on the marked inode
        h.do("close", str(ctr))
        assert mon.active(0, "a")
        h.do("close", str(host))
        assert not mon.active(0, "a")
    finally:
        mon.close()



def test_a_holder_moved_out_of_the_instance_stops_counting_within_the_member_recheck(lab, devices):
    """The holder found last is looked at first, its descriptor each time, whether it is still
    the instance's (its /proc/PID/cgroup) every MEMBER_RECHECK s: moved to another cgroup while
    it holds the GPU, it keeps the instance active that long and no longer (a clock of our own)."""
    now = [1000.0]
    mon = ActivityMonitor({0: devices[0]}, fanotify=True, rescan_interval=1.0, clock=lambda: now[0])
    try:
        g, other = lab.group(KIND_CGROUP2), lab.group(KIND_CGROUP2)
        h = Holder(lab, g)
        mon.watch(0, "a", cgroups=[g])
        h.do("open", devices[0])
        assert mon.active(0, "a")
        with open(os.path.join(other, "cgroup.procs"), "w") as f:  # moved, the device still open
            f.write(str(h.pid))
        scans = mon.stats["scans"]
        now[0] += MEMBER_RECHECK / 2  # the round robin looks at it again: the descriptor is still there
        assert mon.active(0, "a") and mon.stats["scans"] > scans
        now[0] += MEMBER_RECHECK / 2 + 0.01  # its membership is looked at again: not the instance's
        assert not mon.active(0, "a")
        with open(os.path.join(g, "cgroup.procs"), "w") as f:  # back: found by the next look
            f.write(str(h.pid))
        now[0] += 1.01
        assert mon.active(0, "a")
    finally:
        mon.close()

def test_root_pid_marks_the_container_own_node(lab, tmp_path):
    """With the container's init given, its /dev/nvidia0 is marked: seen at
    the next check, no rescan needed."""
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    host = tmp_path / "nvidia0"
    for node in (host, root / "dev" / "nvidia0"):
        os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))
    mon = ActivityMonitor({0: str(host)}, fanotify=True, rescan_interval=3600)
    try:
        h = Holder(lab)
        h.do("chroot", str(root))
        mon.watch(0, "a", pids=[h.pid], root_pid=h.pid)
        assert not mon.active(0, "a")
        h.do("open", "/dev/nvidia0")
        assert mon.active(0, "a")
        h.do("close", "/dev/nvidia0")
        assert not mon.active(0, "a")
    finally:
        mon.close()


def test_run_pokes_the_gpu_whose_instance_changed(lab, monitor, devices):
    """The trio task wakes on the open between boundaries and says which GPU."""
    import trio

    g = lab.group(KIND_CGROUP2)
    h = Holder(lab, g)
    monitor.watch(0, "a", cgroups=[g])
    monitor.watch(1, "b", cgroups=[g])
    assert isinstance(monitor, Activity)
    pokes: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run, pokes.append)
            await trio.to_thread.run_sync(h.do, "open", devices[1])
            with trio.fail_after(1):
                while not pokes:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert pokes == [1]
    assert monitor.active(1, "b") and not monitor.active(0, "a")


def test_cost_of_a_check(lab, monitor, devices, capsys):
    """Printed for docs/enforcement.md: active() with nothing happening, and
    one full look at an instance's descriptors."""
    g = lab.group(KIND_CGROUP2)
    code = "import os, time\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(100)]\ntime.sleep(600)\n"
    procs = [lab.spawn(g, code=code) for _ in range(4)]
    assert wait_until(lambda: all(len(os.listdir(f"/proc/{p.pid}/fd")) >= 100 for p in procs), 10)
    for i in range(10):
        monitor.watch(0, f"i{i}", cgroups=[g])
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        monitor.active(0, "i3")
    per_check = (time.perf_counter() - t0) / n
    scans, fds = monitor.stats["scans"], monitor.stats["fds_read"]
    t0 = time.perf_counter()
    for _ in range(20):
        monitor.watch(0, "i0", cgroups=[g])  # a watch is a full look
    per_scan = (time.perf_counter() - t0) / 20
    fds = (monitor.stats["fds_read"] - fds) / (monitor.stats["scans"] - scans)
    with capsys.disabled():
        print(f"\n  active(): {per_check * 1e6:.2f} µs per call with 10 idle instances watched;"
              f" a full look at 4 processes ({fds:.0f} descriptors): {per_scan * 1e6:.0f} µs"
              f" ({per_scan / fds * 1e6:.2f} µs per descriptor)")
    assert not monitor.active(0, "i0")
