"""Raised scheduling priority for the daemon.

Slice boundaries are only as punctual as the daemon's wake-ups. Under load a
normal-priority daemon waits behind the very workloads it schedules, so it runs
real-time (SCHED_RR) when it may, else at a high nice. SCHED_RESET_ON_FORK
keeps every process it starts at normal priority.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("cgpud")
PR_SET_TIMERSLACK = 29


def raise_priority(rt_priority: int) -> str:
    """Apply and describe the daemon's priority; 0 = leave it alone."""
    try:  # wake-ups as close to their deadline as the kernel can do
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if rt_priority <= 0:
        return "normal priority"
    try:
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(rt_priority))
        return f"real-time SCHED_RR priority {rt_priority}"
    except OSError as exc:
        log.warning("cannot run real-time (%s); scheduling will be less punctual under load", exc.strerror)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice -10"
    except OSError:
        return "normal priority"
