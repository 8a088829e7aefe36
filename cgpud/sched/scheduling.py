"""The daemon's edge to the scheduler.

Maps what the model says (instances and their targets) onto the enforcement
backends and the activity monitor, runs one GpuScheduler per GPU, and keeps
the guard that thaws everything if the daemon dies (SPEC §7: never leave a
container stopped):

- at start: anything a crashed daemon left frozen is thawed (its registry);
- while running: a separate guard process thaws what the registry names as
  soon as the daemon's process is gone, kill -9 included;
- at shutdown: the schedulers thaw what they froze, then everything is thawed
  and detached once more, then the guard is stopped.
"""
from __future__ import annotations

import logging
from typing import Mapping

import trio

from cgpud.sched.guard import Guard, GuardError, Registry, registry_path, thaw_all
from cgpud.core.model import Node
from cgpud.sched.activity import ActivityMonitor
from cgpud.sched.enforce import EnforceError, Enforcement, freezer_from_spec
from cgpud.sched.loop import GpuScheduler, schedulers_for
from cgpud.sched.policies import Params
from cgpud.sched.telemetry import collect

log = logging.getLogger("cgpud")


class Scheduling:
    def __init__(self, node: Node, state_dir: str, devices: Mapping[int, str], params: Params,
                 *, precise: bool = True) -> None:
        self.node = node
        path = registry_path(state_dir)
        thaw_all(path)  # whatever a daemon that died left frozen runs again (each entry is logged)
        self.registry = Registry(path)
        self.enforcement = Enforcement(self.registry)
        self.activity = ActivityMonitor(dict(devices))
        self.schedulers: list[GpuScheduler] = schedulers_for(
            node, self.enforcement, self.activity, params=params, precise=precise, switch=precise
        )
        self.guard: Guard | None = None
        self._targets: dict[str, dict] = {}        # attached: name -> target
        self._watched: dict[tuple[int, str], dict] = {}
        self._seen = -1

    # ---- model -> backends ------------------------------------------------

    def sync(self) -> None:
        """After any change: attach new targets, detach vanished ones (cheap
        when no instance moved), and wake the schedulers so that a changed
        setting takes effect now, not at the end of a long run."""
        if self.node.version == self._seen:
            for s in self.schedulers:
                s.poke()
            return
        self._seen = self.node.version
        want: dict[str, dict] = {}
        keys: dict[tuple[int, str], dict] = {}
        for inst in self.node.instances():
            if inst.target:
                want[inst.name] = inst.target
                keys[(inst.gpu, inst.name)] = inst.target
        for key in [k for k in self._watched if keys.get(k) != self._watched[k]]:
            self.activity.unwatch(*key)
            del self._watched[key]
        for name in [n for n in self._targets if want.get(n) != self._targets[n]]:
            self.enforcement.detach(name)
            del self._targets[name]
        for name, target in want.items():
            if name in self._targets:
                continue
            try:
                self.enforcement.attach(name, freezer_from_spec(target))
            except (EnforceError, OSError) as exc:
                log.warning("%s: cannot enforce on %s (%s); it runs unscheduled", name, target, exc)
                continue
            self._targets[name] = target
        for (gpu, name), target in keys.items():
            if (gpu, name) in self._watched:
                continue
            try:
                self.activity.watch_target(gpu, name, target)
            except (KeyError, OSError, ValueError) as exc:
                log.warning("%s: cannot watch its GPU %d use (%s); taken as idle", name, gpu, exc)
                continue
            self._watched[(gpu, name)] = target
        for s in self.schedulers:
            s.poke()

    def stats(self) -> list[dict]:
        """The latest published telemetry of each GPU, as plain data."""
        out = []
        for s in self.schedulers:
            st = s.published
            if st is None:
                continue
            out.append({
                "gpu": st.gpu,
                "uptime": st.time - st.started,
                "slices": st.slices,
                "switches": st.switches,
                "freezes": st.freezes,
                "thaws": st.thaws,
                "enforce_errors": st.enforce_errors,
                "drains": st.drains,
                "drain_seconds": st.drain_seconds,
                "switched": st.switched,
                "lateness": {
                    "count": st.lateness_count,
                    "sum": st.lateness_sum,
                    "max": st.lateness_max,
                    "p50": st.lateness_quantile(0.50),
                    "p99": st.lateness_quantile(0.99),
                },
                "frozen": sorted(s.frozen),
                "instances": {
                    n: {"granted_seconds": i.granted_seconds, "share_1s": i.share_1s, "share_10s": i.share_10s}
                    for n, i in st.instances.items()
                },
            })
        return out

    def trace(self, seconds: float, gpu: int | None = None) -> list[dict]:
        """Each GPU's (or one GPU's) slices over the last `seconds`, for
        `cgpu trace` (cgpud.sched.telemetry.collect; times on trio's clock)."""

        now = trio.current_time()
        return [collect(self.node.gpu(s.gpu), s.telemetry.recent, s.decision, now, seconds, s.params.slice)
                for s in self.schedulers if gpu is None or s.gpu == gpu]

    # ---- service ------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.guard is None:  # (a hot upgrade starts it ahead, to shorten the switch)
            try:
                self.guard = Guard.start(self.registry.path)
            except (GuardError, OSError) as exc:
                log.error("the guard did not start (%s): a crash could leave instances frozen", exc)
        self.sync()
        try:
            async with trio.open_nursery() as nursery:
                for s in self.schedulers:  # (a GPU out of service too: its instances stay isolated)
                    await nursery.start(s.run)
                await nursery.start(self.activity.run, lambda gpu: self.schedulers[gpu].poke())
                nursery.start_soon(self._keep_guard)
                task_status.started()
        finally:
            self.close()

    def set_in_service(self, gpu: int, on: bool) -> None:
        """A GPU went out of service or came back. Its scheduler goes on either way: what it holds at
        its gates stays held (issue 44: a scheduler stopped opened every gate on the GPU, for the
        quiet time at least and for good after three failures, and a tenant whose neighbour is held
        there ran unisolated). Out of service means nothing new is placed on it (placement,
        the device plugin's units Unhealthy). Called in the trio thread."""
        if 0 <= gpu < len(self.schedulers):
            self.schedulers[gpu].poke()

    async def _keep_guard(self) -> None:
        while True:
            await trio.sleep(1.0)
            if self.guard is not None and not self.guard.alive():
                log.warning("the guard died; starting a new one")
                try:
                    self.guard = Guard.start(self.registry.path)
                except (GuardError, OSError) as exc:
                    log.error("the guard did not start again (%s)", exc)

    def close(self) -> None:
        try:
            self.enforcement.close()
        finally:
            if self.guard is not None:
                self.guard.stop()
                self.guard = None
            self.registry.remove_file()
            self.activity.close()
