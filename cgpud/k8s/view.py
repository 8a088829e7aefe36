"""The cluster as the scheduler extender keeps it (docs/kubernetes.md): nodes
and pods LISTed once and then WATCHed (cgpud.k8s.informer), each event
applied to what is kept of it — of a pod asking gpu-mem its key, UID, node,
GPUs and units (~200 bytes, not its JSON); of a node its GPUs' sizes,
placement, address and recent bind choices — and to the per-node set of pods
on its GPUs. A node's free units are worked out again only when asked after
one of its pods or the node changed, so filter and bind cost in proportion
to the nodes they are asked about.
"""
from __future__ import annotations

import json
import threading
import time

from cgpud.k8s import cluster, modes
from cgpud.k8s.informer import Informer

# ours, on the Node: the choices binds made on it recently, {pod uid: [GPU indices "0,1", units per GPU, unix time]}
ASSUMED = "cgpu.aliyun.com/gpu-mem-assumed"
ASSUMED_SECONDS = 60.0  # a choice stays on the node this long: by then every replica's watch shows its pod
# prioritize's best node for a pod counts the pod there until its bind comes (kube-scheduler binds after
# it has scheduled the next pods) or this long: a burst's next pod sees it (cgpud.k8s.score). A bind
# comes after the pod's binding cycle starts, which on a loaded machine is seconds after its scheduling
# cycle, and may itself take up to kube-scheduler's extender timeout (5 s by default): 5 s here lapsed
# before binds that came, and the next pods saw the node they were going to as empty (the full suite's
# burst on 5 GPUs of 3 nodes, not 4 of 2). A pod whose bind fails is scored again (its nomination then
# ends), a deleted one's ends at its watch event: what stays this long is a pod stuck between the two.
NOMINATED_SECONDS = 30.0
# a node a bind of ours wrote stands against older watch events until the watch brings it, or this long
# (a watch far behind: its events are applied again, as before any write of ours)
WRITTEN_SECONDS = 10.0


class BadRequest(ValueError):
    """A request that cannot be answered as asked: HTTP 400 with str() as the reason."""


class Pod:
    """What the extender keeps of a pod asking for gpu-mem."""

    __slots__ = ("uid", "node", "gpus", "need", "count", "live", "key", "core", "placement")

    def __init__(self, obj: dict) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        self.key = (meta.get("namespace") or "", meta.get("name") or "")
        self.uid = meta.get("uid") or ""
        self.node = spec.get("nodeName") or ""
        self.need = cluster.pod_units(obj)
        self.core = cluster.pod_core(obj)  # core_mem: its compute percentage on each of its GPUs
        try:
            self.count = gpu_count(obj)
        except BadRequest:
            self.count = 1
        gpus = cluster.pod_gpus(obj)
        self.gpus = tuple(gpus) if gpus else ()
        self.live = cluster.holds_gpu(obj)
        try:
            self.placement = cluster.pod_placement(obj)  # its own binpack/spread, or None (the node's label)
        except ValueError:
            self.placement = None  # (the filter refuses such a pod: it is never bound by us)

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

    __slots__ = ("name", "units", "strategy", "address", "version", "assumed", "free", "desc", "why", "until",
                 "unhealthy", "core_free", "whole", "asc", "partly", "partly_free", "total_free", "serving", "total")

    def __init__(self, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        self.name = meta.get("name") or ""
        self.version = meta.get("resourceVersion") or ""
        self.units = tuple(cluster.gpu_units(obj))
        if not modes.advertises(modes.in_force(obj), cluster.RESOURCE):
            self.units = ()  # its mode has no gpu-mem (cgpud.k8s.modes): nothing to place there
        self.unhealthy = cluster.gpu_unhealthy(obj)  # GPUs out of service: nothing is placed on them
        self.strategy = strategy_of(obj)
        self.address = cluster.node_address(obj)
        self.assumed = parse_assumed((meta.get("annotations") or {}).get(ASSUMED))
        self.free: list[int] | None = None  # None: compute again
        self.desc: list[int] = []
        self.why = ""
        self.until = 0.0  # free counts recent choices until then
        self.core_free: list[int] = []  # core_mem: each GPU's compute percentage not asked by its pods
        # (with free, for prioritize and the fragmentation metrics: cgpud.k8s.score) free units, least
        # first; GPUs in service with nothing on them; partly used ones and their free units; all free units
        self.asc: list[int] = []
        self.whole = self.partly = self.partly_free = self.total_free = 0
        self.serving = sum(1 for i, u in enumerate(self.units) if u and i not in self.unhealthy)  # GPUs in service
        self.total = sum(self.units)


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

    def __init__(self, api, raw=None, placement: str = "binpack") -> None:
        self.api, self.raw = api, raw
        self.placement = placement  # across nodes, for pods that name none (cgpud.k8s.score)
        self.lock = threading.Lock()
        self.nodes: dict[str, Node] = {}
        self.pods: dict[tuple[str, str], Pod] = {}  # pods asking gpu-mem, by (namespace, name)
        self.uids: dict[str, tuple[str, str]] = {}
        self.on_node: dict[str, dict[tuple[str, str], Pod]] = {}  # node -> the pods counted on its GPUs
        self.assumed_on: dict[str, str] = {}  # pod uid -> the node whose recent choices name it
        self.gone: dict[str, float] = {}  # pod uid -> when it was deleted (its choice no longer counts)
        # prioritize's best node for pods not bound yet: node -> {pod uid: (GPUs, units per GPU, %, time)}
        self.nominated: dict[str, dict[str, tuple[tuple[int, ...], int, int, float]]] = {}
        self.nominee: dict[str, str] = {}  # pod uid -> the node it is nominated to
        self.node_locks: dict[str, threading.Lock] = {}
        # node -> (the version a bind of ours wrote, when): watch events older than it are not applied
        self.written: dict[str, tuple[str, float]] = {}
        self.waiting: dict[str, list] = {}  # node -> binds waiting to write their choices there (extender._commit)
        self.events = None  # pod events, written off the bind's path (cgpud.k8s.extender.Events)
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
            self.written.clear()

    def wrote(self, node: Node) -> None:
        """A bind's patch answered with `node`: it stands until the watch brings that version. (Under the lock.)"""
        self.nodes[node.name] = node
        for uid in node.assumed:
            self.assumed_on[uid] = node.name
        self.written[node.name] = (node.version, time.time())

    def _node_event(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        name, version = meta.get("name") or "", meta.get("resourceVersion") or ""
        with self.lock:
            if kind != "DELETED" and (mine := self.written.get(name)):
                # The watch brings a node's changes in order: until it brings the version a bind of ours
                # wrote (the patch's answer, cached at once), what it brings is older and would undo that
                # bind's choice (the next bind would then conflict, and filter count the units free).
                # resourceVersions are not compared (opaque: API conventions), only matched.
                if version != mine[0] and time.time() - mine[1] < WRITTEN_SECONDS:
                    return
                del self.written[name]
            if kind != "DELETED" and version and (held := self.nodes.get(name)) and held.version == version:
                return  # the version we hold (a bind's own write, which its answer brought): nothing new
        node = Node(obj)  # (read outside the lock: filter and prioritize do not wait for it)
        with self.lock:
            if kind != "DELETED" and (mine := self.written.get(name)):  # (a bind wrote while it was read)
                if version == mine[0]:
                    del self.written[name]  # (this very version: held already)
                return  # (else newer than this)
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
            now = time.time()
            self.gone.update((uid, now) for uid in self.uids.keys() - uids.keys())  # (deleted while not watched)
            self.pods, self.on_node, self.uids = pods, on_node, uids
            for node in self.nodes.values():
                node.free = None

    def _pod_event(self, kind: str, obj: dict) -> None:
        pod = Pod(obj)
        with self.lock:
            old = self.pods.pop(pod.key, None)
            if kind == "DELETED":
                self._gone(pod.uid)
            if pod.node or kind == "DELETED":
                self.unnominate(pod.uid)  # (bound: its node counts it now)
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

    def nominate(self, uid: str, node: str, gpus: tuple[int, ...], per: int, core: int, now: float) -> None:
        """Count the pod on `node` until its bind (or NOMINATED_SECONDS). (Under the lock.)"""
        self.unnominate(uid)
        if len(self.nominee) > 4096:  # (pods scheduled elsewhere, never bound by us: forget the old)
            for old in [u for n in self.nominated.values() for u, e in n.items() if now - e[3] > NOMINATED_SECONDS]:
                self.unnominate(old)
        self.nominated.setdefault(node, {})[uid] = (gpus, per, core, now)
        self.nominee[uid] = node
        self._changed(node)

    def unnominate(self, uid: str) -> None:
        node = self.nominee.pop(uid, None)
        if node is not None:
            self.nominated[node].pop(uid, None)
            if not self.nominated[node]:
                del self.nominated[node]
            self._changed(node)

    def _gone(self, uid: str) -> None:
        now = time.time()
        self.gone[uid] = now
        if len(self.gone) > 1024:  # forget what no recent choice can name any more
            self.gone = {u: t for u, t in self.gone.items() if now - t <= ASSUMED_SECONDS}

    def _changed(self, name: str | None) -> None:
        node = self.nodes.get(name) if name else None
        if node is not None:
            node.free = None

    def free_units(self, node: Node, now: float) -> list[int]:
        """Each GPU's free units: its size less its pods' units less the recent choices of binds whose
        pods the watch has not shown on a GPU yet, less the pods prioritize nominated here that are not
        bound yet. (Under the lock.)"""
        if node.free is not None and now < node.until:
            return node.free
        used = [0] * len(node.units)
        core = [0] * len(node.units)
        for pod in self.on_node.get(node.name, {}).values():
            for i in pod.gpus:
                if i < len(used):
                    used[i] += pod.need // len(pod.gpus)
                    core[i] += pod.core
        until = float("inf")
        for uid, (gpus, per, pct, at) in self.nominated.get(node.name, {}).items():
            if now - at > NOMINATED_SECONDS or uid in self.gone:
                continue
            until = min(until, at + NOMINATED_SECONDS)
            for i in gpus:
                if i < len(used):
                    used[i] += per
                    core[i] += pct
        node.core_free = [100 - c for c in core]
        for uid, (gpus, per, at) in node.assumed.items():
            if now - at > ASSUMED_SECONDS or uid in self.gone:
                continue
            key = self.uids.get(uid)
            pod = self.pods.get(key) if key else None
            if pod is not None and (pod.counted or not pod.live):
                continue  # its pod counts itself now (or is over)
            until = min(until, at + ASSUMED_SECONDS)
            for i in gpus:
                if i < len(used):
                    used[i] += per
        node.free = [0 if i in node.unhealthy else u - x for i, (u, x) in enumerate(zip(node.units, used))]
        node.desc = sorted(node.free, reverse=True)
        node.asc = node.desc[::-1]
        node.whole = node.partly = node.partly_free = 0
        for i, (f, u, c) in enumerate(zip(node.free, node.units, node.core_free)):
            if f == u and c == 100:
                node.whole += u > 0
            elif f > 0:
                node.partly += 1
                node.partly_free += f
        node.total_free = sum(node.free)
        node.until, node.why = until, ""
        return node.free

    def why_not(self, node: Node, need: int, count: int) -> str:
        if not node.units:
            return f"no {cluster.RESOURCE} on this node"
        if not node.why:
            node.why = ", ".join(f"GPU{i} out of service" if i in node.unhealthy else f"GPU{i} {f}/{u}"
                                 for i, (u, f) in enumerate(zip(node.units, node.free)))
        return f"no {count} GPU(s) with {need // max(count, 1)} free {cluster.RESOURCE} ({node.why})"

    def node_lock(self, name: str) -> threading.Lock:
        with self.lock:
            return self.node_locks.setdefault(name, threading.Lock())


def asked(args: dict) -> tuple[dict, list, list]:
    """ExtenderArgs' pod, the names of its candidate nodes, and their objects (the Nodes form: a
    scheduler not node-cache-capable sends them whole)."""
    pod = args.get("Pod") or args.get("pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs has no Pod")
    names = args.get("NodeNames") or args.get("nodenames")
    items = ((args.get("Nodes") or args.get("nodes") or {}).get("items")) or []
    if names is None:
        names = [(n.get("metadata") or {}).get("name") for n in items]
    return pod, names, items


def gpu_count(pod: dict) -> int:
    """How many GPUs the pod's gpu-mem is spread over: the pod label `aliyun.com/gpu-count` (how
    seed 000 and ACK's multi-GPU sharing ask), else the largest container limit of that name, else 1."""
    label = ((pod.get("metadata") or {}).get("labels") or {}).get(cluster.COUNT)
    asked = [label] if label is not None else [
        ((c.get("resources") or {}).get("limits") or {}).get(cluster.COUNT, 0)
        for c in (pod.get("spec") or {}).get("containers") or []]
    try:
        count = max((int(v) for v in asked), default=0)
    except (TypeError, ValueError):
        raise BadRequest(f"{cluster.COUNT} is not a whole number") from None
    if count < 0:
        raise BadRequest(f"{cluster.COUNT} is negative")
    return count or 1


def strategy_of(node: dict) -> str:
    label = ((node.get("metadata") or {}).get("labels") or {}).get(cluster.PLACEMENT_LABEL, "binpack")
    return label if label in ("binpack", "spread") else "binpack"
