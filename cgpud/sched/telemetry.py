"""What the scheduler measures about itself (issue 3, item 9), as plain data.

`Telemetry` is owned and updated by one GPU's loop in the trio thread.
`Telemetry.snapshot(now)` makes an immutable `GpuStats` that may be handed
to another thread (the metrics HTTP server reads it, never the live object).

- granted_seconds: per instance, total time it was allowed to use the GPU
  while it was active. Under policies 4 and 5 instances run together, so
  their granted times add up to more than the wall time.
- share_1s / share_10s: granted time in the last 1 s / 10 s divided by that
  span, exactly, where the span starts at a 100 ms mark (so it is 1 to 1.1 s,
  10 to 10.1 s; shorter just after the start) and ends with the last slice
  accounted.
- switches: slice boundaries at which the set of instances allowed to run
  changed. freezes / thaws: enforcement calls actually made. drains /
  drain_seconds: slice ends that waited for gated work to finish, and how long.
- lateness: actual wake-up minus the planned boundary, per timed boundary
  (recent samples kept, plus count, sum and max over the whole run).
- recent: the last slices (gpu, names allowed, start, end, kind, and who
  was active and who waited), for the timeline picture of `cgpu trace`: a
  ring bounded both by time (the last `history_seconds`, 60 s) and by count
  (`history` records, 8192: 81 s of 10 ms slices), whichever is shorter.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from cgpud.sched.policies import Decision

SHARE_WINDOWS = (1.0, 10.0)
_MARK_TIME = operator.itemgetter(0)
HISTORY_SECONDS = 60.0  # the ring of recent slices keeps this long (cgpu trace)


@dataclass(frozen=True)
class SliceRecord:
    gpu: int
    names: frozenset[str]  # allowed to run (a ring slot: its holder, busy or not)
    start: float
    end: float
    kind: str
    active: frozenset[str] = frozenset()  # of `names`, the ones that had work: really given the GPU
    waiting: frozenset[str] = frozenset()  # had work but were not allowed: held frozen


@dataclass(frozen=True)
class InstanceStats:
    name: str
    granted_seconds: float
    share_1s: float
    share_10s: float


@dataclass(frozen=True)
class GpuStats:
    gpu: int
    time: float  # trio clock at the snapshot
    started: float  # trio clock when the loop started
    slices: int
    switches: int
    freezes: int
    thaws: int
    enforce_errors: int
    lateness: tuple[float, ...]  # recent samples (s), oldest first
    lateness_count: int
    lateness_sum: float
    lateness_max: float
    instances: Mapping[str, InstanceStats]
    recent: tuple[SliceRecord, ...]
    drains: int = 0  # slice ends that waited for gated instances to finish their queued work
    drain_seconds: float = 0.0  # how long in all
    switched: int = 0  # slices carried out by the GPU's switcher thread (cgpud.sched.batching)

    def lateness_quantile(self, q: float) -> float:
        """Quantile of the recent lateness samples (0 when there are none)."""
        if not self.lateness:
            return 0.0
        xs = sorted(self.lateness)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class Telemetry:
    """Counters of one GPU's loop. Shares are exact over a span that starts at
    a mark (taken every `tick` s) and ends at the end of the last accounted
    slice: share_1s covers the latest mark at least 1 s back (1 s to
    1 s + tick), or everything since the start when that is shorter."""

    def __init__(self, gpu: int, *, lateness_samples: int = 4096, history: int = 8192,
                 history_seconds: float = HISTORY_SECONDS, tick: float = 0.1) -> None:
        self.gpu = gpu
        self.started: float | None = None
        self.slices = 0
        self.switches = 0
        self.freezes = 0
        self.thaws = 0
        self.enforce_errors = 0
        self.drains = 0
        self.drain_seconds = 0.0
        self.switched = 0
        self.lateness: deque[float] = deque(maxlen=lateness_samples)
        self.lateness_count = 0
        self.lateness_sum = 0.0
        self.lateness_max = 0.0
        self.recent: deque[SliceRecord] = deque(maxlen=history)
        self.history_seconds = history_seconds
        self.tick = tick
        self._granted: dict[str, float] = {}
        self._marks: deque[tuple[float, dict[str, float]]] = deque(
            maxlen=int(math.ceil(max(SHARE_WINDOWS) / tick)) + 2
        )
        self._next_mark = 0.0
        self._last_end = 0.0

    def start(self, now: float) -> None:
        if self.started is None:
            self.started = self._last_end = now
            self._marks.append((now, {}))
            self._next_mark = now + self.tick

    def retain(self, names: Iterable[str]) -> None:
        """Forget instances that are gone (a new one of the same name starts from 0)."""
        gone = self._granted.keys() - (names if isinstance(names, (set, frozenset)) else set(names))
        for n in gone:
            del self._granted[n]
            for _, m in self._marks:
                m.pop(n, None)

    def late(self, seconds: float) -> None:
        self.lateness.append(seconds)
        self.lateness_count += 1
        self.lateness_sum += seconds
        self.lateness_max = max(self.lateness_max, seconds)

    def _give(self, names: Iterable[str], seconds: float) -> None:
        g = self._granted
        for n in names:
            g[n] = g.get(n, 0.0) + seconds

    def record(self, decision: Decision, start: float, end: float, *, tail: bool = False) -> None:
        """The decision was in force from `start` to `end` (actual times).
        tail: more time for the decision recorded last (it ran on while the
        next one was being put in place)."""
        if self.started is None:
            self.start(start)
        if not tail:
            self.slices += 1
        act = decision.active
        t = start
        horizon = self._marks.maxlen * self.tick  # type: ignore[operator]
        if end - self._next_mark > horizon:  # a long stall: skip marks nobody will read
            skip = self._next_mark + math.floor((end - self._next_mark - horizon) / self.tick) * self.tick
            if skip > t:
                self._give(act, skip - t)
                t = skip
            self._next_mark = skip
        while self._next_mark <= end:
            mark = self._next_mark
            if mark > t:
                self._give(act, mark - t)
                t = mark
            self._marks.append((mark, dict(self._granted)))
            self._next_mark = mark + self.tick
        if end > t:
            self._give(act, end - t)
        self._last_end = max(self._last_end, end)
        last = self.recent[-1] if self.recent else None
        if tail and last is not None and last.end == start and last.names == decision.running:
            self.recent[-1] = SliceRecord(self.gpu, last.names, last.start, end, last.kind, last.active, last.waiting)
        else:
            recent = self.recent
            recent.append(SliceRecord(self.gpu, decision.running, start, end, decision.kind.value,
                                      decision.active, decision.considered - decision.running))
            horizon = end - self.history_seconds
            while recent[0].end < horizon:
                recent.popleft()

    def granted(self, name: str) -> float:
        return self._granted.get(name, 0.0)

    def share(self, name: str, window: float = 1.0) -> float:
        """Granted time over the last `window` s (see the class) / that span."""
        if name not in self._granted or not self._marks:
            return 0.0
        end = self._last_end
        # the last mark at or before the window's start (the first if none): marks are in time order
        i = bisect.bisect_right(self._marks, end - window + 1e-9, key=_MARK_TIME)
        best = self._marks[i - 1] if i else self._marks[0]
        span = end - best[0]
        return (self._granted[name] - best[1].get(name, 0.0)) / span if span > 0 else 0.0

    def snapshot(self, now: float) -> GpuStats:
        insts = {
            n: InstanceStats(n, g, self.share(n, SHARE_WINDOWS[0]), self.share(n, SHARE_WINDOWS[1]))
            for n, g in self._granted.items()
        }
        return GpuStats(
            gpu=self.gpu,
            time=now,
            started=self.started if self.started is not None else now,
            slices=self.slices,
            switches=self.switches,
            freezes=self.freezes,
            thaws=self.thaws,
            enforce_errors=self.enforce_errors,
            lateness=tuple(self.lateness),
            lateness_count=self.lateness_count,
            lateness_sum=self.lateness_sum,
            lateness_max=self.lateness_max,
            instances=MappingProxyType(insts),
            recent=tuple(self.recent),
            drains=self.drains,
            drain_seconds=self.drain_seconds,
            switched=self.switched,
        )


def collect(gpu, records: Sequence[SliceRecord], decision, now: float, seconds: float,
            slice_len: float | None = None) -> dict:
    """One GPU's slices that end after `now - seconds`, oldest first, the one in
    force last (it runs from the end of the last record until `now`), and
    what the GPU is now. Cheap: no record is looked into but the window's edge.
    `gpu` is the model's Gpu."""
    since = now - seconds
    inside = 0
    for r in reversed(records):  # (a deque: indexing its middle is not O(1))
        if r.end <= since:
            break
        inside += 1
    recs = list(itertools.islice(records, len(records) - inside, None))
    if decision is not None:
        start = recs[-1].end if recs else max(since, decision.start)
        if now > start:
            recs.append(SliceRecord(gpu.index, decision.running, start, now, decision.kind.value,
                                    decision.active, decision.considered - decision.running))
    return {
        "head": {
            "gpu": gpu.index,
            "policy": gpu.policy,
            "max_inst": gpu.max_inst,
            "slice": slice_len,
            "now": now,
            "since": since,
            "instances": [{"name": i.name, "weight": i.weight, "highprio": i.highprio}
                          for i in gpu.instances.values()],
        },
        "records": recs,
    }
