"""Who a caller is (SPEC §9, docs/security.md "Who is calling"): decided once
per connection, from what the kernel says of the process that connected —
never from its uid alone, never from anything the request says.

- **host**: the connecting process runs in the host's pid and mount
  namespaces (those of pid 1 as the daemon sees it: the node's init, the
  daemon running there or in a hostPID pod) or in the daemon's own, and in
  no container's cgroup. Its uid and groups then say whether it is
  privileged (root or the admin group).
- **container**: any other process — another pid or mount namespace
  (a container, root in it or not), pid 0 (outside the daemon's pid
  namespace), a process whose namespaces cannot be read, or a host-namespace
  process inside the cgroup of a container that cgpud manages. What it may
  do is decided by the instance whose cgroup holds it (control.server).

The process is held by a pidfd (SO_PEERPIDFD, Linux 6.5: the process that
called connect(), not whatever has its pid now; before 6.5, pidfd_open on the
pid, refused when that process started after the connection was accepted):
everything read of /proc/<pid> is read while the pidfd says the process is
alive, so a pid that was reused meanwhile is never mistaken for the caller.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass

SO_PEERPIDFD = 77  # Linux >= 6.5 (asm-generic/socket.h); Python does not name it
TENANT_DIR = "tenant"  # beside the socket: the directory with the containers' socket, all a container is given

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Who:
    """What the kernel says of one connection's caller."""

    container: bool
    why: str  # one line: how it was told (for a refusal), naming nothing but the caller itself
    pidfd: int = -1  # the connecting process (closed with the connection); -1: none (the pid 0 case)
    key: tuple | None = None  # a container's connections are counted by this (its pid namespace)

    def alive(self) -> bool:
        """Whether the process that connected still lives (then /proc/<its pid> is it)."""
        if self.pidfd < 0:
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # (alive, only not ours to signal)
            return True
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self.pidfd >= 0:
            try:
                os.close(self.pidfd)
            except OSError:
                pass


HOST = Who(False, "a process in the host's namespaces")  # (a Peer made without a connection: the daemon's own tests)


def _ns(pid: int | str, kind: str) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/{kind}")
    return st.st_dev, st.st_ino


HOST_NS_PID = "CGPUD_HOST_NS_PID"  # the daemon's environment: a process whose namespaces are the node's too


def host_namespaces() -> set[tuple[tuple[int, int], tuple[int, int]]]:
    """The (pid, mount) namespace pairs that count as the host: pid 1's and the daemon's own, and
    those of the process $CGPUD_HOST_NS_PID names (a node whose container runtime runs in a mount
    namespace of its own: the runtime's hook then calls from there; only who sets the daemon's
    environment, the host's root, can name it)."""
    out = {(_ns("self", "pid"), _ns("self", "mnt"))}
    pids: list[int | str] = [1]
    raw = os.environ.get(HOST_NS_PID, "").strip()
    if raw.isdigit() and int(raw) > 0:
        pids.append(int(raw))
    elif raw:
        logging.getLogger("cgpud.control").warning(
            "%s=%r is not a process id: ignored (only pid 1's namespaces and the daemon's own are the host's)",
            HOST_NS_PID, raw)
    for pid in pids:
        try:
            out.add((_ns(pid, "pid"), _ns(pid, "mnt")))
        except OSError:  # (an unprivileged daemon cannot look at pid 1; a named process that is gone)
            pass
    return out


def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22: starttime, in clock ticks since boot


def _pidfd(sock: socket.socket, pid: int, accepted: float) -> int:
    """The connecting process as a pidfd; -1 if it is gone (or never visible)."""
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        os.set_inheritable(fd, False)  # (never into what the daemon runs: a hot upgrade's next daemon)
        return fd
    except OSError as exc:
        if exc.errno not in (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP):
            return -1  # (ESRCH: it exited already)
    # An older kernel: the pid now, if that process started before the connection was accepted
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return -1
    try:
        if _start_ticks(pid) / _CLK_TCK > accepted:
            os.close(fd)
            return -1
    except (OSError, ValueError, IndexError):
        os.close(fd)
        return -1
    return fd


def classify(sock: socket.socket, pid: int, hosts: set, in_container_group) -> Who:
    """The caller of a connection (`pid`: SO_PEERCRED's). `in_container_group(pid)`:
    whether that process is inside the cgroup of a container cgpud manages."""
    if pid <= 0:
        return Who(True, "the caller is outside the daemon's pid namespace (a container)", key=("outside",))
    accepted = time.clock_gettime(time.CLOCK_BOOTTIME)
    fd = _pidfd(sock, pid, accepted)
    gone = Who(True, f"pid {pid}, which connected, is gone", fd, ("gone",))
    if fd < 0:
        return gone
    try:
        mine = (_ns(pid, "pid"), _ns(pid, "mnt"))
    except OSError:
        return Who(True, f"the namespaces of pid {pid} cannot be read (treated as a container)", fd, ("unread",))
    if mine not in hosts:
        who = Who(True, f"pid {pid} runs in a container (its pid or mount namespace is not the host's)", fd,
                  ("ns",) + mine[0])
    else:
        try:
            grouped = in_container_group(pid)
        except (OSError, ValueError):
            grouped = True  # (gone meanwhile: the alive check below says so)
        who = (Who(True, f"pid {pid} runs in the cgroup of a container", fd, ("ns",) + mine[0]) if grouped
               else Who(False, f"pid {pid} runs on the host", fd))
    if not who.alive():  # what was read may be another process's: the pid was reused
        return gone
    return who
