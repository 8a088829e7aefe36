"""A Kubernetes API server stand-in for the tests and bench/k8s.py (no
kube-apiserver runs offline), written from the API conventions
(https://kubernetes.io/docs/reference/using-api/api-concepts/) and as strict
as they are for what cgpud's Kubernetes parts do. The official `kubernetes`
client and the real `kubectl` talk to it over HTTP/1.1 on 127.0.0.1 through a
kubeconfig it writes.

    GET    /version                                      the server's version (`version`: v1.37.2)
    GET    /apis/resource.k8s.io/v1                      the group's discovery (404 when `serves_dra` is False)
    GET    /api/v1/nodes[/NAME]                          list, watch / get
    PATCH  /api/v1/nodes/NAME[/status]                   strategic / JSON merge patch
    PUT    /api/v1/nodes/NAME                            update
    GET    /api/v1/pods, /api/v1/namespaces/NS/pods      list, watch
    GET    /api/v1/namespaces/NS/pods/NAME               get
    PATCH  /api/v1/namespaces/NS/pods/NAME[/status]      patch
    POST   /api/v1/namespaces/NS/bindings                bind (or pods/NAME/binding)
    POST   /api/v1/namespaces/NS/events                  create
    GET    /apis/resource.k8s.io/v1/resourceslices[/NAME]     list, watch / get (the DRA plugin's slices)
    POST   /apis/resource.k8s.io/v1/resourceslices           create (409 when the name is taken; with
                                                             dryRun=All what it would store, nothing stored)
    PUT    /apis/resource.k8s.io/v1/resourceslices/NAME      update (409 on a stale resourceVersion)
    DELETE /apis/resource.k8s.io/v1/resourceslices/NAME      delete
    GET    /apis/resource.k8s.io/v1/[namespaces/NS/]resourceclaims[/NAME]   list / get
    POST   /apis/authentication.k8s.io/v1/tokenreviews        a token's user (`tokens`)
    POST   /apis/authorization.k8s.io/v1/subjectaccessreviews  whether a user may (`grants`: non-resource URLs)

What it holds to, as the real one does:
- one resourceVersion counter for everything (etcd's revision); each write
  bumps it and stamps the object; a no-op patch writes nothing;
- a write carrying metadata.resourceVersion that is not the object's is
  409 Conflict; a Binding is 409 when the pod is bound already or its
  metadata.uid / resourceVersion preconditions fail; the Binding's
  annotations are put on the pod with spec.nodeName in one write;
- the main endpoint does not change status and /status does not change spec;
- LIST answers with the list's resourceVersion (resourceVersion=0: the
  current state, as from the watch cache; `limit` is ignored, as the
  conventions let a server do);
- WATCH (?watch=true) streams chunked JSON lines {"type", "object"}: from
  resourceVersion R every change after R; without R (or 0) the current
  objects as ADDED first; R older than the history kept (`history` changes
  per resource, or `compact()`) is an ERROR event with a 410 Expired
  Status; allowWatchBookmarks=true brings BOOKMARK events (the object has
  only kind, apiVersion and metadata.resourceVersion) every
  `bookmark_every` seconds and before the server ends the watch at
  timeoutSeconds;
- fieldSelector metadata.name, metadata.namespace, spec.nodeName and
  status.phase (ResourceSlices: metadata.name, spec.nodeName) (=, ==, !=; another field is 400), on LIST and WATCH: an
  object that starts to match is ADDED, one that stops matching DELETED;
- `requests` counts each request by (verb, resource): list, watch, get,
  patch, update, create; `by_agent` also by the client's User-Agent.
  Not served (400, never a wrong answer): labelSelector.

Objects are kept as their JSON bytes (40,000 pods fit in little memory and
a LIST is a join); `pods[(ns, name)]` and `nodes[name]` give a fresh dict
(a copy: change objects through the API or the methods below, which make
the watch events). `failing = True` makes every request a 503 and ends the
watches, as an API server that is down behind its load balancer does;
`list_delay` makes each LIST take that long (`lists_in_flight[resource]`
says how many are being answered). `hang` holds (namespace, name) of claims
whose GET is not answered until `release` is set (an API server that hangs on
one request; `hanging` counts them). `store_slice(body)`, when set, changes each ResourceSlice as it
is stored (a server that drops the fields of a feature gate it has off, or
writes a quantity its own way), a dry-run create's answer too; `serves_dra = False` is a server that
does not serve resource.k8s.io/v1 (Kubernetes 1.33 and older).
"""
from __future__ import annotations

import bisect
import collections
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

SELECTABLE = {"pods": ("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"),
              "nodes": ("metadata.name",),
              "resourceslices": ("metadata.name", "metadata.namespace", "spec.nodeName")}
MERGE_TYPES = ("application/strategic-merge-patch+json", "application/merge-patch+json")


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


def status(code: int, reason: str, message: str) -> tuple[int, dict]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                  "reason": reason, "code": code}


class Problem(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.answer = status(code, reason, message)


def fields_of(resource: str, obj: dict) -> tuple:
    meta, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    if resource == "pods":
        return meta.get("name"), meta.get("namespace"), spec.get("nodeName") or "", st.get("phase") or ""
    if resource == "resourceslices":
        return meta.get("name"), "", spec.get("nodeName") or ""
    return (meta.get("name"),)


def parse_selector(resource: str, query: dict) -> list[tuple[int, bool, str]]:
    """fieldSelector as (index into fields_of, equal?, value); Problem 400 for a field not supported
    (and for a labelSelector, which this stand-in does not serve: loud, never a wrong answer)."""
    if query.get("labelSelector"):
        raise Problem(400, "BadRequest", "the stand-in does not serve labelSelector")
    out = []
    for term in ",".join(query.get("fieldSelector", [])).split(","):
        if not term.strip():
            continue
        m = re.fullmatch(r"\s*([\w.]+)\s*(==|!=|=)\s*(.*?)\s*", term)
        if m is None or m[1] not in SELECTABLE[resource]:
            raise Problem(400, "BadRequest", f'field label not supported: {m[1] if m else term}')
        out.append((SELECTABLE[resource].index(m[1]), m[2] != "!=", m[3]))
    return out


def matches(selector, fields) -> bool:
    return fields is not None and all((fields[i] == v) == eq for i, eq, v in selector)


class Resource:
    """One kind of object: the objects (JSON bytes and their selectable fields) and the history
    of changes that watches are served from."""

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self.objs: dict = {}  # key -> [bytes, fields]
        self.rvs: list[int] = []  # the history: resourceVersions ...
        self.log: list[tuple] = []  # ... and (type, new bytes, new fields, old bytes, old fields)
        self.compacted = 0  # changes at or before this resourceVersion are no longer kept
        self.watchers: list[collections.deque] = []  # each open watch's queue of changes


REVIEWS = ("/apis/authentication.k8s.io/v1/tokenreviews", "/apis/authorization.k8s.io/v1/subjectaccessreviews")


def quantity(q: str) -> int:
    """A resource.Quantity string as the stand-in's slices hold them (plain bytes, or Ki/Mi/Gi/Ti)."""
    for suffix, mult in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40)):
        if q.endswith(suffix):
            return int(q[:-2]) * mult
    return int(q)


def check_slice(body: dict) -> None:
    """What kube-apiserver's validation refuses of a slice's capacities with a request policy (422):
    pkg/apis/resource/validation/validation.go, validateRequestPolicyRange (1.34-1.37): min not above
    the capacity's value, and min plus one step not above it either ("one step ... is larger than
    capacity value"), the default not below min."""
    for i, dev in enumerate(((body.get("spec") or {}).get("devices")) or []):
        for name, cap in (dev.get("capacity") or {}).items():
            rng = (cap.get("requestPolicy") or {}).get("validRange")
            if not rng or "min" not in rng:
                continue
            value, low = quantity(cap["value"]), quantity(rng["min"])
            where = f"spec.devices[{i}].capacity[{name}].requestPolicy.validRange"
            if low > value:
                raise Problem(422, "Invalid", f"{where}.min: Invalid value: \"{rng['min']}\": min is larger than "
                                              f"capacity value: {cap['value']}")
            if "step" in rng and low + quantity(rng["step"]) > value:
                raise Problem(422, "Invalid", f"{where}.step: Invalid value: \"{rng['step']}\": one step "
                                              f"{low + quantity(rng['step'])} is larger than capacity value: {cap['value']}")


class ApiServer:
    WATCH_BUFFER = 100_000  # changes a watch may fall behind by before the server ends it
    def __init__(self, tmp: Path, *, history: int = 10000, bookmark_every: float = 1.0) -> None:
        self.res = {"nodes": Resource("nodes", "Node"), "pods": Resource("pods", "Pod"),
                    "resourceslices": Resource("resourceslices", "ResourceSlice"),
                    "resourceclaims": Resource("resourceclaims", "ResourceClaim")}
        self.nodes, self.pods = View(self, "nodes"), View(self, "pods")
        self.slices, self.claims = View(self, "resourceslices"), View(self, "resourceclaims")
        self.bindings: list[tuple[str, str, str]] = []
        self.events: list[dict] = []
        self.requests: collections.Counter = collections.Counter()  # (verb, resource) -> requests
        self.by_agent: collections.Counter = collections.Counter()  # (User-Agent's first word, verb, resource)
        self.lock = threading.Condition()
        self.rv = 1
        self.history, self.bookmark_every = history, bookmark_every
        self._failing = False
        self.closed = False
        self.outages = 0
        self.list_delay = 0.0  # s a LIST takes before it is answered
        self.lists_in_flight: collections.Counter = collections.Counter()  # resource -> LISTs being answered
        self.uid_seq = 0
        self.uids_given: set[str] = set()
        self.hang: set[tuple[str, str]] = set()
        self.release = threading.Event()
        self.hanging = 0  # requests held by `hang` so far
        self.store_slice = None
        # TokenReview: token -> user info ({"username", "uid", "groups"}); SubjectAccessReview of a
        # non-resource URL: (subject "user:NAME" or "group:NAME", verb, path; a path ending in `*` is
        # a prefix, as RBAC's nonResourceURLs) granted
        self.tokens: dict[str, dict] = {}
        self.grants: set[tuple[str, str, str]] = set()
        self.version = "v1.37.2"
        self.serves_dra = True
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def setup(self):
                super().setup()  # small writes go at once (Go's net/http sets TCP_NODELAY too)
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def handle(self):
                try:
                    super().handle()
                except (ConnectionResetError, BrokenPipeError):  # (the client went: as any server)
                    pass

            def _send(self, code: int, obj) -> None:
                body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    return json.loads(raw or b"{}")
                except ValueError as exc:
                    raise Problem(400, "BadRequest", f"the body is not JSON: {exc}") from None

            def _do(self, method: str) -> None:
                if outer.closed:  # (gone: as a refused connection)
                    self.close_connection = True
                    return
                url = urlparse(self.path)
                query = parse_qs(url.query)
                agent = (self.headers.get("User-Agent") or "").split(" ")[0]
                try:
                    body = self._body() if method != "GET" else None
                    if outer._failing:
                        raise Problem(503, "ServiceUnavailable", "the stand-in is down")
                    if method == "GET" and url.path in ("/version", "/version/"):
                        major, minor = re.match(r"v(\d+)\.(\d+)", outer.version).groups()
                        return self._send(200, {"major": major, "minor": minor, "gitVersion": outer.version})
                    if method == "GET" and url.path.rstrip("/") == "/apis/resource.k8s.io/v1":
                        if not outer.serves_dra:
                            raise Problem(404, "NotFound", "the server could not find the requested resource")
                        return self._send(200, {"kind": "APIResourceList", "groupVersion": "resource.k8s.io/v1",
                                                "resources": [{"name": r, "namespaced": r == "resourceclaims",
                                                               "kind": k} for r, k in
                                                              (("resourceslices", "ResourceSlice"),
                                                               ("resourceclaims", "ResourceClaim"))]})
                    if method == "GET" and query.get("watch", [""])[0] in ("true", "1"):
                        return outer.serve_watch(self, url.path, query, agent)
                    if method == "POST" and url.path in REVIEWS:
                        with outer.lock:
                            return self._send(*outer.review(url.path, body))
                    what, parts = outer.route(url.path)
                    if method == "GET" and what == "object" and parts[0] == "resourceclaims" \
                            and parts[1] in outer.hang:
                        with outer.lock:
                            outer.hanging += 1
                        outer.release.wait()
                    if method == "GET" and outer.list_delay and what == "collection":
                        with outer.lock:
                            outer.lists_in_flight[parts[0]] += 1
                        try:
                            time.sleep(outer.list_delay)  # (a LIST of a big cluster takes its time)
                        finally:
                            with outer.lock:
                                outer.lists_in_flight[parts[0]] -= 1
                    if method == "PATCH" and (self.headers.get("Content-Type") or "").split(";")[0] not in MERGE_TYPES:
                        raise Problem(415, "UnsupportedMediaType",
                                      f"the body of the request was in an unknown format - accepted media types "
                                      f"include: {', '.join(MERGE_TYPES)}")
                    with outer.lock:
                        answer = outer.handle(method, url.path, query, body, agent)
                except Problem as p:
                    answer = p.answer
                self._send(*answer)

            def do_GET(self):
                self._do("GET")

            def do_PATCH(self):
                self._do("PATCH")

            def do_POST(self):
                self._do("POST")

            def do_PUT(self):
                self._do("PUT")

            def do_DELETE(self):
                self._do("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.request_queue_size = 128
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
            "users": [{"name": "standin", "user": {}}]}))

    # ---- the state, as a controller or the test changes it (each change is a watch event) ---------

    @property
    def failing(self) -> bool:
        return self._failing

    @failing.setter
    def failing(self, value: bool) -> None:
        with self.lock:
            self._failing = value
            self.outages += value  # (every watch open now ends, however short the outage)
            self.lock.notify_all()

    def add_node(self, name: str, *, gpus: int = 0, units: int = 0, per_device: str | None = None,
                 labels: dict | None = None, ip: str = "192.168.0.1") -> dict:
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels or {}, "annotations": {}},
                "spec": {}, "status": {"capacity": {}, "allocatable": {},
                                       "addresses": [{"type": "InternalIP", "address": ip}]}}
        if gpus:
            node["status"]["capacity"].update({"aliyun.com/gpu-count": str(gpus), "aliyun.com/gpu-mem": str(units)})
            node["status"]["allocatable"] = dict(node["status"]["capacity"])
        if per_device:
            node["metadata"]["annotations"]["cgpu.aliyun.com/gpu-mem-per-device"] = per_device
        with self.lock:
            return self.create("nodes", name, node)

    def add_pod(self, name: str, units: list[int], *, ns: str = "default", node: str | None = None,
                annotations: dict | None = None, phase: str = "Pending", count: int = 0,
                labels: dict | None = None) -> dict:
        limits = [{"aliyun.com/gpu-mem": str(u)} for u in units]
        if count:
            limits[0]["aliyun.com/gpu-count"] = str(count)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "annotations": dict(annotations or {}),
                            "labels": dict(labels or {})},
               "spec": {"containers": [{"name": f"c{k}", "image": "x", "resources": {"limits": lim}}
                                       for k, lim in enumerate(limits)]},
               "status": {"phase": phase}}
        if node:
            pod["spec"]["nodeName"] = node
        with self.lock:
            return self.create("pods", (ns, name), pod)

    def edit_node(self, name: str, change) -> dict:
        """`change(node)` edits the node's dict (labels, annotations, status) in one write."""
        return self._edit("nodes", name, change)

    def edit_pod(self, ns: str, name: str, change) -> dict:
        return self._edit("pods", (ns, name), change)

    def set_phase(self, ns: str, name: str, phase: str) -> dict:
        return self.edit_pod(ns, name, lambda p: p.setdefault("status", {}).update(phase=phase))

    def add_claim(self, ns: str, name: str, results: list[dict], config: list[dict] | None = None) -> dict:
        """A ResourceClaim as kube-scheduler leaves it once allocated: `results` are
        status.allocation.devices.results (driver, pool, device, request, consumedCapacity…)."""
        with self.lock:
            return self.create("resourceclaims", (ns, name), {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"devices": {"requests": [{"name": r} for r in sorted({x["request"] for x in results})]}},
                "status": {"allocation": {"devices": {"results": results, "config": config or []}}}})

    def delete_pod(self, ns: str, name: str) -> None:
        with self.lock:
            self.delete("pods", (ns, name))

    def compact(self) -> None:
        """Forget the history (etcd's compaction): a watch from an older resourceVersion is 410 Gone."""
        with self.lock:
            self.rv += 1
            for r in self.res.values():
                r.rvs, r.log, r.compacted = [], [], self.rv

    def count(self, verb: str, resource: str, agent: str | None = None) -> int:
        """Requests so far of a verb on a resource (by one client, named by its User-Agent's first word)."""
        return self.requests[(verb, resource)] if agent is None else self.by_agent[(agent, verb, resource)]

    def _count(self, agent: str, verb: str, resource: str) -> None:
        self.requests[(verb, resource)] += 1
        self.by_agent[(agent, verb, resource)] += 1

    def _edit(self, resource: str, key, change) -> dict:
        with self.lock:
            obj = self.read(resource, key)
            change(obj)
            return self.write(resource, key, obj)

    # ---- storage (all under self.lock) ----------------------------------------------------------

    def read(self, resource: str, key) -> dict:
        r = self.res[resource]
        if key not in r.objs:
            name = key[1] if isinstance(key, tuple) else key
            raise Problem(404, "NotFound", f'{resource} "{name}" not found')
        return json.loads(r.objs[key][0])

    def _record(self, r: Resource, kind: str, new: bytes | None, new_fields, old: bytes | None, old_fields) -> None:
        r.rvs.append(self.rv)
        r.log.append((kind, new, new_fields, old, old_fields))
        for queue in r.watchers:
            queue.append((self.rv, r.log[-1]))
        if len(r.log) > 2 * self.history:  # keep the last `history` changes
            drop = len(r.log) - self.history
            r.compacted = r.rvs[drop - 1]
            del r.rvs[:drop], r.log[:drop]
        self.lock.notify_all()

    def create(self, resource: str, key, obj: dict) -> dict:
        r = self.res[resource]
        if key in r.objs:
            raise Problem(409, "AlreadyExists", f'{resource} "{obj["metadata"]["name"]}" already exists')
        self.rv += 1
        self.uid_seq += 1
        meta = obj["metadata"]
        uid = f"uid-{meta['namespace']}-{meta['name']}" if "namespace" in meta else f"uid-{meta['name']}"
        meta.setdefault("uid", uid if uid not in self.uids_given else f"{uid}-{self.uid_seq}")  # (recreated)
        self.uids_given.add(meta["uid"])
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        data, fields = json.dumps(obj, separators=(",", ":")).encode(), fields_of(resource, obj)
        r.objs[key] = [data, fields]
        self._record(r, "ADDED", data, fields, None, None)
        return obj

    def write(self, resource: str, key, obj: dict, precondition: str | None = None) -> dict:
        """Store a changed object: 409 when `precondition` (a resourceVersion) is not the object's;
        nothing written (and no event) when nothing changed."""
        r = self.res[resource]
        old, old_fields = r.objs[key]
        current = json.loads(old)
        rv = current["metadata"]["resourceVersion"]
        if precondition is not None and precondition != rv:
            name = obj["metadata"].get("name")
            raise Problem(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": the object has been '
                                           "modified; please apply your changes to the latest version and try again")
        obj["metadata"]["resourceVersion"] = rv
        for fixed in ("uid", "name", "namespace", "creationTimestamp"):
            if fixed in current["metadata"]:
                obj["metadata"][fixed] = current["metadata"][fixed]
        if obj == current:
            return current
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        data, fields = json.dumps(obj, separators=(",", ":")).encode(), fields_of(resource, obj)
        r.objs[key] = [data, fields]
        self._record(r, "MODIFIED", data, fields, old, old_fields)
        return obj

    def delete(self, resource: str, key) -> None:
        r = self.res[resource]
        obj = self.read(resource, key)
        old, old_fields = r.objs.pop(key)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record(r, "DELETED", json.dumps(obj).encode(), None, old, old_fields)

    # ---- the API ----------------------------------------------------------------------------------

    ROUTES = [
        (re.compile(r"/api/v1/(nodes)"), "collection"),
        (re.compile(r"/api/v1/(pods)"), "collection"),
        (re.compile(r"/api/v1/namespaces/([^/]+)/(pods)"), "collection"),
        (re.compile(r"/api/v1/(nodes)/([^/]+)(/status)?"), "object"),
        (re.compile(r"/api/v1/namespaces/([^/]+)/(pods)/([^/]+)(/status|/binding)?"), "object"),
        (re.compile(r"/api/v1/namespaces/([^/]+)/(bindings|events)"), "create"),
        (re.compile(r"/apis/resource\.k8s\.io/v1/(resourceslices|resourceclaims)"), "collection"),
        (re.compile(r"/apis/resource\.k8s\.io/v1/(resourceslices)/([^/]+)()"), "object"),
        (re.compile(r"/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/(resourceclaims)/([^/]+)(/status)?"), "object"),
    ]

    def route(self, path: str):
        for pattern, what in self.ROUTES:
            if m := pattern.fullmatch(path):
                g = m.groups()
                if what == "collection":
                    return what, (g[1], g[0]) if len(g) == 2 else (g[0], None)
                if what == "object":
                    if g[0] in ("nodes", "resourceslices"):  # (cluster-scoped)
                        return what, (g[0], g[1], g[1], (g[2] or "")[1:])
                    return what, (g[1], (g[0], g[2]), g[2], (g[3] or "")[1:])
                return what, (g[1], g[0])
        raise Problem(404, "NotFound", f"the server could not find the requested resource ({path})")

    def review(self, path: str, body) -> tuple[int, dict]:
        """TokenReview and SubjectAccessReview, as
        https://kubernetes.io/docs/reference/kubernetes-api/authentication-resources/token-review-v1/ and
        .../authorization-resources/subject-access-review-v1/ say: the object comes back with `status`
        (TokenReview: authenticated and user, or an error; SubjectAccessReview: allowed, and a reason)."""
        kind = "tokenreviews" if path.endswith("tokenreviews") else "subjectaccessreviews"
        self.requests["create", kind] += 1
        spec = (body or {}).get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, dict):
            raise Problem(400, "BadRequest", f"a {kind[:-1]} needs a spec")
        out = dict(body)
        if kind == "tokenreviews":
            user = self.tokens.get(spec.get("token") or "")
            out["status"] = {"authenticated": True, "user": dict(user)} if user else {
                "user": {}, "error": "[invalid bearer token, service account token has been invalidated]"}
            return 201, out
        attrs = spec.get("nonResourceAttributes") or {}
        if not spec.get("user") and not spec.get("groups"):
            raise Problem(400, "BadRequest", "at least one of user or group must be specified")
        subjects = {f"user:{spec.get('user')}"} | {f"group:{g}" for g in spec.get("groups") or []}
        path_asked, verb = attrs.get("path", ""), attrs.get("verb", "")
        allowed = bool(attrs) and any(
            who in subjects and v in (verb, "*") and (p == path_asked or (p.endswith("*") and path_asked.startswith(p[:-1])))
            for who, v, p in self.grants)
        out["status"] = {"allowed": allowed, "reason": "RBAC: allowed by the stand-in's grants" if allowed else ""}
        return 201, out

    def handle(self, method: str, path: str, query: dict, body, agent: str = "") -> tuple[int, dict | bytes]:
        what, parts = self.route(path)
        if what == "collection" and method == "POST" and parts[0] == "resourceslices":
            if not isinstance(body, dict) or not (body.get("metadata") or {}).get("name"):
                raise Problem(400, "BadRequest", "a ResourceSlice needs metadata.name (generateName is not served)")
            check_slice(body)
            if query.get("dryRun") == ["All"]:  # (validated and answered, never stored; counted apart)
                self._count(agent, "create-dry-run", "resourceslices")
                body = json.loads(json.dumps(body))
                if self.store_slice is not None:
                    self.store_slice(body)
                return 201, body
            self._count(agent, "create", "resourceslices")
            if self.store_slice is not None:
                self.store_slice(body)
            return 201, self.create("resourceslices", body["metadata"]["name"], body)
        if what == "collection" and method == "GET":
            resource, ns = parts
            self._count(agent, "list", resource)
            return 200, self.list_bytes(resource, ns, parse_selector(resource, query))
        if what == "object":
            resource, key, name, sub = parts
            if sub == "binding" and method == "POST":
                self._count(agent, "create", "pods/binding")
                return self.bind(key[0], name, body)
            verb = {"GET": "get", "PATCH": "patch", "PUT": "update",
                    "DELETE": "delete" if resource == "resourceslices" else None}.get(method)
            if verb is None:
                raise Problem(405, "MethodNotAllowed", f"{method} is not allowed on {path}")
            self._count(agent, verb, resource + ("/" + sub if sub else ""))
            obj = self.read(resource, key)
            if verb == "get":
                return 200, obj
            if verb == "delete":
                self.delete(resource, key)
                return 200, obj
            if resource == "resourceslices" and isinstance(body, dict) and verb == "update":
                check_slice(body)
            if resource == "resourceslices" and self.store_slice is not None and isinstance(body, dict):
                self.store_slice(body)
            if not isinstance(body, dict):
                raise Problem(400, "BadRequest", "the patch is not a JSON object")
            precondition = (body.get("metadata") or {}).get("resourceVersion")
            new = merge(json.loads(json.dumps(obj)), body) if verb == "patch" else body
            if not isinstance(new.get("metadata"), dict) or new["metadata"].get("name") != name:
                raise Problem(400, "BadRequest", "metadata.name does not match the object's name")
            # the main endpoint keeps the status as it was; /status keeps the spec
            keep = "spec" if sub == "status" else "status"
            if keep in obj:
                new[keep] = obj[keep]
            else:
                new.pop(keep, None)
            if verb == "update" and not precondition:
                precondition = None
            return 200, self.write(resource, key, new, precondition)
        if what == "create" and method == "POST":
            kind, ns = parts
            self._count(agent, "create", kind)
            if kind == "bindings":
                return self.bind(ns, ((body or {}).get("metadata") or {}).get("name", ""), body)
            self.events.append(body)
            return 201, body
        raise Problem(405, "MethodNotAllowed", f"{method} is not allowed on {path}")

    def bind(self, ns: str, name: str, body: dict) -> tuple[int, dict]:
        target = (body or {}).get("target") or {}
        if not target.get("name") or target.get("kind", "Node") not in ("Node", ""):
            raise Problem(400, "BadRequest", "a Binding needs a target Node's name")
        pod = self.read("pods", (ns, name))
        meta = (body.get("metadata") or {})
        if meta.get("uid") and meta["uid"] != pod["metadata"]["uid"]:
            raise Problem(409, "Conflict", f'Operation cannot be fulfilled on pods "{name}": Precondition failed: '
                                           f'UID in precondition: {meta["uid"]}, UID in object meta: '
                                           f'{pod["metadata"]["uid"]}')
        if pod["spec"].get("nodeName"):
            raise Problem(409, "Conflict", f"pod {name} is already assigned to node {pod['spec']['nodeName']}")
        pod["spec"]["nodeName"] = target["name"]
        pod["metadata"].setdefault("annotations", {}).update(meta.get("annotations") or {})
        pod.setdefault("status", {}).setdefault("conditions", []).append({"type": "PodScheduled", "status": "True"})
        self.write("pods", (ns, name), pod, meta.get("resourceVersion") or None)
        self.bindings.append((ns, name, target["name"]))
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def list_bytes(self, resource: str, ns: str | None, selector) -> bytes:
        r = self.res[resource]
        items = [data for data, fields in r.objs.values()
                 if matches(selector, fields) and (ns is None or fields[1] == ns)]
        head = json.dumps({"kind": r.kind + "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}})
        return head[:-1].encode() + b',"items":[' + b",".join(items) + b"]}"

    # ---- WATCH ------------------------------------------------------------------------------------

    def serve_watch(self, handler, path: str, query: dict, agent: str = "") -> None:
        what, parts = self.route(path)
        if what != "collection":
            raise Problem(405, "MethodNotAllowed", "watch is served on collections")
        resource, ns = parts
        r = self.res[resource]
        selector = parse_selector(resource, query)
        if ns is not None:
            selector.append((1, True, ns))
        since = query.get("resourceVersion", [""])[0]
        if since not in ("", "0") and not since.isdigit():
            raise Problem(400, "BadRequest", f"resourceVersion {since!r} is not a resourceVersion")
        bookmarks = query.get("allowWatchBookmarks", [""])[0] == "true"
        try:
            ends = time.monotonic() + float(query.get("timeoutSeconds", ["1800"])[0])
        except ValueError:
            raise Problem(400, "BadRequest", "timeoutSeconds is not a number") from None
        with self.lock:
            self._count(agent, "watch", resource)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        handler.close_connection = True

        def send(lines: list[bytes]) -> None:
            if lines:
                data = b"".join(lines)
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                handler.wfile.flush()

        def event(kind: str, data: bytes) -> bytes:
            return b'{"type":"%s","object":%s}\n' % (kind.encode(), data)

        def bookmark(rv: int) -> bytes:
            return event("BOOKMARK", json.dumps({"kind": r.kind, "apiVersion": "v1",
                                                 "metadata": {"resourceVersion": str(rv)}}).encode())

        def lines_of(entries) -> list[bytes]:
            lines = []
            for rv, (kind, data, fields, old, old_fields) in entries:
                was, now_ = matches(selector, old_fields), kind != "DELETED" and matches(selector, fields)
                if now_ and was:
                    lines.append(event(kind, data))
                elif now_:
                    lines.append(event("ADDED", data))
                elif was:  # deleted, or no longer selected: its last state, at this version
                    gone = json.loads(old if kind != "DELETED" else data)
                    gone["metadata"]["resourceVersion"] = str(rv)
                    lines.append(event("DELETED", json.dumps(gone).encode()))
            return lines

        queue: collections.deque = collections.deque()  # what each write hands this watch (the watch cache's)
        try:
            with self.lock:
                if since in ("", "0"):
                    first = [event("ADDED", d) for d, f in r.objs.values() if matches(selector, f)]
                elif int(since) < r.compacted:
                    _, gone = status(410, "Expired", f"too old resource version: {since} ({r.compacted})")
                    first, queue = [event("ERROR", json.dumps(gone).encode())], None
                else:
                    i = bisect.bisect_right(r.rvs, int(since))
                    first = lines_of(zip(r.rvs[i:], r.log[i:]))
                if queue is not None:
                    r.watchers.append(queue)
                outages = self.outages
            send(first)
            next_mark = time.monotonic() + self.bookmark_every
            while queue is not None:
                with self.lock:
                    while True:
                        now = time.monotonic()
                        down = self._failing or self.closed or self.outages != outages
                        if queue or down or now >= ends or (bookmarks and now >= next_mark):
                            break
                        self.lock.wait(min(ends, next_mark if bookmarks else ends) - now)
                    if down or len(queue) > self.WATCH_BUFFER:
                        break  # the connection goes (a watcher that does not keep up is ended, as the real one is)
                    entries = list(queue)
                    queue.clear()
                    done = time.monotonic() >= ends
                    mark = bookmarks and (time.monotonic() >= next_mark or done)
                    at = self.rv
                lines = lines_of(entries)
                if mark:
                    lines.append(bookmark(at))
                    next_mark = time.monotonic() + self.bookmark_every
                send(lines)
                if done:
                    break
            handler.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        finally:
            with self.lock:
                r.watchers = [q for q in r.watchers if q is not queue]

    def close(self) -> None:
        self.release.set()
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()


class View(collections.abc.Mapping):
    """`api.pods[(ns, name)]`, `api.nodes[name]`: a fresh dict of the object as stored (read-only)."""

    def __init__(self, api: ApiServer, resource: str) -> None:
        self.api, self.resource = api, resource

    def __getitem__(self, key) -> dict:
        with self.api.lock:
            try:
                return self.api.read(self.resource, key)
            except Problem:
                raise KeyError(key) from None

    def __iter__(self):
        with self.api.lock:
            return iter(list(self.api.res[self.resource].objs))

    def __len__(self) -> int:
        return len(self.api.res[self.resource].objs)
