"""Which gated instances bound their queued GPU work (docs/scheduler.md,
"Queued work"): the part of GpuScheduler (cgpud.sched.loop) that tells each
instance's gate, through the enforcer's `share(gpu, name, on, budget_us)`,
whether the planner may hold it stopped while it is active
(cgpud.sched.policies.may_hold). While it may, libcgpu keeps its processes'
queued work within the budget, so a closing's drain lasts about the budget;
with the GPU to itself, an instance runs unbounded (full speed).
"""
from __future__ import annotations

import logging
from typing import Any

import trio

from cgpud.sched.policies import GpuView, may_hold

log = logging.getLogger("cgpud.sched")


class QueueBounds:
    """Mixed into GpuScheduler: `_share(view)`, called at every boundary and poke."""

    # (GpuScheduler's)
    gpu: int
    params: Any
    _enforcer: Any
    _sharing: dict[str, tuple[int, bool]] | None = None  # what each target was told last
    _unbinding: dict[str, float] | None = None  # since when each bounded one may run unbounded
    _shared_view: GpuView | None = None

    def _share(self, view: GpuView | None) -> None:
        """Tell each gated instance whether the planner may hold it stopped
        while it is active (`may_hold`: another eligible instance is active,
        or its policy leaves time to others or to nobody): while it may, its
        processes keep at most `queue_budget` of work queued ahead (libcgpu).
        An instance is bounded at once, and unbounded (the GPU its own: full
        speed) only once it has been so for `unbound_after` — a launch returns
        at once, so an instance unbounded for a moment before its neighbour
        arrived would have queued a second of work by then. Only changes are
        sent (per target: one attached later is told too). None: the loop
        stops, nobody is bounded any more."""
        share = getattr(self._enforcer, "share", None)
        target = getattr(self._enforcer, "target", None)
        if share is None or target is None:
            return
        if self._sharing is None:
            self._sharing, self._unbinding = {}, {}
        now = trio.current_time()
        if view is not None and view is self._shared_view and not self._unbinding:
            return
        self._shared_view = view
        names = view.names if view is not None else frozenset()
        budget = max(1, round(self.params.queue_budget * 1e6))
        for name in sorted(names | self._sharing.keys()):
            t = target(name)
            if t is None:
                continue
            told = self._sharing.get(name)
            known = told is not None and told[0] == id(t)
            if view is None:
                on = False
            elif name in names and may_hold(view, name):
                on = True
                self._unbinding.pop(name, None)
            else:  # (first seen: bounded, as its page starts; then unbounded once alone for a while)
                since = self._unbinding.setdefault(name, now)
                on = not known or (told[1] and now - since < self.params.unbound_after)
                if not on:
                    del self._unbinding[name]
            if known and told[1] == on:
                continue
            try:
                share(self.gpu, name, on, budget)
            except Exception:
                log.exception("GPU %d: cannot tell %s whether it shares the GPU", self.gpu, name)
                continue
            self._sharing[name] = (id(t), on)
        for name in [n for n in self._sharing if n not in names]:
            del self._sharing[name]
            self._unbinding.pop(name, None)
