"""The API server, through the official kubernetes client: kubeconfig
($KUBECONFIG or ~/.kube/config), else the pod's service account."""
from __future__ import annotations

import os
import threading
import time

# a kubeconfig's token hook (kubernetes.config) runs before every request and sets the client's host
# again, which reads every proxy variable of the environment (~1 ms a request): asked at most this often
REFRESH_SECONDS = 10.0


class NoCluster(Exception):
    """No API server to ask; str() is one line."""


def connect(agent: str | None = None, connections: int | None = None):
    """(CoreV1Api, ApiClient), or NoCluster. `agent` names the component in its User-Agent (as
    kube-scheduler/… does), so the API server's logs and metrics tell our clients apart.
    `connections`: at most that many connections to the API server, kept, and a request past them
    waits for one (by default the client's pool keeps 5 per CPU and opens more past them, each a new
    TLS connection dropped after its one request). Only for a caller that reads every answer (an
    unread one holds its connection: with a bound, the next request would wait for ever)."""
    from kubernetes import client, config

    try:
        # (KUBECONFIG read now: the client reads it once, when it is first imported)
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    except Exception as first:  # noqa: BLE001 - any kubeconfig trouble: try in-cluster next
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise NoCluster(f"no cluster to ask: {first} (set KUBECONFIG, or run in a pod)") from None
    api_client = client.ApiClient()
    if connections:  # (the pools are made at the first request, with these)
        api_client.rest_client.pool_manager.connection_pool_kw.update(maxsize=connections, block=True)
    cfg = api_client.configuration
    if cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook = Throttled(cfg.refresh_api_key_hook, REFRESH_SECONDS)
    if agent:
        api_client.user_agent = f"{agent} (cgpud)"
    return client.CoreV1Api(api_client), api_client


class Throttled:
    """A token refresh hook run at most once every `seconds` (the first request runs it). A token
    about to expire is refreshed by its hook ahead of its expiry (kubernetes.config's margin is 5
    minutes; a service account's token file is rotated long before), so `seconds` later is still early."""

    def __init__(self, hook, seconds: float) -> None:
        self.hook, self.seconds = hook, seconds
        self.next = 0.0
        self.lock = threading.Lock()

    def __call__(self, configuration) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        with self.lock:
            if now < self.next:
                return
            self.hook(configuration)
            if (again := configuration.refresh_api_key_hook) not in (None, self):
                self.hook = again  # (kubernetes.config's hook sets itself again)
            configuration.refresh_api_key_hook = self
            self.next = now + self.seconds


def done(resp) -> None:
    """An answer read with _preload_content=False whose body is not wanted: read it and give its
    connection back to the client's pool. Left unread, the connection is never reused: the next
    request opens another (a TLS handshake on both sides), and the old one lingers until collected."""
    resp.drain_conn()
    resp.release_conn()


def refusal(exc) -> str:
    """One line for the API server's refusal (an ApiException): status, reason, and its message."""
    import json

    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError, TypeError):
        message = ""
    return f"the API server refused: {exc.status} {exc.reason}" + (f": {message}" if message else "")


def one_line(exc: BaseException) -> str:
    """What went wrong talking to the API server, in one line."""
    if hasattr(exc, "status") and hasattr(exc, "reason") and hasattr(exc, "body"):
        return refusal(exc)
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
