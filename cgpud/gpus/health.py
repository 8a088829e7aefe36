"""GPU health: a GPU that fails is taken out of service, and comes back when it recovers
(docs/gpus.md, "Health").

Three parts, I/O at the edges:

- `Health` (pure, synchronous, on any clock): what each GPU's observations mean. A critical Xid
  (all but the application's own, `Policy.ignored_xids`), a double-bit ECC error or a GPU that
  does not answer (NVML_ERROR_GPU_IS_LOST) takes it out; it comes back after `quiet` seconds of
  answering with no new failure; a GPU that failed `max_failures` times within `window` seconds
  stays out (until the daemon restarts).
- Sources (blocking, run in a worker thread): `NvmlSource` (NVML's events through nvidia-ml-py:
  nvmlEventSetCreate, nvmlDeviceRegisterEvents for critical Xids and double-bit ECC errors,
  nvmlEventSetWait_v2; and one call per GPU per period, whose NVML_ERROR_GPU_IS_LOST says the GPU
  is lost), `FileSource` (simulated GPUs: the same events from a file, `sim-faults` in the state
  directory, in the NVML stand-in's words).
- `HealthWatch` (trio): runs a source's blocking step in a thread, feeds `Health`, and tells
  `on_change(gpu, state)` when a GPU goes out of service or comes back.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import trio

log = logging.getLogger("cgpud")

# NVIDIA's device plugin's list: errors of the application itself, not of the GPU
# (13 graphics engine exception, 31 MMU fault, 43 channel stopped, 45 preemptive cleanup,
# 68 video processor exception, 109 context switch timeout)
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
DBE_EVENT = 0x2  # nvmlEventTypeDoubleBitEccError
# What each well-known Xid says, and what to do (NVIDIA's Xid catalogue)
XID_TEXT = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def parse_xids(text: str) -> frozenset[int]:
    """`--health-ignore-xids`: comma-separated Xids ("13,31"), "" for none; ValueError with a
    line for a person."""
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or not 0 < int(part) < 1 << 16:
            raise ValueError(f"{part!r} is not an Xid (a number, e.g. 13,31,43)")
        out.add(int(part))
    return frozenset(out)


def disabled_by_env(value: str) -> tuple[bool, frozenset[int]]:
    """$CGPUD_DISABLE_HEALTHCHECKS, as NVIDIA's DP_DISABLE_HEALTHCHECKS: `all` (or `xids`): no health
    watch; a list of Xids: those ignored too. (off, more ignored Xids)."""
    value = value.strip().lower()
    if value in ("all", "xids"):
        return True, frozenset()
    return False, parse_xids(value)


@dataclass(frozen=True)
class Policy:
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    quiet: float = 60.0  # s of answering with no failure before a failed GPU is back
    max_failures: int = 3  # failures within `window` after which the GPU stays out
    window: float = 3600.0

    def __post_init__(self) -> None:
        if not self.quiet >= 0:
            raise ValueError(f"the quiet time must be 0 s or more, not {self.quiet}")
        if self.max_failures < 1:
            raise ValueError(f"the failures a GPU may have must be at least 1, not {self.max_failures}")
        if not self.window > 0:
            raise ValueError(f"the failure window must be more than 0 s, not {self.window}")


@dataclass
class GpuState:
    """One GPU's health, as shown (query's "health", cgpu-smi, metrics)."""

    healthy: bool = True
    reason: str = ""  # why it is out (the last failure), "" while healthy
    advice: str = ""  # what to do about it
    last_xid: int = 0  # the last critical Xid seen (0: none), kept after recovery
    lost: bool = False  # not answering now
    retired: bool = False  # failed too often: stays out until the daemon restarts
    failures: int = 0  # times it went out of service since the daemon started
    since: float | None = None  # when it went out (the clock's time)
    last_bad: float | None = None  # the last failure or failed answer (the quiet time counts from it)
    recent: deque = field(default_factory=deque)  # when it went out, within the window

    def as_dict(self, now: float) -> dict:
        return {"healthy": self.healthy, "reason": self.reason, "advice": self.advice, "last_xid": self.last_xid,
                "lost": self.lost, "retired": self.retired, "failures": self.failures,
                "out_for": round(now - self.since, 3) if self.since is not None and not self.healthy else 0.0}


# Observations a source makes: ("xid", gpu, code), ("ecc", gpu, 0), ("answers", gpu, 1|0)
Observation = tuple[str, int, int]


def xid_advice(code: int) -> str:
    if code == 79:
        return "the GPU fell off the bus: check it (nvidia-smi, dmesg), reset it (nvidia-smi -r) or reboot"
    if code in (48, 63, 64, 94, 95):
        return "an ECC error: drain the GPU's pods, reset it (nvidia-smi -r); if it repeats, replace the GPU"
    return "see dmesg and NVIDIA's Xid catalogue; reset the GPU (nvidia-smi -r) or reboot"


class Health:
    """Every GPU's health; `observe` and `tick` return the GPUs whose service changed."""

    def __init__(self, gpus: int, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        self.gpus = [GpuState() for _ in range(gpus)]

    def _fail(self, i: int, reason: str, advice: str, now: float) -> bool:
        g = self.gpus[i]
        g.last_bad = now
        if not g.healthy:
            return False  # (one incident, however many events it brings: its first says why)
        g.reason, g.advice = reason, advice
        g.healthy, g.since = False, now
        g.failures += 1
        g.recent.append(now)
        while g.recent and g.recent[0] <= now - self.policy.window:
            g.recent.popleft()
        if len(g.recent) >= self.policy.max_failures:
            g.retired = True
            g.advice += (f"; it failed {len(g.recent)} times within {self.policy.window:g} s and stays out of "
                         f"service until cgpud restarts (systemctl restart cgpud)")
        return True

    def observe(self, obs: Observation, now: float) -> list[int]:
        kind, i, value = obs
        if not 0 <= i < len(self.gpus):
            return []
        g = self.gpus[i]
        if kind == "xid":
            if value in self.policy.ignored_xids:
                return []
            g.last_xid = value
            what = XID_TEXT.get(value)
            return [i] if self._fail(i, f"Xid {value}" + (f" ({what})" if what else ""), xid_advice(value), now) else []
        if kind == "ecc":
            return [i] if self._fail(i, "double-bit ECC error", xid_advice(48), now) else []
        if kind == "answers":
            if value:
                g.lost = False
                return []
            g.lost = True
            return [i] if self._fail(i, "GPU is lost (NVML_ERROR_GPU_IS_LOST)", xid_advice(79), now) else []
        return []

    def tick(self, now: float) -> list[int]:
        """The GPUs back in service now: out, answering, not retired, quiet for `quiet` s."""
        back = []
        for i, g in enumerate(self.gpus):
            if g.healthy or g.retired or g.lost or g.last_bad is None:
                continue
            if now - g.last_bad >= self.policy.quiet:
                g.healthy, g.reason, g.advice, g.since = True, "", "", None
                back.append(i)
        return back

    def healthy(self, i: int) -> bool:
        return self.gpus[i].healthy


# ---- sources -------------------------------------------------------------------------------------

class NvmlSource:
    """NVML's events and answers, on an NVML session of its own (blocking: call from a thread)."""

    def __init__(self) -> None:
        from cgpud.gpus.nvml import Nvml

        self.nvml = Nvml()
        self._set = None
        self._registered: set[int] = set()
        self._lost: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> "NvmlSource":
        self.nvml.open()
        nv = self.nvml._nv
        self._set = nv.nvmlEventSetCreate()
        self._by_handle = {}
        for i in range(self.nvml.count):
            self._by_handle[self._addr(self.nvml._handles[i])] = i
            self._register(i)
        return self

    @staticmethod
    def _addr(handle) -> int:
        import ctypes

        return ctypes.cast(handle, ctypes.c_void_p).value or 0

    def _register(self, i: int) -> bool:
        """Register GPU i for what it supports of critical Xids and double-bit ECC errors."""
        nv = self.nvml._nv
        h = self.nvml._handles[i]
        try:
            types = (XID_EVENT | DBE_EVENT) & nv.nvmlDeviceGetSupportedEventTypes(h)
            if types:
                nv.nvmlDeviceRegisterEvents(h, types, self._set)
        except nv.NVMLError as exc:
            log.warning("GPU %d: its health events cannot be watched (%s); it is probed every period only",
                        i, exc)
            return False
        self._registered.add(i)
        return True

    def step(self, timeout: float) -> list[Observation]:
        """Wait up to `timeout` s for an event, then ask every GPU once."""
        with self._lock:
            if self._closed:
                return []
            nv = self.nvml._nv
            out: list[Observation] = []
            try:
                data = nv.nvmlEventSetWait_v2(self._set, int(timeout * 1000))
            except nv.NVMLError as exc:
                if exc.value != nv.NVML_ERROR_TIMEOUT and exc.value != nv.NVML_ERROR_GPU_IS_LOST:
                    log.warning("NVML's event wait failed (%s); asking each GPU instead", exc)
                if exc.value != nv.NVML_ERROR_TIMEOUT:
                    # (a lost GPU makes every wait fail at once: the answers below say which; not a busy loop)
                    self._closed_wait(timeout)
            else:
                i = self._by_handle.get(self._addr(data.device))
                if i is not None:
                    if data.eventType & XID_EVENT:
                        out.append(("xid", i, int(data.eventData)))
                    elif data.eventType & DBE_EVENT:
                        out.append(("ecc", i, 0))
            for i in range(self.nvml.count):
                try:
                    nv.nvmlDeviceGetMemoryInfo(self.nvml._handles[i])
                except nv.NVMLError as exc:
                    if exc.value == nv.NVML_ERROR_GPU_IS_LOST:
                        out.append(("answers", i, 0))
                        self._lost.add(i)
                    continue
                out.append(("answers", i, 1))
                if i not in self._registered or i in self._lost:  # (a reset GPU's events: registered anew)
                    self._lost.discard(i)
                    self._register(i)
            return out

    def _closed_wait(self, timeout: float) -> None:
        threading.Event().wait(timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._set is not None:
                try:
                    self.nvml._nv.nvmlEventSetFree(self._set)
                except Exception:
                    pass
                self._set = None
            self.nvml.close()


class FileSource:
    """Simulated GPUs' faults, from a file in the NVML stand-in's words (docs/gpus.md):
    `event <i> xid <code>`, `event <i> ecc` (each line one event: append them), `lost <i>` (GPU i does
    not answer while the line is there). Read every step; a missing file is no fault."""

    def __init__(self, path: str, gpus: int) -> None:
        self.path, self.gpus = path, gpus
        self.seen = None  # event lines delivered (None: not read yet; what is there at start is the past)
        self._stop = threading.Event()

    def open(self) -> "FileSource":
        self.seen = len(self._read()[0])
        return self

    def _read(self) -> tuple[list[Observation], set[int]]:
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except OSError:
            return [], set()
        events, lost = [], set()
        for line in lines:
            w = line.split()
            try:
                if len(w) >= 3 and w[0] == "event" and w[2] == "xid" and len(w) >= 4:
                    events.append(("xid", int(w[1]), int(w[3])))
                elif len(w) >= 3 and w[0] == "event" and w[2] == "ecc":
                    events.append(("ecc", int(w[1]), 0))
                elif len(w) == 2 and w[0] == "lost":
                    lost.add(int(w[1]))
            except ValueError:
                continue
        return events, lost

    def step(self, timeout: float) -> list[Observation]:
        events, lost = self._read()
        new = events[self.seen or 0:]
        self.seen = len(events)
        if not new:
            self._stop.wait(timeout)
            events, lost = self._read()
            new = events[self.seen:]
            self.seen = len(events)
        return [e for e in new if 0 <= e[1] < self.gpus] + [("answers", i, int(i not in lost))
                                                            for i in range(self.gpus)]

    def close(self) -> None:
        self._stop.set()


def sim_faults_path(state_dir: str) -> str:
    return os.path.join(state_dir, "sim-faults")


# ---- the service ------------------------------------------------------------------------------

class HealthWatch:
    """The daemon's health service: `health` for whoever shows it, `on_change(gpu, state)` called in
    the trio thread when a GPU goes out of service or comes back."""

    PERIOD = 0.5  # s: the longest an event waits to be read, and how often each GPU is asked

    def __init__(self, health: Health, source, on_change: Callable[[int, GpuState], None] | None = None,
                 period: float = PERIOD, names: list[str] | None = None) -> None:
        self.health, self.source, self.period = health, source, period
        self.on_change = on_change
        self.names = names or [f"GPU {i}" for i in range(len(health.gpus))]

    def apply(self, observations: list[Observation], now: float) -> None:
        changed = []
        for obs in observations:
            if obs[0] == "xid" and obs[2] in self.health.policy.ignored_xids:
                log.info("%s: Xid %d (an application's own error, ignored: --health-ignore-xids)",
                         self.names[obs[1]] if obs[1] < len(self.names) else obs[1], obs[2])
            changed += self.health.observe(obs, now)
        changed += self.health.tick(now)
        for i in changed:
            g = self.health.gpus[i]
            if g.healthy:
                log.warning("%s answers healthily again (%g s with no failure): back in service", self.names[i],
                            self.health.policy.quiet)
            else:
                log.error("%s failed: %s; it is out of service (its units Unhealthy, nothing new placed on it, "
                          "its instances still scheduled): %s", self.names[i], g.reason, g.advice)
            if self.on_change is not None:
                self.on_change(i, g)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self.source.open)
        task_status.started()
        try:
            while True:
                obs = await trio.to_thread.run_sync(self.source.step, self.period, abandon_on_cancel=True)
                self.apply(obs, trio.current_time())
        finally:
            self.source.close()
