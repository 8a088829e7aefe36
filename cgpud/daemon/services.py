"""The parts of a running daemon that a hot upgrade stops, hands on, and
starts again: the scheduler (with its guard), the control socket and the
reaper. Started in one nursery of their own, so that they stop together
(cgpud.daemon.upgrade) while the tree keeps its mount.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import trio

from cgpud.control import server as control
from cgpud.control.instances import reaper
from cgpud.containers.cgroups import CgroupError, InstanceGroups
from cgpud.daemon.errors import StartError
from cgpud.state.durable import Durable

log = logging.getLogger("cgpud")


class Services:
    def __init__(self, durable: Durable, socket_path: str | None, make_scheduling: Callable | None,
                 refresh: Callable, *, admin_gid: int | None, devices: list[str], strategy: str, mode: str,
                 client_env: Callable | None = None, hook_path: str | None = None,
                 library: str | None = None, gate: bool = False) -> None:
        self.durable = durable
        self.socket_path = socket_path
        self._make_scheduling = make_scheduling
        self._refresh = refresh
        self.sched = None
        self.ctl: control.Control | None = None
        if socket_path:
            try:
                groups = InstanceGroups()
            except CgroupError as exc:
                log.warning("%s: `cgpu run` will be refused", exc)
                groups = None
            self.ctl = control.Control(durable, admin_gid, groups, devices=devices,
                                       stats=lambda: self.sched.stats() if self.sched is not None else [],
                                       strategy=strategy, mode=mode, client_env=client_env,
                                       **({"hook_path": hook_path} if hook_path else {}), socket_path=socket_path,
                                       library=library, gate=gate)
            if make_scheduling is not None:
                self.ctl.tracer = self._trace
        self._scope: trio.CancelScope | None = None
        self._done = trio.Event()
        self._nursery: trio.Nursery | None = None

    def _trace(self, seconds: float, gpu: int | None) -> list[dict]:
        if self.sched is None:  # between two daemons' schedulers (a hot upgrade)
            return []
        return self.sched.trace(seconds, gpu)

    async def run(self, *, listen_fd: int | None = None, adopted: list = (), guard=None,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start everything, report started, run until `stop`."""
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    if self._make_scheduling is not None:
                        self.sched = self._make_scheduling()
                        if guard is not None:
                            self.sched.guard = guard
                        await nursery.start(self.sched.run)
                    if self.ctl is not None:
                        serve = functools.partial(control.serve, self.socket_path, self.ctl, self._refresh,
                                                  listen_fd=listen_fd, adopted=adopted)
                        try:
                            await nursery.start(serve)
                        except OSError as exc:
                            raise StartError(f"control socket {self.socket_path}: {exc.strerror or exc}") from None
                        nursery.start_soon(reaper, self.ctl, self._refresh)
                    task_status.started()
        finally:
            if self.sched is not None:
                try:
                    self.durable.listeners.remove(self.sched.sync)
                except ValueError:
                    pass
            self._done.set()

    async def start(self, nursery: trio.Nursery, **kw) -> None:
        self._nursery = nursery
        await nursery.start(functools.partial(self.run, **kw))

    async def stop(self, *, handing_over: bool = False) -> None:
        """Stop the scheduler (everything thawed, its guard stopped), the
        control socket and the reaper. Handing over: connections are kept
        open for the next daemon (`handed()`), the socket file stays."""
        if self.ctl is not None:
            self.ctl.handing_over = handing_over
            self.ctl.handed = []
        if self._scope is not None:
            self._scope.cancel()
        await self._done.wait()
        self.sched = None

    def listen_dup(self) -> int:
        """A copy of the listening socket (to pass on, and to keep for a rollback)."""
        return os.dup(self.ctl.listen_fd) if self.ctl is not None and self.ctl.listen_fd >= 0 else -1

    def handed(self) -> list:
        return list(self.ctl.handed) if self.ctl is not None else []

    def control_state(self) -> dict:
        from cgpud.daemon.upgrade import control_state

        return control_state(self.ctl) if self.ctl is not None else {"conns": []}

    async def start_again(self, listen_fd: int) -> None:
        """After a failed handover: serve again with what we kept."""
        adopted = self.handed()
        if self.ctl is not None:
            self.ctl.handing_over = False
            self.ctl.handed = []
        assert self._nursery is not None
        await self.start(self._nursery, listen_fd=listen_fd if listen_fd >= 0 else None, adopted=adopted)

    def close(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
