"""The cgroup file system as the scheduler and the control socket see it:
where the cgroup2 and v1 freezer hierarchies are mounted, which groups a
process is in, what may never be touched (the daemon's own groups and the
processes the guard protects), and groups of our own (`cgpu run`, tests).
Plain synchronous reads of /proc and the cgroup mounts; sched.enforce pauses
and resumes what is found here.
"""
from __future__ import annotations

import errno
import functools
import os
import re
from dataclasses import dataclass

# target kinds, as the model keeps them (Instance.target) and the guard's registry lists them
KIND_CGROUP2 = "cgroup2"
KIND_FREEZER = "cgroup1-freezer"
KIND_SIGNAL = "pgid"
KIND_SIM = "sim"
KIND_GATE = "gate"  # libcgpu's compute gate in a container's pages (cgpud.sched.gate)

# errno of a pwrite on a control file whose group was removed (ENODEV), of an
# open in a vanished directory (ENOENT), of a signal to nobody (ESRCH)
_GONE = (errno.ENODEV, errno.ENOENT, errno.ESRCH)


class EnforceError(Exception):
    """Base of this module's errors."""


class Refused(EnforceError):
    """This target may not be frozen; nothing was done."""


class TargetGone(EnforceError):
    """The target does not exist (any more): cgroup removed, process group empty."""


# ---- where the hierarchies are ------------------------------------------------------


@dataclass(frozen=True)
class Hierarchy:
    kind: str   # KIND_CGROUP2 or KIND_FREEZER
    mount: str  # where it is mounted, e.g. /sys/fs/cgroup/unified
    root: str   # the group shown at the mount's top (mountinfo's 4th field), usually "/"
    control: str  # the file that freezes a group of it
    freeze_value: bytes
    thaw_value: bytes

    def directory(self, cgpath: str) -> str | None:
        """The directory of a group named as /proc/PID/cgroup names it, or None
        if this mount does not show that group."""
        if self.root != "/":
            if cgpath != self.root and not cgpath.startswith(self.root + "/"):
                return None
            cgpath = cgpath[len(self.root):] or "/"
        return self.mount if cgpath == "/" else self.mount + cgpath

    def holds(self, real: str) -> bool:
        """Whether an absolute, resolved path is this mount or below it."""
        return real == self.mount or real.startswith(self.mount + "/")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@functools.cache
def hierarchies() -> dict[str, Hierarchy]:
    """The mounted cgroup2 hierarchy and v1 freezer hierarchy, by kind (the
    first mount of each, from /proc/self/mountinfo)."""
    found: dict[str, Hierarchy] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 5 or len(rfields) < 3:
                continue
            root, mount = _unescape(fields[3]), _unescape(fields[4])
            fstype, superopts = rfields[0], rfields[2].split(",")
            if fstype == "cgroup2" and KIND_CGROUP2 not in found:
                found[KIND_CGROUP2] = Hierarchy(KIND_CGROUP2, mount, root, "cgroup.freeze", b"1", b"0")
            elif fstype == "cgroup" and "freezer" in superopts and KIND_FREEZER not in found:
                found[KIND_FREEZER] = Hierarchy(KIND_FREEZER, mount, root, "freezer.state", b"FROZEN", b"THAWED")
    return found


@dataclass(frozen=True)
class ProcCgroups:
    """A process's own groups, as directories (None: no such hierarchy mounted,
    or the group is not visible through its mount)."""
    pid: int
    v2: str | None
    freezer: str | None


def proc_cgroups(pid: int | str = "self") -> ProcCgroups:
    """Where `pid` is, from /proc/PID/cgroup. Raises TargetGone if there is no
    such process."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise TargetGone(f"no process {pid}") from None
    hs = hierarchies()
    v2 = v1 = None
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, cgpath = rest.partition(":")
        if hid == "0" and controllers == "" and KIND_CGROUP2 in hs:
            v2 = hs[KIND_CGROUP2].directory(cgpath)
        elif "freezer" in controllers.split(",") and KIND_FREEZER in hs:
            v1 = hs[KIND_FREEZER].directory(cgpath)
    return ProcCgroups(os.getpid() if pid == "self" else int(pid), v2, v1)


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 (state) on: [0] state, [2] pgrp, [11] utime,
    [12] stime, [19] starttime (clock ticks). Raises TargetGone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise TargetGone(f"no process {pid}") from None
    return data.rpartition(b")")[2].decode().split()


def _start_time(pid: int) -> int | None:
    try:
        return int(stat_fields(pid)[19])
    except TargetGone:
        return None


# ---- what may be touched -------------------------------------------------------------

_protected: set[int] = set()


def protect_pid(pid: int) -> None:
    """Never freeze a group or process group that holds `pid` (the guard)."""
    _protected.add(pid)


def unprotect_pid(pid: int) -> None:
    _protected.discard(pid)


def protected_pids() -> set[int]:
    return {os.getpid(), *_protected}


def _who(pid: int) -> str:
    return "the daemon itself" if pid == os.getpid() else f"protected process {pid}"


def _locate(path: str, kind: str) -> tuple[Hierarchy, str]:
    """(hierarchy, resolved path) of a group that may be named in a target;
    Refused for the root or a path outside the hierarchy, TargetGone if the
    group does not exist."""
    h = hierarchies().get(kind)
    if h is None:
        raise Refused(f"no {kind} hierarchy is mounted")
    real = os.path.realpath(path)
    if real == h.mount:
        raise Refused(f"{real} is the root of the {kind} hierarchy: never frozen")
    if not h.holds(real):
        raise Refused(f"{path} is not a group of the {kind} hierarchy at {h.mount}")
    if not os.path.isdir(real):
        raise TargetGone(f"{real}: no such group")
    if not os.path.exists(os.path.join(real, h.control)):
        raise Refused(f"{real} has no {h.control}")
    return h, real


def _refuse_protected_group(real: str, kind: str) -> None:
    for pid in sorted(protected_pids()):
        try:
            pc = proc_cgroups(pid)
        except TargetGone:
            continue
        own = pc.v2 if kind == KIND_CGROUP2 else pc.freezer
        if own is not None and (own == real or own.startswith(real + "/")):
            raise Refused(f"{real} holds {_who(pid)} (in {own}): never frozen")


def _refuse_protected_pgid(pgid: int) -> None:
    if pgid <= 1:
        raise Refused(f"process group {pgid}: never signalled")
    for pid in sorted(protected_pids()):
        try:
            if os.getpgid(pid) == pgid:
                raise Refused(f"process group {pgid} holds {_who(pid)}: never stopped")
        except ProcessLookupError:
            continue


# ---- groups of our own (cgpu run, tests) ----------------------------------------------


def create_cgroup(path: str) -> str:
    """Make a group (its parent must exist) in the cgroup2 or freezer
    hierarchy; returns its resolved path."""
    real = os.path.realpath(path)
    if not any(h.holds(real) and real != h.mount for h in hierarchies().values()):
        raise Refused(f"{path} is not below a cgroup2 or v1 freezer mount")
    os.mkdir(real)
    return real


def join_cgroup(path: str, pid: int = 0) -> None:
    """Move `pid` (0: the caller) into a group. Usable as a preexec_fn:
    `preexec_fn=lambda: join_cgroup(path)`."""
    fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(pid).encode())
    finally:
        os.close(fd)


def cgroup_pids(path: str) -> list[int]:
    """The processes of a group and of the groups below it."""
    out: list[int] = []
    try:
        with open(os.path.join(path, "cgroup.procs"), "rb") as f:
            out.extend(int(x) for x in f.read().split())
        with os.scandir(path) as entries:
            subdirs = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, OSError) as exc:
        if isinstance(exc, FileNotFoundError) or exc.errno in _GONE:
            return out
        raise
    for sub in subdirs:
        out.extend(cgroup_pids(sub))
    return out


def _subgroups_deepest_first(path: str) -> list[str]:
    out = []
    for dirpath, dirnames, _ in os.walk(path):
        out.extend(os.path.join(dirpath, d) for d in dirnames)
    return sorted(out, key=lambda p: p.count("/"), reverse=True)


# ---- every cgroup mount (the control socket: which instance holds a process) ----------
#
# Unlike `hierarchies()` (the first mount of each kind, what the scheduler
# freezes through), these look at every cgroup mount: a target may be named
# through any of them.


def cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, fstype, super options) per cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((_unescape(fields[4]), _unescape(fields[3]), rfields[0], set(rfields[2].split(","))))
    return out


def hierarchy_path(target: dict, mounts) -> tuple[str, str] | None:
    """A cgroup target as (hierarchy, path inside it) — `("", "/cgpud/x")` for
    cgroup2, `("freezer", …)` for a v1 freezer group — comparable with the
    lines of /proc/<pid>/cgroup. None when no mount holds it."""
    kind, path = target.get("kind"), target.get("path")
    if not isinstance(path, str):
        return None
    best = None
    for mnt, root, fstype, opts in mounts:
        if kind == "cgroup2" and fstype != "cgroup2":
            continue
        if kind == "cgroup1-freezer" and not (fstype == "cgroup" and "freezer" in opts):
            continue
        if path == mnt or path.startswith(mnt.rstrip("/") + "/"):
            if best is None or len(mnt) > len(best[0]):
                best = (mnt, root)
    if best is None:
        return None
    mnt, root = best
    rel = path[len(mnt.rstrip("/")):]
    inside = (root.rstrip("/") + rel) or "/"
    return ("" if kind == "cgroup2" else "freezer", inside)


def read_proc_cgroups(pid: int) -> dict[str, str]:
    """/proc/<pid>/cgroup as {hierarchy: path}: "" for cgroup2, each v1 controller by name."""
    out: dict[str, str] = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def contains(group: str, path: str) -> bool:
    return path == group or path.startswith(group.rstrip("/") + "/")
