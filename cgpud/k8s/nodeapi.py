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
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from cgpud.k8s import cluster
from cgpud.k8s.api import one_line

log = logging.getLogger("cgpud.k8s")


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
        if not node:
            self.why_not = "no node name (set NODE_NAME from the downward API, or --node-name)"
            return
        from cgpud.k8s.api import NoCluster, connect

        try:
            self.api, self.raw = connect()
        except NoCluster as exc:
            self.why_not = str(exc)

    @property
    def usable(self) -> bool:
        return self.api is not None

    def say_once(self) -> None:
        if self.why_not:
            log.warning("without the API server (%s): the node's gpu-count, the extender's choices and the "
                        "node's labels are not used; the kubelet is served fully", self.why_not)

    def publish(self, units: list[int]) -> bool:
        """Write the node's gpu-count and per-GPU units; False when the API server refused (try again)."""
        if not self.usable:
            return False
        count = str(len(units))
        try:
            self.api.patch_node_status(self.node, {"status": {"capacity": {cluster.COUNT: count},
                                                              "allocatable": {cluster.COUNT: count}}})
            self.api.patch_node(self.node, {"metadata": {"annotations": {
                cluster.GPU_MEM_PER_DEVICE: ",".join(map(str, units))}}})
        except Exception as exc:  # noqa: BLE001 - the API server's trouble must not stop the kubelet's plugin
            log.warning("cannot update node %s (%s); trying again later", self.node, one_line(exc))
            return False
        return True

    def labels(self) -> dict[str, str] | None:
        """The node's labels, or None when they cannot be read now (keep what was last read)."""
        if not self.usable:
            return None
        try:
            node = self.raw.sanitize_for_serialization(self.api.read_node(self.node))
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot read node %s (%s)", self.node, one_line(exc))
            return None
        return (node.get("metadata") or {}).get("labels") or {}

    def assumed(self, units: int, reserve: bool = True) -> "Choice | None":
        """The extender's choice for a container of `units` units on this node, reserved until
        `confirm` (the container got it) or `release` (Allocate failed after all); None when there is
        no extender's choice to follow; Unreachable when the API server cannot be asked.
        `reserve=False` only looks (GetPreferredAllocation, which comes before Allocate)."""
        if not self.usable:
            return None
        try:
            pods = self.raw.sanitize_for_serialization(self.api.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node},status.phase=Pending").items)
        except Exception as exc:  # noqa: BLE001 - whatever the client raised, the answer is "cannot ask"
            raise Unreachable(f"cannot ask the API server which GPU the scheduler extender chose ({one_line(exc)}); "
                              "refusing rather than guessing: the pod can be created again") from None
        with self.lock:
            candidates = []
            for pod in pods:
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
