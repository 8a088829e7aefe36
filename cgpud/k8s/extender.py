"""`cgpu scheduler-extender`: kube-scheduler's extender for
`aliyun.com/gpu-mem`, compatible with gpushare-scheduler-extender
(docs/kubernetes.md): the same paths, the kube-scheduler extender v1 JSON,
and gpushare's pod annotations.

    POST /gpushare-scheduler/filter   ExtenderArgs -> ExtenderFilterResult
    POST /gpushare-scheduler/bind     ExtenderBindingArgs -> ExtenderBindingResult
    GET  /gpushare-scheduler/inspect[/NODE]

A node passes the filter only if one GPU (or, with aliyun.com/gpu-count, M
GPUs) has the pod's units free; bind chooses the GPU(s) by the node's
placement (label ack.node.gpu.placement: binpack, the default, or spread),
writes the annotations (ALIYUN_COM_GPU_MEM_IDX, _DEV, _POD, _ASSIGNED=false,
_ASSUME_TIME) and creates the Binding. The cluster is read with the official
client and kept for CACHE_SECONDS; what bind assumes counts at once.
Bad input (not JSON, a pod or node that does not exist) is a clear error and
changes nothing.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cgpud.k8s import cluster

log = logging.getLogger("cgpud.k8s")
PREFIX = "/gpushare-scheduler"
CACHE_SECONDS = 1.0
MAX_BODY = 16 << 20


class BadRequest(ValueError):
    pass


class State:
    """Nodes and pods as the API's JSON, read again when older than CACHE_SECONDS; `keep_fresh`
    reads them in the background so that filter never waits for the API server."""

    def __init__(self, api, raw) -> None:
        self.api, self.raw = api, raw
        self.lock = threading.Lock()  # the swap of what was read, and bind's own updates
        self.reading = threading.Lock()  # one read of the cluster at a time
        self.binding = threading.Lock()  # one bind at a time: read, choose, annotate, bind
        self.at = -1e9
        self.nodes: dict[str, dict] = {}
        self.pods: list[dict] = []
        self.on_node: dict[str, list[dict]] = {}  # node name -> its pods

    def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.at < CACHE_SECONDS:
            return
        with self.reading:
            if not force and time.monotonic() - self.at < CACHE_SECONDS:
                return  # (read while this one waited)
            began = time.monotonic()
            # the lists' JSON as it came (the client's models for 400 pods cost tens of ms of CPU, and
            # filter requests would wait for the interpreter meanwhile)
            nodes = json.loads(self.api.list_node(_preload_content=False).data)["items"]
            pods = json.loads(self.api.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
            on_node: dict[str, list[dict]] = {}
            for pod in pods:
                on_node.setdefault((pod.get("spec") or {}).get("nodeName") or "", []).append(pod)
            with self.lock:
                self.nodes = {n["metadata"]["name"]: n for n in nodes}
                self.pods, self.on_node, self.at = pods, on_node, began

    def keep_fresh(self, stop: threading.Event) -> None:
        """Read the cluster every CACHE_SECONDS / 2 until `stop` (its errors logged, not raised)."""
        while not stop.wait(CACHE_SECONDS / 2):
            try:
                self.refresh(force=True)
            except Exception as exc:  # noqa: BLE001 - the next request reads again and says why
                from cgpud.k8s.api import one_line

                log.warning("cannot read the cluster (%s)", one_line(exc))

    def room(self, name: str) -> tuple[list[int], list[int]]:
        node = self.nodes[name]
        units = cluster.gpu_units(node)
        return units, cluster.used_units(name, self.on_node.get(name, []), len(units))

    def placed(self, pod: dict, node_name: str, annotations: dict) -> None:
        """What bind just did counts before the next read."""
        with self.lock:
            pod["metadata"].setdefault("annotations", {}).update(annotations)
            pod.setdefault("spec", {})["nodeName"] = node_name
            self.on_node.setdefault(node_name, []).append(pod)


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
    state.refresh()
    ok, failed = [], {}
    for name in names:
        if name not in state.nodes:
            failed[name] = f"node {name} is not known to the API server"
            continue
        units, used = state.room(name)
        if not units:
            failed[name] = f"no {cluster.RESOURCE} on this node"
        elif cluster.choose(units, used, need, count, strategy_of(state.nodes[name])) is None:
            free = ", ".join(f"GPU{i} {u - x}/{u}" for i, (u, x) in enumerate(zip(units, used)))
            failed[name] = f"no {count} GPU(s) with {need // max(count, 1)} free {cluster.RESOURCE} ({free})"
        else:
            ok.append(name)
    result = {"NodeNames": ok, "FailedNodes": failed, "Error": ""}
    if args.get("NodeNames") is None:
        result["Nodes"] = {"items": [n for n in items if (n.get("metadata") or {}).get("name") in ok]}
    return result


def bind(state: State, args: dict) -> dict:
    name, ns, node_name = args.get("PodName"), args.get("PodNamespace"), args.get("Node")
    if not all(isinstance(x, str) and x for x in (name, ns, node_name)):
        raise BadRequest("ExtenderBindingArgs needs PodName, PodNamespace and Node")
    # kube-scheduler binds pods concurrently: two binds choosing from the same free units would
    # over-fill a GPU, so a bind reads, chooses, annotates and binds alone.
    with state.binding:
        return _bind(state, name, ns, node_name, args.get("PodUID"))


def _bind(state: State, name: str, ns: str, node_name: str, uid: str | None) -> dict:
    from kubernetes.client import V1Binding, V1ObjectMeta, V1ObjectReference
    from kubernetes.client.exceptions import ApiException

    state.refresh(force=True)
    if node_name not in state.nodes:
        raise BadRequest(f"node {node_name} is not known to the API server")
    pod = next((p for p in state.pods if p["metadata"]["name"] == name and p["metadata"]["namespace"] == ns), None)
    if pod is None:
        raise BadRequest(f"pod {ns}/{name} is not known to the API server")
    if uid and pod["metadata"].get("uid") not in (None, uid):
        raise BadRequest(f"pod {ns}/{name} is not the pod with UID {uid} any more (it was recreated)")
    need = cluster.pod_units(pod)
    patch = {}
    if need > 0:
        units, used = state.room(node_name)
        gpus = cluster.choose(units, used, need, gpu_count(pod), strategy_of(state.nodes[node_name]))
        if gpus is None:
            raise BadRequest(f"node {node_name} has no GPU with {need} free {cluster.RESOURCE} any more")
        patch = cluster.assume_annotations(gpus, need, min(units[i] for i in gpus))
        state.api.patch_namespaced_pod(name, ns, {"metadata": {"annotations": patch}})
    body = V1Binding(metadata=V1ObjectMeta(name=name, namespace=ns, uid=uid),
                     target=V1ObjectReference(kind="Node", name=node_name, api_version="v1"))
    try:
        state.api.create_namespaced_binding(ns, body, _preload_content=False)
    except ApiException:
        if patch:  # not bound: take the choice back, so no GPU counts units for a pod that is not there
            try:
                state.api.patch_namespaced_pod(name, ns, {"metadata": {"annotations": dict.fromkeys(patch)}})
            except ApiException as exc:
                log.warning("bind of %s/%s failed and its annotations could not be removed (%s)", ns, name, exc)
        raise
    state.placed(pod, node_name, patch)
    log.info("bound %s/%s to %s %s", ns, name, node_name, patch.get(cluster.IDX, ""))
    if patch:
        event(state.api, pod, "CgpuAssumed", f"{need} {cluster.RESOURCE} on GPU {patch[cluster.IDX]} of node "
              f"{node_name} ({strategy_of(state.nodes[node_name])})")
    return {"Error": ""}


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
    state.refresh()
    if node is not None and node not in state.nodes:
        raise BadRequest(f"node {node} is not known to the API server")
    names = [node] if node else [n for n in state.nodes if cluster.gpu_units(state.nodes[n])]
    return {"nodes": [cluster.node_view(state.nodes[n], state.on_node.get(n, [])) for n in names]}


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
    api, raw = connect()
    state = State(api, raw)
    state.refresh()  # (an API server that refuses us is said now, at start)
    server = make_server(state, host or "0.0.0.0", int(port))
    threading.Thread(target=state.keep_fresh, args=(threading.Event(),), daemon=True).start()
    log.info("scheduler extender on http://%s:%d%s", *server.server_address[:2], PREFIX)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
