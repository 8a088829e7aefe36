"""The GPU time the instances a slice charges got (docs/scheduler.md, "The
charge: GPU time"): the part of GpuScheduler (cgpud.sched.loop) that reads,
at the start and the end of each slice the loop carries out itself — a
high-priority group's (its own, or beside the normal ring), a ring holder's
when the switcher does not run it — the counters libcgpu keeps per process
slot in the usage page, through the enforcer's targets' pages
(cgpud.sched.native.Page.gpu_ns). The switcher reads its steps' itself
(native/switch/cgpu-switch.c)."""
from __future__ import annotations

from typing import Any

from cgpud.sched.policies import Decision, GpuView, Kind


class PrioTime:
    """Mixed into GpuScheduler: `_prio_ns(view, dec)` and `_prio_reading(names)`."""

    # (GpuScheduler's)
    gpu: int
    _enforcer: Any

    _prio_before: tuple[frozenset[str], int] | None = None

    def _prio_ns(self, view: GpuView, dec: Decision) -> tuple[frozenset[str], int] | None:
        """The instances a decision charges — the high-priority ones it runs, or its ring slot's
        active holder — and the GPU time their processes have got (libcgpu's count), when every one
        of them counts it; else None."""
        if dec.kind == Kind.PRIO or dec.along:
            names = dec.along or frozenset(n for n in dec.running if n in view.active_names)
        elif dec.kind == Kind.SLOT and dec.holder in view.active_names:
            names = frozenset({dec.holder})
        else:
            return None
        ns = self._prio_reading(names)
        return (names, ns) if ns is not None else None

    def _prio_reading(self, names: frozenset[str]) -> int | None:
        target = getattr(self._enforcer, "target", None)
        if target is None or not names:
            return None
        total = 0
        for name in names:
            page = getattr(target(name), "page", None)
            reading = page.gpu_ns(self.gpu) if page is not None and hasattr(page, "gpu_ns") else None
            if reading is None:
                return None
            total += reading
        return total
