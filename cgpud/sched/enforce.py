"""Enforcement: pausing and resuming one instance's processes.

Longer than 450 lines on purpose: the four backends share one surface and
one set of safety checks, and whoever checks what may be frozen, and how it
is thawed again, wants them in one place. Where the groups are and what may
never be touched is sched.cgroupfs.

One object per target, built once when the instance is registered, then
driven by the scheduler at every slice boundary:

    f = freezer_for_pid(container_init_pid)   # or CgroupV2Freezer(path), …
    registry.add(f)                            # cgpud.sched.guard: before the first freeze
    f.freeze()                                 # one pwrite(2) on an fd kept open
    f.thaw()

| backend            | target                  | freeze                        | thaw                      |
|--------------------|-------------------------|-------------------------------|---------------------------|
| `CgroupV2Freezer`  | a cgroup2 directory     | `1` > cgroup.freeze           | `0` > cgroup.freeze       |
| `CgroupV1Freezer`  | a v1 freezer directory  | `FROZEN` > freezer.state      | `THAWED` > freezer.state  |
| `SignalFreezer`    | a process group         | SIGSTOP to the group          | SIGCONT to the group      |
| `SimFreezer`       | nothing (a simulation)  | records it                    | records it                |

All four have the same surface: `freeze()`, `thaw() -> bool`, `is_frozen()`,
`spec()` (the entry for the guard's registry), `close()`, and the attribute
`frozen` (the state last asked for). `freeze()` and `thaw()` may be called in
any order and any number of times; each call asks the kernel again (a few µs),
so a target thawed behind our back is frozen again at the next call.
`freeze()` raises `TargetGone` when the target no longer exists; `thaw()`
never raises for that (a target that is gone is not frozen) and returns False.

Safety, checked when the object is built (`Refused`, nothing done):
- a path must be a group of a mounted cgroup2 / v1-freezer hierarchy, and
  never the root of one;
- never a group that holds the daemon or another protected process (the
  guard: `protect_pid`), nor an ancestor of such a group;
- never the daemon's own process group, nor process groups 0 and 1.
The daemon's own groups are read once, when the object is built: the daemon
does not move itself between cgroups.

`freezer_for_pid(pid)` chooses like this: the process's cgroup2 group if it is
not the root and has cgroup.freeze; else its v1 freezer group if not the root;
else SIGSTOP/SIGCONT on its process group. A group that holds the daemon is
passed over like a root.

The thawing side needs no object: `thaw_spec(entry)` thaws what a registry
entry names (the guard and the daemon's start-up use it), validating the
entry the same way but never refusing to thaw a group for holding a protected
process (a thaw cannot hurt).
"""
from __future__ import annotations

import functools
import os
import signal
import statistics
import time
from typing import Any, Protocol

from cgpud.sched.cgroupfs import (
    _GONE,
    KIND_CGROUP2,
    KIND_FREEZER,
    KIND_GATE,
    KIND_SIGNAL,
    KIND_SIM,
    cgroup_pids,
    EnforceError,
    hierarchies,
    _locate,
    proc_cgroups,
    _refuse_protected_group,
    _refuse_protected_pgid,
    Refused,
    _start_time,
    stat_fields,
    _subgroups_deepest_first,
    TargetGone,
)
from cgpud.sched.gate import GateFreezer, tell_damage, thaw_gate

# ---- the backends ----------------------------------------------------------------------


class Freezer(Protocol):
    kind: str
    frozen: bool

    def freeze(self) -> None: ...
    def thaw(self) -> bool: ...
    def is_frozen(self) -> bool: ...
    def spec(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class _GroupFreezer:
    """A cgroup's freeze file, kept open; freeze/thaw are one pwrite each."""
    kind = ""

    def __init__(self, path: str, *, label: str | None = None) -> None:
        self._h, self.path = _locate(path, self.kind)
        _refuse_protected_group(self.path, self.kind)
        self.label = label
        self.frozen = False
        self._fd = os.open(os.path.join(self.path, self._h.control), os.O_WRONLY | os.O_CLOEXEC)

    def _write(self, value: bytes) -> None:
        if self._fd < 0:
            raise EnforceError(f"{self!r} is closed")
        os.pwrite(self._fd, value, 0)

    def freeze(self) -> None:
        try:
            self._write(self._h.freeze_value)
        except OSError as exc:
            if exc.errno in _GONE:
                raise TargetGone(f"{self.path} is gone") from None
            raise
        self.frozen = True

    def thaw(self) -> bool:
        self.frozen = False
        try:
            self._write(self._h.thaw_value)
        except OSError as exc:
            if exc.errno in _GONE:
                return False
            raise
        return True

    def spec(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": self.kind, "path": self.path}
        if self.label:
            entry["label"] = self.label
        return entry

    def close(self) -> None:
        """Close the file; the group keeps the state it has (thaw first)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)


class CgroupV2Freezer(_GroupFreezer):
    """`cgroup.freeze` of one cgroup2 group (what `docker pause` does on v2).
    The write returns at once; the group is frozen when cgroup.events says
    `frozen 1` (is_frozen)."""
    kind = KIND_CGROUP2

    def is_frozen(self) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.events"), "rb") as f:
                return b"\nfrozen 1" in b"\n" + f.read()
        except FileNotFoundError:
            return False


class CgroupV1Freezer(_GroupFreezer):
    """`freezer.state` of one v1 freezer group. The group reads FREEZING until
    every task has stopped, then FROZEN (is_frozen)."""
    kind = KIND_FREEZER

    def is_frozen(self) -> bool:
        try:
            with open(os.path.join(self.path, "freezer.state"), "rb") as f:
                return f.read().strip() == b"FROZEN"
        except FileNotFoundError:
            return False


def group_members(pgid: int) -> list[int]:
    """The processes of a process group (a walk over /proc: slow, for checks)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if int(stat_fields(int(name))[2]) == pgid:
                    out.append(int(name))
            except (TargetGone, IndexError, ValueError):
                continue
    return out


class SignalFreezer:
    """SIGSTOP/SIGCONT to a process group: for processes without a group of
    their own. Weaker than a freezer: a process that leaves the group (setsid,
    setpgid) escapes, a parent sees its child stopped, and SIGCONT also
    resumes a process the user had stopped himself."""
    kind = KIND_SIGNAL

    def __init__(self, pgid: int, *, label: str | None = None) -> None:
        _refuse_protected_pgid(pgid)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            raise TargetGone(f"no process group {pgid}") from None
        self.pgid = pgid
        self.label = label
        self.start = _start_time(pgid)  # of the leader, to tell a reused number (None: leader gone)
        self.frozen = False

    def freeze(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGSTOP)
        except ProcessLookupError:
            raise TargetGone(f"process group {self.pgid} is gone") from None
        self.frozen = True

    def thaw(self) -> bool:
        self.frozen = False
        try:
            os.killpg(self.pgid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True

    def is_frozen(self) -> bool:
        states = []
        for pid in group_members(self.pgid):
            try:
                states.append(stat_fields(pid)[0])
            except TargetGone:
                continue
        return bool(states) and all(s in ("T", "t") for s in states)

    def spec(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": self.kind, "pgid": self.pgid, "start": self.start}
        if self.label:
            entry["label"] = self.label
        return entry

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"SignalFreezer({self.pgid})"


class SimFreezer:
    """No processes: records what was asked (for simulated instances and tests)."""
    kind = KIND_SIM

    def __init__(self, name: str = "sim") -> None:
        self.name = name
        self.frozen = False
        self.freezes = 0  # transitions thawed -> frozen
        self.thaws = 0    # transitions frozen -> thawed

    def freeze(self) -> None:
        if not self.frozen:
            self.freezes += 1
            self.frozen = True

    def thaw(self) -> bool:
        if self.frozen:
            self.thaws += 1
            self.frozen = False
        return True

    def is_frozen(self) -> bool:
        return self.frozen

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"SimFreezer({self.name!r}, frozen={self.frozen})"


# ---- choosing one ------------------------------------------------------------------------


def freezer_for_pid(pid: int, *, label: str | None = None) -> Freezer:
    """The backend for the instance whose processes share `pid`'s group (a
    container's init PID, or the command `cgpu run` started): its cgroup2
    group, else its v1 freezer group, else its process group. Raises Refused
    (with every reason) if none may be frozen, TargetGone if pid is gone."""
    pc = proc_cgroups(pid)
    reasons = []
    for kind, path, cls in ((KIND_CGROUP2, pc.v2, CgroupV2Freezer), (KIND_FREEZER, pc.freezer, CgroupV1Freezer)):
        if path is None:
            reasons.append(f"no {kind} hierarchy")
            continue
        try:
            return cls(path, label=label)
        except Refused as exc:
            reasons.append(str(exc))
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        raise TargetGone(f"no process {pid}") from None
    try:
        return SignalFreezer(pgid, label=label)
    except Refused as exc:
        reasons.append(str(exc))
        raise Refused(f"process {pid} cannot be frozen: " + "; ".join(reasons)) from None


def freezer_for_cgroup(path: str, *, label: str | None = None) -> Freezer:
    """The backend for a group given by its directory, in whichever hierarchy holds it."""
    real = os.path.realpath(path)
    for kind, cls in ((KIND_CGROUP2, CgroupV2Freezer), (KIND_FREEZER, CgroupV1Freezer)):
        h = hierarchies().get(kind)
        if h is not None and h.holds(real):
            return cls(path, label=label)
    raise Refused(f"{path} is in no cgroup2 or v1 freezer hierarchy")


def freezer_from_spec(entry: dict[str, Any]) -> Freezer:
    """A backend from a registry entry (checked like any other). A target
    with a "gate" (its container's pages: it carries libcgpu and the daemon
    gates launches) gets the gate instead of its group's freezer."""
    kind, label = entry.get("kind"), entry.get("label")
    if entry.get("gate"):
        group, cls = None, {KIND_CGROUP2: CgroupV2Freezer, KIND_FREEZER: CgroupV1Freezer}.get(kind)
        if cls is not None and isinstance(entry.get("path"), str):
            group = {"kind": kind, "path": entry["path"]}
        return GateFreezer(entry["gate"], label=label, gpus=entry.get("gpus"), group=group,
                           group_freezer=(lambda: cls(group["path"], label=label)) if group else None)
    if kind == KIND_GATE:
        return GateFreezer(entry["path"], label=label)
    if kind == KIND_CGROUP2:
        return CgroupV2Freezer(entry["path"], label=label)
    if kind == KIND_FREEZER:
        return CgroupV1Freezer(entry["path"], label=label)
    if kind == KIND_SIGNAL:
        return SignalFreezer(int(entry["pgid"]), label=label)
    if kind == KIND_SIM:
        return SimFreezer(entry.get("name", "sim"))
    raise Refused(f"unknown kind {kind!r}")


def thaw_spec(entry: Any) -> str:
    """Thaw what one registry entry names. Never raises for a bad or vanished
    entry: returns "thawed", "gone", "nothing to do" (sim) or "refused: why"."""
    if not isinstance(entry, dict):
        return f"refused: not an object: {entry!r}"
    kind = entry.get("kind")
    if kind in (KIND_CGROUP2, KIND_FREEZER):
        path = entry.get("path")
        if not isinstance(path, str):
            return "refused: no path"
        try:
            h, real = _locate(path, kind)
            fd = os.open(os.path.join(real, h.control), os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, h.thaw_value, 0)
            finally:
                os.close(fd)
        except Refused as exc:
            return f"refused: {exc}"
        except TargetGone:
            return "gone"
        except OSError as exc:
            return "gone" if exc.errno in _GONE else f"refused: {path}: {exc.strerror}"
        return "thawed"
    if kind == KIND_SIGNAL:
        pgid, start = entry.get("pgid"), entry.get("start")
        if not isinstance(pgid, int) or isinstance(pgid, bool) or pgid <= 1:
            return f"refused: bad process group {pgid!r}"
        now = _start_time(pgid)
        if start is not None and now is not None and now != start:
            return f"refused: process group {pgid} is another one now (its leader started at {now}, ours at {start})"
        try:
            os.killpg(pgid, signal.SIGCONT)
        except ProcessLookupError:
            return "gone"
        return "thawed"
    if kind == KIND_SIM:
        return "nothing to do"
    if kind == KIND_GATE:
        path = entry.get("path")
        if isinstance(entry.get("group"), dict):  # (its cgroup, which held it when a process left the library)
            thaw_spec(entry["group"])
        return thaw_gate(path) if isinstance(path, str) else "refused: no path"
    return f"refused: unknown kind {kind!r}"


# ---- the scheduler's side -----------------------------------------------------------------


def _per_gpu(target: Any) -> bool:
    """The target stops its container on one GPU at a time (a gate with per-GPU gates)."""
    return getattr(target, "drives_gpus", False)


class Enforcement:
    """The scheduler's Enforcer (cgpud.sched.enforce_api): freeze(gpu, name)
    and thaw(gpu, name) carried out on one backend per instance name.

    A container with instances on several GPUs is one target: it stays frozen
    while at least one GPU holds it frozen, unless the target stops it per GPU
    (a gate with `drives_gpus`: each GPU closes and opens its own gate, and
    the container runs on where it may). An instance with no target
    attached (nothing to stop) and a target that is gone succeed quietly.
    `registry` (cgpud.sched.guard.Registry, or anything with add/discard) is told of
    a target when it is attached, before any freeze, and after it is detached
    and thawed: the guard then knows everything that may be frozen.

        enf = Enforcement(registry)
        enf.attach("abc", freezer_from_spec(instance.target))
        sched = GpuScheduler(node, 0, enf, monitor)
        …
        enf.detach("abc")     # instance removed
        enf.close()           # shutdown: thaw everything, detach
    """

    def __init__(self, registry: Any = None) -> None:
        self._registry = registry
        self._targets: dict[str, Freezer] = {}
        self._holders: dict[str, set[int]] = {}  # name -> GPUs that hold it frozen

    def attach(self, name: str, target: Freezer) -> None:
        """Give instance `name` its target (replacing one it had, thawed).
        Frozen at once if a GPU holds the instance frozen."""
        if name in self._targets:
            self.detach(name, keep_holders=True)
        if self._registry is not None:
            self._registry.add(target)
        self._targets[name] = target
        holders = self._holders.get(name)
        if holders and _per_gpu(target):
            for gpu in sorted(holders):
                self._apply(name, functools.partial(target.freeze, gpu))
        elif holders:
            self._apply(name, target.freeze)

    def detach(self, name: str, *, keep_holders: bool = False) -> None:
        """Thaw instance `name`'s target and forget it."""
        target = self._targets.pop(name, None)
        if not keep_holders:
            self._holders.pop(name, None)
        if target is None:
            return
        target.thaw()
        if self._registry is not None:
            self._registry.discard(target)
        tell_damage(name, target)  # (found since the last look: said before it goes)
        target.close()

    def target(self, name: str) -> Freezer | None:
        return self._targets.get(name)

    def freeze(self, gpu: int, name: str) -> None:
        self._holders.setdefault(name, set()).add(gpu)
        target = self._targets.get(name)
        if target is not None:
            self._apply(name, functools.partial(target.freeze, gpu) if _per_gpu(target) else target.freeze)

    def thaw(self, gpu: int, name: str) -> None:
        target = self._targets.get(name)
        per_gpu = _per_gpu(target)
        self.release(gpu, name)
        if name in self._holders and not per_gpu:
            return  # another GPU still holds it
        if target is not None:
            target.thaw(gpu) if per_gpu else target.thaw()

    def release(self, gpu: int, name: str) -> None:
        """GPU `gpu` no longer holds `name` stopped, its gate left as it is:
        the GPU's switcher thread drives it now (cgpud.sched.batching)."""
        holders = self._holders.get(name)
        if holders is not None:
            holders.discard(gpu)
            if not holders:
                del self._holders[name]

    def adopt(self, gpu: int, name: str) -> None:
        """GPU `gpu` holds `name` stopped (its switcher left its gate closed)."""
        self._holders.setdefault(name, set()).add(gpu)

    def share(self, gpu: int, name: str, on: bool, budget_us: int) -> None:
        """Tell instance `name`'s gate whether another instance is active on
        GPU `gpu` now (its processes then bound their queued work: libcgpu)."""
        target = self._targets.get(name)
        share = getattr(target, "share", None)
        if share is not None:
            self._apply(name, functools.partial(share, gpu, on, budget_us))

    def undrained(self, names: Any, gpu: int | None = None) -> list[Any]:
        """Of the instances `names`, the targets whose processes still run work
        they queued before being stopped (the gate: cgpud.sched.gate), on GPU
        `gpu` when the target stops them per GPU; the loop waits for them,
        bounded, before it lets the next instance run."""
        out = []
        for name in names:
            t = self._targets.get(name)
            if t is None or not t.frozen or not getattr(t, "undrained", None):
                continue
            if t.undrained(gpu) if _per_gpu(t) else t.undrained():
                out.append(t)
        return out

    def _apply(self, name: str, action: Any) -> None:
        try:
            action()
        except TargetGone:
            self.detach(name, keep_holders=True)  # nothing left to stop

    def frozen(self) -> dict[str, frozenset[int]]:
        """name -> the GPUs that hold it frozen."""
        return {n: frozenset(h) for n, h in self._holders.items() if h}

    def close(self) -> None:
        """Thaw and detach every target (the daemon's shutdown)."""
        for name in list(self._targets):
            self.detach(name)
        self._holders.clear()


# ---- groups of our own (cgpu run, tests): their removal ---------------------------------


def remove_cgroup(path: str, timeout: float = 2.0) -> None:
    """Empty a group of our own and remove it with the groups below it: thaw,
    SIGKILL every process in it, wait until it is empty, rmdir deepest first.
    Refused for a root or a group that holds the daemon. A group that is
    already gone is fine; one still busy at `timeout` raises EnforceError."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return
    kind = next((k for k, h in hierarchies().items() if h.holds(real)), None)
    if kind is None:
        raise Refused(f"{path} is in no cgroup2 or v1 freezer hierarchy")
    h, real = _locate(real, kind)
    _refuse_protected_group(real, kind)
    groups = _subgroups_deepest_first(real) + [real]
    for g in reversed(groups):  # parents first: a frozen parent keeps its children frozen
        thaw_spec({"kind": kind, "path": g})
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids(real)
        if not pids:
            break
        if time.monotonic() > deadline:
            raise EnforceError(f"{real} still holds processes {pids} after {timeout} s")
        kill_file = os.path.join(real, "cgroup.kill")
        if kind == KIND_CGROUP2 and os.path.exists(kill_file):
            with open(kill_file, "w") as f:
                f.write("1")
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.005)
    for g in groups:
        try:
            os.rmdir(g)
        except FileNotFoundError:
            pass


# ---- how fast ------------------------------------------------------------------------------


def measure(f: Freezer, rounds: int = 200, pause: float = 0.002, realtime: bool = False) -> dict[str, float]:
    """Freeze/thaw `f` `rounds` times; µs per call (median, p99) for freeze and
    thaw, and until the kernel reports the target frozen (`settle`, polled
    every ~20 µs). The target's processes should be busy, as in real use.
    `realtime`: measure as SCHED_FIFO (what the daemon's scheduler runs as),
    so that the tasks a thaw wakes do not preempt the caller. Leaves it thawed."""
    freeze, thaw, settle = [], [], []
    old = (os.sched_getscheduler(0), os.sched_getparam(0))
    if realtime:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    try:
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            f.freeze()
            t1 = time.perf_counter_ns()
            while not f.is_frozen():
                time.sleep(0.00002)
            t2 = time.perf_counter_ns()
            f.thaw()
            t3 = time.perf_counter_ns()
            freeze.append(t1 - t0)
            settle.append(t2 - t0)
            thaw.append(t3 - t2)
            time.sleep(pause)
    finally:
        f.thaw()
        if realtime:
            os.sched_setscheduler(0, *old)
    out = {}
    for name, values in (("freeze", freeze), ("thaw", thaw), ("settle", settle)):
        values.sort()
        out[f"{name}_p50_us"] = statistics.median(values) / 1000
        out[f"{name}_p99_us"] = values[min(len(values) - 1, int(len(values) * 0.99))] / 1000
    return out
