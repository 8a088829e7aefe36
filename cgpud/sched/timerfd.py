"""Precise sleeps for trio: a Linux timerfd watched by trio's epoll.

trio's own timers go through epoll's millisecond timeout, which CPython rounds
up: a sleep can end up to 1 ms late. A timerfd fires at its nanosecond
deadline and wakes epoll at once. `TimerFd.sleep_until(deadline)` takes a
deadline on trio's clock (so the scheduler keeps reading time only through
`trio.current_time()`) and converts it to CLOCK_MONOTONIC, which trio's system
clock counts in too.

`MonotonicClock` is the daemon's trio clock: CLOCK_MONOTONIC itself (trio's
own adds a random offset of its run), so that the times the daemon reports
(`cgpu trace`, the switcher's reports) compare with any other process's
`time.monotonic()` or `clock_gettime(CLOCK_MONOTONIC)`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

import trio

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1


class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _timespec), ("it_value", _timespec)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_itimerspec), ctypes.c_void_p]


class MonotonicClock(trio.abc.Clock):
    """trio.run(..., clock=MonotonicClock()): trio's time is time.monotonic()."""

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return time.monotonic()

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return deadline - time.monotonic()


class TimerFd:
    def __init__(self) -> None:
        fd = _libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self._spec = _itimerspec()
        self._value = self._spec.it_value
        self._set_args = (fd, TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None)  # (made once: armed every slice)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self._set_args = (-1, *self._set_args[1:])  # (a number reused after this is not ours)

    def _arm(self, monotonic_deadline: float) -> None:
        sec = int(monotonic_deadline)
        nsec = int((monotonic_deadline - sec) * 1e9)
        if sec <= 0 and nsec <= 0:
            nsec = 1  # 0 would disarm the timer
        self._value.tv_sec = sec
        self._value.tv_nsec = nsec
        if _libc.timerfd_settime(*self._set_args) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def fire_now(self) -> None:
        """Make a pending (or the next) wait return at once."""
        self._value.tv_sec = 0
        self._value.tv_nsec = 1  # an absolute time long past: expires immediately
        if _libc.timerfd_settime(*self._set_args) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until `deadline` on trio's clock, to within microseconds."""
        now = trio.current_time()
        if deadline <= now:
            await trio.lowlevel.checkpoint()
            return
        self._arm(time.monotonic() + (deadline - now))
        await trio.lowlevel.wait_readable(self.fd)
        # (its expiration count is left unread: arming it again, as every sleep does first, resets it)
