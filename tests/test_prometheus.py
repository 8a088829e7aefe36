"""A real Prometheus (Debian's `prometheus`, started here on loopback with a
1 s scrape interval and its data in a temporary directory) scrapes a real
daemon; the test asks Prometheus's HTTP API for our series while real
workloads run under `cgpu run`, their weight changes, and they go."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import SIM_T4_BYTES

PROMETHEUS = "/usr/bin/prometheus"
GiB, MiB = 1 << 30, 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, base: Path, target: str) -> None:
        self.base = base
        self.port = free_port()
        cfg = base / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
            "scrape_configs:\n  - job_name: cgpud\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = open(base / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={base / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"prometheus did not get ready:\n{self.log_text()}")
            time.sleep(0.1)

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def query(self, q: str) -> list[tuple[dict, float]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return [(x["metric"], float(x["value"][1])) for x in body["data"]["result"]]

    def value(self, q: str) -> float | None:
        res = self.query(q)
        assert len(res) <= 1, f"{q}: {res}"
        return res[0][1] if res else None

    def wait(self, q: str, pred, what: str, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.value(q)
            if pred(last):
                return last
            time.sleep(0.25)
        pytest.fail(f"Prometheus: {what}: `{q}` is still {last} after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture
def prometheus():
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail(f"{PROMETHEUS} is missing: run ./scripts/setup.sh (Debian package prometheus)")
    made: list[Prometheus] = []
    bases: list[str] = []

    def start(target: str) -> Prometheus:
        base = tempfile.mkdtemp(prefix="cgpud-test-prom-")
        bases.append(base)
        made.append(p := Prometheus(Path(base), target))
        return p

    yield start
    for p in made:
        p.stop()
    for b in bases:
        shutil.rmtree(b, ignore_errors=True)


def metrics_target(daemon) -> str:
    m = re.findall(r"metrics on http://([0-9.]+:\d+)/metrics", daemon.log_text())
    assert m, f"the daemon did not log its metrics address:\n{daemon.log_text()}"
    return m[-1]


def test_prometheus_scrapes_instances_as_they_appear_change_and_go(make_daemon, prometheus):
    daemon = make_daemon(gpus="sim:2xT4")
    prom = prometheus(metrics_target(daemon))
    exe = str(Path(sys.executable).parent / "cgpu")
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    tag = f"{os.getpid() % 10**7:07d}"
    a, b = f"prom{tag}a", f"prom{tag}b"
    procs: list[subprocess.Popen] = []
    try:
        prom.wait('cgpu_gpu_memory_total_bytes{gpu="1"}', lambda v: v == SIM_T4_BYTES, "GPU 1's memory")
        assert prom.value('count(cgpu_gpu_info{name="Tesla T4"})') == 2
        daemon.write("0/policy", "2")
        # A: asks for more than its memsize once (refused), then holds 256 MiB while it works.
        procs.append(subprocess.Popen(
            [exe, "run", "--name", a, "--weight", "1", "--mem", "1G", "--", "sh", "-c",
             f"{exe} mem hold 2G --seconds 0; exec {exe} workload --seconds 60 --mem 256M"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(
            [exe, "run", "--name", b, "--weight", "3", "--mem", "2G", "--", exe, "workload", "--seconds", "60"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def inst(metric: str, name: str) -> str:
            return f'{metric}{{gpu="0",container="{name}"}}'

        prom.wait(inst("cgpu_instance_weight", a), lambda v: v == 1, "A's weight")
        prom.wait(inst("cgpu_instance_weight", b), lambda v: v == 3, "B's weight")
        assert prom.value(inst("cgpu_instance_memsize_bytes", a)) == GiB
        assert prom.value(inst("cgpu_instance_compute_limit_ratio", a)) == 0.25
        assert prom.value(inst("cgpu_instance_compute_limit_ratio", b)) == 0.75
        prom.wait(inst("cgpu_instance_oom_refusals_total", a), lambda v: v == 1, "A's refused allocation")
        prom.wait(inst("cgpu_instance_memory_used_bytes", a), lambda v: v == 256 * MiB, "A's memory")
        prom.wait('cgpu_gpu_memory_used_bytes{gpu="0"}', lambda v: v == 256 * MiB, "GPU 0's memory used")
        assert prom.value('cgpu_gpu_memory_allocated_bytes{gpu="0"}') == 3 * GiB
        assert prom.value('cgpu_gpu_free_weight{gpu="0"}') == 12
        # Both work: the scheduler grants 1:3, and Prometheus sees it.
        prom.wait(inst("cgpu_instance_share_1s_ratio", a), lambda v: v is not None and abs(v - 0.25) < 0.05,
                  "A's share at 1:3")
        prom.wait(inst("cgpu_instance_share_1s_ratio", b), lambda v: v is not None and abs(v - 0.75) < 0.05,
                  "B's share at 1:3")
        prom.wait(f'increase({inst("cgpu_instance_granted_seconds_total", b)}[5s])', lambda v: v and v > 0.5,
                  "B's granted time growing")
        prom.wait('increase(cgpu_gpu_scheduler_switches_total{gpu="0"}[5s])', lambda v: v and v > 10,
                  "switches on GPU 0")
        prom.wait(f'max_over_time({inst("cgpu_instance_frozen", a)}[30s])', lambda v: v == 1,
                  "A seen frozen while B has its turn")
        assert prom.value('cgpu_gpu_slice_lateness_seconds_count{gpu="0"}') > 0

        daemon.write(f"0/{a}/weight", "2")
        prom.wait(inst("cgpu_instance_weight", a), lambda v: v == 2, "A's new weight")
        assert prom.value(inst("cgpu_instance_compute_limit_ratio", a)) == 0.4
        assert prom.value(inst("cgpu_instance_compute_limit_ratio", b)) == 0.6
        prom.wait(inst("cgpu_instance_share_1s_ratio", a), lambda v: v is not None and abs(v - 0.4) < 0.05,
                  "A's share at 2:3")

        for p in procs:
            p.terminate()  # cgpu run passes it on; the workload exits; the instance is deregistered
        for p in procs:
            p.wait(20)
        for name in (a, b):
            prom.wait(f'absent({inst("cgpu_instance_weight", name)})', lambda v: v == 1, f"{name} gone")
            assert prom.query(f'{{container="{name}"}}') == []
        assert prom.value('cgpu_gpu_instances{gpu="0"}') == 0
        assert prom.value('cgpu_gpu_memory_used_bytes{gpu="0"}') == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
