"""The GPU time the instances a slice charges got (docs/scheduler.md, "The
charge: GPU time"): the part of GpuScheduler (cgpud.sched.loop) that reads,
at the start and the end of each slice the loop carries out itself — a
high-priority group's (its own, or beside the normal ring), a ring holder's
when the switcher does not run it — the counters libcgpu keeps per process
slot in the usage page, through the enforcer's targets' pages
(cgpud.sched.native.Page.gpu_ns). The switcher reads its steps' itself
(native/switch/cgpu-switch.c)."""
from __future__ import annotations

import logging
import time
from typing import Any

import trio

from cgpud.sched.policies import Decision, GpuView, InstView, Kind, entitled_share

log = logging.getLogger(__name__)


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


class HeldBack:
    """Mixed into GpuScheduler: `held_back`, the instances a process of which left the library and used
    more GPU time than their share (NVML's figure: ChargeCheck), planned with weight 0 (held at their
    gates and frozen) until that debt is paid; `_held_back(settings)` applies it to the basis."""

    held_back: frozenset[str] = frozenset()

    def _held_back(self, settings: tuple) -> tuple:
        if not self.held_back:
            return settings
        return tuple((n, 0 if n in self.held_back else w, h) for n, w, h in settings)


# ---- the check of what the pages say (docs/security.md, "The charge") ----------------------------

DEBT_MAX = 30.0     # s of GPU time past its share a held instance may owe (paid back before it runs again)
TRUSTED = 0.5       # a page that counts under this part of what NVML measured is not believed
NOISE = 0.1         # ... when NVML measured at least this part of the window (its figure is whole percents)


def judge(claimed_ns: int, measured_ns: int, window_ns: int) -> str | None:
    """Why an instance's page is not believed, from what its processes counted over a window (the
    page's difference, negative if the count went back) and what NVML measured its processes used
    (the sum over them of utilisation × window); None: believed. An honest page counts nearly all
    (libcgpu undercounts at most a tick per idle gap: a few %); a count well below NVML's is a lie
    (or a library that does not count), and charging by the page would give it more than its weight."""
    if claimed_ns < 0:
        return f"its GPU time count went back by {-claimed_ns / 1e6:.1f} ms"
    if measured_ns >= NOISE * window_ns and claimed_ns < TRUSTED * measured_ns:
        return (f"its processes counted {claimed_ns / 1e6:.1f} ms of GPU time over {window_ns / 1e9:.2f} s, "
                f"NVML measured {measured_ns / 1e6:.1f} ms")
    return None


class ChargeCheck:
    """What each instance's page says its processes got, against NVML's per-process utilisation, over
    windows of `window` s (cgpud/daemon/main.py starts it with the schedulers, when NVML answers).
    An instance whose page counts well below (`judge`) is charged the time its gate is open from then
    on (native.Page.distrust: its count is no longer read, by the loop or the switcher), said once.

    nvml: an open cgpud.gpus.nvml.Nvml; schedulers(): the GpuSchedulers (each its `gpu` and its
    enforcer's `target(name)` with a `page`); owner(pid, gpu): the instance (`.name`) of a process
    NVML names, or None."""

    def __init__(self, nvml: Any, schedulers: Any, owner: Any, window: float = 1.0) -> None:
        self.nvml, self.schedulers, self.owner, self.window = nvml, schedulers, owner, window
        self._claimed: dict[tuple[int, str], int] = {}   # (gpu, name): the page's count at the last look
        self._stamp: dict[int, int] = {}                   # gpu: NVML's timestamp of its last answer
        self._at: dict[int, float] = {}                    # gpu: when that was (monotonic s)
        self.distrusted: set[tuple[int, str]] = set()
        self._errors: set[str] = set()
        self.debt: dict[tuple[int, str], float] = {}      # (gpu, name): GPU s a held instance used past its share

    def measured(self, gpu: int, since: int) -> tuple[dict[int, float] | None, int]:
        """NVML's utilisation of each process on `gpu` since its answer stamped `since` (a fraction of
        the time) and the stamp of this answer; no process sampled: {} (NVML_ERROR_NOT_FOUND)."""
        nv = self.nvml
        try:
            found = nv._call(gpu, "nvmlDeviceGetProcessUtilization", since)
        except Exception as exc:  # NVMLError_NotFound: no process used it since
            if getattr(exc, "code", None) == getattr(nv._nv, "NVML_ERROR_NOT_FOUND", -1):
                return {}, since
            if str(exc) not in self._errors:
                self._errors.add(str(exc))
                log.warning("the usage pages' GPU time on GPU %d is not checked while NVML fails: %s", gpu, exc)
            return None, since
        util: dict[int, list[int]] = {}
        stamp = since
        for s in found:
            util.setdefault(int(s.pid), []).append(int(s.smUtil))
            stamp = max(stamp, int(s.timeStamp))
        return {pid: sum(u) / len(u) / 100 for pid, u in util.items()}, stamp

    def sample(self) -> dict[int, tuple[dict[int, float], float]]:
        """NVML's answer for every GPU a scheduler runs (in a worker thread: NVML may be slow): per GPU,
        each process's utilisation since the last answer and the time (monotonic s) that answer covers."""
        out = {}
        for s in self.schedulers():
            gpu = s.gpu
            wall = int(time.time() * 1e6)
            util, stamp = self.measured(gpu, self._stamp.get(gpu, 0))
            now = time.monotonic()
            window = now - self._at[gpu] if gpu in self._at else 0.0
            self._stamp[gpu] = stamp if stamp > self._stamp.get(gpu, 0) else wall
            self._at[gpu] = now
            if util is not None:
                out[gpu] = (util, window)
        return out

    def look(self, sampled: dict[int, tuple[dict[int, float], float]]) -> list[tuple[str, int, str]]:
        """One window's check of every GPU against NVML's answer (`sample`), in the scheduler's thread
        (the pages are its): the (name, gpu, why) of the pages found lying now."""
        found = []
        for s in self.schedulers():
            gpu, enforcer = s.gpu, s._enforcer
            target = getattr(enforcer, "target", None)
            if target is None or gpu not in sampled:
                continue
            util, window = sampled[gpu]
            used: dict[str, float] = {}
            users: dict[str, list[int]] = {}
            for pid, u in util.items():
                inst = self.owner(pid, gpu)
                if inst is not None:
                    used[inst.name] = used.get(inst.name, 0.0) + u
                    if u > 0:
                        users.setdefault(inst.name, []).append(pid)
            for name, pids in users.items():
                self._hold_outside(target(name), name, gpu, pids)
            self._charge_held(s, target, used, window)
            for name in list(getattr(enforcer, "_targets", {})):
                page = getattr(target(name), "page", None)
                if page is None or (gpu, name) in self.distrusted:
                    continue
                count = page.gpu_ns(gpu)
                before = self._claimed.get((gpu, name))
                if count is None:
                    self._claimed.pop((gpu, name), None)
                    continue
                self._claimed[(gpu, name)] = count
                if before is None or window <= 0:
                    continue
                why = judge(count - before, int(used.get(name, 0.0) * window * 1e9), int(window * 1e9))
                if why is not None and page.distrust(why):
                    self.distrusted.add((gpu, name))
                    found.append((name, gpu, why))
        live = {(s.gpu, n) for s in self.schedulers() for n in getattr(s._enforcer, "_targets", {})}
        self.distrusted &= live  # (an instance made again has a new page)
        self._claimed = {k: v for k, v in self._claimed.items() if k in live}
        self.debt = {k: v for k, v in self.debt.items() if k in live}
        return found

    def _charge_held(self, sched: Any, target: Any, used: dict[str, float], window: float) -> None:
        """Charge the held instances of a GPU (a process of theirs outside the library) by NVML's figure:
        what each used past its share over the window is its debt (none banked below it, at most
        DEBT_MAX s); while it owes, its scheduler plans it with weight 0 (held, its queued work drains
        beside the others). An instance's GPU time over time is then its share, whatever it queued."""
        g = sched.node.gpu(sched.gpu)
        held = [n for n in getattr(sched._enforcer, "_targets", {}) if getattr(target(n), "held", None) is not None]
        if not held or window <= 0:
            return
        view = GpuView(g.policy, g.max_inst, g.prio_ratio,
                       tuple(InstView(i.name, i.weight, i.highprio, True) for i in g.instances.values()))
        owing = set()
        for name in held:
            if name not in view.names:
                continue
            key = (sched.gpu, name)
            owed = self.debt.get(key, 0.0) + (used.get(name, 0.0) - entitled_share(view, name)) * window
            self.debt[key] = min(max(owed, 0.0), DEBT_MAX)
            if self.debt[key] > 0:
                owing.add(name)
        if frozenset(owing) != sched.held_back:
            sched.held_back = frozenset(owing)
            sched.poke()

    @staticmethod
    def _hold_outside(target: Any, name: str, gpu: int, pids: list[int]) -> None:
        """Processes of a gated instance that used the GPU (NVML's word) with no live slot in its page
        (the kernel's: no slot's lock is theirs) left the library: no gate holds them. The instance is
        held by its cgroup's freezer from then on, frozen whenever its gates are closed (issue 44)."""
        outside = getattr(target, "outside", None)
        if outside is None or getattr(target, "held", None) is not None:
            return
        gone = outside(pids)
        why = (f"process {', '.join(map(str, gone))} of it used GPU {gpu} outside the library (NVML lists it, "
               "it holds no slot): held by its cgroup's freezer")
        if gone and target.hold_group(why):
            log.warning("instance %s: %s, frozen whenever its gates are closed; charged the time they are open, "
                        "until the instance is made again", name, why)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        spent: list[float] = []  # each window's check: NVML's answer and the pages' reads (s)
        try:
            while True:
                await trio.sleep(self.window)
                t0 = time.perf_counter()
                sampled = await trio.to_thread.run_sync(self.sample)
                t1 = time.perf_counter()
                lying = self.look(sampled)
                spent.append(time.perf_counter() - t1 + (t1 - t0))
                for name, gpu, why in lying:
                    log.warning("instance %s's usage page under-reports its GPU time on GPU %d: %s; it is charged "
                                "the time its gate is open from now on, until the instance is made again", name, gpu, why)
        finally:
            self.nvml.close()
            if spent:  # (bench/charge.py reads it)
                spent.sort()
                log.info("the usage pages' GPU time was checked %d times, each %.3f ms (median), %.3f ms at most",
                         len(spent), spent[len(spent) // 2] * 1e3, spent[-1] * 1e3)
