"""A Kubernetes API server stand-in for the tests (no kube-apiserver runs
offline), small enough to read: nodes and pods kept as the API's JSON, the
few calls cgpud's Kubernetes parts make, answered as the real server does
for them. The official `kubernetes` client and the real `kubectl` talk to it
over HTTP on 127.0.0.1 through a kubeconfig it writes.

    GET   /api/v1/nodes[/NAME]                      list / get
    PATCH /api/v1/nodes/NAME[/status]                merge patch (metadata, status)
    GET   /api/v1/pods, /api/v1/namespaces/NS/pods   list, fieldSelector spec.nodeName=, status.phase=
    GET   /api/v1/namespaces/NS/pods/NAME            get
    PATCH /api/v1/namespaces/NS/pods/NAME            merge patch
    POST  /api/v1/namespaces/NS/bindings             bind: spec.nodeName (or pods/NAME/binding)
    POST  /api/v1/namespaces/NS/events               accepted

`failing = True` makes every call a 503, as an API server that is down
behind its load balancer answers.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse


def merge(into: dict, patch: dict) -> dict:
    """JSON merge patch (RFC 7386), which is also what a strategic merge does for these fields."""
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


class ApiServer:
    def __init__(self, tmp: Path) -> None:
        self.nodes: dict[str, dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.bindings: list[tuple[str, str, str]] = []
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.version = 1
        self.failing = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def do_GET(self):
                with outer.lock:
                    self._send(*outer.down() or outer.get(urlparse(self.path)))

            def do_PATCH(self):
                with outer.lock:
                    self._send(*outer.down() or outer.patch(urlparse(self.path).path, self._body()))

            def do_POST(self):
                with outer.lock:
                    self._send(*outer.down() or outer.post(urlparse(self.path).path, self._body()))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
            "users": [{"name": "standin", "user": {}}]}))

    # ---- objects ----------------------------------------------------------------

    def add_node(self, name: str, *, gpus: int = 0, units: int = 0, per_device: str | None = None,
                 labels: dict | None = None, ip: str = "192.168.0.1") -> dict:
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels or {}, "annotations": {}},
                "status": {"capacity": {}, "allocatable": {}, "addresses": [{"type": "InternalIP", "address": ip}]}}
        if gpus:
            node["status"]["capacity"].update({"aliyun.com/gpu-count": str(gpus), "aliyun.com/gpu-mem": str(units)})
            node["status"]["allocatable"] = dict(node["status"]["capacity"])
        if per_device:
            node["metadata"]["annotations"]["cgpu.aliyun.com/gpu-mem-per-device"] = per_device
        self.nodes[name] = node
        return node

    def add_pod(self, name: str, units: list[int], *, ns: str = "default", node: str | None = None,
                annotations: dict | None = None, phase: str = "Pending") -> dict:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}",
                            "annotations": dict(annotations or {}), "creationTimestamp": "2026-11-24T00:00:00Z"},
               "spec": {"nodeName": node, "containers": [
                   {"name": f"c{k}", "image": "x", "resources": {"limits": {"aliyun.com/gpu-mem": str(u)}}}
                   for k, u in enumerate(units)]},
               "status": {"phase": phase}}
        self.pods[(ns, name)] = pod
        return pod

    # ---- the API ------------------------------------------------------------------

    def _list(self, kind: str, items: list[dict]) -> tuple[int, dict]:
        self.version += 1
        return 200, {"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": str(self.version)},
                     "items": items}

    def down(self) -> tuple[int, dict] | None:
        if not self.failing:
            return None
        return 503, {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "ServiceUnavailable",
                     "message": "the stand-in is down", "code": 503}

    @staticmethod
    def _missing(what: str) -> tuple[int, dict]:
        return 404, {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "NotFound",
                     "message": f"{what} not found", "code": 404}

    def _select(self, query: dict) -> list[dict]:
        pods = list(self.pods.values())
        for term in ",".join(query.get("fieldSelector", [])).split(","):
            if not term:
                continue
            field, _, value = term.partition("=")
            value = value.lstrip("=")
            if field == "spec.nodeName":
                pods = [p for p in pods if (p["spec"].get("nodeName") or "") == value]
            elif field == "status.phase":
                pods = [p for p in pods if p["status"].get("phase") == value]
        return pods

    def get(self, url) -> tuple[int, dict]:
        path, query = url.path, parse_qs(url.query)
        if path == "/api/v1/nodes":
            return self._list("NodeList", list(self.nodes.values()))
        if m := re.fullmatch(r"/api/v1/nodes/([^/]+)", path):
            return (200, self.nodes[m[1]]) if m[1] in self.nodes else self._missing(f'nodes "{m[1]}"')
        if path == "/api/v1/pods":
            return self._list("PodList", self._select(query))
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path):
            return self._list("PodList", [p for p in self._select(query) if p["metadata"]["namespace"] == m[1]])
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path):
            pod = self.pods.get((m[1], m[2]))
            return (200, pod) if pod else self._missing(f'pods "{m[2]}"')
        return self._missing(path)

    def patch(self, path: str, body: dict) -> tuple[int, dict]:
        if m := re.fullmatch(r"/api/v1/nodes/([^/]+)(/status)?", path):
            if m[1] not in self.nodes:
                return self._missing(f'nodes "{m[1]}"')
            return 200, merge(self.nodes[m[1]], body)
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path):
            pod = self.pods.get((m[1], m[2]))
            return (200, merge(pod, body)) if pod else self._missing(f'pods "{m[2]}"')
        return self._missing(path)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/binding", path)
        if m is None and (b := re.fullmatch(r"/api/v1/namespaces/([^/]+)/bindings", path)):
            m = (path, b[1], (body.get("metadata") or {}).get("name", ""))  # the same, named in the body
        if m:
            pod = self.pods.get((m[1], m[2]))
            if pod is None:
                return self._missing(f'pods "{m[2]}"')
            node = body.get("target", {}).get("name")
            if pod["spec"].get("nodeName"):
                return 409, {"kind": "Status", "status": "Failure", "reason": "Conflict", "code": 409,
                             "message": f"pod {m[2]} is already assigned to node {pod['spec']['nodeName']}"}
            pod["spec"]["nodeName"] = node
            self.bindings.append((m[1], m[2], node))
            return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}
        if re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path):
            self.events.append(body)
            return 201, body
        return self._missing(path)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
