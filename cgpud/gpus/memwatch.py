"""Memory isolation on real GPUs (SPEC §3): the memory watchdog.

The driver, not cgpud, hands out GPU memory on a real GPU, and nothing in
user space can make one `cudaMalloc` fail. So every `period` seconds the
watchdog asks NVML which processes use each GPU and how much
(nvmlDeviceGetComputeRunningProcesses), maps each process to its instance by
the process's cgroup (the same mapping as the control socket's), and when an
instance's processes together pass its `memsize` it fails the process that
passed it — the one that grew most since the last look, then the largest,
until what is left fits:

- `kill` (default): SIGKILL, as the seeds say ("forces the pod that exceeds
  its request to fail"); `term`: SIGTERM, once per process; `log`: only says so.
- Every event is logged with the instance, GPU, memsize, the process and its
  memory, and what was done; `over[(gpu, name)]` counts the processes found
  past the limit, `kills[(gpu, name)]` those signalled (for metrics).
- The signal goes through a pidfd opened before the process's cgroup is
  checked once more, so a pid reused meanwhile is never hit.

Each look also replaces every instance's process table (`Instance.procs`:
`meminfo` on the tree, `query`) with what the driver reports, and keeps the
latest `samples` (per-GPU memory and utilisation). NVML calls run in a worker
thread: they may take milliseconds and must not delay the schedulers.

An instance whose processes carry libcgpu (docs/isolation.md) also says what
it holds, in its usage page: each look reads it (`library`), keeps it as
`Instance.library_used`, and the larger of the two views is what the
instance uses (`meminfo`'s Free). NVML's view alone decides whom to fail: the
page is the container's to write, the driver's count is not.

Between two looks an instance can be over its limit for up to `period`
seconds; memory outside NVML's view (unified memory, processes in another pid
namespace than the daemon's) is not seen. docs/gpus.md says more.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable, Sequence

import trio

from cgpud.gpus.nvml import GpuSample, Nvml, NvmlError
from cgpud.core.model import Instance, Node

log = logging.getLogger("cgpud")

ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "log": None}
DEFAULT_PERIOD = 0.5

Owner = Callable[[int, int], "Instance | None"]  # (pid, gpu) -> the instance whose cgroup holds pid


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class MemWatchdog:
    def __init__(self, node: Node, owner: Owner, action: str = "kill", period: float = DEFAULT_PERIOD,
                 look: Callable[[], tuple[list[GpuSample], list[NvmlError]]] | None = None,
                 library: Callable[[Instance], int | None] | None = None) -> None:
        if action not in ACTIONS:
            raise ValueError(f"memory action {action!r}: expected one of {', '.join(ACTIONS)}")
        self.node = node
        self.owner = owner
        self.action = action
        self.period = period
        self._look = look
        # what an instance's in-container library says it holds (its usage page), None without one
        self._library = library
        self._with_library: set[tuple[int, str]] = set()  # (gpu, instance) whose page answered at the last look
        self.samples: list[GpuSample] = []
        self.over: dict[tuple[int, str], int] = {}   # processes found past their instance's memsize
        self.kills: dict[tuple[int, str], int] = {}  # of them, those signalled (kill/term)
        self._last: dict[tuple[int, int], int] = {}  # (gpu, pid) -> bytes at the previous look
        self._acted: set[tuple[int, int]] = set()    # (gpu, pid) already failed (once per process)
        self._errors: set[str] = set()  # the NVML failures logged and not yet over

    # ---- one look ------------------------------------------------------------

    def check(self, samples: Sequence[GpuSample]) -> list[tuple[int, str, int]]:
        """Apply one look at the GPUs; the processes failed, as (gpu, instance, pid)."""
        failed = []
        self._with_library = with_library = set()
        now_over: set[tuple[int, int]] = set()  # the processes of instances past their memsize now
        for s in samples:
            try:
                gpu = self.node.gpu(s.index)
            except Exception:
                continue
            mine: dict[str, dict[int, int]] = {}
            for pid, nbytes in s.procs.items():
                inst = self.owner(pid, s.index)
                if inst is not None:
                    mine.setdefault(inst.name, {})[pid] = nbytes
            for inst in gpu.instances.values():
                inst.procs = mine.get(inst.name, {})
                held = self._library(inst) if self._library is not None else None
                inst.library_used = held or 0
                if held is not None:
                    with_library.add((inst.gpu, inst.name))
            for name, procs in mine.items():
                inst = gpu.instances.get(name)
                if inst is None:
                    continue
                excess = sum(procs.values()) - inst.memsize
                if excess <= 0:
                    continue
                now_over.update((s.index, p) for p in procs)
                # Those failed already are on their way out: their memory is as good as back.
                excess -= sum(n for p, n in procs.items() if (s.index, p) in self._acted)
                grew = {p: n - self._last.get((s.index, p), 0) for p, n in procs.items()}
                for pid in sorted(procs, key=lambda p: (-grew[p], -procs[p], p)):
                    if excess <= 0:
                        break
                    if (s.index, pid) in self._acted:
                        continue
                    excess -= procs[pid]
                    self._acted.add((s.index, pid))
                    self._fail(inst, pid, procs)
                    failed.append((s.index, name, pid))
        self._last = {(s.index, p): n for s in samples for p, n in s.procs.items()}
        self._acted &= now_over  # back under its limit (or gone): a new excess is a new event
        self.samples = list(samples)
        return failed

    def _fail(self, inst: Instance, pid: int, procs: dict[int, int]) -> None:
        key = (inst.gpu, inst.name)
        self.over[key] = self.over.get(key, 0) + 1
        what = (f"memory watchdog: {inst.name} on GPU {inst.gpu} uses {sum(procs.values())} bytes, past its memsize "
                f"{inst.memsize}: pid {pid} ({_comm(pid)}) holds {procs[pid]} bytes")
        if (inst.gpu, inst.name) in self._with_library:
            what += (f" (its in-container library accounts for {inst.library_used}: the rest went around it — "
                     "a process without libcgpu, raw ioctls — or is the driver's own, its contexts)")
        sig = ACTIONS[self.action]
        if sig is None:
            log.warning("%s; left running (--mem-action log)", what)
            return
        done = self._signal(pid, inst, sig)
        if done is None:
            self.kills[key] = self.kills.get(key, 0) + 1
            log.warning("%s; %s sent (--mem-action %s)", what, sig.name, self.action)
        else:
            log.warning("%s; not signalled: %s", what, done)

    def _signal(self, pid: int, inst: Instance, sig: int) -> str | None:
        """Signal pid if it is still in `inst`; None when sent, else why not."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "it is gone already"
        except OSError as exc:
            return f"pidfd_open: {exc.strerror}"
        try:
            again = self.owner(pid, inst.gpu)
            if again is None or again.name != inst.name:
                return "it is no longer in the instance"
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return "it is gone already"
        except OSError as exc:
            return f"{exc.strerror}"
        finally:
            os.close(fd)
        return None

    # ---- service ---------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        nv = None
        look = self._look
        if look is None:
            nv = Nvml()
            await trio.to_thread.run_sync(nv.open)  # NvmlError: the caller's start fails with its line
            look = nv.look
        log.info("memory watchdog: every %.2g s, action %s past memsize", self.period, self.action)
        task_status.started()
        try:
            while True:
                samples, errors = await trio.to_thread.run_sync(look)
                self.note_errors(errors)
                self.check(samples)
                await trio.sleep(self.period)
        finally:
            if nv is not None:
                nv.close()

    def note_errors(self, errors: Sequence[NvmlError]) -> None:
        """Log each NVML failure once while it lasts (a GPU that does not answer
        is not watched; the others are), and when it is over."""
        now = {str(e) for e in errors}
        for e in sorted(now - self._errors):
            log.error("memory watchdog: %s (memory limits on that GPU are not enforced until NVML answers)", e)
        if self._errors - now:
            log.info("memory watchdog: NVML answers again (%s)", "; ".join(sorted(self._errors - now)))
        self._errors = now
