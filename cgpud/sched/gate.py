"""The compute gate: enforcement for containers whose processes carry libcgpu
(docs/isolation.md), in place of freezing their cgroup.

The container's `limits` page holds a gate word (odd: open, even: closed;
every change adds one, and wakes the futex). Closing it stops the
container's *kernel launches*:
libcgpu makes a launch that finds it closed wait on it with a futex, while
the container's CPU side runs on. Opening it wakes them (FUTEX_WAKE on the
shared file mapping: the futex is keyed by the file, so the container's
read-only mapping of the same file is woken).

Work already queued on the GPU runs on after the gate closes, so a closing
is complete only when every process that launches has drained: its helper
thread synchronized its contexts and wrote the closed value into its slot's
`acked`, then a byte into the `drained` FIFO, which the daemon waits on
(`fileno()`), never polling. `is_frozen()` says whether that is so. A process
that does not answer within the scheduler's bound is taken as stale (killed,
stopped, or lying) and is not waited for again until it answers: it cannot
hold the GPU from the others for longer than one bound.

The surface is the freezers' (cgpud.sched.enforce): freeze(), thaw(),
is_frozen(), spec(), close(), `frozen`; thaw_gate(path) opens a gate from
its registry entry (the guard, when the daemon dies: nothing stays gated).
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
    """The limits page of one container, mapped writable by the daemon."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "limits")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TargetGone(f"{path} is gone") from None
        except OSError as exc:
            raise Refused(f"{path}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size < pages.LIMITS.size:
                raise Refused(f"{path} is not a cgpud limits page")
            self.map = mmap.mmap(fd, pages.LIMITS.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version = struct.unpack_from("<2I", self.map, 0)
        if magic not in (pages.MAGIC, 0) or version != pages.VERSION:  # (0: prepared, its memsizes not yet written)
            self.map.close()
            raise Refused(f"{path} is not a cgpud limits page of version {pages.VERSION}")
        self._word = ctypes.c_uint32.from_buffer(self.map, pages.GATE_OFFSET)
        self.addr = ctypes.addressof(self._word)
        self._wake_args = (_SYS_FUTEX, self.addr, _FUTEX_WAKE, _INT_MAX, None, None, 0)

    @property
    def gate(self) -> int:
        return self._word.value

    def set(self, value: int) -> None:
        self._word.value = value & 0xFFFFFFFF

    def wake(self) -> None:
        _libc.syscall(*self._wake_args)

    def close(self) -> None:
        del self._word
        self.map.close()


def open_gate(page: _Page) -> None:
    g = page.gate
    if not g & 1:
        page.set(g + 1)
    page.wake()  # (also when it was open: a waiter that read an old value wakes and looks again)


class GateFreezer:
    """Gate one container's kernel launches (see the module's text)."""
    kind = KIND_GATE

    def __init__(self, directory: str, *, label: str | None = None) -> None:
        self.path = os.path.realpath(directory)
        self.label = label
        self._page = _Page(self.path)
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
        self.frozen = False
        open_gate(self._page)  # the loop assumes every instance starts thawed

    def freeze(self) -> None:
        g = self._page.gate
        if g & 1:
            self._page.set(g + 1)
            self._page.wake()  # the processes' helper threads: drain and answer
        self.frozen = True

    def thaw(self) -> bool:
        self.frozen = False
        open_gate(self._page)
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

    def _slots(self) -> list[tuple[int, int, int, int]]:
        """(slot, pid, gated, acked) of the slots whose processes launch (the
        page's bitmap names them: a few words read, not 256 slots)."""
        out = []
        # (its little-endian words read as one little-endian number: bit k is slot k)
        bits = int.from_bytes(self._usage[pages.GATED_OFFSET:pages.GATED_OFFSET + pages.GATED.size], "little")
        while bits:
            low = bits & -bits
            k = low.bit_length() - 1
            bits ^= low
            pid, gated, acked, _ = pages.PROC_HEAD.unpack_from(self._usage, pages.USAGE_HEAD.size + k * pages.PROC.size)
            if pid > 0:
                out.append((k, pid, gated, acked))
        return out

    def undrained(self) -> list[int]:
        """The slots of launching processes that have not drained the current
        closing (none when the gate is open, or once closed here), leaving out
        the stale ones."""
        return [slot for slot, _, _ in self._undrained()]

    def _undrained(self) -> list[tuple[int, int, int]]:
        """(slot, pid, acked) of each process undrained() names."""
        if self._fifo < 0:
            return []
        g = self._page.gate
        if g & 1:
            return []
        waiting = []
        for slot, pid, gated, acked in self._slots():
            if self._stale.get(slot, (pid, acked)) != (pid, acked):
                del self._stale[slot]  # it has answered a closing since (or is another process): waited for again
            if not gated or acked == g or slot in self._stale:
                continue
            waiting.append((slot, pid, acked))
        return waiting

    def give_up(self) -> list[int]:
        """The bound passed: those who did not answer are not waited for again
        (until they answer). Returns their slots."""
        late = self._undrained()
        for slot, pid, acked in late:
            self._stale[slot] = (pid, acked)
        return [slot for slot, _, _ in late]

    def is_frozen(self) -> bool:
        return not self._page.gate & 1 and not self.undrained()

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
    """Open the gate in the pages at `path` (a registry entry's): "thawed",
    "gone", or "refused: why". Never raises."""
    try:
        page = _Page(path)
    except TargetGone:
        return "gone"
    except Refused as exc:
        return f"refused: {exc}"
    try:
        open_gate(page)
    finally:
        page.close()
    return "thawed"
