"""The compute gate: enforcement for containers whose processes carry libcgpu
(docs/isolation.md), in place of freezing their cgroup.

The container's `limits` page holds a gate word per GPU of the container, and
one for the whole container (odd: open, even: closed; every change adds one,
and wakes the futex). Closing a GPU's gate stops the container's *kernel
launches on that GPU*: libcgpu makes a launch that finds its device's gate
closed wait on it with a futex, while the container's CPU side, and its work
on its other GPUs, run on. Opening it wakes them (FUTEX_WAKE on the shared
file mapping: the futex is keyed by the file, so the container's read-only
mapping of the same file is woken). The container's own gate is closed while
any GPU's is: what a process of an older libcgpu, or in a page of an older
cgpud (no per-GPU gates: `_Page.per_gpu` False), waits on.

Work already queued on the GPU runs on after the gate closes, so a closing
is complete only when every process that launches there has drained: at each
closing (a count in the page, which wakes them) its helper thread
synchronized its contexts on the closed GPUs and wrote the count into its
slot's `acked`, then a byte into the `drained` FIFO, which the daemon waits
on (`fileno()`), never polling. `is_frozen()` says whether that is so. A
process that has not answered when the scheduler's bound passes is asked
about: dead (it no longer holds the lock on its slot), stopped, or alive but
not draining, it is taken as stale and is not waited for again until it
answers (it holds the GPU from the others for one bound at most); alive and
draining, it is waited for on (up to a cap).

While another instance is active on its GPU (share()), the container's
processes keep at most a budget of GPU work queued ahead (libcgpu), so a
drain lasts about the budget.

The surface is the freezers' (cgpud.sched.enforce): freeze(), thaw(),
is_frozen(), spec(), close(), `frozen`; with the node GPU of each of the
page's (`gpus`), `drives_gpus` is set and freeze(gpu), thaw(gpu),
undrained(gpu) act on that GPU's gate alone. thaw_gate(path) opens every gate
from its registry entry (the guard, when the daemon dies: nothing stays
gated).

The page's state (its gate words, which GPUs' gates are closed and with which
closing, who was given up on) is kept by the daemon's native part
(cgpud.sched.native), shared with the switcher threads that carry out a GPU's
switches (cgpud.sched.loop): one implementation, used by both.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
from typing import Any, Iterable

import trio

from cgpud.gpus import pages
from cgpud.sched import native
from cgpud.sched.cgroupfs import KIND_GATE, Refused, TargetGone

log = logging.getLogger("cgpud.sched")
_SYS_FUTEX = 202  # x86_64
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int]  # (only the futex call is made: its arguments converted without guessing)


class _Page:
    """The limits page of one container, mapped writable by the daemon, in
    Python (the guard opens its gates with it: a dead daemon's native part is
    not needed to let its containers run). A page
    made by an older cgpud (SHARED_GATE_SIZE bytes) has only the container's
    gate: `per_gpu` is False."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "limits")
        try:
            fd = pages.open_page(directory, "limits", os.O_RDWR)
        except FileNotFoundError:
            raise TargetGone(f"{path} is gone") from None
        except OSError as exc:
            raise Refused(f"{path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < pages.SHARED_GATE_SIZE:
                raise Refused(f"{path} is not a cgpud limits page")
            self.per_gpu = size >= pages.LIMITS.size
            size = pages.LIMITS.size if self.per_gpu else pages.SHARED_GATE_SIZE
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version = struct.unpack_from("<2I", self.map, 0)
        if magic not in (pages.MAGIC, 0) or version != pages.VERSION:  # (0: prepared, its memsizes not yet written)
            self.map.close()
            raise Refused(f"{path} is not a cgpud limits page of version {pages.VERSION}")
        # the words: [0] the container's gate, [1 + k] GPU k's
        self._words = [ctypes.c_uint32.from_buffer(self.map, pages.GATE_OFFSET)]
        if self.per_gpu:
            self._words += [ctypes.c_uint32.from_buffer(self.map, pages.GPU_GATE_OFFSET + 4 * k)
                            for k in range(pages.MAX_GPUS)]
        self._wake_args = [(_SYS_FUTEX, ctypes.addressof(w), _FUTEX_WAKE, _INT_MAX, None, None, 0)
                           for w in self._words]

    def get(self, k: int | None = None) -> int:
        """The container's gate (None), or GPU k's."""
        return self._words[0 if k is None else 1 + k].value

    def set(self, value: int, k: int | None = None) -> None:
        self._words[0 if k is None else 1 + k].value = value & 0xFFFFFFFF

    def wake(self, k: int | None = None) -> None:
        _libc.syscall(*self._wake_args[0 if k is None else 1 + k])

    def close(self) -> None:
        del self._words
        self.map.close()


def _open(page: _Page, k: int | None = None) -> None:
    g = page.get(k)
    if not g & 1:
        page.set(g + 1, k)
    page.wake(k)  # (also when it was open: a waiter that read an old value wakes and looks again)


class GateFreezer:
    """Gate one container's kernel launches (see the module's text).

    `gpus`: the node GPU of each of the page's GPUs, in its order. With them,
    and a page of per-GPU gates, `freeze(gpu)` and `thaw(gpu)` close and open
    that GPU's gate alone (`drives_gpus`): the container's launches on its
    other GPUs go on. Without a GPU, they close or open all of them. The
    container's own gate is closed while any of its GPUs' is (what a process
    of an older libcgpu waits on).

    The page's state lives in the daemon's native part (cgpud.sched.native),
    which the GPUs' switcher threads share: `page` is its handle."""
    kind = KIND_GATE

    def __init__(self, directory: str, *, label: str | None = None, gpus: list[int] | None = None,
                 group: dict | None = None, group_freezer: Any = None) -> None:
        self.path = os.path.realpath(directory)
        self.label = label
        # (its instance's cgroup, {"kind", "path"}, and how to open its freezer: where a process of it
        # uses the GPU outside the library, hold_group() freezes it whenever its gates are closed)
        self.group, self._group_freezer, self.held = group, group_freezer, None
        ok = isinstance(gpus, list) and gpus and all(isinstance(g, int) and not isinstance(g, bool) for g in gpus)
        self.gpus = list(gpus) if ok else None  # (from a state file: anything else is the container's one gate)
        try:
            self.page = native.Page(self.path, self.gpus)
        except native.PageError as exc:
            raise (TargetGone if exc.gone else Refused)(str(exc)) from None
        self.drives_gpus = self.page.drives
        self.thaw()  # the loop assumes every instance starts thawed

    @property
    def frozen(self) -> bool:
        return self.page.handle is not None and self.page.frozen()

    def freeze(self, gpu: int | None = None) -> None:
        self.page.freeze(gpu)

    def thaw(self, gpu: int | None = None) -> bool:
        self.page.thaw(gpu)
        return True

    def closed_on(self, gpu: int) -> bool:
        """Whether node GPU `gpu`'s gate is closed (not driven per GPU: whether it is frozen)."""
        return self.page.closed_on(gpu)

    def fileno(self) -> int:
        return self.page.fifo

    def consume(self) -> None:
        """Empty the FIFO (its bytes only wake us; the page says who drained)."""
        if self.page.handle is not None:
            self.page.consume()

    def undrained(self, gpu: int | None = None) -> list[int]:
        """The slots of launching processes that have not drained the current
        closing (of node GPU `gpu`'s gate; None: of any), leaving out the
        stale ones. None when nothing is closed, or once drained."""
        if self.page.handle is None:
            return []
        return self.page.undrained(gpu)

    def give_up(self, gpu: int | None = None, every: bool = False) -> list[tuple[int, str]]:
        """The bound passed: those who cannot answer (dead, stopped, or alive
        and not draining; `every`: all) are not waited for again (until they
        answer). Returns their slots and why."""
        return self.page.give_up(gpu, every)

    def damage(self) -> str | None:
        """Why the container's usage page is damaged, once (see native.Page.damage)."""
        return self.page.damage()

    def outside(self, pids: Iterable[int]) -> list[int]:
        """Of processes of the instance that use the GPU (NVML's pids), those with no live slot in its
        page (no slot's lock is theirs): outside the library, no gate holds them."""
        return [pid for pid in pids if not self.page.holds(pid)]

    def hold_group(self, why: str) -> bool:
        """Hold the instance by its cgroup's freezer from now on, frozen whenever its gates are closed
        (docs/security.md, "Leaving the library"). True the first time; False without a cgroup."""
        if self.held is not None or self._group_freezer is None or self.page.handle is None:
            return False
        try:
            f = self._group_freezer()
        except (Refused, TargetGone, OSError) as exc:
            log.warning("%s: its cgroup cannot hold it (%s)", self.label or self.path, exc)
            return False
        self.held = f
        return self.page.hold(f._fd, f._h.freeze_value, f._h.thaw_value, why)

    def share(self, gpu: int | None, on: bool, budget_us: int) -> None:
        """Another instance is active on node GPU `gpu` (None: on all the
        container's GPUs) now, or no longer: while it is, the container's
        processes keep at most `budget_us` of GPU work queued ahead there."""
        if self.page.handle is not None:
            self.page.set_shared(gpu if self.drives_gpus else None, on, budget_us)

    def bound(self, bound_us: int) -> None:
        """The daemon's drain bound (µs), which the container's processes answer a closing within
        (three quarters of it: docs/isolation.md, "The drain bound")."""
        if self.page.handle is not None:
            self.page.set_bound(bound_us)

    def is_frozen(self) -> bool:
        return self.frozen and not self.undrained()

    def spec(self) -> dict[str, Any]:  # (the guard thaws its group too: it may have held it)
        return {"kind": self.kind, "path": self.path, **({"label": self.label} if self.label else {}),
                **({"group": self.group} if self.group else {})}

    def close(self) -> None:
        """Forget the page; the gate keeps the state it has (thaw first)."""
        if self.page.handle is not None:
            try:  # the scheduler may be waiting on its FIFO (trio must know before the number is reused)
                trio.lowlevel.notify_closing(self.page.fifo)
            except RuntimeError:  # (not in a trio thread)
                pass
            self.page.release()
        if self.held is not None:
            self.held.close()

    def __repr__(self) -> str:
        return f"GateFreezer({self.path!r})"


def tell_damage(name: str, target: Any) -> None:
    """Say in the log, once, that instance `name`'s usage page was found damaged (cut, replaced, a
    foreign head: native.Page.damage): from then on it is not read (docs/isolation.md, "The pages")."""
    damage = getattr(target, "damage", None)
    why = damage() if damage is not None else None
    if why:
        log.warning("instance %s's usage page is damaged: %s; its GPU time is not known (it is charged the time its "
                    "gate is open) and its processes' queued work is not waited for when its gate closes, until the "
                    "instance is made again", name, why)


def look_at_pages(enforcer: Any, view: Any) -> None:
    """tell_damage for each instance of a GPU's view (its loop, each time it publishes its stats)."""
    target = getattr(enforcer, "target", None)
    if target is not None and view is not None:
        for name in view.names:
            tell_damage(name, target(name))


def thaw_gate(path: str) -> str:
    """Open the gates in the pages at `path` (a registry entry's): the
    container's and every GPU's. "thawed", "gone", or "refused: why". Never
    raises."""
    try:
        page = _Page(path)
    except TargetGone:
        return "gone"
    except Refused as exc:
        return f"refused: {exc}"
    try:
        if page.per_gpu:
            for k in range(pages.MAX_GPUS):
                _open(page, k)
            struct.pack_into("<I", page.map, pages.SHARED_OFFSET, 0)  # (no scheduler: no queue bound either)
        _open(page)
    finally:
        page.close()
    return "thawed"
