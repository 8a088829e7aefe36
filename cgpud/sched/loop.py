"""One trio task per GPU: plan a slice, enforce it, sleep to its end, account.

    sched = GpuScheduler(node, 0, enforcer, activity, params=Params(slice=0.010))
    await nursery.start(sched.run)
    ...
    sched.stop()          # ends the loop; everything it froze is thawed

At every boundary the loop reads the model (policy, max_inst, prio_ratio,
instances, weights, highprio) and the activity of each instance, asks the
planner for a decision, and freezes/thaws only what changes: an instance is
held frozen while it is active and not allowed to run. Idle instances are
never frozen (they do not use the GPU, and a frozen process could not open
it). Time is read only through `trio.current_time()` and waited for only with
deadlines on trio's clock, so the loop runs unchanged on `MockClock`.

`poke()` wakes the loop between boundaries (an activity detector calls it when an instance opens or
closes the GPU): a high-priority instance then takes the GPU at once, a newcomer that may not run is
frozen at once, and idle time is handed on where the policy gives it to others.
"""
from __future__ import annotations

import logging
import operator
from typing import Mapping, Sequence

import trio

from cgpud.core.model import Node
from cgpud.sched import native
from cgpud.sched.batching import NativeSwitching
from cgpud.sched.gate import look_at_pages
from cgpud.sched.gputime import HeldBack, PrioTime
from cgpud.sched.enforce_api import Activity, Enforcer, UsageMeter
from cgpud.sched.policies import Decision, GpuView, InstView, Kind, Params, Planner
from cgpud.sched.sharing import QueueBounds
from cgpud.sched.telemetry import GpuStats, Telemetry

log = logging.getLogger("cgpud.sched")
_SETTINGS = operator.attrgetter("name", "weight", "highprio")  # an instance's part of the basis (C speed)


class EventWaiter:
    """Waits on trio's own timers (what the tests use, on MockClock).
    trio's timers may fire up to 1 ms late: CPython rounds epoll's timeout up
    to whole milliseconds."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def wake(self) -> None:
        self._event.set()

    def reset(self) -> None:
        if self._event.is_set():
            self._event = trio.Event()

    async def wait_until(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self._event.wait()

    def close(self) -> None:
        pass


class TimerFdWaiter:
    """Waits on a timerfd: wakes within microseconds of the deadline (the
    daemon's choice on Linux). `wake()` makes the timer fire at once."""

    def __init__(self) -> None:
        from cgpud.sched.timerfd import TimerFd

        self._timer = TimerFd()
        self._woken = False

    def wake(self) -> None:
        self._woken = True
        self._timer.fire_now()

    def reset(self) -> None:
        self._woken = False

    async def wait_until(self, deadline: float) -> None:
        if self._woken:
            await trio.lowlevel.checkpoint()
            return
        await self._timer.sleep_until(deadline)

    def close(self) -> None:
        self._timer.close()


class GpuScheduler(NativeSwitching, QueueBounds, PrioTime, HeldBack):
    """The time-slice scheduler of one GPU (a background service: `run`, `stop`).

    With a `switcher` (cgpud.sched.native), the slices of gated instances
    under the ring policies are carried out by its thread, planned ahead a
    batch at a time (cgpud.sched.batching); the rest as below."""

    def __init__(
        self,
        node: Node,
        gpu: int,
        enforcer: Enforcer,
        activity: Activity,
        *,
        params: Params | None = None,
        usage: UsageMeter | None = None,
        publish_every: float = 0.5,
        waiter: EventWaiter | TimerFdWaiter | None = None,
        switcher: native.Switcher | None = None,
        batch: float = 0.5,
    ) -> None:
        self.node = node
        self.gpu = gpu
        self.params = params or Params()
        self.planner = Planner(self.params)
        self.telemetry = Telemetry(gpu)
        self.published: GpuStats | None = None  # replaced whole every publish_every s: safe to read from any thread
        self._enforcer = enforcer
        self._activity = activity
        self._usage = usage
        self._publish_every = publish_every
        self._frozen: set[str] = set()
        self._failing: set[tuple[str, str]] = set()
        self._scope: trio.CancelScope | None = None
        self._stop_requested = False
        self._waiter = waiter or EventWaiter()
        self._waiting = False
        self._current: tuple[Decision, float, dict[str, float] | None] | None = None
        self._last_publish = -float("inf")
        self._cached_view: GpuView | None = None  # (_view: the last view and what it was built from)
        self._cached_basis: tuple | None = None
        self._cached_snap: dict | None = None
        self.decision: Decision | None = None  # the decision in force
        self._switcher = switcher
        self._batch_horizon = batch

    # ---- service -----------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self._scope is not None:
            raise RuntimeError(f"the scheduler of GPU {self.gpu} is already running")
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                self.telemetry.start(trio.current_time())
                task_status.started()
                if not self._stop_requested:
                    await self._loop()
            finally:
                self._finish()
                self._scope = None

    def stop(self) -> None:
        """End the loop. Everything it froze is thawed before `run` returns."""
        self._stop_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def poke(self) -> None:
        """Activity changed: look again now rather than at the next boundary."""
        if self._native_poke():
            return
        if self._waiting:
            self._waiter.wake()

    @property
    def frozen(self) -> frozenset[str]:
        """The instances this loop holds frozen now (or its switcher holds at their gates)."""
        return frozenset(self._frozen) | self._native_frozen

    def snapshot(self) -> GpuStats:
        """Telemetry as of now (call from the trio thread)."""
        return self.telemetry.snapshot(trio.current_time())

    # ---- the loop ----------------------------------------------------------

    async def _loop(self) -> None:
        planner, tel = self.planner, self.telemetry
        prev: Decision | None = None
        waiter = self._waiter
        self._waiting = True
        now = trio.current_time()
        while True:
            self._account(now)  # the slice that just ended, up to the wake-up
            view = self._view()
            self._share(view)
            tel.retain(view.names)
            if self._switcher is not None and (gates := self._native_gates(view)) is not None:
                ran = await self._native_run(view, gates, prev)
                if ran is not None:  # (it charged everything up to now)
                    prev = self.decision = ran
                    now = trio.current_time()
                    continue
            dec = planner.plan(view, now)
            waited = await self._enforce(view, dec)
            start = trio.current_time()
            if prev is not None:
                if start > now:  # the old set ran on until it was frozen just now: its time, not the new set's
                    planner.charge(prev, now, start)
                    tel.record(prev, now, start, tail=True)
                if dec.running != prev.running:
                    tel.switches += 1
            prev = self.decision = dec
            # (what the view was made of, unless others ran while we waited for a drain)
            basis = self._cached_basis if not waited and self._cached_basis is not None else self._basis()
            self._current = (dec, start, self._read_usage(dec))
            self._prio_before = self._prio_ns(view, dec)
            while True:
                waiter.reset()
                await waiter.wait_until(dec.until)
                now = trio.current_time()
                if now >= dec.until:
                    tel.late(now - dec.until)
                    break
                view = self._view()  # poked
                self._share(view)
                if planner.preempt(view, dec, now) or self._basis() != basis:
                    break  # (a setting changed: it takes effect now)
                await self._enforce(view, dec)
            self._publish(now)

    def _publish(self, now: float) -> None:
        """Publish the telemetry as of `now` when `publish_every` has passed (the slice in force charged first)."""
        if now - self._last_publish >= self._publish_every:
            self._last_publish = now
            self._account(now)
            self.published = self.telemetry.snapshot(now)
            look_at_pages(self._enforcer, self._cached_view)  # (a damaged usage page said, once)

    def _account(self, end: float) -> None:
        """Charge the decision in force from its start to `end`."""
        if self._current is None:
            return
        dec, start, before = self._current
        self._current = None
        usage = None
        if before is not None:
            after = self._read_usage(dec) or {}
            usage = {n: max(0.0, after.get(n, 0.0) - before.get(n, 0.0)) for n in dec.active}
        prio_used = None
        if self._prio_before is not None:
            names, ns = self._prio_before
            now_ns = self._prio_reading(names)
            prio_used = max(0, now_ns - ns) / 1e9 if now_ns is not None else None
        self._prio_before = None
        self.planner.charge(dec, start, end, usage, prio_used)
        self.telemetry.record(dec, start, end)

    def _finish(self) -> None:
        """Leave nothing frozen; account the slice that was cut short."""
        self._waiting = False
        self._waiter.close()
        if self._switcher is not None:
            self._switcher.close()
            self._switcher = None
        try:
            self._account(trio.current_time())
            self._share(None)  # (nobody bounds its queue for a scheduler that is gone)
        finally:
            for name in sorted(self._frozen):
                try:
                    self._enforcer.thaw(self.gpu, name)
                except Exception:
                    log.exception("GPU %d: cannot thaw %s at stop", self.gpu, name)
                    self.telemetry.enforce_errors += 1
                else:
                    self.telemetry.thaws += 1
            self._frozen.clear()
            self.decision = None
            self.published = self.telemetry.snapshot(trio.current_time())

    # ---- model, activity, enforcement ---------------------------------------

    def _view(self) -> GpuView:
        """The view as of now: the one built last while nothing it is made
        of changed (the settings and the activity), so that the planner can
        reuse what it derived from it."""
        g = self.node.gpu(self.gpu)
        basis = self._basis(g)
        snap = self._activity_snapshot()
        if snap is not None:
            cached = self._cached_view
            if cached is not None and basis == self._cached_basis and snap == self._cached_snap:
                return cached
            self._cached_basis, self._cached_snap = basis, dict(snap)
            gpu = self.gpu
            insts = tuple(InstView(name, weight, highprio, snap.get((gpu, name), False))
                          for name, weight, highprio in basis[3])
        else:
            self._cached_basis = self._cached_snap = None
            insts = tuple(InstView(name, weight, highprio, self._is_active(name))
                          for name, weight, highprio in basis[3])
        self._cached_view = view = GpuView(g.policy, g.max_inst, g.prio_ratio, insts)
        return view

    def _activity_snapshot(self) -> Mapping | None:
        """Every instance's activity in one call, when the detector offers it
        (`snapshot() -> {(gpu, name): bool}`): one look per boundary instead
        of one per instance."""
        snapshot = getattr(self._activity, "snapshot", None)
        if snapshot is None:
            return None
        try:
            return snapshot()
        except Exception:
            if ("active", "*") not in self._failing:
                self._failing.add(("active", "*"))
                log.exception("GPU %d: activity unknown; everyone taken as idle", self.gpu)
            return {}

    def _basis(self, g=None) -> tuple:
        """The settings a decision was made on: when they change, replan."""
        if g is None:
            g = self.node.gpu(self.gpu)
        return g.policy, g.max_inst, g.prio_ratio, self._held_back(tuple(map(_SETTINGS, g.instances.values())))

    def _is_active(self, name: str) -> bool:
        try:
            return bool(self._activity.active(self.gpu, name))
        except Exception:
            if ("active", name) not in self._failing:
                self._failing.add(("active", name))
                log.exception("GPU %d: activity of %s unknown; taken as idle", self.gpu, name)
            return False

    def _read_usage(self, dec: Decision) -> dict[str, float] | None:
        if self._usage is None or not dec.active:
            return None
        out = {}
        for name in dec.active:
            try:
                out[name] = float(self._usage.gpu_seconds(self.gpu, name))
            except Exception:
                out[name] = 0.0
        return out

    async def _enforce(self, view: GpuView, dec: Decision) -> bool:
        """Freeze the active instances that may not run, thaw the others: only changes.
        Between the two, an instance stopped at a gate (libcgpu: cgpud.sched.gate)
        finishes the work it had queued, for at most one long slice, so that the
        next instance's slice starts on a free GPU. Returns whether it waited for that."""
        if dec.kind is Kind.NATIVE:
            want: frozenset[str] = frozenset()
        else:
            want = view.active_names - dec.running
        if want == self._frozen:
            return False  # (nothing to change: the usual case within a slice)
        present = view.names
        tel = self.telemetry
        stopped = []
        for name in sorted(want - self._frozen):  # freeze before thawing: never two at once
            if self._call(self._enforcer.freeze, "freeze", name):
                self._frozen.add(name)
                stopped.append(name)
                tel.freezes += 1
        waited = False
        if stopped:  # (also before an idle slot: the work that runs on is the stopped one's, charged to it)
            waited = await self._drain(stopped)
        for name in sorted(self._frozen - want):
            if self._call(self._enforcer.thaw, "thaw", name):
                tel.thaws += 1
                self._frozen.discard(name)
            elif name not in present:  # gone: nothing left to thaw
                self._frozen.discard(name)
        return waited

    async def _drain(self, names: list[str]) -> bool:
        """Wait until the gated instances `names` have drained (each wakes us
        through its FIFO). Each time `max_slice` passes, the processes that
        cannot answer (dead, stopped, alive and not draining) are given up on
        — not waited for again until they answer — and the log says which;
        past `drain_limit` (one drain bound unless drain_cap says more) every one is."""
        undrained = getattr(self._enforcer, "undrained", None)
        if undrained is None:
            return False
        waiting = undrained(names, self.gpu)
        if not waiting:
            return False
        p = self.planner.params
        t0 = trio.current_time()
        while waiting:
            with trio.move_on_after(p.max_slice):
                while waiting:
                    try:
                        await trio.lowlevel.wait_readable(waiting[0].fileno())
                    except trio.BusyResourceError:  # (another GPU's loop waits on it: look again soon)
                        await trio.sleep(0.0005)
                    except trio.ClosedResourceError:  # its instance went meanwhile (closed: no longer undrained)
                        pass
                    waiting[0].consume()
                    waiting = undrained(names, self.gpu)
            capped = trio.current_time() - t0 >= p.drain_limit
            for target in waiting:
                for slot, why in target.give_up(self.gpu, capped):
                    log.warning("%s: the process of slot %d did not finish its queued GPU work within %.0f ms of its "
                                "slice's end (%s); it is not waited for until it answers", target, slot,
                                (trio.current_time() - t0) * 1000, why)
            # (past the cap, nobody: a slot whose values keep changing cannot hold the GPU on)
            waiting = undrained(names, self.gpu) if not capped else []
        self.telemetry.drains += 1
        self.telemetry.drain_seconds += trio.current_time() - t0
        return True

    def _call(self, fn, what: str, name: str) -> bool:
        try:
            fn(self.gpu, name)
        except Exception:
            self.telemetry.enforce_errors += 1
            if (what, name) not in self._failing:
                self._failing.add((what, name))
                log.exception("GPU %d: %s %s failed; will retry", self.gpu, what, name)
            return False
        self._failing.discard((what, name))
        return True


def schedulers_for(
    node: Node,
    enforcer: Enforcer,
    activity: Activity,
    *,
    params: Params | None = None,
    usage: UsageMeter | None = None,
    precise: bool = False,
    switch: bool = False,
) -> list[GpuScheduler]:
    """One scheduler per GPU of the node (start each with `nursery.start(s.run)`).
    precise: wait on timerfds instead of trio's millisecond timers. switch:
    give each a switcher thread for its gated instances (cgpud.sched.native),
    when the daemon's native part is built."""
    return [scheduler_for(node, g.index, enforcer, activity, params=params, usage=usage, precise=precise,
                          switch=switch) for g in node.gpus]


def scheduler_for(node: Node, gpu: int, enforcer: Enforcer, activity: Activity, *, params: Params | None = None,
                  usage: UsageMeter | None = None, precise: bool = False, switch: bool = False) -> GpuScheduler:
    """GPU `gpu`'s scheduler (schedulers_for's, one of them: a GPU back in service gets a new one)."""
    p = params or Params()
    sw = native.Switcher(gpu, p.max_slice, p.drain_limit) if switch and native.load() is not None else None
    if sw is not None:
        sw.mode(p.switch, p.switch_lead)
        sw.align(p.slice)  # (a gang's turns start together on its GPUs, one slice of waiting at most)
    return GpuScheduler(node, gpu, enforcer, activity, params=params, usage=usage,
                        waiter=TimerFdWaiter() if precise else None, switcher=sw)


def stats(schedulers: Sequence[GpuScheduler]) -> Mapping[int, GpuStats | None]:
    """The latest published telemetry of each GPU (safe from any thread)."""
    return {s.gpu: s.published for s in schedulers}
