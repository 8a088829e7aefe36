"""The Prometheus collector (cgpud/observe/metrics.py) on a fresh registry per test:
values from the model, the scheduler's telemetry and the OOM counter; the
snapshot rule (the collector sees only what was published); the compute-limit
rule of each policy; the HTTP server; docs/metrics.md in sync; and the
daemon's --metrics-addr refusals."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
from types import MappingProxyType

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cgpud.observe import exposition, metrics
from cgpud.observe.exposition import CgpuCollector, MetricsServer, parse_addr, registry_for
from cgpud.observe.metrics import METRICS, Publisher, compute_limit
from cgpud.core.model import GpuInfo, Node
from cgpud.sched.telemetry import GpuStats, InstanceStats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "metrics.md")
BEGIN, END = "<!-- table:begin -->\n", "<!-- table:end -->"
GiB = 1 << 30
A, B, C = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"


def make_node() -> Node:
    node = Node([GpuInfo(0, "GPU-zero", "Tesla T4", 16 * GiB), GpuInfo(1, "GPU-one", "Tesla V100", 32 * GiB)])
    node.create_instance(0, A, memsize=4 * GiB, weight=1)
    node.create_instance(0, B, memsize=2 * GiB, weight=3)
    node.create_instance(1, C, memsize=8 * GiB, weight=2, highprio=True)
    node.gpus[0].instances[A].target = {"kind": "cgroup2", "path": "/x", "container": "a" * 64}
    node.set_policy(0, 2)
    node.alloc(0, A, 1234, 512 << 20)
    node.alloc(0, A, 1235, 256 << 20)
    return node


def gpu_stats(gpu: int, **shares) -> GpuStats:
    """The scheduler's own immutable telemetry type, filled with known values."""
    insts = {n: InstanceStats(n, g, s1, s10) for n, (g, s1, s10) in shares.items()}
    return GpuStats(gpu=gpu, time=12.0, started=2.0, slices=100, switches=40, freezes=30, thaws=29,
                    enforce_errors=1, lateness=tuple(i / 1000 for i in range(1, 101)), lateness_count=500,
                    lateness_sum=0.25, lateness_max=0.009, instances=MappingProxyType(insts), recent=())


class FakeSched:
    """What Publisher reads of a GpuScheduler: gpu, published, frozen."""

    def __init__(self, gpu: int, published: GpuStats | None, frozen=frozenset()) -> None:
        self.gpu, self.published, self.frozen = gpu, published, frozenset(frozen)


@pytest.fixture
def setup():
    node = make_node()
    scheds = [FakeSched(0, gpu_stats(0, **{A: (3.5, 0.25, 0.2), B: (9.0, 0.75, 0.7)}), frozen={A}),
              FakeSched(1, None)]
    oom = {(0, A): 3}
    pub = Publisher(node, schedulers=scheds, oom=oom, mode="cgpu", placement="spread")
    reg = registry_for(lambda: pub.current, CollectorRegistry())
    return node, scheds, oom, pub, reg


def val(reg, metric, **labels):
    return reg.get_sample_value(metric, labels)


def inst(name, gpu=0):
    return {"gpu": str(gpu), "uuid": "GPU-zero" if gpu == 0 else "GPU-one", "container": name}


def test_gpu_series(setup):
    node, _, _, _, reg = setup
    g0 = {"gpu": "0", "uuid": "GPU-zero"}
    assert val(reg, "cgpu_gpu_info", **g0, name="Tesla T4") == 1
    assert val(reg, "cgpu_gpu_info", gpu="1", uuid="GPU-one", name="Tesla V100") == 1
    assert val(reg, "cgpu_gpu_memory_total_bytes", **g0) == 16 * GiB
    assert val(reg, "cgpu_gpu_memory_allocated_bytes", **g0) == 6 * GiB
    assert val(reg, "cgpu_gpu_memory_used_bytes", **g0) == 768 << 20
    assert val(reg, "cgpu_gpu_policy", **g0) == 2
    assert val(reg, "cgpu_gpu_max_inst", **g0) == 16
    assert val(reg, "cgpu_gpu_free_weight", **g0) == 12
    assert val(reg, "cgpu_gpu_prio_ratio", **g0) == pytest.approx(0.8)
    assert val(reg, "cgpu_gpu_instances", **g0) == 2
    assert val(reg, "cgpu_gpu_scheduler_switches_total", **g0) == 40
    assert val(reg, "cgpu_gpu_scheduler_slices_total", **g0) == 100
    assert val(reg, "cgpu_gpu_scheduler_enforce_errors_total", **g0) == 1
    assert val(reg, "cgpu_gpu_slice_lateness_seconds_count", **g0) == 500
    assert val(reg, "cgpu_gpu_slice_lateness_seconds_sum", **g0) == 0.25
    assert val(reg, "cgpu_gpu_slice_lateness_seconds", **g0, quantile="0.5") == pytest.approx(0.050)
    assert val(reg, "cgpu_gpu_slice_lateness_seconds", **g0, quantile="0.99") == pytest.approx(0.099)
    assert val(reg, "cgpu_gpu_slice_lateness_max_seconds", **g0) == 0.009
    # GPU 1's scheduler has published nothing yet: no scheduler series, the rest is there
    assert val(reg, "cgpu_gpu_scheduler_switches_total", gpu="1", uuid="GPU-one") is None
    assert val(reg, "cgpu_gpu_memory_allocated_bytes", gpu="1", uuid="GPU-one") == 8 * GiB
    assert val(reg, "cgpu_daemon_info", version=metrics.__version__, mode="cgpu", placement="spread",
               scheduling="1") == 1


def test_instance_series(setup):
    _, _, _, _, reg = setup
    a, b, c = inst(A), inst(B), inst(C, 1)
    assert val(reg, "cgpu_instance_info", **a, id="1", container_id="a" * 64) == 1
    assert val(reg, "cgpu_instance_info", **b, id="2", container_id="") == 1
    assert val(reg, "cgpu_instance_memsize_bytes", **a) == 4 * GiB
    assert val(reg, "cgpu_instance_memory_used_bytes", **a) == 768 << 20
    assert val(reg, "cgpu_instance_memory_used_bytes", **b) == 0
    assert val(reg, "cgpu_instance_weight", **b) == 3
    assert val(reg, "cgpu_instance_highprio", **a) == 0 and val(reg, "cgpu_instance_highprio", **c) == 1
    assert val(reg, "cgpu_instance_compute_limit_ratio", **a) == pytest.approx(0.25)  # policy 2: 1 of 1+3
    assert val(reg, "cgpu_instance_compute_limit_ratio", **b) == pytest.approx(0.75)
    assert val(reg, "cgpu_instance_compute_limit_ratio", **c) == pytest.approx(0.8)  # high priority: prio_ratio
    assert val(reg, "cgpu_instance_share_1s_ratio", **a) == 0.25
    assert val(reg, "cgpu_instance_share_10s_ratio", **b) == 0.7
    assert val(reg, "cgpu_instance_granted_seconds_total", **b) == 9.0
    assert val(reg, "cgpu_instance_granted_seconds_total", **c) == 0  # no telemetry yet
    assert val(reg, "cgpu_instance_oom_refusals_total", **a) == 3
    assert val(reg, "cgpu_instance_oom_refusals_total", **b) == 0
    assert val(reg, "cgpu_instance_frozen", **a) == 1 and val(reg, "cgpu_instance_frozen", **b) == 0


def test_the_collector_reads_only_the_published_snapshot(setup):
    node, scheds, oom, pub, reg = setup
    node.set_weight(0, A, 2)
    node.destroy(B)
    oom[(0, A)] = 4
    scheds[0].frozen = frozenset()
    # nothing published: the scrape shows the old state, whole
    assert val(reg, "cgpu_instance_weight", **inst(A)) == 1
    assert val(reg, "cgpu_instance_weight", **inst(B)) == 3
    assert val(reg, "cgpu_instance_oom_refusals_total", **inst(A)) == 3
    pub.publish()
    assert val(reg, "cgpu_instance_weight", **inst(A)) == 2
    assert val(reg, "cgpu_instance_oom_refusals_total", **inst(A)) == 4
    assert val(reg, "cgpu_instance_frozen", **inst(A)) == 0
    assert val(reg, "cgpu_instance_compute_limit_ratio", **inst(A)) == 1.0  # alone under policy 2
    # a gone instance has no series at all (Prometheus marks them stale)
    for spec in METRICS:
        if "container" in spec.labels:
            assert all(s.labels.get("container") != B for f in reg.collect() for s in f.samples), spec.name
    assert val(reg, "cgpu_gpu_instances", gpu="0", uuid="GPU-zero") == 1


def test_the_snapshot_is_immutable(setup):
    _, _, _, pub, _ = setup
    snap = pub.current
    with pytest.raises(AttributeError):
        snap.gpus[0].policy = 3  # type: ignore[misc]
    assert isinstance(snap.gpus, tuple) and isinstance(snap.gpus[0].instances, tuple)


@pytest.mark.parametrize("policy, expected", [
    (0, [1 / 16, 1 / 16, 0.0, 0.8]),
    (1, [1 / 2, 1 / 2, 0.0, 0.8]),
    (2, [1 / 3, 2 / 3, 0.0, 0.8]),
    (3, [1 / 16, 2 / 16, 0.0, 0.8]),
    (4, [1 / 2, 1 / 2, 0.0, 0.8]),
    (5, [1.0, 1.0, 1.0, 1.0]),
])
def test_compute_limit_rule(policy, expected):
    node = Node([GpuInfo(0, "GPU-z", "x", 16 * GiB)])
    weights = [(A, 1, False), (B, 2, False), ("zeroweight00", 0, False), ("highprio0000", 1, True)]
    for n, w, hp in weights:
        node.create_instance(0, n, memsize=GiB, weight=w, highprio=hp)
    g = node.gpus[0]
    normal = [i for i in g.instances.values() if i.weight > 0 and not i.highprio]
    got = [compute_limit(policy, g.max_inst, g.prio_ratio, g.instances[n], normal) for n, _, _ in weights]
    assert got == pytest.approx(expected)


def test_every_declared_metric_is_collected_and_nothing_else(setup):
    *_, reg = setup
    seen = set()
    for fam in reg.collect():
        for s in fam.samples:
            name = s.name
            for suffix in ("_count", "_sum"):
                if fam.type == "summary" and name.endswith(suffix):
                    name = name[: -len(suffix)]
            seen.add(name)
    assert seen == {s.name for s in METRICS}
    for s in METRICS:
        assert s.name.startswith("cgpu_")
        assert (s.kind == "counter") == s.name.endswith("_total"), s.name
        assert (s.kind == "info") == s.name.endswith("_info"), s.name
        assert (s.unit == "ratio") == s.name.endswith("_ratio"), s.name
        assert (s.unit == "bytes") == s.name.endswith("_bytes"), s.name
        assert (s.unit == "seconds") == ("_seconds" in s.name), s.name


def documented_table() -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)]


def test_docs_table_is_the_declared_table():
    assert documented_table() == metrics.markdown(), (
        "docs/metrics.md is out of date: put the output of `python -m cgpud.observe.metrics` between its markers"
    )
    out = subprocess.run([sys.executable, "-m", "cgpud.observe.metrics"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out == metrics.markdown()


def test_a_fresh_default_registry_works_too():
    reg = CollectorRegistry()
    node = Node([GpuInfo(0, "GPU-z", "x", GiB)])
    pub = Publisher(node)  # no scheduler, no control socket
    reg.register(CgpuCollector(lambda: pub.current))
    assert reg.get_sample_value("cgpu_gpu_instances", {"gpu": "0", "uuid": "GPU-z"}) == 0
    assert reg.get_sample_value("cgpu_daemon_info", {"version": metrics.__version__, "mode": "cgpu",
                                                     "placement": "binpack", "scheduling": "0"}) == 1
    with pytest.raises(ValueError):  # the same names twice in one registry are refused
        reg.register(CgpuCollector(lambda: pub.current))


def samples(text: str) -> dict:
    """(name, labels) -> value of a scrape, its type per family; the snapshot's age left out (it moves)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name != "cgpu_snapshot_age_seconds":
                out[(s.name, frozenset(s.labels.items()))] = (fam.type, s.value)
    return out


def test_the_fast_renderer_says_what_generate_latest_says(setup):
    node, *_, pub, reg = setup
    node.gpus[0].instances[B].target = {"kind": "cgroup2", "path": "/y", "container": 'we"ird\\id\nline'}
    pub.publish()
    from prometheus_client import generate_latest
    fast = exposition.render(pub.current).decode()
    ref = generate_latest(reg).decode()
    assert samples(fast) == samples(ref) and len(samples(fast)) > 50
    assert val(reg, "cgpu_instance_info", **inst(B), id="2", container_id='we"ird\\id\nline') == 1
    # the same HELP and TYPE lines, in the same order
    assert [ln for ln in fast.splitlines() if ln.startswith("#")] == [
        ln for ln in ref.splitlines() if ln.startswith("#")]


def test_http_server_serves_the_registry_on_a_free_port(setup):
    *_, pub, reg = setup
    server = MetricsServer(reg)
    host, port = server.start("127.0.0.1", 0)
    try:
        assert host == "127.0.0.1" and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        w = [s for s in fams["cgpu_instance_weight"].samples if s.labels["container"] == B]
        assert [s.value for s in w] == [3.0]
        assert fams["cgpu_instance_granted_seconds"].type == "counter"
        assert fams["cgpu_gpu_slice_lateness_seconds"].type == "summary"
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_the_daemons_app_serves_ours_then_the_process_metrics(setup):
    *_, pub, _ = setup
    expo = exposition.Exposition(lambda: pub.current, exposition.process_registry())
    pub.subscribe(expo.published)
    server = MetricsServer(exposition.wsgi_app(expo))
    _, port = server.start("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            got = samples(r.read().decode())
    finally:
        server.stop()
    assert got[("cgpu_instance_weight", frozenset(inst(B).items()))] == ("gauge", 3.0)
    assert got[("cgpu_instance_granted_seconds_total", frozenset(inst(B).items()))] == ("counter", 9.0)
    assert got[("process_cpu_seconds_total", frozenset())][1] > 0


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9402", ("127.0.0.1", 9402)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    (":9500", ("127.0.0.1", 9500)),
    ("[::1]:9400", ("::1", 9400)),
    ("off", None), ("", None), (None, None), ("OFF", None),
])
def test_parse_addr(text, expected):
    assert parse_addr(text) == expected


@pytest.mark.parametrize("text", ["9400x", "localhost", "host:port", "127.0.0.1:70000", "127.0.0.1:-1"])
def test_parse_addr_refuses(text):
    with pytest.raises(exposition.BadAddress, match="HOST:PORT"):
        parse_addr(text)


def _serve_once(args: list[str]) -> subprocess.CompletedProcess:
    base = tempfile.mkdtemp(prefix="cgpud-test-metrics-")
    cmd = [os.path.join(os.path.dirname(sys.executable), "cgpud"), "serve", "--gpus", "sim:T4",
           "--mount", f"{base}/mnt", "--state-dir", f"{base}/state", "--socket", f"{base}/s.sock",
           "--dev-dir", f"{base}/dev", "--rt-priority", "0", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    finally:
        subprocess.run(["fusermount3", "-uz", f"{base}/mnt"], capture_output=True)


def test_daemon_refuses_a_bad_or_busy_address_with_one_line():
    r = _serve_once(["--metrics-addr", "nonsense"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: --metrics-addr nonsense: give HOST:PORT (e.g. 127.0.0.1:9402), or `off`")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _serve_once(["--metrics-addr", f"127.0.0.1:{port}"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: --metrics-addr 127.0.0.1:{port}: ") and "in use" in last, r.stderr


def test_changes_are_published_right_after_the_trio_step_that_made_them():
    import trio
    import trio.testing

    node = Node([GpuInfo(0, "GPU-z", "x", 16 * GiB)])
    pub = Publisher(node, period=3600)  # only changes publish here
    taken = []
    real = pub._take
    pub._take = lambda: taken.append(1) or real()  # count the snapshots built

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.run)
            before = pub.current
            node.create_instance(0, A, memsize=GiB)
            pub.changed()
            node.set_weight(0, A, 5)
            pub.changed()
            assert pub.current is before  # the change's own step is not interrupted
            await trio.testing.wait_all_tasks_blocked()
            assert [i.weight for i in pub.current.gpus[0].instances] == [5]
            assert len(taken) == 1  # two changes, one snapshot
            nursery.cancel_scope.cancel()

    trio.run(main)
    node.set_weight(0, A, 6)
    pub.changed()  # not running: at once
    assert [i.weight for i in pub.current.gpus[0].instances] == [6]


def test_a_failing_snapshot_never_stops_the_loop_and_the_last_good_one_stays(caplog):
    import trio
    import trio.testing

    node = Node([GpuInfo(0, "GPU-z", "x", 16 * GiB)])
    pub = Publisher(node, period=0.01)
    good = pub.current
    boom = [True]
    real = pub._take

    def take():
        if boom[0]:
            raise RuntimeError("broken")
        return real()

    pub._take = take

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.run)
            await trio.sleep(0.05)  # several periods, each failing
            assert pub.current is good
            boom[0] = False
            await trio.sleep(0.05)
            assert pub.current is not good
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sum("building a snapshot failed" in r.message for r in caplog.records) == 1  # said once


def test_oom_counts_of_gone_instances_are_dropped(tmp_path):
    """A new instance of the same name starts from 0 (Control.oom_refusals
    forgets instances that are gone after any change)."""
    from cgpud.control.server import Control
    from cgpud.state.durable import Durable
    from cgpud.state.store import Store

    store = Store(str(tmp_path))
    store.open()
    try:
        durable = Durable(Node([GpuInfo(0, "GPU-z", "x", 16 * GiB)]), store)
        ctl = Control(durable)
        pub = Publisher(durable.node, oom=ctl.oom_refusals)
        durable.listeners.append(pub.changed)
        durable.apply(lambda n: n.create_instance(0, A, memsize=GiB))
        ctl.oom_refusals[(0, A)] += 2  # as gpu_alloc (or a watchdog) counts them
        pub.publish()
        assert [i.oom_refusals for i in pub.current.gpus[0].instances] == [2]
        durable.apply(lambda n: n.destroy(A))
        assert (0, A) not in ctl.oom_refusals
        durable.apply(lambda n: n.create_instance(0, A, memsize=GiB))
        assert [i.oom_refusals for i in pub.current.gpus[0].instances] == [0]
    finally:
        store.close()


def test_while_scraped_each_snapshot_is_rendered_when_published(setup):
    node, _, _, pub, reg = setup
    expo = exposition.Exposition(lambda: pub.current, keep=60)
    pub.subscribe(expo.published)
    pub.publish()
    assert expo.rendered is None  # nobody scrapes: no work in the trio thread
    first = expo.body()  # a scrape renders what it finds not rendered
    pub.publish()
    snap, text = expo.rendered
    assert snap is pub.current  # rendered with the snapshot, before any scrape asks
    node.set_weight(0, A, 2)
    pub.publish()
    assert expo.rendered[0] is pub.current and expo.rendered[1] != text
    body = expo.body().decode()
    assert body.endswith(expo.rendered[1].decode())  # the scrape sent those bytes
    assert samples(body)[("cgpu_instance_weight", frozenset(inst(A).items()))] == ("gauge", 2.0)
    assert samples(first.decode())[("cgpu_instance_weight", frozenset(inst(A).items()))] == ("gauge", 1.0)
    from prometheus_client import generate_latest
    assert samples(body) == samples(generate_latest(reg).decode())
    expo.last_scrape -= 61  # no scrape for a minute: publishing renders nothing again
    before = expo.rendered
    pub.publish()
    assert expo.rendered is before


def test_lateness_quantiles_cover_the_last_512_boundaries():
    node = Node([GpuInfo(0, "GPU-z", "x", GiB)])
    old = tuple([1.0] * 3000)  # long ago: a stall
    recent = tuple(i / 100000 for i in range(1, 513))  # 0.01 .. 5.12 ms
    st = gpu_stats(0)
    st = GpuStats(**{**st.__dict__, "lateness": old + recent})
    pub = Publisher(node, schedulers=[FakeSched(0, st)])
    reg = registry_for(lambda: pub.current, CollectorRegistry())
    g = {"gpu": "0", "uuid": "GPU-z"}
    assert val(reg, "cgpu_gpu_slice_lateness_seconds", **g, quantile="0.5") == pytest.approx(256 / 100000)
    assert val(reg, "cgpu_gpu_slice_lateness_seconds", **g, quantile="0.99") == pytest.approx(507 / 100000)
    assert val(reg, "cgpu_gpu_slice_lateness_max_seconds", **g) == 0.009  # the whole run's, as the scheduler says
