"""The cluster's GPU memory as the API server shows it (docs/kubernetes.md).
Pure: the official client's node and pod objects (or their dicts) in,
plain data out; used by `kubectl inspect cgpu` and the scheduler extender.

Where things are (gpushare's names, so its tools and ours agree):
- a node's GPUs: capacity `aliyun.com/gpu-count` and `aliyun.com/gpu-mem`
  (units), and — ours, because GPUs of one node may differ in size — the
  annotation `GPU_MEM_PER_DEVICE` = the units of each GPU, "15,22"; without it
  every GPU has gpu-mem / gpu-count units, as gpushare assumes;
- a pod's request: the sum of its containers' `aliyun.com/gpu-mem` limits;
- where a pod is: its annotations ALIYUN_COM_GPU_MEM_IDX (the GPU index, or
  indices "0,1"), _POD (its units), _ASSIGNED ("true" once the device plugin
  gave it), _ASSUME_TIME (when the extender chose, ns).
"""
from __future__ import annotations

import time
from typing import Any

RESOURCE = "aliyun.com/gpu-mem"
COUNT = "aliyun.com/gpu-count"
GPU_MEM_PER_DEVICE = "cgpu.aliyun.com/gpu-mem-per-device"
IDX, POD, DEV, ASSIGNED, ASSUME_TIME = ("ALIYUN_COM_GPU_MEM_IDX", "ALIYUN_COM_GPU_MEM_POD", "ALIYUN_COM_GPU_MEM_DEV",
                                        "ALIYUN_COM_GPU_MEM_ASSIGNED", "ALIYUN_COM_GPU_MEM_ASSUME_TIME")
# ours: the node's GPUs out of service (the node daemon's health watch, published by the device plugin):
# indices, "1" or "0,3"; absent or "": all in service (docs/gpus.md, Health)
UNHEALTHY = "cgpu.aliyun.com/gpu-unhealthy"
GIVEN = "cgpu.aliyun.com/gpu-mem-containers-given"  # ours: how many of a pod's containers have their units
PLACEMENT_LABEL = "ack.node.gpu.placement"
# ours: a pod's own placement, binpack or spread, across nodes and on the node's GPUs (docs/kubernetes.md,
# "Placement across nodes"); without it the extender's --placement across nodes, the node's label on it
PLACEMENT_ANNOTATION = "cgpu.aliyun.com/placement"
DISABLE_LABEL = "cgpu.disable.isolation"


def _get(obj: Any, *path: str, default=None):
    """A field of a client model object or of its dict, by the API's JSON names."""
    for key in path:
        if obj is None:
            return default
        if isinstance(obj, dict):
            obj = obj.get(key)
        else:
            attr = {"allocatable": "allocatable", "nodeName": "node_name"}.get(key, key)
            obj = getattr(obj, _snake(attr), None)
    return default if obj is None else obj


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def gpu_units(node) -> list[int]:
    """The units of each GPU of a node ([] without GPUs)."""
    ann = _get(node, "metadata", "annotations", default={}) or {}
    raw = ann.get(GPU_MEM_PER_DEVICE)
    if raw:
        try:
            units = [int(x) for x in raw.split(",")]
            if all(u >= 0 for u in units):
                return units
        except ValueError:
            pass
    cap = _get(node, "status", "capacity", default={}) or {}
    try:
        count, mem = int(cap.get(COUNT, 0)), int(cap.get(RESOURCE, 0))
    except (TypeError, ValueError):
        return []
    return [mem // count] * count if count > 0 else []


def gpu_unhealthy(node) -> frozenset[int]:
    """The indices of a node's GPUs out of service (annotation UNHEALTHY; malformed parts ignored)."""
    raw = (_get(node, "metadata", "annotations", default={}) or {}).get(UNHEALTHY) or ""
    return frozenset(int(x) for x in raw.split(",") if x.strip().isdigit())


def pod_units(pod) -> int:
    total = 0
    for c in _get(pod, "spec", "containers", default=[]) or []:
        limits = _get(c, "resources", "limits", default={}) or {}
        try:
            total += int(limits.get(RESOURCE, 0))
        except (TypeError, ValueError):
            continue
    return total


CORE = "aliyun.com/gpu-core.percentage"


def pod_core(pod) -> int:
    """The compute percentage a pod asks (core_mem: the sum of its containers' limits), 0 for none."""
    total = 0
    for c in _get(pod, "spec", "containers", default=[]) or []:
        limits = _get(c, "resources", "limits", default={}) or {}
        try:
            total += int(limits.get(CORE, 0))
        except (TypeError, ValueError):
            continue
    return total


def pod_gpus(pod) -> list[int] | None:
    """The GPU indices a pod was placed on (None: not placed, or malformed)."""
    raw = (_get(pod, "metadata", "annotations", default={}) or {}).get(IDX)
    if not raw:
        return None
    try:
        idx = [int(x) for x in raw.split(",")]
    except ValueError:
        return None
    return idx if all(i >= 0 for i in idx) else None


def pod_placement(pod) -> str | None:
    """The pod's own placement (annotation PLACEMENT_ANNOTATION): "binpack", "spread", None when it
    names none; ValueError (its one-line reason) for anything else."""
    raw = (_get(pod, "metadata", "annotations", default={}) or {}).get(PLACEMENT_ANNOTATION)
    if raw is None:
        return None
    if raw not in ("binpack", "spread"):
        raise ValueError(f"{PLACEMENT_ANNOTATION} is {raw!r}: binpack or spread")
    return raw


def holds_gpu(pod) -> bool:
    phase = _get(pod, "status", "phase", default="Pending")
    return phase not in ("Succeeded", "Failed") and _get(pod, "metadata", "deletionTimestamp") is None


def used_units(node_name: str, pods, n_gpus: int) -> list[int]:
    """Units taken on each GPU of a node by its live pods that were placed."""
    used = [0] * n_gpus
    for pod in pods:
        if _get(pod, "spec", "nodeName") != node_name or not holds_gpu(pod):
            continue
        idx = pod_gpus(pod)
        units = pod_units(pod)
        if not idx or not units:
            continue
        for i in idx:
            if i < n_gpus:
                used[i] += units // len(idx)
    return used


def node_address(node) -> str:
    for a in _get(node, "status", "addresses", default=[]) or []:
        if _get(a, "type") == "InternalIP":
            return _get(a, "address", default="unknown")
    return "unknown"


def node_view(node, pods) -> dict:
    """One node in cgpud.observe.inspect's shape (summary, detail)."""
    name = _get(node, "metadata", "name")
    units = gpu_units(node)
    used = used_units(name, pods, len(units))
    gpus = [{"index": i, "allocated": used[i], "total": units[i]} for i in range(len(units))]
    insts = []
    for pod in pods:
        if _get(pod, "spec", "nodeName") != name or not holds_gpu(pod) or not pod_gpus(pod) or not pod_units(pod):
            continue
        idx = pod_gpus(pod)
        per = {str(i): pod_units(pod) // len(idx) for i in idx}
        insts.append({"name": _get(pod, "metadata", "name"), "namespace": _get(pod, "metadata", "namespace"),
                      "gpus": per, "allocated": sum(per.values()), "core": pod_core(pod)})
    allocated, total = sum(used), sum(units)
    return {"name": name, "ipaddress": node_address(node), "gpus": gpus, "allocated": allocated, "total": total,
            "percent": allocated * 100 // total if total else 0, "instances": insts}


def choose(units: list[int], used: list[int], need: int, count: int = 1, strategy: str = "binpack") -> list[int] | None:
    """`count` GPUs with need/count free units each, binpack (least free that fits) or spread; None if none."""
    if count < 1 or need % count or need <= 0:
        return None
    per = need // count
    fits = [i for i in range(len(units)) if units[i] - used[i] >= per]
    fits.sort(key=lambda i: ((units[i] - used[i]) if strategy != "spread" else -(units[i] - used[i]), i))
    return sorted(fits[:count]) if len(fits) >= count else None


def assume_annotations(gpus: list[int], units: int, dev_units: int) -> dict[str, str]:
    return {IDX: ",".join(map(str, gpus)), POD: str(units), DEV: str(dev_units), ASSIGNED: "false",
            ASSUME_TIME: str(time.time_ns())}
