"""What the API server serves of DRA, read from the server itself and not from its version string
(docs/kubernetes.md, DRA versions): a feature gate that is off, or a release that predates a field,
shows as the field dropped from what the server stores.

- `resource.k8s.io/v1` (DRA's structured parameters, GA in 1.34): not served, the plugin is refused
  in one line — the device plugin and extender are the way on such a cluster.
- `allowMultipleAllocations` and a capacity's request policy (DRAConsumableCapacity: alpha and off in
  1.34–1.35, beta and on since 1.36): the layout (one device per GPU whose memory claims share) needs
  them; dropped, the plugin is refused in one line naming the gate and the components to set it on.
- a device's taints (DRADeviceTaints: alpha and off until 1.35, beta in 1.36, GA in 1.37): dropped, the
  plugin says so once and leaves a GPU out of service out of its slices instead of tainting it.

The probe is one dry-run create (`dryRun=All`: validated and admitted, never stored) of a slice of the
node's own pool shaped as the plugin writes its slices, one device with all three."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from cgpud.k8s import dra
from cgpud.k8s.api import done

log = logging.getLogger("cgpud.k8s")

COMPONENTS = "kube-apiserver, kube-scheduler, kube-controller-manager and every kubelet"


class NotServed(Exception):
    """The API server cannot serve this driver; str() is the one line."""


@dataclass(frozen=True)
class Served:
    """What the API server keeps of what the plugin writes."""
    taints: bool = True  # device taints (DRADeviceTaints)


PROBE_UNIT = 1 << 30


def publishable(gpus: list[dra.Gpu], served: Served) -> list[dra.Gpu]:
    """The GPUs the node's slices carry: where the server drops device taints, a GPU out of service is
    left out (published untainted, new claims would be allocated on it)."""
    return [g for g in gpus if served.taints or g.taint is None]


def probe_slice(node: str, unit: int = PROBE_UNIT) -> dict:
    """A slice of `node`'s pool as the plugin writes them, one GPU out of service on it (so tainted).
    The GPU has two units: kube-apiserver refuses a request policy whose min plus one step is above the
    capacity (validateRequestPolicyRange, 1.34-1.37): a one-unit probe was refused with 422 on every
    release, and the plugin went on as if device taints were kept (found on 1.34.4's cluster tier)."""
    gpu = dra.Gpu(0, "GPU-00000000-0000-0000-0000-000000000000", "probe", 2 * unit, (dra.TAINT_XID, "0"))
    body = dra.resource_slices(node, [gpu], unit)[0]
    body["metadata"]["name"] = dra.slice_name(node, "probe")  # (never stored: dryRun)
    return body


def judge(sent: dict, stored: dict) -> Served:
    """What `stored` (the server's answer to the dry-run create of `sent`) says it serves; NotServed
    when it dropped what the layout needs."""
    want = dra.canonical(sent["spec"]["devices"][0])
    got = dra.canonical(((stored.get("spec") or {}).get("devices") or [{}])[0])
    policy = want["capacity"][dra.CAPACITY]["requestPolicy"]
    if not got.get("allowMultipleAllocations") or (got.get("capacity") or {}).get(dra.CAPACITY, {}).get(
            "requestPolicy") != policy:
        raise NotServed("the API server drops a ResourceSlice device's allowMultipleAllocations and request policy: "
                        "the feature gate DRAConsumableCapacity is off (alpha in Kubernetes 1.34-1.35: set "
                        f"--feature-gates=DRAConsumableCapacity=true on {COMPONENTS}; on by default since 1.36), "
                        "and claims cannot share a GPU's memory without it: turn it on, or use the device plugin "
                        "and extender on this cluster (docs/kubernetes.md, DRA versions)")
    return Served(taints=bool(got.get("taints")))


def probe(api_client, node: str) -> Served:
    """Ask the server (a kubernetes ApiClient) what it serves; NotServed when it cannot serve the plugin."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    resource = client.ResourceV1Api(api_client)
    try:
        done(resource.get_api_resources(_preload_content=False, _request_timeout=10))  # (GET /apis/resource.k8s.io/v1)
    except ApiException as exc:
        if exc.status == 404:
            raise NotServed("the API server does not serve resource.k8s.io/v1 (DRA, GA in Kubernetes 1.34): "
                            "use the device plugin and extender on this cluster (docs/kubernetes.md, DRA "
                            "versions)") from None
        raise
    sent = probe_slice(node)
    r = resource.create_resource_slice(sent, dry_run="All", _preload_content=False, _request_timeout=10)
    served = judge(sent, json.loads(r.data))
    if not served.taints:
        log.warning("the API server drops device taints (the feature gate DRADeviceTaints is off: alpha until "
                    "Kubernetes 1.35, set it on %s to have them): a GPU out of service is left out of the "
                    "node's ResourceSlices instead of tainted", COMPONENTS)
    return served
