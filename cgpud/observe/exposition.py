"""Prometheus metrics over HTTP: the text of a snapshot (observe.metrics),
rendered in the trio thread when a snapshot is published and sent by the
HTTP server's threads (docs/metrics.md). Nothing here touches trio objects
but `serve`, which runs the server's threads from the daemon's nursery.
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import sys
import threading
import time
from typing import Callable, Iterable

from prometheus_client.exposition import generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample


from cgpud.observe.door import DEADLINE, MAX_REQUESTS, BoundedServer, Door
from cgpud.observe.metrics import (
    _LABELS,
    INSTANCE_METRICS,
    METRICS,
    InstanceSnap,
    Labels,
    Publisher,
    Snapshot,
    Spec,
    family_name,
    _Quantiles,
    instance_rows,
    series,
)

log = logging.getLogger("cgpud")

DEFAULT_ADDR = "127.0.0.1:9402"
SWITCH_INTERVAL = 0.0005  # s: the longest a scrape holds the GIL before the scheduler's thread gets it

def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if type(v) is int:
        return str(v)
    if v - v == 0:  # finite
        return repr(float(v))
    return "NaN" if v != v else "+Inf" if v > 0 else "-Inf"


_HEADERS = {
    s.name: (f"# HELP {s.name} {s.help.replace(chr(92), chr(92) * 2)}\n"
             f"# TYPE {s.name} {'gauge' if s.kind == 'info' else s.kind}\n")
    for s in METRICS
}


def _labels_text(labels: Labels) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}" if labels else ""


class Renderer:
    """Renders snapshots in the Prometheus text format 0.0.4, fast.

    prometheus_client's generate_latest takes ~15 µs a sample, and 8 GPUs x
    25 instances are ~2300 samples. Here each label set is escaped once per
    scrape, and an instance whose snapshot did not change since the last
    scrape (most of them: idle instances, settings) reuses its lines.
    tests/test_metrics.py checks the output against generate_latest.
    Shared by the server's threads: the cache is replaced whole, never edited."""

    def __init__(self) -> None:
        self._quantiles = _Quantiles()
        self._lines: dict[InstanceSnap, dict[str, str]] = {}

    def __call__(self, snap: Snapshot) -> bytes:
        rows = series(snap, self._quantiles, instances=False, age=False)
        cache, fresh, per_inst = self._lines, {}, []
        for g in snap.gpus:
            for i in g.instances:
                lines = cache.get(i)
                if lines is None:
                    lines = {}
                    for name, labels, value in instance_rows(i):
                        lines[name] = f"{name}{_labels_text(labels)} {_number(value)}\n"
                fresh[i] = lines
                per_inst.append(lines)
        self._lines = fresh
        rendered: dict[int, str] = {}  # by id: one label tuple is shared by several rows (all alive here)
        parts: list[str] = []
        for s in METRICS[1:]:  # all but the snapshot's age, which only a scrape knows (Exposition)
            name = s.name
            parts.append(_HEADERS[name])
            if name in INSTANCE_METRICS:
                parts.extend(lines[name] for lines in per_inst)
                continue
            for suffix, labels, value in rows[name]:
                text = rendered.get(id(labels))
                if text is None:
                    text = rendered[id(labels)] = _labels_text(labels)
                parts.append(f"{name}{suffix}{text} {_number(value)}\n")
        return "".join(parts).encode()


def age_text(snap: Snapshot) -> str:
    return (_HEADERS["cgpu_snapshot_age_seconds"]
            + f"cgpu_snapshot_age_seconds {_number(max(0.0, time.monotonic() - snap.taken))}\n")


def render(snap: Snapshot) -> bytes:
    """One snapshot in the text format, all of it (a Renderer of its own: no reuse)."""
    return age_text(snap).encode() + Renderer()(snap)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Exposition:
    """What a scrape returns: the latest snapshot as text, then `extra`'s
    metrics (e.g. the daemon's process_* ones).

    While someone scrapes (a scrape in the last `keep` s), the snapshot is
    rendered right after it is built, in the trio thread (`published`), and a
    scrape only sends those bytes. Rendering in the HTTP thread instead would
    hold the GIL for milliseconds in a normal-priority thread: on a loaded
    machine that thread is preempted while holding it, and the real-time
    scheduler's wake-up waits for it (measured: mean slice lateness 0.09 ms
    unscraped, ~1 ms under a 1 s Prometheus, ~4 ms under a tight loop).
    A scrape finding no bytes for the current snapshot renders it itself."""

    def __init__(self, source: Callable[[], Snapshot], extra: CollectorRegistry | None = None,
                 keep: float = 60.0) -> None:
        self.source, self.extra, self.keep = source, extra, keep
        self.renderer = Renderer()
        self.rendered: tuple[Snapshot, bytes] | None = None
        self.last_scrape = -float("inf")  # time.monotonic() of the last scrape (set by the HTTP threads)
        self.untenanted: tuple[bytes, bytes] | None = None  # (a rendered text, the same without tenants)

    def published(self, snap: Snapshot) -> None:
        """A new snapshot (trio thread): render it now if it will be scraped."""
        if time.monotonic() - self.last_scrape < self.keep:
            self.rendered = (snap, self.renderer(snap))

    def body(self, tenants: bool = True) -> bytes:
        """A scrape's response body (HTTP threads); tenants=False: without the per-instance series
        (observe.door decides who gets them)."""
        self.last_scrape = time.monotonic()
        snap = self.source()
        done = self.rendered
        text = done[1] if done is not None and done[0] is snap else self.renderer(snap)
        if not tenants:
            kept = self.untenanted
            if kept is not None and kept[0] is text:
                text = kept[1]
            else:
                plain = b"".join(line for line in text.splitlines(keepends=True) if not _tenant_line(line))
                self.untenanted, text = (text, plain), plain
        body = age_text(snap).encode() + text
        if self.extra is not None:
            body += generate_latest(self.extra)
        return body


_TENANT_PREFIXES = (b"cgpu_instance_", b"# HELP cgpu_instance_", b"# TYPE cgpu_instance_")


def _tenant_line(line: bytes) -> bool:
    return line.startswith(_TENANT_PREFIXES)


def wsgi_app(exposition: Exposition, door: Door | None = None):
    """A WSGI app serving `exposition.body()` at any path, to whom `door` lets in (None: anyone,
    every series)."""

    def app(environ, start_response):
        answer = door.check(environ) if door is not None else None
        if answer is not None and not answer.status.startswith("200"):
            text = f"{answer.status}: {answer.reason}\n".encode()
            headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(text)))]
            if answer.status.startswith("401"):
                headers.append(("WWW-Authenticate", 'Bearer realm="cgpud metrics"'))
            start_response(answer.status, headers)
            return [text]
        body = exposition.body(tenants=answer is None or answer.tenants)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    return app


class BadAddress(ValueError):
    pass


def parse_addr(text: str | None) -> tuple[str, int] | None:
    """`HOST:PORT` (`[v6]:PORT`; `:PORT` = loopback) -> (host, port); `off`,
    `none` or empty -> None (no metrics)."""
    text = (text or "").strip()
    if text.lower() in ("", "off", "none", "no", "0"):
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise BadAddress(f"--metrics-addr {text}: give HOST:PORT (e.g. {DEFAULT_ADDR}), or `off`")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "127.0.0.1", int(port)


class MetricsServer:
    """Serves a registry, or a WSGI app such as `wsgi_app(...)`, over HTTP (or HTTPS with `tls`)
    (`/metrics`, or any path) from a thread of its own, at normal scheduling priority (the daemon
    runs real-time and threads inherit that); at most `max_requests` connections at once, each for
    at most `deadline` s (observe.door.BoundedServer)."""

    def __init__(self, what, *, max_requests: int = MAX_REQUESTS, deadline: float = DEADLINE,
                 tls: ssl.SSLContext | None = None) -> None:
        self.app = make_wsgi_app(what) if isinstance(what, CollectorRegistry) else what
        self.max_requests, self.deadline, self.tls = max_requests, deadline, tls
        self.httpd: BoundedServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; the bound (host, port). OSError when it cannot bind."""
        self.httpd = BoundedServer((host, port), self.app, max_requests=self.max_requests,
                                   deadline=self.deadline, tls=self.tls)
        self._thread = threading.Thread(target=self._serve, name="cgpud-metrics", daemon=True)
        self._thread.start()
        return self.httpd.server_address[:2]

    def _serve(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        try:  # its name for top -H and /proc/PID/task (Python names its threads for itself only)
            import ctypes

            ctypes.CDLL(None).prctl(15, b"cgpud-metrics", 0, 0, 0)  # PR_SET_NAME: this thread
        except (OSError, AttributeError):
            pass
        # One connection accepted at a time, blocking until one comes or an open one is overdue: no
        # polling while none is open. stop() shuts the listening socket down, which wakes the wait;
        # its accept then fails and the loop sees it is stopping. Each connection is served by a
        # thread of its own (new threads are SCHED_OTHER: they inherit this thread's policy).
        httpd = self.httpd
        while not self._stopping:
            httpd.timeout = httpd.next_wait()
            httpd.handle_request()

    def stop(self) -> None:
        if self.httpd is not None:
            self._stopping = True
            try:
                self.httpd.socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if self.httpd is not None:
            self.httpd.server_close()
            self.httpd = None


def process_registry() -> CollectorRegistry:
    """The daemon's own process_* metrics (CPU seconds, memory, open fds)."""
    from prometheus_client import ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


async def serve(addr: tuple[str, int], publisher: Publisher, *, extra: CollectorRegistry | None = None,
                door: Door | None = None, tls: ssl.SSLContext | None = None, task_status=None) -> None:
    """Serve metrics at `addr` (ours, then `extra`'s: by default the
    process_* metrics) to whom `door` lets in (None: Door("none")), over TLS
    with `tls`, and keep the snapshot fresh until cancelled.
    OSError (before `started`) when the address cannot be bound."""
    import trio

    # A scrape renders in this process, holding the GIL in turns with the
    # scheduler's thread. The scheduler waits for it at most one switch
    # interval per wake-up: 5 ms by default, half a slice; 0.5 ms here.
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
    expo = Exposition(lambda: publisher.current, process_registry() if extra is None else extra)
    publisher.subscribe(expo.published)
    door = door if door is not None else Door("none")
    server = MetricsServer(wsgi_app(expo, door), tls=tls)
    host, port = server.start(*addr)
    try:
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics on %s://%s:%d/metrics (%s)", "https" if tls is not None else "http", shown, port,
                 {"kubernetes": "bearer token and RBAC checked (TokenReview, SubjectAccessReview)",
                  "open": "every series to anyone"}.get(door.auth, "per-instance series to loopback clients only"))
        if task_status is not None:
            task_status.started((host, port))
        await publisher.run()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.stop)


class CgpuCollector(Collector):
    """Turns the latest snapshot into metric families, for any
    CollectorRegistry. `source` returns it (e.g. `lambda: publisher.current`);
    it is only read, never changed."""

    def __init__(self, source: Callable[[], Snapshot]) -> None:
        self.source = source
        self._quantiles = _Quantiles()

    def describe(self) -> Iterable[Metric]:
        return [self._family(s) for s in METRICS]

    @staticmethod
    def _family(s: Spec) -> Metric:
        fam, labels = family_name(s), list(_LABELS[s.name])
        if s.kind == "gauge":
            return GaugeMetricFamily(fam, s.help, labels=labels)
        if s.kind == "counter":
            return CounterMetricFamily(fam, s.help, labels=labels)
        if s.kind == "info":
            return InfoMetricFamily(fam, s.help, labels=[])
        return SummaryMetricFamily(fam, s.help, labels=labels)

    def collect(self) -> Iterable[Metric]:
        rows = series(self.source(), self._quantiles)
        out = []
        for s in METRICS:
            fam = self._family(s)
            fam.samples.extend(Sample(s.name + suffix, dict(labels), value) for suffix, labels, value in rows[s.name])
            out.append(fam)
        return out


def registry_for(source: Callable[[], Snapshot], registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """A registry (a fresh one unless given) holding our collector."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(CgpuCollector(source))
    return registry
