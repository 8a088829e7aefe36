"""What an operator installs to watch cgpud (docs/monitoring.md; issues 44 and 48): the metrics
door's RBAC and Service in deploy/kubernetes/metrics.yaml (each right says why), the DaemonSet
serving behind it, and the Helm chart's monitoring values: off by default, on they render the
ServiceMonitor (Prometheus's token, TLS), the PrometheusRule (the rule file, as promtool tests it:
tests/test_alerts.py), the dashboard ConfigMap with Grafana's sidecar label, the readers' binding
and the TLS Secret; the chart's copies are deploy/'s files byte for byte."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from test_manifests import RENDERED, containers

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "cgpud"


@pytest.mark.parametrize("name,copy", [
    ("kubernetes/metrics.yaml", "files/metrics.yaml"),
    ("monitoring/cgpud-alerts.yaml", "files/monitoring/cgpud-alerts.yaml"),
    ("monitoring/cgpud-dashboard.json", "files/monitoring/cgpud-dashboard.json"),
])
def test_the_charts_copies_are_deploys_files(name, copy):
    """After a change there: `cp deploy/<file> deploy/helm/cgpud/<copy>`."""
    assert (CHART / copy).read_bytes() == (DEPLOY / name).read_bytes()


def test_the_daemonset_serves_metrics_behind_the_door_with_the_least_rights():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in RENDERED}
    ds = docs[("DaemonSet", "cgpud")]
    (cgpud,) = [c for c in containers(ds) if c["name"] == "cgpud"]
    cmd = cgpud["command"]
    assert cmd[cmd.index("--metrics-auth") + 1] == "kubernetes" and cmd[cmd.index("--metrics-addr") + 1] == "0.0.0.0:9402"
    rules = docs[("ClusterRole", "cgpu-metrics-auth")]["rules"]
    assert [(r["apiGroups"], r["resources"], r["verbs"]) for r in rules] == [
        (["authentication.k8s.io"], ["tokenreviews"], ["create"]),
        (["authorization.k8s.io"], ["subjectaccessreviews"], ["create"])]
    binding = docs[("ClusterRoleBinding", "cgpu-metrics-auth")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ds["spec"]["template"]["spec"]["serviceAccountName"],
                                    "namespace": ds["metadata"]["namespace"]}]
    assert docs[("ClusterRole", "cgpu-metrics-reader")]["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    svc = docs[("Service", "cgpud-metrics")]["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert svc["ports"] == [{"name": "metrics", "port": 9402, "targetPort": "metrics"}]
    # no other object is bound to the reader: who scrapes is the operator's to say
    assert not [d for d in RENDERED if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "cgpu-metrics-reader"]


def test_each_right_in_metrics_yaml_says_why():
    lines = (DEPLOY / "kubernetes" / "metrics.yaml").read_text().splitlines()
    rules = [i for i, line in enumerate(lines) if line.lstrip().startswith(("- apiGroups:", "- nonResourceURLs:"))]
    assert len(rules) == 3
    for i in rules:
        assert lines[i - 1].lstrip().startswith("#"), f"metrics.yaml:{i + 1}: {lines[i]} says no why"


def test_in_dra_mode_the_daemons_account_asks_the_reviews(tmp_path):
    from test_manifests import dra_rendered

    docs = {(d["kind"], d["metadata"]["name"]): d for d in dra_rendered(tmp_path / "overlay")}
    sa = docs[("DaemonSet", "cgpud")]["spec"]["template"]["spec"]["serviceAccountName"]
    assert sa == "cgpu-dra-plugin"
    assert docs[("ClusterRoleBinding", "cgpu-metrics-auth")]["subjects"] == [
        {"kind": "ServiceAccount", "name": sa, "namespace": "kube-system"}]
