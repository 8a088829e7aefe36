"""`cgpu dra-webhook`: the mutating admission webhook that serves seed 000's label in DRA mode
(docs/kubernetes.md; what it may do and why: docs/security.md, "The cluster"). The decision is
cgpud.k8s.webhook's; here is the I/O around it:

- HTTPS (the API server calls webhooks over TLS only): POST /mutate takes an AdmissionReview
  and answers one. Python's ssl serves it. Each connection's TLS handshake runs on its own
  thread with a deadline (HANDSHAKE_S), never on the accepting one: a client that connects and
  says nothing holds one thread for a few seconds and keeps no one else waiting. Connections
  are bounded (MAX_HANDSHAKING still in their handshake, the oldest dropped for a new one;
  MAX_SERVING requests at once) and each request has REQUEST_S to be read and answered.
- Who may ask: only the API server, told at the handshake, before a serving slot: the TLS
  handshake requires a client certificate of --client-ca (CERT_REQUIRED), and one whose CN is
  not one of --client-name is closed right after it (kube-apiserver's AdmissionConfiguration
  gives it one toward webhooks, `WebhookAdmission` kubeConfigFile). Anyone else who reaches the
  Service completes no handshake, holds no slot and has nothing made.
- Health: GET /healthz on a port of its own, plain HTTP (--health-addr; cgpud.k8s.healthport),
  for the kubelet's probe, which has no certificate.
- The certificate: given (--tls-cert/--tls-key), or shared by every replica through the Secret
  --tls-secret (made by the first replica that finds none: a CA and a serving certificate for
  --tls-san), or made at start (one replica only). The CA then goes into the caBundle of each
  webhook of the MutatingWebhookConfiguration --webhook-config (RBAC: get and patch that one
  object; a ValidatingAdmissionPolicy lets the webhook's ServiceAccount change nothing of it
  but the caBundle).
- The templates a decision names are created in the pod's namespace before the pod is
  admitted (AlreadyExists is fine: another pod, or another replica, made it first); not on a
  dry run (sideEffects: NoneOnDryRun). A template the API server refuses denies the pod with
  the API server's reason.
- A rewritten pod still counts against its namespace's `requests.aliyun.com/gpu-mem` quota:
  the webhook sums it (cgpud.k8s.quota) and refuses the rewrite past it, with one line.

Longer than 450 lines on purpose: the TLS server's deadlines and bounds, the API server's
client certificate, the CA shared through a Secret and the caBundle it writes are one
server's defences; split, none of them reads alone.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import logging
import os
import ssl
import socket
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler

from cgpud.k8s import quota, webhook
from cgpud.k8s.api import done
from cgpud.k8s.httpjson import Server, send_json

log = logging.getLogger("cgpud.k8s")
MAX_BODY = 8 << 20
PATH = "/mutate"
HANDSHAKE_S = 5.0  # a connection's TLS handshake, from accept to its end
REQUEST_S = 15.0  # a request read and answered, after the handshake (the API server waits at most 30 s)
MAX_HANDSHAKING = 512  # connections in their handshake at once: a new one drops the oldest
MAX_SERVING = 64  # requests handled at once: more wait for a turn within REQUEST_S
# the CN of the client certificate kubeadm gives the API server (apiserver-kubelet-client.crt, of the
# cluster's CA): the one to name in the AdmissionConfiguration's kubeconfig (docs/kubernetes.md)
CLIENT_NAMES = ("kube-apiserver-kubelet-client",)
SA_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"  # the cluster's CA, in every pod


class CertError(RuntimeError):
    """The serving certificate could not be made or loaded; str() is one line."""


def _openssl(*args: str, cwd: str) -> None:
    try:
        p = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=60)
    except FileNotFoundError:
        raise CertError("openssl is not installed: give --tls-cert and --tls-key instead") from None
    if p.returncode != 0:
        raise CertError(f"openssl {args[0]}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")


def make_certificate(sans: list[str], d: str) -> tuple[bytes, str, str]:
    """A CA (10 years) and a serving certificate it signs for `sans` (DNS names or IPs), EC P-256,
    in `d`: (the CA's PEM, the certificate's path, the key's path)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=cgpu-dra-webhook-ca", cwd=d)
    alt = []
    for s in sans:
        try:
            alt.append(f"IP:{ipaddress.ip_address(s)}")
        except ValueError:
            alt.append(f"DNS:{s}")
    with open(os.path.join(d, "ext"), "w") as f:
        f.write("extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
                f"subjectAltName={','.join(alt)}\n")
    _openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={sans[0]}", cwd=d)
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.crt", "-days", "3650", "-extfile", "ext", cwd=d)
    with open(os.path.join(d, "ca.crt"), "rb") as f:
        return f.read(), os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The serving context; with client_ca, a client certificate of that CA is required at the
    handshake (whether its CN may ask: TLSServer.caller, right after)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise CertError(f"cannot load {cert} / {key}: {getattr(exc, 'strerror', None) or exc}") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise CertError(f"cannot load the client CA {client_ca}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        ctx.verify_mode = ssl.CERT_REQUIRED  # (the kubelet's probe, which has none: the health port)
    return ctx


class Api:
    """The API server through the official client: templates made, the webhook's caBundle set."""

    def __init__(self) -> None:
        from kubernetes import client

        from cgpud.k8s.api import connect

        _, api_client = connect("cgpu-dra-webhook")
        self.resource = client.ResourceV1Api(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)
        self.core = client.CoreV1Api(api_client)

    def ensure_template(self, body: dict) -> dict | None:
        """Create the template: None; one that is there already: what it is (the caller compares).
        ApiException otherwise."""
        from kubernetes.client.exceptions import ApiException

        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            done(self.resource.create_namespaced_resource_claim_template(ns, body, _preload_content=False,
                                                                         _request_timeout=5))
            log.info("made ResourceClaimTemplate %s/%s", ns, name)
            return None
        except ApiException as exc:
            if exc.status != 409:
                raise
        return json.loads(self.resource.read_namespaced_resource_claim_template(
            name, ns, _preload_content=False, _request_timeout=5).data)

    def set_ca_bundle(self, name: str, ca: bytes) -> int:
        """Put the CA into every webhook of the MutatingWebhookConfiguration `name` (nothing else of
        it: the only change its ValidatingAdmissionPolicy lets the webhook make): how many. One
        already holding it is left alone (another replica of the same Secret wrote it)."""
        got = json.loads(self.admission.read_mutating_webhook_configuration(name, _preload_content=False).data)
        bundle = base64.b64encode(ca).decode()
        hooks = got.get("webhooks") or []
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": got["metadata"]["resourceVersion"]}]
        patch += [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
                  for i, h in enumerate(hooks) if (h.get("clientConfig") or {}).get("caBundle") != bundle]
        if len(patch) > 1:
            done(self.admission.patch_mutating_webhook_configuration(name, patch, _preload_content=False))
        return len(hooks)

    def tls_secret(self, namespace: str, name: str, make) -> dict[str, bytes]:
        """The Secret every replica serves with (ca.crt, tls.crt, tls.key); the first replica that
        finds none makes it (make() → those three), a second one racing it reads the winner's."""
        from kubernetes.client.exceptions import ApiException

        for _ in range(3):
            try:
                r = self.core.read_namespaced_secret(name, namespace, _preload_content=False, _request_timeout=10)
                data = json.loads(r.data).get("data") or {}
                got = {k: base64.b64decode(data.get(k) or "") for k in ("ca.crt", "tls.crt", "tls.key")}
                if not all(got.values()):
                    raise CertError(f"Secret {namespace}/{name} lacks one of ca.crt, tls.crt, tls.key")
                return got
            except ApiException as exc:
                if exc.status != 404:
                    raise
            files = make()
            body = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                    "metadata": {"name": name, "namespace": namespace,
                                 "labels": {"app.kubernetes.io/managed-by": "cgpu-dra-webhook"}},
                    "data": {k: base64.b64encode(v).decode() for k, v in files.items()}}
            try:
                done(self.core.create_namespaced_secret(namespace, body, _preload_content=False, _request_timeout=10))
                log.info("made Secret %s/%s (a CA and the serving certificate every replica uses)", namespace, name)
                return files
            except ApiException as exc:
                if exc.status != 409:  # (409: another replica made it first: read it)
                    raise
        raise CertError(f"Secret {namespace}/{name} kept changing; try again")

    def gpu_mem_quotas(self, namespace: str) -> list[dict]:
        """The namespace's ResourceQuotas that limit requests.aliyun.com/gpu-mem."""
        r = self.core.list_namespaced_resource_quota(namespace, _preload_content=False, _request_timeout=5)
        return [q for q in json.loads(r.data).get("items") or [] if quota.hard(q) is not None]

    def pods(self, namespace: str) -> list[dict]:
        """The namespace's pods that are not finished."""
        r = self.core.list_namespaced_pod(namespace, field_selector="status.phase!=Succeeded,status.phase!=Failed",
                                          _preload_content=False, _request_timeout=10)
        return json.loads(r.data).get("items") or []


LEDGER = quota.Ledger()  # this process's admissions a LIST may not show yet


def check_quota(api, ledger: quota.Ledger, request: dict, pod: dict, dry_run: bool) -> None:
    """Denied when the rewrite of `pod` would pass a GPU-memory quota of its namespace; else the
    pod is counted (reserved) until the API server's LIST shows it."""
    from cgpud.k8s.api import one_line

    ns = request.get("namespace") or "default"
    units = quota.pod_units(pod)
    if units <= 0:
        return
    try:
        quotas = api.gpu_mem_quotas(ns)
        if not quotas:
            return
        with ledger.lock:
            pods = ledger.with_reserved(ns, api.pods(ns))
            why = quota.refusal(quotas, pods, pod, units)
            if why is None and not dry_run:
                ledger.reserve(ns, pod)
    except webhook.Denied:
        raise
    except Exception as exc:  # noqa: BLE001 - the API server's refusal, or no answer: said on the pod
        raise webhook.Denied(f"cannot read namespace {ns}'s {quota.KEY} quota: {one_line(exc)}") from None
    if why is not None:
        raise webhook.Denied(why)


def admit(api, review, ledger: quota.Ledger | None = None) -> dict:
    """One AdmissionReview → its answer (never raises for what the pod or the API server says)."""
    from cgpud.k8s.api import one_line

    try:
        request = webhook.request_of(review)
    except webhook.Denied as exc:
        return webhook.response({}, denied=str(exc))
    obj = request.get("object")
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    who = f"pod {request.get('namespace')}/{meta.get('name') or meta.get('generateName') or '?'}"
    try:
        decision = webhook.decide(request)
        if decision.templates:  # a rewrite: its gpu-mem leaves the pod, the quota must still count it
            check_quota(api, ledger or LEDGER, request, obj, bool(request.get("dryRun")))
        if not request.get("dryRun"):
            for t in decision.templates:
                where = f"{t['metadata']['namespace']}/{t['metadata']['name']}"
                try:
                    found = api.ensure_template(t)
                except Exception as exc:  # noqa: BLE001 - the API server's refusal, or no answer: said on the pod
                    raise webhook.Denied(f"cannot make ResourceClaimTemplate {where}: {one_line(exc)}") from None
                # (one there already must be the webhook's: a tenant's by hand under its name would be used as
                # it is, asking more than the quota counts; issue 44)
                if found is not None and (why := webhook.not_ours(t, found)) is not None:
                    raise webhook.Denied(f"ResourceClaimTemplate {where} is not the one the webhook makes ({why}): "
                                         "it was made by hand; delete it (the webhook makes it again) or rename it")
    except webhook.Denied as exc:
        log.info("%s: denied: %s", who, exc)
        return webhook.response(request, denied=str(exc))
    if decision.patch:
        log.info("%s: claims from %s%s", who, ", ".join(t["metadata"]["name"] for t in decision.templates),
                 " (dry run)" if request.get("dryRun") else "")
    return webhook.response(request, decision)


class TLSServer(Server):
    """The HTTPS server: accepts on its thread, shakes hands on each connection's own, with the
    deadlines and bounds of the module's docstring. A watchdog thread cuts what overstays."""

    def __init__(self, addr, handler, ctx: ssl.SSLContext, client_names) -> None:
        super().__init__(addr, handler)
        self.ctx = ctx
        self.client_names = None if client_names is None else frozenset(client_names)
        self.lock = threading.Lock()
        # connection key -> [fd, deadline (monotonic), in its handshake]; insertion order is age
        self.live: dict[int, list] = {}
        self.next_key = 0
        self.turns = threading.BoundedSemaphore(MAX_SERVING)
        self.dropped = 0  # connections cut: handshake too slow, request too slow, or pushed out
        self.refused = 0  # connections closed after the handshake: a certificate that is not the API server's
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="cgpu-webhook-watchdog", daemon=True).start()

    @staticmethod
    def _cut(sock) -> None:
        """Shut a live connection down (the syscall only, never its TLS state: its own thread then
        fails out of its read and closes it)."""
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self.lock:
                for key, (sock, deadline, _) in list(self.live.items()):
                    if deadline < now:
                        del self.live[key]
                        self.dropped += 1
                        self._cut(sock)

    def process_request(self, request, client_address):
        """On the accepting thread: count the connection in (dropping the oldest handshake when
        MAX_HANDSHAKING are under way) and hand it to a thread of its own. Nothing here waits."""
        with self.lock:
            handshaking = [k for k, v in self.live.items() if v[2]]
            if len(handshaking) >= MAX_HANDSHAKING:
                self._cut(self.live.pop(handshaking[0])[0])
                self.dropped += 1
            self.next_key += 1
            key = self.next_key
            self.live[key] = [request, time.monotonic() + HANDSHAKE_S, True]
        threading.Thread(target=self._connection, args=(request, client_address, key), daemon=True,
                         name="cgpu-webhook-conn").start()

    def _connection(self, request, client_address, key: int) -> None:
        tls = None
        try:
            request.settimeout(HANDSHAKE_S)
            with self.lock:  # (the socket's live entry follows it into its TLS wrapper: cut either way)
                if key not in self.live:
                    return
                tls = self.ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                self.live[key][0] = tls
            try:
                tls.do_handshake()  # here, on this connection's thread, within HANDSHAKE_S
            except (OSError, ValueError) as exc:
                log.debug("%s: no TLS handshake: %s", client_address[0], exc)
                return
            why = self.caller(tls)
            if why is not None:  # (before a serving slot: only the API server waits for one)
                self.refused += 1
                log.debug("%s: closed after the handshake: %s", client_address[0], why)
                return
            with self.lock:
                if key not in self.live:  # cut meanwhile
                    return
                self.live[key][1:] = [time.monotonic() + REQUEST_S, False]
            if not self.turns.acquire(timeout=REQUEST_S):
                return
            try:
                tls.settimeout(REQUEST_S)
                self.RequestHandlerClass(tls, client_address, self)
            finally:
                self.turns.release()
        except OSError as exc:  # (cut by the watchdog, or the client went away)
            log.debug("%s: %s", client_address[0], exc)
        except Exception:  # noqa: BLE001 - one connection's failure, never the server's
            log.exception("%s: connection failed", client_address[0])
        finally:
            with self.lock:
                self.live.pop(key, None)
            for sock in (tls, request):
                if sock is not None:
                    try:
                        sock.close()
                    except OSError:
                        pass

    def handle_error(self, request, client_address):
        log.debug("%s: connection failed", client_address[0], exc_info=True)

    def server_close(self):
        self._stop.set()
        super().server_close()

    def caller(self, conn) -> str | None:
        """Why this connection may not ask for admissions, or None when it may."""
        if self.client_names is None:
            return None
        cert = conn.getpeercert() if hasattr(conn, "getpeercert") else None
        if not cert:
            return "a client certificate of the API server is required"
        cns = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
        if not any(cn in self.client_names for cn in cns):
            return f"client certificate CN={','.join(cns) or '?'} is not one of {', '.join(sorted(self.client_names))}"
        return None


def make_server(api, host: str, port: int, ctx: ssl.SSLContext, client_names=None,
                ledger: quota.Ledger | None = None) -> TLSServer:
    """The webhook's server on host:port. client_names: the CNs of the client certificates (of the
    context's client CA) that may POST /mutate; None: anyone (only for tests of the decision)."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            log.debug("%s " + fmt, self.address_string(), *a)

        def _send(self, code: int, obj) -> None:
            send_json(self, code, obj)

        def do_POST(self):
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, {"error": "Content-Length is not a number"})
            if n < 0 or n > MAX_BODY:
                return self._send(413, {"error": f"body larger than {MAX_BODY} bytes"})
            body = self.rfile.read(n)  # (read before any answer: a close with unread data resets the answer)
            if self.path.split("?")[0] != PATH:
                return self._send(404, {"error": f"no such path {self.path}"})
            why = self.server.caller(self.connection)
            if why is not None:
                log.warning("%s: POST %s refused: %s", self.client_address[0], PATH, why)
                return self._send(403, {"error": why})
            try:
                review = json.loads(body or b"null")
            except ValueError as exc:
                return self._send(400, {"error": f"the body is not JSON ({exc})"})
            try:
                self._send(200, admit(api, review, ledger))
            except Exception as exc:  # noqa: BLE001 - one request's failure, said, never the server's
                log.exception("admission failed")
                self._send(500, {"error": f"internal error: {exc}"})

        def do_GET(self):
            if self.path == "/healthz":
                return self._send(200, {"ok": True})
            self._send(404, {"error": f"no such path {self.path}"})

    return TLSServer((host, port), Handler, ctx, client_names)


def _made(sans: list[str]) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory(prefix="cgpu-dra-webhook-") as d:
        ca, cert, key = make_certificate(sans, d)
        with open(cert, "rb") as f, open(key, "rb") as g:
            return {"ca.crt": ca, "tls.crt": f.read(), "tls.key": g.read()}


def _context_of(files: dict[str, bytes], client_ca: str | None) -> ssl.SSLContext:
    with tempfile.TemporaryDirectory(prefix="cgpu-dra-webhook-") as d:  # (private: 0700; gone once loaded)
        for name in ("tls.crt", "tls.key"):
            with open(os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(files[name])
        return server_context(os.path.join(d, "tls.crt"), os.path.join(d, "tls.key"), client_ca)


def main(addr: str, cert: str | None, key: str | None, config: str | None, sans: list[str],
         client_ca: str | None = None, client_names: list[str] | None = None, tls_secret: str | None = None,
         health_addr: str | None = None) -> None:
    """Serve until stopped. client_ca: the CA of the API server's client certificate (default: the
    cluster's, SA_CA, in the pod); client_names: the CNs taken (default CLIENT_NAMES); tls_secret:
    NAMESPACE/NAME of the Secret the replicas share their CA and certificate through; health_addr:
    HOST:PORT of the plain-HTTP health port (None: none)."""
    from cgpud.k8s.healthport import HealthPort

    host, _, port = addr.rpartition(":")
    api = Api()
    client_ca = client_ca or SA_CA
    if not os.path.exists(client_ca):
        raise CertError(f"no client CA at {client_ca}: give --client-ca, the CA of the client certificate the API "
                        "server presents to webhooks (docs/kubernetes.md)")
    if cert and key:
        ctx = server_context(cert, key, client_ca)
        ca = None
    elif tls_secret:
        from cgpud.k8s.api import one_line

        ns, _, name = tls_secret.rpartition("/")
        try:
            files = api.tls_secret(ns or "kube-system", name, lambda: _made(sans))
        except CertError:
            raise
        except Exception as exc:  # noqa: BLE001 - the API server's refusal: one line, fatal
            raise CertError(f"cannot read or make Secret {ns or 'kube-system'}/{name}: {one_line(exc)}") from None
        ctx, ca = _context_of(files, client_ca), files["ca.crt"]
    else:
        files = _made(sans)
        ctx, ca = _context_of(files, client_ca), files["ca.crt"]
    server = make_server(api, host or "0.0.0.0", int(port), ctx, client_names or CLIENT_NAMES)
    health = None
    if health_addr:
        h_host, _, h_port = health_addr.rpartition(":")
        try:
            health = HealthPort(h_host or "0.0.0.0", int(h_port))
        except OSError as exc:
            server.server_close()
            raise CertError(f"--health-addr {health_addr}: {exc.strerror or exc}") from None
        log.info("health on http://%s:%d/healthz", *health.server_address[:2])
    if ca is not None and config:
        for attempt in range(10):  # (a conflict: the configuration changed between read and patch)
            try:
                n = api.set_ca_bundle(config, ca)
                log.info("the caBundle of MutatingWebhookConfiguration %s (%d webhooks) is %s CA", config, n,
                         f"Secret {tls_secret}'s" if tls_secret else "this start's")
                break
            except Exception as exc:  # noqa: BLE001 - said, tried again, then fatal
                from cgpud.k8s.api import one_line

                if attempt == 9 or getattr(exc, "status", 409) not in (409, 422, 500, 503):
                    raise CertError(f"cannot set the caBundle of MutatingWebhookConfiguration {config}: "
                                    f"{one_line(exc)}") from None
                time.sleep(0.5)
    log.info("dra-webhook on https://%s:%d%s (certificate for %s; %s from client certificates CN=%s of %s)",
             *server.server_address[:2], PATH, ", ".join(sans) if ca is not None else cert, PATH,
             ",".join(client_names or CLIENT_NAMES), client_ca)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if health is not None:
            health.close()
