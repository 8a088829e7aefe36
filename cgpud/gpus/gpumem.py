"""Simulated GPU memory, as a process inside an instance sees it (docs/memory.md).

A `SimGpu` is one connection to the daemon: the process's "CUDA context" on
one GPU. What it allocates is counted in its instance's `meminfo` under this
process's pid, may not pass the instance's `memsize`, and is returned when the
context is closed — or when the process exits or is killed, since the daemon
sees the connection close.

    from cgpud.gpus.gpumem import SimGpu, OutOfMemoryError

    with SimGpu() as gpu:                 # GPU from $CGPU_GPUS (set by `cgpu run`)
        free, total = gpu.mem_info()      # total is the instance's memsize
        a = gpu.alloc(1 << 30)
        ...
        gpu.free(a)

The process is identified by the daemon through the socket's peer credentials
(the pid that opened the connection), and its instance by the cgroup that pid
is in. Create the SimGpu in the process that uses it (after a fork, the child's
memory would be counted under the parent's pid).
"""
from __future__ import annotations

import errno
import os
import socket as _socket
from dataclasses import dataclass

from cgpud.client import Client, ControlError, DaemonUnavailable

__all__ = ["SimGpu", "Allocation", "MemInfo", "OutOfMemoryError", "NotInInstanceError",
           "ControlError", "DaemonUnavailable"]


class OutOfMemoryError(MemoryError):
    """The allocation would pass the instance's memsize; nothing was allocated."""

    errno = errno.ENOMEM


class NotInInstanceError(PermissionError):
    """The calling process is in no instance (or its instance is not on that GPU)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPERM, message)

    def __str__(self) -> str:
        return self.strerror


@dataclass(frozen=True)
class Allocation:
    handle: int
    nbytes: int
    gpu: int


@dataclass(frozen=True)
class MemInfo:
    gpu: int
    instance: str
    free: int
    total: int  # the instance's memsize
    used: int  # by all processes of the instance on this GPU


def default_gpu() -> int | None:
    """The first GPU of $CGPU_GPUS (set by `cgpu run`); None lets the daemon
    choose the lowest GPU of the caller's instance."""
    first = os.environ.get("CGPU_GPUS", "").split(",")[0].strip()
    return int(first) if first.isdigit() else None


class SimGpu:
    """One context on one simulated GPU: `alloc`, `free`, `mem_info`, `close`."""

    def __init__(self, gpu: int | None = None, socket: str | None = None) -> None:
        self.gpu = gpu if gpu is not None else default_gpu()
        self._client = Client(socket)  # DaemonUnavailable when no daemon answers
        self._live: dict[int, Allocation] = {}

    def _call(self, op: str, **args) -> dict:
        if self._client is None:
            raise ValueError("this SimGpu is closed")
        try:
            res = self._client.call(op, gpu=self.gpu, **args)
        except ControlError as exc:
            if exc.error == "ENOMEM":
                raise OutOfMemoryError(str(exc)) from None
            if exc.error == "EPERM":
                raise NotInInstanceError(str(exc)) from None
            raise
        if self.gpu is None and isinstance(res.get("gpu"), int):
            self.gpu = res["gpu"]  # the daemon chose: keep to it
        return res

    def alloc(self, nbytes: int) -> Allocation:
        """Allocate `nbytes` (> 0). OutOfMemoryError past the instance's memsize."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"an allocation is a positive number of bytes, not {nbytes!r}")
        res = self._call("gpu_alloc", bytes=nbytes)
        a = Allocation(res["handle"], nbytes, res["gpu"])
        self._live[a.handle] = a
        return a

    def free(self, a: Allocation) -> None:
        """Return one allocation made through this context."""
        if self._live.get(a.handle) != a:
            raise ValueError(f"allocation {a.handle} is not held by this context (freed twice?)")
        self._call("gpu_free", handle=a.handle)
        del self._live[a.handle]

    def info(self) -> MemInfo:
        res = self._call("gpu_meminfo")
        return MemInfo(res["gpu"], res["instance"], res["free"], res["total"], res["used"])

    def mem_info(self) -> tuple[int, int]:
        """(free, total) as cudaMemGetInfo gives them: total is the memsize."""
        i = self.info()
        return i.free, i.total

    @property
    def allocated(self) -> int:
        """Bytes this context holds."""
        return sum(a.nbytes for a in self._live.values())

    def close(self) -> None:
        """Close the context: the daemon returns everything it holds, and has
        done so when this returns (it closes its end only after that)."""
        c, self._client = self._client, None
        if c is None:
            return
        self._live.clear()
        try:
            c.sock.shutdown(_socket.SHUT_WR)
            while c.sock.recv(4096):  # every answer was read already: this waits for EOF
                pass
        except OSError:  # the daemon is gone: so is the memory
            pass
        finally:
            c.close()

    def __enter__(self) -> "SimGpu":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
