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


def chart(*args: str) -> dict:
    from test_helm import by_key, template

    return by_key(template(*args))


def test_the_charts_monitoring_is_off_by_default_and_on_renders_each_object():
    assert not [k for k in chart() if k[0] in ("ServiceMonitor", "PrometheusRule", "ConfigMap")]
    docs = chart("--set", "namespace=gpu-system", "--set", "metricsPort=9500",
                 "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
                 "--set", "metrics.dashboard.enabled=true", "--set", "metrics.dashboard.namespace=grafana",
                 "--set-json", 'metrics.serviceMonitor.labels={"release":"kps"}',
                 "--set-json", 'metrics.readers=[{"name":"prometheus-k8s","namespace":"monitoring"}]',
                 "--set", "metrics.tlsSecret=cgpud-metrics-tls")
    sm = docs[("ServiceMonitor", "gpu-system", "cgpud")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"] == {"app": "cgpud", "release": "kps"}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics" and ep["scheme"] == "https" and ep["tlsConfig"] == {"insecureSkipVerify": True}
    assert ep["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    svc = docs[("Service", "gpu-system", "cgpud-metrics")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == 9500
    rule = docs[("PrometheusRule", "gpu-system", "cgpud")]
    assert rule["spec"] == yaml.safe_load((DEPLOY / "monitoring" / "cgpud-alerts.yaml").read_text())
    cm = docs[("ConfigMap", "grafana", "cgpud-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["cgpud-dashboard.json"]) == json.loads(
        (DEPLOY / "monitoring" / "cgpud-dashboard.json").read_text())
    readers = docs[("ClusterRoleBinding", None, "cgpu-metrics-reader")]
    assert readers["roleRef"]["name"] == "cgpu-metrics-reader"
    assert readers["subjects"] == [{"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}]
    assert docs[("ClusterRoleBinding", None, "cgpu-metrics-auth")]["subjects"][0]["namespace"] == "gpu-system"
    spec = docs[("DaemonSet", "gpu-system", "cgpud")]["spec"]["template"]["spec"]
    (cgpud,) = [c for c in spec["containers"] if c["name"] == "cgpud"]
    cmd = cgpud["command"]
    assert cmd[cmd.index("--metrics-tls-cert") + 1] == "/etc/cgpud/metrics-tls/tls.crt"
    assert cmd[cmd.index("--metrics-addr") + 1] == "0.0.0.0:9500"
    assert {"name": "metrics-tls", "secret": {"secretName": "cgpud-metrics-tls"}} in spec["volumes"]


def test_in_the_charts_dra_mode_the_plugins_account_asks_the_reviews():
    docs = chart("--set", "dra.enabled=true")
    assert docs[("ClusterRoleBinding", None, "cgpu-metrics-auth")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "cgpu-dra-plugin", "namespace": "kube-system"}]


@pytest.mark.parametrize("args,names", [
    (["--set", "metrics.serviceMonitor.enabled=yes"], "at '/metrics/serviceMonitor/enabled': got string, want boolean"),
    (["--set-json", 'metrics.readers=[{"name":"p"}]'], "at '/metrics/readers/0': missing property 'namespace'"),
    (["--set", "metrics.serviceMonitor.interval=soon"], "at '/metrics/serviceMonitor/interval'"),
])
def test_bad_monitoring_values_are_refused_naming_the_value(args, names):
    from test_helm import CHART as chart_dir, helm

    p = helm("template", "cgpud", str(chart_dir), *args)
    assert p.returncode != 0 and names in p.stderr, p.stderr
