"""cgpud's alerts (deploy/monitoring/cgpud-alerts.yaml; issue 48) under `promtool test rules`
(Debian's prometheus package), on series shaped exactly as cgpud exports them: a healthy node's
series are the daemon's own exposition of a snapshot (`exposition.render`, parsed back), each with
the `job` and `instance` Prometheus adds; each fault changes the values of those series only.
Each alert fires on its fault, with its labels and annotations, and stays silent on the healthy
node. The counters the alerts need (starts refused, watchdog kills) are counted by a real daemon
(test_starts_refused_are_counted)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cgpud.core.model import GpuInfo, Node
from cgpud.observe import exposition, metrics
from cgpud.sched.telemetry import GpuStats, InstanceStats

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "monitoring" / "cgpud-alerts.yaml"
PROMTOOL = "/usr/bin/promtool"
GiB = 1 << 30
A, B = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
JOB, INST = "cgpud-metrics", "10.0.0.7:9402"
STEPS = 100  # samples of 15 s: 25 minutes
SPEC = {s.name: s for s in metrics.METRICS}


def healthy_series() -> dict[tuple[str, tuple], str]:
    """(name, labels) -> promtool values of a healthy node: one T4 under policy 2 with two
    working instances at weights 1 and 3 getting their shares, as the daemon renders it."""
    node = Node([GpuInfo(0, "GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789a0", "Tesla T4", 15109 << 20)])
    node.create_instance(0, A, memsize=4 * GiB, weight=1)
    node.create_instance(0, B, memsize=8 * GiB, weight=3)
    node.set_policy(0, 2)
    insts = {A: InstanceStats(A, 30.0, 0.25, 0.25), B: InstanceStats(B, 90.0, 0.75, 0.75)}
    stats = GpuStats(gpu=0, time=120.0, started=0.0, slices=12000, switches=6000, freezes=3000, thaws=3000,
                     enforce_errors=0, lateness=(0.0001,) * 10, lateness_count=12000, lateness_sum=1.2,
                     lateness_max=0.002, instances=MappingProxyType(insts), recent=())
    snap = metrics.take(node, stats={0: stats}, frozen={0: frozenset({A})}, now=None)
    text = exposition.render(snap).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            base = s.name
            for suffix in ("_count", "_sum"):
                if base.endswith(suffix) and base[: -len(suffix)] in SPEC:
                    base = base[: -len(suffix)]
            spec = SPEC.get(base) or SPEC.get(base + "_total")
            assert spec is not None, f"{s.name}: not a declared metric"
            assert set(labels) == set(spec.labels) - ({"quantile"} if "quantile" not in labels else set()), s
            labels |= {"job": JOB, "instance": INST}
            value = s.value
            if s.name.endswith("_total") and "granted" in s.name:
                values = f"{value:g}+{15 * (0.25 if labels['container'] == A else 0.75):g}x{STEPS}"
            else:
                values = f"{value:g}x{STEPS}"
            out[(s.name, tuple(sorted(labels.items())))] = values
    out[("up", (("instance", INST), ("job", JOB)))] = f"1x{STEPS}"
    return out


def change(series: dict, name: str, values: str, **match) -> dict:
    """A copy of `series` with the values of `name`'s series whose labels match replaced."""
    out, hit = dict(series), 0
    for (n, labels), _ in series.items():
        if n == name and all(dict(labels).get(k) == v for k, v in match.items()):
            out[(n, labels)], hit = values, hit + 1
    assert hit, f"no series {name} {match}"
    return out


GPU = {"gpu": "0", "uuid": "GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789a0"}
HEALTHY = healthy_series()
RULE = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
ALERTS = sorted(RULE)


def desc(alert: str, **subst) -> str:
    text = " ".join(RULE[alert]["annotations"]["description"].split())
    for k, v in subst.items():
        text = text.replace("{{ $labels.%s }}" % k, v)
    return text


# alert -> (the fault's series, when to look, the labels and summary it fires with)
FAULTS = {
    "CgpuGpuOutOfService": (change(HEALTHY, "cgpu_gpu_healthy", f"1x10 0x{STEPS - 10}"), "10m",
                            {**GPU, "job": JOB, "instance": INST}, f"GPU 0 of {INST} is out of service",
                            desc("CgpuGpuOutOfService", **GPU)),
    "CgpuWatchdogKilled": (change(HEALTHY, "cgpu_gpu_watchdog_kills_total", f"0x10 1x{STEPS - 10}"), "5m",
                           {**GPU, "job": JOB, "instance": INST},
                           f"The memory watchdog killed a process on GPU 0 of {INST}", desc("CgpuWatchdogKilled")),
    "CgpuContainerStartRefused": (change(HEALTHY, "cgpu_container_starts_refused_total", f"0x10 2x{STEPS - 10}"),
                                  "5m", {"job": JOB, "instance": INST},
                                  f"A GPU container start was refused on {INST}", desc("CgpuContainerStartRefused")),
    "CgpuDaemonDown": (change(HEALTHY, "up", f"1x10 0x{STEPS - 10}"), "10m", {"job": JOB, "instance": INST},
                       f"cgpud on {INST} does not answer its scrapes", desc("CgpuDaemonDown")),
    "CgpuDaemonNotScraped": ({k: v for k, v in HEALTHY.items() if k[0] != "up"} | {
        ("up", (("instance", "10.0.0.8:9100"), ("job", "node-exporter"))): f"1x{STEPS}"}, "20m", {},
        "No cgpud daemon has been scraped for 10 minutes", desc("CgpuDaemonNotScraped")),
    "CgpuDaemonStuck": (change(HEALTHY, "cgpu_snapshot_age_seconds", f"0.2x10 0.2+15x{STEPS - 10}"), "10m",
                        {"job": JOB, "instance": INST}, f"cgpud on {INST} answers with a snapshot over 30 s old",
                        desc("CgpuDaemonStuck")),
    "CgpuShareFarFromWeight": (change(HEALTHY, "cgpu_instance_share_10s_ratio", f"0.25x10 0.05x{STEPS - 10}",
                                      container=A), "15m", {**GPU, "container": A, "job": JOB, "instance": INST},
                               f"{A} on GPU 0 of {INST} gets a share 20% away from its weight's",
                               desc("CgpuShareFarFromWeight")),
    "CgpuMemoryPromisedPastGpu": (change(HEALTHY, "cgpu_gpu_memory_allocated_bytes", f"{12 * GiB}x10 {20 * GiB}x{STEPS - 10}"),
                                  "15m", {**GPU, "job": JOB, "instance": INST},
                                  f"GPU 0 of {INST} has more memory promised than it holds",
                                  desc("CgpuMemoryPromisedPastGpu")),
}
SILENT_AT = ("1m", "5m", "15m", "24m")


def series_yaml(series: dict) -> list[dict]:
    return [{"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}", "values": values}
            for (name, labels), values in series.items()]


def promtool(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    assert os.access(PROMTOOL, os.X_OK), f"{PROMTOOL} is missing: run ./scripts/setup.sh (Debian package prometheus)"
    f = tmp_path / "cgpud-alerts.test.yaml"
    f.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": tests}))
    return subprocess.run([PROMTOOL, "test", "rules", str(f)], capture_output=True, text=True, timeout=120)


def test_the_rule_file_is_valid_and_each_alert_has_a_fault_here():
    p = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and f"SUCCESS: {len(RULE)} rules found" in p.stdout, p.stdout + p.stderr
    assert sorted(FAULTS) == ALERTS


@pytest.mark.parametrize("alert", ALERTS)
def test_each_alert_fires_on_its_fault(alert, tmp_path):
    series, at, labels, summary, description = FAULTS[alert]
    expect = [{"exp_labels": {**labels, "severity": RULE[alert]["labels"]["severity"]},
               "exp_annotations": {"summary": summary, "description": description}}]
    tests = [{"name": f"{alert} fires", "interval": "15s", "input_series": series_yaml(series),
              "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expect}]}]
    p = promtool(tmp_path, tests)
    assert p.returncode == 0, p.stdout + p.stderr
    # and the check can fail: the same fault does not make it fire on the healthy series
    tests[0]["input_series"] = series_yaml(HEALTHY)
    p = promtool(tmp_path, tests)
    assert p.returncode != 0 and "FAILED" in p.stdout + p.stderr


def test_every_alert_is_silent_on_a_healthy_node(tmp_path):
    tests = [{"name": "a healthy node", "interval": "15s", "input_series": series_yaml(HEALTHY),
              "alert_rule_test": [{"eval_time": at, "alertname": a, "exp_alerts": []}
                                  for a in ALERTS for at in SILENT_AT]}]
    p = promtool(tmp_path, tests)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


def test_starts_refused_are_counted(daemon):
    """cgpu_container_starts_refused_total counts the hook's and cgpu-runtime's refusals (a refused container
    start)."""
    import urllib.request

    from cgpud.client import Client, ControlError
    from test_hook_op import call_hook
    from test_prometheus import metrics_target

    def refused() -> float:
        with urllib.request.urlopen(f"http://{metrics_target(daemon)}/metrics", timeout=10) as r:
            text = r.read().decode()
        (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "cgpu_container_starts_refused"]
        return fam.samples[0].value

    assert refused() == 0
    for _ in range(2):
        assert call_hook(daemon, "createRuntime", {"id": "c" * 64, "pid": 5}).error == "EINVAL"
    with Client(os.fspath(daemon.socket)) as c:  # cgpu-runtime's prepare, refused
        with pytest.raises(ControlError):
            c.call("prepare", id="")
    deadline = time.monotonic() + 5
    while refused() != 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert refused() == 3


def test_watchdog_kills_are_per_gpu_and_outlive_the_instance():
    node = Node([GpuInfo(0, "GPU-a", "Tesla T4", 16 * GiB), GpuInfo(1, "GPU-b", "Tesla T4", 16 * GiB)])
    node.create_instance(1, A, memsize=GiB, weight=1)
    kills = {(1, A): 2, (1, "gone00000000"): 1}  # (the watchdog's own counts, kept for instances that went)
    snap = metrics.take(node, kills=kills, starts_refused=3)
    rows = metrics.series(snap)
    assert rows["cgpu_gpu_watchdog_kills_total"] == [
        ("", (("gpu", "0"), ("uuid", "GPU-a")), 0), ("", (("gpu", "1"), ("uuid", "GPU-b")), 3)]
    assert rows["cgpu_container_starts_refused_total"] == [("", (), 3)]
