"""Running under systemd (docs/service.md): the watchdog, and the two
commands the unit runs around the daemon.

- `Watchdog`: pings `WATCHDOG=1` every half of `$WATCHDOG_USEC`, and only
  while the daemon is healthy: every GPU scheduler woke up for its last
  boundary in time, and the mounted tree answers a `statfs` from another
  thread within half an interval. A daemon whose event loop is stuck pings
  nothing at all (the pinger is a task of that loop); systemd then kills it
  (SIGABRT) and `Restart=on-failure` starts a new one.
- `clear_mount(path)` (`cgpud clear-mount`, the unit's ExecStartPre): a dead
  FUSE mount a crashed daemon left is cleared; a live one is left alone.
- `thaw_everything(state_dir)` (`cgpud thaw`, the unit's ExecStopPost):
  every target the guard's registry names runs again (the guard does the
  same the moment the daemon dies; this covers a guard that was killed too).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

import trio

from fusefs import mount as fmount

from cgpud.sched.guard import RegistryError, read_registry, registry_path
from cgpud.sched.enforce import thaw_spec
from cgpud.daemon.sdnotify import notify

log = logging.getLogger("cgpud")


# ---- the watchdog ------------------------------------------------------------------------


def watchdog_interval(env: dict[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between pings (half of $WATCHDOG_USEC), or None when no
    watchdog is asked of this process ($WATCHDOG_PID names another one)."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    wpid = env.get("WATCHDOG_PID")
    if wpid and wpid.strip() != str(os.getpid() if pid is None else pid):
        return None
    return usec / 2e6


def overdue_schedulers(schedulers: Sequence[Any], now: float, grace: float) -> list[str]:
    """Why each late scheduler is unhealthy: one whose decision in force
    should have ended more than `grace` seconds ago has stopped waking up."""
    out = []
    for s in schedulers:
        dec = getattr(s, "decision", None)
        if dec is not None and now - dec.until > grace:
            out.append(f"the scheduler of GPU {s.gpu} is {now - dec.until:.1f} s late for its boundary")
    return out


class Watchdog:
    """A background service: `run(task_status=…)`; nothing to stop (cancel it).

    schedulers: objects with `gpu` and `decision` (GpuScheduler), or a callable
                giving those running now (a hot upgrade replaces them).
    probe:      a blocking callable that must return within half an interval
                (the daemon: `os.statvfs(mountpoint)`, answered by its own
                FUSE loop); run in a worker thread, one at a time.
    """

    def __init__(self, interval: float, schedulers: Sequence[Any] | Callable[[], Sequence[Any]] = (), probe: Callable[[], Any] | None = None,
                 *, send: Callable[[str], Any] = notify) -> None:
        self.interval = interval
        self.schedulers = schedulers
        self.probe = probe
        self.send = send
        self.pings = 0
        self.missed = 0
        self._probing = False
        self._unhealthy: list[str] = []

    @property
    def grace(self) -> float:
        return max(1.0, self.interval)

    async def check(self) -> list[str]:
        """[] when healthy, else what is wrong (one line each)."""
        scheds = self.schedulers() if callable(self.schedulers) else self.schedulers
        problems = overdue_schedulers(scheds, trio.current_time(), self.grace)
        if self.probe is not None:
            problems += await self._probe()
        return problems

    async def _probe(self) -> list[str]:
        if self._probing:  # the last probe's thread is still stuck
            return ["the mounted tree has not answered the last probe"]
        self._probing = True
        done = False

        def run() -> None:
            nonlocal done
            try:
                self.probe()
            except OSError:
                pass  # an answer is an answer (ENOTCONN: the mount is gone: _serve_fs stops us)
            finally:
                self._probing = False
            done = True

        with trio.move_on_after(self.interval / 2):
            await trio.to_thread.run_sync(run, abandon_on_cancel=True)
        return [] if done else [f"the mounted tree did not answer within {self.interval / 2:.1f} s"]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            problems = await self.check()
            if problems:
                self.missed += 1
                if problems != self._unhealthy:
                    log.error("watchdog: not pinging systemd: %s (systemd restarts the daemon if this lasts)",
                              "; ".join(problems))
            else:
                if self._unhealthy:
                    log.warning("watchdog: healthy again; pinging systemd")
                self.send("WATCHDOG=1")
                self.pings += 1
            self._unhealthy = problems
            await trio.sleep(self.interval)


# ---- ExecStartPre: a dead mount -----------------------------------------------------------


class ServiceError(Exception):
    """One line for a person: what went wrong and what to do."""


def clear_mount(path: str) -> str:
    """Clear a dead FUSE mount at `path`; what was done, in words. A live
    mount (a daemon serves it) and a foreign one are left alone (the daemon's
    start then refuses with its own message)."""
    path = os.path.abspath(path)
    try:
        m = fmount.find_mount(path)
    except OSError as exc:
        raise ServiceError(f"cannot read the mount table: {exc.strerror}") from None
    if m is None:
        return f"{path}: not mounted; nothing to clear"
    if not m.fstype.startswith("fuse"):
        return f"{path}: a {m.fstype} mount, not ours; left alone"
    if not fmount.is_dead(path):
        return f"{path}: served by a live daemon ({m.source}); left alone"
    try:
        fmount.unmount(path, lazy=True)
    except fmount.MountError as exc:
        raise ServiceError(str(exc)) from None
    return f"{path}: cleared the dead mount a crashed daemon left"


# ---- ExecStopPost: thaw -------------------------------------------------------------------


def thaw_everything(state_dir: str) -> list[tuple[Any, str]]:
    """Thaw every target the guard's registry in `state_dir` names (what the
    daemon froze or may have been freezing when it stopped: it adds a target
    before its first freeze and drops it after its last thaw). Only those: a
    container someone else paused (`docker pause`) stays paused.
    [(entry, outcome)] as thaw_spec says it; ServiceError if the registry is
    unreadable."""
    try:
        entries = read_registry(registry_path(state_dir))
    except RegistryError as exc:
        raise ServiceError(f"cannot read what the daemon froze: {exc}") from None
    return [(entry, thaw_spec(entry)) for entry in entries]
