"""Placement across nodes (issue 46; docs/kubernetes.md, "Placement across nodes"): the extender's
`prioritize` — kube-scheduler's extender v1 HostPriorityList, a score 0..10 per candidate node —
and the cluster's whole-GPU fragmentation that its /metrics exports.

binpack (the default): the node where the GPU(s) the bind would choose are fullest after the pod
wins — first a GPU already in use (the least left free after the pod), then a whole GPU of a node
already in use (the node with the fewest whole GPUs left), last a node wholly free (the one with the
fewest GPUs): whole GPUs and whole nodes stay free for pods that need them. spread: the node with
the most free after the pod (as a share of its GPUs), then its emptiest GPU. A pod asking a compute
percentage (core_mem) counts each GPU's free percentage before its free memory, both ways.

Scores are ranks, not distances: the best candidate 10 (the first, of equals), its equals 9, the
others 1..8 by rank, a node where the pod does not fit 0; kube-scheduler's weight on the extender
(deploy/kubernetes/scheduler/) decides what one step outweighs. kube-scheduler schedules the next
pod before it binds this one, so the pod is counted on its best node (State.nominate) until its
bind or its pod's watch event, at most NOMINATED_SECONDS: a burst's next pod sees it there.
"""
from __future__ import annotations

import json
import re
import time
from bisect import bisect_left

from cgpud.k8s import cluster, view
from cgpud.k8s.view import BadRequest, Node, State

MAX_PRIORITY = 10  # kube-scheduler's extenderv1.MaxExtenderPriority
# a node's name as the API server allows it (a DNS subdomain, RFC 1123): nothing in it to escape in JSON
NODE_NAME = re.compile(r"[a-z0-9.-]*")


def placement(pod: dict, default: str) -> str:
    """The pod's placement across nodes: its annotation, else the extender's --placement."""
    try:
        return cluster.pod_placement(pod) or default
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def pick(free: list[int], core_free: list[int], per: int, count: int, core: int, strategy: str) -> list[int] | None:
    """The `count` GPUs a pod of `per` units (and `core` % each) takes on a node whose GPUs have `free`
    units and `core_free` % left: binpack the least left (compute first for a core_mem pod), spread
    the most; lowest index on a tie. None if fewer fit."""
    fits = [i for i, f in enumerate(free) if f >= per and (not core or core_free[i] >= core)]
    if len(fits) < count:
        return None
    sign = -1 if strategy == "spread" else 1
    fits.sort(key=(lambda i: (sign * core_free[i], sign * free[i], i)) if core else (lambda i: (sign * free[i], i)))
    return sorted(fits[:count])


def choice(node: Node, per: int, count: int, core: int, within: str) -> tuple[int, ...] | None:
    """The GPU(s) the pod's bind would choose on the node (as pick, from the node's worked-out free)."""
    if count == 1 and not core:  # (the common pod, over thousands of nodes: a bisection, no list built)
        asc = node.asc
        at = len(asc) - 1 if within == "spread" else bisect_left(asc, per)
        return (node.free.index(asc[at]),) if 0 <= at < len(asc) and asc[at] >= per else None
    chosen = pick(node.free, node.core_free, per, count, core, within)
    return None if chosen is None else tuple(chosen)


def key(node: Node, per: int, count: int, core: int, within: str, across: str) -> tuple | None:
    """How good the node is for the pod (larger is better), from the GPU(s) its bind would choose
    there; None where it does not fit. (Under the state's lock, node.free worked out.)"""
    free, units, core_free = node.free, node.units, node.core_free
    if count == 1 and not core:  # (choice's, inline: the loop over thousands of nodes)
        asc = node.asc
        at = len(asc) - 1 if within == "spread" else bisect_left(asc, per)
        if at < 0 or at >= len(asc) or asc[at] < per:
            return None
        left = asc[at] - per  # units the GPU keeps free
        i = free.index(asc[at])
        opens = left + per == units[i] and core_free[i] == 100
    elif (gpus := choice(node, per, count, core, within)) is None:
        return None
    elif count == 1:
        i = gpus[0]
        left = free[i] - per + 1000 * (core_free[i] - core)  # (percentages first: 100 % > its units)
        opens = free[i] == units[i] and core_free[i] == 100
    else:
        left = sum(free[i] for i in gpus) - per * count
        if core:
            left += 1000 * sum(core_free[i] - core for i in gpus)  # (percentages first: 100 % > its units)
        opens = any(free[i] == units[i] and core_free[i] == 100 for i in gpus)
    if across == "spread":
        return (node.total_free - per * count) / node.total, left
    if not opens:
        return 2, -left, -node.whole
    if node.whole < node.serving:
        return 1, -node.whole, -left  # a whole GPU, of a node already in use
    return 0, -len(units), -left  # a node wholly free: the smallest


def ranked(keys: dict[str, tuple | None]) -> tuple[list[dict], str | None]:
    """HostPriorityList and the best node: the first with the best key MAX_PRIORITY, the others with it
    MAX_PRIORITY-1, the rest 1..MAX_PRIORITY-2 by rank, None 0."""
    distinct = sorted({k for k in keys.values() if k is not None})
    top = len(distinct) - 1
    rank = {k: MAX_PRIORITY - 1 if i == top else 1 + (MAX_PRIORITY - 3) * i // max(top - 1, 1)
            for i, k in enumerate(distinct)}
    rank[None] = 0
    best = next((name for name, k in keys.items() if k is not None and k == distinct[top]), None)
    out = [{"Host": name, "Score": rank[k]} for name, k in keys.items()]
    if best is not None:
        out[list(keys).index(best)]["Score"] = MAX_PRIORITY
    return out, best


def prioritize(state: State, args: dict) -> list[dict]:
    pod, names, _ = view.asked(args)
    need = cluster.pod_units(pod)
    if need <= 0:  # not ours to judge: no preference
        return [{"Host": n, "Score": 0} for n in names]
    count = view.gpu_count(pod)
    if need % count:
        return [{"Host": n, "Score": 0} for n in names]
    across = placement(pod, state.placement)
    own = cluster.pod_placement(pod)  # (valid now) on the node's GPUs too; else the node's label
    core, per = cluster.pod_core(pod), need // count
    keys: dict[str, tuple | None] = {}
    uid = (pod.get("metadata") or {}).get("uid")
    now = time.time()
    with state.lock:
        state.unnominate(uid)  # (asked again: where it was nominated before does not count for it)
        nodes, work_out = state.nodes, state.free_units
        for name in names:
            node = nodes.get(name)
            if node is None or not node.units:
                keys[name] = None
                continue
            if node.free is None or now >= node.until:
                work_out(node, now)
            keys[name] = key(node, per, count, core, own or node.strategy, across)
        scores, best = ranked(keys)
        if best is not None and uid:  # the pod counts there until its bind: the next pods see it
            node = nodes[best]
            state.nominate(uid, best, choice(node, per, count, core, own or node.strategy), per, core, now)
    return scores


def encode(scores: list[dict]) -> bytes:
    """HostPriorityList as JSON, written out: json.dumps took as long as prioritize's own work, on the
    scheduling cycle's path (one dict per candidate node). Names the API server would not allow, or a
    score that is not an int: json.dumps."""
    if not NODE_NAME.fullmatch("".join([s["Host"] for s in scores])) or \
            not all(type(s["Score"]) is int for s in scores):  # (not a bool either)
        return json.dumps(scores).encode()
    return ("[" + ",".join([f'{{"Host":"{s["Host"]}","Score":{s["Score"]}}}' for s in scores]) + "]").encode()


def fragmentation(state: State) -> dict[str, int]:
    """The cluster's GPUs (of nodes with gpu-mem) as the extender sees them: in service, whole (nothing
    on them), partly used (something on them and room left), the units free on those, whole nodes."""
    gpus = whole = partly = partly_free = nodes = whole_nodes = 0
    now = time.time()
    with state.lock:
        for node in state.nodes.values():
            if not node.units:
                continue
            if node.free is None or now >= node.until:
                state.free_units(node, now)
            nodes += 1
            gpus += node.serving
            whole += node.whole
            whole_nodes += node.whole == len(node.units)  # (every GPU in service and whole)
            partly += node.partly
            partly_free += node.partly_free
    return {"gpus": gpus, "whole": whole, "partly_used": partly, "partly_used_free_units": partly_free,
            "nodes": nodes, "whole_nodes": whole_nodes}


METRICS = (  # (name, the fragmentation() key, help): gauges, docs/kubernetes.md
    ("cgpu_extender_gpus", "gpus", "GPUs in service on the cluster's gpu-mem nodes, as the extender sees them."),
    ("cgpu_extender_gpus_whole", "whole", "GPUs with nothing on them: what a whole-GPU pod can take."),
    ("cgpu_extender_gpus_partly_used", "partly_used", "GPUs with a pod on them and units left free."),
    ("cgpu_extender_partly_used_free_units", "partly_used_free_units",
     "aliyun.com/gpu-mem units free on partly used GPUs: room only shared pods can use."),
    ("cgpu_extender_nodes", "nodes", "Nodes with aliyun.com/gpu-mem."),
    ("cgpu_extender_nodes_whole", "whole_nodes",
     "Nodes whose GPUs are all in service and whole: what a pod asking a whole node can take."),
)


def exposition(state: State) -> bytes:
    """The Prometheus text of fragmentation(), read at scrape time."""
    from prometheus_client import generate_latest
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import CollectorRegistry

    class Fragments:
        def collect(self):
            now = fragmentation(state)
            for name, k, text in METRICS:
                yield GaugeMetricFamily(name, text, value=now[k])

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fragments())
    return generate_latest(registry)
