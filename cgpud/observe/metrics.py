"""Prometheus metrics (SPEC §7) over an immutable snapshot.

Two threads, one rule: the HTTP server's threads never touch trio objects.

- In the trio thread, `Publisher.publish()` copies what the metrics need out
  of the model (`Node`), the schedulers (their published `GpuStats`, which are
  immutable already, and the set each holds frozen) and the out-of-memory
  counter into a `Snapshot` of named tuples, and replaces `Publisher.current`
  with it in one assignment. It runs every `period` seconds and after the
  changes that land (a `Durable` listener, `Publisher.changed`). While
  someone scrapes, the snapshot is rendered as text right then too
  (`Exposition.published`; why: docs/metrics.md).
- In the HTTP server's threads (observe.exposition), `Exposition.body()` reads those references
  and sends the text (rendering it only if it finds none for the current
  snapshot). `CgpuCollector` (there too) offers the same as metric
  families for any CollectorRegistry. The exposition learns of each new
  snapshot as any reader would, by `Publisher.subscribe`: this module knows
  nothing of who reads it.

Every metric is declared once in `METRICS`; docs/metrics.md's table is
generated from it (`python -m cgpud.observe.metrics`) and a test keeps them equal.

The configured compute limit (`cgpu_instance_compute_limit_ratio`) is what
the GPU's policy promises the instance when every instance is active and no
high-priority instance runs (SPEC §5, docs/metrics.md).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

from cgpud import __version__

log = logging.getLogger("cgpud")

LATENESS_QUANTILES = (0.5, 0.99)
LATENESS_RECENT = 512  # boundaries the quantiles cover: sorting all 4096 the scheduler keeps, for 8 GPUs
                       # every 0.5 s, would cost ~5 ms of the trio thread each time
GPU_LABELS = ("gpu", "uuid")
INSTANCE_LABELS = ("gpu", "uuid", "container")


# ---- the declared metrics ------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str  # as exposed (an info's `_info`, a counter's `_total` included)
    kind: str  # gauge, counter, info, summary
    labels: tuple[str, ...]
    unit: str
    help: str


METRICS: tuple[Spec, ...] = (
    Spec("cgpu_snapshot_age_seconds", "gauge", (), "seconds",
         "How old the snapshot this scrape reads is (it is renewed every 0.5 s and after every change; "
         "a large value means the daemon's event loop is stuck)."),
    Spec("cgpu_daemon_info", "info", ("version", "mode", "placement", "scheduling"), "—",
         "The daemon: its version, node mode, placement strategy, and whether it schedules (1, else 0)."),
    Spec("cgpu_container_starts_refused_total", "counter", (), "—",
         "Container starts the container hook or cgpu-runtime refused (the container did not start) since the "
         "daemon started."),
    Spec("cgpu_gpu_info", "info", GPU_LABELS + ("name",), "—", "One per GPU: index (`gpu`), UUID and model name."),
    Spec("cgpu_gpu_memory_total_bytes", "gauge", GPU_LABELS, "bytes", "The device's memory."),
    Spec("cgpu_gpu_memory_allocated_bytes", "gauge", GPU_LABELS, "bytes",
         "Σ memsize of the GPU's instances; it may pass the device, since memsizes overcommit (SPEC §3)."),
    Spec("cgpu_gpu_memory_used_bytes", "gauge", GPU_LABELS, "bytes",
         "Σ memory the instances' processes hold (simulated GPUs: their allocations)."),
    Spec("cgpu_gpu_policy", "gauge", GPU_LABELS, "—", "The compute policy, 0..5 (`N/policy`)."),
    Spec("cgpu_gpu_max_inst", "gauge", GPU_LABELS, "—", "The most instances the GPU may hold (`N/max_inst`)."),
    Spec("cgpu_gpu_free_weight", "gauge", GPU_LABELS, "—", "max_inst − Σ weight (`N/free_weight`)."),
    Spec("cgpu_gpu_prio_ratio", "gauge", GPU_LABELS, "ratio",
         "The most of the GPU high-priority instances may take, 0.20..0.99 (`N/prio_ratio` ÷ 100)."),
    Spec("cgpu_gpu_instances", "gauge", GPU_LABELS, "—", "How many instances the GPU holds."),
    Spec("cgpu_gpu_healthy", "gauge", GPU_LABELS, "—",
         "1 while the GPU is in service, 0 while it is out (a critical Xid, a double-bit ECC error, lost; "
         "docs/gpus.md, Health)."),
    Spec("cgpu_gpu_last_xid", "gauge", GPU_LABELS, "—",
         "The last critical Xid error of the GPU since the daemon started (0: none); kept after it recovers."),
    Spec("cgpu_gpu_failures_total", "counter", GPU_LABELS, "—",
         "Times the GPU went out of service since the daemon started."),
    Spec("cgpu_gpu_watchdog_kills_total", "counter", GPU_LABELS, "—",
         "Processes the memory watchdog signalled (--mem-action kill or term) for passing their instance's "
         "memsize, since the daemon started (kept after the instance goes)."),
    Spec("cgpu_gpu_scheduler_slices_total", "counter", GPU_LABELS, "—",
         "Decisions (slices) the GPU's scheduler has made since the daemon started."),
    Spec("cgpu_gpu_scheduler_switches_total", "counter", GPU_LABELS, "—",
         "Slice boundaries at which the set of instances allowed to run changed."),
    Spec("cgpu_gpu_scheduler_freezes_total", "counter", GPU_LABELS, "—", "Freezes the scheduler made."),
    Spec("cgpu_gpu_scheduler_thaws_total", "counter", GPU_LABELS, "—", "Thaws the scheduler made."),
    Spec("cgpu_gpu_scheduler_enforce_errors_total", "counter", GPU_LABELS, "—",
         "Freezes or thaws that failed (each is retried at the next boundary)."),
    Spec("cgpu_gpu_slice_lateness_seconds", "summary", GPU_LABELS + ("quantile",), "seconds",
         "Wake-up minus the planned slice boundary: `_count` and `_sum` over the whole run, quantiles "
         "0.5 and 0.99 over the last 512 boundaries."),
    Spec("cgpu_gpu_slice_lateness_max_seconds", "gauge", GPU_LABELS, "seconds",
         "The latest wake-up after a planned boundary since the daemon started."),
    Spec("cgpu_instance_info", "info", INSTANCE_LABELS + ("id", "container_id"), "—",
         "One per instance: its number (`id`, the cGPU device minor) and the full container ID the "
         "container hook registered (empty for `cgpu run` and `inst_ctl`)."),
    Spec("cgpu_instance_memsize_bytes", "gauge", INSTANCE_LABELS, "bytes",
         "The instance's memory limit, which it sees as its GPU's total (`memsize`)."),
    Spec("cgpu_instance_memory_used_bytes", "gauge", INSTANCE_LABELS, "bytes",
         "Memory the instance's processes hold."),
    Spec("cgpu_instance_weight", "gauge", INSTANCE_LABELS, "—", "The instance's weight, 0..max_inst."),
    Spec("cgpu_instance_highprio", "gauge", INSTANCE_LABELS, "—", "1 for a high-priority instance, else 0."),
    Spec("cgpu_instance_compute_limit_ratio", "gauge", INSTANCE_LABELS, "ratio",
         "The share of the GPU the policy promises the instance (the rule is below)."),
    Spec("cgpu_instance_share_1s_ratio", "gauge", INSTANCE_LABELS, "ratio",
         "The share of the GPU's time the instance was allowed to use over the last second (while active)."),
    Spec("cgpu_instance_share_10s_ratio", "gauge", INSTANCE_LABELS, "ratio",
         "The same over the last 10 seconds."),
    Spec("cgpu_instance_granted_seconds_total", "counter", INSTANCE_LABELS, "seconds",
         "GPU time the instance was allowed to use while active, since it appeared."),
    Spec("cgpu_instance_oom_refusals_total", "counter", INSTANCE_LABELS, "—",
         "Out-of-memory events: allocations refused past memsize (simulated GPUs) and processes the "
         "memory watchdog failed (real GPUs)."),
    Spec("cgpu_instance_frozen", "gauge", INSTANCE_LABELS, "—",
         "1 while the scheduler holds the instance frozen (active and not its turn), else 0."),
)

# The `quantile` label belongs to the summary's samples, not to its families.
_LABELS = {s.name: tuple(lbl for lbl in s.labels if lbl != "quantile") for s in METRICS}


def family_name(spec: Spec) -> str:
    """The name prometheus_client's families take (without `_info`/`_total`)."""
    for suffix in ("_info", "_total"):
        if spec.kind in ("info", "counter") and spec.name.endswith(suffix):
            return spec.name[: -len(suffix)]
    return spec.name


def markdown() -> str:
    """docs/metrics.md's table, from METRICS."""
    lines = ["| name | type | labels | unit | meaning |", "|---|---|---|---|---|"]
    for s in METRICS:
        labels = ", ".join(f"`{lbl}`" for lbl in s.labels) or "—"
        lines.append(f"| `{s.name}` | {s.kind} | {labels} | {s.unit} | {s.help} |")
    return "\n".join(lines) + "\n"


# ---- the snapshot (built in the trio thread) ------------------------------------
# Named tuples: immutable, and ~5x cheaper to build than frozen dataclasses
# (200 instances: ~0.4 ms of the trio thread per snapshot).


class InstanceSnap(NamedTuple):
    gpu: int
    uuid: str
    name: str
    id: int
    container_id: str
    memsize: int
    used: int
    weight: int
    highprio: bool
    limit: float
    granted_seconds: float
    share_1s: float
    share_10s: float
    oom_refusals: int
    frozen: bool


class GpuSnap(NamedTuple):
    index: int
    uuid: str
    name: str
    memory: int
    allocated: int
    used: int
    policy: int
    max_inst: int
    free_weight: int
    prio_ratio: int
    stats: object | None  # the scheduler's GpuStats (immutable), None when it does not run
    instances: tuple[InstanceSnap, ...]
    healthy: bool = True  # its health (cgpud/gpus/health.py)
    last_xid: int = 0
    failures: int = 0
    watchdog_kills: int = 0


@dataclass(frozen=True)
class Snapshot:
    taken: float  # time.monotonic()
    version: str
    mode: str
    placement: str
    scheduling: bool
    gpus: tuple[GpuSnap, ...]
    starts_refused: int = 0


def compute_limit(policy: int, max_inst: int, prio_ratio: int, inst, normal: Sequence) -> float:
    """What the GPU's policy promises `inst` (SPEC §5), as a ratio 0..1, when
    every instance is active and no high-priority one runs. `normal`: the
    GPU's eligible (weight > 0) instances that are not high priority.

    5 native: 1 (no control). Weight 0: 0 under 0..4. High priority: at most
    prio_ratio %. Otherwise 0 fair: 1/max_inst; 1 preemptive and 4 weak:
    1/len(normal); 2 weighted: w/Σw over `normal`; 3 fixed: w/max_inst.
    """
    if policy == 5:
        return 1.0
    if inst.weight <= 0:
        return 0.0
    if inst.highprio:
        return prio_ratio / 100.0
    if policy == 0:
        return 1.0 / max_inst
    if policy in (1, 4):
        return 1.0 / max(1, len(normal))
    if policy == 2:
        total = sum(i.weight for i in normal)
        return inst.weight / total if total else 0.0
    if policy == 3:
        return min(1.0, inst.weight / max_inst)
    raise ValueError(f"no policy {policy}")


def take(
    node,
    *,
    stats: Mapping[int, object | None] = {},
    frozen: Mapping[int, frozenset[str]] = {},
    oom: Mapping[tuple[int, str], int] = {},
    kills: Mapping[tuple[int, str], int] = {},
    starts_refused: int = 0,
    mode: str = "cgpu",
    placement: str = "binpack",
    scheduling: bool = True,
    now: float | None = None,
) -> Snapshot:
    """Copy what the metrics show out of live objects (call in the trio thread)."""
    gpus, killed = [], {g: sum(n for (k, _), n in kills.items() if k == g) for g, _ in kills}
    for g in node.gpus:
        st = stats.get(g.index)
        per = st.instances if st is not None else {}
        held = frozen.get(g.index, frozenset())
        insts = list(g.instances.values())
        normal = [i for i in insts if i.weight > 0 and not i.highprio]
        snaps = []
        for i in insts:
            tel = per.get(i.name)
            snaps.append(InstanceSnap(
                gpu=g.index, uuid=g.info.uuid, name=i.name, id=i.id,
                container_id=str((i.target or {}).get("container", "")),
                memsize=i.memsize, used=i.used, weight=i.weight, highprio=bool(i.highprio),
                limit=compute_limit(g.policy, g.max_inst, g.prio_ratio, i, normal),
                granted_seconds=tel.granted_seconds if tel else 0.0,
                share_1s=tel.share_1s if tel else 0.0,
                share_10s=tel.share_10s if tel else 0.0,
                oom_refusals=int(oom.get((g.index, i.name), 0)),
                frozen=i.name in held,
            ))
        gpus.append(GpuSnap(
            index=g.index, uuid=g.info.uuid, name=g.info.name, memory=g.info.memory,
            allocated=sum(s.memsize for s in snaps), used=sum(s.used for s in snaps),
            policy=g.policy, max_inst=g.max_inst, free_weight=g.free_weight, prio_ratio=g.prio_ratio,
            stats=st, instances=tuple(snaps), healthy=bool(g.health.get("healthy", True)),
            last_xid=int(g.health.get("last_xid", 0)), failures=int(g.health.get("failures", 0)),
            watchdog_kills=killed.get(g.index, 0),
        ))
    return Snapshot(time.monotonic() if now is None else now, __version__, mode, placement, scheduling, tuple(gpus),
                    starts_refused)


class Publisher:
    """Keeps `current`, the latest Snapshot (a background service: `run`).

    `schedulers`: objects with `gpu`, `published` (GpuStats or None) and
    `frozen` (a frozenset), i.e. the daemon's GpuSchedulers. `oom`: counts of
    out-of-memory events by (gpu, instance name), fed by whoever sees them;
    `events()`: (the memory watchdog's kills by (gpu, instance name), container starts refused).
    """

    def __init__(self, node, *, schedulers: Sequence | Callable[[], Sequence] = (), oom: Mapping[tuple[int, str], int] | None = None,
                 mode: str = "cgpu", placement: str = "binpack", period: float = 0.5,
                 events: Callable[[], tuple[Mapping[tuple[int, str], int], int]] = lambda: ({}, 0)) -> None:
        self.node, self.events = node, events
        # a list, or a callable giving the schedulers running now (a hot upgrade replaces them)
        self._schedulers = schedulers if callable(schedulers) else list(schedulers)
        self.oom = oom if oom is not None else {}
        self.mode, self.placement = mode, placement
        self.period = period
        self._wake = None  # a trio.Event while run() runs
        self._listeners: list[Callable[[Snapshot], None]] = []  # told of each new snapshot
        self._failed = False
        self.current: Snapshot = self._take()

    @property
    def schedulers(self) -> list:
        return list(self._schedulers()) if callable(self._schedulers) else self._schedulers

    def _take(self) -> Snapshot:
        scheds = self.schedulers
        kills, refused = self.events()
        return take(
            self.node,
            stats={s.gpu: s.published for s in scheds},
            frozen={s.gpu: s.frozen for s in scheds},
            oom=self.oom, kills=kills, starts_refused=refused, mode=self.mode, placement=self.placement, scheduling=bool(scheds),
        )

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        """Call `listener(snapshot)` with each snapshot made current, in the trio thread (the
        exposition renders it there while someone scrapes)."""
        self._listeners.append(listener)

    def publish(self) -> None:
        """Build a new snapshot and make it current (trio thread only)."""
        self.current = self._take()
        for listener in self._listeners:
            listener(self.current)

    def changed(self) -> None:
        """A Durable listener: publish soon. While `run` runs, changes made
        within one trio step are published once, right after it."""
        if self._wake is not None:
            self._wake.set()
        else:
            self.publish()

    async def run(self, *, task_status=None) -> None:
        import trio

        self._wake = trio.Event()
        if task_status is not None:
            task_status.started()
        try:
            while True:
                with trio.move_on_after(self.period):
                    await self._wake.wait()
                self._wake = trio.Event()
                try:
                    self.publish()
                except Exception:  # noqa: BLE001 - metrics must never stop the daemon
                    if not self._failed:
                        log.exception("metrics: building a snapshot failed; scrapes show the last good one")
                    self._failed = True
                else:
                    self._failed = False
        finally:
            self._wake = None


# ---- reading a snapshot (in the HTTP server's threads) ----------------------------

Labels = tuple[tuple[str, str], ...]
Row = tuple[str, Labels, float]  # (sample suffix: "", "_count", "_sum"; labels; value)


class _Quantiles:
    """Lateness quantiles per GPU, computed once per published GpuStats."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[object, tuple[float, ...]]] = {}

    def __call__(self, gpu: int, st) -> tuple[float, ...]:
        cached = self._cache.get(gpu)
        if cached is not None and cached[0] is st:
            return cached[1]
        xs = sorted(st.lateness[-LATENESS_RECENT:])
        qs = tuple(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else 0.0
                   for q in LATENESS_QUANTILES)
        self._cache[gpu] = (st, qs)
        return qs


def series(snap: Snapshot, quantiles: Callable[[int, object], tuple[float, ...]] | None = None,
           *, instances: bool = True, age: bool = True) -> dict[str, list[Row]]:
    """Every sample of the snapshot, by declared metric name (METRICS order);
    instances=False: without the per-instance ones."""
    quantiles = quantiles or _Quantiles()
    out: dict[str, list[Row]] = {s.name: [] for s in METRICS}
    out["cgpu_daemon_info"].append(("", (("version", snap.version), ("mode", snap.mode), ("placement", snap.placement),
                                         ("scheduling", str(int(snap.scheduling)))), 1))
    out["cgpu_container_starts_refused_total"].append(("", (), snap.starts_refused))
    if age:
        out["cgpu_snapshot_age_seconds"].append(("", (), max(0.0, time.monotonic() - snap.taken)))
    for g in snap.gpus:
        gl = (("gpu", str(g.index)), ("uuid", g.uuid))
        out["cgpu_gpu_info"].append(("", gl + (("name", g.name),), 1))
        for key, value in (
            ("cgpu_gpu_memory_total_bytes", g.memory),
            ("cgpu_gpu_memory_allocated_bytes", g.allocated),
            ("cgpu_gpu_memory_used_bytes", g.used),
            ("cgpu_gpu_policy", g.policy),
            ("cgpu_gpu_max_inst", g.max_inst),
            ("cgpu_gpu_free_weight", g.free_weight),
            ("cgpu_gpu_prio_ratio", g.prio_ratio / 100.0),
            ("cgpu_gpu_instances", len(g.instances)),
            ("cgpu_gpu_healthy", int(g.healthy)),
            ("cgpu_gpu_last_xid", g.last_xid),
            ("cgpu_gpu_failures_total", g.failures),
            ("cgpu_gpu_watchdog_kills_total", g.watchdog_kills),
        ):
            out[key].append(("", gl, value))
        st = g.stats
        if st is not None:
            for key, value in (
                ("cgpu_gpu_scheduler_slices_total", st.slices),
                ("cgpu_gpu_scheduler_switches_total", st.switches),
                ("cgpu_gpu_scheduler_freezes_total", st.freezes),
                ("cgpu_gpu_scheduler_thaws_total", st.thaws),
                ("cgpu_gpu_scheduler_enforce_errors_total", st.enforce_errors),
                ("cgpu_gpu_slice_lateness_max_seconds", st.lateness_max),
            ):
                out[key].append(("", gl, value))
            lateness = out["cgpu_gpu_slice_lateness_seconds"]
            for q, v in zip(LATENESS_QUANTILES, quantiles(g.index, st)):
                lateness.append(("", gl + (("quantile", str(q)),), v))
            lateness.append(("_count", gl, st.lateness_count))
            lateness.append(("_sum", gl, st.lateness_sum))
        if instances:
            for i in g.instances:
                for key, labels, value in instance_rows(i):
                    out[key].append(("", labels, value))
    return out


def instance_rows(i: InstanceSnap) -> tuple[tuple[str, Labels, float], ...]:
    """The samples of one instance: (metric name, labels, value)."""
    il = (("gpu", str(i.gpu)), ("uuid", i.uuid), ("container", i.name))
    return (
        ("cgpu_instance_info", il + (("id", str(i.id)), ("container_id", i.container_id)), 1),
        ("cgpu_instance_memsize_bytes", il, i.memsize),
        ("cgpu_instance_memory_used_bytes", il, i.used),
        ("cgpu_instance_weight", il, i.weight),
        ("cgpu_instance_highprio", il, int(i.highprio)),
        ("cgpu_instance_compute_limit_ratio", il, i.limit),
        ("cgpu_instance_share_1s_ratio", il, i.share_1s),
        ("cgpu_instance_share_10s_ratio", il, i.share_10s),
        ("cgpu_instance_granted_seconds_total", il, i.granted_seconds),
        ("cgpu_instance_oom_refusals_total", il, i.oom_refusals),
        ("cgpu_instance_frozen", il, int(i.frozen)),
    )


INSTANCE_METRICS = frozenset(s.name for s in METRICS if s.name.startswith("cgpu_instance_"))


if __name__ == "__main__":
    print(markdown(), end="")
