"""Enforcement backends on real processes and real cgroups (no mocks).

Every group a test makes is named cgpud-test-<random> directly under the
hierarchy's mount, and is emptied (thaw, SIGKILL) and removed by the `lab`
fixture whatever happens; nothing else is touched. test_guard.py and
test_activity.py import `lab` from here.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Callable

import pytest

from cgpud.sched import cgroupfs, enforce
from cgpud.sched.enforce import (
    KIND_CGROUP2, KIND_FREEZER, KIND_SIGNAL, CgroupV1Freezer, CgroupV2Freezer, Enforcement, Refused, SignalFreezer, SimFreezer,
    TargetGone, freezer_for_cgroup, freezer_for_pid, stat_fields,
)
from cgpud.sched.enforce_api import Enforcer

# two busy processes: the target is all of an instance's processes, not one
BUSY = "import os\nos.fork()\nwhile True: pass\n"


def hierarchy(kind: str) -> cgroupfs.Hierarchy:
    h = cgroupfs.hierarchies().get(kind)
    if h is None:
        pytest.fail(f"no {kind} hierarchy is mounted: these tests need cgroup2 and the v1 freezer")
    return h


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.001) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        f = stat_fields(pid)
        total += int(f[11]) + int(f[12])
    return total


class Lab:
    """Test groups and child processes, all cleaned up by `close()`."""

    def __init__(self) -> None:
        self.groups: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def group(self, kind: str, parent: str | None = None) -> str:
        base = parent or hierarchy(kind).mount
        path = cgroupfs.create_cgroup(os.path.join(base, f"cgpud-test-{secrets.token_hex(4)}"))
        if parent is None:
            self.groups.append(path)
        return path

    def spawn(self, *groups: str, code: str = BUSY, new_session: bool = True, **kwargs) -> subprocess.Popen:
        """python -c code, moved into `groups` before it runs; its own
        session (so its own process group) unless new_session=False."""
        def enter() -> None:
            for g in groups:
                cgroupfs.join_cgroup(g)

        kwargs.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen([sys.executable, "-c", code], preexec_fn=enter, start_new_session=new_session, **kwargs)
        self.procs.append(p)
        return p

    def pids(self, p: subprocess.Popen, min_count: int = 2) -> list[int]:
        """The processes of p's process group (p and what it forked)."""
        assert wait_until(lambda: len(enforce.group_members(p.pid)) >= min_count, 5), \
            f"process group {p.pid} never had {min_count} processes"
        return enforce.group_members(p.pid)

    def close(self) -> None:
        problems = []
        for g in reversed(self.groups):  # thaws, kills what is inside, removes
            try:
                enforce.remove_cgroup(g, timeout=5)
            except enforce.EnforceError as exc:
                problems.append(str(exc))
        for p in self.procs:
            try:  # the whole group of those in a session of their own, else the one
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            except ProcessLookupError:
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                problems.append(f"process {p.pid} did not die")
        assert not problems, problems


@pytest.fixture
def lab():
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


def report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n  {text}")


# ---- freeze stops the processes, thaw resumes them ------------------------------------


def _target(lab: Lab, kind: str) -> tuple[subprocess.Popen, enforce.Freezer]:
    if kind == KIND_SIGNAL:
        p = lab.spawn()
        return p, SignalFreezer(p.pid)
    g = lab.group(kind)
    p = lab.spawn(g)
    return p, (CgroupV2Freezer(g) if kind == KIND_CGROUP2 else CgroupV1Freezer(g))


@pytest.mark.parametrize("kind", [KIND_CGROUP2, KIND_FREEZER, KIND_SIGNAL])
def test_freeze_stops_cpu_progress_and_thaw_resumes_it(lab, capsys, kind):
    p, f = _target(lab, kind)
    pids = lab.pids(p)
    time.sleep(0.1)
    assert not f.is_frozen()

    f.freeze()
    f.freeze()  # twice is fine
    assert f.frozen
    assert wait_until(f.is_frozen, 2), f"{f!r} never reported frozen"
    before = cpu_ticks(pids)
    time.sleep(0.3)
    frozen_ticks = cpu_ticks(pids) - before
    assert frozen_ticks <= 1, f"{frozen_ticks} ticks of CPU while frozen"

    assert f.thaw() is True
    f.thaw()
    assert not f.frozen
    assert wait_until(lambda: not f.is_frozen(), 2)
    # Running again: it gains CPU time (on a loaded machine it may take a while
    # to get 10 ticks; frozen, it never would).
    before = cpu_ticks(pids)
    assert wait_until(lambda: cpu_ticks(pids) - before >= 10, 5), \
        f"only {cpu_ticks(pids) - before} ticks of CPU in 5 s after the thaw"

    for realtime in (False, True):
        m = enforce.measure(f, rounds=200 if kind != KIND_SIGNAL else 40, realtime=realtime)
        report(capsys, f"{kind:15} {'SCHED_FIFO' if realtime else 'normal':10} "
                       f"freeze {m['freeze_p50_us']:6.1f} µs (p99 {m['freeze_p99_us']:7.1f})  "
                       f"thaw {m['thaw_p50_us']:6.1f} µs (p99 {m['thaw_p99_us']:7.1f})  "
                       f"frozen after {m['settle_p50_us']:7.1f} µs (p99 {m['settle_p99_us']:7.1f})")
    assert not f.is_frozen() and not f.frozen
    assert f.spec()["kind"] == kind


def test_spec_names_the_target(lab):
    g = lab.group(KIND_CGROUP2)
    assert CgroupV2Freezer(g, label="0/abc").spec() == {"kind": KIND_CGROUP2, "path": g, "label": "0/abc"}
    v1 = lab.group(KIND_FREEZER)
    assert CgroupV1Freezer(v1).spec() == {"kind": KIND_FREEZER, "path": v1}
    p = lab.spawn()
    spec = SignalFreezer(p.pid).spec()
    assert spec["pgid"] == p.pid and spec["start"] == int(stat_fields(p.pid)[19])


def test_sim_freezer_records_transitions():
    f = SimFreezer("0/abc")
    f.freeze(); f.freeze()
    assert f.frozen and f.is_frozen() and f.freezes == 1
    assert f.thaw() and f.thaw()
    assert not f.frozen and f.thaws == 1
    assert f.spec() == {"kind": "sim", "name": "0/abc"}


# ---- what is refused ----------------------------------------------------------------------


def test_roots_and_foreign_paths_are_refused(tmp_path):
    v2, v1 = hierarchy(KIND_CGROUP2), hierarchy(KIND_FREEZER)
    for make, path in ((CgroupV2Freezer, v2.mount), (CgroupV1Freezer, v1.mount),
                       (CgroupV2Freezer, v2.mount + "/"), (CgroupV2Freezer, v2.mount + "/x/.."),
                       (CgroupV2Freezer, str(tmp_path)), (CgroupV1Freezer, v2.mount + "/nope"),
                       (freezer_for_cgroup, str(tmp_path))):
        with pytest.raises(Refused):
            make(path)
    (tmp_path / "cgroup.freeze").write_text("0")  # looks like a group, is not one
    with pytest.raises(Refused):
        CgroupV2Freezer(str(tmp_path))
    for pgid in (0, 1, -5, os.getpgid(0)):
        with pytest.raises(Refused):
            SignalFreezer(pgid)
    # the test's own groups (the roots on this machine, but whatever they are)
    own = cgroupfs.proc_cgroups()
    with pytest.raises(Refused):
        CgroupV2Freezer(own.v2)
    with pytest.raises(Refused):
        CgroupV1Freezer(own.freezer)
    with pytest.raises(Refused):
        freezer_for_pid(os.getpid())


CHECK_SELF = textwrap.dedent("""
    import json, os, sys
    from cgpud.sched import cgroupfs, enforce
    v2_inner, v2_outer, v2_sibling, v1_inner = sys.argv[1:5]
    cgroupfs.join_cgroup(v2_inner)
    cgroupfs.join_cgroup(v1_inner)
    out = {}
    for name, make, path in (("v2 own", enforce.CgroupV2Freezer, v2_inner),
                             ("v2 parent", enforce.CgroupV2Freezer, v2_outer),
                             ("v1 own", enforce.CgroupV1Freezer, v1_inner),
                             ("by pid", lambda _: enforce.freezer_for_pid(os.getpid()), None),
                             ("sibling", enforce.CgroupV2Freezer, v2_sibling)):
        try:
            make(path)
            out[name] = "ok"
        except enforce.Refused as exc:
            out[name] = "refused: " + str(exc)
    print(json.dumps(out))
""")


def test_groups_holding_the_daemon_are_refused(lab):
    """A process (standing in for the daemon) in a group of its own may not
    freeze that group, nor a parent of it, in either hierarchy; a sibling is fine."""
    outer = lab.group(KIND_CGROUP2)
    inner = lab.group(KIND_CGROUP2, parent=outer)
    sibling = lab.group(KIND_CGROUP2)
    v1_inner = lab.group(KIND_FREEZER)
    run = subprocess.run([sys.executable, "-c", CHECK_SELF, inner, outer, sibling, v1_inner],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in ("v2 own", "v2 parent", "v1 own", "by pid"):
        assert out[name].startswith("refused") and "the daemon itself" in out[name], out
    assert out["sibling"] == "ok"


def test_protected_process_groups_are_refused(lab):
    g = lab.group(KIND_CGROUP2)
    p = lab.spawn(g)
    cgroupfs.protect_pid(p.pid)
    try:
        with pytest.raises(Refused, match="protected process"):
            CgroupV2Freezer(g)
        with pytest.raises(Refused, match="protected process"):
            SignalFreezer(p.pid)
    finally:
        cgroupfs.unprotect_pid(p.pid)
    CgroupV2Freezer(g)


# ---- which backend ------------------------------------------------------------------------


def test_freezer_for_pid_picks_the_process_own_group(lab):
    v2 = lab.group(KIND_CGROUP2)
    v1 = lab.group(KIND_FREEZER)
    both = lab.spawn(v2, v1)
    only_v1 = lab.spawn(v1)
    bare = lab.spawn()
    same_pgrp = lab.spawn(new_session=False)

    f = freezer_for_pid(both.pid)
    assert isinstance(f, CgroupV2Freezer) and f.path == v2
    f = freezer_for_pid(only_v1.pid)
    assert isinstance(f, CgroupV1Freezer) and f.path == v1
    f = freezer_for_pid(bare.pid)
    assert isinstance(f, SignalFreezer) and f.pgid == bare.pid
    with pytest.raises(Refused, match="the daemon itself"):
        freezer_for_pid(same_pgrp.pid)  # its process group is ours
    same_pgrp.kill()
    same_pgrp.wait()
    with pytest.raises(TargetGone):
        freezer_for_pid(same_pgrp.pid)


def test_a_vanished_target_is_reported(lab):
    g = lab.group(KIND_CGROUP2)
    f = CgroupV2Freezer(g)
    enforce.remove_cgroup(g)
    with pytest.raises(TargetGone):
        f.freeze()
    assert f.thaw() is False
    p = lab.spawn()
    s = SignalFreezer(p.pid)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert wait_until(lambda: not enforce.group_members(p.pid), 5)
    with pytest.raises(TargetGone):
        s.freeze()
    assert s.thaw() is False


def test_remove_cgroup_empties_a_frozen_group_and_its_children(lab):
    for kind in (KIND_CGROUP2, KIND_FREEZER):
        g = lab.group(kind)
        child = lab.group(kind, parent=g)
        p = lab.spawn(child)
        f = freezer_for_cgroup(g)
        f.freeze()
        assert wait_until(lambda: freezer_for_cgroup(child).is_frozen(), 2)
        enforce.remove_cgroup(g)
        assert not os.path.exists(g)
        assert p.wait(5) == -signal.SIGKILL


# A counter in a shared file, bumped as fast as Python can: when it stops
# changing after freeze(), and when it moves again after thaw(), is what the
# instance's processes actually see.
COUNTER = """
import mmap, struct, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 8)
n = 0
while True:
    n += 1
    struct.pack_into("Q", m, 0, n)
"""


@pytest.mark.parametrize("kind", [KIND_CGROUP2, KIND_FREEZER, KIND_SIGNAL])
def test_progress_stops_and_resumes_within_microseconds(lab, tmp_path, capsys, kind):
    """Measured and printed (docs/enforcement.md), asserted only in kind: the
    counter stops after every freeze and moves again after every thaw."""
    import mmap
    import struct

    path = tmp_path / "counter"
    path.write_bytes(bytes(8))
    code = COUNTER.replace("sys.argv[1]", repr(str(path)))
    g = None if kind == KIND_SIGNAL else lab.group(kind)
    p = lab.spawn(*([g] if g else []), code=code)
    f = SignalFreezer(p.pid) if g is None else freezer_for_cgroup(g)
    with open(path, "r+b") as fh:
        m = mmap.mmap(fh.fileno(), 8)
    count = lambda: struct.unpack_from("Q", m, 0)[0]  # noqa: E731
    assert wait_until(lambda: count() > 0, 5), "the counter never started"
    quiet = 0.005  # s without a change: stopped
    stops, resumes = [], []
    old = (os.sched_getscheduler(0), os.sched_getparam(0))
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))  # as the daemon's scheduler runs
    try:
        for _ in range(100):
            last, t0 = count(), time.perf_counter()
            f.freeze()
            last_change = t0  # any change seen from here on (during the call too) is progress
            while True:
                now, c = time.perf_counter(), count()
                if c != last:
                    last, last_change = c, now
                elif now - last_change > quiet:
                    break
                assert now - t0 < 2, f"{f!r}: the counter still moves 2 s after freeze()"
            stops.append(max(0.0, last_change - t0))
            t1 = time.perf_counter()
            f.thaw()
            while count() == last:
                assert time.perf_counter() - t1 < 2, f"{f!r}: the counter still stands 2 s after thaw()"
            resumes.append(time.perf_counter() - t1)
            time.sleep(0.001)
    finally:
        os.sched_setscheduler(0, *old)
        f.thaw()
    stops.sort()
    resumes.sort()
    report(capsys, f"{kind:15} last progress after freeze(): median {statistics.median(stops) * 1e6:6.1f} µs, "
                   f"p99 {stops[98] * 1e6:7.1f} µs;  first progress after thaw(): median "
                   f"{statistics.median(resumes) * 1e6:6.1f} µs, p99 {resumes[98] * 1e6:7.1f} µs")


# ---- Enforcement: what the scheduler loop drives ---------------------------------------


class ListRegistry:
    """Records the order of registry calls against freezes (the guard's contract)."""

    def __init__(self, log: list) -> None:
        self.entries: list[dict] = []
        self.log = log

    def add(self, target) -> None:
        self.entries.append(target.spec())
        self.log.append(("add", target.spec()["path"]))

    def discard(self, target) -> None:
        self.entries.remove(target.spec())
        self.log.append(("discard", target.spec()["path"]))


def test_enforcement_counts_gpus_holding_a_container(lab):
    """One container on GPUs 0 and 1: frozen while either GPU holds it."""
    g = lab.group(KIND_CGROUP2)
    p = lab.spawn(g)
    pids = lab.pids(p)
    log: list = []
    reg = ListRegistry(log)
    enf = Enforcement(reg)
    f = CgroupV2Freezer(g)
    real_freeze = f.freeze
    f.freeze = lambda: (log.append(("freeze", g)), real_freeze())[1]  # record the order; still the real thing
    enf.attach("abc", f)
    assert reg.entries == [f.spec()]

    enf.freeze(0, "abc")
    enf.freeze(1, "abc")
    assert wait_until(f.is_frozen, 2)
    enf.thaw(0, "abc")
    assert f.frozen and f.is_frozen(), "thawed while GPU 1 still holds it"
    before = cpu_ticks(pids)
    time.sleep(0.2)
    assert cpu_ticks(pids) - before <= 1
    enf.thaw(1, "abc")
    assert wait_until(lambda: not f.is_frozen(), 2)
    assert enf.frozen() == {}

    enf.freeze(0, "abc")
    enf.close()
    assert not f.is_frozen() and reg.entries == []
    assert log[0] == ("add", g) and log[1] == ("freeze", g) and log[-1] == ("discard", g)


def test_enforcement_without_a_target_or_with_a_vanished_one_is_quiet(lab):
    enf = Enforcement()
    enf.freeze(0, "nothing")  # an instance with no processes yet
    enf.thaw(0, "nothing")
    enf.thaw(3, "never-seen")
    # attached while a GPU holds it frozen: frozen at once
    g = lab.group(KIND_CGROUP2)
    lab.spawn(g)
    enf.freeze(0, "late")
    f = CgroupV2Freezer(g)
    enf.attach("late", f)
    assert wait_until(f.is_frozen, 2)
    enf.detach("late")
    assert not f.is_frozen()
    # a target that disappears under the scheduler
    g2 = lab.group(KIND_CGROUP2)
    enf.attach("gone", CgroupV2Freezer(g2))
    enforce.remove_cgroup(g2)
    enf.freeze(0, "gone")
    assert enf.target("gone") is None
    enf.thaw(0, "gone")
    assert isinstance(enf, Enforcer)
