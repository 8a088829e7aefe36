"""deploy/kubernetes/ as a cluster gets it (issue 21): `kubectl kustomize
deploy/kubernetes` (kustomize as built into the real kubectl, offline) renders
it, and every field of every rendered object is one the official `kubernetes`
client's models know (the client itself ignores unknown fields, so this walks
each object against the models' attribute maps: a misspelt field fails). The
image is named in one place; kube-scheduler's configuration is complete and
the kubeadm patch puts it into a stock kubeadm static pod; the settings files
hold what the docs say."""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

import cgpud
from cgpud.containers import hostconfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBECTL = "/usr/bin/kubectl"
KINDS = {"ServiceAccount": "V1ServiceAccount", "ClusterRole": "V1ClusterRole",
         "ClusterRoleBinding": "V1ClusterRoleBinding", "DaemonSet": "V1DaemonSet", "Deployment": "V1Deployment",
         "Service": "V1Service", "RuntimeClass": "V1RuntimeClass", "Pod": "V1Pod", "DeviceClass": "V1DeviceClass",
         "MutatingWebhookConfiguration": "V1MutatingWebhookConfiguration", "Role": "V1Role",
         "RoleBinding": "V1RoleBinding", "ValidatingAdmissionPolicy": "V1ValidatingAdmissionPolicy",
         "ValidatingAdmissionPolicyBinding": "V1ValidatingAdmissionPolicyBinding"}
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
    if not isinstance(data, dict):
        return [f"{where} (not an object)"]
    out = []
    for key, value in data.items():
        if key not in by_json:
            out.append(f"{where}.{key}")
        else:
            out += unknown(value, cls.openapi_types[by_json[key]], f"{where}.{key}")
    return out


def kustomize(path: Path = DEPLOY) -> list[dict]:
    r = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


RENDERED = kustomize()


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


@pytest.mark.parametrize("doc", RENDERED, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_rendered_object_is_a_model_with_no_unknown_field(doc):
    assert doc["kind"] in KINDS, f"{doc['kind']} is not one of the kinds we ship"
    assert unknown(doc, KINDS[doc["kind"]], doc["kind"]) == []
    obj = k8s.ApiClient()._ApiClient__deserialize(doc, KINDS[doc["kind"]])
    assert obj.metadata.name


def test_what_is_rendered():
    assert sorted((d["kind"], d["metadata"]["name"]) for d in RENDERED) == sorted([
        ("ServiceAccount", "cgpu"), ("ClusterRole", "cgpu"), ("ClusterRoleBinding", "cgpu"), ("DaemonSet", "cgpud"),
        ("ServiceAccount", "cgpu-scheduler-extender"), ("ClusterRole", "cgpu-scheduler-extender"),
        ("ClusterRoleBinding", "cgpu-scheduler-extender"), ("ValidatingAdmissionPolicy", "cgpu-node-scope"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-node-scope"), ("ValidatingAdmissionPolicy", "cgpu-node-events"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-node-events"),
        ("ValidatingAdmissionPolicy", "cgpu-gpu-core-percentage"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-gpu-core-percentage"),
        ("Role", "cgpu-node-keeper"), ("RoleBinding", "cgpu-node-keeper"),
        ("DaemonSet", "cgpu-scheduler-extender"), ("RuntimeClass", "cgpu"), ("DaemonSet", "cgpu-mps-control"),
        ("ClusterRole", "cgpu-metrics-auth"), ("ClusterRoleBinding", "cgpu-metrics-auth"),
        ("ClusterRole", "cgpu-metrics-reader"), ("Service", "cgpud-metrics"),
        ("ValidatingAdmissionPolicy", "cgpu-runtime-class"), ("ValidatingAdmissionPolicyBinding", "cgpu-runtime-class")])


def test_the_checker_sees_an_unknown_or_misspelt_field(tmp_path):
    assert unknown({"spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "x", "imagee": "y"}]}}}},
                   "V1DaemonSet", "d") == ["d.spec.template.spec.containers[0].imagee"]
    # ... also in what kustomize renders: a copy of the manifests with one field misspelt
    for f in DEPLOY.glob("*.yaml"):
        (tmp_path / f.name).write_text(f.read_text())
    ds = tmp_path / "daemonset.yaml"
    ds.write_text(ds.read_text().replace("mountPropagation: Bidirectional", "mountPropogation: Bidirectional"))
    bad = next(d for d in kustomize(tmp_path) if d["metadata"]["name"] == "cgpud")
    assert unknown(bad, "V1DaemonSet", "DaemonSet") == ["DaemonSet.spec.template.spec.containers[0].volumeMounts[0]"
                                                        ".mountPropogation"]


def test_the_image_is_named_in_one_place():
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    assert image["newTag"] == cgpud.__version__
    want = f"{image['newName']}:{image['newTag']}"
    images = [c["image"] for d in RENDERED if d["kind"] == "DaemonSet" for c in containers(d)]
    assert len(images) == 7 and set(images) == {want}  # (install, daemon, node-keeper, device plugin, extender;
    #                                                     mps-control.yaml: 2)
    for f in DEPLOY.glob("*.yaml"):  # the manifests name only the placeholder
        assert set(re.findall(r"image: (\S+)", f.read_text())) <= {image["name"]}, f
    # the build's default tag is the same
    assert f"cgpud:{cgpud.__version__}" in (DEPLOY / "Containerfile").read_text()


def test_rbac_is_the_least_and_the_plugin_knows_its_node():
    """The node's account binds nothing and makes events only on its own Node (issue 33: it held the extender's
    cluster-wide bindings create); the extender has its own, which patches no pod."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in RENDERED}
    rules = {(r["resources"][0], tuple(r["verbs"])) for r in docs[("ClusterRole", "cgpu")]["rules"]}
    assert rules == {("nodes", ("get", "list", "watch", "patch")), ("nodes/status", ("patch",)),
                     ("pods", ("get", "list", "watch", "patch")), ("events", ("create",))}
    rules = {(r["resources"][0], tuple(r["verbs"]))
             for r in docs[("ClusterRole", "cgpu-scheduler-extender")]["rules"]}
    assert rules == {("nodes", ("get", "list", "watch", "patch")), ("pods", ("get", "list", "watch")),
                     ("bindings", ("create",)), ("events", ("create",))}
    ext = docs[("DaemonSet", "cgpu-scheduler-extender")]["spec"]["template"]["spec"]
    assert ext["serviceAccountName"] == "cgpu-scheduler-extender"
    policy = docs[("ValidatingAdmissionPolicy", "cgpu-node-scope")]["spec"]
    assert "'system:serviceaccount:kube-system:cgpu'" in policy["matchConditions"][0]["expression"]
    assert docs[("ValidatingAdmissionPolicyBinding", "cgpu-node-scope")]["spec"] == {
        "policyName": "cgpu-node-scope", "validationActions": ["Deny"]}
    ds = next(d for d in RENDERED if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpud")
    plugin = next(c for c in containers(ds) if c["name"] == "device-plugin")
    assert plugin["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_node_daemonset_sets_the_node_up_and_finds_the_driver():
    ds = next(d for d in RENDERED if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpud")
    spec = ds["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["command"][:3] == ["cgpu", "node", "install"] and "--host-root" in init["command"]
    host_root = init["command"][init["command"].index("--host-root") + 1]
    host = next(v["name"] for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/")
    assert {"name": host, "mountPath": host_root} in init["volumeMounts"]
    daemon = next(c for c in spec["containers"] if c["name"] == "cgpud")
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    mount = next(m for m in daemon["volumeMounts"] if m["name"] == host)
    assert env["CGPUD_DRIVER_ROOT"] == mount["mountPath"] and mount["readOnly"] is True


def scheduler_config() -> dict:
    return yaml.safe_load((DEPLOY / "scheduler" / "kube-scheduler-config.yaml").read_text())


def test_the_scheduler_reaches_the_extender_on_its_own_node():
    conf = scheduler_config()
    assert conf["clientConnection"]["kubeconfig"] == "/etc/kubernetes/scheduler.conf"  # --kubeconfig is ignored
    assert conf["leaderElection"] == {"leaderElect": True}
    (ext,) = conf["extenders"]
    assert (ext["filterVerb"], ext["bindVerb"]) == ("filter", "bind")
    # binpack across nodes (docs/kubernetes.md): the best node is ahead by 2 steps × weight × 10, more than
    # the default plugins' 800 (NodeResourcesFit, BalancedAllocation, PodTopologySpread, ImageLocality, Taints)
    assert ext["prioritizeVerb"] == "prioritize" and 2 * ext["weight"] * 10 > 800
    assert ext["managedResources"] == [{"name": "aliyun.com/gpu-mem", "ignoredByScheduler": False}]
    extender = next(d for d in RENDERED
                    if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpu-scheduler-extender")
    spec = extender["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and "node-role.kubernetes.io/control-plane" in spec["nodeSelector"]
    (c,) = spec["containers"]
    addr = c["command"][c["command"].index("--addr") + 1]
    assert addr.startswith("127.0.0.1:") and ext["urlPrefix"] == f"http://{addr}/gpushare-scheduler"
    # no node port, no kube-proxy in the path (the one Service is the daemons' headless metrics one)
    assert [d["metadata"]["name"] for d in RENDERED if d["kind"] == "Service"] == ["cgpud-metrics"]


KUBEADM_SCHEDULER = """\
apiVersion: v1
kind: Pod
metadata:
  labels: {component: kube-scheduler, tier: control-plane}
  name: kube-scheduler
  namespace: kube-system
spec:
  containers:
  - command:
    - kube-scheduler
    - --authentication-kubeconfig=/etc/kubernetes/scheduler.conf
    - --authorization-kubeconfig=/etc/kubernetes/scheduler.conf
    - --bind-address=127.0.0.1
    - --kubeconfig=/etc/kubernetes/scheduler.conf
    - --leader-elect=true
    image: registry.k8s.io/kube-scheduler:v1.34.0
    imagePullPolicy: IfNotPresent
    livenessProbe:
      failureThreshold: 8
      httpGet: {host: 127.0.0.1, path: /livez, port: 10259, scheme: HTTPS}
      initialDelaySeconds: 10
      periodSeconds: 10
      timeoutSeconds: 15
    name: kube-scheduler
    resources:
      requests: {cpu: 100m}
    volumeMounts:
    - {mountPath: /etc/kubernetes/scheduler.conf, name: kubeconfig, readOnly: true}
  hostNetwork: true
  priority: 2000001000
  priorityClassName: system-node-critical
  securityContext:
    seccompProfile: {type: RuntimeDefault}
  volumes:
  - hostPath: {path: /etc/kubernetes/scheduler.conf, type: FileOrCreate}
    name: kubeconfig
"""  # (kubeadm's static pod manifest, /etc/kubernetes/manifests/kube-scheduler.yaml, as it writes it)


def test_the_kubeadm_patch_gives_the_static_pod_the_configuration(tmp_path):
    pod = tmp_path / "kube-scheduler.yaml"
    pod.write_text(KUBEADM_SCHEDULER)
    r = subprocess.run([KUBECTL, "patch", "--local", "-f", str(pod), "--type", "json", "--patch-file",
                        str(DEPLOY / "scheduler" / "kubeadm-patches" / "kube-scheduler+json.yaml"), "-o", "yaml"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    patched = yaml.safe_load(r.stdout)
    assert unknown(patched, "V1Pod", "Pod") == []
    (c,) = patched["spec"]["containers"]
    config = next(a.split("=", 1)[1] for a in c["command"] if a.startswith("--config="))
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == config)
    volume = next(v for v in patched["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": config, "type": "File"} and mount["readOnly"] is True
    # the kubeconfig the configuration names is one the static pod has
    kubeconfig = scheduler_config()["clientConnection"]["kubeconfig"]
    assert kubeconfig in [m["mountPath"] for m in c["volumeMounts"]]


@pytest.mark.parametrize("name, version", [("containerd-cgpu.toml", 2), ("containerd-cgpu-v3.toml", 3)])
def test_the_containerd_settings_are_what_runtime_config_writes(name, version):
    text = (DEPLOY / name).read_text()
    assert hostconfig.containerd_version(text) == version
    path = hostconfig.cri_table(version)
    node = tomllib.loads(text)
    for key in hostconfig.split_dotted(path):
        node = node[key]
    assert node == {"default_runtime_name": "cgpu", "runtimes": {"cgpu": {
        "runtime_type": "io.containerd.runc.v2", "container_annotations": ["cgpu.aliyun.com/allocation-*"],
        "options": {"BinaryName": "/usr/local/bin/cgpu-runtime"}}}}
    want = tomllib.loads(hostconfig.containerd(f"version = {version}\n", default=True))
    assert tomllib.loads(text) == want


# ---- DRA mode: deploy/kubernetes with the component deploy/kubernetes/dra ----------------------


def dra_rendered(tmp: Path) -> list[dict]:
    """What an administrator's overlay of the base and the DRA component renders."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(DEPLOY, tmp)], "components": [os.path.relpath(DEPLOY / "dra", tmp)]}))
    return kustomize(tmp)


def test_the_dra_component_renders_models_with_no_unknown_field(tmp_path):
    docs = dra_rendered(tmp_path / "overlay")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted([
        ("ServiceAccount", "cgpu"), ("ClusterRole", "cgpu"), ("ClusterRoleBinding", "cgpu"), ("DaemonSet", "cgpud"),
        ("DaemonSet", "cgpu-mps-control"), ("RuntimeClass", "cgpu"), ("ClusterRole", "cgpu-dra"),
        ("ClusterRoleBinding", "cgpu-dra"), ("ValidatingAdmissionPolicy", "cgpu-node-scope"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-node-scope"), ("ValidatingAdmissionPolicy", "cgpu-node-events"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-node-events"), ("ServiceAccount", "cgpu-dra-plugin"),
        ("ValidatingAdmissionPolicy", "cgpu-dra-plugin-node-scope"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-dra-plugin-node-scope"),
        ("DeviceClass", "gpu.cgpu.aliyun.com"),
        ("ServiceAccount", "cgpu-dra-webhook"), ("ClusterRole", "cgpu-dra-webhook"),
        ("ClusterRoleBinding", "cgpu-dra-webhook"), ("Role", "cgpu-dra-webhook"), ("RoleBinding", "cgpu-dra-webhook"),
        ("ValidatingAdmissionPolicy", "cgpu-dra-webhook-limits"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-dra-webhook-limits"),
        ("Deployment", "cgpu-dra-webhook"), ("Service", "cgpu-dra-webhook"),
        ("Role", "cgpu-node-keeper"), ("RoleBinding", "cgpu-node-keeper"),
        ("MutatingWebhookConfiguration", "cgpu-dra-webhook"), ("ValidatingAdmissionPolicy", "cgpu-gpu-core-percentage"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-gpu-core-percentage"),
        ("ClusterRole", "cgpu-metrics-auth"), ("ClusterRoleBinding", "cgpu-metrics-auth"),
        ("ClusterRole", "cgpu-metrics-reader"), ("Service", "cgpud-metrics"),
        ("ValidatingAdmissionPolicy", "cgpu-runtime-class"),
        ("ValidatingAdmissionPolicyBinding", "cgpu-runtime-class")])  # no extender
    for doc in docs:
        assert unknown(doc, KINDS[doc["kind"]], doc["kind"]) == [], doc["kind"]


def test_the_dra_component_swaps_the_device_plugin_for_the_dra_plugin_with_the_least_rbac(tmp_path):
    from cgpud.k8s import dra

    docs = dra_rendered(tmp_path / "overlay")
    ds = next(d for d in docs if d["metadata"]["name"] == "cgpud")
    names = sorted(c["name"] for c in containers(ds))
    assert names == ["cgpud", "dra-plugin", "node-install", "node-keeper"], names
    plugin = next(c for c in containers(ds) if c["name"] == "dra-plugin")
    assert plugin["env"][0] == {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # each directory the plugin is told is a host path mounted where it is told
    cmd = plugin["command"]
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in ds["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in plugin["volumeMounts"]}
    for flag, host in (("--registry-dir", "/var/lib/kubelet/plugins_registry"),
                       ("--plugin-dir", f"/var/lib/kubelet/plugins/{dra.DRIVER}"), ("--cdi-dir", "/var/run/cdi")):
        assert mounts[cmd[cmd.index(flag) + 1]] == host, flag
    assert cmd[cmd.index("--state-dir") + 1].startswith("/var/lib/cgpud/") and mounts["/var/lib/cgpud"] == "/var/lib/cgpud"
    assert "plugins" not in volumes  # the device plugin's directory is not mounted
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "cgpu-dra")
    assert {(r["resources"][0], tuple(r["verbs"])) for r in role["rules"]} == {
        ("resourceslices", ("list", "watch", "create", "update", "delete")), ("resourceclaims", ("get",)),
        # its Node: the slices' owner, its mode's label watched, the mode in force written (issue 37)
        ("nodes", ("get", "list", "watch", "patch")), ("nodes/status", ("patch",)), ("events", ("create",))}
    # the plugin's own account (issue 33), bound to that role only
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "cgpu-dra-plugin"
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "cgpu-dra")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cgpu-dra-plugin", "namespace": "kube-system"}]
    classes = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "DeviceClass"}
    assert list(classes) == ["gpu.cgpu.aliyun.com"]  # (gpu-mem reaches it through the webhook: no unit devices)
    expr = classes["gpu.cgpu.aliyun.com"]["selectors"][0]["cel"]["expression"]
    assert f'device.driver == "{dra.DRIVER}"' in expr and f'.kind == "{dra.KIND_GPU}"' in expr, expr


def cmd_of(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["command"]


def test_the_dra_webhook_sees_only_gpu_pods_at_create_and_is_reached_through_its_service(tmp_path):
    from cgpud.k8s import webhook

    docs = {(d["kind"], d["metadata"]["name"]): d for d in dra_rendered(tmp_path / "overlay")}
    (hook,) = docs[("MutatingWebhookConfiguration", "cgpu-dra-webhook")]["webhooks"]
    assert "objectSelector" not in hook
    (cond,) = hook["matchConditions"]  # (the API server evaluates it: tests/test_cluster_dra.py)
    for word in (f"'{webhook.LABEL}' in object.metadata.labels", f"'{webhook.RESOURCE}' in c.resources.limits",
                 f"'{webhook.RESOURCE}' in c.resources.requests", "object.spec.initContainers.exists",
                 f"'{webhook.CORE}' in c.resources.limits"):
        assert word in cond["expression"], word
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "cgpu.aliyun.com/dra-webhook", "operator": "NotIn", "values": ["off"]}]}
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["admissionReviewVersions"]) == \
        ("Fail", "NoneOnDryRun", ["v1"])
    assert "caBundle" not in hook["clientConfig"]  # the webhook writes its own CA there at start
    ref = hook["clientConfig"]["service"]
    svc = docs[("Service", ref["name"])]
    assert (svc["metadata"]["name"], svc["metadata"]["namespace"]) == (ref["name"], ref["namespace"])
    (port,) = svc["spec"]["ports"]
    assert port["port"] == ref["port"]
    dep = docs[("Deployment", "cgpu-dra-webhook")]
    spec = dep["spec"]["template"]["spec"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert dep["spec"]["replicas"] == 2  # one CA for both, through the Secret
    assert cmd_of(dep)[cmd_of(dep).index("--tls-secret") + 1] == "kube-system/cgpu-dra-webhook-tls"
    (c,) = spec["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["cgpu", "dra-webhook"]
    assert cmd[cmd.index("--addr") + 1].endswith(f":{port['targetPort']}")
    assert cmd[cmd.index("--webhook-config") + 1] == "cgpu-dra-webhook"
    assert cmd[cmd.index("--tls-san") + 1] == f"{ref['name']}.{ref['namespace']}.svc"  # the name the API server calls
    # (the HTTPS port takes only the API server's certificate; the probe, which has none, asks the health port)
    probe = c["readinessProbe"]["httpGet"]
    assert (probe["scheme"], probe["path"]) == ("HTTP", "/healthz")
    assert cmd[cmd.index("--health-addr") + 1] == f"0.0.0.0:{probe['port']}" != cmd[cmd.index("--addr") + 1]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}  # (the certificate, until it is loaded)
    assert spec["serviceAccountName"] == "cgpu-dra-webhook"
    role = docs[("ClusterRole", "cgpu-dra-webhook")]
    assert [(r["resources"], r["verbs"], r.get("resourceNames")) for r in role["rules"]] == [
        (["resourceclaimtemplates"], ["create", "get"], None),
        (["mutatingwebhookconfigurations"], ["get", "patch"], ["cgpu-dra-webhook"]),
        (["resourcequotas", "pods"], ["list"], None)]
    role = docs[("Role", "cgpu-dra-webhook")]
    assert role["metadata"]["namespace"] == "kube-system" and \
        [(r["resources"], r["verbs"], r.get("resourceNames")) for r in role["rules"]] == [
        (["secrets"], ["get"], ["cgpu-dra-webhook-tls"]), (["secrets"], ["create"], None)]
    binding = docs[("ClusterRoleBinding", "cgpu-dra-webhook")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cgpu-dra-webhook", "namespace": "kube-system"}]


def test_every_container_of_dra_mode_runs_the_bases_image(tmp_path):
    """The component's containers (dra-plugin, the webhook) are added after the base's images
    transformer ran: without the component's own stanza they rendered as `cgpud` (docker.io's
    cgpud:latest on a real node)."""
    (image,) = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["images"]
    docs = dra_rendered(tmp_path / "overlay")
    images = {(d["metadata"]["name"], c["name"]): c["image"] for d in docs if d["kind"] in ("DaemonSet", "Deployment")
              for c in containers(d)}
    assert ("cgpu-dra-webhook", "webhook") in images and ("cgpud", "dra-plugin") in images
    assert set(images.values()) == {f"{image['newName']}:{image['newTag']}"}, images
    assert yaml.safe_load((DEPLOY / "dra" / "kustomization.yaml").read_text())["images"] == [image]  # (no drift)


def test_each_right_in_the_manifests_says_why():
    """Issue 33: each rule of each role is commented with why it is needed (the comment above
    the rule, or on its verbs)."""
    for f in (DEPLOY / "rbac.yaml", DEPLOY / "extender.yaml", DEPLOY / "dra" / "rbac.yaml",
              DEPLOY / "dra" / "webhook.yaml"):
        lines = f.read_text().splitlines()
        in_rules = False
        for i, line in enumerate(lines):
            if line.startswith("rules:"):
                in_rules = True
            elif line and not line.startswith((" ", "#")):
                in_rules = False
            if in_rules and line.lstrip().startswith("- apiGroups:"):
                rule = lines[i:i + 5]
                verbs = next(x for x in rule if x.lstrip().startswith("verbs:"))
                assert lines[i - 1].lstrip().startswith("#") or "#" in verbs, f"{f.name}:{i + 1}: {line} says no why"
