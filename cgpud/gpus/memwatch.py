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
instance uses (`meminfo`'s Free). NVML's view decides whom to fail: the page
is the container's to write, the driver's count is not.

Each look also gives back what dead processes' slots held (pages.reclaim_dead: a
slot whose liveness lock is gone, in a page whose processes take one), so a
SIGKILLed process's charge does not wait for a sibling's next call.

The driver's own memory grows after a context is made, through no call
libcgpu sees (lazily loaded modules, library handles, graphs: docs/memory.md).
So each look also writes NVML's figure for every process that has a slot in
its instance's page into that slot (`page`), with what the slot had allocated
just before NVML was read: libcgpu charges the difference. And it tells that
growth from memory that went around the library: a process went through
libcgpu when it has a slot whose charge its NVML figure passes by no more than
the growth allowance (`allowance`: 256 MiB or 3 % of memsize, the larger). An
instance past memsize by at most the allowance whose processes all went
through libcgpu has nothing failed — libcgpu refuses their next allocation
instead; otherwise those that went around it (no slot: LD_PRELOAD unset, a
static binary; or past the allowance) are failed first. The log says which it
was. The page being the container's to write, what it says buys the instance
at most the allowance past memsize, never more.

Between two looks an instance can be over its limit for up to `period`
seconds; memory outside NVML's view (unified memory, processes in another pid
namespace than the daemon's) is not seen. docs/gpus.md says more.
"""
from __future__ import annotations

import logging
import os
import signal
import struct
from typing import Callable, Sequence

import trio

from cgpud.gpus import pages
from cgpud.gpus.nvml import GpuSample, Nvml, NvmlError
from cgpud.core.model import Instance, Node

log = logging.getLogger("cgpud")

ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "log": None}
DEFAULT_PERIOD = 0.5

Owner = Callable[[int, int], "Instance | None"]  # (pid, gpu) -> the instance whose cgroup holds pid
Page = Callable[[Instance], "tuple[str, int] | None"]  # the instance's usage page directory, its GPU's index there
GROWTH_ALLOWANCE = 256 << 20  # bytes: the driver's growth past libcgpu's account that is left to libcgpu


def allowance(memsize: int) -> int:
    """How far NVML's figure for a process through libcgpu may pass what libcgpu charges it before the
    rest is taken as memory that went around the library: the largest growth of the driver's memory
    between two looks seen on an H100 was 162 MiB (a captured graph after a fill, issue 28)."""
    return max(GROWTH_ALLOWANCE, memsize * 3 // 100)


def ns_pid(pid: int) -> int:
    """The pid in its own (innermost) PID namespace, as its slot in the page names it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return pid


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class MemWatchdog:
    def __init__(self, node: Node, owner: Owner, action: str = "kill", period: float = DEFAULT_PERIOD,
                 look: Callable[[], tuple[list[GpuSample], list[NvmlError]]] | None = None,
                 library: Callable[[Instance], int | None] | None = None, page: Page | None = None) -> None:
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
        self._page = page
        # (gpu, instance) -> (page directory, the GPU's index there, {slot pid: Slot}) read just before NVML
        self._slots: dict[tuple[int, str], tuple[str, int, dict]] = {}
        self._grown: set[tuple[int, int]] = set()  # (gpu, pid) logged as grown within the allowance
        self.samples: list[GpuSample] = []
        self.over: dict[tuple[int, str], int] = {}   # processes found past their instance's memsize
        self.kills: dict[tuple[int, str], int] = {}  # of them, those signalled (kill/term)
        self._last: dict[tuple[int, int], int] = {}  # (gpu, pid) -> bytes at the previous look
        self._charged_before: dict[tuple[int, int], int] = {}  # (gpu, pid) -> libcgpu's charge at the previous look
        self._acted: set[tuple[int, int]] = set()    # (gpu, pid) already failed (once per process)
        self._errors: set[str] = set()  # the NVML failures logged and not yet over

    # ---- one look ------------------------------------------------------------

    def check(self, samples: Sequence[GpuSample], slots: dict | None = None) -> list[tuple[int, str, int]]:
        """Apply one look at the GPUs; the processes failed, as (gpu, instance, pid). `slots`: the
        instances' page slots read just before NVML was (snapshot()); None: read now."""
        self._slots = self.snapshot(self.page_targets()) if slots is None else slots
        failed = []
        grown_now: set[tuple[int, int]] = set()
        self._with_library = with_library = set()
        now_over: set[tuple[int, int]] = set()  # the processes of instances past their memsize now
        seen_charged: dict[tuple[int, int], int] = {}
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
                if held is not None and not 0 <= held <= gpu.info.memory:
                    held = None  # (past the card: a damaged page, not a figure; the GPU's `used` sums it)
                inst.library_used = held or 0
                if held is not None:
                    with_library.add((inst.gpu, inst.name))
            for name, procs in mine.items():
                inst = gpu.instances.get(name)
                if inst is None:
                    continue
                charged = self._charged(inst, procs)  # pid -> what libcgpu charges it (those with a slot)
                # NVML's figure comes a little after the driver call that changed it: memory freed (and
                # refunded in the slot) just before this look may still be in it. What a process is judged
                # by is the larger of its charge now and at the previous look (a lag under the period).
                seen_charged.update({(s.index, p): c for p, c in charged.items()})
                charged = {p: max(c, self._charged_before.get((s.index, p), 0)) for p, c in charged.items()}
                self._tell_library(inst, procs)
                excess = sum(procs.values()) - inst.memsize
                if excess <= 0:
                    continue
                now_over.update((s.index, p) for p in procs)
                # Those failed already are on their way out: their memory is as good as back.
                excess -= sum(n for p, n in procs.items() if (s.index, p) in self._acted)
                # The driver's growth past what libcgpu charges, within the allowance: libcgpu is told
                # (the reading above) and refuses what comes next; no process is failed for it while every
                # process left went through libcgpu. Those that went around it are failed first. The page
                # is the container's to write: what it says buys at most the allowance past memsize.
                allow = allowance(inst.memsize)
                # through libcgpu: what NVML sees of it passes what libcgpu charges by the allowance at most
                # (the growth not charged yet; once charged, none)
                through = {p for p, c in charged.items() if procs[p] - c <= allow}

                def tolerated(excess: int, left: set[int]) -> bool:  # all that is left went through libcgpu
                    return excess <= allow and all(p in through for p in left)
                left = {p for p in procs if (s.index, p) not in self._acted}
                if tolerated(excess, left):
                    for pid in through:
                        grown_now.add((s.index, pid))
                        if (s.index, pid) not in self._grown:
                            log.warning("memory watchdog: %s on GPU %d uses %d bytes, past its memsize %d: pid %d (%s)"
                                        " went through libcgpu: NVML says %d bytes, libcgpu charges %d; the driver's "
                                        "own growth, %d bytes past memsize, within the allowance %d, is charged to it: "
                                        "left running, its next allocation fails", inst.name, inst.gpu,
                                        sum(procs.values()), inst.memsize, pid, _comm(pid), procs[pid], charged[pid],
                                        excess, allow)
                    continue
                grew = {p: n - self._last.get((s.index, p), 0) for p, n in procs.items()}
                for pid in sorted(procs, key=lambda p: (p in through, -grew[p], -procs[p], p)):
                    if excess <= 0 or tolerated(excess, left):
                        break
                    if (s.index, pid) in self._acted:
                        continue
                    excess -= procs[pid]
                    left.discard(pid)
                    self._acted.add((s.index, pid))
                    self._fail(inst, pid, procs, charged.get(pid))
                    failed.append((s.index, name, pid))
        self._last = {(s.index, p): n for s in samples for p, n in s.procs.items()}
        self._charged_before = seen_charged
        self._acted &= now_over  # back under its limit (or gone): a new excess is a new event
        self._grown = grown_now & now_over
        self.samples = list(samples)
        return failed

    def _fail(self, inst: Instance, pid: int, procs: dict[int, int], charged: int | None = None) -> None:
        key = (inst.gpu, inst.name)
        self.over[key] = self.over.get(key, 0) + 1
        what = (f"memory watchdog: {inst.name} on GPU {inst.gpu} uses {sum(procs.values())} bytes, past its memsize "
                f"{inst.memsize}: pid {pid} ({_comm(pid)}) holds {procs[pid]} bytes")
        if charged is not None and procs[pid] - charged > allowance(inst.memsize):
            what += (f"; it went around the library: libcgpu charges it {charged}, {procs[pid] - charged} bytes less, "
                     f"more than the driver's growth allowance {allowance(inst.memsize)} (raw ioctls, an unwrapped "
                     "allocator)")
        elif charged is not None:
            what += (f"; the instance is past memsize by more than the driver's growth allowance "
                     f"{allowance(inst.memsize)} (its slot in the page says libcgpu charges it {charged})")
        elif (inst.gpu, inst.name) in self._slots:
            what += ("; it went around the library: it has no slot in the instance's page (LD_PRELOAD unset, "
                     "a static binary)")
        elif (inst.gpu, inst.name) in self._with_library:
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

    # ---- the instances' pages: the driver's readings ------------------------------

    def page_targets(self) -> list[tuple[int, str, str, int]]:
        """(gpu, instance, page directory, the GPU's index in the page) of every instance with a page."""
        out = []
        if self._page is None:
            return out
        for gpu in self.node.gpus:
            for inst in list(gpu.instances.values()):
                where = self._page(inst)
                if where is not None:
                    out.append((inst.gpu, inst.name, *where))
        return out

    @staticmethod
    def snapshot(targets: Sequence[tuple[int, str, str, int]]) -> dict:
        """The process slots of each page, read (in the look's worker thread) just before NVML is."""
        out = {}
        for gpu, name, where, index in targets:
            try:
                for k, pid, held in pages.reclaim_dead(where):
                    log.info("memory watchdog: %s: the slot of pid %d (in the container) is dead (its liveness lock "
                             "is gone: the process ended, was killed, or exec'd): the %d bytes it held are given "
                             "back to the instance", name, pid, sum(held))
                slots, readings = pages.slots(where)
                if readings:
                    pages.mark_watched(where)  # (libcgpu keeps its headroom from now on)
            except (OSError, struct.error):
                continue
            if readings:
                out[(gpu, name)] = (where, index, slots)
        return out

    def _slot(self, inst: Instance, pid: int):
        got = self._slots.get((inst.gpu, inst.name))
        if got is None:
            return None, None
        where, index, slots = got
        # (NVML's pid is the daemon's; a slot names the container's: a slot found either way is the
        # process's only if it started when the slot says, or a reused or colliding pid is charged)
        for slot in (slots.get(pid), slots.get(ns_pid(pid))):
            if slot is not None and pages.same_process(slot, pid):
                return (where, index), slot
        return (where, index), None

    def _charged(self, inst: Instance, procs: dict[int, int]) -> dict[int, int]:
        """pid -> what libcgpu charges it on the instance's GPU, for its processes with a slot."""
        out = {}
        for pid in procs:
            at, slot = self._slot(inst, pid)
            if slot is not None:
                out[pid] = slot.held[at[1]]
        return out

    def _tell_library(self, inst: Instance, procs: dict[int, int]) -> None:
        """NVML's figure for each process with a slot into the slot (its GPU's only: a reading of an
        instance on several GPUs is written per GPU, the others' left 0, which libcgpu skips)."""
        for pid, nbytes in procs.items():
            at, slot = self._slot(inst, pid)
            if slot is None:
                continue
            where, index = at
            nvml = [0] * pages.MAX_GPUS
            allocs = [0] * pages.MAX_GPUS
            nvml[index] = nbytes
            allocs[index] = max(0, slot.held[index] - slot.driver[index])
            try:
                pages.write_reading(where, slot.index, slot.pid, nvml, allocs, slot.claim)
            except OSError:
                pass

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
                targets = self.page_targets()

                def read(targets=targets):
                    slots = self.snapshot(targets)  # (before NVML: an allocation between counts as the driver's)
                    return slots, look()
                slots, (samples, errors) = await trio.to_thread.run_sync(read)
                self.note_errors(errors)
                self.check(samples, slots)
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
