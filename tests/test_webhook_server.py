"""`cgpu dra-webhook`'s server against what a caller who is not the API server can do (issue 33,
docs/security.md "The cluster"): connections that never speak, callers without the API server's
client certificate, and the quota of the pods it rewrites. Real sockets, real TLS (Python's ssl,
certificates by the openssl CLI); the API server is a fake recording what would be made. On the
real control plane: tests/test_cluster_security.py."""
from __future__ import annotations

import copy
import json
import socket
import ssl
import subprocess
import threading
from decimal import Decimal
from pathlib import Path

import pytest

from cgpud.k8s import healthport, quota, webhook, webhookserver

CN = "kube-apiserver-kubelet-client"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, stdin=subprocess.DEVNULL)


def client_cert(d: Path, cn: str) -> tuple[Path, Path, Path]:
    """A CA of its own in `d` and a client certificate it signs for `cn`: (ca, cert, key)."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    (d / "ext").write_text("extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n")
    _openssl("req", *ec, "-keyout", "c.key", "-out", "c.csr", "-subj", f"/CN={cn}", cwd=d)
    _openssl("x509", "-req", "-in", "c.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "c.crt",
             "-days", "2", "-extfile", "ext", cwd=d)
    return d / "ca.crt", d / "c.crt", d / "c.key"


class FakeApi:
    def __init__(self, quotas: list[dict] | None = None, pods: list[dict] | None = None) -> None:
        self.made: list[dict] = []
        self.quotas, self.listed = quotas or [], pods or []

    def ensure_template(self, body: dict) -> None:
        self.made.append(body)

    def gpu_mem_quotas(self, namespace: str) -> list[dict]:
        return [q for q in self.quotas if quota.hard(q) is not None]

    def pods(self, namespace: str) -> list[dict]:
        return copy.deepcopy(self.listed)


def pod(n: int = 8, m: int = 2, name: str | None = None, **spec) -> dict:
    meta = {"labels": {webhook.LABEL: str(m)}} if m else {"labels": {}}
    meta.update({"name": name} if name else {"generateName": "job-"})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "app", "image": "x", "resources": {
                "limits": {webhook.RESOURCE: str(n)}, "requests": {webhook.RESOURCE: str(n)}}}], **spec}}


def review(p: dict, uid: str = "u-1", ns: str = "team-a", dry_run: bool = False) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                        "namespace": ns, "object": p, "dryRun": dry_run}}


@pytest.fixture
def certs(tmp_path):
    ca, cert, key = webhookserver.make_certificate(["127.0.0.1"], str(tmp_path))
    api_ca, api_cert, api_key = client_cert(tmp_path / "apiserver", CN)
    return {"ca": ca, "cert": cert, "key": key, "client_ca": api_ca, "client": (api_cert, api_key)}


def serve(certs, api, names=(CN,)):
    ctx = webhookserver.server_context(certs["cert"], certs["key"], str(certs["client_ca"]))
    srv = webhookserver.make_server(api, "127.0.0.1", 0, ctx, names, ledger=quota.Ledger())
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def client_ctx(certs, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=certs["ca"].decode())
    if cert:
        ctx.load_cert_chain(*map(str, cert))
    return ctx


def post(port: int, ctx: ssl.SSLContext, body: dict, timeout: float = 20) -> tuple[int, dict]:
    """POST /mutate over a connection of its own (HTTP/1.0, as the server speaks): (status, JSON)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"POST /mutate HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(data) + data)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
    if not got:
        raise ConnectionError("closed without an answer")
    head, _, body_ = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body_)


def test_a_hundred_idle_connections_keep_no_admission_waiting(certs):
    """Issue 33: the handshake ran inside accept() on the one serving thread with no deadline, so
    one TCP client that never sent a ClientHello blocked every admission (on main this test's
    first POST times out). Each connection shakes hands on its own thread now."""
    api = FakeApi()
    srv = serve(certs, api, names=None)
    port = srv.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(100)]
    try:
        ctx = client_ctx(certs, certs["client"])
        for i in range(5):
            code, answer = post(port, ctx, review(pod(), uid=f"u-{i}"))
            assert code == 200 and answer["response"]["allowed"] is True and answer["response"]["patch"]
        assert len(api.made) == 5
        assert all(s.fileno() >= 0 for s in idle)  # (they were held all along)
    finally:
        for s in idle:
            s.close()
        srv.shutdown()
        srv.server_close()


def test_a_connection_that_never_finishes_its_handshake_is_cut_and_the_oldest_makes_room(certs, monkeypatch):
    """The bounds: a handshake past HANDSHAKE_S is cut; with MAX_HANDSHAKING under way, a new
    connection pushes out the oldest (so a flood cannot keep the API server's out)."""
    monkeypatch.setattr(webhookserver, "HANDSHAKE_S", 1.0)
    monkeypatch.setattr(webhookserver, "MAX_HANDSHAKING", 3)
    srv = serve(certs, FakeApi(), names=None)
    port = srv.server_address[1]
    try:
        first = socket.create_connection(("127.0.0.1", port), timeout=30)
        first.sendall(b"\x16\x03\x01")  # the start of a ClientHello, and then nothing
        others = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        assert first.recv(1) == b""  # pushed out by the fourth (or cut by the deadline): closed either way
        for s in others:
            assert s.recv(1) == b""  # cut at the deadline: the server closed them
        assert srv.dropped >= 1  # (the first, pushed out; the others may end at their own socket timeout)
        code, answer = post(port, client_ctx(certs, certs["client"]), review(pod()))
        assert code == 200 and answer["response"]["allowed"] is True
        first.close()
        for s in others:
            s.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_only_the_api_servers_client_certificate_may_ask_and_nothing_is_made_for_anyone_else(certs, tmp_path):
    """Issue 33: anyone who reached the Service could post an AdmissionReview naming any
    namespace and have templates made there with the webhook's cluster-wide right (main makes the
    template for the first POST below). Issue 44: told at the handshake. Without a certificate, or
    with one of another CA: no handshake; of its CA with another CN: closed after it, unanswered."""
    api = FakeApi()
    srv = serve(certs, api)
    port = srv.server_address[1]
    try:
        with pytest.raises(OSError):  # (ssl.SSLError: "certificate required"; or the connection reset)
            post(port, client_ctx(certs, None), review(pod(), ns="kube-system"))
        _, other_cert, other_key = client_cert(tmp_path / "other", CN)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            post(port, client_ctx(certs, (other_cert, other_key)), review(pod()))
        with pytest.raises(OSError):
            post(port, client_ctx(certs, _wrong_cn(certs, tmp_path / "wrong")), review(pod()))
        assert srv.refused == 1 and api.made == []
        code, answer = post(port, client_ctx(certs, certs["client"]), review(pod()))
        assert code == 200 and answer["response"]["allowed"] is True
        assert [(t["metadata"]["namespace"], t["metadata"]["name"]) for t in api.made] == \
            [("team-a", webhook.template_name(8, 2))]
    finally:
        srv.shutdown()
        srv.server_close()


def _wrong_cn(certs, d: Path) -> tuple[Path, Path]:
    """A client certificate of the API server's CA with another CN."""
    d.mkdir()
    for f in ("ca.crt", "ca.key"):
        (d / f).write_bytes((certs["client_ca"].parent / f).read_bytes())
    (d / "ext").write_text("extendedKeyUsage=clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", *ec, "-keyout", "w.key", "-out", "w.csr", "-subj", "/CN=system:anonymous", cwd=d)
    _openssl("x509", "-req", "-in", "w.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "w.crt", "-days", "2", "-extfile", "ext", cwd=d)
    return d / "w.crt", d / "w.key"


def test_silent_tls_clients_that_are_not_the_api_server_hold_no_serving_slot(certs, tmp_path):
    """Issue 44: any client that completed a TLS handshake and said nothing held one of the
    MAX_SERVING slots for REQUEST_S (the certificate was checked after the body): 100 of them kept
    the API server's POST waiting past 15 s, and every GPU pod's creation timed out. Now a
    handshake needs the API server's CA, and its CN is checked before a slot is given."""
    api = FakeApi()
    srv = serve(certs, api)
    port = srv.server_address[1]
    wrong = _wrong_cn(certs, tmp_path / "wrong")
    silent = []
    try:
        for i in range(100):  # half with no certificate, half with the right CA's but another CN
            raw = socket.create_connection(("127.0.0.1", port), timeout=20)
            try:
                silent.append(client_ctx(certs, None if i % 2 else wrong).wrap_socket(raw, server_hostname="127.0.0.1"))
            except OSError:
                raw.close()  # (refused at the handshake itself: holds nothing either)
        ctx = client_ctx(certs, certs["client"])
        for i in range(3):
            code, answer = post(port, ctx, review(pod(), uid=f"u-{i}"), timeout=5)
            assert code == 200 and answer["response"]["allowed"] is True
        assert len(api.made) == 3 and srv.refused >= 40
    finally:
        for s in silent:
            s.close()
        srv.shutdown()
        srv.server_close()


def test_the_health_port_answers_the_probe_without_a_certificate_whatever_else_is_connected():
    """The kubelet's probe has no client certificate: /healthz is on a plain port of its own,
    which silent connections (more than it keeps) cannot close to the probe."""
    h = healthport.HealthPort("127.0.0.1", 0)
    port = h.server_address[1]

    def ask(line: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(line + b"\r\nHost: x\r\n\r\n")
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            return got
    silent = []
    try:
        assert ask(b"GET /healthz HTTP/1.1").startswith(b"HTTP/1.0 200 OK")
        assert ask(b"POST /mutate HTTP/1.1").startswith(b"HTTP/1.0 404")
        assert ask(b"\x16\x03\x01 hello").startswith(b"HTTP/1.0 400")
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5)
                  for _ in range(healthport.MAX_OPEN + 44)]
        for _ in range(3):
            assert ask(b"GET /healthz HTTP/1.1").endswith(b"ok\n")
        assert h.dropped >= 44
    finally:
        for s in silent:
            s.close()
        h.close()


# ---- the quota of the pods it rewrites ---------------------------------------------------------


def rq(name: str, hard: str, **spec) -> dict:
    return {"metadata": {"name": name}, "spec": {"hard": {quota.KEY: hard}, **spec}}


def rewritten(n: int, m: int, name: str, phase: str = "Pending") -> dict:
    """A pod as the API server lists it after the webhook rewrote it (its patch applied)."""
    p = pod(n, m, name=name)
    d = webhook.mutate(p, "team-a")
    from test_webhook import apply

    out = apply(p, d.patch)
    out["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    out["status"] = {"phase": phase}
    return out


def test_a_rewritten_pod_counts_as_its_gpu_mem_did_and_one_past_the_quota_is_refused():
    """Issue 33: the webhook took aliyun.com/gpu-mem off a labelled pod, so the namespace's
    requests.aliyun.com/gpu-mem quota no longer counted it (main admits every pod below). The
    sum: an unlabelled pod's own gpu-mem (3), the rewritten pods' templates (8; a finished one 0)."""
    listed = [pod(3, 0, name="plain"), rewritten(8, 2, "a"), rewritten(8, 2, "done", phase="Succeeded")]
    api = FakeApi([rq("gpu", "20")], listed)
    ledger = quota.Ledger()
    ok = webhookserver.admit(api, review(pod(8, 2)), ledger)["response"]
    assert ok["allowed"] is True and len(api.made) == 1  # 3 + 8 + 8 = 19 ≤ 20
    no = webhookserver.admit(api, review(pod(2, 2), uid="u-2"), ledger)["response"]  # 19 (this one reserved) + 2
    assert no["allowed"] is False and no["status"]["message"] == (
        "exceeded quota: gpu, requested: requests.aliyun.com/gpu-mem=2, used: requests.aliyun.com/gpu-mem=19, "
        "limited: requests.aliyun.com/gpu-mem=20 (a pod whose aliyun.com/gpu-mem the webhook turns into claims "
        "counts as before)")
    assert len(api.made) == 1  # (nothing made for the refused one)
    # a dry run is checked the same and reserves nothing; a namespace without the quota is not read
    assert webhookserver.admit(api, review(pod(1, 1)), ledger)["response"]["allowed"] is True  # 19 + 1: the quota
    assert webhookserver.admit(FakeApi(), review(pod(64, 2)), ledger)["response"]["allowed"] is True


def test_the_reservation_is_answered_by_the_listed_pod_not_counted_twice():
    ledger = quota.Ledger()
    api = FakeApi([rq("gpu", "16")], [])
    assert webhookserver.admit(api, review(pod(8, 2, name="a")), ledger)["response"]["allowed"] is True
    api.listed = [rewritten(8, 2, "a")]  # the LIST now shows it: 8, not 16
    assert webhookserver.admit(api, review(pod(8, 2, name="b"), uid="u-2"), ledger)["response"]["allowed"] is True
    api.listed.append(rewritten(8, 2, "b"))
    no = webhookserver.admit(api, review(pod(2, 2, name="c"), uid="u-3"), ledger)["response"]
    assert no["allowed"] is False and "used: requests.aliyun.com/gpu-mem=16," in no["status"]["message"]


def test_concurrent_admissions_of_one_process_never_pass_the_quota_together():
    api = FakeApi([rq("gpu", "16")], [])
    ledger = quota.Ledger()
    answers = []
    threads = [threading.Thread(target=lambda i=i: answers.append(
        webhookserver.admit(api, review(pod(8, 2), uid=f"u-{i}"), ledger)["response"]["allowed"])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [False] * 4 + [True] * 2


@pytest.mark.parametrize("spec,pod_spec,applies", [
    ({}, {}, True),
    ({"scopes": ["Terminating"]}, {}, False),
    ({"scopes": ["NotTerminating"]}, {}, True),
    ({"scopes": ["Terminating"]}, {"activeDeadlineSeconds": 60}, True),
    ({"scopes": ["BestEffort"]}, {}, True),
    ({"scopes": ["NotBestEffort"]}, {}, False),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["hi"]}]}},
     {"priorityClassName": "hi"}, True),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["hi"]}]}},
     {}, False),
    ({"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "DoesNotExist"}]}},
     {}, True),
])
def test_a_quotas_scopes_decide_whether_it_counts_the_pod(spec, pod_spec, applies):
    """The scopes as the API server's quota evaluator reads them for pods (a pod with only an
    extended resource and no cpu/memory is BestEffort)."""
    assert quota.applies({"spec": {"hard": {quota.KEY: "1"}, **spec}}, pod(8, 2, **pod_spec)) is applies


def test_what_a_pod_counts_follows_the_templates_the_webhook_names():
    """The counting reads the template names webhook.template_name writes: any change there must
    keep N readable (this test breaks first)."""
    for n, m in ((8, 2), (12, 4), (64, 32)):
        assert quota.claimed_units(rewritten(n, m, "x")) == n and quota.pod_units(rewritten(n, m, "x")) == 0
    p = pod(5, 0)
    p["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {webhook.RESOURCE: "7"}}}]
    assert quota.pod_units(p) == 7 and quota.counted(p) == Decimal(7)


def test_a_pod_of_many_containers_counts_all_its_units_never_zero():
    """Issue 44: a template's name past 63 characters was hashed, and a hashed name counted 0: a pod
    of six containers asking 100000 units each counted nothing against the quota once admitted. The
    name is cut into labels by dots now, and read back whole; past 253 characters the pod is refused."""
    def many(k: int, n: int) -> dict:
        p = pod(0, 0, name=f"many-{k}")
        p["spec"]["containers"] = [{"name": f"c{i}", "image": "x", "resources": {"limits": {webhook.RESOURCE: str(n)}}}
                                   for i in range(k)]
        return p
    for k in (2, 6, 12):
        d = webhook.mutate(many(k, 100000), "team-a")
        (t,) = d.templates
        name = t["metadata"]["name"]
        assert len(name) <= 253 and all(0 < len(label) <= 63 for label in name.split(".")), name
        assert not any(label.startswith("-") or label.endswith("-") for label in name.split("."))
        from test_webhook import apply

        got = apply(many(k, 100000), d.patch)
        assert quota.claimed_units(got) == quota.counted(got) == k * 100000
    api = FakeApi([rq("gpu", "700000")], [])
    ledger = quota.Ledger()
    assert webhookserver.admit(api, review(many(6, 100000)), ledger)["response"]["allowed"] is True
    from test_webhook import apply

    api.listed = [apply(many(6, 100000), webhook.mutate(many(6, 100000), "team-a").patch)]
    no = webhookserver.admit(api, review(many(2, 100000), uid="u-2"), ledger)["response"]
    assert no["allowed"] is False and "used: requests.aliyun.com/gpu-mem=600000," in no["status"]["message"]
    with pytest.raises(webhook.Denied, match="containers ask aliyun.com/gpu-mem: more than one claim's name can say"):
        webhook.mutate(many(30, 100000), "team-a")


def test_a_template_made_by_hand_under_the_webhooks_name_is_refused():
    """Issue 44: a tenant made `cgpu-gpu-mem-1x1` by hand asking eight whole GPUs; a pod asking one
    unit was rewritten to it (AlreadyExists was fine) and counted one unit. Now one found under the
    webhook's name must be what the webhook makes."""
    class Existing(FakeApi):
        def __init__(self, found: dict) -> None:
            super().__init__()
            self.found = found

        def ensure_template(self, body: dict):
            super().ensure_template(body)
            return self.found

    ours = webhook.template("team-a", 1, 1)
    greedy = copy.deepcopy(ours)
    for alt in greedy["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"]:
        alt["count"] = 8
        alt["capacity"]["requests"]["memory"] = str(80 << 30)
    admin = copy.deepcopy(ours)
    admin["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"][0]["adminAccess"] = True
    for found, why in ((greedy, "count is 8, not 1"), (admin, "adminAccess is not the webhook's")):
        got = webhookserver.admit(Existing(found), review(pod(1, 0)), quota.Ledger())["response"]
        assert got["allowed"] is False and "ResourceClaimTemplate team-a/cgpu-gpu-mem-1x1 is not the one the " \
            "webhook makes" in got["status"]["message"] and why in got["status"]["message"], got
    same = copy.deepcopy(ours)
    same["metadata"]["uid"] = "x"  # (what the API server adds; and a field it defaults, empty)
    same["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"][0]["tolerations"] = []
    assert webhookserver.admit(Existing(same), review(pod(1, 0)), quota.Ledger())["response"]["allowed"] is True
