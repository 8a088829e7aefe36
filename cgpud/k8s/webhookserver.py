"""`cgpu dra-webhook`: the mutating admission webhook that serves seed 000's label in DRA mode
(docs/kubernetes.md). The decision is cgpud.k8s.webhook's; here is the I/O around it:

- HTTPS (the API server calls webhooks over TLS only): POST /mutate takes an AdmissionReview
  and answers one; GET /healthz. Python's ssl serves it.
- The certificate: given (--tls-cert/--tls-key, e.g. a Secret made by cert-manager), or made
  at start: a CA and a serving certificate for --tls-san, by the `openssl` CLI (Debian's
  ca-certificates, in the image, depends on it: no Python dependency added), kept in a
  private temporary directory only until loaded; the CA then goes into the caBundle of each
  webhook of the MutatingWebhookConfiguration --webhook-config (RBAC: get and patch that one
  object).
- The templates a decision names are created in the pod's namespace before the pod is
  admitted (AlreadyExists is fine: another pod, or another replica, made it first); not on a
  dry run (sideEffects: NoneOnDryRun). A template the API server refuses denies the pod with
  the API server's reason.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import logging
import os
import ssl
import subprocess
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cgpud.k8s import webhook
from cgpud.k8s.httpjson import Server, send_json

log = logging.getLogger("cgpud.k8s")
MAX_BODY = 8 << 20
PATH = "/mutate"


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


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise CertError(f"cannot load {cert} / {key}: {getattr(exc, 'strerror', None) or exc}") from None
    return ctx


class Api:
    """The API server through the official client: templates made, the webhook's caBundle set."""

    def __init__(self) -> None:
        from kubernetes import client

        from cgpud.k8s.api import connect

        _, api_client = connect("cgpu-dra-webhook")
        self.resource = client.ResourceV1Api(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)

    def ensure_template(self, body: dict) -> None:
        """Create the template; one that is there already is fine. ApiException otherwise."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.resource.create_namespaced_resource_claim_template(body["metadata"]["namespace"], body,
                                                                    _preload_content=False, _request_timeout=5)
            log.info("made ResourceClaimTemplate %s/%s", body["metadata"]["namespace"], body["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 409:
                raise

    def set_ca_bundle(self, name: str, ca: bytes) -> int:
        """Put the CA into every webhook of the MutatingWebhookConfiguration `name`: how many."""
        got = json.loads(self.admission.read_mutating_webhook_configuration(name, _preload_content=False).data)
        bundle = base64.b64encode(ca).decode()
        hooks = got.get("webhooks") or []
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": got["metadata"]["resourceVersion"]}]
        patch += [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
                  for i in range(len(hooks))]
        self.admission.patch_mutating_webhook_configuration(name, patch, _preload_content=False)
        return len(hooks)


def admit(api, review) -> dict:
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
        if not request.get("dryRun"):
            for t in decision.templates:
                try:
                    api.ensure_template(t)
                except Exception as exc:  # noqa: BLE001 - the API server's refusal, or no answer: said on the pod
                    raise webhook.Denied(f"cannot make ResourceClaimTemplate {t['metadata']['namespace']}/"
                                         f"{t['metadata']['name']}: {one_line(exc)}") from None
    except webhook.Denied as exc:
        log.info("%s: denied: %s", who, exc)
        return webhook.response(request, denied=str(exc))
    if decision.patch:
        log.info("%s: claims from %s%s", who, ", ".join(t["metadata"]["name"] for t in decision.templates),
                 " (dry run)" if request.get("dryRun") else "")
    return webhook.response(request, decision)


def make_server(api, host: str, port: int, ctx: ssl.SSLContext) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            log.debug("%s " + fmt, self.address_string(), *a)

        def _send(self, code: int, obj) -> None:
            send_json(self, code, obj)

        def do_POST(self):
            if self.path.split("?")[0] != PATH:
                return self._send(404, {"error": f"no such path {self.path}"})
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                return self._send(413, {"error": f"body larger than {MAX_BODY} bytes"})
            try:
                review = json.loads(self.rfile.read(n) or b"null")
            except ValueError as exc:
                return self._send(400, {"error": f"the body is not JSON ({exc})"})
            try:
                self._send(200, admit(api, review))
            except Exception as exc:  # noqa: BLE001 - one request's failure, said, never the server's
                log.exception("admission failed")
                self._send(500, {"error": f"internal error: {exc}"})

        def do_GET(self):
            if self.path == "/healthz":
                return self._send(200, {"ok": True})
            self._send(404, {"error": f"no such path {self.path}"})

    server = Server((host, port), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    return server


def main(addr: str, cert: str | None, key: str | None, config: str | None, sans: list[str]) -> None:
    host, _, port = addr.rpartition(":")
    api = Api()
    if cert and key:
        ctx = server_context(cert, key)
        ca = None
    else:
        with tempfile.TemporaryDirectory(prefix="cgpu-dra-webhook-") as d:
            ca, cert_path, key_path = make_certificate(sans, d)
            ctx = server_context(cert_path, key_path)
    server = make_server(api, host or "0.0.0.0", int(port), ctx)
    if ca is not None and config:
        for attempt in range(10):  # (a conflict: the configuration changed between read and patch)
            try:
                n = api.set_ca_bundle(config, ca)
                log.info("the caBundle of MutatingWebhookConfiguration %s (%d webhooks) is this start's CA", config, n)
                break
            except Exception as exc:  # noqa: BLE001 - said, tried again, then fatal
                from cgpud.k8s.api import one_line

                if attempt == 9 or getattr(exc, "status", 409) not in (409, 422, 500, 503):
                    raise CertError(f"cannot set the caBundle of MutatingWebhookConfiguration {config}: "
                                    f"{one_line(exc)}") from None
                time.sleep(0.5)
    log.info("dra-webhook on https://%s:%d%s (certificate for %s)", *server.server_address[:2], PATH,
             ", ".join(sans) if ca is not None else cert)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
