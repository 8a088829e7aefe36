"""GPU health in DRA mode on the cluster tier (issue 38): test_cluster_dra.py's node, shared with it
(real kube-apiserver, kube-scheduler, a kubelet with DRA on and containerd 2; cgpud on two simulated
H100s, GPU health's quiet time 2 s). A pod's GPU falls off the bus (Xid 79, lost) -> its devices in
the node's ResourceSlices carry the NoSchedule taint (left out of the slices where the API server
keeps no device taints: DRADeviceTaints off, 1.34-1.35), the kubelet puts Unhealthy into the pod's
status (KEP-4680's allocatedResourcesStatus), a new claim is allocated on the other GPU; the GPU
answers again -> untainted (published again), Healthy.

The pod's claim is shaped as its kubelet can report it (docs/kubernetes.md, DRA versions): the kubelet
of 1.34 finds a claim's devices for the pod's status only when the pod's entry has the claim's own
name, 1.35's only for a claim made from a ResourceClaimTemplate (it reads the claim's name from
pod.status.resourceClaimStatuses, which holds template claims only: kubernetes#140036); 1.36 and
later find both, and the test uses the plain shape (an entry `gpu` naming claim-<pod>) there."""
from __future__ import annotations

import json
import re

import pytest

from cluster import NODE, wait_for
from test_cluster import running
from test_cluster_dra import (DRIVER, SHARED_CLUSTER, allocated_gpus, cgpud, claim_pod, claim_spec, cluster,  # noqa: F401
                              delete, make_claim, node, run_with_claim)

pytestmark = pytest.mark.slow


def gpu_devices(c, gpu: int) -> list[dict]:
    """The node's published devices of GPU `gpu` (over its slices)."""
    out = []
    for k in range(4):
        p = c.kubectl("get", "resourceslice", f"{NODE}-{DRIVER}-{k}", "-o", "json", check=False)
        if p.returncode == 0:
            out += [d for d in json.loads(p.stdout)["spec"].get("devices", [])
                    if d["name"] == f"gpu-{gpu}" or d["name"].startswith(f"gpu-{gpu}-unit-")]
    return out


def taints(c, gpu: int) -> list[dict]:
    return [t for d in gpu_devices(c, gpu) for t in d.get("taints", [])]


def devices(c, gpu: int) -> list[str]:
    return [d["name"] for d in gpu_devices(c, gpu)]


def keeps_taints(c) -> bool:
    """What the plugin found the API server keeps (its one line at start: draplugin.py)."""
    log = wait_for(lambda: re.search(r"shared devices(, device taints| \(no device taints\))",
                                     c.procs["dra-plugin"].log_path.read_text()), 60, "the plugin's line", c.logs)
    return log.group(1) == ", device taints"


def run_reported(c, pod: str, memory: str) -> tuple[int, str]:
    """A pod with a claim of `memory` shaped as its release's kubelet reports health for (above),
    Running: (its GPU, its claim's name)."""
    release = c.release[:2]
    if release == (1, 35):
        c.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                  "metadata": {"name": f"tmpl-{pod}"}, "spec": {"spec": claim_spec(memory)}})
        c.create(claim_pod(pod, f"tmpl-{pod}", template=True))
    else:
        make_claim(c, f"claim-{pod}", memory)
        c.create(claim_pod(pod, f"claim-{pod}", entry=f"claim-{pod}" if release == (1, 34) else "gpu"))
    got = c.wait_pod(pod, running, 90, "Running")
    names = [s["resourceClaimName"] for s in got["status"].get("resourceClaimStatuses") or []]
    claim = names[0] if names else f"claim-{pod}"
    return allocated_gpus(c, claim)[0], claim


def resource_health(c, pod: str) -> set[str]:
    st = c.get("pod", pod)["status"].get("containerStatuses") or [{}]
    return {r.get("health", "") for a in st[0].get("allocatedResourcesStatus") or [] for r in a.get("resources", [])}


def test_a_failed_gpu_is_tainted_and_unhealthy_in_the_pods_status_and_back_when_it_recovers(cluster, cgpud):
    tainted = keeps_taints(cluster)
    gpu, _ = run_reported(cluster, "hlth-a", "3Gi")
    wait_for(lambda: resource_health(cluster, "hlth-a") == {"Healthy"}, 60, "Healthy in the pod's status",
             cluster.logs)
    assert devices(cluster, gpu) and not taints(cluster, gpu)
    faults = cgpud.state_dir / "sim-faults"
    faults.write_text(f"event {gpu} xid 79\nlost {gpu}\n")
    if tainted:
        wait_for(lambda: taints(cluster, gpu), 60, "the GPU's devices tainted", cluster.logs)
        assert all(t["key"] == "cgpu.aliyun.com/gpu-lost" and t["effect"] == "NoSchedule" for t in taints(cluster, gpu))
    else:  # (published untainted, new claims would be allocated on it)
        wait_for(lambda: not devices(cluster, gpu), 60, "the GPU's devices left out of the slices", cluster.logs)
    assert not taints(cluster, 1 - gpu) and devices(cluster, 1 - gpu)
    wait_for(lambda: resource_health(cluster, "hlth-a") == {"Unhealthy"}, 90, "Unhealthy in the pod's status",
             cluster.logs)
    # (the pod's status says why: what `kubectl get pod -o yaml` shows; kubectl 1.37's describe does not print it)
    msgs = [r.get("message", "") for a in cluster.get("pod", "hlth-a")["status"]["containerStatuses"][0]
            ["allocatedResourcesStatus"] for r in a["resources"]]
    if cluster.release[:2] >= (1, 36):  # (ResourceHealthStatusMessage: the kubelets before drop the message)
        assert any("out of service" in m for m in msgs), msgs
    _, other, _ = run_with_claim(cluster, "hlth-b", "3Gi")
    assert other == 1 - gpu
    faults.write_text(f"event {gpu} xid 79\n")
    if tainted:
        wait_for(lambda: not taints(cluster, gpu), 60, "the taints gone", cluster.logs)
    else:
        wait_for(lambda: devices(cluster, gpu), 60, "the GPU's devices published again", cluster.logs)
    wait_for(lambda: resource_health(cluster, "hlth-a") == {"Healthy"}, 90, "Healthy again", cluster.logs)
    delete(cluster, "hlth-a", "hlth-b")
    cluster.kubectl("delete", "resourceclaimtemplate", "tmpl-hlth-a", "--ignore-not-found", "--wait=true", timeout=90)
