"""The metrics door (docs/metrics.md, "Who may read them"): who gets which
series, and a server whose threads and time per connection are bounded.

- `Door`: `none` (the plain host's default) serves every series to clients
  on loopback and the node's and GPUs' series only (no `cgpu_instance_*`:
  no tenant's container ID, memory or GPU time) to anyone else; `open`
  every series to anyone (the host's admin says so: a firewalled port); `kubernetes`
  (the DaemonSet) asks a bearer token of every scrape, checks it with a
  TokenReview and the caller's right to `get` the non-resource URL
  `/metrics` with a SubjectAccessReview, as kube-rbac-proxy does in front of
  node-exporter and kube-state-metrics: 401 without a valid token, 403
  without the right, every series with it. Answers are cached by the
  token's hash (allowed: `ALLOW_TTL`, refused: `DENY_TTL`; at most `CACHE`).
- `BoundedServer`: at most `max_requests` connections are served at once,
  each by a thread of its own, and at most half of them from one address (so
  one pod's silent connections leave Prometheus its turns); one more is
  refused at once (plain HTTP: a 503 line; TLS: closed) and counted; each connection has `deadline` seconds in
  all (TLS handshake, request, answer), after which its socket is shut down
  by the accepting thread. TLS is done in the connection's thread, never in
  the accepting one, so a silent client holds one slot for `deadline`, not
  the door.
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger("cgpud")

AUTH_MODES = ("none", "open", "kubernetes")
MAX_REQUESTS = 8  # connections served at once; Prometheus needs one per scraper
DEADLINE = 10.0  # s a connection may take in all (Prometheus's default scrape_timeout)
ALLOW_TTL, DENY_TTL, CACHE = 60.0, 10.0, 1024
REVIEW_TIMEOUT = 5.0  # s for the API server to answer a review
METRICS_PATH = "/metrics"  # the non-resource URL the SubjectAccessReview asks about
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: 40\r\n\r\ncgpud metrics: too many requests at once\n")


class DoorError(RuntimeError):
    """The door cannot be set up (a certificate, the API server's configuration); str() is one line."""


class Answer:
    """What the door says to one request: `status` ("200 OK", "401 Unauthorized", …), `tenants`
    (whether per-instance series are shown) and a one-line `reason` for a refusal."""

    __slots__ = ("status", "tenants", "reason")

    def __init__(self, status: str, tenants: bool = False, reason: str = "") -> None:
        self.status, self.tenants, self.reason = status, tenants, reason


def loopback(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class Door:
    """Decides, per request, what it may read. `reviewer`: an object with `token_review(token)`
    -> (authenticated, user dict) and `access_review(user, verb, path)` -> (allowed, reason); made
    from the kubeconfig ($KUBECONFIG) or the pod's service account when not given."""

    def __init__(self, auth: str = "none", reviewer=None) -> None:
        if auth not in AUTH_MODES:
            raise DoorError(f"--metrics-auth {auth}: give one of {', '.join(AUTH_MODES)}")
        self.auth = auth
        self.reviewer = reviewer if reviewer is not None or auth != "kubernetes" else KubeReviewer()
        self._cache: dict[bytes, tuple[float, Answer]] = {}
        self._lock = threading.Lock()
        self.reviews = 0  # token reviews asked of the API server (the cache's misses)

    def check(self, environ: dict) -> Answer:
        if self.auth != "kubernetes":  # none: tenants' series to loopback only; open: to anyone
            return Answer("200 OK", tenants=self.auth == "open" or loopback(environ.get("REMOTE_ADDR", "")))
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Answer("401 Unauthorized", reason="a bearer token is needed (Authorization: Bearer …)")
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        answer, ttl = self._review(token)
        if ttl:
            with self._lock:
                if len(self._cache) >= CACHE:
                    self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                    if len(self._cache) >= CACHE:
                        self._cache.clear()
                self._cache[key] = (now + ttl, answer)
        return answer

    def _review(self, token: str) -> tuple[Answer, float]:
        with self._lock:
            self.reviews += 1
        try:
            authenticated, user = self.reviewer.token_review(token)
            if not authenticated:
                return Answer("401 Unauthorized", reason="the token is not valid (TokenReview)"), DENY_TTL
            allowed, why = self.reviewer.access_review(user, "get", METRICS_PATH)
        except Exception as exc:  # noqa: BLE001 - the API server's trouble: refused now, asked again next time
            log.warning("metrics: cannot review a scrape's token: %s", _one_line(exc))
            return Answer("503 Service Unavailable", reason="cannot check the token now"), 0.0
        if not allowed:
            name = user.get("username", "?")
            return Answer("403 Forbidden", reason=f"Forbidden (user={name}, verb=get, nonResourceURL={METRICS_PATH})"
                          + (f": {why}" if why else "")), DENY_TTL
        return Answer("200 OK", tenants=True), ALLOW_TTL


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


class KubeReviewer:
    """TokenReview and SubjectAccessReview through the official client (its configuration from
    $KUBECONFIG, else the pod's service account, whose token it re-reads as it rotates)."""

    def __init__(self) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise DoorError("--metrics-auth kubernetes: the kubernetes client is not installed") from None
        try:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except Exception as first:  # noqa: BLE001 - any kubeconfig trouble: in-cluster next
            try:
                config.load_incluster_config()
            except config.ConfigException:
                raise DoorError(f"--metrics-auth kubernetes: no API server to ask: {_one_line(first)} "
                                "(set KUBECONFIG, or run in a pod)") from None
        api = client.ApiClient()
        api.user_agent = "cgpud-metrics (cgpud)"
        self._client = client
        self.authn, self.authz = client.AuthenticationV1Api(api), client.AuthorizationV1Api(api)

    def token_review(self, token: str) -> tuple[bool, dict]:
        c = self._client
        r = self.authn.create_token_review(c.V1TokenReview(spec=c.V1TokenReviewSpec(token=token)),
                                           _request_timeout=REVIEW_TIMEOUT)
        st = r.status
        if not st or not st.authenticated or not st.user:
            return False, {}
        u = st.user
        return True, {"username": u.username or "", "uid": u.uid, "groups": list(u.groups or []),
                      "extra": dict(u.extra or {})}

    def access_review(self, user: dict, verb: str, path: str) -> tuple[bool, str]:
        c = self._client
        spec = c.V1SubjectAccessReviewSpec(user=user["username"], uid=user.get("uid"), groups=user.get("groups"),
                                           extra=user.get("extra") or None,
                                           non_resource_attributes=c.V1NonResourceAttributes(path=path, verb=verb))
        r = self.authz.create_subject_access_review(c.V1SubjectAccessReview(spec=spec),
                                                    _request_timeout=REVIEW_TIMEOUT)
        return bool(r.status and r.status.allowed), (r.status.reason or "") if r.status else ""


def check_config(auth: str, tls: tuple[str | None, str | None] | None) -> None:
    """What the flags say, checked before the daemon does anything: DoorError (one line) when the
    door could not be set up as asked."""
    Door(auth)  # (kubernetes: the API server's configuration is found)
    cert, key = tls or (None, None)
    if cert or key:
        tls_context(cert, key, auth)
    elif auth == "kubernetes" and shutil.which("openssl") is None:
        raise DoorError("--metrics-auth kubernetes: openssl is not installed to make a certificate: "
                        "give --metrics-tls-cert and --metrics-tls-key")


# ---- TLS ----------------------------------------------------------------------------


def tls_context(cert: str | None, key: str | None, auth: str) -> ssl.SSLContext | None:
    """The serving context: the given certificate, or (kubernetes auth without one) a self-signed
    one made now (openssl; the key never leaves a private directory removed at once), as
    kube-rbac-proxy does; None: plain HTTP."""
    if bool(cert) != bool(key):
        raise DoorError("--metrics-tls-cert and --metrics-tls-key go together")
    if not cert and auth != "kubernetes":
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise DoorError(f"--metrics-tls-cert {cert}: cannot load it with {key}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from None
        return ctx
    with tempfile.TemporaryDirectory(prefix="cgpud-metrics-tls-") as d:
        host = socket.gethostname()
        try:
            p = subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", "tls.key", "-out", "tls.crt", "-days", "3650", "-subj", f"/CN={host}",
                 "-addext", f"subjectAltName=DNS:{host},DNS:localhost,IP:127.0.0.1"],
                cwd=d, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
        except FileNotFoundError:
            raise DoorError("--metrics-auth kubernetes: openssl is not installed to make a certificate: "
                            "give --metrics-tls-cert and --metrics-tls-key") from None
        if p.returncode != 0:
            raise DoorError(f"openssl req: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")
        ctx.load_cert_chain(os.path.join(d, "tls.crt"), os.path.join(d, "tls.key"))
    return ctx


# ---- the server ---------------------------------------------------------------------


class _Handler(WSGIRequestHandler):
    timeout = DEADLINE  # each read and write; the whole connection is bounded by the server

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


class BoundedServer(WSGIServer):
    """A WSGI server whose connections each get a thread, at most `max_requests` at once, each for
    at most `deadline` s; `tls` wraps each connection in its own thread. `served`, `refused`,
    `expired` count connections; `peak` is the most served at once."""

    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr: tuple[str, int], app, *, max_requests: int = MAX_REQUESTS,
                 deadline: float = DEADLINE, tls: ssl.SSLContext | None = None) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, _Handler)
        self.set_app(app)
        self.max_requests, self.deadline, self.tls = max_requests, deadline, tls
        self._slots = threading.BoundedSemaphore(max_requests)
        self._open: dict[int, float] = {}  # connection's descriptor -> when it must be done
        self.per_peer = max(1, max_requests // 2)
        self._peers: dict[str, int] = {}  # address -> its connections served now
        self._lock = threading.Lock()
        self.served = self.refused = self.expired = self.peak = 0
        self.timeout = None  # the accepting thread blocks until a connection comes or one is overdue

    def next_wait(self) -> float | None:
        """How long the accepting thread may block: until the first deadline of the open connections."""
        with self._lock:
            if not self._open:
                return None
            return max(0.0, min(self._open.values()) - time.monotonic()) + 0.01

    def handle_timeout(self) -> None:
        self.reap()

    def reap(self) -> None:
        now = time.monotonic()
        with self._lock:  # (held: a connection's thread forgets it here before it closes the descriptor)
            for fd in [fd for fd, t in self._open.items() if t <= now]:
                del self._open[fd]
                self.expired += 1
                try:  # its thread's read, write or handshake ends; the thread closes it
                    with socket.socket(fileno=os.dup(fd)) as s:
                        s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def process_request(self, request, client_address) -> None:
        self.reap()
        peer = client_address[0] if isinstance(client_address, tuple) else ""
        with self._lock:
            mine = self._peers.get(peer, 0)
            if mine < self.per_peer:
                self._peers[peer] = mine + 1
        if mine >= self.per_peer or not self._slots.acquire(blocking=False):
            if mine < self.per_peer:
                self._forget(peer)
            self.refused += 1
            try:
                request.setblocking(False)
                if self.tls is None:
                    request.send(REFUSAL)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._lock:
            self._open[request.fileno()] = time.monotonic() + self.deadline
            self.served += 1
            self.peak = max(self.peak, len(self._open))
        threading.Thread(target=self._work, args=(request, client_address, peer), name="cgpud-metrics-req",
                         daemon=True).start()

    def _forget(self, peer: str) -> None:
        with self._lock:
            left = self._peers.pop(peer, 1) - 1
            if left > 0:
                self._peers[peer] = left

    def _work(self, request, client_address, peer: str) -> None:
        conn, fd = request, request.fileno()
        try:
            if self.tls is not None:
                request.settimeout(self.deadline)
                conn = self.tls.wrap_socket(request, server_side=True)
            self.finish_request(conn, client_address)
        except Exception:  # noqa: BLE001 - a client that went, a failed handshake, a shut-down socket
            pass
        finally:
            with self._lock:
                self._open.pop(fd, None)
            if conn is not request:  # (TLS: the wrapper holds the descriptor now)
                try:
                    conn.close()
                except OSError:
                    pass
            self.shutdown_request(request)
            self._forget(peer)
            self._slots.release()
