"""`cgpu scheduler-extender`: kube-scheduler's extender for
`aliyun.com/gpu-mem`, compatible with gpushare-scheduler-extender
(docs/kubernetes.md): the same paths, the kube-scheduler extender v1 JSON,
and gpushare's pod annotations.

    POST /gpushare-scheduler/filter      ExtenderArgs -> ExtenderFilterResult
    POST /gpushare-scheduler/prioritize  ExtenderArgs -> HostPriorityList (cgpud.k8s.score)
    POST /gpushare-scheduler/bind        ExtenderBindingArgs -> ExtenderBindingResult
    GET  /gpushare-scheduler/inspect[/NODE]
    GET  /metrics                        the cluster's whole-GPU fragmentation (cgpud.k8s.score)

A node passes the filter only if one GPU (or, with aliyun.com/gpu-count, M
GPUs) has the pod's units free; prioritize ranks the nodes that passed
(binpack across nodes by default: the fullest GPU that fits; spread by
--placement or the pod's annotation cgpu.aliyun.com/placement); bind chooses
the GPU(s) by the pod's annotation, else the node's placement (label
ack.node.gpu.placement: binpack, the default, or spread) and creates the
Binding, which puts gpushare's annotations on the pod (ALIYUN_COM_GPU_MEM_IDX,
_DEV, _POD, _ASSIGNED=false, _ASSUME_TIME) in the same write.

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

Longer than 450 lines on purpose: the four verbs share the informers' view and the binds' group
commit (binds waiting on one node written in one patch, with their own events and timings), which
one lock keeps consistent; split, the lock's reasoning would be spread over modules.
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import ThreadingHTTPServer

from cgpud.k8s import cluster, httpjson, score, view
from cgpud.k8s.api import done
from cgpud.k8s.httpjson import Server, send_json
from cgpud.k8s.view import ASSUMED_SECONDS, BadRequest, Node, Pod, State, dump_assumed, gpu_count

log = logging.getLogger("cgpud.k8s")
PREFIX = "/gpushare-scheduler"
MAX_BODY = 16 << 20
BIND_ATTEMPTS = 10  # conflicts a bind rides out before it answers the scheduler "try again"
# kube-scheduler binds each pod on a goroutine of its own: a burst's binds share this many connections
# to the API server (each bind reads every answer: cgpud.k8s.api.connect), the watches and the events too.
# A bind holds one for two writes (~0.6 s when etcd takes 300 ms a write): 32 capped a burst near 50
# binds/s and queued binds past kube-scheduler's 5 s; the API server serves 200 writes at once by default.
API_CONNECTIONS = 100
EVENTS_QUEUED = 4096  # pod events waiting for their write; more are dropped (and counted)
# pod events written at once, then this many a second (a token bucket): a burst's binds write their
# choices, not one courtesy each (an Event is a write to etcd like a Binding; the pod's annotations and
# the "bound" log line say the same); the rest are dropped and counted (cgpu_extender_events_dropped_total)
EVENTS_BURST = 20
EVENTS_PER_SECOND = 2.0
# a request waits for the GIL at most one switch interval per wake-up (5 ms by default): filter and
# prioritize, short, wait behind binds' and watches' work less (cgpud.observe.exposition does the same)
SWITCH_INTERVAL = 0.0005
VERBS = ("filter", "prioritize", "bind")
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Busy(RuntimeError):
    """The node kept changing under a bind: the scheduler should try again (HTTP 503)."""


def filter_nodes(state: State, args: dict) -> dict:
    pod, names, items = view.asked(args)
    need = cluster.pod_units(pod)
    if need <= 0:  # not ours to judge
        return {"Nodes": args.get("Nodes"), "NodeNames": names, "FailedNodes": {}, "Error": ""}
    score.placement(pod, state.placement)  # (a placement that is neither: refused here, where the pod says so)
    count = gpu_count(pod)
    core = cluster.pod_core(pod)
    ok, failed = [], {}
    now = time.time()
    per, even = need // count, need % count == 0
    with state.lock:  # (the loop a filter of 5,000 nodes spends its time in: kept lean)
        state.unnominate((pod.get("metadata") or {}).get("uid"))  # (scheduled again: not where it was nominated)
        nodes, work_out = state.nodes, state.free_units
        for name in names:
            node = nodes.get(name)
            if node is None:
                failed[name] = f"node {name} is not known to the API server"
                continue
            if node.free is None or now >= node.until:
                work_out(node, now)
            desc = node.desc  # free units per GPU, most first
            if core and even and sum(f >= per and c >= core for f, c in zip(node.free, node.core_free)) >= count:
                ok.append(name)  # core_mem: GPUs with the units and the compute percentage free
            elif core:
                failed[name] = (f"no {count} GPU(s) with {per} free {cluster.RESOURCE} and {core} % of "
                                f"{cluster.CORE} free (compute left: "
                                f"{', '.join(f'GPU{i} {c}' for i, c in enumerate(node.core_free))})")
            elif even and len(desc) >= count and desc[count - 1] >= per:
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
        # kube-scheduler binds pods concurrently: choices on one node are written together (_commit), its
        # Bindings and events are not held by each other; other replicas' choices are kept apart by the
        # node's resourceVersion.
        chosen = _commit(state, node, pod)
        annotations = cluster.assume_annotations(list(chosen[0]), pod.need, min(node.units[i] for i in chosen[0]))
    meta = {"name": name, "namespace": ns, **({"uid": uid} if uid else {}),
            **({"annotations": annotations} if annotations else {})}
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": meta,  # (the API's JSON: no model to build)
            "target": {"kind": "Node", "name": node_name, "apiVersion": "v1"}}
    try:
        done(state.api.create_namespaced_binding(ns, body, _preload_content=False))
    except ApiException:
        if chosen:  # not bound: take the choice back (else it counts until ASSUMED_SECONDS pass)
            _take_back(state, node_name, pod.uid)
        raise
    log.info("bound %s/%s to %s %s", ns, name, node_name, annotations.get(cluster.IDX, ""))
    if annotations:  # (written after the answer, by the events' own thread: not on the bind's path)
        (state.events or Events(state.api, start=False)).put(
            {"metadata": {"name": name, "namespace": ns, "uid": pod.uid}}, "CgpuAssumed",
            f"{pod.need} {cluster.RESOURCE} on GPU {annotations[cluster.IDX]} of node {node_name} ({chosen[1]})")
    return {"Error": ""}


class Waiting:
    """A bind waiting for its node's next write: its pod, and what came of it ((GPUs, placement), or
    the exception its bind raises)."""

    __slots__ = ("pod", "result")

    def __init__(self, pod: Pod) -> None:
        self.pod, self.result = pod, None


def _commit(state: State, node: Node, pod: Pod) -> tuple[tuple[int, ...], str]:
    """Choose the pod's GPU(s) on the node and write the choice on the Node, with the resourceVersion the
    choice was made from (on a conflict: read the node again and choose again). Binds to one node take
    turns (in this replica: they would only conflict), and the bind whose turn it is writes the choices
    of every bind waiting for that node, in the order they came, in one patch (group commit): binpack
    binds a burst's pods to one node after another, and one write each, one after the other, made a
    node's binds wait for each other's round trips to the API server and etcd."""
    me = Waiting(pod)
    with state.lock:
        state.waiting.setdefault(node.name, []).append(me)
    with state.node_lock(node.name):
        if me.result is None:  # (else a bind before ours wrote it)
            with state.lock:
                batch = state.waiting.pop(node.name, [])
                node = state.nodes.get(node.name) or node  # (the choices before ours, written while we waited)
            try:
                results = _choose_and_write(state, node, [w.pod for w in batch])
            except Exception as exc:  # noqa: BLE001 - each bind of the batch answers it
                results = [exc] * len(batch)
            finally:
                with state.lock:  # (chosen, or not bound: their nominations end)
                    for w in batch:
                        state.unnominate(w.pod.uid)
            for w, result in zip(batch, results):
                w.result = result
    if isinstance(me.result, BaseException):
        raise me.result
    return me.result


def _choose_and_write(state: State, node: Node, pods: list[Pod]) -> list:
    """For each pod, in order: (GPUs, placement), or BadRequest where it no longer fits; all chosen
    written in one patch of the Node."""
    from kubernetes.client.exceptions import ApiException

    uids = {pod.uid for pod in pods}
    for _ in range(BIND_ATTEMPTS):
        now = time.time()
        with state.lock:
            free, core_free = list(state.free_units(node, now)), list(node.core_free)
            # prioritize's nominations of these pods count for the others until their choices do, not for them
            for pod in pods:
                if (own := state.nominated.get(node.name, {}).get(pod.uid)) and now - own[3] <= view.NOMINATED_SECONDS:
                    for i in own[0]:
                        free[i], core_free[i] = free[i] + own[1], core_free[i] + own[2]
        assumed = {u: e for u, e in node.assumed.items() if now - e[2] <= ASSUMED_SECONDS and u not in uids}
        results: list = []
        for pod in pods:
            strategy = pod.placement or node.strategy  # the pod's own, else the node's label
            per = pod.need // pod.count
            # (core_mem: a GPU without the pod's compute percentage free does not fit)
            gpus = score.pick(free, core_free, per, pod.count, pod.core, strategy) \
                if pod.need > 0 and pod.need % pod.count == 0 else None
            if gpus is None:
                results.append(BadRequest(f"node {node.name} has no GPU with {pod.need} free {cluster.RESOURCE} "
                                          "any more"))
                continue
            for i in gpus:  # (the next pod of the batch sees this one's choice)
                free[i], core_free[i] = free[i] - per, core_free[i] - pod.core
            assumed[pod.uid] = (tuple(gpus), per, now)
            results.append((tuple(gpus), strategy))
        if all(isinstance(r, BaseException) for r in results):
            return results  # (nothing to write)
        patch = {"metadata": {"resourceVersion": node.version, "annotations": {view.ASSUMED: dump_assumed(assumed)}}}
        try:
            resp = state.api.patch_node(node.name, patch, _preload_content=False,
                                        _content_type="application/merge-patch+json")  # (no schema to look up)
        except ApiException as exc:
            if exc.status != 409:
                raise
            node = Node(_read(state, f"node {node.name}", state.api.read_node, node.name))  # read again
            continue
        written = Node(json.loads(resp.data))
        with state.lock:  # what we wrote counts at once (unless the watch already brought newer)
            if (cached := state.nodes.get(node.name)) is None or cached.version == node.version:
                state.wrote(written)
            for uid in uids:  # (their choices count now: in the same step, no moment counts neither)
                state.unnominate(uid)
        return results
    raise Busy(f"node {node.name} changed under {BIND_ATTEMPTS} binds in a row; try again")


def _take_back(state: State, node_name: str, uid: str) -> None:
    """Remove a choice whose Binding failed (once; when that conflicts, the choice ages out)."""
    from cgpud.k8s.api import one_line

    try:
        node = Node(_read(state, f"node {node_name}", state.api.read_node, node_name))
        if uid in node.assumed:
            del node.assumed[uid]
            done(state.api.patch_node(node_name, {"metadata": {
                "resourceVersion": node.version, "annotations": {view.ASSUMED: dump_assumed(node.assumed)}}},
                _preload_content=False, _content_type="application/merge-patch+json"))
    except Exception as exc:  # noqa: BLE001 - it ages out after ASSUMED_SECONDS
        log.warning("cannot take back the choice for pod %s on %s (%s)", uid, node_name, one_line(exc))


def event(api, pod: dict, reason: str, message: str) -> None:
    """An Event on the pod (`kubectl describe pod` shows it); a failure is logged, not raised."""
    from cgpud.k8s.api import one_line

    meta = pod["metadata"]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {"apiVersion": "v1", "kind": "Event",  # (the API's JSON: no model to build)
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid"), "apiVersion": "v1"},
            "reason": reason, "message": message, "type": "Normal", "count": 1, "firstTimestamp": now,
            "lastTimestamp": now, "source": {"component": "cgpu-scheduler-extender"}}
    try:
        done(api.create_namespaced_event(meta["namespace"], body, _preload_content=False))
    except Exception as exc:  # noqa: BLE001 - an event is a courtesy; the bind is done
        log.warning("cannot record an event on %s/%s (%s)", meta["namespace"], meta["name"], one_line(exc))


class Events:
    """Pod events written by a thread of their own, in order, after the bind that made them has
    answered: a bind waits for its two writes (the choice on the Node, the Binding), not for a
    courtesy. EVENTS_BURST are written at once, then EVENTS_PER_SECOND (a token bucket: a burst of
    binds is not also a burst of Events for the API server and etcd); at most EVENTS_QUEUED wait.
    The others are dropped and counted (`dropped`; said once in the log: the pods' annotations and
    the "bound" lines say the same). `start=False`: written at once by put (no thread)."""

    def __init__(self, api, start: bool = True) -> None:
        self.api, self.dropped = api, 0
        self.clock = time.monotonic
        self.tokens, self.at = float(EVENTS_BURST), self.clock()
        self.lock = threading.Lock()
        self.queue: queue.Queue | None = None
        if start:
            self.queue = queue.Queue(EVENTS_QUEUED)
            threading.Thread(target=self._run, name="cgpud-extender-events", daemon=True).start()

    def _take(self) -> bool:
        """A token for one event (EVENTS_PER_SECOND come back, up to EVENTS_BURST)."""
        with self.lock:
            now = self.clock()
            self.tokens = min(float(EVENTS_BURST), self.tokens + max(now - self.at, 0.0) * EVENTS_PER_SECOND)
            self.at = now
            if self.tokens < 1:
                return False
            self.tokens -= 1
            return True

    def put(self, pod: dict, reason: str, message: str) -> None:
        if not self._take():
            return self._drop(f"more than {EVENTS_BURST} at once, then {EVENTS_PER_SECOND:g} a second")
        if self.queue is None:
            return event(self.api, pod, reason, message)
        try:
            self.queue.put_nowait((pod, reason, message))
        except queue.Full:
            self._drop(f"more than {EVENTS_QUEUED} waiting for the API server")

    def _drop(self, why: str) -> None:
        with self.lock:
            self.dropped += 1
            first = self.dropped == 1
        if first:  # (said once; cgpu_extender_events_dropped_total counts them all)
            log.warning("pod events dropped (%s): the pods' annotations and the 'bound' lines of this log say "
                        "where each went; counted in cgpu_extender_events_dropped_total", why)

    def _run(self) -> None:
        while True:
            pod, reason, message = self.queue.get()
            try:
                event(self.api, pod, reason, message)
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        """Wait until every event put so far is written (or failed)."""
        if self.queue is not None:
            self.queue.join()


class Calls:
    """What the extender answered, by verb: how many (by HTTP status) and how long each took, from
    its request read to its answer made, counted before the answer is sent (GET /metrics:
    cgpu_extender_requests_total, cgpu_extender_request_seconds; docs/kubernetes.md), and the pod
    events it dropped (cgpu_extender_events_dropped_total, from `events`)."""

    def __init__(self, events: Events | None = None) -> None:
        from prometheus_client import Counter, Histogram
        from prometheus_client.core import CounterMetricFamily
        from prometheus_client.registry import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)

        class Dropped:
            def collect(self):
                yield CounterMetricFamily("cgpu_extender_events_dropped",
                                          "Pod events not written: past the rate a burst may write, or the queue.",
                                          value=events.dropped if events is not None else 0)

        self.registry.register(Dropped())
        self.count = Counter("cgpu_extender_requests", "Requests the extender answered, by verb and HTTP status.",
                             ["verb", "code"], registry=self.registry)
        self.seconds = Histogram("cgpu_extender_request_seconds",
                                 "How long the extender took to answer, from the request read to the answer made "
                                 "(before it is sent).",
                                 ["verb"], buckets=SECONDS_BUCKETS, registry=self.registry)

    def done(self, verb: str, code: int, seconds: float) -> None:
        self.count.labels(verb, str(code)).inc()
        self.seconds.labels(verb).observe(seconds)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


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
        insts.append({"name": pod.key[1], "namespace": pod.key[0], "gpus": per, "allocated": sum(per.values()),
                      "core": pod.core})
    allocated, total = sum(used), sum(node.units)
    return {"name": node.name, "ipaddress": node.address,
            "gpus": [{"index": i, "allocated": used[i], "total": u} for i, u in enumerate(node.units)],
            "allocated": allocated, "total": total, "percent": allocated * 100 // total if total else 0,
            "instances": insts}


def prioritize(state: State, args: dict) -> bytes:
    """cgpud.k8s.score's HostPriorityList, as JSON."""
    return score.encode(score.prioritize(state, args))


def make_server(state: State, host: str, port: int) -> ThreadingHTTPServer:
    if state.events is None:
        state.events = Events(state.api)
    calls = Calls(state.events)
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))

    class Handler(httpjson.Handler):  # (its headers read without the email parser)
        # kube-scheduler's client keeps its connections (Go's transport): one per binding goroutine and
        # the scheduling cycle's, not a connection and a thread made for each call
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            log.debug("%s " + fmt, self.address_string(), *a)

        verb: str | None = None  # (a POST's verb while it is answered: what _send counts it under)
        counted = False

        def _send(self, code: int, obj: dict) -> None:
            if self.verb is not None and not self.counted:  # (counted before the answer goes: a client that
                # has its answer and then scrapes /metrics sees its call counted)
                self.counted = True
                calls.done(self.verb, code, time.perf_counter() - self.start)
            send_json(self, code, obj)

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

        def parse_request(self) -> bool:
            self.start = time.perf_counter()  # (its request line read: the headers and the body count too)
            return super().parse_request()

        def do_POST(self):
            verb = self.path[len(PREFIX) + 1:] if self.path.startswith(PREFIX + "/") else ""
            self.counted, self.verb = False, verb if verb in VERBS else "other"
            try:
                self._post()
            finally:
                if not self.counted:  # (no answer sent: the connection failed first; code 0)
                    calls.done(self.verb, 0, time.perf_counter() - self.start)
                self.verb = None

        def _post(self):
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if n < 0 or n > MAX_BODY:
                self.close_connection = True  # (its body is not read: the connection cannot carry another)
                return self._send(413 if n > 0 else 400, {"Error": f"body larger than {MAX_BODY} bytes" if n > 0
                                                         else "Content-Length is not a number"})
            try:
                args = json.loads(self.rfile.read(n) or b"null")
                if not isinstance(args, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                return self._send(400, {"Error": f"the body is not a JSON object ({exc})"})
            fn = {f"{PREFIX}/filter": filter_nodes, f"{PREFIX}/prioritize": prioritize,
                  f"{PREFIX}/bind": bind}.get(self.path)
            if fn is None:
                return self._send(404, {"Error": f"no such path {self.path}"})
            self._answer(fn, args)

        def do_GET(self):
            if self.path == "/metrics":  # (the cluster's whole-GPU fragmentation: cgpud.k8s.score; the calls)
                body = score.exposition(state) + calls.exposition()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                return self.wfile.write(body)
            if self.path == f"{PREFIX}/inspect":
                return self._answer(inspect, None)
            if self.path.startswith(f"{PREFIX}/inspect/"):
                return self._answer(inspect, self.path[len(PREFIX) + 9:])
            self._send(404, {"Error": f"no such path {self.path}"})

    return Server((host, port), Handler)


def main(addr: str, placement: str = "binpack") -> None:
    from cgpud.k8s.api import connect

    host, _, port = addr.rpartition(":")
    api, raw = connect("cgpu-scheduler-extender", connections=API_CONNECTIONS)
    state = State(api, raw, placement).start()  # (the first LIST: an API server that refuses us is said now, at start)
    server = make_server(state, host or "0.0.0.0", int(port))
    log.info("scheduler extender on http://%s:%d%s", *server.server_address[:2], PREFIX)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
