"""The planner's accounting state (cgpud.sched.policies): a ring's position and credits (Ring), and
the exact sliding-window sum of what each instance used (Window). docs/scheduler.md says how the
credits are kept; the Planner is the only one that moves them."""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from cgpud.sched.views import WASTE, Params

class Window:
    """Exact sum of amounts over the last `length` seconds.

    An amount is given over an interval [start, end) and spread evenly over
    it; a sum counts the part of each interval inside the window. Intervals
    that follow one another at (nearly) the same rate are merged, so an
    instance that runs for a long time costs one entry. Adding and summing
    are O(1) amortized; memory is one entry per separate run in the window,
    whether it is summed or not (sums are asked for a time at or after the
    latest amount's end)."""

    def __init__(self, length: float, merge_gap: float | None = None) -> None:
        self.length = float(length)
        self.merge_gap = self.length * 1e-4 if merge_gap is None else merge_gap
        self._segs: deque[list[float]] = deque()  # [start, end, amount]
        self._total = 0.0
        self._adds = 0

    def add(self, start: float, end: float, amount: float) -> None:
        if amount <= 0:
            return
        if end <= start:  # an instantaneous amount: give it a tiny extent where it happened
            start = end - 1e-9
        segs = self._segs
        if segs:
            last = segs[-1]
            if 0 <= start - last[1] <= self.merge_gap:
                r_new = amount / (end - start)
                r_old = last[2] / (last[1] - last[0])
                if abs(r_new - r_old) <= 1e-3 * max(r_new, r_old):
                    last[1] = end
                    last[2] += amount
                    self._total += amount
                    return
        segs.append([start, end, amount])
        self._total += amount
        lo = end - self.length  # (what ended before the window of its latest end: never summed again)
        while segs[0][1] <= lo:
            self._total -= segs.popleft()[2]
        self._adds += 1
        if self._adds >= 4096:  # drop accumulated rounding now and then
            self._adds = 0
            self._total = math.fsum(x[2] for x in segs)

    def sum(self, now: float) -> float:
        lo = now - self.length
        segs = self._segs
        while segs and segs[0][1] <= lo:
            self._total -= segs.popleft()[2]
        if not segs:
            self._total = 0.0
            return 0.0
        s, e, a = segs[0]
        part = a * (lo - s) / (e - s) if s < lo else 0.0
        return max(0.0, self._total - part)


@dataclass
class Ring:
    """Position and credits of one ring (normal or high-priority group)."""

    cur: str | None = None  # key of the holder of the current slot
    cur_seq: float = -math.inf  # its order key (kept when it leaves the ring)
    used: int = 0  # slots of the current holder's run begun so far
    open: bool = False  # the current slot still has time owed (it was cut short)
    credit: dict[str, float] = field(default_factory=dict)
    # (the holders table the credits were last cleaned for, and the holders' order keys: a slot's
    # choice is then a lookup and a bisection, not a walk over every holder)
    _seen: object = field(default=None, repr=False, compare=False)
    _orders: tuple = field(default=(None, []), repr=False, compare=False)

    def reset(self) -> None:
        self.cur, self.cur_seq, self.used, self.open = None, -math.inf, 0, False
        self.credit.clear()

    def next(self, holders: list[tuple[str, float, int]], p: Params, table: dict | None = None) -> tuple[str, float]:
        """The holder of the next slot (or the rest of an open one) and its length.
        `holders`: (key, order, slots) sorted by order, non-empty, slots >= 1 (`table`: {key: slots})."""
        table = {k: n for k, _, n in holders} if table is None else table
        if table is not self._seen or len(self.credit) > len(table):
            for k in self.credit.keys() - table.keys():
                del self.credit[k]
            self._seen = table
        if self.cur in table and self.open:
            c = self.credit.get(self.cur, 0.0)
            if c >= p.min_slice:
                return self.cur, min(c, p.max_slice)
        if self.cur in table and self.used < table[self.cur]:
            self.used += 1
        else:
            if self._orders[0] is not holders:
                self._orders = (holders, [h[1] for h in holders])
            i = bisect.bisect_right(self._orders[1], self.cur_seq)  # (the first holder after the current)
            nxt = holders[i] if i < len(holders) else holders[0]
            self.cur, self.cur_seq, self.used = nxt[0], nxt[1], 1
        n = table[self.cur] - self.used + 1 if p.merge_runs else 1  # slots of the run given now
        self.used += n - 1
        c = self.credit.get(self.cur, 0.0) + n * p.slice
        self.credit[self.cur] = c
        self.open = True
        return self.cur, min(max(c, p.min_slice), p.max_slice + (n - 1) * p.slice)

    def bounds(self, key: str, p: Params) -> tuple[float, float]:
        """The credit's bounds: ±2X, and with merged runs what a holder may be owed goes up by the rest
        of its run of n slots (a run charged its GPU time owes the holder what its processes did not use
        of it: a bound of 2X would drop that for a long run alone, and the larger weight would get less
        than its share); WASTE's credit may go as far down (policy 3 charges it the gate time others
        are owed: Planner._absorb)."""
        table = self._seen
        if not (p.merge_runs and isinstance(table, dict)):
            return -p.credit_bound, p.credit_bound
        hi = p.credit_bound + (table.get(key, 1) - 1) * p.slice
        return (-hi if key == WASTE else -p.credit_bound), hi

    def bounded(self, key: str, c: float, p: Params) -> float:
        lo, hi = self.bounds(key, p)
        return max(lo, min(hi, c))

    def charge(self, key: str, ran: float, p: Params) -> None:
        self.credit[key] = self.bounded(key, self.credit.get(key, 0.0) - ran, p)
        if key == self.cur and self.credit[key] < p.min_slice:
            self.open = False
