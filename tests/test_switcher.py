"""The daemon's native part of the gate (issue 12): libcgpu-switch.so's switcher thread
(cgpud.sched.native), which carries out a GPU's switches between gated instances —
close, wait for the stopped one's queued work, open, sleep to the step's end — and
the scheduler that plans its steps a batch ahead (Planner.plan_ahead, settle, rewind;
cgpud.sched.batching).

The switcher is driven here as the scheduler drives it, with the stand-in libcuda.so.1
and libcgpu in real launcher processes where a drain matters; its reports and the
stand-in's kernel log share one clock (CLOCK_MONOTONIC), so what happened when is read
from timestamps, not assumed from sleeps."""
from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cgpud.core.model import GpuInfo, Node
from cgpud.gpus import pages
from cgpud.sched import native
from cgpud.sched.enforce import Enforcement
from cgpud.sched.gate import GateFreezer
from stopping import stop_outside_card
from cgpud.sched.loop import GpuScheduler, TimerFdWaiter
from cgpud.sched.policies import GpuView, InstView, Params, Planner
from test_gate import kernels, libs  # noqa: F401  (libs: the fixture)

GIB = 1 << 30
CGPUD = str(Path(sys.executable).parent / "cgpud")


def gate_open(directory: Path, k: int = 0) -> bool:
    limits = (directory / "limits").read_bytes()
    return bool(int.from_bytes(limits[pages.GPU_GATE_OFFSET + 4 * k:pages.GPU_GATE_OFFSET + 4 * k + 4], "little") & 1)


def wait_note(sw: native.Switcher, timeout: float = 5.0) -> None:
    r, _, _ = select.select([sw.fileno()], [], [], timeout)
    assert r, "the switcher said nothing"
    sw.ack()


def wait_step(sw: native.Switcher, batch: int, step: int, timeout: float = 5.0) -> list[native.Report]:
    """Wait until step `step` of batch `batch` is in force; the reports of the steps that ended."""
    ended = []
    while True:
        got, cur = sw.take()
        ended += got
        if cur is not None and (cur.batch, cur.step) == (batch, step):
            return ended
        wait_note(sw, timeout)


def cancel(sw: native.Switcher) -> list[native.Report]:
    sw.cancel()
    while not sw.idle():
        wait_note(sw)
    return sw.take()[0]


@pytest.fixture
def two(tmp_path):
    """Two containers' pages on node GPU 0, opened by the library, and a switcher for GPU 0."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        pages.create(os.fspath(d), [GIB])
    ps = [native.Page(os.fspath(d), [0]) for d in dirs]
    for p in ps:  # (both active: as the scheduler tells them, their queued work bounded to 2 ms)
        p.set_shared(0, True, 2000)
    sw = native.Switcher(0, 0.05)
    yield dirs, ps, sw
    sw.close()
    for p in ps:
        p.thaw(None)
        p.release()


def test_a_batch_is_carried_out_step_by_step_and_each_step_reported(two):
    dirs, ps, sw = two
    assert sw.submit(1, ps, [True, True], [(0.03, 0, 0), (0.03, 1, 0), (30.0, 0, native.NOTIFY)])
    ended = wait_step(sw, 1, 2)
    # in force now: the first runs, the second (active) waits at its closed gate
    assert gate_open(dirs[0]) and not gate_open(dirs[1])
    assert ps[1].closed_on(0) and not ps[0].closed_on(0)
    assert [(r.batch, r.step) for r in ended] == [(1, 0), (1, 1)]
    for r in ended:
        assert r.begin <= r.start <= r.end
    # a step is in force until the next one's gate opens (its queued work drains meanwhile)
    assert ended[0].end == ended[1].start and ended[1].end == sw.take()[1].start
    assert ended[1].end - ended[1].begin >= 30_000_000, "a step ended before its length"
    assert ended[1].closed == 1 and ended[0].closed == 1  # (the runner's neighbour at each switch)
    # charged until its closing was answered (nobody launches here: at once), not to the next opening
    assert ended[1].begin <= ended[0].drained <= ended[1].start
    # cut now: the step in force ends at once, the gates stay as they are
    last = cancel(sw)
    assert [(r.batch, r.step) for r in last] == [(1, 2)] and last[0].end - last[0].start < 5_000_000_000
    assert gate_open(dirs[0]) and not gate_open(dirs[1])


def test_an_idle_instance_is_never_held_and_nobody_runs_a_waste_step(two):
    dirs, ps, sw = two
    assert sw.submit(1, ps, [True, False], [(30.0, 1, native.NOTIFY)])
    wait_step(sw, 1, 0)
    assert not gate_open(dirs[0]) and gate_open(dirs[1])  # the runner is idle; the active one waits
    cancel(sw)
    assert sw.submit(2, ps, [True, True], [(30.0, -1, native.NOTIFY)])  # a slot nobody holds
    wait_step(sw, 2, 0)
    assert not gate_open(dirs[0]) and not gate_open(dirs[1])
    cancel(sw)


def test_a_batch_follows_the_one_in_force_and_a_third_is_refused(two):
    dirs, ps, sw = two
    assert sw.submit(1, ps, [True, True], [(30.0, 0, native.NOTIFY)])
    wait_step(sw, 1, 0)
    assert sw.submit(2, ps, [True, True], [(0.01, 1, native.NOTIFY)])
    assert not sw.submit(3, ps, [True, True], [(0.01, 0, 0)]), "a third batch was taken while one waited"
    assert not gate_open(dirs[1]), "the next batch began before the one in force ended"
    cancel(sw)  # (both dropped)
    assert sw.submit(4, ps, [True, True], [(0.01, 1, 0), (30.0, 1, native.NOTIFY)])
    wait_step(sw, 4, 1)
    assert gate_open(dirs[1]) and not gate_open(dirs[0])
    cancel(sw)


@pytest.fixture
def launching(libs, tmp_path):  # noqa: F811
    """Start a launcher of long kernels under libcgpu in the pages at a directory."""
    procs = []

    def start(directory: Path, kernel_us: int) -> subprocess.Popen:
        env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
               "LD_PRELOAD": os.fspath(libs / "libcgpu.so"), "CGPU_PAGE_DIR": os.fspath(directory),
               "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"),
               "CGPU_STUB_CUDA_LOG": os.fspath(tmp_path / f"{directory.name}.kernels")}
        p = subprocess.Popen([os.fspath(libs / "launcher"), "60", str(kernel_us), "0"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_a_switch_opens_the_next_gate_only_once_the_stopped_ones_work_is_done(two, launching, tmp_path):
    """b launches 5 ms kernels, one queued behind the running one: at the switch to a, its
    gate closes and the switcher waits for its helper's answer; a's gate opens after b's last
    kernel ended, and no kernel of b starts while a runs."""
    dirs, ps, sw = two
    launching(dirs[1], 5_000)
    assert sw.submit(1, ps, [True, True], [(0.3, 1, 0), (30.0, 0, native.NOTIFY)])
    ended = wait_step(sw, 1, 1)
    cur = sw.take()[1]
    switch, opened = cur.begin, cur.start  # (the switch to a began, a's gate opened)
    assert opened > switch
    ks = kernels(tmp_path / "b.kernels")
    assert [s for _, s, _ in ks if s < switch], "b launched nothing in its step"
    assert all(e <= opened for _, s, e in ks if s < switch), "a's gate opened before b's queued work ended"
    assert max(e for _, s, e in ks if s < switch) > switch, "nothing was queued at the switch (no drain to wait for)"
    # b's step is charged until its helper answered: after its last kernel ended, before a's gate opened
    b_step = [r for r in ended if (r.batch, r.step) == (1, 0)][0]
    assert max(e for _, s, e in ks if s < switch) <= b_step.drained <= opened == b_step.end
    last = cancel(sw)
    assert last[0].drain_ns > 0 and last[0].gave_up == -1
    assert not [s for _, s, _ in kernels(tmp_path / "b.kernels") if opened <= s < last[0].end], \
        "b launched while its gate was closed"


def test_a_process_that_does_not_answer_is_given_up_on_once(two, launching, tmp_path):
    """A stopped launcher cannot answer: the switch waits the bound (50 ms here) once, reports it
    given up on, and does not wait for it again until it answers."""
    dirs, ps, sw = two
    p = launching(dirs[1], 1000)
    assert sw.submit(1, ps, [True, True], [(0.2, 1, native.NOTIFY)])
    wait_step(sw, 1, 0)
    log, end = tmp_path / f"{dirs[1].name}.kernels", time.monotonic() + 10
    while not kernels(log):  # (stopped before its first launch it would be nobody the closing waits for)
        assert time.monotonic() < end, "b launched nothing in 10 s"
        select.select([], [], [], 0.005)
    stop_outside_card(p)
    cancel(sw)
    steps = [(0.05, 0, 0), (0.05, 1, 0), (0.05, 0, 0), (30.0, 1, native.NOTIFY)]
    assert sw.submit(2, ps, [True, True], steps)
    ended = wait_step(sw, 2, 3)
    first, again = ended[0], ended[2]  # the switches that closed b's gate
    assert first.gave_up == 1 and first.drain_ns >= 50_000_000
    assert again.gave_up == -1 and again.drain_ns < 50_000_000, "it was waited for again without answering"
    cancel(sw)


def test_a_live_process_whose_kernel_outlasts_the_bound_answers_at_its_drain_bound(two, launching):
    """b launches 2 s kernels: its work at the switch cannot be done within any drain bound. Its
    library answers the closing itself at its drain bound (issue 34: one drain bound, once), so the
    switch to a is not held for b's kernel: b is not given up on (it answered), and a's gate opens
    long before b's running kernel could end. (Issue 27's library was waited for up to the 5 s cap,
    the neighbours' gates shut meanwhile: the drain here lasted a kernel, 2 s.)"""
    dirs, ps, sw = two
    launching(dirs[1], 2_000_000)
    assert sw.submit(1, ps, [True, True], [(0.3, 1, 0), (30.0, 0, native.NOTIFY)])
    wait_step(sw, 1, 1)
    cur = sw.take()[1]  # (the switch to a: its drain of b, then a's gate opened)
    assert cur.gave_up == -1, f"given up on after {cur.drain_ns / 1e6:.0f} ms: it did not answer"
    assert cur.drain_ns < 1_000_000_000, f"the switch waited {cur.drain_ns / 1e6:.0f} ms for b's kernel"
    cancel(sw)


def slot_holder(usage: Path, slot: int) -> subprocess.Popen:
    """A process that holds the read lock on slot `slot` of a usage page, as libcgpu's helper does."""
    code = (f"import fcntl, os, sys, time; f = open({os.fspath(usage)!r}, 'rb'); "
            f"fcntl.lockf(f, fcntl.LOCK_SH, 1, {pages.USAGE_HEAD.size + slot * pages.PROC.size}); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_who_cannot_answer_is_given_up_on_and_the_reason_said(tmp_path):
    """Four launching processes that have not answered a closing: one dead (no lock on its slot),
    one stopped, one alive whose helper does not drain, one alive and draining. Past the bound the
    first three are given up on, each with its reason; the drainer only at the cap."""
    d = tmp_path / "c"
    pages.create(os.fspath(d), [GIB])
    usage = d / "usage"
    raw = bytearray(usage.read_bytes())
    for slot, flags in enumerate([0, 0, 0, pages.PROC_DRAINING]):
        pages.PROC_HEAD.pack_into(raw, pages.USAGE_HEAD.size + slot * pages.PROC.size, 4_000_000 + slot,
                                  pages.GATED_PER_GPU, 0, 1 | flags)
    struct.pack_into("<I", raw, pages.GATED_OFFSET, 0b1111)
    usage.write_bytes(bytes(raw))
    holders = [slot_holder(usage, k) for k in (1, 2, 3)]
    holders[0].send_signal(signal.SIGSTOP)
    while Path(f"/proc/{holders[0].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        select.select([], [], [], 0.001)  # (until the signal has stopped it)
    page = native.Page(os.fspath(d), [0])
    try:
        page.freeze(0)
        assert sorted(page.undrained(0)) == [0, 1, 2, 3]
        assert sorted(page.give_up(0)) == [(0, "dead"), (1, "stopped"), (2, "alive but not answering")]
        assert page.undrained(0) == [3], "a live process draining was given up on before the cap"
        assert page.give_up(0) == [] and page.undrained(0) == [3]
        assert page.give_up(0, every=True) == [(3, "still draining at the cap")]
        assert page.undrained(0) == []
    finally:
        page.thaw(0)
        page.release()
        for h in holders:
            h.send_signal(signal.SIGCONT)
            h.kill()
            h.wait()


def test_pages_that_are_not_a_cgpud_page_are_refused_with_the_reason(tmp_path):
    with pytest.raises(native.PageError) as gone:
        native.Page(os.fspath(tmp_path / "nowhere"), [0])
    assert gone.value.gone and "is gone" in str(gone.value)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "limits").write_bytes(b"\0" * 16)
    with pytest.raises(native.PageError) as bad:
        native.Page(os.fspath(tmp_path / "bad"), [0])
    assert not bad.value.gone and "not a cgpud limits page" in str(bad.value)
    pages.create(os.fspath(tmp_path / "old"), [GIB])
    data = bytearray((tmp_path / "old" / "limits").read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    (tmp_path / "old" / "limits").write_bytes(bytes(data))
    with pytest.raises(native.PageError, match="of version 2"):
        native.Page(os.fspath(tmp_path / "old"), [0])


def test_without_the_native_part_compute_gate_is_refused_with_one_line(tmp_path):
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([CGPUD, "serve", "--gpus", "sim:T4", "--mount", os.fspath(tmp_path / "mnt"), "--state-dir",
                        os.fspath(tmp_path / "state"), "--socket", os.fspath(tmp_path / "sock"), "--compute", "gate"],
                       env=dict(os.environ, CGPUD_NATIVE=os.fspath(tmp_path / "libcgpu-switch.so")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--compute gate" in lines[0] and "make -C native" in lines[0], r.stderr
    assert not os.path.ismount(tmp_path / "mnt")


# ---- planning ahead ------------------------------------------------------------------------

VIEWS = [
    GpuView(2, 6, 50, (InstView("a", 1, False, True), InstView("b", 2, False, True), InstView("c", 3, False, True))),
    GpuView(3, 8, 50, (InstView("a", 1, False, True), InstView("b", 3, False, True))),  # with waste
    GpuView(0, 4, 50, (InstView("a", 1, False, True), InstView("b", 1, False, False))),
    GpuView(1, 4, 50, (InstView("a", 1, False, True), InstView("b", 1, False, True), InstView("c", 1, False, True))),
]


def one_at_a_time(view: GpuView, n: int, ran) -> list[tuple[str | None, float]]:
    """The loop's way: plan one, charge what ran (ran(k, planned length)), plan the next."""
    p, t, out = Planner(Params(slice=0.01, merge_runs=True)), 100.0, []
    for k in range(n):
        d = p.plan(view, t)
        r = ran(k, d.length)
        p.charge(d, t, t + r)
        out.append((d.holder, round(d.length, 9)))
        t += r
    return out


def ahead(view: GpuView, n: int, ran, horizon: float = 0.05) -> list[tuple[str | None, float, float]]:
    """The switcher's way: plan a batch ahead, then settle each step with what ran (ran(k, length))."""
    p, t, got, k = Planner(Params(slice=0.01, merge_runs=True)), 100.0, [], 0
    while len(got) < n:
        batch = p.plan_ahead(view, t, horizon)
        assert batch and all(a.decision.holder is not None for a in batch)
        for a in batch:  # (settled after the whole batch was planned, as the switcher's reports come)
            r = ran(k, a.decision.length)
            p.settle(a, t, t + r)
            got.append((a.decision.holder, round(a.decision.length, 9), r))
            t += r
            k += 1
    return got[:n]


@pytest.mark.parametrize("view", VIEWS, ids=["policy2", "policy3-waste", "policy0-idle", "policy1"])
def test_planning_ahead_plans_what_planning_one_at_a_time_does(view):
    """Each step running its planned length: the same holders and lengths as the loop, which
    charges each before it plans the next."""
    full = (lambda k, length: length)
    assert [h[:2] for h in ahead(view, 60, full)] == one_at_a_time(view, 60, full)


@pytest.mark.parametrize("view", VIEWS, ids=["policy2", "policy3-waste", "policy0-idle", "policy1"])
def test_time_a_switch_takes_from_a_step_planned_ahead_is_still_owed(view):
    """Every step loses 0.3 ms at its switch and every fifth is cut at half (a poke): what was
    planned ahead could not know, but the ring keeps what it owes, so each holder's share of
    the time run comes out as when planning one at a time (within 0.5 pp over 3 s)."""
    ran = (lambda k, length: length / 2 if k % 5 == 4 else length - 0.0003)
    loop = one_at_a_time(view, 300, ran)
    fwd = ahead(view, 300, ran)
    loop_ran = [ran(k, length) for k, (_, length) in enumerate(loop)]

    def shares(holders, times):
        total = sum(times)
        return {h: sum(t for x, t in zip(holders, times) if x == h) / total for h in set(holders)}

    want = shares([h for h, _ in loop], loop_ran)
    got = shares([h for h, _, _ in fwd], [r for _, _, r in fwd])
    assert want.keys() == got.keys()
    assert all(abs(got[h] - want[h]) <= 0.005 for h in want), (got, want)


@pytest.mark.parametrize("view", VIEWS, ids=["policy2", "policy3-waste", "policy0-idle", "policy1"])
def test_what_never_started_is_taken_back(view):
    """A batch of which 4 steps ran, the 4th cut at half its length, the rest rewound: the planner
    goes on exactly as the loop would have after those 4 (the cut one's rest still owed)."""
    ran = (lambda k, length: length / 2 if k == 3 else length)
    want = one_at_a_time(view, 12, ran)
    p, t = Planner(Params(slice=0.01, merge_runs=True)), 100.0
    batch = p.plan_ahead(view, t, 1.0)
    assert len(batch) > 6
    p.rewind(batch[4:])
    got = []
    for k, a in enumerate(batch[:4]):
        r = ran(k, a.decision.length)
        p.settle(a, t, t + r)
        got.append((a.decision.holder, round(a.decision.length, 9)))
        t += r
    for k in range(4, 12):
        d = p.plan(view, t)
        r = ran(k, d.length)
        p.charge(d, t, t + r)
        got.append((d.holder, round(d.length, 9)))
        t += r
    assert got == want


def test_high_priority_and_policies_4_and_5_are_not_planned_ahead():
    p = Planner(Params(slice=0.01))
    hp = GpuView(2, 4, 50, (InstView("a", 1, False, True), InstView("h", 1, True, True)))
    assert p.plan_ahead(hp, 0.0, 1.0) == [] and p.plan(hp, 0.0).holder == "h"
    for policy in (4, 5):
        assert Planner(Params(slice=0.01)).plan_ahead(GpuView(policy, 4, 50, (InstView("a", 1, False, True),)),
                                                      0.0, 1.0) == []


# ---- the scheduler with a switcher -----------------------------------------------------------

class Active:
    def active(self, gpu: int, name: str) -> bool:
        return True


@pytest.fixture
def as_the_daemon():
    """This thread (the scheduler's here) and what it starts (the switcher's thread) at the daemon's
    real-time priority (cgpud serve --rt-priority 10, cgpud.sched.priority) for the test: on the real
    clock a normal-priority scheduler is as punctual as the machine's load lets it be (the 1:2
    below failed under four CPU hogs), which is not what the daemon is."""
    old = (os.sched_getscheduler(0), os.sched_getparam(0))
    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
    yield
    os.sched_setscheduler(0, *old)


def test_the_scheduler_carries_out_gated_slices_through_the_switcher(tmp_path, as_the_daemon):
    """Policy 2 at 1:2 between two gated instances, on the real clock: the switcher carries out
    the slices (the telemetry counts them), the shares are 1:2, a weight changed mid-run takes
    effect at once (the batch is cut and planned again), and at stop every gate is open."""
    node = Node([GpuInfo(0, "GPU-test-0", "Sim", 16 * GIB)])
    node.set_default_memsize(GIB)
    node.set_policy(0, 2)
    enf = Enforcement()
    for name, w in (("aaaaaaaaaaaa", 1), ("bbbbbbbbbbbb", 2)):
        node.create_instance(0, name, weight=w)
        pages.create(os.fspath(tmp_path / name), [GIB])
        enf.attach(name, GateFreezer(os.fspath(tmp_path / name), gpus=[0]))
    # (batches of 50 ms: the telemetry, which counts the steps reported, is at most that much behind)
    sched = GpuScheduler(node, 0, enf, Active(), params=Params(slice=0.01, merge_runs=True), waiter=TimerFdWaiter(),
                         switcher=native.Switcher(0, 0.02), publish_every=0.05, batch=0.05)
    shares = {}

    async def main():
        async with trio.open_nursery() as n:
            await n.start(sched.run)
            await trio.sleep(1.5)
            shares["before"] = sched.snapshot()
            node.set_weight(0, "aaaaaaaaaaaa", 2)
            sched.poke()
            await trio.sleep(1.5)
            shares["after"] = sched.snapshot()
            sched.stop()

    trio.run(main)
    b, a = shares["before"], shares["after"]
    ga = [s.instances["aaaaaaaaaaaa"].granted_seconds for s in (b, a)]
    gb = [s.instances["bbbbbbbbbbbb"].granted_seconds for s in (b, a)]
    assert b.switched > 50, "the switcher did not carry out the slices"
    assert 1.7 <= gb[0] / ga[0] <= 2.3, (ga, gb)
    assert 0.8 <= (gb[1] - gb[0]) / (ga[1] - ga[0]) <= 1.25, (ga, gb)  # 2:2 after the change
    assert all(gate_open(tmp_path / n) for n in ("aaaaaaaaaaaa", "bbbbbbbbbbbb")), "a gate was left closed"
    assert sched.frozen == frozenset()
    enf.close()


def test_an_instance_detached_while_the_switcher_runs_is_left_with_its_gate_open(tmp_path, as_the_daemon):
    """Removed mid-batch (its GateFreezer detached, which opens its gate): whatever the switcher
    did with the page in between, the scheduler, poked, leaves that gate open and goes on with the
    others."""
    node = Node([GpuInfo(0, "GPU-test-0", "Sim", 16 * GIB)])
    node.set_default_memsize(GIB)
    node.set_policy(0, 1)
    enf = Enforcement()
    names = ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc")
    for name in names:
        node.create_instance(0, name, weight=1)
        pages.create(os.fspath(tmp_path / name), [GIB])
        enf.attach(name, GateFreezer(os.fspath(tmp_path / name), gpus=[0]))
    sched = GpuScheduler(node, 0, enf, Active(), params=Params(slice=0.01, merge_runs=True), waiter=TimerFdWaiter(),
                         switcher=native.Switcher(0, 0.02), publish_every=0.05)
    seen = {}

    async def main():
        async with trio.open_nursery() as n:
            await n.start(sched.run)
            for _ in range(20):  # (detached at various points of the switcher's steps)
                await trio.sleep(0.037)
                name = "aaaaaaaaaaaa"
                enf.detach(name)
                node.destroy(name)
                sched.poke()
                await trio.sleep(0.05)
                seen.setdefault("open", []).append(gate_open(tmp_path / name))
                node.create_instance(0, name, weight=1)
                enf.attach(name, GateFreezer(os.fspath(tmp_path / name), gpus=[0]))
                sched.poke()
            seen["switched"] = sched.snapshot().switched
            sched.stop()

    trio.run(main)
    assert all(seen["open"]), "a detached instance's gate was left closed"
    assert seen["switched"] > 20
    assert all(gate_open(tmp_path / n) for n in names)
    enf.close()


def test_a_usage_page_cut_behind_the_daemons_back_costs_its_gpu_time_reading_not_the_daemon(tmp_path):
    """The usage file is writable from inside the container: one cut short after the daemon opened it
    (ftruncate, or an older library's layout) reads as 'GPU time not known' (its instance charged by
    time), never a SIGBUS in the daemon (the switcher once mapped the GPU-time block)."""
    d = tmp_path / "c"
    pages.create(os.fspath(d), [GIB])
    usage = d / "usage"
    raw = bytearray(usage.read_bytes())
    pages.PROC_HEAD.pack_into(raw, pages.USAGE_HEAD.size, os.getpid(), pages.GATED_PER_GPU, 0, 1)
    struct.pack_into("<I", raw, pages.GATED_OFFSET, 0b1)
    pages.BUSY.pack_into(raw, pages.BUSY_OFFSET, 1, os.getpid(), 12_345, *[0] * (pages.MAX_GPUS - 1))
    usage.write_bytes(bytes(raw))
    page = native.Page(os.fspath(d), [0])
    try:
        assert page.gpu_ns(0) == 12_345
        os.truncate(usage, pages.USAGE_V2_SIZE)
        assert page.gpu_ns(0) is None
    finally:
        page.release()
