"""The per-GPU trio loop on trio's MockClock: minutes of scheduling in a second.

A recording fake enforcer stands in for the real backends (cgroup freeze,
SIGSTOP: tested with real processes elsewhere). Shares are measured from what
the enforcer was told and when, independently of the scheduler's telemetry.
"""
from __future__ import annotations

import os
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from cgpud.core.model import GpuInfo, Node
from cgpud.sched.enforce_api import Activity, Enforcer, UsageMeter
from cgpud.sched.loop import GpuScheduler, schedulers_for, stats
from cgpud.sched.policies import Params
from cgpud.sched.telemetry import GpuStats

X = 0.010
GIB = 1 << 30
A, B, C, H = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc", "hhhhhhhhhhhh"


def make_node(gpus: int = 1) -> Node:
    node = Node([GpuInfo(i, f"GPU-test-{i}", "Sim", 16 * GIB) for i in range(gpus)])
    node.set_default_memsize(GIB)
    return node


def scenario(policy: int, *specs, max_inst: int | None = None):
    """A one-GPU node under `policy` with instances (name, weight[, active[, highprio]])."""
    node = make_node()
    node.set_policy(0, policy)
    if max_inst is not None:
        node.set_max_inst(0, max_inst)
    act = FakeActivity()
    for name, weight, *rest in specs:
        active, highprio = (list(rest) + [True, False][len(rest):])[:2]
        node.create_instance(0, name, weight=weight, highprio=highprio)
        act.set(name, active)
    return node, act


class FakeActivity:
    def __init__(self) -> None:
        self.state: dict[tuple[int, str], bool] = {}

    def set(self, name: str, active: bool, gpu: int = 0) -> None:
        self.state[(gpu, name)] = active

    def active(self, gpu: int, name: str) -> bool:
        return self.state.get((gpu, name), False)


class FakeEnforcer:
    """Records every call with its trio time; insists on state changes only."""

    def __init__(self, clock: trio.testing.MockClock | None = None, cost: float = 0.0) -> None:
        self.clock = clock
        self.cost = cost  # each call takes this long (jumps the mock clock): a switch loss
        self.frozen: set[tuple[int, str]] = set()
        self.events: list[tuple[float, int, str, str]] = []  # (time, gpu, op, name)
        self.redundant: list[tuple[float, str, str]] = []
        self.fail_freeze: dict[str, int] = {}

    def _do(self, op: str, gpu: int, name: str) -> None:
        if self.cost and self.clock is not None:
            self.clock.jump(self.cost)
        self.events.append((trio.current_time(), gpu, op, name))

    def freeze(self, gpu: int, name: str) -> None:
        if self.fail_freeze.get(name, 0) > 0:
            self.fail_freeze[name] -= 1
            raise OSError("cgroup.freeze: device busy")
        if (gpu, name) in self.frozen:
            self.redundant.append((trio.current_time(), "freeze", name))
        self._do("freeze", gpu, name)
        self.frozen.add((gpu, name))

    def thaw(self, gpu: int, name: str) -> None:
        if (gpu, name) not in self.frozen:
            self.redundant.append((trio.current_time(), "thaw", name))
        self._do("thaw", gpu, name)
        self.frozen.discard((gpu, name))

    def frozen_time(self, name: str, t0: float, t1: float, gpu: int = 0) -> float:
        """How long `name` was frozen within [t0, t1]."""
        total, since = 0.0, None
        for t, g, op, n in self.events:
            if g != gpu or n != name:
                continue
            if op == "freeze" and since is None:
                since = t
            elif op == "thaw" and since is not None:
                total += max(0.0, min(t, t1) - max(since, t0))
                since = None
        if since is not None:
            total += max(0.0, t1 - max(since, t0))
        return total

    def ran(self, name: str, t0: float, t1: float, gpu: int = 0) -> float:
        """Share of [t0, t1] an always-active instance was not frozen."""
        return 1.0 - self.frozen_time(name, t0, t1, gpu) / (t1 - t0)

    def ops(self, op: str, name: str | None = None) -> int:
        return sum(1 for _, _, o, n in self.events if o == op and (name is None or n == name))


def run_on_mock_clock(test):
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(test, clock, clock=clock)


async def started(nursery, node, enf, act, **kw) -> GpuScheduler:
    s = GpuScheduler(node, kw.pop("gpu", 0), enf, act, params=kw.pop("params", Params(slice=X)), **kw)
    await nursery.start(s.run)
    return s


@asynccontextmanager
async def running(node, act, **kw):
    """A started scheduler of GPU 0 and its recording enforcer; stopped on exit."""
    enf = kw.pop("enf", None) or FakeEnforcer()
    async with trio.open_nursery() as n:
        s = await started(n, node, enf, act, **kw)
        yield s, enf
        s.stop()


def test_fakes_satisfy_the_protocols():
    assert isinstance(FakeEnforcer(), Enforcer)
    assert isinstance(FakeActivity(), Activity)
    assert not isinstance(object(), Enforcer)


def test_weighted_one_to_two_exact_on_the_mock_clock():
    node, act = scenario(2, (A, 1), (B, 2))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(60.0)
            t = trio.current_time()
            snap = s.snapshot()
            n_events = len(enf.events)
        assert enf.ran(A, 0, t) == pytest.approx(1 / 3, abs=1e-6)
        assert enf.ran(B, 0, t) == pytest.approx(2 / 3, abs=1e-6)
        # never both on the GPU at once
        frozen = set()
        for _, _, op, name in enf.events[:n_events]:  # (before the first call, nothing was frozen yet)
            (frozen.add if op == "freeze" else frozen.discard)(name)
            assert len({A, B} - frozen) <= 1
        # the scheduler's own telemetry says the same
        assert snap.instances[A].granted_seconds == pytest.approx(20.0, abs=1e-6)
        assert snap.instances[B].share_10s == pytest.approx(2 / 3, abs=1e-3)
        assert snap.instances[A].share_1s == pytest.approx(1 / 3, abs=0.011)  # 1 s is not a whole number of 30 ms cycles
        assert snap.switches == pytest.approx(2 * 6000 / 3, abs=2)
        assert snap.lateness_max == 0.0 and snap.lateness_count >= 5999
        assert enf.redundant == []

    run_on_mock_clock(main)


def test_late_wakeups_and_switch_losses_are_measured_and_paid_back():
    node, act = scenario(2, (A, 1), (B, 2))

    async def disturb(clock):
        # a busy core: every 93.7 ms the process loses 3 ms
        while True:
            await trio.sleep(0.0937)
            clock.jump(0.003)

    async def main(clock):
        enf = FakeEnforcer(clock, cost=50e-6)  # each freeze/thaw costs 50 µs
        async with trio.open_nursery() as n:
            n.start_soon(disturb, clock)
            s = await started(n, node, enf, act)
            await trio.sleep(30.0)
            t = trio.current_time()
            snap = s.snapshot()
            n.cancel_scope.cancel()
        a, b = enf.ran(A, 1, t), enf.ran(B, 1, t)
        assert a / (a + b) == pytest.approx(1 / 3, abs=0.001)
        assert 0.002 < snap.lateness_max <= 0.003 + 1e-9
        assert sum(1 for x in snap.lateness if x > 0.0002) > 30
        assert min(snap.lateness) >= 0.0
        assert snap.lateness_quantile(0.5) < 0.001
        assert 0.99 < a + b < 1.0  # switch losses (freeze to thaw) are real but small, and shared fairly

    run_on_mock_clock(main)


def test_only_state_changes_are_enforced_and_counts_match_switches():
    node, act = scenario(2, (A, 8), (B, 4))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(10 * 12 * X - X / 2)  # 10 cycles of 12 slices
            switches = s.telemetry.switches
        assert enf.redundant == []
        assert switches == 19
        assert enf.ops("freeze") == 1 + 19  # B at the start, then one per switch
        assert enf.ops("thaw") == 19 + 1  # one per switch, then the one left frozen at stop

    run_on_mock_clock(main)


def test_stop_leaves_everyone_thawed():
    node, act = scenario(3, (A, 1), (B, 1))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(1.0 + X / 3)
            assert s.frozen == {A, B}  # policy 3, 1/16 each: mid-waste both are held
            assert enf.frozen == {(0, A), (0, B)}
        assert enf.frozen == set()
        assert s.frozen == frozenset()
        assert s.published is not None and s.published.thaws >= 2
        # stop before run: returns at once, freezes nothing
        s2 = GpuScheduler(node, 0, enf, act, params=Params(slice=X))
        s2.stop()
        before = len(enf.events)
        async with trio.open_nursery() as n:
            await n.start(s2.run)
        assert len(enf.events) == before

    run_on_mock_clock(main)


def test_highprio_takes_the_gpu_at_once_when_poked():
    node, act = scenario(2, (A, 1), (B, 1), (H, 1, False, True))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(1.0035)
            assert H not in s.frozen  # idle: never frozen
            act.set(H, True)
            s.poke()
            await trio.testing.wait_all_tasks_blocked()  # let the loop look (the clock stands still)
            t = trio.current_time()
            assert t == pytest.approx(1.0035)
            assert s.frozen == {A, B}
            assert s.decision.running == {H}
            await trio.sleep(20.0)
            t2 = trio.current_time()
        assert enf.ran(H, t, t2) == pytest.approx(0.8, abs=0.005)
        assert enf.ran(A, t + 1, t2) == pytest.approx(0.1, abs=0.005)
        assert enf.ran(B, t + 1, t2) == pytest.approx(0.1, abs=0.005)
        assert enf.redundant == []

    run_on_mock_clock(main)


def test_without_poke_a_newcomer_waits_at_most_one_slice_and_is_then_held():
    node, act = scenario(0, (A, 1), (B, 1, False), max_inst=4)

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(0.5 + X / 2)  # in A's slot (A, B, waste, waste)
            act.set(B, True)
            await trio.sleep(X)
            assert B in s.frozen or s.decision.running == {B}
            s.poke()
            await trio.sleep(4.0)
            t = trio.current_time()
        assert enf.ran(B, 1, t) == pytest.approx(0.25, abs=X / (t - 1))  # [1, t] is not whole cycles
        assert enf.ran(A, 1, t) == pytest.approx(0.25, abs=X / (t - 1))

    run_on_mock_clock(main)


def test_poked_newcomer_is_held_at_once_under_an_exclusive_policy():
    node, act = scenario(2, (A, 4), (B, 4, False))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(0.0025)  # A's run of 4 slices
            act.set(B, True)
            s.poke()
            await trio.testing.wait_all_tasks_blocked()
            assert enf.events[-1] == (pytest.approx(0.0025), 0, "freeze", B)
            assert s.decision.running == {A}

    run_on_mock_clock(main)


def test_preemptive_idle_time_goes_to_the_others_at_once():
    node, act = scenario(1, (A, 1), (B, 1))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(5.0)
            t0 = trio.current_time()
            assert enf.ran(A, 0, t0) == pytest.approx(0.5, abs=1e-6)
            await trio.sleep(X / 4)
            (held,) = s.decision.running
            other = B if held == A else A
            act.set(held, False)
            s.poke()
            await trio.testing.wait_all_tasks_blocked()
            assert s.decision.running == {other}
            assert s.frozen == frozenset()  # the idle one is not frozen, the other runs
            await trio.sleep(3.0)
            t1 = trio.current_time()
            act.set(held, True)  # back: it gets its share back
            await trio.sleep(5.0)
            t2 = trio.current_time()
        assert enf.ran(other, t0 + X, t1) == pytest.approx(1.0)
        assert enf.ran(held, t1 + X, t2) == pytest.approx(0.5, abs=0.003)

    run_on_mock_clock(main)


def test_settings_changes_take_effect_at_the_next_boundary():
    node, act = scenario(2, (A, 1), (B, 1))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(5.0 + 0.0033)
            in_force = s.decision
            node.set_weight(0, B, 3)
            await trio.sleep(in_force.until - trio.current_time() - 1e-6)
            assert s.decision is in_force  # the slice runs to its end
            await trio.sleep(10.0)
            t1 = trio.current_time()
            node.set_policy(0, 3)  # A 1/16, B 3/16
            await trio.sleep(16.0)
            t2 = trio.current_time()
            node.set_max_inst(0, 8)  # A 1/8, B 3/8
            await trio.sleep(16.0)
            t3 = trio.current_time()
        assert enf.ran(B, 5.1, t1) == pytest.approx(0.75, abs=0.002)
        assert enf.ran(A, t1 + 0.2, t2) == pytest.approx(1 / 16, abs=0.002)
        assert enf.ran(B, t1 + 0.2, t2) == pytest.approx(3 / 16, abs=0.002)
        assert enf.ran(A, t2 + 0.2, t3) == pytest.approx(1 / 8, abs=0.002)
        assert enf.ran(B, t2 + 0.2, t3) == pytest.approx(3 / 8, abs=0.002)

    run_on_mock_clock(main)


def test_weight_change_is_not_applied_mid_slice():
    node, act = scenario(2, (A, 1), (B, 1), (C, 0))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(1.0 + X / 2)
            assert C in s.frozen  # weight 0: no compute
            boundary = s.decision.until
            node.set_weight(0, A, 0)
            node.set_weight(0, B, 0)
            node.set_weight(0, C, 2)
            await trio.testing.wait_all_tasks_blocked()
            assert C in s.frozen  # not yet
            await trio.sleep(boundary - trio.current_time())
            await trio.testing.wait_all_tasks_blocked()
            assert s.frozen == {A, B}

    run_on_mock_clock(main)


def test_idle_instances_are_never_frozen_and_removed_ones_are_let_go():
    node, act = scenario(2, (A, 1), (B, 1), (C, 1, False))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(3.0)
            assert enf.ops("freeze", C) == 0
            assert enf.ran(A, 0, 3.0) == pytest.approx(1 / 3, abs=0.004)  # C's slot is wasted
            while A not in s.frozen:
                await trio.sleep(X / 2)
            node.destroy(A)
            await trio.sleep(2 * X)
            assert A not in s.frozen and (0, A) not in enf.frozen
            assert A not in s.snapshot().instances
        assert enf.redundant == []

    run_on_mock_clock(main)


def test_enforcer_errors_are_retried_and_counted():
    node, act = scenario(2, (A, 1), (B, 1))

    async def main(clock):
        enf = FakeEnforcer()
        enf.fail_freeze[B] = 3
        async with running(node, act, enf=enf) as (s, _):
            await trio.sleep(2.0)
            snap = s.snapshot()
        assert snap.enforce_errors == 3
        assert enf.ops("freeze", B) >= 50
        assert enf.frozen == set()

    run_on_mock_clock(main)


def test_native_policy_freezes_nothing():
    node, act = scenario(5, (A, 0), (B, 1, True, True))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(3.0)
            snap = s.snapshot()
        assert enf.events == []
        assert snap.instances[A].share_1s == pytest.approx(1.0)
        assert snap.switches == 0

    run_on_mock_clock(main)


def test_policy_switch_from_native_freezes_at_the_next_boundary_and_back_thaws():
    node, act = scenario(5, (A, 1), (B, 1))

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(1.0)
            node.set_policy(0, 1)
            await trio.sleep(1.0)
            assert len(s.frozen) == 1
            node.set_policy(0, 5)
            await trio.sleep(X * 2.5)
            assert s.frozen == frozenset() and enf.frozen == set()

    run_on_mock_clock(main)


class TimelineMeter:
    """Policy 4 with a meter: running together, the hog does 80 % of the GPU's work."""

    def __init__(self, enf: FakeEnforcer, names: list[str]) -> None:
        self.enf = enf
        self.names = names

    def gpu_seconds(self, gpu: int, name: str) -> float:
        now = trio.current_time()
        frozen: set[str] = set()
        total, last = 0.0, 0.0
        for t, g, op, n in self.enf.events + [(now, gpu, "end", "")]:
            running = [x for x in self.names if x not in frozen]
            if name in running:
                share = 1.0 if len(running) == 1 else (0.8 if name == A else 0.2)
                total += share * (t - last)
            last = t
            if op == "freeze":
                frozen.add(n)
            elif op == "thaw":
                frozen.discard(n)
        return total


def test_weak_policy_with_a_usage_meter_holds_the_hog():
    node, act = scenario(4, (A, 1), (B, 1))

    async def main(clock):
        enf = FakeEnforcer()
        meter = TimelineMeter(enf, [A, B])
        assert isinstance(meter, UsageMeter)
        async with trio.open_nursery() as n:
            s = await started(n, node, enf, act, usage=meter, params=Params(slice=0.05, window=1.0))
            await trio.sleep(12.0)
            t = trio.current_time()
            s.stop()
        hog, mod = meter.gpu_seconds(0, A), meter.gpu_seconds(0, B)
        # unchecked, running together, the hog would do 80 % of the work; held, each does half
        assert enf.frozen_time(A, 0, t) > 2 * enf.frozen_time(B, 0, t) > 0
        assert s.planner.usage_share(A, t) <= 0.5 + 0.05
        assert hog / t == pytest.approx(0.5, abs=0.03)
        assert mod / t == pytest.approx(0.5, abs=0.03)

    run_on_mock_clock(main)


def test_two_gpus_two_loops_and_published_stats():
    node = make_node(2)
    node.set_policy(0, 2)
    node.set_policy(1, 0)
    node.set_max_inst(1, 4)
    for g in (0, 1):
        node.create_instance(g, A, weight=1)
        node.create_instance(g, B, weight=3)
    act = FakeActivity()
    for g in (0, 1):
        act.set(A, True, g)
        act.set(B, True, g)

    async def main(clock):
        enf = FakeEnforcer()
        scheds = schedulers_for(node, enf, act, params=Params(slice=X))
        async with trio.open_nursery() as n:
            for sch in scheds:
                await n.start(sch.run)
            await trio.sleep(12.0)
            t = trio.current_time()
            pub = stats(scheds)
            for sch in scheds:
                sch.stop()
        assert enf.ran(B, 1, t, gpu=0) == pytest.approx(0.75, abs=1e-3)
        assert enf.ran(B, 1, t, gpu=1) == pytest.approx(0.25, abs=1e-3)
        assert set(pub) == {0, 1}
        p0 = pub[0]
        assert isinstance(p0, GpuStats) and p0.gpu == 0 and t - 0.6 <= p0.time <= t
        assert p0.instances[B].share_10s == pytest.approx(0.75, abs=2e-3)
        with pytest.raises(TypeError):
            p0.instances["x"] = None  # read-only for the collector thread
        # the ring keeps the last 60 s: all 12 s of this run, slice after slice
        assert p0.recent[0].start == pytest.approx(p0.started) and all(r.gpu == 0 for r in p0.recent)
        assert all(b.start == pytest.approx(a.end) for a, b in zip(p0.recent, p0.recent[1:]))
        assert p0.recent[-1].end <= p0.time + 1e-9
        assert all(r.end >= r.start for r in p0.recent)

    run_on_mock_clock(main)


def test_merged_runs_replan_at_once_when_a_setting_changes_and_the_loop_is_poked():
    """The daemon's mode: a run of wasted slots is one long decision; a change
    written to the tree wakes the loop (the daemon pokes it) and applies now."""
    node, act = scenario(3, (A, 1), (B, 1))  # fixed: A 1/16, B 1/16, then 14 wasted slots

    async def main(clock):
        async with running(node, act, params=Params(slice=X, merge_runs=True)) as (s, enf):
            while s.decision is None or s.decision.kind.value != "waste":
                await trio.sleep(X / 2)
            assert s.decision.length == pytest.approx(14 * X)  # one decision for the whole run
            t = trio.current_time()
            node.set_policy(0, 1)  # preemptive: A and B take turns, nothing wasted
            s.poke()
            await trio.testing.wait_all_tasks_blocked()
            assert trio.current_time() == t  # replanned at the same instant
            assert s.decision.running in ({A}, {B})
            await trio.sleep(2.0)
            t2 = trio.current_time()
        assert enf.ran(A, t, t2) == pytest.approx(0.5, abs=0.01)
        assert enf.ran(B, t, t2) == pytest.approx(0.5, abs=0.01)

    run_on_mock_clock(main)


class SnapshotActivity(FakeActivity):
    """A detector that answers for everyone at once (as ActivityMonitor does)."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots = 0

    def active(self, gpu: int, name: str) -> bool:
        raise AssertionError("the loop should ask once per boundary through snapshot()")

    def snapshot(self):
        self.snapshots += 1
        return dict(self.state)


def test_a_detector_with_snapshot_is_asked_once_per_boundary_with_the_same_outcome():
    node, _ = scenario(2, (A, 1), (B, 2))
    act = SnapshotActivity()
    act.set(A, True)
    act.set(B, True)

    async def main(clock):
        async with running(node, act) as (s, enf):
            await trio.sleep(3.0)
            t = trio.current_time()
            slices = s.telemetry.slices
        assert enf.ran(A, 0.3, t) == pytest.approx(1 / 3, abs=0.01)
        assert enf.ran(B, 0.3, t) == pytest.approx(2 / 3, abs=0.01)
        assert act.snapshots <= slices + 2  # one look per boundary, not one per instance

    run_on_mock_clock(main)


class SharingEnforcer(FakeEnforcer):
    """A fake of gated targets: records what each was told about sharing its GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.told: dict[str, tuple[bool, int]] = {}

    def target(self, name: str) -> object:
        return self

    def share(self, gpu: int, name: str, on: bool, budget_us: int) -> None:
        self.told[name] = (on, budget_us)


def test_gated_instances_are_bounded_under_every_controlled_policy_alone_or_not():
    """Every instance of the GPU is told its queued work is bounded (the budget with it) under
    policies 0-4, the active one alone included — what it queued alone could not be recalled when a
    neighbour or a high-priority instance arrives; under policy 5 (no control) and at stop nobody is;
    a change of policy is told at once when poked."""
    node, act = scenario(1, (A, 1), (B, 2, False), (C, 0))
    budget = 3000

    async def main(clock):
        enf = SharingEnforcer()
        async with running(node, act, enf=enf, params=Params(slice=X, queue_budget=0.003)) as (s, _):
            await trio.sleep(2.0)  # (A alone, active, for long)
            assert enf.told == {A: (True, budget), B: (True, budget), C: (True, budget)}
            node.set_policy(0, 5)
            s.poke()
            await trio.testing.wait_all_tasks_blocked()
            assert {on for on, _ in enf.told.values()} == {False}
            node.set_policy(0, 2)
            s.poke()
            await trio.testing.wait_all_tasks_blocked()
            assert enf.told[A] == (True, budget)
        assert {on for on, _ in enf.told.values()} == {False}

    run_on_mock_clock(main)


class ChurningEnforcer(FakeEnforcer):
    """A fake of one gated target (A's) whose page's slot never drains and reads as a new answer at
    every look (garbage that keeps changing, or a hostile process): given up on, and then there
    again."""

    def __init__(self) -> None:
        super().__init__()
        self._r, self._w = os.pipe()  # (a FIFO nobody writes)
        self.given_up = 0

    def fileno(self) -> int:
        return self._r

    def consume(self) -> None:
        pass

    def give_up(self, gpu: int, every: bool = False) -> list[tuple[int, str]]:
        self.given_up += 1
        return [(0, "dead")]

    def undrained(self, names, gpu: int) -> list:
        return [self] if A in names and (gpu, A) in self.frozen else []

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def test_a_drain_that_never_ends_is_cut_at_the_cap_and_the_others_run():
    """Each look at A's page finds its slot undrained anew (given up on, there again): the wait for
    its drain ends at drain_cap, whatever the page says, and B gets the GPU (it waited for ever)."""
    node, act = scenario(2, (A, 1), (B, 1))

    async def main(clock):
        enf = ChurningEnforcer()
        try:
            with trio.move_on_after(60):
                async with running(node, act, enf=enf, params=Params(slice=X, drain_cap=0.5)) as (s, _):
                    await trio.sleep(30)
            thawed_b = [t for t, _, op, n in enf.events if op == "thaw" and n == B]
            frozen_a = [t for t, _, op, n in enf.events if op == "freeze" and n == A]
            assert frozen_a and [t for t in thawed_b if frozen_a[0] < t < 30], "B never ran after A's first closing"
            assert len(frozen_a) > 10  # (its turns go on: each drain cut at the cap)
        finally:
            enf.close()

    run_on_mock_clock(main)
