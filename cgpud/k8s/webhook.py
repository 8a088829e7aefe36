"""What `cgpu dra-webhook` decides (docs/kubernetes.md, DRA mode: seed 000's label). Pure: an
AdmissionReview's pod in, a JSONPatch and the ResourceClaimTemplates it names out, or Denied
saying why; cgpud.k8s.webhookserver does the I/O.

A pod with the label `aliyun.com/gpu-count: M` (M ≥ 2) whose containers ask
`aliyun.com/gpu-mem: N` wants N/M of the node's units on each of M GPUs of one node (seed
000; gpushare's extender does it from the same label). DRA's extended-resource mapping cannot
read a label, so at CREATE each such container loses its gpu-mem (limits and requests) and gets
a claim of its own from the template `cgpu-gpu-mem-<N>x<M>` of the pod's namespace, one
request of M devices of the class gpu.cgpu.aliyun.com each giving N/M units of memory:

    firstAvailable:                                  # the node's unit decides, as it does for
      - {name: unit-1gi, count: M, memory: N/M GiB,  #   the extender: a node publishes its unit
         selectors: [memoryUnit == 1 GiB]}           #   as the attribute memoryUnit
      - {name: unit-128mi, count: M, memory: N/M × 128 MiB, selectors: [memoryUnit == 128 MiB]}

N not a multiple of M is refused (the extender's filter passes no node for it and Allocate
refuses it: each GPU gives the same units). M of 0 or 1 is left to the extended-resource path.
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field

from cgpud.containers.request import GIB, SHARE_UNIT
from cgpud.k8s import cluster, dra

LABEL = cluster.COUNT  # the pod label seed 000 spreads its memory with
RESOURCE = cluster.RESOURCE
TEMPLATE_PREFIX = "cgpu-gpu-mem-"
CLAIM_PREFIX = "cgpu-gpu-mem-"  # the pod's claims: cgpu-gpu-mem-<i> (containers), -init-<i> (init containers)
UNITS = (("unit-1gi", GIB), ("unit-128mi", SHARE_UNIT))  # the units a node may publish (placement.unit_for)
MAX_COUNT = 32  # a claim's devices (the API's AllocationResultsMaxSize)
MANAGED_BY = "cgpu-dra-webhook"  # (a label value: no slash)


class Denied(ValueError):
    """The pod cannot be admitted as asked; str() is the one line the API server returns."""


@dataclass
class Decision:
    """What to do with a pod: the JSONPatch (empty: admit unchanged) and the templates its claims
    name (made in the pod's namespace before it is admitted)."""

    patch: list[dict] = field(default_factory=list)
    templates: list[dict] = field(default_factory=list)


def template_name(n: int, m: int) -> str:
    return f"{TEMPLATE_PREFIX}{n}x{m}"


def template(namespace: str, n: int, m: int) -> dict:
    """The ResourceClaimTemplate of N units over M GPUs: one request whose first alternative that a
    node has gives N/M of that node's units on each of M GPUs."""
    per = n // m
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(n, m), "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
            {"name": name, "deviceClassName": "gpu.cgpu.aliyun.com", "allocationMode": "ExactCount", "count": m,
             "capacity": {"requests": {dra.CAPACITY: str(per * unit)}},
             "selectors": [{"cel": {"expression": f'device.attributes["{dra.DRIVER}"].memoryUnit == {unit}'}}]}
            for name, unit in UNITS]}]}}},
    }


def _obj(x) -> dict:
    return x if isinstance(x, dict) else {}


def _count(pod: dict) -> int:
    raw = _obj(_obj(pod.get("metadata")).get("labels")).get(LABEL)
    if raw is None:
        return 0
    if not re.fullmatch(r"[0-9]{1,6}", str(raw)):
        raise Denied(f"label {LABEL}: {raw!r} is not a whole number of GPUs")
    m = int(raw)
    if m > MAX_COUNT:
        raise Denied(f"label {LABEL}: {m} GPUs is more than a claim can hold ({MAX_COUNT})")
    return m


def _units(container: dict, where: str) -> int:
    """The container's gpu-mem (limits, else requests; both must agree), 0 if it asks none."""
    res = _obj(container.get("resources"))
    asked = {k: _obj(res.get(k)).get(RESOURCE) for k in ("limits", "requests")}
    asked = {k: v for k, v in asked.items() if v is not None}
    for k, v in asked.items():
        if not re.fullmatch(r"[0-9]{1,9}", str(v)):
            raise Denied(f"{where}: {k} {RESOURCE} {v!r} is not a whole number of units")
    values = {int(v) for v in asked.values()}
    if len(values) > 1:
        raise Denied(f"{where}: {RESOURCE} differs between limits ({asked['limits']}) and requests "
                     f"({asked['requests']})")
    return values.pop() if values else 0


def mutate(pod: dict, namespace: str) -> Decision:
    """The decision for a pod at CREATE, or Denied."""
    if not isinstance(pod, dict) or not isinstance(pod.get("spec"), dict):
        raise Denied("the request holds no pod")
    m = _count(pod)
    if m < 2:
        return Decision()
    spec = pod["spec"]
    if not isinstance(spec.get("resourceClaims") or [], list):
        raise Denied("spec.resourceClaims is not a list")
    taken = {c.get("name") for c in spec.get("resourceClaims") or () if isinstance(c, dict)}
    out = Decision()
    claims: list[dict] = []
    made: set[str] = set()
    for kind, prefix in (("containers", CLAIM_PREFIX), ("initContainers", f"{CLAIM_PREFIX}init-")):
        items = spec.get(kind) or []
        if not isinstance(items, list):
            raise Denied(f"spec.{kind} is not a list")
        for i, c in enumerate(items):
            if not isinstance(c, dict):
                raise Denied(f"spec.{kind}[{i}] is not an object")
            where = f"container {c.get('name') or i}"
            n = _units(c, where)
            if n == 0:
                continue
            if n % m:
                raise Denied(f"{where}: {RESOURCE} {n} cannot be spread over {LABEL} {m}: each GPU gives the same "
                             f"memory, so N/M must be a whole number of units ({n}/{m} is not)")
            claim = f"{prefix}{i}"
            if claim in taken:
                raise Denied(f"{where}: the pod already has a claim named {claim}")
            name = template_name(n, m)
            if name not in made:
                made.add(name)
                out.templates.append(template(namespace, n, m))
            claims.append({"name": claim, "resourceClaimTemplateName": name})
            base = f"/spec/{kind}/{i}/resources"
            res = c["resources"]
            key = RESOURCE.replace("~", "~0").replace("/", "~1")
            for part in ("limits", "requests"):
                if RESOURCE in _obj(res.get(part)):
                    out.patch.append({"op": "remove", "path": f"{base}/{part}/{key}"})
            if not isinstance(res.get("claims") or [], list):
                raise Denied(f"{where}: resources.claims is not a list")
            if res.get("claims"):
                out.patch.append({"op": "add", "path": f"{base}/claims/-", "value": {"name": claim}})
            else:
                out.patch.append({"op": "add", "path": f"{base}/claims", "value": [{"name": claim}]})
    if not claims:
        return Decision()
    if spec.get("resourceClaims"):
        out.patch += [{"op": "add", "path": "/spec/resourceClaims/-", "value": c} for c in claims]
    else:
        out.patch.append({"op": "add", "path": "/spec/resourceClaims", "value": claims})
    return out


def request_of(review) -> dict:
    """The AdmissionReview's request, or Denied."""
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview" \
            or not isinstance(review.get("request"), dict) or not review["request"].get("uid"):
        raise Denied("not an AdmissionReview with a request")
    return review["request"]


def decide(request: dict) -> Decision:
    """An admission request → the decision (only pods at CREATE change), or Denied."""
    kind = request.get("kind") or {}
    if request.get("operation") != "CREATE" or kind.get("kind") != "Pod" or kind.get("group"):
        return Decision()
    return mutate(request.get("object"), request.get("namespace") or "default")


def response(request: dict, decision: Decision | None = None, denied: str | None = None) -> dict:
    """The AdmissionReview answer: the patch, or the denial's one line."""
    answer: dict = {"uid": request.get("uid", ""), "allowed": denied is None}
    if denied is not None:
        answer["status"] = {"code": 403, "reason": "Forbidden", "message": denied}
    elif decision is not None and decision.patch:
        answer["patchType"] = "JSONPatch"
        answer["patch"] = base64.b64encode(json.dumps(decision.patch).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer}
