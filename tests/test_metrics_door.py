"""The metrics door (issue 44; cgpud/observe/door.py, docs/metrics.md "Who may read them").

Attacks that succeeded on the port as the DaemonSet served it (0.0.0.0:9402, no
authentication, a thread per connection): any pod read every tenant's container
ID, memsize, use and GPU time with one GET, and a flood of silent connections
made a thread each, without bound. Here a real daemon serves as the DaemonSet
now starts it (`--metrics-auth kubernetes`), checking tokens against the API
server stand-in's TokenReview and SubjectAccessReview (tests/apiserver_standin.py);
and as a plain host starts it (`--metrics-auth none`), where a client that is
not on loopback gets the GPUs' series but no tenant's.
"""
from __future__ import annotations

import http.client
import os
import re
import socket
import ssl
import subprocess
import time

import pytest

from apiserver_standin import ApiServer

TENANT = re.compile(rb"^cgpu_instance_\w+\{", re.M)


def host_address() -> str:
    """A non-loopback IPv4 address of this machine (a client from there is not on loopback)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    assert found, f"no non-loopback IPv4 address on this machine to scrape from:\n{out}"
    return found[0]


def bound_port(daemon, scheme: str) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = re.findall(rf"metrics on {scheme}://[^:]+:(\d+)/metrics", daemon.log_text())
        if m:
            return int(m[-1])
        time.sleep(0.05)
    pytest.fail(f"the daemon did not log a {scheme} metrics address:\n{daemon.log_text()}")


def get(port: int, *, host: str = "127.0.0.1", token: str | None = None, tls: bool = True,
        source: str | None = None) -> tuple[int, bytes]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (self-signed, as kube-rbac-proxy's)
    kw = {"source_address": (source, 0)} if source else {}
    conn = (http.client.HTTPSConnection(host, port, timeout=10, context=ctx, **kw) if tls
            else http.client.HTTPConnection(host, port, timeout=10, **kw))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.fixture
def apiserver(tmp_path, monkeypatch):
    api = ApiServer(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))  # (the daemon started next inherits it)
    yield api
    api.close()


def test_without_an_allowed_token_no_series_and_with_one_every_tenants(apiserver, make_daemon):
    tag = f"{os.getpid() % 10**6:06d}"
    scraper, tenant, group_member = f"system:serviceaccount:monitoring:prom{tag}", f"doortenant{tag[:2]}", f"grp{tag}"
    apiserver.tokens.update({
        "good": {"username": scraper, "uid": "u1", "groups": ["system:serviceaccounts"]},
        "tenant": {"username": f"system:serviceaccount:team-a:{tenant}", "uid": "u2",
                   "groups": ["system:serviceaccounts", "system:serviceaccounts:team-a"]},
        "grouped": {"username": group_member, "uid": "u3", "groups": ["metrics-readers"]},
    })
    apiserver.grants.update({(f"user:{scraper}", "get", "/metrics"), ("group:metrics-readers", "get", "/metr*")})
    d = make_daemon(extra_args=["--metrics-addr", "0.0.0.0:0", "--metrics-auth", "kubernetes"])
    d.create(0, tenant)
    port = bound_port(d, "https")
    source = host_address()  # (from the pod network, as another pod would)

    code, body = get(port, host=source, source=source)
    assert code == 401 and b"bearer token" in body and b"cgpu_" not in body
    code, body = get(port, host=source, source=source, token="forged")
    assert code == 401 and b"cgpu_" not in body
    code, body = get(port, host=source, source=source, token="tenant")  # a real token, no right to /metrics
    assert code == 403 and b"cgpu_" not in body, body
    assert f"user=system:serviceaccount:team-a:{tenant}".encode() in body
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        get(port, host=source, source=source, tls=False, token="good")  # a token never goes in the clear

    reviews = apiserver.requests["create", "tokenreviews"]
    for token in ("good", "grouped"):
        code, body = get(port, host=source, source=source, token=token)
        assert code == 200, body
        assert f'cgpu_instance_weight{{gpu="0",uuid='.encode() in body and f'container="{tenant}"'.encode() in body
        assert TENANT.search(body) and b"cgpu_gpu_memory_total_bytes{" in body
    assert apiserver.requests["create", "tokenreviews"] == reviews + 2
    assert apiserver.requests["create", "subjectaccessreviews"] >= 3
    for _ in range(3):  # answers are cached: no review per scrape
        assert get(port, host=source, source=source, token="good")[0] == 200
    assert apiserver.requests["create", "tokenreviews"] == reviews + 2


def test_the_plain_host_default_gives_tenants_series_to_loopback_only(make_daemon):
    tag = f"{os.getpid() % 10**6:06d}"
    d = make_daemon(extra_args=["--metrics-addr", "0.0.0.0:0"])
    d.create(0, f"lotenant{tag[:4]}")
    port = bound_port(d, "http")
    code, body = get(port, tls=False)
    assert code == 200 and f'container="lotenant{tag[:4]}"'.encode() in body
    source = host_address()
    code, body = get(port, host=source, source=source, tls=False)
    assert code == 200 and b"cgpu_gpu_memory_allocated_bytes{" in body and b"cgpu_container_starts_refused_total" in body
    assert not TENANT.search(body) and f"lotenant{tag[:4]}".encode() not in body and b"cgpu_instance_" not in body


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_flood_of_silent_connections_takes_a_bounded_number_of_threads(make_daemon):
    """400 connections from one address that never send a request: the daemon holds at most its
    bound of request threads (the port made one each, without bound), refuses the rest at once,
    and a scraper from another address is still answered meanwhile."""
    d = make_daemon(extra_args=["--metrics-addr", "0.0.0.0:0"])
    port = bound_port(d, "http")
    before = threads(d.proc.pid)
    source = host_address()
    flood: list[socket.socket] = []
    refused_fast = 0
    try:
        for _ in range(400):
            s = socket.create_connection((source, port), timeout=5, source_address=(source, 0))
            flood.append(s)
        time.sleep(0.5)
        during = threads(d.proc.pid)
        assert during - before <= 8, f"{during - before} more threads for 400 silent connections"
        for s in flood[-50:]:  # refused at once: a 503 line and closed, not left waiting
            s.settimeout(2)
            t = time.monotonic()
            data = s.recv(200)
            refused_fast += data.startswith(b"HTTP/1.1 503") and time.monotonic() - t < 2
        assert refused_fast == 50
        code, body = get(port, tls=False)  # from loopback: another address, its own turns
        assert code == 200 and b"cgpu_gpu_info{" in body
    finally:
        for s in flood:
            s.close()
    deadline = time.monotonic() + 15  # the silent ones held their slots for the deadline at most
    while threads(d.proc.pid) > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert threads(d.proc.pid) <= before
    assert get(port, tls=False)[0] == 200


def test_bad_door_settings_refuse_the_start_with_one_line(make_daemon, tmp_path):
    d = make_daemon(start=False, extra_args=["--metrics-addr", "127.0.0.1:0", "--metrics-tls-cert",
                                             str(tmp_path / "none.crt")])
    p = subprocess.run(d.command(), capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == "Error: --metrics-tls-cert and --metrics-tls-key go together"
    assert not os.path.ismount(d.mount)


def test_an_api_server_that_cannot_answer_refuses_the_scrape_and_caches_nothing(apiserver):
    """In process: the door's server, its reviews against the stand-in; the stand-in down (503) gives
    the scrape 503, and the same token is reviewed again once it is back."""
    from cgpud.observe import door, exposition

    from test_metrics import make_node
    from cgpud.observe.metrics import Publisher

    apiserver.tokens["t"] = {"username": "prom", "uid": "p", "groups": []}
    apiserver.grants.add(("user:prom", "get", "/metrics"))
    pub = Publisher(make_node())
    gate = door.Door("kubernetes")
    server = exposition.MetricsServer(exposition.wsgi_app(exposition.Exposition(lambda: pub.current), gate),
                                      tls=door.tls_context(None, None, "kubernetes"))
    _, port = server.start("127.0.0.1", 0)
    try:
        apiserver.failing = True
        code, body = get(port, token="t")
        assert code == 503 and b"cannot check the token now" in body and b"cgpu_" not in body
        apiserver.failing = False
        code, body = get(port, token="t")
        assert code == 200 and TENANT.search(body)
        assert gate.reviews == 2  # (the failed review was not cached)
        assert get(port, token="t")[0] == 200 and gate.reviews == 2
    finally:
        server.stop()


def test_tls_connections_past_the_bound_are_closed_before_the_handshake():
    from cgpud.observe import door, exposition

    server = exposition.MetricsServer(lambda environ, start: (start("200 OK", []), [b"x"])[1], max_requests=2,
                                      deadline=3, tls=door.tls_context(None, None, "kubernetes"))
    _, port = server.start("127.0.0.1", 0)
    # (two addresses: one address may hold half the slots)
    silent = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{i}", 0)) for i in (1, 2)]
    try:
        time.sleep(0.3)
        t = time.monotonic()
        extra = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0))
        extra.settimeout(2)
        assert extra.recv(10) == b"" and time.monotonic() - t < 1  # closed at once
        assert server.httpd.refused == 1
        time.sleep(3.5)  # the silent ones' deadline: their slots come back
        assert get(port, tls=True)[0] == 200
    finally:
        for s in silent:
            s.close()
        server.stop()


def test_a_client_that_trickles_its_request_is_cut_at_the_deadline():
    """A byte a second keeps each read alive; the connection's deadline (3 s here) ends it all the same."""
    from cgpud.observe import exposition

    server = exposition.MetricsServer(lambda environ, start: (start("200 OK", []), [b"x"])[1], deadline=3)
    _, port = server.start("127.0.0.1", 0)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        t, cut = time.monotonic(), None
        while time.monotonic() - t < 8:
            try:
                s.sendall(b"X")
            except OSError:
                cut = time.monotonic() - t
                break
            s.settimeout(1)
            try:
                if s.recv(100) == b"":
                    cut = time.monotonic() - t
                    break
            except socket.timeout:
                pass
        s.close()
        assert cut is not None and 2.5 < cut < 5, cut
        assert server.httpd.expired == 1
    finally:
        server.stop()
