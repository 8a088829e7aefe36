"""The cluster side of issue 33 on a real kube-apiserver enforcing the shipped RBAC and
ValidatingAdmissionPolicies (docs/security.md, "The cluster"; docs/cluster-tests.md, test 8).

Only etcd and kube-apiserver run (`Cluster.start_control_plane`): what is tried here is what the
API server allows. Nodes `node-a` and `node-b` are made through the API (no kubelet), and a
component's token "on node A" is its account's token bound to a pod on node-a
(`kubectl create token --bound-object-kind Pod`), which is what the kubelet gives a DaemonSet's
pod: the API server puts the node's name in it (userInfo.extra
authentication.kubernetes.io/node-name). `cgpu dra-webhook` runs as two host processes sharing
the Secret its first replica makes, called by the API server with the client certificate its
AdmissionConfiguration gives it (tests/cluster.py)."""
from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from cluster import DRA_SA, NAMESPACE, SA, Cluster, Proc, free_port, kubeconfig, wait_for

pytestmark = pytest.mark.slow

WEBHOOK = "cgpu-dra-webhook"
WEBHOOK_USER = f"system:serviceaccount:{NAMESPACE}:{WEBHOOK}"
QUOTA_NS = "team-q"


def overlay(d) -> str:
    from test_cluster_dra import overlay as dra_overlay

    return os.fspath(dra_overlay(d))


@pytest.fixture(scope="module")
def cp():
    c = Cluster(None, None).start_control_plane()
    try:
        c.kubectl("apply", "-k", overlay(c.path("overlay")))
        for node in ("node-a", "node-b"):
            c.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        c.kubectl("create", "namespace", QUOTA_NS)
        c.kubectl("create", "serviceaccount", "default", "-n", QUOTA_NS)
        yield c
    finally:
        c.cleanup()


def as_token(c: Cluster, name: str, token: str):
    return kubeconfig(c.path(f"{name}.kubeconfig"), c.server, c.path("pki", "ca.crt"), {"token": token})


def core_as(c: Cluster, kc):
    """The official client (CoreV1Api) with a kubeconfig's token, as the device plugin calls."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=os.fspath(kc), client_configuration=cfg)
    return client.CoreV1Api(client.ApiClient(cfg))


def status_patch(c: Cluster, kc, node: str) -> str:
    """The device plugin's write of a node's gpu-count (nodes/status patch, no read first): "" when
    the API server took it, else its refusal."""
    from kubernetes.client.exceptions import ApiException

    try:
        core_as(c, kc).patch_node_status(node, {"status": {"capacity": {"aliyun.com/gpu-count": "2"}}})
        return ""
    except ApiException as exc:
        return f"{exc.status} {exc.body}"


def try_(c: Cluster, kc, *args: str, stdin: dict | None = None):
    return c.kubectl(*args, kubeconfig=kc, check=False, stdin=None if stdin is None else json.dumps(stdin))


def slice_(node: str, driver: str = "cgpu.aliyun.com", name: str | None = None) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name or f"{node}-{driver}-t"},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                  "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


def policy_active(c: Cluster, kc, probe: list[str], stdin: dict | None, name: str) -> None:
    """Wait until the API server enforces the policy `name` (it loads policies by a watch): a
    server-side dry run of a request it refuses, until it refuses it."""
    wait_for(lambda: name in try_(c, kc, *probe, "--dry-run=server", stdin=stdin).stderr, 30,
             f"policy {name} in force", c.logs)


def refused(p, *words: str) -> bool:
    return p.returncode != 0 and all(w in p.stderr for w in words)


def test_a_node_plugins_token_writes_only_its_own_nodes_slices_and_nothing_of_nodes_or_pods(cp):
    """Issue 33: the DRA plugin's account could create and update every ResourceSlice of every
    driver and node, and held nodes/pods patch and bindings create (main has no account
    cgpu-dra-plugin: the DaemonSet's pods ran as cgpu)."""
    a = as_token(cp, "dra-a", cp.node_token(DRA_SA, "node-a"))
    b = as_token(cp, "dra-b", cp.node_token(DRA_SA, "node-b"))
    policy = "cgpu-dra-plugin-node-scope"
    policy_active(cp, a, ["create", "-f", "-"], slice_("node-b"), policy)
    assert try_(cp, a, "create", "-f", "-", stdin=slice_("node-a")).returncode == 0  # its own: yes
    p = try_(cp, a, "create", "-f", "-", stdin=slice_("node-b"))
    assert refused(p, policy, "may write only its own node's ResourceSlices"), p.stderr
    p = try_(cp, a, "create", "-f", "-", stdin=slice_("node-a", driver="gpu.nvidia.com"))  # another driver's
    assert refused(p, policy), p.stderr
    mine = cp.get("resourceslice", "node-a-cgpu.aliyun.com-t")
    moved = {**mine, "spec": {**mine["spec"], "nodeName": "node-b"}}
    assert try_(cp, a, "replace", "-f", "-", stdin=moved).returncode != 0  # (the API's own rule: immutable)
    emptied = {**mine, "spec": {**mine["spec"], "devices": [{"name": "none"}]}}
    assert refused(try_(cp, b, "replace", "-f", "-", stdin=emptied), policy)  # node B rewriting node A's
    unbound = as_token(cp, "dra-unbound", cp.kubectl("create", "token", DRA_SA, "-n", NAMESPACE).stdout.strip())
    assert refused(try_(cp, unbound, "create", "-f", "-", stdin=slice_("node-a", name="x")), policy,
                   "only a token bound to a pod on a node")
    # (the DRA plugin writes its node's mode in force, condition and events since issue 37: nodes patch,
    # held to its own node and to cgpud's annotations by the node policy, as the device plugin's account)
    scope = "cgpu-node-scope"
    assert refused(try_(cp, a, "annotate", "node", "node-a", "x=y"), scope, "may change only the annotations")
    mode = json.dumps({"metadata": {"annotations": {"cgpu.aliyun.com/gpu-schedule": "cgpu"}}})
    assert refused(try_(cp, a, "patch", "node", "node-b", "-p", mode), scope, "may change only its own node")
    for args in (["annotate", "pod", "-n", NAMESPACE, f"{DRA_SA}-on-node-a", "x=y"], ["create", "-f", "-"]):
        stdin = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": f"{DRA_SA}-on-node-a",
                                                                     "namespace": NAMESPACE},
                 "target": {"kind": "Node", "name": "node-b"}} if args[0] == "create" else None
        p = try_(cp, a, *args, stdin=stdin)
        assert refused(p, "forbidden"), (args, p.stderr)
    assert cp.get("resourceslice", "node-a-cgpu.aliyun.com-t")["spec"]["nodeName"] == "node-a"
    assert try_(cp, cp.admin, "get", "resourceslice", "node-b-cgpu.aliyun.com-t").returncode != 0


def test_the_node_accounts_token_changes_only_its_own_node_and_the_pods_bound_to_it(cp):
    """Issue 33: the node's account held cluster-wide nodes patch, pods patch and bindings create
    (main: node A's token annotates node B and binds)."""
    a = as_token(cp, "node-a", cp.node_token(SA, "node-a"))
    cp.node_token(SA, "node-b")  # (a pod on node-b to try)
    policy = "cgpu-node-scope"
    patch = json.dumps({"metadata": {"annotations": {"cgpu.aliyun.com/gpu-mem-per-device": "15"}}})
    policy_active(cp, a, ["patch", "node", "node-b", "-p", patch], None, policy)
    assert try_(cp, a, "patch", "node", "node-a", "-p", patch).returncode == 0
    assert refused(try_(cp, a, "patch", "node", "node-b", "-p", patch), policy, "may change only its own node")
    assert status_patch(cp, a, "node-a") == ""
    assert policy in status_patch(cp, a, "node-b")
    assert refused(try_(cp, a, "label", "node", "node-a", "nvidia.com/gpu.present=true"), policy,
                   "may change only the annotations")  # (not a label that draws pods to it)
    given = json.dumps({"metadata": {"annotations": {"ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}}})
    assert try_(cp, a, "patch", "pod", "-n", NAMESPACE, f"{SA}-on-node-a", "-p", given).returncode == 0
    assert refused(try_(cp, a, "patch", "pod", "-n", NAMESPACE, f"{SA}-on-node-b", "-p", given), policy,
                   "only the pods bound to it")
    assert refused(try_(cp, a, "annotate", "pod", "-n", NAMESPACE, f"{SA}-on-node-a", "other=1"), policy)
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": f"{SA}-on-node-a", "namespace": NAMESPACE},
               "target": {"kind": "Node", "name": "node-b"}}
    assert refused(try_(cp, a, "create", "-f", "-", stdin=binding), "forbidden")
    assert "cgpu.aliyun.com/gpu-mem-per-device" not in (cp.get("node", "node-b")["metadata"].get("annotations") or {})


def test_the_node_accounts_token_changes_no_label_or_annotation_through_nodes_status(cp):
    """Issue 44: the policy let every status write through (subresources were skipped), and the API
    server keeps the metadata a nodes/status patch sends: a stolen node token labelled its own node
    (a label that draws GPU pods, or the node's mode) and wrote any annotation there. Its gpu-count
    in capacity, the device plugin's write, is still taken."""
    from kubernetes.client.exceptions import ApiException

    a = as_token(cp, "node-a", cp.node_token(SA, "node-a"))
    policy = "cgpu-node-scope"
    policy_active(cp, a, ["patch", "node", "node-b", "-p", json.dumps({"metadata": {"annotations": {"x": "y"}}})],
                  None, policy)
    api = core_as(cp, a)
    for meta in ({"labels": {"nvidia.com/gpu.present": "true"}}, {"labels": {"ack.node.gpu.schedule": "share"}},
                 {"annotations": {"cgpu.aliyun.com/gpu-schedule": "exclusive"}}, {"annotations": {"other": "1"}}):
        with pytest.raises(ApiException) as e:
            api.patch_node_status("node-a", {"metadata": meta, "status": {"capacity": {"aliyun.com/gpu-count": "2"}}})
        assert e.value.status in (403, 422) and policy in e.value.body and "nodes/status" in e.value.body, e.value.body
    node = cp.get("node", "node-a")["metadata"]
    assert "nvidia.com/gpu.present" not in (node.get("labels") or {})
    assert "other" not in (node.get("annotations") or {})
    assert status_patch(cp, a, "node-a") == ""  # (what the device plugin writes there: taken)


def test_the_webhooks_account_may_set_the_ca_bundle_and_widen_nothing(cp):
    """Issue 33: the webhook's patch on its own MutatingWebhookConfiguration was not limited to
    caBundle: its token could widen its rules to every pod of the cluster (main allows each patch
    below). Tried as its account (impersonated): rules, selectors, failure policy, the URL are
    refused by the policy; a new caBundle is allowed; the one Secret it may make is its own TLS."""
    policy = "cgpu-dra-webhook-limits"
    as_hook = ["--as", WEBHOOK_USER]
    widen = [{"op": "replace", "path": "/webhooks/0/rules/0/operations", "value": ["*"]}]
    wait_for(lambda: policy in try_(cp, cp.admin, "patch", "mutatingwebhookconfiguration", WEBHOOK, *as_hook,
                                    "--type=json", "-p", json.dumps(widen), "--dry-run=server").stderr, 30,
             "the webhook's policy in force", cp.logs)
    for patch in (widen,
                  [{"op": "remove", "path": "/webhooks/0/matchConditions"}],
                  [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}],
                  [{"op": "replace", "path": "/webhooks/0/namespaceSelector", "value": {}}],
                  [{"op": "replace", "path": "/webhooks/0/clientConfig", "value": {"url": "https://evil:1/m"}}]):
        p = try_(cp, cp.admin, "patch", "mutatingwebhookconfiguration", WEBHOOK, *as_hook, "--type=json",
                 "-p", json.dumps(patch))
        assert refused(p, policy, "may change only the caBundle"), (patch, p.stderr)
    hook = cp.get("mutatingwebhookconfiguration", WEBHOOK)["webhooks"][0]
    assert hook["rules"][0]["operations"] == ["CREATE"] and hook["failurePolicy"] == "Fail"
    ca = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg=="
    p = try_(cp, cp.admin, "patch", "mutatingwebhookconfiguration", WEBHOOK, *as_hook, "--type=json", "-p",
             json.dumps([{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": ca}]))
    assert p.returncode == 0, p.stderr
    assert cp.get("mutatingwebhookconfiguration", WEBHOOK)["webhooks"][0]["clientConfig"]["caBundle"] == ca
    token_secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
                    "metadata": {"name": "cgpu-dra-webhook-tls", "namespace": NAMESPACE,
                                 "annotations": {"kubernetes.io/service-account.name": "cgpu"}}}
    for secret in (token_secret, {**token_secret, "type": "kubernetes.io/tls", "metadata": {
            "name": "other", "namespace": NAMESPACE}, "data": {"tls.crt": "", "tls.key": ""}}):
        p = try_(cp, cp.admin, "create", "-f", "-", *as_hook, stdin=secret)
        assert refused(p, policy, "only its own Secret"), p.stderr


# ---- the webhook itself, called by the API server --------------------------------------------


def start_webhook(c: Cluster, name: str) -> tuple[Proc, int]:
    port, health = free_port(), free_port()
    token = c.kubectl("create", "token", WEBHOOK, "-n", NAMESPACE, "--duration", "1h").stdout.strip()
    kc = kubeconfig(c.path(f"{name}.kubeconfig"), c.server, c.path("pki", "ca.crt"), {"token": token})
    c.procs[name] = Proc(name, [
        c._cgpu(), "dra-webhook", "--addr", f"127.0.0.1:{port}", "--tls-san", "127.0.0.1", "--webhook-config", WEBHOOK,
        "--tls-secret", f"{NAMESPACE}/cgpu-dra-webhook-tls", "--client-ca", c.path("pki", "ca.crt"),
        "--health-addr", f"127.0.0.1:{health}"],
        c.path(f"{name}.log"), env={"KUBECONFIG": os.fspath(kc)}).start()
    wait_for(lambda: "dra-webhook on https://" in c.procs[name].log_path.read_text() or not c.procs[name].alive(),
             60, f"{name} to serve", c.logs)
    assert c.procs[name].alive(), c.procs[name].log()
    c.procs[name].health_port = health
    return c.procs[name], port


def anonymous_cert(c: Cluster) -> tuple[Path, Path]:
    """A client certificate of the cluster's CA (the one the webhook takes) with a CN that is not
    the API server's: what a caller who is not the API server could at best present."""
    d = Path(c.path("anonymous"))
    if not (d / "a.crt").exists():
        d.mkdir(exist_ok=True)
        (d / "ext").write_text("extendedKeyUsage=clientAuth\n")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for args in (["req", *ec, "-keyout", "a.key", "-out", "a.csr", "-subj", "/CN=system:anonymous"],
                     ["x509", "-req", "-in", "a.csr", "-CA", os.fspath(c.path("pki", "ca.crt")), "-CAkey",
                      os.fspath(c.path("pki", "ca.key")), "-CAcreateserial", "-out", "a.crt", "-days", "2",
                      "-extfile", "ext"]):
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return d / "a.crt", d / "a.key"


def silent_tls(port: int, n: int, ca: str, cert: tuple[Path, Path] | None) -> list:
    """`n` connections that complete (or try) a TLS handshake and then say nothing, held open."""
    held = []
    for _ in range(n):
        ctx = ssl.create_default_context(cadata=ca)
        if cert is not None:
            ctx.load_cert_chain(*map(os.fspath, cert))
        raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            held.append(ctx.wrap_socket(raw, server_hostname="127.0.0.1"))
        except OSError:
            held.append(raw)  # (refused at the handshake: held all the same)
    return held


def labelled(name: str, n: int, m: int = 2) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"aliyun.com/gpu-count": str(m)}},
            "spec": {"automountServiceAccountToken": False, "containers": [{
                "name": "app", "image": "x", "resources": {"limits": {"aliyun.com/gpu-mem": str(n)}}}]}}


@pytest.fixture(scope="module")
def webhook(cp):
    """Two replicas on the Secret the first makes; the configuration pointed at the first (no
    kube-proxy: as an administrator would, its URL in place of the Service)."""
    first, port = start_webhook(cp, "dra-webhook")
    second, port2 = start_webhook(cp, "dra-webhook-2")
    cp.kubectl("patch", "mutatingwebhookconfiguration", WEBHOOK, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/webhooks/0/clientConfig",
          "value": {"url": f"https://127.0.0.1:{port}/mutate",
                    "caBundle": cp.get("secret", "cgpu-dra-webhook-tls", "-n", NAMESPACE)["data"]["ca.crt"]}}]))
    return port, port2


def dry_run(c: Cluster, pod: dict, ns: str = "default"):
    return c.kubectl("create", "-n", ns, "--dry-run=server", "-o", "json", "-f", "-", check=False,
                     stdin=json.dumps(pod))


def test_two_replicas_share_one_ca_and_only_the_api_server_may_ask(cp, webhook):
    """Issue 33: anyone who reached the webhook could post an AdmissionReview naming any namespace
    and have a ResourceClaimTemplate made there (main answers the POST below with 200 and makes
    it); one replica made a new CA at each start. Here both replicas serve the Secret's CA; the
    API server, with its client certificate, is answered; a POST without one is refused — at the
    handshake (issue 44), the kubelet's probe answered on the plain health port."""
    port, port2 = webhook
    secret = cp.get("secret", "cgpu-dra-webhook-tls", "-n", NAMESPACE)
    assert secret["type"] == "kubernetes.io/tls"
    ca = base64.b64decode(secret["data"]["ca.crt"]).decode()
    for p in (port, port2):  # the same certificate, of the Secret's CA, on both
        ctx = ssl.create_default_context(cadata=ca)
        with socket.create_connection(("127.0.0.1", p), timeout=20) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert s.getpeercert()["subjectAltName"] == (("IP Address", "127.0.0.1"),)
                try:  # (no client certificate: the handshake's end is refused, nothing answered)
                    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                    got = s.recv(100)
                except OSError:
                    got = b""
                assert got == b"", got
    for name in ("dra-webhook", "dra-webhook-2"):
        with urllib.request.urlopen(f"http://127.0.0.1:{cp.procs[name].health_port}/healthz", timeout=20) as r:
            assert r.status == 200
    wait_for(lambda: dry_run(cp, labelled("d", 4)).returncode == 0, 30, "the API server to call the webhook",
             cp.logs)
    pod = json.loads(dry_run(cp, labelled("d", 4)).stdout)
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "cgpu-gpu-mem-4x2"
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "forged", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
        "namespace": NAMESPACE, "object": labelled("forged", 6)}}
    req = urllib.request.Request(f"https://127.0.0.1:{port}/mutate", data=json.dumps(review).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(OSError) as e:  # (no certificate: no handshake; nothing answered)
        urllib.request.urlopen(req, context=ssl.create_default_context(cadata=ca), timeout=20)
    assert not isinstance(e.value, urllib.error.HTTPError), e.value
    assert try_(cp, cp.admin, "get", "resourceclaimtemplate", "-n", NAMESPACE, "cgpu-gpu-mem-6x2").returncode != 0


def test_a_hundred_idle_connections_keep_no_labelled_pod_from_being_admitted(cp, webhook):
    """Issue 33: on main one connection that never sent a ClientHello held the webhook's only
    serving thread, and with failurePolicy Fail every labelled pod was refused. Issue 44: 100
    that complete a TLS handshake (with the cluster CA's certificate of another CN, or none) and
    say nothing took the 64 serving slots for 15 s each: the dry run below timed out."""
    port, _ = webhook
    ca = base64.b64decode(cp.get("secret", "cgpu-dra-webhook-tls", "-n", NAMESPACE)["data"]["ca.crt"]).decode()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(100)]
    idle += silent_tls(port, 50, ca, anonymous_cert(cp)) + silent_tls(port, 50, ca, None)
    try:
        p = dry_run(cp, labelled("busy", 4))
        assert p.returncode == 0 and json.loads(p.stdout)["spec"]["resourceClaims"], p.stderr
    finally:
        for s in idle:
            s.close()


def test_a_rewritten_pod_still_counts_against_its_namespaces_gpu_mem_quota(cp, webhook):
    """Issue 33: the webhook took aliyun.com/gpu-mem off a labelled pod, so the namespace's
    requests.aliyun.com/gpu-mem quota no longer counted it: with a quota of 12, main admits both
    pods of 8 below. Now the second is refused with the quota's line and nothing of it is made."""
    cp.create({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu-mem", "namespace": QUOTA_NS},
               "spec": {"hard": {"requests.aliyun.com/gpu-mem": "12"}}})
    first = labelled("first", 8)
    p = cp.kubectl("create", "-n", QUOTA_NS, "-f", "-", stdin=json.dumps(first), check=False)
    assert p.returncode == 0, p.stderr
    p = cp.kubectl("create", "-n", QUOTA_NS, "-f", "-", stdin=json.dumps(labelled("second", 8)), check=False)
    assert refused(p, 'admission webhook "gpu-count.cgpu.aliyun.com" denied the request: exceeded quota: gpu-mem, '
                      "requested: requests.aliyun.com/gpu-mem=8, used: requests.aliyun.com/gpu-mem=8, "
                      "limited: requests.aliyun.com/gpu-mem=12"), p.stderr
    assert try_(cp, cp.admin, "get", "pod", "-n", QUOTA_NS, "second").returncode != 0
    assert cp.kubectl("create", "-n", QUOTA_NS, "-f", "-", stdin=json.dumps(labelled("third", 4)),
                      check=False).returncode == 0  # 8 + 4 = 12: still within it
    assert len(yaml.safe_load(cp.kubectl("get", "pods", "-n", QUOTA_NS, "-o", "yaml").stdout)["items"]) == 2


def test_a_template_made_by_hand_under_the_webhooks_name_is_refused(cp, webhook):
    """Issue 44: a tenant made `cgpu-gpu-mem-1x1` by hand, asking eight GPUs' memory; the webhook's
    create met AlreadyExists and rewrote a pod asking one unit to it (counted one unit by the quota).
    Now the pod is refused with the reason, and one the webhook made is used as before."""
    from cgpud.k8s import webhook as decision

    ns = "team-h"
    cp.kubectl("create", "namespace", ns)
    cp.kubectl("create", "serviceaccount", "default", "-n", ns)
    greedy = decision.template(ns, 1, 1)
    for alt in greedy["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]:
        alt["count"], alt["capacity"]["requests"]["memory"] = 8, str(80 << 30)
    cp.create(greedy)
    p = cp.kubectl("create", "-n", ns, "-f", "-", stdin=json.dumps(labelled("h0", 1, m=1)), check=False)
    assert refused(p, "ResourceClaimTemplate team-h/cgpu-gpu-mem-1x1 is not the one the webhook makes",
                   "count is 8, not 1"), p.stderr  # (not a dry run: a dry run makes, and checks, no template)
    cp.kubectl("delete", "resourceclaimtemplate", "-n", ns, "cgpu-gpu-mem-1x1")
    p = cp.kubectl("create", "-n", ns, "-f", "-", stdin=json.dumps(labelled("h", 1, m=1)), check=False)
    assert p.returncode == 0, p.stderr
    p = cp.kubectl("create", "-n", ns, "-f", "-", stdin=json.dumps(labelled("h2", 1, m=1)), check=False)
    assert p.returncode == 0, p.stderr  # (the webhook's own, found there: the same, taken)
