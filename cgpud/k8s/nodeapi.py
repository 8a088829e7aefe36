"""The device plugin's dealings with the API server (docs/kubernetes.md),
through the official client; all optional: without access the plugin serves
the kubelet fully and says once what it cannot do.

- publish: the node's `aliyun.com/gpu-count` capacity and allocatable, and
  each GPU's units in the annotation cgpu.aliyun.com/gpu-mem-per-device (for
  the extender and `kubectl inspect cgpu`: GPUs of one node may differ);
- labels: ack.node.gpu.placement (binpack|spread) and cgpu.disable.isolation;
- assumed: the GPU the scheduler extender chose for a container. As gpushare
  does: among this node's pending pods whose annotations say
  ALIYUN_COM_GPU_MEM_ASSIGNED=false, the oldest (ALIYUN_COM_GPU_MEM_ASSUME_TIME)
  that has a container asking exactly this many units not yet given — but per
  container, so a pod with two gpu-mem containers works; the pod is marked
  ASSIGNED=true once all its containers have been given theirs. How many
  have is also written on the pod (GIVEN), so a restarted plugin goes on
  with the right container.

Both are kept in memory by watches (cgpud.k8s.informer), not asked for: the
node's own pods (fieldSelector spec.nodeName=<node>) and its own Node
(metadata.name=<node>), each LISTed once and then WATCHed; so Allocate and
the labels are answered from memory and the API server sees two watches
from each node, not a request per container start or per tick.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from cgpud.k8s import cluster, modes
from cgpud.k8s.api import done, one_line
from cgpud.k8s.informer import Informer

log = logging.getLogger("cgpud.k8s")
# s: how long Allocate waits for the pod watch to bring an extender's choice it does not have yet (the
# kubelet learns of a pod through its own watch, which may be a moment ahead of ours)
CHOICE_WAIT = 0.25


class Unreachable(Exception):
    """The API server did not answer a question the plugin cannot do without; str() says which."""


class NodeApi:
    def __init__(self, node: str | None) -> None:
        self.node = node
        self.api = self.raw = None
        self.why_not: str | None = None
        self.given: dict[str, int] = {}  # pod uid -> containers given their units
        self.warned: set[str] = set()  # pods whose malformed annotation was logged
        self.lock = threading.Lock()
        self.waiting: dict[str, dict] = {}  # uid -> this node's pending pods the extender chose for, not yet given
        self.node_labels: dict[str, str] | None = None  # None: not read yet
        self.on_labels = None  # called with the node's labels when they change
        # the node's mode (cgpud.k8s.modes): the mode in force as the Node says it, its GPU pods
        self.mode_in_force: str | None = None
        self.gpu_pods: dict[str, str] = {}  # uid -> "namespace/name" of the node's pods holding GPUs
        self.on_pods = None  # called (no arguments) when the set of GPU pods changes
        self.pods_synced = False  # the pods' watch LISTed once: gpu_pods is the node's
        # (units, when) a GetPreferredAllocation's look found no choice: its Allocate, next, does not wait again
        self.missed: tuple[int, float] | None = None
        self.informers: list[Informer] = []
        if not node:
            self.why_not = "no node name (set NODE_NAME from the downward API, or --node-name)"
            return
        from cgpud.k8s.api import NoCluster, connect

        try:
            self.api, self.raw = connect("cgpu-device-plugin")
        except NoCluster as exc:
            self.why_not = str(exc)
            return
        self.pod_watch = Informer(f"pods on {node}", self.api.list_pod_for_all_namespaces, self._replace_pods,
                                  self._pod_event, field_selector=f"spec.nodeName={node}")
        self.node_watch = Informer(f"node {node}", self.api.list_node, self._replace_node, self._node_event,
                                   field_selector=f"metadata.name={node}")
        self.informers = [self.pod_watch, self.node_watch]

    def start(self) -> None:
        """Watch the node's pods and the node (each LISTed first; failures retried in the background)."""
        for inf in self.informers:
            inf.start()

    def stop(self) -> None:
        for inf in self.informers:
            inf.stop()

    @staticmethod
    def _waits(pod: dict) -> bool:
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        return ann.get(cluster.ASSIGNED) == "false" and (pod.get("status") or {}).get("phase") == "Pending"

    def _replace_pods(self, items: list[dict]) -> None:
        with self.lock:
            self.waiting = {p["metadata"].get("uid", ""): p for p in items if self._waits(p)}
            self.gpu_pods = {p["metadata"].get("uid", ""): _key(p) for p in items
                                                     if modes.gpu_pod(p)}
        self.pods_synced = True
        if self.on_pods is not None:
            self.on_pods()

    def _pod_event(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"].get("uid", "")
        with self.lock:
            if kind != "DELETED" and self._waits(pod):
                self.waiting[uid] = pod
            else:
                self.waiting.pop(uid, None)
                if kind == "DELETED":
                    self.given.pop(uid, None)
            had = uid in self.gpu_pods
            if kind != "DELETED" and modes.gpu_pod(pod):
                self.gpu_pods[uid] = _key(pod)
            else:
                self.gpu_pods.pop(uid, None)
            changed = had != (uid in self.gpu_pods)
        if changed and self.on_pods is not None:
            self.on_pods()

    def _replace_node(self, items: list[dict]) -> None:
        for node in items:
            self._node_event("ADDED", node)

    def _node_event(self, kind: str, node: dict) -> None:
        if kind == "DELETED":
            return
        meta = node.get("metadata") or {}
        self.mode_in_force = (meta.get("annotations") or {}).get(modes.MODE_IN_FORCE)
        labels = meta.get("labels") or {}
        if labels != self.node_labels:
            self.node_labels = labels
            if self.on_labels is not None:
                self.on_labels(labels)

    @property
    def usable(self) -> bool:
        return self.api is not None

    def say_once(self) -> None:
        if self.why_not:
            log.warning("without the API server (%s): the node's gpu-count, the extender's choices and the "
                        "node's labels are not used; the kubelet is served fully", self.why_not)

    def publish(self, units: list[int], unhealthy: list[int] = ()) -> bool:
        """Write the node's gpu-count and per-GPU units, and which GPUs are out of service (the
        extender places nothing on them); False when the API server refused (try again)."""
        if not self.usable:
            return False
        count = str(len(units))
        try:
            self.api.patch_node_status(self.node, {"status": {"capacity": {cluster.COUNT: count},
                                                              "allocatable": {cluster.COUNT: count}}})
            self.api.patch_node(self.node, {"metadata": {"annotations": {
                cluster.GPU_MEM_PER_DEVICE: ",".join(map(str, units)),
                cluster.UNHEALTHY: ",".join(map(str, unhealthy)) or None}}})
        except Exception as exc:  # noqa: BLE001 - the API server's trouble must not stop the kubelet's plugin
            log.warning("cannot update node %s (%s); trying again later", self.node, one_line(exc))
            return False
        return True

    def write_mode(self, decision: "modes.Decision", switched_from: str | None) -> None:
        """Say the node's mode on the Node (write_mode below)."""
        if self.usable:
            write_mode(self.api, self.node, self.node_labels, decision, switched_from, "cgpu-device-plugin")

    def node_event(self, reason: str, message: str) -> None:
        if self.usable:
            node_event(self.api, self.node, reason, message, "cgpu-device-plugin")

    def labels(self) -> dict[str, str] | None:
        """The node's labels as last watched, or None before they were read."""
        return self.node_labels

    def assumed(self, units: int, reserve: bool = True) -> "Choice | None":
        """The extender's choice for a container of `units` units on this node, reserved until
        `confirm` (the container got it) or `release` (Allocate failed after all); None when there is
        no extender's choice to follow; Unreachable while the API server cannot be watched.
        `reserve=False` only looks (GetPreferredAllocation, which comes before Allocate). From
        memory; when there is no choice, waits up to CHOICE_WAIT for the watch to bring one (once
        for a GetPreferredAllocation and its Allocate)."""
        if not self.usable:
            return None
        watch = self.pod_watch
        now = time.monotonic()
        # Only the Allocate (reserve) that follows a look which found nothing skips the wait, once:
        # another look (the next container's GetPreferredAllocation) waits for the watch again.
        missed = reserve and self.missed is not None and self.missed[0] == units and now - self.missed[1] < 2.0
        deadline = now + (0 if missed else CHOICE_WAIT)
        with watch.changed:
            while True:
                if not watch.healthy:
                    raise Unreachable(f"cannot ask the API server which GPU the scheduler extender chose "
                                      f"({watch.problem}); refusing rather than guessing: the pod can be created "
                                      "again")
                choice = self._choose(units, reserve)
                left = deadline - time.monotonic()
                if choice is not None or left <= 0:
                    break
                watch.changed.wait(left)
        self.missed = None if choice is not None or reserve else (units, time.monotonic())
        return choice

    def _choose(self, units: int, reserve: bool) -> "Choice | None":
        with self.lock:
            candidates = []
            for pod in list(self.waiting.values()):
                ann = pod["metadata"].get("annotations") or {}
                idx = cluster.pod_gpus(pod)
                if ann.get(cluster.ASSIGNED) != "false":
                    continue
                if idx is None:
                    self._malformed(pod, ann.get(cluster.IDX))
                    continue
                asks = [a for a in map(_units, pod["spec"].get("containers") or []) if a > 0]
                done = max(self.given.get(pod["metadata"].get("uid", ""), 0), _count(ann.get(cluster.GIVEN)))
                if done < len(asks) and asks[done] == units:
                    try:
                        when = int(ann.get(cluster.ASSUME_TIME, "0"))
                    except ValueError:
                        when = 0
                    candidates.append((when, pod, idx, len(asks)))
            if not candidates:
                return None
            _, pod, idx, n = min(candidates, key=lambda c: c[0])
            meta = pod["metadata"]
            uid = meta.get("uid", "")
            done = max(self.given.get(uid, 0), _count((meta.get("annotations") or {}).get(cluster.GIVEN))) + 1
            if reserve:
                self.given[uid] = done
            return Choice(idx, meta["namespace"], meta["name"], uid, last=done == n, number=done)

    def _malformed(self, pod: dict, raw) -> None:
        uid = pod["metadata"].get("uid", "")
        if uid not in self.warned:
            self.warned.add(uid)
            log.warning("pod %s/%s: %s=%r is not a list of GPU indices; its containers get the kubelet's own "
                        "units", pod["metadata"].get("namespace"), pod["metadata"].get("name"), cluster.IDX, raw)

    def release(self, choice: "Choice") -> None:
        with self.lock:
            self.given[choice.uid] -= 1

    def confirm(self, choice: "Choice") -> None:
        """The container got its units: count it on the pod, and after the pod's last container
        mark it ASSIGNED=true."""
        ann = {cluster.GIVEN: str(choice.number)}
        if choice.last:
            ann[cluster.ASSIGNED] = "true"
        try:
            self.api.patch_namespaced_pod(choice.name, choice.namespace, {"metadata": {"annotations": ann}})
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot mark %s/%s's container %d given (%s)", choice.namespace, choice.name, choice.number,
                        one_line(exc))


@dataclass(frozen=True)
class Choice:
    gpus: list[int]
    namespace: str
    name: str
    uid: str
    last: bool  # the pod's last gpu-mem container
    number: int  # which of the pod's gpu-mem containers (1, 2, …)


def _key(pod: dict) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _count(raw: str | None) -> int:
    try:
        return max(0, int(raw or 0))
    except ValueError:
        return 0


def _units(container: dict) -> int:
    try:
        return int(((container.get("resources") or {}).get("limits") or {}).get(cluster.RESOURCE, 0) or 0)
    except (TypeError, ValueError):
        return 0


def write_mode(api, node: str, labels: dict | None, decision: "modes.Decision", switched_from: str | None,
               component: str) -> None:
    """Say the node's mode on the Node, through `api` (the official CoreV1Api): the mode in force
    (annotation), the condition (True while a label change waits), and an event when it switched or
    started waiting. Failures are logged: the mode in force is the plugin's either way (written
    again at the next change). The device plugin's and the DRA plugin's alike."""
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    cond = {"type": modes.CONDITION, "status": "True" if decision.pending else "False",
            "reason": "WaitingForGpuPods" if decision.pending else "ModeInForce",
            "message": decision.message(), "lastHeartbeatTime": now, "lastTransitionTime": now}
    try:
        api.patch_node(node, {"metadata": {"annotations": {modes.MODE_IN_FORCE: decision.mode}}})
        api.patch_node_status(node, {"status": {"conditions": [cond]}})
    except Exception as exc:  # noqa: BLE001 - the API server's trouble must not stop the kubelet's plugin
        log.warning("cannot write node %s's mode (%s)", node, one_line(exc))
    if switched_from is not None and switched_from != decision.mode:
        node_event(api, node, "GpuModeChanged", f"mode {switched_from} -> {decision.mode} ({modes.LABEL}="
                                                f"{(labels or {}).get(modes.LABEL, '(none)')})", component)
    elif decision.pending:
        node_event(api, node, "GpuModeChangeWaiting", decision.message(), component)


def node_event(api, node: str, reason: str, message: str, component: str) -> None:
    """An event on the Node (a courtesy: a failure is logged)."""
    from datetime import datetime, timezone

    from kubernetes.client import CoreV1Event, V1EventSource, V1ObjectMeta, V1ObjectReference

    now = datetime.now(timezone.utc)
    body = CoreV1Event(
        metadata=V1ObjectMeta(generate_name=f"{node}.", namespace="default"),
        involved_object=V1ObjectReference(kind="Node", name=node, uid=node, api_version="v1"),
        reason=reason, message=message, type="Normal", count=1, first_timestamp=now, last_timestamp=now,
        source=V1EventSource(component=component, host=node))
    try:
        done(api.create_namespaced_event("default", body, _preload_content=False))  # (read: its connection reused)
    except Exception as exc:  # noqa: BLE001 - an event is a courtesy
        log.warning("cannot record an event on node %s (%s)", node, one_line(exc))
