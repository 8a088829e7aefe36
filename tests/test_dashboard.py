"""The Grafana dashboard (deploy/monitoring/cgpud-dashboard.json; issue 48) without Grafana:
every query of every panel is asked of a real Prometheus (Debian's, as tests/test_prometheus.py
starts it) that scrapes a live daemon with tenants at work (two simulated T4s: two workloads at
weights 1 and 3 on GPU 0 under policy 2, one holding memory on GPU 1), and each returns series.
The chart's copy is the same file (tests/test_monitoring.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_prometheus import metrics_target, prometheus  # noqa: F401 - (the fixture)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from dashboard_svg import DASHBOARD, queries  # noqa: E402

CGPU = str(Path(sys.executable).parent / "cgpu")


def test_the_dashboard_is_grafanas_shape():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["schemaVersion"] >= 36
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "instance"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"], p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_every_panels_query_returns_series_from_a_live_daemon(make_daemon, prometheus):  # noqa: F811
    daemon = make_daemon(gpus="sim:2xT4")
    target = metrics_target(daemon)
    prom = prometheus(target)
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    tag = f"{os.getpid() % 10**7:07d}"
    daemon.write("0/policy", "2")
    runs = [
        [CGPU, "run", "--name", f"dash{tag}a", "--gpu", "0", "--weight", "1", "--mem", "2G", "--",
         CGPU, "workload", "--seconds", "90", "--mem", "256M"],
        [CGPU, "run", "--name", f"dash{tag}b", "--gpu", "0", "--weight", "3", "--mem", "4G", "--",
         CGPU, "workload", "--seconds", "90"],
        [CGPU, "run", "--name", f"dash{tag}c", "--gpu", "1", "--mem", "1G", "--",
         CGPU, "mem", "hold", "512M", "--seconds", "90"],
    ]
    procs = [subprocess.Popen(r, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in runs]
    panels = queries(instance=target.replace(".", "\\\\."))
    empty: dict[str, list[str]] = {}
    try:
        deadline = time.monotonic() + 60
        while True:
            empty = {title: [q for q in qs if not prom.query(q)] for title, qs in panels.items()}
            empty = {t: qs for t, qs in empty.items() if qs}
            if not empty or time.monotonic() > deadline:
                break
            assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs if p.poll() is not None]
            time.sleep(1)
        with_data = len(panels) - len(empty)
        print(f"dashboard panels with data: {with_data} / {len(panels)}")
        assert not empty, f"panels whose queries return nothing: {empty}"
        # and they say what runs: both tenants' shares, weight 3 getting about three times weight 1's
        share = {m["container"]: v for m, v in prom.query(f'cgpu_instance_share_10s_ratio{{gpu="0",instance="{target}"}}')}
        assert share[f"dash{tag}b"] > 1.5 * share[f"dash{tag}a"] > 0, share
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
