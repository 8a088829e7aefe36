"""`cgpu scheduler-extender`: kube-scheduler's extender for
`aliyun.com/gpu-mem`, compatible with gpushare-scheduler-extender
(docs/kubernetes.md): the same paths, the kube-scheduler extender v1 JSON,
and gpushare's pod annotations.

    POST /gpushare-scheduler/filter   ExtenderArgs -> ExtenderFilterResult
    POST /gpushare-scheduler/bind     ExtenderBindingArgs -> ExtenderBindingResult
    GET  /gpushare-scheduler/inspect[/NODE]

A node passes the filter only if one GPU (or, with aliyun.com/gpu-count, M
GPUs) has the pod's units free; bind chooses the GPU(s) by the node's
placement (label ack.node.gpu.placement: binpack, the default, or spread)
and creates the Binding, which puts gpushare's annotations on the pod
(ALIYUN_COM_GPU_MEM_IDX, _DEV, _POD, _ASSIGNED=false, _ASSUME_TIME) in the
same write.

The cluster is kept in memory as informers keep it (cgpud.k8s.informer):
nodes and pods LISTed once, then WATCHed; each event updates per-node
tallies, so filter and bind cost in proportion to the nodes they are asked
about, and no request waits for the API server's LIST.

Binds, also from several replicas, never give the same units twice: each
bind commits its choice on the Node first — a patch of the annotation
ASSUMED (the node's recent choices) carrying the resourceVersion the choice
was made from. A conflict (409: another bind, or anything, changed the
node) makes it read the node again and choose again. Bad input (not JSON,
a pod or node that does not exist) is a clear error and changes nothing.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cgpud.k8s import cluster
from cgpud.k8s.informer import Informer

log = logging.getLogger("cgpud.k8s")
PREFIX = "/gpushare-scheduler"
MAX_BODY = 16 << 20
# ours, on the Node: the choices binds made on it recently, {pod uid: [GPU indices "0,1", units per GPU, unix time]}
ASSUMED = "cgpu.aliyun.com/gpu-mem-assumed"
ASSUMED_SECONDS = 60.0  # a choice stays on the node this long: by then every replica's watch shows its pod
BIND_ATTEMPTS = 10  # conflicts a bind rides out before it answers the scheduler "try again"


class BadRequest(ValueError):
    pass


class Busy(RuntimeError):
    """The node kept changing under a bind: the scheduler should try again (HTTP 503)."""


def _int(raw, default: int = 0) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default


class Pod:
    """What the extender keeps of a pod asking for gpu-mem."""

    __slots__ = ("uid", "node", "gpus", "need", "count", "live", "key")

    def __init__(self, obj: dict) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        self.key = (meta.get("namespace") or "", meta.get("name") or "")
        self.uid = meta.get("uid") or ""
        self.node = spec.get("nodeName") or ""
        self.need = cluster.pod_units(obj)
        try:
            self.count = gpu_count(obj)
        except BadRequest:
            self.count = 1
        gpus = cluster.pod_gpus(obj)
        self.gpus = tuple(gpus) if gpus else ()
        self.live = cluster.holds_gpu(obj)

    @property
    def counted(self) -> bool:
        """On a node's GPUs: bound, live, placed."""
        return bool(self.node and self.live and self.gpus and self.need > 0)


def _gpu_pod(obj: dict) -> Pod | None:
    """What is kept of a LISTed pod: only pods asking gpu-mem count."""
    pod = Pod(obj)
    return pod if pod.need > 0 else None


class Node:
    """What the extender keeps of a node: its GPUs' sizes, placement, address, recent choices,
    and (computed when asked after a change) each GPU's free units."""

    __slots__ = ("name", "units", "strategy", "address", "version", "assumed", "free", "desc", "why", "until")

    def __init__(self, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        self.name = meta.get("name") or ""
        self.version = meta.get("resourceVersion") or ""
        self.units = tuple(cluster.gpu_units(obj))
        self.strategy = strategy_of(obj)
        self.address = cluster.node_address(obj)
        self.assumed = parse_assumed((meta.get("annotations") or {}).get(ASSUMED))
        self.free: list[int] | None = None  # None: compute again
        self.desc: list[int] = []
        self.why = ""
        self.until = 0.0  # free counts recent choices until then


def parse_assumed(raw) -> dict[str, tuple[tuple[int, ...], int, float]]:
    """The node's recent choices (malformed entries left out)."""
    out = {}
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        return out
    for uid, entry in (doc.items() if isinstance(doc, dict) else ()):
        try:
            idx, per, at = entry
            out[str(uid)] = (tuple(int(i) for i in str(idx).split(",")), int(per), float(at))
        except (TypeError, ValueError):
            continue
    return out


def dump_assumed(assumed: dict) -> str:
    return json.dumps({uid: [",".join(map(str, g)), per, round(at, 3)] for uid, (g, per, at) in assumed.items()},
                      separators=(",", ":"))


class State:
    """Nodes and pods, LISTed once and then WATCHed (cgpud.k8s.informer); per node, the pods on
    its GPUs. Filter and inspect read it under `lock`; the watches write it."""

    def __init__(self, api, raw=None) -> None:
        self.api, self.raw = api, raw
        self.lock = threading.Lock()
        self.nodes: dict[str, Node] = {}
        self.pods: dict[tuple[str, str], Pod] = {}  # pods asking gpu-mem, by (namespace, name)
        self.uids: dict[str, tuple[str, str]] = {}
        self.on_node: dict[str, dict[tuple[str, str], Pod]] = {}  # node -> the pods counted on its GPUs
        self.assumed_on: dict[str, str] = {}  # pod uid -> the node whose recent choices name it
        self.node_locks: dict[str, threading.Lock] = {}
        self.informers = {
            "nodes": Informer("nodes", api.list_node, self._replace_nodes, self._node_event),
            "pods": Informer("pods", api.list_pod_for_all_namespaces, self._replace_pods, self._pod_event,
                             convert=_gpu_pod),
        }

    # ---- keeping the view ----------------------------------------------------------------

    def start(self) -> "State":
        """LIST nodes and pods (raises when the API server refuses), then watch them in the background."""
        for inf in self.informers.values():
            inf.sync()
        for inf in self.informers.values():
            inf.start()
        return self

    def stop(self) -> None:
        for inf in self.informers.values():
            inf.stop()

    def _replace_nodes(self, items: list[dict]) -> None:
        nodes = {n.name: n for n in map(Node, items)}
        with self.lock:
            self.nodes = nodes
            self.assumed_on = {uid: n.name for n in nodes.values() for uid in n.assumed}

    def _node_event(self, kind: str, obj: dict) -> None:
        node = Node(obj)
        with self.lock:
            old = self.nodes.pop(node.name, None)
            for uid in (old.assumed if old else ()):
                self.assumed_on.pop(uid, None)
            if kind != "DELETED":
                self.nodes[node.name] = node
                for uid in node.assumed:
                    self.assumed_on[uid] = node.name

    def _replace_pods(self, items: list[Pod]) -> None:
        pods = {pod.key: pod for pod in items}
        on_node: dict[str, dict] = {}
        for pod in pods.values():
            if pod.counted:
                on_node.setdefault(pod.node, {})[pod.key] = pod
        uids = {p.uid: k for k, p in pods.items()}
        with self.lock:
            self.pods, self.on_node, self.uids = pods, on_node, uids
            for node in self.nodes.values():
                node.free = None

    def _pod_event(self, kind: str, obj: dict) -> None:
        pod = Pod(obj)
        with self.lock:
            old = self.pods.pop(pod.key, None)
            if old is not None:
                self.uids.pop(old.uid, None)
                if old.counted:
                    self.on_node.get(old.node, {}).pop(old.key, None)
                    self._changed(old.node)
                self._changed(self.assumed_on.get(old.uid))
            if kind != "DELETED" and pod.need > 0:
                self.pods[pod.key] = pod
                self.uids[pod.uid] = pod.key
                if pod.counted:
                    self.on_node.setdefault(pod.node, {})[pod.key] = pod
                    self._changed(pod.node)
                self._changed(self.assumed_on.get(pod.uid))

    def _changed(self, name: str | None) -> None:
        node = self.nodes.get(name) if name else None
        if node is not None:
            node.free = None

    def _free(self, node: Node, now: float) -> list[int]:
        """Each GPU's free units: its size less its pods' units less the recent choices of binds whose
        pods the watch has not shown on a GPU yet. (Under the lock.)"""
        if node.free is not None and now < node.until:
            return node.free
        used = [0] * len(node.units)
        for pod in self.on_node.get(node.name, {}).values():
            for i in pod.gpus:
                if i < len(used):
                    used[i] += pod.need // len(pod.gpus)
        until = float("inf")
        for uid, (gpus, per, at) in node.assumed.items():
            if now - at > ASSUMED_SECONDS:
                continue
            key = self.uids.get(uid)
            pod = self.pods.get(key) if key else None
            if pod is not None and (pod.counted or not pod.live):
                continue  # its pod counts itself now (or is over)
            until = min(until, at + ASSUMED_SECONDS)
            for i in gpus:
                if i < len(used):
                    used[i] += per
        node.free = [u - x for u, x in zip(node.units, used)]
        node.desc = sorted(node.free, reverse=True)
        node.until, node.why = until, ""
        return node.free

    def fits(self, node: Node, need: int, count: int, now: float) -> bool:
        self._free(node, now)
        return need % count == 0 and len(node.desc) >= count and node.desc[count - 1] >= need // count

    def why_not(self, node: Node, need: int, count: int) -> str:
        if not node.units:
            return f"no {cluster.RESOURCE} on this node"
        if not node.why:
            node.why = ", ".join(f"GPU{i} {f}/{u}" for i, (u, f) in enumerate(zip(node.units, node.free)))
        return f"no {count} GPU(s) with {need // max(count, 1)} free {cluster.RESOURCE} ({node.why})"

    def node_lock(self, name: str) -> threading.Lock:
        with self.lock:
            return self.node_locks.setdefault(name, threading.Lock())


def gpu_count(pod: dict) -> int:
    count = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        try:
            count = max(count, int(((c.get("resources") or {}).get("limits") or {}).get(cluster.COUNT, 0)))
        except (TypeError, ValueError):
            raise BadRequest(f"{cluster.COUNT} is not a whole number") from None
    return count or 1


def strategy_of(node: dict) -> str:
    label = ((node.get("metadata") or {}).get("labels") or {}).get(cluster.PLACEMENT_LABEL, "binpack")
    return label if label in ("binpack", "spread") else "binpack"


def filter_nodes(state: State, args: dict) -> dict:
    pod = args.get("Pod") or args.get("pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs has no Pod")
    need = cluster.pod_units(pod)
    names = args.get("NodeNames") or args.get("nodenames")
    items = ((args.get("Nodes") or args.get("nodes") or {}).get("items")) or []
    if names is None:
        names = [(n.get("metadata") or {}).get("name") for n in items]
    if need <= 0:  # not ours to judge
        return {"Nodes": args.get("Nodes"), "NodeNames": names, "FailedNodes": {}, "Error": ""}
    count = gpu_count(pod)
    ok, failed = [], {}
    now = time.time()
    with state.lock:
        nodes = state.nodes
        for name in names:
            node = nodes.get(name)
            if node is None:
                failed[name] = f"node {name} is not known to the API server"
            elif state.fits(node, need, count, now):
                ok.append(name)
            else:
                failed[name] = state.why_not(node, need, count)
    result = {"NodeNames": ok, "FailedNodes": failed, "Error": ""}
    if args.get("NodeNames") is None:
        keep = set(ok)
        result["Nodes"] = {"items": [n for n in items if (n.get("metadata") or {}).get("name") in keep]}
    return result


def bind(state: State, args: dict) -> dict:
    name, ns, node_name = args.get("PodName"), args.get("PodNamespace"), args.get("Node")
    if not all(isinstance(x, str) and x for x in (name, ns, node_name)):
        raise BadRequest("ExtenderBindingArgs needs PodName, PodNamespace and Node")
    # kube-scheduler binds pods concurrently: binds to one node take turns in this replica (they would
    # only conflict with each other); other replicas' binds are kept apart by the node's resourceVersion.
    with state.node_lock(node_name):
        return _bind(state, name, ns, node_name, args.get("PodUID"))


def _read(state: State, what: str, call, *args) -> dict:
    """GET one object as the API's JSON; 404 is BadRequest."""
    from kubernetes.client.exceptions import ApiException

    try:
        return json.loads(call(*args, _preload_content=False).data)
    except ApiException as exc:
        if exc.status == 404:
            raise BadRequest(f"{what} is not known to the API server") from None
        raise


def _bind(state: State, name: str, ns: str, node_name: str, uid: str | None) -> dict:
    from kubernetes.client import V1Binding, V1ObjectMeta, V1ObjectReference
    from kubernetes.client.exceptions import ApiException

    with state.lock:
        node = state.nodes.get(node_name)
        pod = state.pods.get((ns, name))
    if node is None:  # (newer than our view, or no such node)
        node = Node(_read(state, f"node {node_name}", state.api.read_node, node_name))
    if pod is None:  # a pod asking nothing, or newer than our view
        pod = Pod(_read(state, f"pod {ns}/{name}", state.api.read_namespaced_pod, name, ns))
    if uid and pod.uid not in ("", uid):
        raise BadRequest(f"pod {ns}/{name} is not the pod with UID {uid} any more (it was recreated)")
    annotations, chosen = {}, None
    if pod.need > 0:
        chosen = _commit(state, node, pod)
        annotations = cluster.assume_annotations(list(chosen[0]), pod.need, min(node.units[i] for i in chosen[0]))
    body = V1Binding(metadata=V1ObjectMeta(name=name, namespace=ns, uid=uid or None, annotations=annotations or None),
                     target=V1ObjectReference(kind="Node", name=node_name, api_version="v1"))
    try:
        state.api.create_namespaced_binding(ns, body, _preload_content=False)
    except ApiException:
        if chosen:  # not bound: take the choice back (else it counts until ASSUMED_SECONDS pass)
            _take_back(state, node_name, pod.uid)
        raise
    log.info("bound %s/%s to %s %s", ns, name, node_name, annotations.get(cluster.IDX, ""))
    if annotations:
        event(state.api, {"metadata": {"name": name, "namespace": ns, "uid": pod.uid}}, "CgpuAssumed",
              f"{pod.need} {cluster.RESOURCE} on GPU {annotations[cluster.IDX]} of node {node_name} "
              f"({chosen[1]})")
    return {"Error": ""}


def _commit(state: State, node: Node, pod: Pod) -> tuple[tuple[int, ...], str]:
    """Choose the pod's GPU(s) on the node and write the choice on the Node, with the resourceVersion
    the choice was made from; on a conflict read the node again and choose again."""
    from kubernetes.client.exceptions import ApiException

    for _ in range(BIND_ATTEMPTS):
        now = time.time()
        with state.lock:
            free = list(state._free(node, now))
        gpus = cluster.choose(list(node.units), [u - f for u, f in zip(node.units, free)], pod.need, pod.count,
                              node.strategy)
        if gpus is None:
            raise BadRequest(f"node {node.name} has no GPU with {pod.need} free {cluster.RESOURCE} any more")
        assumed = {u: e for u, e in node.assumed.items() if now - e[2] <= ASSUMED_SECONDS and u != pod.uid}
        assumed[pod.uid] = (tuple(gpus), pod.need // len(gpus), now)
        patch = {"metadata": {"resourceVersion": node.version, "annotations": {ASSUMED: dump_assumed(assumed)}}}
        try:
            resp = state.api.patch_node(node.name, patch, _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:
                raise
            node = Node(_read(state, f"node {node.name}", state.api.read_node, node.name))  # read again
            continue
        written = Node(json.loads(resp.data))
        with state.lock:  # what we wrote counts at once (unless the watch already brought newer)
            if (cached := state.nodes.get(node.name)) is None or cached.version == node.version:
                state.nodes[node.name] = written
                for uid in written.assumed:
                    state.assumed_on[uid] = node.name
        return tuple(gpus), node.strategy
    raise Busy(f"node {node.name} changed under {BIND_ATTEMPTS} binds in a row; try again")


def _take_back(state: State, node_name: str, uid: str) -> None:
    """Remove a choice whose Binding failed (once; when that conflicts, the choice ages out)."""
    from cgpud.k8s.api import one_line

    try:
        node = Node(_read(state, f"node {node_name}", state.api.read_node, node_name))
        if uid in node.assumed:
            del node.assumed[uid]
            state.api.patch_node(node_name, {"metadata": {"resourceVersion": node.version,
                                                          "annotations": {ASSUMED: dump_assumed(node.assumed)}}},
                                 _preload_content=False)
    except Exception as exc:  # noqa: BLE001 - it ages out after ASSUMED_SECONDS
        log.warning("cannot take back the choice for pod %s on %s (%s)", uid, node_name, one_line(exc))


def event(api, pod: dict, reason: str, message: str) -> None:
    """An Event on the pod (`kubectl describe pod` shows it); a failure is logged, not raised."""
    from datetime import datetime, timezone

    from kubernetes.client import CoreV1Event, V1EventSource, V1ObjectMeta, V1ObjectReference

    from cgpud.k8s.api import one_line

    meta = pod["metadata"]
    now = datetime.now(timezone.utc)
    body = CoreV1Event(
        metadata=V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
        involved_object=V1ObjectReference(kind="Pod", name=meta["name"], namespace=meta["namespace"],
                                          uid=meta.get("uid"), api_version="v1"),
        reason=reason, message=message, type="Normal", count=1, first_timestamp=now, last_timestamp=now,
        source=V1EventSource(component="cgpu-scheduler-extender"))
    try:
        api.create_namespaced_event(meta["namespace"], body, _preload_content=False)
    except Exception as exc:  # noqa: BLE001 - an event is a courtesy; the bind is done
        log.warning("cannot record an event on %s/%s (%s)", meta["namespace"], meta["name"], one_line(exc))


def inspect(state: State, node: str | None) -> dict:
    with state.lock:
        if node is not None and node not in state.nodes:
            raise BadRequest(f"node {node} is not known to the API server")
        names = [node] if node else [n for n, v in state.nodes.items() if v.units]
        return {"nodes": [_view(state.nodes[n], state.on_node.get(n, {})) for n in names]}


def _view(node: Node, pods: dict) -> dict:
    """One node in cgpud.observe.inspect's shape (as cluster.node_view), from the pods on its GPUs."""
    used = [0] * len(node.units)
    insts = []
    for pod in sorted(pods.values(), key=lambda p: p.key):
        per = {str(i): pod.need // len(pod.gpus) for i in pod.gpus}
        for i in pod.gpus:
            if i < len(used):
                used[i] += pod.need // len(pod.gpus)
        insts.append({"name": pod.key[1], "namespace": pod.key[0], "gpus": per, "allocated": sum(per.values())})
    allocated, total = sum(used), sum(node.units)
    return {"name": node.name, "ipaddress": node.address,
            "gpus": [{"index": i, "allocated": used[i], "total": u} for i, u in enumerate(node.units)],
            "allocated": allocated, "total": total, "percent": allocated * 100 // total if total else 0,
            "instances": insts}


def make_server(state: State, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            log.debug("%s " + fmt, self.address_string(), *a)

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _answer(self, fn, *args) -> None:
            from kubernetes.client.exceptions import ApiException

            from cgpud.k8s.api import refusal

            try:
                self._send(200, fn(state, *args))
            except BadRequest as exc:
                self._send(400, {"Error": str(exc)})
            except Busy as exc:
                self._send(503, {"Error": str(exc)})
            except ApiException as exc:
                self._send(502, {"Error": refusal(exc)})
            except Exception as exc:  # noqa: BLE001 - one request's failure, said, never the server's
                log.exception("extender request failed")
                self._send(500, {"Error": f"internal error: {exc}"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                return self._send(413, {"Error": f"body larger than {MAX_BODY} bytes"})
            try:
                args = json.loads(self.rfile.read(n) or b"null")
                if not isinstance(args, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                return self._send(400, {"Error": f"the body is not a JSON object ({exc})"})
            fn = {f"{PREFIX}/filter": filter_nodes, f"{PREFIX}/bind": bind}.get(self.path)
            if fn is None:
                return self._send(404, {"Error": f"no such path {self.path}"})
            self._answer(fn, args)

        def do_GET(self):
            if self.path == f"{PREFIX}/inspect":
                return self._answer(inspect, None)
            if self.path.startswith(f"{PREFIX}/inspect/"):
                return self._answer(inspect, self.path[len(PREFIX) + 9:])
            self._send(404, {"Error": f"no such path {self.path}"})

    return Server((host, port), Handler)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # kube-scheduler asks in parallel; the default backlog of 5 resets connections


def main(addr: str) -> None:
    from cgpud.k8s.api import connect

    host, _, port = addr.rpartition(":")
    api, raw = connect("cgpu-scheduler-extender")
    state = State(api, raw).start()  # (the first LIST: an API server that refuses us is said now, at start)
    server = make_server(state, host or "0.0.0.0", int(port))
    log.info("scheduler extender on http://%s:%d%s", *server.server_address[:2], PREFIX)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
