"""The Helm chart deploy/helm/cgpud (docs/kubernetes.md, "Helm") with the real `helm` built from
its Go module (scripts/helm-build.sh): `helm lint`; `helm template` with the default values
renders exactly the objects of `kubectl kustomize deploy/kubernetes` (so the two cannot drift);
values change what they say; bad values are refused by values.schema.json with a message naming
the value. Every rendered object's fields are ones the official client's models know
(test_manifests.unknown)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from test_manifests import KINDS, RENDERED, unknown

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "cgpud"


def helm_bin() -> str:
    p = subprocess.run([ROOT / "scripts" / "helm-build.sh"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    return str(Path(p.stdout.strip().splitlines()[-1]) / "helm")


HELM = helm_bin()


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "HELM_CACHE_HOME": "/tmp/helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-config", "HELM_DATA_HOME": "/tmp/helm-data"})


def template(*args: str) -> list[dict]:
    p = helm("template", "cgpud", str(CHART), *args)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def by_key(docs: list[dict]) -> dict:
    return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}


def test_helm_lint_passes():
    p = helm("lint", "--strict", str(CHART))
    assert p.returncode == 0 and "1 chart(s) linted, 0 chart(s) failed" in p.stdout, p.stdout + p.stderr


def test_the_default_render_is_the_kustomize_render_object_for_object():
    chart, kustomize = by_key(template()), by_key(RENDERED)
    assert sorted(chart) == sorted(kustomize)
    for key in kustomize:
        assert chart[key] == kustomize[key], key


def test_the_dra_render_is_the_kustomize_render_with_the_dra_component_object_for_object(tmp_path):
    """dra.enabled: the DaemonSet's DRA plugin in place of the device plugin, the DeviceClass, the
    dra-webhook and its rights, no extender (extender.enabled or not): what kustomize renders of
    deploy/kubernetes with the component deploy/kubernetes/dra."""
    from test_manifests import dra_rendered

    kustomize = by_key(dra_rendered(tmp_path / "overlay"))
    for extra in ([], ["--set", "extender.enabled=false"]):
        chart = by_key(template("--set", "dra.enabled=true", *extra))
        assert sorted(chart) == sorted(kustomize)
        for key in kustomize:
            assert chart[key] == kustomize[key], key


def test_dra_values_change_what_they_say():
    docs = by_key(template("--set", "dra.enabled=true", "--set", "namespace=gpu-system", "--set", "image.tag=1.3.0",
                           "--set", "dra.webhookReplicas=3", "--set", "devicePlugin.mode=core_mem"))
    spec = docs[("DaemonSet", "gpu-system", "cgpud")]["spec"]["template"]["spec"]
    (plugin,) = [c for c in spec["containers"] if c["name"] == "dra-plugin"]
    assert plugin["command"][-2:] == ["--mode", "core_mem"] and plugin["image"] == "cgpud:1.3.0"
    assert spec["serviceAccountName"] == "cgpu-dra-plugin"
    hook = docs[("Deployment", "gpu-system", "cgpu-dra-webhook")]["spec"]
    assert hook["replicas"] == 3 and hook["template"]["spec"]["containers"][0]["image"] == "cgpud:1.3.0"
    cmd = hook["template"]["spec"]["containers"][0]["command"]
    assert "gpu-system/cgpu-dra-webhook-tls" in cmd and "cgpu-dra-webhook.gpu-system.svc" in cmd
    config = docs[("MutatingWebhookConfiguration", None, "cgpu-dra-webhook")]
    assert config["webhooks"][0]["clientConfig"]["service"]["namespace"] == "gpu-system"
    scope = docs[("ValidatingAdmissionPolicy", None, "cgpu-dra-plugin-node-scope")]["spec"]
    assert "system:serviceaccount:gpu-system:cgpu-dra-plugin" in scope["matchConditions"][0]["expression"]
    assert not [k for k in docs if "kube-system" in str(docs[k])]


@pytest.mark.parametrize("doc", template("--set", "devicePlugin.mode=core_mem"),
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_rendered_field_is_known_to_the_api(doc):
    assert unknown(doc, KINDS[doc["kind"]], doc["kind"]) == []


def test_values_change_what_they_say():
    docs = by_key(template("--set", "image.repository=registry.example.com/cgpud", "--set", "image.tag=1.3.0",
                           "--set", "devicePlugin.mode=core_mem", "--set", "devicePlugin.placement=spread",
                           "--set", "extender.enabled=false", "--set", "namespace=gpu-system",
                           "--set-json", 'nodeModes=["core_mem"]'))
    assert not [k for k in docs if k[2] == "cgpu-scheduler-extender"]
    ds = docs[("DaemonSet", "gpu-system", "cgpud")]
    spec = ds["spec"]["template"]["spec"]
    plugin = next(c for c in spec["containers"] if c["name"] == "device-plugin")
    assert plugin["command"][-4:] == ["--mode", "core_mem", "--placement", "spread"]
    assert {c["image"] for c in spec["containers"] + spec["initContainers"]} == {"registry.example.com/cgpud:1.3.0"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[1]["matchExpressions"] == [{"key": "ack.node.gpu.schedule", "operator": "In", "values": ["core_mem"]}]
    sa = docs[("ServiceAccount", "gpu-system", "cgpu")]
    binding = docs[("ClusterRoleBinding", None, "cgpu")]
    assert sa and binding["subjects"][0]["namespace"] == "gpu-system"


@pytest.mark.parametrize("args,names", [
    (["--set", "devicePlugin.mode=turbo"], "at '/devicePlugin/mode': value must be one of 'exclusive', 'cgpu'"),
    (["--set-json", "image.tag=5"], "at '/image/tag': got number, want string"),
    (["--set", "extender.port=70000"], "at '/extender/port': maximum"),
    (["--set", "devicePluginn.mode=cgpu"], "devicePluginn"),
    (["--set-json", 'nodeModes=["disabled"]'], "at '/nodeModes/0': value must be one of"),
    (["--set", "dra.enabled=yes"], "at '/dra/enabled': got string, want boolean"),
    (["--set", "dra.webhookReplicas=0"], "at '/dra/webhookReplicas': minimum"),
])
def test_bad_values_are_refused_naming_the_value(args, names):
    p = helm("template", "cgpud", str(CHART), *args)
    assert p.returncode != 0 and names in p.stderr and "values don't meet the specifications of the schema" in p.stderr, \
        p.stderr
    assert "Traceback" not in p.stderr and not p.stdout.strip()


@pytest.mark.parametrize("name", ["rbac.yaml", "admission.yaml", "runtimeclass-policy.yaml", "dra/deviceclass.yaml",
                                  "dra/rbac.yaml", "dra/webhook.yaml"])
def test_the_charts_copies_are_deploy_kubernetes_files(name):
    """The chart's RBAC and admission policy are copies of the kustomize files, byte for byte (a
    link would make helm warn on every command): after a change there,
    `cp deploy/kubernetes/<file> deploy/helm/cgpud/files/`."""
    assert (CHART / "files" / name).read_bytes() == (ROOT / "deploy" / "kubernetes" / name).read_bytes()
