"""deploy/kubernetes/: every manifest loads into the official client's models
with no unknown field (the client itself ignores unknown fields, so this
walks each object against the models' attribute maps), and the settings
files hold what the docs say."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KINDS = {"ServiceAccount": "V1ServiceAccount", "ClusterRole": "V1ClusterRole",
         "ClusterRoleBinding": "V1ClusterRoleBinding", "DaemonSet": "V1DaemonSet", "Deployment": "V1Deployment",
         "Service": "V1Service", "RuntimeClass": "V1RuntimeClass"}
SCALARS = {"str", "int", "bool", "float", "object", "datetime", "date"}


def unknown(data, type_name: str, where: str) -> list[str]:
    """Fields of `data` that the model `type_name` does not have, as paths."""
    if type_name in SCALARS:
        return []
    if m := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        return [u for k, item in enumerate(data or []) for u in unknown(item, m[1], f"{where}[{k}]")]
    if m := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name):
        return [u for key, item in (data or {}).items() for u in unknown(item, m[1] or m[2], f"{where}.{key}")]
    cls = getattr(k8s, type_name)
    by_json = {json: attr for attr, json in cls.attribute_map.items()}
    out = []
    for key, value in (data or {}).items():
        if key not in by_json:
            out.append(f"{where}.{key}")
        else:
            out += unknown(value, cls.openapi_types[by_json[key]], f"{where}.{key}")
    return out


def documents():
    for f in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                yield f.name, doc


@pytest.mark.parametrize("name, doc", list(documents()), ids=lambda x: x if isinstance(x, str) else x.get("kind"))
def test_each_manifest_is_a_model_with_no_unknown_field(name, doc):
    assert doc["kind"] in KINDS, f"{name}: {doc['kind']} is not one of the kinds we ship"
    assert unknown(doc, KINDS[doc["kind"]], f"{name}:{doc['kind']}") == []
    obj = k8s.ApiClient()._ApiClient__deserialize(doc, KINDS[doc["kind"]])
    assert obj.metadata.name


def test_the_checker_sees_an_unknown_field():
    assert unknown({"spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "x", "imagee": "y"}]}}}},
                   "V1DaemonSet", "d") == ["d.spec.template.spec.containers[0].imagee"]


def test_rbac_is_the_least_and_the_plugin_knows_its_node():
    docs = {d["kind"]: d for _, d in documents()}
    rules = {(r["resources"][0], tuple(r["verbs"])) for r in docs["ClusterRole"]["rules"]}
    assert rules == {("nodes", ("get", "list", "watch", "patch")), ("nodes/status", ("patch",)),
                     ("pods", ("get", "list", "watch", "patch")), ("bindings", ("create",)),
                     ("events", ("create",))}
    plugin = next(c for c in docs["DaemonSet"]["spec"]["template"]["spec"]["containers"] if c["name"] == "device-plugin")
    assert plugin["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_scheduler_and_containerd_settings():
    conf = yaml.safe_load((DEPLOY / "scheduler" / "kube-scheduler-config.yaml").read_text())
    (ext,) = conf["extenders"]
    assert ext["urlPrefix"].endswith("/gpushare-scheduler") and (ext["filterVerb"], ext["bindVerb"]) == ("filter", "bind")
    # kube-scheduler is on the host's network: it reaches the extender by the Service's node port
    service = next(d for _, d in documents() if d["kind"] == "Service")
    port = service["spec"]["ports"][0]
    assert service["spec"]["type"] == "NodePort" and ext["urlPrefix"] == f"http://127.0.0.1:{port['nodePort']}/gpushare-scheduler"
    assert ext["managedResources"] == [{"name": "aliyun.com/gpu-mem", "ignoredByScheduler": False}]
    toml = tomllib.loads((DEPLOY / "containerd-cgpu.toml").read_text())
    cgpu = toml["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["cgpu"]
    assert cgpu == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": "/usr/local/bin/cgpu-runtime"}}
