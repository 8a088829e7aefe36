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
process that does not answer within the scheduler's bound is taken as stale
(killed, stopped, or lying) and is not waited for again until it answers: it
cannot hold the GPU from the others for longer than one bound.

The surface is the freezers' (cgpud.sched.enforce): freeze(), thaw(),
is_frozen(), spec(), close(), `frozen`; with the node GPU of each of the
page's (`gpus`), `drives_gpus` is set and freeze(gpu), thaw(gpu),
undrained(gpu) act on that GPU's gate alone. thaw_gate(path) opens every gate
from its registry entry (the guard, when the daemon dies: nothing stays
gated).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

import trio

from cgpud.gpus import pages
from cgpud.sched.cgroupfs import KIND_GATE, Refused, TargetGone

_SYS_FUTEX = 202  # x86_64
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int]  # (only the futex call is made: its arguments converted without guessing)


class _Page:
    """The limits page of one container, mapped writable by the daemon. A page
    made by an older cgpud (SHARED_GATE_SIZE bytes) has only the container's
    gate: `per_gpu` is False."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "limits")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
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
        # the words: [0] the container's gate, [1 + k] GPU k's; and the count of closings
        self._words = [ctypes.c_uint32.from_buffer(self.map, pages.GATE_OFFSET)]
        self._closings = None
        if self.per_gpu:
            self._closings = ctypes.c_uint32.from_buffer(self.map, pages.CLOSINGS_OFFSET)
            self._words += [ctypes.c_uint32.from_buffer(self.map, pages.GPU_GATE_OFFSET + 4 * k)
                            for k in range(pages.MAX_GPUS)]
        self._wake_args = [(_SYS_FUTEX, ctypes.addressof(w), _FUTEX_WAKE, _INT_MAX, None, None, 0)
                           for w in self._words]
        if self._closings is not None:
            self._closings_wake = (_SYS_FUTEX, ctypes.addressof(self._closings), _FUTEX_WAKE, _INT_MAX, None, None, 0)

    @property
    def ngpus(self) -> int:
        """The page's GPUs (read each time: a prepared page learns them when it is filled)."""
        return min(max(struct.unpack_from("<I", self.map, 8)[0], 1), pages.MAX_GPUS)

    def get(self, k: int | None = None) -> int:
        """The container's gate (None), or GPU k's."""
        return self._words[0 if k is None else 1 + k].value

    def set(self, value: int, k: int | None = None) -> None:
        self._words[0 if k is None else 1 + k].value = value & 0xFFFFFFFF

    def wake(self, k: int | None = None) -> None:
        _libc.syscall(*self._wake_args[0 if k is None else 1 + k])

    def closed(self) -> int:
        """Count one more closing, wake the helper threads; the new count."""
        c = (self._closings.value + 1) & 0xFFFFFFFF
        self._closings.value = c
        _libc.syscall(*self._closings_wake)
        return c

    def close(self) -> None:
        del self._words, self._closings
        self.map.close()


def _open(page: _Page, k: int | None = None) -> None:
    g = page.get(k)
    if not g & 1:
        page.set(g + 1, k)
    page.wake(k)  # (also when it was open: a waiter that read an old value wakes and looks again)


def _before(acked: int, closing: int) -> bool:
    """`acked` answers a closing older than `closing` (counts that wrap)."""
    return (acked - closing) & 0xFFFFFFFF >= 0x80000000


class GateFreezer:
    """Gate one container's kernel launches (see the module's text).

    `gpus`: the node GPU of each of the page's GPUs, in its order. With them,
    and a page of per-GPU gates, `freeze(gpu)` and `thaw(gpu)` close and open
    that GPU's gate alone (`drives_gpus`): the container's launches on its
    other GPUs go on. Without a GPU, they close or open all of them. The
    container's own gate is closed while any of its GPUs' is (what a process
    of an older libcgpu waits on)."""
    kind = KIND_GATE

    def __init__(self, directory: str, *, label: str | None = None, gpus: list[int] | None = None) -> None:
        self.path = os.path.realpath(directory)
        self.label = label
        ok = isinstance(gpus, list) and gpus and all(isinstance(g, int) and not isinstance(g, bool) for g in gpus)
        self.gpus = list(gpus) if ok else None  # (from a state file: anything else is the container's one gate)
        self._page = _Page(self.path)
        self.drives_gpus = self._page.per_gpu and self.gpus is not None
        fifo = os.path.join(self.path, "drained")
        try:
            self._fifo = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # our own writer: the FIFO never reads as hung up between the processes' writes
            self._keep = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self._page.close()
            raise Refused(f"{fifo}: {exc.strerror}") from None
        try:
            fd = os.open(os.path.join(self.path, "usage"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._usage = mmap.mmap(fd, pages.USAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            self._page.close()
            os.close(self._fifo)
            os.close(self._keep)
            raise Refused(f"{self.path}/usage: {exc}") from None
        self._stale: dict[int, tuple[int, int]] = {}  # slot -> (its pid, its acked) when it was given up on
        self._closed: dict[int, int] = {}  # page GPU -> the count of closings its closing made
        self.frozen = False
        self.thaw()  # the loop assumes every instance starts thawed

    def _ks(self, gpu: int | None) -> list[int]:
        """The page GPUs a freeze or thaw of node GPU `gpu` (None: all) is about."""
        if gpu is None or not self.drives_gpus:
            return list(range(self._page.ngpus))
        try:
            return [self.gpus.index(gpu)]
        except ValueError:
            return []

    def freeze(self, gpu: int | None = None) -> None:
        page = self._page
        if page.per_gpu:
            for k in self._ks(gpu):
                g = page.get(k)
                if g & 1:
                    page.set(g + 1, k)
                if k not in self._closed:
                    self._closed[k] = page.closed()  # (wakes the helper threads: drain and answer)
        g = page.get()
        if g & 1:
            page.set(g + 1)
            page.wake()  # the helper threads of an older libcgpu: drain and answer
        self.frozen = True

    def thaw(self, gpu: int | None = None) -> bool:
        page = self._page
        if page.per_gpu:
            for k in self._ks(gpu):
                self._closed.pop(k, None)
                _open(page, k)
        if not self._closed:
            _open(page)
        self.frozen = bool(self._closed)
        return True

    def fileno(self) -> int:
        return self._fifo

    def consume(self) -> None:
        """Empty the FIFO (its bytes only wake us; the page says who drained)."""
        if self._fifo < 0:
            return
        try:
            while len(os.read(self._fifo, 4096)) == 4096:  # (a short read emptied it: no second call)
                pass
        except BlockingIOError:
            pass

    def _slots(self) -> list[tuple[int, int, int, int, int]]:
        """(slot, pid, gated, acked, gpus) of the slots whose processes launch
        (the page's bitmap names them: a few words read, not 256 slots)."""
        out = []
        # (its little-endian words read as one little-endian number: bit k is slot k)
        bits = int.from_bytes(self._usage[pages.GATED_OFFSET:pages.GATED_OFFSET + pages.GATED.size], "little")
        while bits:
            low = bits & -bits
            k = low.bit_length() - 1
            bits ^= low
            pid, gated, acked, on = pages.PROC_HEAD.unpack_from(self._usage, pages.USAGE_HEAD.size + k * pages.PROC.size)
            if pid > 0:
                out.append((k, pid, gated, acked, on))
        return out

    def undrained(self, gpu: int | None = None) -> list[int]:
        """The slots of launching processes that have not drained the current
        closing (of node GPU `gpu`'s gate; None: of any), leaving out the
        stale ones. None when nothing is closed, or once drained."""
        return [slot for slot, _, _ in self._undrained(gpu)]

    def _undrained(self, gpu: int | None = None) -> list[tuple[int, int, int]]:
        """(slot, pid, acked) of each process undrained() names."""
        if self._fifo < 0:
            return []
        shared = self._page.get()
        if gpu is None or not self.drives_gpus:
            closing = self._closed
        else:
            closing = {k: c for k in self._ks(gpu) if (c := self._closed.get(k)) is not None}
        if shared & 1 and not closing:
            return []
        waiting = []
        for slot, pid, gated, acked, on in self._slots():
            if self._stale.get(slot, (pid, acked)) != (pid, acked):
                del self._stale[slot]  # it has answered a closing since (or is another process): waited for again
            if slot in self._stale:
                continue
            if gated == pages.GATED_PER_GPU:
                if not any(on >> k & 1 and _before(acked, c) for k, c in closing.items()):
                    continue
            elif not gated or shared & 1 or acked == shared:
                continue
            waiting.append((slot, pid, acked))
        return waiting

    def give_up(self, gpu: int | None = None) -> list[int]:
        """The bound passed: those who did not answer are not waited for again
        (until they answer). Returns their slots."""
        late = self._undrained(gpu)
        for slot, pid, acked in late:
            self._stale[slot] = (pid, acked)
        return [slot for slot, _, _ in late]

    def is_frozen(self) -> bool:
        return self.frozen and not self.undrained()

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, **({"label": self.label} if self.label else {})}

    def close(self) -> None:
        """Forget the page; the gate keeps the state it has (thaw first)."""
        if self._fifo >= 0:
            try:  # the scheduler may be waiting on it (trio must know before the number is reused)
                trio.lowlevel.notify_closing(self._fifo)
            except RuntimeError:  # (not in a trio thread)
                pass
            os.close(self._fifo)
            os.close(self._keep)
            self._fifo = self._keep = -1
            self._page.close()
            self._usage.close()

    def __repr__(self) -> str:
        return f"GateFreezer({self.path!r})"


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
        _open(page)
    finally:
        page.close()
    return "thawed"
