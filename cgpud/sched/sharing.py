"""Which gated instances bound their queued GPU work (docs/scheduler.md,
"Queued work"): the part of GpuScheduler (cgpud.sched.loop) that tells each
instance's gate, through the enforcer's `share(gpu, name, on, budget_us)`,
whether its processes keep their queued work within the budget: under every
controlled policy (0-4), alone or not — what an instance queued while alone
cannot be recalled when a neighbour or a high-priority instance arrives, and
bounded it still runs at full speed (the H100: 101 % of the job without
cgpud) — and not under policy 5 (no control). A closing's drain then lasts
about the budget.
"""
from __future__ import annotations

import logging
from typing import Any

from cgpud.sched.policies import NATIVE, GpuView

log = logging.getLogger("cgpud.sched")


class QueueBounds:
    """Mixed into GpuScheduler: `_share(view)`, called at every boundary and poke."""

    # (GpuScheduler's)
    gpu: int
    params: Any
    _enforcer: Any
    _sharing: dict[str, tuple[int, bool]] | None = None  # what each target was told last
    _shared_view: GpuView | None = None

    def _share(self, view: GpuView | None) -> None:
        """Tell each gated instance whether its queued work is bounded: under
        a controlled policy, yes (see the module's text). Only changes are
        sent (per target: one attached later is told too). None: the loop
        stops, nobody is bounded any more."""
        share = getattr(self._enforcer, "share", None)
        target = getattr(self._enforcer, "target", None)
        if share is None or target is None or (view is not None and view is self._shared_view):
            return
        if self._sharing is None:
            self._sharing = {}
        self._shared_view = view
        names = view.names if view is not None else frozenset()
        on = view is not None and view.policy != NATIVE
        budget = max(1, round(self.params.queue_budget * 1e6))
        for name in sorted(names | self._sharing.keys()):
            t = target(name)
            if t is None or self._sharing.get(name) == (id(t), on and name in names):
                continue
            try:
                if callable(bound := getattr(t, "bound", None)):  # (the drain bound follows the slice)
                    bound(max(1, round(self.params.max_slice * 1e6)))
                share(self.gpu, name, on and name in names, budget)
            except Exception:
                log.exception("GPU %d: cannot tell %s whether its queued work is bounded", self.gpu, name)
                continue
            self._sharing[name] = (id(t), on and name in names)
        for name in [n for n in self._sharing if n not in names]:
            del self._sharing[name]
