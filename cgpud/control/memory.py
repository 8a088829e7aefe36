"""Simulated GPU memory over the socket (docs/memory.md): gpu_alloc,
gpu_free, gpu_meminfo. Open to every process, but each acts only on the
instance whose cgroup holds the caller: allocations belong to the connection
and are returned when it closes, as a CUDA context's memory is when its
process dies."""
from __future__ import annotations

import errno
import logging
import os
import select
from dataclasses import dataclass

from cgpud.control.protocol import Peer, Refused, arg, gpu_arg
from cgpud.core.model import Instance, NotFound, OutOfMemory
from cgpud.sched.cgroupfs import cgroup_mounts, contains, hierarchy_path, read_proc_cgroups

log = logging.getLogger("cgpud")

# Allocations held at once (docs/memory.md): each is an entry the daemon keeps until it is freed or
# its connection closes, whatever its size, so a tenant's one-byte allocations are bounded by count
# too. Past either bound: ENOSPC, nothing allocated.
MAX_HELD_PER_CONN = 1024
MAX_HELD_PER_INSTANCE = 4096  # (over all its connections and GPUs)


class CgroupMounts:
    """The cgroup mounts (cgroupfs.cgroup_mounts), read again only when the daemon's mount table
    changed: the kernel says so through poll on /proc/self/mountinfo (POLLPRI, once per change).
    Every connection's caller is looked up in them (control.callers)."""

    def __init__(self) -> None:
        self.table: list | None = None
        self.poller = None
        try:
            self.f = open("/proc/self/mountinfo", "rb")
            self.poller = select.poll()
            self.poller.register(self.f, select.POLLPRI | select.POLLERR)
            self.poller.poll(0)  # (the table as it is now: read below)
        except OSError:
            self.poller = None

    def __call__(self) -> list:
        if self.poller is None or self.table is None or self.poller.poll(0):
            self.table = cgroup_mounts()
        return self.table


@dataclass(frozen=True)
class Held:
    """Simulated GPU memory one connection allocated: returned when it closes."""

    conn: int
    pid: int
    gpu: int
    name: str
    nbytes: int


class Memory:
    """gpu_alloc, gpu_free, gpu_meminfo: a family of Control's ops (control.server)."""

    OPS = {"gpu_alloc": False, "gpu_free": False, "gpu_meminfo": False}

    def instance_named_by_cgroup(self, pid: int, *, containers_only: bool = False) -> str | None:
        """The instance whose target cgroup holds `pid` (the deepest, if targets
        nest), or None; `containers_only`: only the instances of containers (a
        target with the container's ID, from the hook). OSError/ValueError: the
        pid is gone."""
        cgroups = read_proc_cgroups(pid)
        mounts = None
        best: tuple[int, str] | None = None
        for inst in self.node.instances():
            t = inst.target
            if not t or (containers_only and not t.get("container")):
                continue
            if t.get("kind") == "pgid":
                try:
                    inside = os.getpgid(pid) == t.get("pgid")
                except OSError:
                    inside = False
                depth = 0
            else:
                if mounts is None:
                    if getattr(self, "_mounts", None) is None:
                        self._mounts = CgroupMounts()
                    mounts = self._mounts()
                where = hierarchy_path(t, mounts)
                inside = where is not None and where[0] in cgroups and contains(where[1], cgroups[where[0]])
                depth = len(where[1]) if where is not None else 0
            if inside and (best is None or depth > best[0]):
                best = (depth, inst.name)
        return best[1] if best is not None else None

    def instance_of(self, pid: int, gpu: int | None, known: str | None = None) -> Instance:
        """The instance of `pid` on `gpu` (None: its lowest GPU): the one whose
        target cgroup holds the process (the deepest, if targets nest). A
        process in no instance, or whose instance is not on `gpu`: EPERM.
        `known`: already looked up in this request (a container's, by `admit`)."""
        if pid <= 0:  # SO_PEERCRED says 0 for a process outside our pid namespace
            raise Refused(errno.EPERM, "the calling process is not visible from the daemon's pid namespace")
        try:
            found = known or self.instance_named_by_cgroup(pid)
        except (OSError, ValueError):
            raise Refused(errno.EPERM, f"pid {pid} is gone; GPU memory belongs to a live process") from None
        if found is None:
            try:
                cgroups = read_proc_cgroups(pid)
            except (OSError, ValueError):
                cgroups = {}
            where = cgroups.get("") or cgroups.get("freezer") or "?"
            raise Refused(
                errno.EPERM,
                f"pid {pid} is in no cgpud instance (cgroup {where}): only processes inside an instance "
                "(cgpu run, or a managed container) have simulated GPU memory",
            )
        name = found
        mine = self.node.instances_named(name)
        if gpu is None:
            return mine[0]
        for inst in mine:
            if inst.gpu == gpu:
                return inst
        raise Refused(
            errno.EPERM,
            f"pid {pid} is in instance {name}, which has no share of GPU {gpu} "
            f"(its GPUs: {','.join(str(i.gpu) for i in mine)})",
        )

    def _known(self, peer: Peer) -> str | None:
        """A container's instance, as `admit` found it for the request now running (else None)."""
        return getattr(self, "asking", None) if peer.who.container else None

    def gpu_alloc(self, req: dict, peer: Peer) -> dict:
        """Allocate `bytes` of the caller's instance on `gpu`; ENOMEM past memsize."""
        gpu = gpu_arg(req)
        nbytes = arg(req, "bytes", int)
        if nbytes <= 0:
            raise Refused(errno.EINVAL, f"bytes must be a positive number of bytes, not {nbytes}")
        inst = self.instance_of(peer.pid, gpu, self._known(peer))
        if len(self.held.get(peer.conn, ())) >= MAX_HELD_PER_CONN:
            raise Refused(errno.ENOSPC, f"this connection holds {MAX_HELD_PER_CONN} allocations, the most one may: "
                                        "free some (gpu_free), or allocate fewer, larger ones")
        if self.held_count[inst.name] >= MAX_HELD_PER_INSTANCE:
            raise Refused(errno.ENOSPC, f"instance {inst.name} holds {MAX_HELD_PER_INSTANCE} allocations, the most "
                                        "one may: free some (gpu_free), or allocate fewer, larger ones")
        try:
            self.node.alloc(inst.gpu, inst.name, peer.pid, nbytes)  # OutOfMemory: nothing changed
        except OutOfMemory:
            self.oom_refusals[(inst.gpu, inst.name)] += 1
            raise
        handle = next(self._handles)
        self.hold(handle, Held(peer.conn, peer.pid, inst.gpu, inst.name, nbytes))
        log.debug("pid %d allocated %d bytes of %s on GPU %d (handle %d)", peer.pid, nbytes, inst.name, inst.gpu, handle)
        return {"handle": handle, "gpu": inst.gpu, "instance": inst.name, "bytes": nbytes,
                "free": inst.free, "total": inst.memsize}

    def gpu_free(self, req: dict, peer: Peer) -> dict:
        """Return one allocation this connection made."""
        gpu = gpu_arg(req)
        handle = arg(req, "handle", int)
        h = self.held.get(peer.conn, {}).get(handle)
        if h is None or (gpu is not None and gpu != h.gpu):
            on = f" on GPU {gpu}" if gpu is not None else ""
            raise Refused(errno.ENOENT, f"no allocation {handle}{on} made on this connection")
        self._release(handle, h)
        try:
            inst = self.node.instance(h.gpu, h.name)
        except NotFound:
            return {"gpu": h.gpu, "free": 0, "total": 0}
        return {"gpu": h.gpu, "free": inst.free, "total": inst.memsize}

    def gpu_meminfo(self, req: dict, peer: Peer) -> dict:
        """What the caller's instance sees of its GPU: memsize as the total."""
        inst = self.instance_of(peer.pid, gpu_arg(req), self._known(peer))
        return {"gpu": inst.gpu, "instance": inst.name, "free": inst.free, "total": inst.memsize, "used": inst.used}

    def hold(self, handle: int, h: Held) -> None:
        """Keep an allocation made (here, or by the daemon before a hot upgrade)."""
        self.held.setdefault(h.conn, {})[handle] = h
        self.held_count[h.name] += 1

    def _unhold(self, mine: dict, handle: int) -> None:
        h = mine.pop(handle, None)
        if h is not None:
            self.held_count[h.name] -= 1
            if self.held_count[h.name] <= 0:
                del self.held_count[h.name]

    def _release(self, handle: int, h: Held) -> None:
        mine = self.held.get(h.conn, {})
        self._unhold(mine, handle)
        if not mine:
            self.held.pop(h.conn, None)
        try:
            self.node.free(h.gpu, h.name, h.pid, h.nbytes)
        except NotFound:  # the instance is gone, and its memory with it
            pass

    def disconnected(self, conn: int) -> int:
        """A connection closed (its process exited, was killed, or closed its
        client): everything it allocated is returned. The bytes returned."""
        total = 0
        for handle, h in list(self.held.get(conn, {}).items()):
            self._release(handle, h)
            total += h.nbytes
        if total:
            log.debug("connection %d closed: %d bytes of GPU memory returned", conn, total)
        return total

    def _forget_gone(self) -> None:
        """After any change: allocations of instances that no longer exist are
        forgotten (a new instance of the same name must start empty), and so
        are their out-of-memory counts."""
        for key in [k for k in self.oom_refusals if k[1] not in self.node.gpus[k[0]].instances]:
            del self.oom_refusals[key]
        if not self.held:
            return
        for conn, mine in list(self.held.items()):
            for handle, h in list(mine.items()):
                try:
                    self.node.instance(h.gpu, h.name)
                except NotFound:
                    self._unhold(mine, handle)
            if not mine:
                self.held.pop(conn)
