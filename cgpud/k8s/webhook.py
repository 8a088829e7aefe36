"""What `cgpu dra-webhook` decides (docs/kubernetes.md, DRA mode). Pure: an AdmissionReview's pod
in, a JSONPatch and the ResourceClaimTemplates it names out, or Denied saying why;
cgpud.k8s.webhookserver does the I/O.

A pod whose containers ask `aliyun.com/gpu-mem: N` (the seeds' manifests, unchanged) loses its
gpu-mem (limits and requests) at CREATE and gets one claim, `cgpu-gpu-mem`, from a template of
the pod's namespace that asks the memory as capacity of the node's GPU devices (one device per
GPU, `memory` shared by claims: docs/decisions.md). Every alternative of a request is one of the
node units a node may publish (the slices' attribute memoryUnit decides, as the node's unit does
for the extender):

    firstAvailable:
      - {name: unit-1gi,   count: M, memory: N/M GiB,       selectors: [memoryUnit == 1 GiB]}
      - {name: unit-128mi, count: M, memory: N/M × 128 MiB, selectors: [memoryUnit == 128 MiB]}

- Without the label `aliyun.com/gpu-count` (or with 0 or 1): one request per container that
  asks (`c-<i>`, `init-<i>`; a single one is `gpu`), each N of one GPU, all on the same GPU
  (`matchAttribute: uuid`), as gpushare puts a pod on one GPU. Template
  `cgpu-gpu-mem-<N>x1` (one container), else named by the containers' units.
- With `aliyun.com/gpu-count: M` (M ≥ 2, seed 000): N/M on each of M distinct GPUs
  (`distinctAttribute: uuid`: a GPU shared by claims could otherwise be given twice). One
  container of such a pod may ask gpu-mem (its GPUs are the pod's); N not a multiple of M is
  refused (each GPU gives the same units, as the extender's filter and Allocate have it).
  Template `cgpu-gpu-mem-<N>x<M>`.

Each alternative selects the devices of nodes whose mode gives memory to such a pod (the
device attribute `mode`, cgpud.k8s.dra): `cgpu`, `share` or `mps` for memory alone. A container
that asks `aliyun.com/gpu-core.percentage: P` too (mode core_mem) asks P of the GPU's second
capacity, `compute`, on `core_mem` devices only (memory-only and percentage pods never share a
node); P must be a whole multiple of 5 from 5 to 100, asked with gpu-mem, and a pod's containers
that ask GPU memory all ask a percentage or none (they go to one node). Templates
`cgpu-gpu-mem-<N>c<P>x<M>`. What is wrong is denied at CREATE with one line.
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
CORE = "aliyun.com/gpu-core.percentage"  # (cgpud.k8s.modes.CORE) core_mem's compute percentage
CORE_STEP = 5
MEMORY_MODES = ("cgpu", "share", "mps")  # the modes whose devices give memory alone (dra.devices)
TEMPLATE_PREFIX = "cgpu-gpu-mem-"
CLAIM = "cgpu-gpu-mem"  # the pod's claim
CLASS = "gpu.cgpu.aliyun.com"
UNITS = (("unit-1gi", GIB), ("unit-128mi", SHARE_UNIT))  # the units a node may publish (placement.unit_for)
MAX_COUNT = 32  # a claim's devices (the API's AllocationResultsMaxSize)
MANAGED_BY = "cgpu-dra-webhook"  # (a label value: no slash)
UUID = f"{dra.DRIVER}/uuid"  # the GPU devices' attribute that tells GPUs apart


class Denied(ValueError):
    """The pod cannot be admitted as asked; str() is the one line the API server returns."""


@dataclass
class Decision:
    """What to do with a pod: the JSONPatch (empty: admit unchanged) and the templates its claims
    name (made in the pod's namespace before it is admitted)."""

    patch: list[dict] = field(default_factory=list)
    templates: list[dict] = field(default_factory=list)


def template_name(n: int, m: int, percentage: int | None = None) -> str:
    return f"{TEMPLATE_PREFIX}{n}" + (f"c{percentage}" if percentage is not None else "") + f"x{m}"


MAX_NAME = 253  # a ResourceClaimTemplate's name: a DNS subdomain, of labels of 63 at most


def shape_name(shape: list[tuple], m: int) -> str:
    """The template's name for a pod's shape: (request, units[, percentage]) of each container that
    asks. It says the units (quota.template_units reads them back: the quota of the pods the webhook
    rewrote is counted from it), so it is never hashed (issue 44: a hashed name counted 0): past 63
    characters it is cut into labels of 63 at dashes, made dots; past 253 the pod is refused."""
    shape = [(x[0], x[1], x[2] if len(x) > 2 else None) for x in shape]
    if len(shape) == 1:
        return template_name(shape[0][1], m, shape[0][2])
    name = f"{TEMPLATE_PREFIX}{'-'.join(f'{r}u{n}' + (f'c{p}' if p is not None else '') for r, n, p in shape)}x{m}"
    labels = [""]
    for token in name.split("-"):  # (labels of at most 63, cut at a dash, which becomes the dot)
        if labels[-1] and len(labels[-1]) + 1 + len(token) > 63:
            labels.append(token)
        else:
            labels[-1] = f"{labels[-1]}-{token}" if labels[-1] else token
    dotted = ".".join(labels)
    if len(dotted) > MAX_NAME:
        raise Denied(f"{len(shape)} containers ask {RESOURCE}: more than one claim's name can say "
                     f"(the template's name, {len(name)} characters, must say each one's units in {MAX_NAME}); "
                     "ask it in fewer containers")
    return dotted


def mode_selector(percentage: int | None) -> str:
    """The CEL that keeps a request to the devices of nodes whose mode serves it: core_mem for a
    percentage, the memory modes else (a device of a plugin before modes says no mode: cgpu's)."""
    attrs = f'device.attributes["{dra.DRIVER}"]'
    if percentage is not None:
        return f'"mode" in {attrs} && {attrs}.mode == "core_mem"'
    return f'!("mode" in {attrs}) || {attrs}.mode in {json.dumps(list(MEMORY_MODES))}'


def _request(name: str, per: int, m: int, percentage: int | None = None) -> dict:
    def requests(unit: int) -> dict:
        out = {dra.CAPACITY: str(per * unit)}
        if percentage is not None:
            out[dra.COMPUTE] = str(percentage)
        return out

    return {"name": name, "firstAvailable": [
        {"name": alt, "deviceClassName": CLASS, "allocationMode": "ExactCount", "count": m,
         "capacity": {"requests": requests(unit)},
         "selectors": [{"cel": {"expression": f'device.attributes["{dra.DRIVER}"].memoryUnit == {unit}'}},
                       {"cel": {"expression": mode_selector(percentage)}}]}
        for alt, unit in UNITS]}


def pod_template(namespace: str, shape: list[tuple], m: int) -> dict:
    """The ResourceClaimTemplate of a pod's shape over M GPUs: a request per container that asks
    (N/M of a node's units on each of M GPUs, the first alternative that the node has), its
    GPUs distinct, and the requests of several containers on one GPU."""
    shape = [(x[0], x[1], x[2] if len(x) > 2 else None) for x in shape]
    requests = [r for r, _, _ in shape]
    constraints = []
    if m >= 2:
        constraints.append({"requests": requests, "distinctAttribute": UUID})
    if len(shape) > 1:
        constraints.append({"requests": requests, "matchAttribute": UUID})
    devices: dict = {"requests": [_request(r, n // m, m, p) for r, n, p in shape]}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": shape_name(shape, m), "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {"spec": {"devices": devices}},
    }


def _differs(ours, theirs, where: str) -> str | None:
    """Where `theirs` says more or other than `ours` (a key of theirs that ours lacks is taken only
    when it is empty or false: what the API server may default)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for k, v in ours.items():
            if (why := _differs(v, theirs.get(k), f"{where}.{k}")) is not None:
                return why
        extra = [k for k, v in theirs.items() if k not in ours and v not in (None, False, [], {}, "")]
        return f"{where}.{extra[0]} is not the webhook's" if extra else None
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if (why := _differs(a, b, f"{where}[{i}]")) is not None:
                return why
        return None
    return None if ours == theirs else f"{where} is {json.dumps(theirs)[:80]}, not {json.dumps(ours)[:80]}"


def not_ours(made: dict, found: dict) -> str | None:
    """Why a ResourceClaimTemplate found under the name of one the webhook makes (`made`) is not
    what the webhook makes (a tenant's by hand, asking more than the name says), or None."""
    return _differs(made.get("spec"), _obj(found).get("spec"), "spec")


def template(namespace: str, n: int, m: int, percentage: int | None = None) -> dict:
    """The template of one container's N units over M GPUs (and P percent of each one's compute)."""
    return pod_template(namespace, [("gpu", n, percentage)], m)


def _obj(x) -> dict:
    return x if isinstance(x, dict) else {}


def _count(pod: dict) -> int:
    raw = _obj(_obj(pod.get("metadata")).get("labels")).get(LABEL)
    if raw is None:
        return 1
    if not re.fullmatch(r"[0-9]{1,6}", str(raw)):
        raise Denied(f"label {LABEL}: {raw!r} is not a whole number of GPUs")
    m = int(raw)
    if m > MAX_COUNT:
        raise Denied(f"label {LABEL}: {m} GPUs is more than a claim can hold ({MAX_COUNT})")
    return max(m, 1)


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


def percentage(container: dict, where: str) -> int | None:
    """The container's compute percentage (limits, else requests; both must agree), None if it asks
    none; Denied unless a whole multiple of 5 from 5 to 100 (core_mem's 20 slots of 5 %)."""
    res = _obj(container.get("resources"))
    asked = {k: _obj(res.get(k)).get(CORE) for k in ("limits", "requests")}
    asked = {k: v for k, v in asked.items() if v is not None}
    rule = f"give a whole multiple of {CORE_STEP} from {CORE_STEP} to 100"
    for k, v in asked.items():
        if not re.fullmatch(r"[0-9]{1,9}", str(v)):
            raise Denied(f"{where}: {k} {CORE} {v!r} is not a whole number: {rule}")
        p = int(v)
        if not CORE_STEP <= p <= 100 or p % CORE_STEP:
            raise Denied(f"{where}: {k} {CORE} {p} is not a percentage core_mem gives: {rule}")
    values = {int(v) for v in asked.values()}
    if len(values) > 1:
        raise Denied(f"{where}: {CORE} differs between limits ({asked['limits']}) and requests ({asked['requests']})")
    return values.pop() if values else None


def mutate(pod: dict, namespace: str) -> Decision:
    """The decision for a pod at CREATE, or Denied."""
    if not isinstance(pod, dict) or not isinstance(pod.get("spec"), dict):
        raise Denied("the request holds no pod")
    m = _count(pod)
    spec = pod["spec"]
    if not isinstance(spec.get("resourceClaims") or [], list):
        raise Denied("spec.resourceClaims is not a list")
    asking: list[tuple[str, int, dict, str, int, int | None]] = []  # (kind, index, container, where, units, %)
    for kind in ("initContainers", "containers"):
        items = spec.get(kind) or []
        if not isinstance(items, list):
            raise Denied(f"spec.{kind} is not a list")
        for i, c in enumerate(items):
            if not isinstance(c, dict):
                raise Denied(f"spec.{kind}[{i}] is not an object")
            where = f"container {c.get('name') or i}"
            n = _units(c, where)
            p = percentage(c, where)
            if n == 0 and p is not None:
                raise Denied(f"{where}: {CORE} {p} without {RESOURCE}: a core_mem node gives GPU memory and a "
                             f"compute percentage together; ask {RESOURCE} too")
            if n == 0:
                continue
            if n % m:
                raise Denied(f"{where}: {RESOURCE} {n} cannot be spread over {LABEL} {m}: each GPU gives the same "
                             f"memory, so N/M must be a whole number of units ({n}/{m} is not)")
            res = c.get("resources")
            if not isinstance(res.get("claims") or [], list):
                raise Denied(f"{where}: resources.claims is not a list")
            asking.append((kind, i, c, where, n, p))
    if not asking:
        return Decision()
    if len({p is None for *_, p in asking}) > 1:
        raise Denied(f"containers {', '.join(w.split(' ', 1)[1] for _, _, _, w, _, p in asking if p is None)} ask "
                     f"{RESOURCE} without {CORE} and others with it: memory-only and percentage containers never "
                     "share a node (core_mem); ask a percentage in each or in none")
    if m >= 2 and len(asking) > 1:
        raise Denied(f"label {LABEL}: {len(asking)} containers ask {RESOURCE} "
                     f"({', '.join(w.split(' ', 1)[1] for _, _, _, w, _, _ in asking)}): the pod's {m} GPUs are given to "
                     f"one container; ask {RESOURCE} in one of them")
    taken = {c.get("name") for c in spec.get("resourceClaims") or () if isinstance(c, dict)}
    if CLAIM in taken:
        raise Denied(f"the pod already has a claim named {CLAIM}")
    if len(asking) == 1:
        shape = [("gpu", asking[0][4], asking[0][5])]
    else:
        shape = [(f"{'init' if kind == 'initContainers' else 'c'}-{i}", n, p) for kind, i, _, _, n, p in asking]
    t = pod_template(namespace, shape, m)
    out = Decision(templates=[t])
    key = RESOURCE.replace("~", "~0").replace("/", "~1")
    core_key = CORE.replace("~", "~0").replace("/", "~1")
    for (kind, i, c, _, _, _), (request, _, _) in zip(asking, shape):
        base = f"/spec/{kind}/{i}/resources"
        res = c["resources"]
        for part in ("limits", "requests"):
            for name, k in ((RESOURCE, key), (CORE, core_key)):
                if name in _obj(res.get(part)):
                    out.patch.append({"op": "remove", "path": f"{base}/{part}/{k}"})
        ref = {"name": CLAIM} if len(shape) == 1 else {"name": CLAIM, "request": request}
        if res.get("claims"):
            out.patch.append({"op": "add", "path": f"{base}/claims/-", "value": ref})
        else:
            out.patch.append({"op": "add", "path": f"{base}/claims", "value": [ref]})
    claim = {"name": CLAIM, "resourceClaimTemplateName": t["metadata"]["name"]}
    if spec.get("resourceClaims"):
        out.patch.append({"op": "add", "path": "/spec/resourceClaims/-", "value": claim})
    else:
        out.patch.append({"op": "add", "path": "/spec/resourceClaims", "value": [claim]})
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
