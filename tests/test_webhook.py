"""`cgpu dra-webhook` (docs/kubernetes.md, DRA mode: seed 000's label): the pure decision
(cgpud.k8s.webhook: a pod in, a JSONPatch and templates out, or one line of denial) called
directly, then the HTTPS server with a certificate made at start, called as the API server
calls it. On the real control plane: tests/test_cluster_dra.py."""
from __future__ import annotations

import base64
import copy
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.k8s import webhook, webhookserver

GIB, MIB = 1 << 30, 1 << 20

SEED_000 = """
apiVersion: batch/v1
kind: Job
metadata:
  name: tensorflow-mnist-multigpu
spec:
  parallelism: 1
  template:
    metadata:
      labels:
        app: tensorflow-mnist-multigpu
        # 在Pod label中申明8 GiB顯存,由2塊GPU卡提供,每塊提供4 GiB顯存。
        aliyun.com/gpu-count: "2"
    spec:
      containers:
      - name: tensorflow-mnist-multigpu
        image: registry.cn-beijing.aliyuncs.com/ai-samples/gpushare-sample:tensorflow-1.5
        command:
        - python
        - tensorflow-sample-code/tfjob/docker/mnist/main.py
        - --max_steps=100000
        - --data_dir=tensorflow-sample-code/data
        resources:
          limits:
            aliyun.com/gpu-mem: 8 # 總共申請8 GiB顯存。
        workingDir: /root
      restartPolicy: Never
"""


def seed_pod() -> dict:
    """Seed 000's pod as the API server shows it to a webhook: the Job's template, requests
    defaulted from limits, quantities as strings."""
    tmpl = yaml.safe_load(SEED_000)["spec"]["template"]
    c = tmpl["spec"]["containers"][0]
    c["resources"] = {"limits": {"aliyun.com/gpu-mem": "8"}, "requests": {"aliyun.com/gpu-mem": "8"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "tensorflow-mnist-multigpu-",
                                                            **tmpl["metadata"]}, "spec": tmpl["spec"]}


def apply(doc: dict, patch: list[dict]) -> dict:
    """RFC 6902 add and remove, as the API server applies them (enough for our patches)."""
    doc = copy.deepcopy(doc)
    for op in patch:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        at = doc
        for p in parents:
            at = at[int(p)] if isinstance(at, list) else at[p]
        if op["op"] == "remove":
            del at[int(last) if isinstance(at, list) else last]
        elif op["op"] == "add":
            if isinstance(at, list):
                at.insert(len(at) if last == "-" else int(last), op["value"])
            else:
                at[last] = op["value"]
        else:
            raise AssertionError(op)
    return doc


def alternatives(t: dict, request: str = "gpu") -> dict:
    (req,) = [r for r in t["spec"]["spec"]["devices"]["requests"] if r["name"] == request]
    return {a["name"]: a for a in req["firstAvailable"]}


def test_seed_000s_pod_gets_a_claim_of_4_gib_on_each_of_2_distinct_gpus_and_no_gpu_mem():
    pod = seed_pod()
    d = webhook.mutate(pod, "default")
    got = apply(pod, d.patch)
    (c,) = got["spec"]["containers"]
    assert c["resources"] == {"limits": {}, "requests": {}, "claims": [{"name": "cgpu-gpu-mem"}]}
    assert got["spec"]["resourceClaims"] == [{"name": "cgpu-gpu-mem", "resourceClaimTemplateName": "cgpu-gpu-mem-8x2"}]
    assert got["metadata"] == pod["metadata"] and c["command"] == pod["spec"]["containers"][0]["command"]
    assert webhook.mutate(got, "default").patch == []  # called again (another webhook's reinvocation): unchanged
    (t,) = d.templates
    assert (t["kind"], t["metadata"]["name"], t["metadata"]["namespace"]) == \
        ("ResourceClaimTemplate", "cgpu-gpu-mem-8x2", "default")
    alts = alternatives(t)
    for name, memory, unit in (("unit-1gi", 4 * GIB, GIB), ("unit-128mi", 4 * 128 * MIB, 128 * MIB)):
        a = alts[name]
        assert (a["deviceClassName"], a["count"], a["allocationMode"]) == ("gpu.cgpu.aliyun.com", 2, "ExactCount")
        assert a["capacity"]["requests"]["memory"] == str(memory)
        assert a["selectors"][0]["cel"]["expression"] == f'device.attributes["cgpu.aliyun.com"].memoryUnit == {unit}'
    assert list(alts) == ["unit-1gi", "unit-128mi"]  # the slices' units (placement.unit_for)
    # a GPU that claims share may be given twice to one request: the two must be distinct GPUs
    assert t["spec"]["spec"]["devices"]["constraints"] == [{"requests": ["gpu"], "distinctAttribute": "cgpu.aliyun.com/uuid"}]
    for value in t["metadata"]["labels"].values():  # what the API server takes as a label value
        assert re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", value) and len(value) <= 63, value


def test_the_official_clients_model_takes_the_templates():
    from kubernetes import client

    from test_manifests import unknown

    pod = seed_pod()
    pod["spec"]["containers"].append({**pod["spec"]["containers"][0], "name": "b"})
    del pod["metadata"]["labels"]["aliyun.com/gpu-count"]
    for t in webhook.mutate(pod, "default").templates + webhook.mutate(seed_pod(), "default").templates:
        assert unknown(t, "V1ResourceClaimTemplate", "ResourceClaimTemplate") == []
        client.ApiClient()._ApiClient__deserialize(t, "V1ResourceClaimTemplate")


def test_n_not_a_multiple_of_m_is_refused_with_the_reason():
    pod = seed_pod()
    for part in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][part]["aliyun.com/gpu-mem"] = "7"
    with pytest.raises(webhook.Denied) as e:
        webhook.mutate(pod, "default")
    assert str(e.value) == ("container tensorflow-mnist-multigpu: aliyun.com/gpu-mem 7 cannot be spread over "
                            "aliyun.com/gpu-count 2: each GPU gives the same memory, so N/M must be a whole number "
                            "of units (7/2 is not)")


@pytest.mark.parametrize("label", [None, "0", "1"])
def test_a_pod_without_the_label_or_on_one_gpu_asks_its_memory_of_one_gpu(label):
    """gpu-mem of any size a GPU holds, as capacity of one GPU device: 8 units are 8 GiB on a 1 GiB
    node, 1 GiB on a 128 MiB one (no 32-device limit, no units over two GPUs)."""
    pod = seed_pod()
    if label is None:
        del pod["metadata"]["labels"]["aliyun.com/gpu-count"]
    else:
        pod["metadata"]["labels"]["aliyun.com/gpu-count"] = label
    for part in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][part]["aliyun.com/gpu-mem"] = "40"
    d = webhook.mutate(pod, "default")
    got = apply(pod, d.patch)
    assert got["spec"]["resourceClaims"] == [{"name": "cgpu-gpu-mem", "resourceClaimTemplateName": "cgpu-gpu-mem-40x1"}]
    assert got["spec"]["containers"][0]["resources"]["claims"] == [{"name": "cgpu-gpu-mem"}]
    (t,) = d.templates
    assert {k: (a["count"], a["capacity"]["requests"]["memory"]) for k, a in alternatives(t).items()} == \
        {"unit-1gi": (1, str(40 * GIB)), "unit-128mi": (1, str(40 * 128 * MIB))}
    assert "constraints" not in t["spec"]["spec"]["devices"]


def test_a_labelled_pod_asking_no_gpu_mem_is_unchanged():
    pod = seed_pod()
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    assert webhook.mutate(pod, "default").patch == []


@pytest.mark.parametrize("label,why", [
    ("two", "label aliyun.com/gpu-count: 'two' is not a whole number of GPUs"),
    ("-2", "label aliyun.com/gpu-count: '-2' is not a whole number of GPUs"),
    ("33", "label aliyun.com/gpu-count: 33 GPUs is more than a claim can hold (32)"),
])
def test_a_bad_label_is_refused_with_one_line(label, why):
    pod = seed_pod()
    pod["metadata"]["labels"]["aliyun.com/gpu-count"] = label
    with pytest.raises(webhook.Denied, match=f"^{why}$".replace("(", r"\(").replace(")", r"\)")):
        webhook.mutate(pod, "default")


@pytest.mark.parametrize("limits,requests,why", [
    ("1.5", None, "container c: limits aliyun.com/gpu-mem '1.5' is not a whole number of units"),
    ("8Gi", None, "container c: limits aliyun.com/gpu-mem '8Gi' is not a whole number of units"),
    ("8", "4", "container c: aliyun.com/gpu-mem differs between limits (8) and requests (4)"),
])
def test_a_bad_gpu_mem_is_refused_with_one_line(limits, requests, why):
    pod = seed_pod()
    c = pod["spec"]["containers"][0]
    c["name"] = "c"
    c["resources"] = {"limits": {"aliyun.com/gpu-mem": limits}}
    if requests:
        c["resources"]["requests"] = {"aliyun.com/gpu-mem": requests}
    with pytest.raises(webhook.Denied) as e:
        webhook.mutate(pod, "default")
    assert str(e.value) == why


def test_several_containers_share_the_pods_one_claim_on_one_gpu_and_what_the_pod_had_is_kept():
    """A pod's containers on the pod's GPU (as gpushare places a pod): one claim, a request per
    container with its own memory (its CDI device, its environment), all on one GPU."""
    pod = seed_pod()
    del pod["metadata"]["labels"]["aliyun.com/gpu-count"]
    spec = pod["spec"]
    base = spec["containers"][0]
    spec["containers"] = [
        {**base, "name": "a", "resources": {"limits": {"aliyun.com/gpu-mem": "4", "cpu": "1"},
                                            "claims": [{"name": "other"}]}},
        {**base, "name": "plain", "resources": {"limits": {"cpu": "1"}}},
        {**base, "name": "b", "resources": {"limits": {"aliyun.com/gpu-mem": "8"}}},
    ]
    spec["initContainers"] = [{**base, "name": "init", "resources": {"limits": {"aliyun.com/gpu-mem": "2"}}}]
    spec["resourceClaims"] = [{"name": "other", "resourceClaimName": "mine"}]
    d = webhook.mutate(pod, "ns1")
    got = apply(pod, d.patch)
    cs = got["spec"]["containers"]
    assert cs[0]["resources"] == {"limits": {"cpu": "1"},
                                  "claims": [{"name": "other"}, {"name": "cgpu-gpu-mem", "request": "c-0"}]}
    assert cs[1] == spec["containers"][1]
    assert cs[2]["resources"] == {"limits": {}, "claims": [{"name": "cgpu-gpu-mem", "request": "c-2"}]}
    assert got["spec"]["initContainers"][0]["resources"] == {
        "limits": {}, "claims": [{"name": "cgpu-gpu-mem", "request": "init-0"}]}
    assert got["spec"]["resourceClaims"] == [
        {"name": "other", "resourceClaimName": "mine"},
        {"name": "cgpu-gpu-mem", "resourceClaimTemplateName": "cgpu-gpu-mem-init-0u2-c-0u4-c-2u8x1"}]
    (t,) = d.templates
    assert t["metadata"]["namespace"] == "ns1"
    devices = t["spec"]["spec"]["devices"]
    assert [(r["name"], r["firstAvailable"][0]["capacity"]["requests"]["memory"]) for r in devices["requests"]] == \
        [("init-0", str(2 * GIB)), ("c-0", str(4 * GIB)), ("c-2", str(8 * GIB))]
    assert devices["constraints"] == [{"requests": ["init-0", "c-0", "c-2"], "matchAttribute": "cgpu.aliyun.com/uuid"}]


def test_a_pod_spread_over_gpus_gives_them_to_one_container_or_is_refused_with_one_line():
    pod = seed_pod()
    base = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**base, "name": "a"}, {**base, "name": "b", "resources": {"limits": {"cpu": "1"}}},
                                 {**base, "name": "c"}]
    with pytest.raises(webhook.Denied) as e:
        webhook.mutate(pod, "default")
    assert str(e.value) == ("label aliyun.com/gpu-count: 2 containers ask aliyun.com/gpu-mem (a, c): the pod's 2 GPUs "
                            "are given to one container; ask aliyun.com/gpu-mem in one of them")


def test_claims_that_are_not_lists_are_refused():
    pod = seed_pod()
    pod["spec"]["containers"][0]["resources"]["claims"] = "gpu"
    with pytest.raises(webhook.Denied, match="^container tensorflow-mnist-multigpu: resources.claims is not a list$"):
        webhook.mutate(pod, "default")
    pod = seed_pod()
    pod["spec"]["resourceClaims"] = {"name": "x"}
    with pytest.raises(webhook.Denied, match="^spec.resourceClaims is not a list$"):
        webhook.mutate(pod, "default")


def test_a_pod_already_holding_a_claim_of_that_name_is_refused():
    pod = seed_pod()
    pod["spec"]["resourceClaims"] = [{"name": "cgpu-gpu-mem", "resourceClaimName": "x"}]
    with pytest.raises(webhook.Denied, match="already has a claim named cgpu-gpu-mem$"):
        webhook.mutate(pod, "default")


def review(pod, operation="CREATE", dry_run=False, kind="Pod") -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": kind}, "operation": operation,
        "namespace": "team-a", "object": pod, "dryRun": dry_run}}


class FakeApi:
    def __init__(self, refuse: Exception | None = None) -> None:
        self.made: list[dict] = []
        self.refuse = refuse

    def ensure_template(self, body: dict) -> None:
        if self.refuse:
            raise self.refuse
        self.made.append(body)

    def gpu_mem_quotas(self, namespace: str) -> list[dict]:  # (no quota: tests/test_webhook_server.py has them)
        return []

    def pods(self, namespace: str) -> list[dict]:
        return []


def patch_of(answer: dict) -> list[dict]:
    r = answer["response"]
    assert r["allowed"] is True and r["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(r["patch"]))


# Seed 000's pod's patch, written out from docs/kubernetes.md (not from mutate()): its gpu-mem gone
# from limits and requests, the container naming the pod's claim, the claim from the template.
SEED_000_PATCH = [
    {"op": "remove", "path": "/spec/containers/0/resources/limits/aliyun.com~1gpu-mem"},
    {"op": "remove", "path": "/spec/containers/0/resources/requests/aliyun.com~1gpu-mem"},
    {"op": "add", "path": "/spec/containers/0/resources/claims", "value": [{"name": "cgpu-gpu-mem"}]},
    {"op": "add", "path": "/spec/resourceClaims",
     "value": [{"name": "cgpu-gpu-mem", "resourceClaimTemplateName": "cgpu-gpu-mem-8x2"}]},
]


def test_admit_makes_the_template_then_answers_the_patch_and_a_dry_run_makes_nothing():
    api = FakeApi()
    answer = webhookserver.admit(api, review(seed_pod()))
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["response"]["uid"] == "u-1"
    assert patch_of(answer) == SEED_000_PATCH
    assert [(t["metadata"]["namespace"], t["metadata"]["name"]) for t in api.made] == [("team-a", "cgpu-gpu-mem-8x2")]
    api = FakeApi()
    assert patch_of(webhookserver.admit(api, review(seed_pod(), dry_run=True)))
    assert api.made == []  # sideEffects: NoneOnDryRun


def test_admit_denies_with_one_line_when_the_template_cannot_be_made():
    from kubernetes.client.exceptions import ApiException

    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"message": 'resourceclaimtemplates is forbidden: User "x" cannot create'})
    answer = webhookserver.admit(FakeApi(exc), review(seed_pod()))["response"]
    assert answer["allowed"] is False and "patch" not in answer
    assert answer["status"]["message"] == ("cannot make ResourceClaimTemplate team-a/cgpu-gpu-mem-8x2: the API server "
                                           'refused: 403 Forbidden: resourceclaimtemplates is forbidden: User "x" '
                                           "cannot create")


@pytest.mark.parametrize("op,kind", [("UPDATE", "Pod"), ("CREATE", "Deployment")])
def test_only_pods_at_create_change(op, kind):
    api = FakeApi()
    answer = webhookserver.admit(api, review(seed_pod(), operation=op, kind=kind))["response"]
    assert answer == {"uid": "u-1", "allowed": True} and api.made == []


@pytest.mark.parametrize("body", [None, [], "x", {"kind": "AdmissionReview"}, {"kind": "Other", "request": {"uid": 1}},
                                  {"kind": "AdmissionReview", "request": {"uid": "u", "operation": "CREATE",
                                                                          "kind": {"kind": "Pod"}, "object": "x"}}])
def test_what_is_not_a_review_of_a_pod_is_denied_with_one_line(body):
    answer = webhookserver.admit(FakeApi(), body)["response"]
    assert answer["allowed"] is False and "\n" not in answer["status"]["message"]


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.sampled_from(
    ["", "2", "8", "7", "x", "1.5", "aliyun.com/gpu-mem", "aliyun.com/gpu-count"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["metadata", "labels", "spec", "containers", "initContainers", "resources", "limits", "requests", "claims",
         "resourceClaims", "name", "aliyun.com/gpu-mem", "aliyun.com/gpu-count"]), inner, max_size=4), max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_is_a_decision_or_a_denial_never_a_traceback(pod):
    try:
        d = webhook.mutate(pod, "default")
    except webhook.Denied as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    if d.patch:
        apply(pod, d.patch)  # (the patch applies to the pod it was made for)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 32), st.lists(st.integers(0, 64), min_size=1, max_size=4))
def test_each_pod_gets_its_units_n_over_m_on_m_gpus_or_is_refused(m, ns):
    pod = seed_pod()
    pod["metadata"]["labels"]["aliyun.com/gpu-count"] = str(m)
    base = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**base, "name": f"c{i}", "resources": {"limits": {"aliyun.com/gpu-mem": str(n)}}}
                                 for i, n in enumerate(ns)]
    gpus = max(m, 1)
    if any(n % gpus for n in ns):
        with pytest.raises(webhook.Denied, match="N/M must be a whole number"):
            webhook.mutate(pod, "default")
        return
    if gpus > 1 and sum(1 for n in ns if n) > 1:
        with pytest.raises(webhook.Denied, match="are given to one container"):
            webhook.mutate(pod, "default")
        return
    d = webhook.mutate(pod, "default")
    got = apply(pod, d.patch)
    templates = {t["metadata"]["name"]: t for t in d.templates}
    given_ = 0
    for c, n in zip(got["spec"]["containers"], ns):
        assert ("aliyun.com/gpu-mem" in c["resources"]["limits"]) == (n == 0)  # (0 asks nothing: left as it is)
        for ref in c["resources"].get("claims", []):
            (pc,) = [p for p in got["spec"]["resourceClaims"] if p["name"] == ref["name"]]
            reqs = templates[pc["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]["requests"]
            (req,) = [r for r in reqs if r["name"] == ref.get("request", reqs[0]["name"])]
            alt = req["firstAvailable"][0]
            assert alt["count"] == gpus
            given_ += alt["count"] * int(alt["capacity"]["requests"]["memory"]) // GIB
    assert given_ == sum(ns)


# ---- the server, over HTTPS with a certificate made at start ------------------------------


@pytest.fixture
def server(tmp_path):
    ca, cert, key = webhookserver.make_certificate(["127.0.0.1", "cgpu-dra-webhook.kube-system.svc"], str(tmp_path))
    api = FakeApi()
    srv = webhookserver.make_server(api, "127.0.0.1", 0, webhookserver.server_context(cert, key))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ctx = ssl.create_default_context(cadata=ca.decode())
    yield f"https://127.0.0.1:{srv.server_address[1]}", ctx, api
    srv.shutdown()
    srv.server_close()


def post(url: str, ctx, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_server_answers_over_tls_with_the_ca_it_made(server):
    url, ctx, api = server
    code, answer = post(f"{url}/mutate", ctx, json.dumps(review(seed_pod())).encode())
    assert code == 200 and patch_of(answer) == SEED_000_PATCH
    assert [t["metadata"]["name"] for t in api.made] == ["cgpu-gpu-mem-8x2"]
    assert post(f"{url}/mutate", ctx, b"{not json")[0] == 400
    assert post(f"{url}/other", ctx, b"{}")[0] == 404
    with urllib.request.urlopen(f"{url}/healthz", context=ctx, timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not a CA the client trusts
        urllib.request.urlopen(f"{url}/healthz", context=ssl.create_default_context(), timeout=10)


def test_a_certificate_that_cannot_be_loaded_is_one_line(tmp_path):
    (tmp_path / "c.pem").write_text("not a certificate")
    with pytest.raises(webhookserver.CertError, match=r"^cannot load .*c\.pem"):
        webhookserver.server_context(str(tmp_path / "c.pem"), str(tmp_path / "c.pem"))


@pytest.mark.parametrize("args,why", [
    (["--addr", "nope"], "Error: --addr nope: give HOST:PORT"),
    (["--tls-cert", "/x.pem"], "Error: --tls-cert and --tls-key go together"),
    (["--tls-san", " , "], "Error: --tls-san: give at least one name"),
    ([], "Error: no cluster to ask: "),
])
def test_the_commands_mistakes_are_one_line(args, why, tmp_path):
    env = dict(os.environ, KUBECONFIG=str(tmp_path / "none"), HOME=str(tmp_path))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    p = subprocess.run([Path(sys.executable).parent / "cgpu", "dra-webhook", "--addr", "127.0.0.1:0", *args],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1 and p.stderr.startswith(why) and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_template_made_meanwhile_by_another_pod_is_fine_and_a_refusal_is_not():
    """Two pods of one shape admitted at once (or two replicas): the second create finds the
    template made (409 AlreadyExists) and returns it (admit compares it with its own); any other
    refusal is the API server's."""
    from kubernetes.client.exceptions import ApiException

    class Answer:  # (the client's unread answer: read and its connection given back)
        drained = released = False

        def drain_conn(self):
            self.drained = True

        def release_conn(self):
            self.released = True

    class Resource:
        def __init__(self, status):
            self.status, self.calls, self.answers = status, [], []

        def create_namespaced_resource_claim_template(self, namespace, body, **kw):
            self.calls.append((namespace, body["metadata"]["name"], kw.get("_request_timeout")))
            if self.status:
                raise ApiException(status=self.status, reason="x")
            self.answers.append(Answer())
            return self.answers[-1]

        def read_namespaced_resource_claim_template(self, name, namespace, **kw):
            self.calls.append(("read", namespace, name))
            return type("R", (), {"data": json.dumps(body).encode()})()

    body = webhook.template("ns", 8, 2)
    for status, found, reads in ((None, None, []), (409, body, [("read", "ns", "cgpu-gpu-mem-8x2")])):
        api = object.__new__(webhookserver.Api)
        api.resource = Resource(status)
        assert api.ensure_template(body) == found
        assert api.resource.calls == [("ns", "cgpu-gpu-mem-8x2", 5)] + reads
        assert all(a.drained and a.released for a in api.resource.answers)
    api.resource = Resource(403)
    with pytest.raises(ApiException):
        api.ensure_template(body)


# ---- core_mem: aliyun.com/gpu-core.percentage (issue 37) -------------------------------------


def core_pod(units="4", percentage="30", containers: int = 1) -> dict:
    res = {"limits": {"aliyun.com/gpu-mem": units, "aliyun.com/gpu-core.percentage": percentage}}
    if percentage is None:
        del res["limits"]["aliyun.com/gpu-core.percentage"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": f"c{i}", "image": "x", "resources": copy.deepcopy(res)}
                                    for i in range(containers)]}}


@pytest.mark.parametrize("value,why", [
    ("33", "container c0: limits aliyun.com/gpu-core.percentage 33 is not a percentage core_mem gives: give a "
           "whole multiple of 5 from 5 to 100"),
    ("0", "container c0: limits aliyun.com/gpu-core.percentage 0 is not a percentage core_mem gives: give a "
          "whole multiple of 5 from 5 to 100"),
    ("3", "container c0: limits aliyun.com/gpu-core.percentage 3 is not a percentage core_mem gives: give a "
          "whole multiple of 5 from 5 to 100"),
    ("105", "container c0: limits aliyun.com/gpu-core.percentage 105 is not a percentage core_mem gives: give a "
            "whole multiple of 5 from 5 to 100"),
    ("2.5", "container c0: limits aliyun.com/gpu-core.percentage '2.5' is not a whole number: give a whole "
            "multiple of 5 from 5 to 100"),
    ("50m", "container c0: limits aliyun.com/gpu-core.percentage '50m' is not a whole number: give a whole "
            "multiple of 5 from 5 to 100"),
])
def test_a_bad_compute_percentage_is_refused_at_create_with_one_line(value, why):
    with pytest.raises(webhook.Denied) as e:
        webhook.decide({"uid": "u", "operation": "CREATE", "kind": {"group": "", "kind": "Pod"},
                        "namespace": "ns", "object": core_pod(percentage=value)})
    assert str(e.value) == why and "\n" not in str(e.value)


def test_a_percentage_without_gpu_mem_or_beside_a_memory_only_container_is_refused():
    pod = core_pod()
    del pod["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-mem"]
    with pytest.raises(webhook.Denied, match="^container c0: aliyun.com/gpu-core.percentage 30 without "
                                             "aliyun.com/gpu-mem: .* ask aliyun.com/gpu-mem too$"):
        webhook.mutate(pod, "ns")
    pod = core_pod(containers=2)
    del pod["spec"]["containers"][1]["resources"]["limits"]["aliyun.com/gpu-core.percentage"]
    with pytest.raises(webhook.Denied, match="^containers c1 ask aliyun.com/gpu-mem without aliyun.com/gpu-core."
                                             "percentage and others with it: memory-only and percentage containers "
                                             "never share a node"):
        webhook.mutate(pod, "ns")


def test_a_percentage_pod_claims_its_compute_as_capacity_of_core_mem_gpus_only():
    """`gpu-mem: 4` and `gpu-core.percentage: 30` → one claim asking 4 units of memory and 30 of
    the device's `compute`, on devices whose mode is core_mem; a memory-only pod's claim keeps off
    them (and off whole GPUs)."""
    pod = core_pod()
    d = webhook.mutate(pod, "ns")
    got = apply(pod, d.patch)
    assert got["spec"]["containers"][0]["resources"] == {"limits": {}, "claims": [{"name": "cgpu-gpu-mem"}]}
    (t,) = d.templates
    assert t["metadata"]["name"] == "cgpu-gpu-mem-4c30x1"
    for name, unit in (("unit-1gi", GIB), ("unit-128mi", 128 * MIB)):
        a = alternatives(t)[name]
        assert a["capacity"]["requests"] == {"memory": str(4 * unit), "compute": "30"}
        assert [s["cel"]["expression"] for s in a["selectors"]] == [
            f'device.attributes["cgpu.aliyun.com"].memoryUnit == {unit}',
            '"mode" in device.attributes["cgpu.aliyun.com"] && device.attributes["cgpu.aliyun.com"].mode == "core_mem"']
    (t,) = webhook.mutate(core_pod(percentage=None), "ns").templates
    assert t["metadata"]["name"] == "cgpu-gpu-mem-4x1"
    a = alternatives(t)["unit-1gi"]
    assert a["capacity"]["requests"] == {"memory": str(4 * GIB)}
    assert a["selectors"][1]["cel"]["expression"] == (
        '!("mode" in device.attributes["cgpu.aliyun.com"]) || '
        'device.attributes["cgpu.aliyun.com"].mode in ["cgpu", "share", "mps"]')


def test_the_quota_counts_a_percentage_templates_units():
    from cgpud.k8s import quota

    assert quota.template_units("cgpu-gpu-mem-4c30x1") == 4
    assert quota.template_units(webhook.pod_template("ns", [("c-0", 2, 20), ("c-1", 3, 20)], 1)["metadata"]["name"]) == 5
