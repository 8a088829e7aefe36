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
  ASSIGNED=true once all its containers have been given theirs.
"""
from __future__ import annotations

import logging
import threading

from cgpud.k8s import cluster

log = logging.getLogger("cgpud.k8s")


class NodeApi:
    def __init__(self, node: str | None) -> None:
        self.node = node
        self.api = self.raw = None
        self.why_not: str | None = None
        self.given: dict[str, int] = {}  # pod uid -> containers given their units
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

    def publish(self, units: list[int]) -> None:
        if not self.usable:
            return
        count = str(len(units))
        try:
            self.api.patch_node_status(self.node, {"status": {"capacity": {cluster.COUNT: count},
                                                              "allocatable": {cluster.COUNT: count}}})
            self.api.patch_node(self.node, {"metadata": {"annotations": {
                cluster.GPU_MEM_PER_DEVICE: ",".join(map(str, units))}}})
        except Exception as exc:  # noqa: BLE001 - the API server's trouble must not stop the kubelet's plugin
            log.warning("cannot update node %s (%s); trying again later", self.node, exc)

    def labels(self) -> dict[str, str]:
        if not self.usable:
            return {}
        try:
            node = self.raw.sanitize_for_serialization(self.api.read_node(self.node))
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot read node %s (%s)", self.node, exc)
            return {}
        return (node.get("metadata") or {}).get("labels") or {}

    def assumed(self, units: int) -> tuple[list[int], str, str] | None:
        """(GPU indices, namespace, name) the extender chose for a container of
        `units` units on this node, or None (no extender, or none matches)."""
        if not self.usable:
            return None
        pods = self.raw.sanitize_for_serialization(self.api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node},status.phase=Pending").items)
        with self.lock:
            candidates = []
            for pod in pods:
                ann = pod["metadata"].get("annotations") or {}
                idx = cluster.pod_gpus(pod)
                if ann.get(cluster.ASSIGNED) != "false" or idx is None:
                    continue
                asks = [int(((c.get("resources") or {}).get("limits") or {}).get(cluster.RESOURCE, 0) or 0)
                        for c in pod["spec"].get("containers") or []]
                asks = [a for a in asks if a > 0]
                done = self.given.get(pod["metadata"].get("uid", ""), 0)
                if done < len(asks) and asks[done] == units:
                    try:
                        when = int(ann.get(cluster.ASSUME_TIME, "0"))
                    except ValueError:
                        when = 0
                    candidates.append((when, pod, idx, len(asks)))
            if not candidates:
                return None
            _, pod, idx, n = min(candidates, key=lambda c: c[0])
            uid = pod["metadata"].get("uid", "")
            self.given[uid] = self.given.get(uid, 0) + 1
            last = self.given[uid] == n
        meta = pod["metadata"]
        if last:
            try:
                self.api.patch_namespaced_pod(meta["name"], meta["namespace"],
                                              {"metadata": {"annotations": {cluster.ASSIGNED: "true"}}})
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot mark %s/%s assigned (%s)", meta["namespace"], meta["name"], exc)
        return idx, meta["namespace"], meta["name"]
