"""The compute policies of SPEC §5 as pure code: who may use a GPU now, and until when.

The planner is here; what it is given and gives back is cgpud.sched.views,
its accounting state (a ring's credits, the usage windows) cgpud.sched.ring.

Nothing here reads a clock, sleeps or touches a process. The loop
(`cgpud.sched.loop`) hands a `GpuView` and the current time to
`Planner.plan`, enforces the `Decision` it gets back, and reports what really
happened with `Planner.charge(decision, start, end)`: the time the slice
actually began (after enforcement) and actually ended (when the loop woke up).
All accounting is done from those reported times, so late timers and switch
losses are paid back instead of biasing the shares.

The algorithms are documented in docs/scheduler.md. In short:

- Policies 0, 1, 2, 3 are *rings* of base slices of length X. A ring is a list
  of holders in a stable order (the order in which instances were first seen),
  each holding n consecutive slots; a WASTE holder at the end takes the slots
  nobody holds (GPU left idle on purpose).
      0 fair:        every instance 1 slot, WASTE = max_inst - holders
      1 preemptive:  every ACTIVE instance 1 slot, no WASTE
      2 weighted:    every instance w slots, no WASTE (cycle = sum(w) * X)
      3 fixed:       every instance w slots, WASTE = max_inst - sum(w)
  Each holder keeps a credit (seconds owed): a slot adds X, running takes off
  the time actually run. A slot lasts `credit` seconds, clamped to
  [X/4, 2X]; credits are bounded to +-2X so a stall is not repaid as a burst.
- Policy 4 (weak): active instances run together; one whose usage over the
  last `window` seconds exceeds window/active is paused until it is under again.
  Usage of instances running together is split evenly unless a usage meter
  reports real figures.
- Policy 5 (native): everyone runs, nothing is controlled.
- High priority: active high-priority instances (weight > 0) run first, as a
  group scheduled by the GPU's policy (only its active members, no WASTE),
  for at most prio_ratio % of any `window`. They hold no slots in the normal
  ring. Under policies 1 and 4, and when the normal ring has no holder at all,
  a capped group may still use time nobody else wants ("fill"); that time is
  not counted against prio_ratio.
- Weight 0: never runs (except under policy 5, where nothing is controlled).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, Mapping

from cgpud.sched.ring import Ring, Window
from cgpud.sched.views import (  # noqa: F401  (the policies' names, as the callers import them from here)
    EXCLUSIVE_POLICIES, FAIR, FIXED, NATIVE, NORMAL, POLICY_NAMES, PREEMPTIVE, PRIO, WASTE, WEAK, WEIGHTED,
    Ahead, Decision, GpuView, InstView, Kind, Params,
)


class Planner:
    """The accounting state of one GPU and the policy decisions made from it."""

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        self._rings = {NORMAL: Ring(), PRIO: Ring()}
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._policy: int | None = None
        self._usage: dict[str, Window] = {}  # per instance, for policy 4
        self._prio = Window(self.params.window)
        self._synced, self._derived = None, {}  # the view _sync saw last; what plan() derived from it
        self._ahead_seq = 0  # the count of decisions planned ahead (less those rewound)
        self._drift: dict[str, float] = {}  # per ring key: how long its queued work drains after its slot (a mean)
        self._duty: dict[str, float] = {}  # per ring key: the GPU time it is charged per second of its steps (a mean)
        self._ahead_last: Ahead | None = None  # the last decision planned ahead
        self._prio_light = False  # the group used little of its last slice's GPU (its GPU time known)

    # ---- bookkeeping -------------------------------------------------------

    def _sync(self, view: GpuView) -> None:
        if view is self._synced:  # (the loop hands the same view again while nothing changed)
            return
        self._synced, self._derived = view, {}
        if view.policy != self._policy:
            if self._policy is not None:
                for r in self._rings.values():
                    r.reset()
            self._policy = view.policy
        names = view.names
        for gone in [n for n in self._seq if n not in names]:
            del self._seq[gone]
            self._usage.pop(gone, None)
            self._drift.pop(gone, None)
            self._duty.pop(gone, None)
        for i in view.instances:
            if i.name not in self._seq:
                self._seq[i.name] = self._next_seq
                self._next_seq += 1
                self._usage[i.name] = Window(self.params.window)

    def _holders(self, insts: Iterable[InstView], slots, waste: int) -> list[tuple[str, float, int]]:
        hs = [(i.name, float(self._seq[i.name]), slots(i)) for i in insts]
        hs.sort(key=lambda h: h[1])
        if waste > 0:
            hs.append((WASTE, math.inf, waste))
        return hs

    # ---- queries -----------------------------------------------------------

    def prio_used(self, now: float) -> float:
        """Seconds the high-priority group ran (counted, not fill) in the window."""
        return self._prio.sum(now)

    def prio_headroom(self, view: GpuView, now: float) -> float:
        return view.prio_ratio / 100.0 * self.params.window - self._prio.sum(now)

    def usage_share(self, name: str, now: float) -> float:
        """An instance's usage over the window as a fraction of the window."""
        w = self._usage.get(name)
        return 0.0 if w is None else w.sum(now) / self.params.window

    def credit(self, name: str, group: str = NORMAL) -> float:
        return self._rings[group].credit.get(name, 0.0)

    # ---- decisions ---------------------------------------------------------

    def plan(self, view: GpuView, now: float) -> Decision:
        """Who may use the GPU from `now`, and until when."""
        self._sync(view)
        p = self.params
        if "plan" not in self._derived:
            eligible = [i for i in view.instances if i.weight > 0]
            self._derived["plan"] = (frozenset(i.name for i in eligible if i.active),
                                     [i for i in eligible if i.highprio and i.active],
                                     [i for i in eligible if not i.highprio])
        considered, hp, normal = self._derived["plan"]
        if view.policy == NATIVE:
            names = view.names
            return Decision(names, now + p.slice, now, Kind.NATIVE, active=view.active_names, considered=considered)
        if hp:
            room = self.prio_headroom(view, now)
            if room >= p.min_slice and self._prio_light:  # (light: the normal ring runs, the group beside it)
                d = self._plan_group(NORMAL, normal, view, now, considered)
                if d is not None:
                    names = frozenset(i.name for i in hp)
                    return replace(d, running=d.running | names, until=min(d.until, now + room), along=names)
            if room >= p.min_slice:
                d = self._plan_group(PRIO, hp, view, now, considered)
                assert d is not None
                return replace(d, kind=Kind.PRIO, until=min(d.until, now + room))
        d = self._plan_group(NORMAL, normal, view, now, considered)
        if d is None:
            if hp:  # nobody else holds or wants the time (policies 1 and 4, or no normal holder)
                f = self._plan_group(PRIO, hp, view, now, considered)
                assert f is not None
                return replace(f, kind=Kind.FILL)
            return Decision(frozenset(), now + p.slice, now, Kind.IDLE, considered=considered)
        return d

    def _plan_group(
        self, group: str, insts: list[InstView], view: GpuView, now: float, considered: frozenset[str]
    ) -> Decision | None:
        """The group's next decision; None when it has nobody to give time to."""
        p = self.params
        pol = view.policy
        if pol == WEAK:
            return self._plan_weak(group, [i for i in insts if i.active], now, considered)
        cached = self._derived.get(group)
        if cached is None or cached[0] is not insts:  # (else the same view's: _sync kept the order keys)
            if group == PRIO:  # only active members, no waste; 0 and 1 round robin, 2 and 3 by weight
                slots = (lambda i: 1) if pol in (FAIR, PREEMPTIVE) else (lambda i: i.weight)
                holders = self._holders(insts, slots, 0)
            elif pol == FAIR:
                holders = self._holders(insts, lambda i: 1, view.max_inst - len(insts))
            elif pol == PREEMPTIVE:
                holders = self._holders([i for i in insts if i.active], lambda i: 1, 0)
            elif pol == WEIGHTED:
                holders = self._holders(insts, lambda i: i.weight, 0)
            elif pol == FIXED:
                holders = self._holders(insts, lambda i: i.weight, view.max_inst - sum(i.weight for i in insts))
            else:
                raise ValueError(f"no policy {pol}")
            cached = self._derived[group] = (insts, holders, {k: n for k, _, n in holders})
        holders = cached[1]
        if not holders:
            return None
        key, length = self._rings[group].next(holders, p, cached[2])
        if key == WASTE:
            return Decision(frozenset(), now + length, now, Kind.WASTE, group, WASTE, considered=considered)
        act = frozenset({key}) if key in considered else frozenset()
        return Decision(frozenset({key}), now + length, now, Kind.SLOT, group, key, act, considered)

    def _plan_weak(
        self, group: str, cands: list[InstView], now: float, considered: frozenset[str]
    ) -> Decision | None:
        if not cands:
            return None
        limit = 1.0 / len(cands)
        shares = {i.name: self.usage_share(i.name, now) for i in cands}
        run = frozenset(n for n, s in shares.items() if s <= limit + 1e-9)
        if not run:  # cannot happen while the usage sums to <= 1, but never idle a wanted GPU
            low = min(shares.values())
            run = frozenset(n for n, s in shares.items() if s <= low + 1e-9)
        paused = frozenset(shares) - run
        return Decision(run, now + self.params.slice, now, Kind.WEAK, group, None, run, considered, paused)

    def preempt(self, view: GpuView, decision: Decision, now: float) -> bool:
        """Mid-slice (activity changed): should the loop end this slice now?

        Yes when a high-priority instance became active (it takes the GPU at
        once), when the GPU is idle or filled and someone now wants it, under
        policy 4 when a newcomer joins, and when everyone given the GPU went
        idle where idle time goes to others (policies 1, 4, high priority).
        Ending a slice early is always safe: the ring keeps what is owed."""
        if decision.kind == Kind.NATIVE or view.policy == NATIVE:
            return False
        eligible = {i.name: i for i in view.instances if i.weight > 0}
        active = frozenset(n for n, i in eligible.items() if i.active)
        newcomers = active - decision.considered
        if newcomers:
            if any(eligible[n].highprio for n in newcomers) and decision.kind != Kind.PRIO:
                return True
            if decision.kind in (Kind.IDLE, Kind.FILL) or view.policy == WEAK:
                return True
        if decision.active and not (decision.active & active):
            if view.policy in (PREEMPTIVE, WEAK) or decision.kind in (Kind.PRIO, Kind.FILL):
                return True
        return False

    # ---- planning ahead (a batch carried out by a switcher thread) ------------

    def plan_ahead(self, view: GpuView, now: float, horizon: float, max_steps: int = 64) -> list[Ahead]:
        """The decisions from `now` on for about `horizon` seconds, as if each
        ran its planned length: the ring is charged that length as it plans
        (so that the next one follows), and, where the holder changes, the
        previous holder the tail its queued work has been draining for after
        its slot (a mean of what its steps ran past their length: charged
        as the loop charges the time a switch waited for it). Only ring
        decisions of the normal group (SLOT, WASTE) are planned ahead;
        planning stops before anything else (high priority, idle, policies 4
        and 5), which the caller plans one at a time. `settle` charges what
        really ran, `rewind` takes back what did not start; `ahead_reset`
        when decisions not planned ahead were in force in between."""
        out: list[Ahead] = []
        t = now
        p = self.params
        while len(out) < max_steps and t - now < horizon:
            ring = self._rings[NORMAL]
            pos = (ring.cur, ring.cur_seq, ring.used, ring.open)
            before = dict(ring.credit)
            d = self.plan(view, t)
            if d.kind not in (Kind.SLOT, Kind.WASTE) or d.group != NORMAL or d.along:
                ring.cur, ring.cur_seq, ring.used, ring.open = pos
                ring.credit = before
                break
            expect = d.length * self._duty.get(d.holder, 1.0)  # (what it will be charged for it, as it went)
            ring.charge(d.holder, expect, p)
            delta = ring.credit.get(d.holder, 0.0) - before.get(d.holder, 0.0)
            absorbed = self._absorb(d, d.length - expect)
            prev = self._ahead_last
            if prev is not None and prev.decision.holder != d.holder and not prev.followed:
                prev.followed = True
                prev.tail = self._drift.get(prev.decision.holder, 0.0)
                if prev.tail:
                    ring.charge(prev.decision.holder, prev.tail, p)
                    prev.charged += prev.tail
            self._ahead_seq += 1
            a = Ahead(d, pos, delta, self._ahead_seq, expect, prev, absorbed=absorbed)
            out.append(a)
            self._ahead_last = a
            t = d.until
        return out

    def ahead_reset(self) -> None:
        """The decision in force was not planned ahead: a next one planned ahead charges no tail."""
        self._ahead_last = None

    def settle(self, ahead: Ahead, start: float, end: float, cut: bool = False, used: float | None = None) -> None:
        """A decision planned ahead was in force from `start` to `end` (actual
        times; to when its queued work was done, the next switch's closing answered):
        charge the difference from what was charged for it, and the windows.
        `cut`: ended early (the batch was cut), not a measure of its tail.
        `used`: the GPU seconds its holder's processes got meanwhile, when
        they count them (libcgpu): an active holder is charged that, not the
        time its gate was open — at most the time, and at least half of it
        (`gpu_cost`)."""
        d, p = ahead.decision, self.params
        ring = self._rings[NORMAL]
        ran = end - start
        cost = gpu_cost(used, ran) if used is not None and d.active else ran
        ring.charge(d.holder, cost - ahead.charged, p)
        ahead.absorbed += self._absorb(d, ran - cost - ahead.absorbed)
        if ran > 0 and not cut:  # (the next ones are planned as charged so: a batch plans its slots' lengths right)
            duty = self._duty.get(d.holder, 1.0)
            self._duty[d.holder] = max(0.5, min(1.0, duty + (cost / ran - duty) / 4))
        if ahead.seq == self._ahead_seq:  # the ring's latest: its slot stays open while time is owed on it
            ring.open = ring.credit.get(d.holder, 0.0) >= p.min_slice
        if ahead.followed and not cut:  # (what ran past its length is the tail its queued work drained for)
            drift = self._drift.get(d.holder, 0.0)
            self._drift[d.holder] = max(0.0, min(p.slice, drift + (ran - d.length - drift) / 4))
        self._windows(d, start, end)

    def rewind(self, aheads: list[Ahead]) -> None:
        """Take back decisions planned ahead that never started (the last ones
        planned, in order): the ring is where it was before the first, and
        what their planning charged is taken back, the last planned first: the
        holders' time, the tails charged the steps before them (the first's
        included), and what policy 3 charged the wasted slots."""
        if not aheads:
            return
        ring, p = self._rings[NORMAL], self.params
        first = aheads[0]
        ring.cur, ring.cur_seq, ring.used, ring.open = first.position
        self._ahead_seq = first.seq - 1
        self._ahead_last = first.before
        for a in reversed(aheads):  # (the last planned first: each step back to the credits it was planned on)
            prev = a.before
            if prev is not None and prev.followed:  # (a's planning charged the step before it its tail)
                h = prev.decision.holder
                if prev.tail:
                    ring.credit[h] = ring.bounded(h, ring.credit.get(h, 0.0) + prev.tail, p)
                prev.charged -= prev.tail
                prev.tail, prev.followed = 0.0, False
            if a.absorbed and WASTE in ring.credit:
                ring.credit[WASTE] = ring.bounded(WASTE, ring.credit[WASTE] + a.absorbed, p)
            if a.decision.holder in ring.credit:
                ring.credit[a.decision.holder] = ring.bounded(a.decision.holder,
                                                              ring.credit[a.decision.holder] - a.delta, p)

    def charge(
        self, decision: Decision, start: float, end: float, usage: Mapping[str, float] | None = None,
        prio_used: float | None = None,
    ) -> None:
        """Report that `decision` was in force from `start` to `end` (actual
        times). `usage`: GPU seconds each running instance really used in
        that time, when a meter knows; otherwise time is split evenly among
        the active instances that ran together. `prio_used`: the GPU seconds
        the instances it charges got, when their processes count them
        (libcgpu): a slot's active holder is charged that (`gpu_cost`); while
        a high-priority group uses under a quarter of its own slices (charged
        their time) the normal ring runs with the group beside it (`along`:
        its holder is charged the time, the group its GPU time, at most the
        time, against prio_ratio)."""
        ran = max(0.0, end - start)
        p = self.params
        if decision.holder is not None and decision.group is not None:
            by_gpu = prio_used is not None and decision.kind == Kind.SLOT and not decision.along
            cost = gpu_cost(prio_used, ran) if by_gpu else ran
            self._rings[decision.group].charge(decision.holder, cost, p)
            if by_gpu:
                self._absorb(decision, ran - cost)
        if (decision.kind == Kind.PRIO or decision.along) and prio_used is not None and ran >= p.min_slice / 2:
            self._prio_light = prio_used < ran / 4
        self._windows(decision, start, end, usage, prio_used)

    def _absorb(self, decision: Decision, amount: float) -> float:
        """Policy 3 (fixed: w/max_inst of the GPU, even alone): the time an active holder's gate stood
        open past what it is charged (its GPU time, `gpu_cost`) is owed back to it as gate time, which
        would stretch the cycle past max_inst slices and give everyone less than w/max_inst of the
        GPU; it comes out of the wasted slots instead (charged to WASTE, so the cycle keeps its length
        while the waste has room). Returns what WASTE's credit changed by."""
        if (self._policy != FIXED or decision.group != NORMAL or decision.kind != Kind.SLOT or not decision.active
                or not amount):
            return 0.0
        ring = self._rings[NORMAL]
        if not isinstance(ring._seen, dict) or WASTE not in ring._seen:
            return 0.0
        before = ring.credit.get(WASTE, 0.0)
        ring.charge(WASTE, amount, self.params)
        return before - ring.credit[WASTE]

    def _windows(self, decision: Decision, start: float, end: float,
                 usage: Mapping[str, float] | None = None, prio_used: float | None = None) -> None:
        """The time windows' part of a charge (high priority's, policy 4's)."""
        ran = max(0.0, end - start)
        if decision.kind == Kind.PRIO:
            self._prio.add(start, end, ran)
        elif decision.along:
            self._prio.add(start, end, ran if prio_used is None else min(max(0.0, prio_used), ran))
        act = decision.active
        if act:
            for name in act:
                w = self._usage.get(name)
                if w is None:
                    continue
                amount = usage.get(name, 0.0) if usage is not None else ran / len(act)
                w.add(start, end, amount)


def gpu_cost(used: float, ran: float) -> float:
    """What a ring holder is charged for a slice of `ran` seconds in which its processes got `used`
    seconds of GPU time: that, but at least half the slice (an instance active and nearly idle —
    its device open, nothing launched — would otherwise hold its gate on and on, the ring's credit
    never spent: it gets at most 2X of gate time per X it is owed) and at most all of it."""
    return min(ran, max(used, ran / 2))


def entitled_share(view: GpuView, name: str) -> float:
    """The long-run share `name` may get under the view's policy when the view
    does not change and nobody is high priority: what the SPEC §5 table says.
    (For policy 1 and 4 with the named instance active; 1.0 under policy 5.)"""
    inst = next(i for i in view.instances if i.name == name)
    if view.policy == NATIVE:
        return 1.0
    if inst.weight == 0:
        return 0.0
    eligible = [i for i in view.instances if i.weight > 0]
    if view.policy == FAIR:
        return 1.0 / view.max_inst
    if view.policy in (PREEMPTIVE, WEAK):
        if not inst.active:
            return 0.0
        return 1.0 / sum(1 for i in eligible if i.active)
    if view.policy == WEIGHTED:
        return inst.weight / sum(i.weight for i in eligible)
    if view.policy == FIXED:
        return inst.weight / view.max_inst
    raise ValueError(f"no policy {view.policy}")
