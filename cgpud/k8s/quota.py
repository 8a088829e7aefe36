"""The GPU-memory quota of the pods the DRA webhook rewrites (docs/security.md, "The cluster").

The webhook takes `aliyun.com/gpu-mem` off a labelled pod and gives it claims instead, so the
namespace's ResourceQuota `requests.aliyun.com/gpu-mem` (evaluated by the API server after the
mutating webhooks) no longer sees it. The webhook therefore does the quota's sum itself before it
rewrites a pod: the units of every pod of the namespace that is not finished — a pod's own
`aliyun.com/gpu-mem` as the quota counts it, plus, for a pod the webhook rewrote, the units its
claims' templates name (`cgpu-gpu-mem-<N>x<M>`: N; a pod's `spec.resourceClaims` cannot change
after CREATE, so a tenant cannot hide them) — plus the pods it admitted itself a moment ago that
a LIST may not show yet; the pod is refused, with one line, when that plus its own units passes
a quota's `hard`. Pure: the I/O is cgpud.k8s.webhookserver's.

Races (said in docs/security.md): one webhook process checks and reserves under one lock, so its
admissions never pass the quota together; two replicas admitting pods of one namespace in the
same instant can each pass it once (as two API servers' quota admissions cannot, by the quota's
resourceVersion): the overshoot is at most one pod per replica per such instant.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal

from cgpud.k8s import webhook

RESOURCE = webhook.RESOURCE
KEY = f"requests.{RESOURCE}"  # the quota's name for it (extended resources are quota'd by requests only)
PENDING_S = 30.0  # how long an admitted pod is counted before a LIST must show it


def _obj(x) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x) -> list:
    return x if isinstance(x, list) else []


def quantity(v) -> Decimal | None:
    """A Kubernetes quantity ("8", "1k", "2Ki") as a number, None when it is not one."""
    from kubernetes.utils import parse_quantity

    try:
        return parse_quantity(v)
    except (ValueError, TypeError, ArithmeticError):
        return None


def _asked(container: dict) -> Decimal:
    res = _obj(_obj(container).get("resources"))
    for part in ("requests", "limits"):  # (a request defaults to the limit)
        v = _obj(res.get(part)).get(RESOURCE)
        if v is not None:
            return quantity(v) or Decimal(0)
    return Decimal(0)


def pod_units(pod: dict) -> Decimal:
    """The pod's `aliyun.com/gpu-mem` as ResourceQuota counts a pod's requests: the sum over its
    containers, or its largest init container's when that is more."""
    spec = _obj(_obj(pod).get("spec"))
    main = sum((_asked(c) for c in _list(spec.get("containers"))), Decimal(0))
    init = max((_asked(c) for c in _list(spec.get("initContainers"))), default=Decimal(0))
    return max(main, init)


def template_units(name: str) -> int:
    """The units a template of the webhook's names (webhook.shape_name): `<N>x<M>` (or `<N>c<P>x<M>`) is N, and
    `<r>u<n>-<r>u<n>…x<M>` the sum of the n (a long one cut into labels by dots); 0 for any other name."""
    name = name.replace(".", "-")  # (the dashes webhook.shape_name cut a long name at)
    if not name.startswith(webhook.TEMPLATE_PREFIX):
        return 0
    body, sep, m = name[len(webhook.TEMPLATE_PREFIX):].rpartition("x")
    if not sep or not m.isdigit():
        return 0
    whole = re.fullmatch(r"([0-9]{1,9})(?:c[0-9]{1,3})?", body)  # (`c<P>`: a percentage, core_mem)
    if whole:
        return int(whole[1])
    parts = \
        re.findall(r"(?:^|-)[a-z0-9]+?u([0-9]{1,9})(?:c[0-9]{1,3})?(?=-|$)", body)
    return sum(int(p) for p in parts)


def claimed_units(pod: dict) -> Decimal:
    """The units of the webhook's claims a pod holds (its templates' N), as the quota would have
    counted the gpu-mem they replaced."""
    spec = _obj(_obj(pod).get("spec"))
    return Decimal(sum(template_units(str(_obj(c).get("resourceClaimTemplateName") or ""))
                       for c in _list(spec.get("resourceClaims"))))


def counted(pod: dict) -> Decimal:
    """What a pod of the namespace counts against its GPU-memory quota (0 once it is finished)."""
    if _obj(_obj(pod).get("status")).get("phase") in ("Succeeded", "Failed"):
        return Decimal(0)
    return pod_units(pod) + claimed_units(pod)


def _best_effort(pod: dict) -> bool:
    spec = _obj(_obj(pod).get("spec"))
    for c in _list(spec.get("containers")) + _list(spec.get("initContainers")):
        res = _obj(_obj(c).get("resources"))
        if any(k in _obj(res.get(p)) for p in ("requests", "limits") for k in ("cpu", "memory")):
            return False
    return True


def applies(quota: dict, pod: dict) -> bool:
    """Whether a ResourceQuota's scopes take in the pod (Terminating, NotTerminating, BestEffort,
    NotBestEffort, PriorityClass; a scope not known here is taken to apply: counted, not missed)."""
    spec = _obj(_obj(quota).get("spec"))
    pspec = _obj(_obj(pod).get("spec"))
    terms = [{"scopeName": s, "operator": "Exists"} for s in _list(spec.get("scopes"))]
    terms += _list(_obj(spec.get("scopeSelector")).get("matchExpressions"))
    for t in terms:
        t = _obj(t)
        name, op, values = t.get("scopeName"), t.get("operator"), _list(t.get("values"))
        if name == "Terminating":
            ok = pspec.get("activeDeadlineSeconds") is not None
        elif name == "NotTerminating":
            ok = pspec.get("activeDeadlineSeconds") is None
        elif name == "BestEffort":
            ok = _best_effort(pod)
        elif name == "NotBestEffort":
            ok = not _best_effort(pod)
        elif name == "PriorityClass":
            pc = pspec.get("priorityClassName") or ""
            ok = {"In": pc in values, "NotIn": pc not in values, "Exists": bool(pc),
                  "DoesNotExist": not pc}.get(op, True)
        else:
            ok = True
        if not ok:
            return False
    return True


def hard(quota: dict) -> Decimal | None:
    return quantity(_obj(_obj(quota).get("spec")).get("hard", {}).get(KEY)) \
        if isinstance(_obj(_obj(quota).get("spec")).get("hard"), dict) else None


def _fmt(d: Decimal) -> str:
    return str(int(d)) if d == int(d) else str(d)


def refusal(quotas: list[dict], pods: list[dict], pod: dict, units: Decimal) -> str | None:
    """The one line refusing `pod` (asking `units`) when it would pass a quota of its namespace,
    counting `pods` (the namespace's, the webhook's reservations among them); None when it fits."""
    for q in quotas:
        limit = hard(q)
        if limit is None or not applies(q, pod):
            continue
        used = sum((counted(p) for p in pods if applies(q, p)), Decimal(0))
        if used + units > limit:
            name = _obj(q.get("metadata")).get("name")
            return (f"exceeded quota: {name}, requested: {KEY}={_fmt(units)}, used: {KEY}={_fmt(used)}, "
                    f"limited: {KEY}={_fmt(limit)} (a pod whose {RESOURCE} the webhook turns into claims counts "
                    "as before)")
    return None


@dataclass
class _Reserved:
    pod: dict  # the pod as the API server sent it (before the rewrite: its gpu-mem says its units)
    at: float  # time.time() of the admission
    until: float  # time.monotonic() after which it is no longer counted


@dataclass
class Ledger:
    """The pods this process admitted that a LIST may not show yet, by namespace, and the lock
    that makes one process's check-and-reserve a single step."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    reserved: dict[str, list[_Reserved]] = field(default_factory=dict)

    def with_reserved(self, namespace: str, listed: list[dict]) -> list[dict]:
        """`listed` plus this process's reservations in the namespace that no listed pod answers
        yet (a listed pod of the same name, or generateName, units and a creation time from the
        admission's second on, answers one). Call under `lock`."""
        now = time.monotonic()
        keep = [r for r in self.reserved.get(namespace, []) if r.until > now]
        left = list(keep)
        for p in listed:
            meta = _obj(p.get("metadata"))
            created = _created(meta.get("creationTimestamp"))
            for r in left:
                rm = _obj(r.pod.get("metadata"))
                same = (meta.get("name") == rm.get("name")) if rm.get("name") else \
                    (meta.get("generateName") == rm.get("generateName") and created is not None
                     and created >= int(r.at) - 1)
                if same and counted(p) == counted(r.pod):
                    left.remove(r)
                    keep.remove(r)  # (seen: counted by the LIST from now on)
                    break
        self.reserved[namespace] = keep
        return listed + [r.pod for r in left]

    def reserve(self, namespace: str, pod: dict) -> None:
        self.reserved.setdefault(namespace, []).append(_Reserved(pod, time.time(), time.monotonic() + PENDING_S))


def _created(ts) -> float | None:
    import calendar

    try:
        return float(calendar.timegm(time.strptime(str(ts), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None
