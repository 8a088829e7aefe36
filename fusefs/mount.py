"""Mounting: the checks around it (serving is fusefs.handover.FuseServer).

A crashed FUSE daemon leaves a dead mount behind: every access answers
ENOTCONN and `os.path.ismount` says False. We look in /proc/self/mountinfo
instead, and clear such a mount with `fusermount3 -uz` (or a lazy umount).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("fusefs")


class MountError(Exception):
    """A mount cannot be made; the message says why and what to do."""


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 0 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def find_mount(path: str, mountinfo: str = "/proc/self/mountinfo") -> MountInfo | None:
    """The mount whose mount point is exactly `path` (the last one wins)."""
    path = os.path.abspath(path)
    found = None
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rfields = right.split()
            if len(fields) >= 5 and len(rfields) >= 2 and _unescape(fields[4]) == path:
                found = MountInfo(path, rfields[0], rfields[1])
    return found


def is_dead(path: str) -> bool:
    # statfs always reaches the daemon; stat may be answered from the kernel's
    # attribute cache even after the daemon has died.
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def unmount(path: str, lazy: bool = True) -> None:
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        cmd = [tool, "-u"] + (["-z"] if lazy else []) + [path]
    else:
        cmd = ["umount"] + (["-l"] if lazy else []) + [path]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise MountError(f"could not unmount {path}: {res.stderr.strip() or res.returncode}")


def prepare_mountpoint(path: str, fsname: str) -> None:
    """Make `path` ready to mount on: create it, clear a dead mount of ours,
    refuse one that is alive."""
    if not os.path.exists("/dev/fuse"):
        raise MountError(
            "/dev/fuse is missing: load the fuse module (modprobe fuse), "
            "or give the container the device (--device /dev/fuse)"
        )
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise MountError("/dev/fuse is not readable and writable by this user: run as root or fix its mode")
    m = find_mount(path)
    if m is not None:
        if m.fstype.startswith("fuse") and is_dead(path):
            log.warning("clearing a dead mount at %s (left by a daemon that crashed)", path)
            unmount(path, lazy=True)
        elif m.fstype.startswith("fuse") and m.source == fsname:
            raise MountError(
                f"{path} is already served by a running daemon ({m.source}): stop it first, or choose another --mount"
            )
        elif not m.fstype.startswith("fuse") and os.path.isdir(path) and not os.listdir(path):
            # an empty directory mounted there: a container's volume (the DaemonSet's hostPath of the
            # tree, mounted with Bidirectional propagation): the tree goes on top of it, hiding nothing
            log.info("mounting over the empty %s mount at %s (a container's volume)", m.fstype, path)
        else:
            raise MountError(f"{path} is already a mount point ({m.fstype} {m.source}) with files in it: "
                             "choose another --mount")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise MountError(f"cannot create mount point {path}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise MountError(f"mount point {path} is not a directory")


def allow_other_permitted() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def options(fsname: str, allow_other: bool = True) -> set[str]:
    opts = {"default_permissions", f"fsname={fsname}", "subtype=cgpud"}
    if allow_other:
        opts.add("allow_other")
    return opts
