"""The API server, through the official kubernetes client: kubeconfig
($KUBECONFIG or ~/.kube/config), else the pod's service account."""
from __future__ import annotations

import os


class NoCluster(Exception):
    """No API server to ask; str() is one line."""


def connect(agent: str | None = None):
    """(CoreV1Api, ApiClient), or NoCluster. `agent` names the component in its User-Agent (as
    kube-scheduler/… does), so the API server's logs and metrics tell our clients apart."""
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
    if agent:
        api_client.user_agent = f"{agent} (cgpud)"
    return client.CoreV1Api(api_client), api_client


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
