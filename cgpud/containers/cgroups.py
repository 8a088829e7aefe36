"""Cgroups the daemon creates for `cgpu run` instances, and nothing else.

Every group made here lives under one parent the daemon owns: `cgpud/` in the
cgroup2 tree (preferred: `cgroup.freeze`), else in the v1 freezer hierarchy.
Groups made by others (containers, systemd) are never created or removed here.
"""
from __future__ import annotations

import errno
import os
import time

from fusefs.mount import _unescape

PARENT = "cgpud"


class CgroupError(Exception):
    pass


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) for every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((_unescape(fields[4]), rfields[0], rfields[2]))
    return out


def remove_when_empty(paths, timeout: float, step: float = 0.05) -> set[str]:
    """rmdir each group once its processes are gone, for up to `timeout`
    seconds (a group already gone counts as removed). What is left."""
    left = set(paths)
    deadline = time.monotonic() + timeout
    while left:
        for path in list(left):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue  # still populated: its processes are on their way out
            left.discard(path)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(step)
    return left


def v2_root() -> str | None:
    for mnt, fstype, _ in _mounts():
        if fstype == "cgroup2":
            return mnt
    return None


def v1_freezer_root() -> str | None:
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup" and "freezer" in opts.split(","):
            return mnt
    return None


class InstanceGroups:
    """Create and remove per-instance groups under the daemon's own parent."""

    def __init__(self, base: str | None = None) -> None:
        if base is None:
            root = v2_root()
            if root is not None:
                base, self.kind = os.path.join(root, PARENT), "cgroup2"
            else:
                root = v1_freezer_root()
                if root is None:
                    raise CgroupError("no cgroup2 tree and no v1 freezer hierarchy is mounted")
                base, self.kind = os.path.join(root, PARENT), "cgroup1-freezer"
        else:
            self.kind = "cgroup2" if os.path.exists(os.path.join(os.path.dirname(base), "cgroup.controllers")) else "cgroup1-freezer"
        self.base = base

    def path(self, name: str) -> str:
        return os.path.join(self.base, name)

    def create(self, name: str) -> str:
        os.makedirs(self.base, exist_ok=True)
        p = self.path(name)
        try:
            os.mkdir(p)
        except FileExistsError:
            if self.populated(p):
                raise CgroupError(f"cgroup {p} exists and holds processes") from None
        return p

    def populated(self, path: str) -> bool:
        if self.kind == "cgroup2":
            try:
                with open(os.path.join(path, "cgroup.events")) as f:
                    return any(line.strip() == "populated 1" for line in f)
            except FileNotFoundError:
                return False
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return bool(f.read().strip())
        except FileNotFoundError:
            return False

    def remove(self, path: str) -> bool:
        """rmdir the group; False while it still holds processes."""
        if not path.startswith(self.base + os.sep):
            raise CgroupError(f"refusing to remove {path}: not one of ours")
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise
        return True
