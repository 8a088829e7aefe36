"""bench/webhook_attack: the cluster side of issue 33, in one run, on a real kube-apiserver
(tests/cluster.py's control plane: etcd and kube-apiserver, the shipped manifests with the DRA
component applied, nodes node-a and node-b made through the API) and `cgpu dra-webhook` as a host
process called by the API server with its client certificate.

1. Admission through the API server (a server-side dry run of a labelled pod, which the API server
   sends to the webhook), p50 and p99 over --admissions, in turns of ten: with --idle idle TCP
   connections held open to the webhook (connected, never a ClientHello), with --idle silent TLS
   connections (issue 44: half with a client certificate of the cluster's CA and another CN, half
   with none; each completes or tries its handshake, then says nothing), and with none (the
   reference, in the same turns). Then main's server (git show 4bb5e69:cgpud/k8s/webhookserver.py,
   or --main-ref), in this process with the same certificate: how many of 5 POSTs are answered
   within 10 s with --idle idle connections held open to it (issue 33: none); and the server
   before issue 44 (--tls-ref) in the same way with --idle silent TLS connections: the time of each
   of 5 POSTs in turn, and POSTs in turns of ten with and without them, p50/p99, for that server and
   this one, in this process (--in-process-only: these alone, no cluster).
2. The attacks of a caller who is not the API server, a stolen node token, a stolen webhook
   token, a tenant escaping its quota: each tried against the API server (or the webhook), and
   whether it succeeded (it must not).

    .venv/bin/python bench/webhook_attack.py [--admissions 100] [--idle 100] [--main-ref 4bb5e69] [--tls-ref 555a060]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from cluster import DRA_SA, NAMESPACE, SA, Cluster  # noqa: E402
from test_cluster_security import (QUOTA_NS, WEBHOOK, WEBHOOK_USER, anonymous_cert, as_token, labelled,  # noqa: E402
                                   overlay, silent_tls, slice_, start_webhook, try_)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def admission_times(c: Cluster, n: int, hold) -> tuple[list[float], list[float]]:
    """(with the connections `hold()` opens held, without), in turns of ten, through the official client."""
    api = c.api()
    body = labelled("bench", 4)
    with_, without = [], []
    held: list[socket.socket] = []
    for turn in range(2 * ((n + 9) // 10)):
        loaded = turn % 2 == 0
        if loaded:
            held = hold()
        for _ in range(10):
            t0 = time.perf_counter()
            got = api.create_namespaced_pod("default", body, dry_run="All", _preload_content=False)
            dt = (time.perf_counter() - t0) * 1000
            assert "resourceClaims" in json.loads(got.data)["spec"], "the webhook did not change the pod"
            (with_ if loaded else without).append(dt)
        for s in held:
            s.close()
        held = []
    return with_[:n], without[:n]


def server_of(ref: str, d: Path):
    """`ref`'s cgpud/k8s/webhookserver.py as a module, written into `d`; ValueError when git cannot
    show it."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:cgpud/k8s/webhookserver.py"], capture_output=True,
                         text=True)
    if src.returncode != 0:
        raise ValueError(f"(cannot read {ref}'s webhookserver.py: {src.stderr.strip()})")
    (d / "ws_ref.py").write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("ws_ref", d / "ws_ref.py")
    ws = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ws)
    return ws


def main_server_answers(ref: str, idle: int) -> str:
    """Main's webhook server, in this process: POSTs answered within 10 s with `idle` idle
    connections held open to it."""
    d = tempfile.mkdtemp(prefix="cgpu-bench-main-")
    try:
        ws = server_of(ref, Path(d))
    except ValueError as exc:
        return str(exc)

    class Api:
        def ensure_template(self, body):
            pass

        def gpu_mem_quotas(self, ns):
            return []

        def pods(self, ns):
            return []

    ca, cert, key = ws.make_certificate(["127.0.0.1"], d)
    srv = ws.make_server(Api(), "127.0.0.1", 0, ws.server_context(cert, key))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
        "namespace": "default", "object": labelled("p", 4)}}
    ok = 0
    for _ in range(5):
        try:
            req = urllib.request.Request(f"https://127.0.0.1:{port}/mutate", data=json.dumps(review).encode())
            with urllib.request.urlopen(req, context=ssl.create_default_context(cadata=ca.decode()), timeout=10):
                ok += 1
        except OSError:
            pass
    for s in held:
        s.close()
    return f"{ok} of 5 answered within 10 s"


def tls_server_answers(ref: str, silent: int) -> str:
    """The server of `ref` (before issue 44), in this process, with a client CA: how long POSTs with
    the API server's certificate take while `silent` clients without one hold a completed handshake
    and say nothing."""
    from test_webhook_server import CN, FakeApi, client_cert, client_ctx, post, review

    d = Path(tempfile.mkdtemp(prefix="cgpu-bench-tls-"))
    try:
        ws = server_of(ref, d)
    except ValueError as exc:
        return str(exc)
    ca, cert, key = ws.make_certificate(["127.0.0.1"], str(d))
    api_ca, api_cert, api_key = client_cert(d / "apiserver", CN)
    certs = {"ca": ca, "client": (api_cert, api_key)}
    srv = ws.make_server(FakeApi(), "127.0.0.1", 0, ws.server_context(cert, key, str(api_ca)), (CN,))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    held = silent_tls(port, silent, ca.decode(), None)
    times = []
    for i in range(5):  # (one after another, each with the API server's 30 s)
        t0 = time.perf_counter()
        try:
            code, _ = post(port, client_ctx(certs, certs["client"]), review(labelled("p", 4), uid=f"u-{i}"), timeout=30)
            times.append(f"{time.perf_counter() - t0:.2f} s" if code == 200 else f"HTTP {code}")
        except OSError as exc:
            times.append(f"failed ({exc.__class__.__name__})")
    for s in held:
        s.close()
    srv.shutdown()
    return "5 POSTs one after another answered in " + ", ".join(times)


def in_process_times(ref: str | None, silent: int, n: int) -> tuple[list[float], list[float]]:
    """The server of `ref` (None: this checkout's), in this process, with a client CA: POSTs with the
    API server's certificate, in turns of ten, with `silent` silent TLS connections held (half with
    no certificate, half with one of the API server's CA and another CN; each turn its own) and with
    none: (with, without) in ms; a POST that fails counts 30 s (the API server's wait, at most)."""
    from test_webhook_server import CN, FakeApi, _wrong_cn, client_cert, client_ctx, post, review

    d = Path(tempfile.mkdtemp(prefix="cgpu-bench-tls-"))
    if ref is None:
        from cgpud.k8s import webhookserver as ws
    else:
        ws = server_of(ref, d)
    ca, cert, key = ws.make_certificate(["127.0.0.1"], str(d))
    api_ca, api_cert, api_key = client_cert(d / "apiserver", CN)
    certs = {"ca": ca, "client": (api_cert, api_key), "client_ca": api_ca}
    wrong = _wrong_cn(certs, d / "wrong")
    srv = ws.make_server(FakeApi(), "127.0.0.1", 0, ws.server_context(cert, key, str(api_ca)), (CN,))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    with_, without = [], []
    try:
        for turn in range(2 * ((n + 9) // 10)):
            loaded = turn % 2 == 0
            held = silent_tls(port, silent // 2, ca.decode(), wrong) + silent_tls(port, silent - silent // 2,
                                                                                   ca.decode(), None) if loaded else []
            for i in range(10):
                t0 = time.perf_counter()
                try:
                    code, _ = post(port, client_ctx(certs, certs["client"]), review(labelled("p", 4), uid=f"u{i}"),
                                   timeout=30)
                    dt = (time.perf_counter() - t0) * 1000 if code == 200 else 30000.0
                except OSError:
                    dt = 30000.0
                (with_ if loaded else without).append(dt)
            for sock in held:
                sock.close()
    finally:
        srv.shutdown()
        srv.server_close()
    return with_[:n], without[:n]


def attacks(c: Cluster, port: int, ca: str) -> list[tuple[str, bool]]:
    """Each attack and whether it succeeded."""
    out = []
    a = as_token(c, "dra-a", c.node_token(DRA_SA, "node-a"))
    node_a = as_token(c, "node-a", c.node_token(SA, "node-a"))
    c.node_token(SA, "node-b")

    def ok(p) -> bool:
        return p.returncode == 0

    # (the policies are loaded by a watch: wait until the first is in force)
    deadline = time.monotonic() + 30
    while "cgpu-dra-plugin-node-scope" not in try_(c, a, "create", "-f", "-", "--dry-run=server",
                                                     stdin=slice_("node-b")).stderr:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out.append(("DRA plugin token of node-a writes a ResourceSlice of node-b",
                ok(try_(c, a, "create", "-f", "-", stdin=slice_("node-b")))))
    out.append(("DRA plugin token of node-a writes another driver's slice on node-a",
                ok(try_(c, a, "create", "-f", "-", stdin=slice_("node-a", driver="gpu.nvidia.com")))))
    out.append(("DRA plugin token patches a node", ok(try_(c, a, "annotate", "node", "node-b", "x=y"))))
    out.append(("DRA plugin token patches a pod", ok(try_(c, a, "annotate", "pod", "-n", NAMESPACE,
                                                           f"{SA}-on-node-b", "x=y"))))
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": f"{SA}-on-node-b", "namespace": NAMESPACE},
               "target": {"kind": "Node", "name": "node-a"}}
    out.append(("node token binds a pod", ok(try_(c, node_a, "create", "-f", "-", stdin=binding))))
    out.append(("node token of node-a annotates node-b", ok(try_(c, node_a, "annotate", "node", "node-b",
                                                                 "cgpu.aliyun.com/gpu-mem-per-device=99"))))
    out.append(("node token of node-a labels its own node", ok(try_(c, node_a, "label", "node", "node-a",
                                                                     "nvidia.com/gpu.present=true"))))
    out.append(("node token of node-a annotates a pod on node-b", ok(try_(
        c, node_a, "annotate", "pod", "-n", NAMESPACE, f"{SA}-on-node-b", "ALIYUN_COM_GPU_MEM_ASSIGNED=true"))))
    widen = [{"op": "replace", "path": "/webhooks/0/rules/0/operations", "value": ["*"]}]
    out.append(("webhook token widens its rules", ok(try_(c, c.admin, "patch", "mutatingwebhookconfiguration",
                                                          WEBHOOK, "--as", WEBHOOK_USER, "--type=json", "-p",
                                                          json.dumps(widen)))))
    out.append(("webhook token drops its matchConditions", ok(try_(
        c, c.admin, "patch", "mutatingwebhookconfiguration", WEBHOOK, "--as", WEBHOOK_USER, "--type=json", "-p",
        json.dumps([{"op": "remove", "path": "/webhooks/0/matchConditions"}])))))
    token_secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
                    "metadata": {"name": "cgpu-dra-webhook-tls", "namespace": NAMESPACE,
                                 "annotations": {"kubernetes.io/service-account.name": "cgpu"}}}
    out.append(("webhook token makes a token Secret of another account",
                ok(try_(c, c.admin, "create", "-f", "-", "--as", WEBHOOK_USER, stdin=token_secret))))
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "forged", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
        "namespace": NAMESPACE, "object": labelled("forged", 6)}}
    try:
        req = urllib.request.Request(f"https://127.0.0.1:{port}/mutate", data=json.dumps(review).encode())
        urllib.request.urlopen(req, context=ssl.create_default_context(cadata=ca), timeout=20).read()
    except OSError:  # (HTTPError 403 before issue 44; now no handshake)
        pass
    out.append(("unauthenticated POST makes a ResourceClaimTemplate in kube-system",
                ok(try_(c, c.admin, "get", "resourceclaimtemplate", "-n", NAMESPACE, "cgpu-gpu-mem-6x2"))))
    c.create({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu-mem", "namespace": QUOTA_NS},
              "spec": {"hard": {"requests.aliyun.com/gpu-mem": "12"}}})
    c.kubectl("create", "-n", QUOTA_NS, "-f", "-", stdin=json.dumps(labelled("first", 8)))
    out.append(("labelled pod past its namespace's gpu-mem quota", ok(try_(
        c, c.admin, "create", "-n", QUOTA_NS, "-f", "-", stdin=labelled("second", 8)))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admissions", type=int, default=100)
    ap.add_argument("--idle", type=int, default=100)
    ap.add_argument("--main-ref", default="4bb5e69",
                    help="the git ref of the server before issue 33 (default 4bb5e69, main when it was filed)")
    ap.add_argument("--in-process-only", action="store_true", help="the in-process figures only (no cluster)")
    ap.add_argument("--tls-ref", default="555a060",
                    help="the git ref of the server before issue 44 (default 555a060, main when it was filed)")
    args = ap.parse_args()
    answered = main_server_answers(args.main_ref, args.idle)
    print(f"main's server ({args.main_ref}), {args.idle} idle connections held: {answered}", flush=True)
    answered = tls_server_answers(args.tls_ref, args.idle)
    print(f"the server of {args.tls_ref}, {args.idle} silent TLS connections held: {answered}", flush=True)
    for ref, what in ((args.tls_ref, f"the server of {args.tls_ref}"), (None, "this checkout's server")):
        loaded, quiet = in_process_times(ref, args.idle, args.admissions // 2)
        print(f"{what}, in this process, {len(loaded)} POSTs each in turns of ten: {args.idle} silent TLS "
              f"connections held p50 {pct(loaded, 50):.1f} ms, p99 {pct(loaded, 99):.1f} ms; none p50 "
              f"{pct(quiet, 50):.1f} ms, p99 {pct(quiet, 99):.1f} ms", flush=True)
    if args.in_process_only:
        return
    c = Cluster(None, None).start_control_plane()
    try:
        c.kubectl("apply", "-k", overlay(c.path("overlay")))
        for node in ("node-a", "node-b"):
            c.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        c.kubectl("create", "namespace", QUOTA_NS)
        c.kubectl("create", "serviceaccount", "default", "-n", QUOTA_NS)
        _, port = start_webhook(c, "dra-webhook")
        ca = c.get("secret", "cgpu-dra-webhook-tls", "-n", NAMESPACE)["data"]["ca.crt"]
        c.kubectl("patch", "mutatingwebhookconfiguration", WEBHOOK, "--type=json", "-p", json.dumps(
            [{"op": "replace", "path": "/webhooks/0/clientConfig",
              "value": {"url": f"https://127.0.0.1:{port}/mutate", "caBundle": ca}}]))
        import base64

        ca_pem = base64.b64decode(ca).decode()
        deadline = time.monotonic() + 30
        while True:  # (the API server reads the configuration by a watch)
            p = c.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", check=False,
                          stdin=json.dumps(labelled("w", 4)))
            if p.returncode == 0 and "resourceClaims" in p.stdout:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the API server never called the webhook: {p.stderr}")
            time.sleep(0.2)
        anonymous = anonymous_cert(c)
        for what, hold in (
                (f"{args.idle} idle TCP connections held open",
                 lambda: [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(args.idle)]),
                (f"{args.idle} silent TLS connections held open",
                 lambda: silent_tls(port, args.idle // 2, ca_pem, anonymous)
                 + silent_tls(port, args.idle - args.idle // 2, ca_pem, None))):
            loaded, quiet = admission_times(c, args.admissions, hold)
            print(f"admission through the API server (server-side dry run), {len(loaded)} each, in turns of ten:")
            print(f"  {what}: p50 {pct(loaded, 50):.1f} ms, p99 {pct(loaded, 99):.1f} ms")
            print(f"  none (reference, the turns between): p50 {pct(quiet, 50):.1f} ms, p99 {pct(quiet, 99):.1f} ms",
                  flush=True)
        results = attacks(c, port, ca_pem)
        print(f"attacks tried / succeeded: {len(results)} / {sum(ok for _, ok in results)}")
        for what, ok in results:
            print(f"  {'SUCCEEDED' if ok else 'refused  '}  {what}")
    finally:
        c.cleanup()


if __name__ == "__main__":
    main()
