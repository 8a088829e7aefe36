"""A GPU's slices carried out by its switcher thread (cgpud.sched.native),
trio only planning: the part of GpuScheduler (cgpud.sched.loop) that runs
while every instance it must stop is gated (libcgpu) and the policy is a ring
(0-3).

    planner.plan_ahead(view, now, horizon)  ->  a batch of steps
    switcher: for each step, close / wait for the drain / open / sleep to its end
    trio wakes when the batch's last step starts (it plans the next, handed on
    before that step ends: no gap), or when poked (activity or settings
    changed: the batch is cut now and planning starts again from what really
    ran).

Every step's real times come back in a report and are charged
(Planner.settle): a step from its gate opening until its queued work was done
(the next switch's closing answered: its drain is its own); the rest of the
switch, from that answer to the next gate's opening, is nobody's (else each
instance would pay for every switch that ends its run, and one that runs a
slot at a time, for more of them than one given runs of several). The
telemetry's timeline runs on from one gate opening to the next. What was
planned ahead and did not start is taken back (Planner.rewind). When it hands
back to the loop, the gates closed on this GPU are the loop's again
(Enforcement.adopt): nothing is left closed that nobody knows of.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import trio

from cgpud.sched import native
from cgpud.sched.policies import EXCLUSIVE_POLICIES, Ahead, Decision, GpuView

log = logging.getLogger("cgpud.sched")


class _Batch:
    def __init__(self, ident: int, steps: list[Ahead]) -> None:
        self.id = ident
        self.steps = steps
        self.started = -1  # the last of its steps that has started


class NativeSwitching:
    """Mixed into GpuScheduler: `_switcher`, `_native_run`, `_native_poke`."""

    _switcher: native.Switcher | None = None
    _batch_horizon: float  # (GpuScheduler's `batch`)
    _native_scope: trio.CancelScope | None = None
    _native_state: dict | None = None  # while running: its universe (for `frozen` and the stop)
    _native_seq = 0  # the last batch's number
    _native_last: tuple[int, int] = (-1, -1)  # (batch, step): the last step handed over
    _native_poked = False

    # (GpuScheduler's)
    gpu: int
    planner: Any
    telemetry: Any
    decision: Decision | None
    _enforcer: Any
    _frozen: set[str]
    # and its _view(), _basis() and _publish()

    def _native_poke(self) -> bool:
        """Poked while the switcher runs: wake the planner (True), else False."""
        if self._native_scope is None:
            return False
        self._native_poked = True
        self._native_scope.cancel()
        return True

    def _native_gates(self, view: GpuView) -> dict[str, Any] | None:
        """The gates (GateFreezers driven per GPU) of the view's instances when the
        switcher may carry out its slices: a ring policy, every active instance and
        every instance the loop holds stopped gated. None: the loop does it."""
        if self._switcher is None or view.policy not in EXCLUSIVE_POLICIES:
            return None
        target = getattr(self._enforcer, "target", None)
        if target is None:
            return None
        gates = {}
        for i in view.instances:
            t = target(i.name)
            if t is not None and getattr(t, "drives_gpus", False) and getattr(t, "page", None) is not None \
                    and t.page.handle is not None:
                gates[i.name] = t
            elif i.active and i.weight > 0:
                return None
        if not gates or any(n not in gates for n in self._frozen):
            return None
        return gates

    async def _native_run(self, view: GpuView, gates: dict[str, Any], prev: Decision | None) -> Decision | None:
        """Carry out the view's slices through the switcher until the view
        changes or a decision comes that is not planned ahead; returns the
        decision in force then (its time charged up to now), or None when
        nothing could be planned ahead (nothing was done)."""
        planner, tel, gpu, sw = self.planner, self.telemetry, self.gpu, self._switcher
        assert sw is not None
        now = trio.current_time()
        # (a high-priority instance is active: one step at a time, so that its share is looked at each slice)
        horizon = 1e-9 if any(i.highprio and i.active for i in view.instances) else self._batch_horizon
        planner.ahead_reset()
        first = planner.plan_ahead(view, now, horizon)
        if not first:
            return None
        basis = self._basis()
        names = sorted(gates)
        index = {n: k for k, n in enumerate(names)}
        pages = [gates[n].page.share() for n in names]  # (ours: an instance detached meanwhile stays mapped)
        active = [n in view.active_names for n in names]
        release = getattr(self._enforcer, "release", None)
        for n in self._frozen:  # what the loop closed is the switcher's to open now
            if release is not None:
                release(gpu, n)
        self._frozen.clear()
        self._native_state = {"names": names, "gates": gates, "pages": pages}
        batches: dict[int, _Batch] = {}
        last: list[Any] = [prev]  # the decision whose report came last

        def started(batch: int, step: int) -> _Batch | None:
            b = batches.get(batch)
            if b is not None:
                b.started = max(b.started, step)
            return b

        def submit(steps: list[Ahead]) -> None:
            self._native_seq = seq = (self._native_seq + 1) & 0x7FFFFFFF
            batches[seq] = _Batch(seq, steps)
            spec = [(a.decision.length, index.get(a.decision.holder, -1) if a.decision.running else -1,
                     native.NOTIFY if k == len(steps) - 1 else 0) for k, a in enumerate(steps)]
            if not sw.submit(seq, pages, active, spec):
                raise RuntimeError("the switcher refused a batch while one was waiting")
            self._native_last = (seq, len(steps) - 1)

        def account(reports: list, offset: float, cut: Any = None) -> None:
            for r in reports:
                b = started(r.batch, r.step)
                if b is None or r.step >= len(b.steps):
                    continue
                ahead = b.steps[r.step]
                d = ahead.decision
                start, end = r.start / 1e9 + offset, r.end / 1e9 + offset
                # (from when the card was its own, to when its queued work was done: the rest of the switch,
                # opening the next gate, is nobody's; with overlap, the tail before it is the previous one's)
                planner.settle(ahead, r.owned / 1e9 + offset, r.drained / 1e9 + offset,
                               cut is not None and (r.batch, r.step) == (cut.batch, cut.step),
                               r.gpu_ns / 1e9 if r.gpu_ns >= 0 else None)
                if last[0] is not None and d.running != last[0].running:
                    tel.switches += 1
                tel.record(d, start, end)
                tel.switched += 1
                if r.late_ns:
                    tel.late(r.late_ns / 1e9)
                if r.closed:
                    tel.drains += 1
                    tel.drain_seconds += r.drain_ns / 1e9
                    tel.freezes += r.closed
                if r.gave_up >= 0:
                    log.warning("%s: a process of it did not finish its queued GPU work within %.0f ms of its "
                                "slice's end (%s); it is not waited for until it answers", names[r.gave_up],
                                r.drain_ns / 1e6, native.GAVE_UP.get(r.why, "?"))
                if r.longer:
                    log.info("GPU %d: a switch waited %.0f ms for a live process draining its queued GPU work",
                             gpu, r.drain_ns / 1e6)
                last[0] = d
                if r.step == len(b.steps) - 1:
                    del batches[r.batch]

        async def stop(cur: Any) -> Decision | None:
            """Cut the batch now: what did not start is taken back, what ran is
            charged, and the gates closed on this GPU are the loop's again."""
            sw.cancel()
            while not sw.idle():
                with trio.move_on_after(planner.params.max_slice):
                    await trio.lowlevel.wait_readable(sw.fileno())
                sw.ack()
            offset = trio.current_time() - time.monotonic()
            reports, _ = sw.take()
            for r in reports + ([cur] if cur is not None else []):
                started(r.batch, r.step)
            # what never started goes back into the ring (in the order it was planned)
            planner.rewind([a for bid in sorted(batches) for k, a in enumerate(batches[bid].steps)
                            if k > batches[bid].started])
            account(reports, offset, cur)
            self._native_handback()
            return last[0]

        submit(first)
        try:
            while True:
                self._native_poked = False
                with trio.CancelScope() as self._native_scope:
                    await trio.lowlevel.wait_readable(sw.fileno())
                self._native_scope = None
                sw.ack()
                offset = trio.current_time() - time.monotonic()
                reports, cur = sw.take()
                account(reports, offset)
                if cur is not None and (b := started(cur.batch, cur.step)) is not None and cur.step < len(b.steps):
                    self.decision = b.steps[cur.step].decision
                self._publish(trio.current_time())
                at_last = cur is not None and (cur.batch, cur.step) == self._native_last
                if not (at_last or self._native_poked):
                    continue
                if self._view() is not view or self._basis() != basis:  # (changed: cut the batch now)
                    return await stop(cur)
                if not at_last:
                    continue
                # the last step handed over has started: plan on from its planned end, handed over before it
                step = batches[cur.batch].steps[cur.step].decision
                nxt = planner.plan_ahead(view, cur.start / 1e9 + offset + step.length, horizon)
                if not nxt:  # (not planned ahead: the loop plans it, when this step ends)
                    with trio.move_on_at(cur.start / 1e9 + offset + step.length):
                        self._native_poked = False
                        with trio.CancelScope() as self._native_scope:
                            await trio.sleep_forever()
                    self._native_scope = None
                    return await stop(cur)
                submit(nxt)
        finally:
            self._native_scope = None
            if self._native_state is not None:  # (cancelled from outside: the daemon stops)
                self._native_abandon()

    def _native_handback(self) -> None:
        """The gates the switcher left closed on this GPU are the loop's; those of
        instances detached meanwhile (their GateFreezer closed) are opened."""
        state, self._native_state = self._native_state, None
        if state is None:
            return
        adopt = getattr(self._enforcer, "adopt", None)
        target = getattr(self._enforcer, "target", lambda name: None)
        for n, page in zip(state["names"], state["pages"]):
            if page.closed_on(self.gpu):
                g = state["gates"][n]
                if target(n) is g and g.page.handle is not None:
                    self._frozen.add(n)
                    if adopt is not None:
                        adopt(self.gpu, n)
                else:
                    page.thaw(self.gpu)
            page.release()

    def _native_abandon(self) -> None:
        """The loop is cancelled (the daemon stops): stop the switcher (a few ms
        at most), then the gates it closed are the loop's, which thaws them."""
        sw = self._switcher
        sw.cancel()
        deadline = time.monotonic() + self.planner.params.max_slice * 4 + 0.5
        while not sw.idle() and time.monotonic() < deadline:
            time.sleep(0.0002)
        sw.ack()
        sw.take()
        self._native_handback()

    @property
    def _native_frozen(self) -> frozenset[str]:
        state = self._native_state
        if state is None:
            return frozenset()
        return frozenset(n for n, page in zip(state["names"], state["pages"]) if page.closed_on(self.gpu))
