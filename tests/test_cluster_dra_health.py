"""GPU health in DRA mode on the cluster tier (issue 38): test_cluster_dra.py's node, shared with it
(real kube-apiserver, kube-scheduler, a kubelet with DRA on and containerd 2; cgpud on two simulated
H100s, GPU health's quiet time 2 s). A pod's GPU falls off the bus (Xid 79, lost) -> its devices in
the node's ResourceSlices carry the NoSchedule taint, the kubelet puts Unhealthy into the pod's status
(KEP-4680's allocatedResourcesStatus), a new claim is allocated
on the other GPU; the GPU answers again -> untainted, Healthy."""
from __future__ import annotations

import json

import pytest

from cluster import NODE, wait_for
from test_cluster_dra import (DRIVER, SHARED_CLUSTER, allocated_gpus, cgpud, claim_pod, cluster, delete,  # noqa: F401
                              make_claim, node, run_with_claim)

pytestmark = pytest.mark.slow


def taints(c, gpu: int) -> list[dict]:
    out = []
    for k in range(4):
        p = c.kubectl("get", "resourceslice", f"{NODE}-{DRIVER}-{k}", "-o", "json", check=False)
        if p.returncode == 0:
            out += [t for d in json.loads(p.stdout)["spec"].get("devices", [])
                    if d["name"] == f"gpu-{gpu}" or d["name"].startswith(f"gpu-{gpu}-unit-") for t in d.get("taints", [])]
    return out


def resource_health(c, pod: str) -> set[str]:
    st = c.get("pod", pod)["status"].get("containerStatuses") or [{}]
    return {r.get("health", "") for a in st[0].get("allocatedResourcesStatus") or [] for r in a.get("resources", [])}


def test_a_failed_gpu_is_tainted_and_unhealthy_in_the_pods_status_and_back_when_it_recovers(cluster, cgpud):
    _, gpu, _ = run_with_claim(cluster, "hlth-a", "3Gi")
    wait_for(lambda: resource_health(cluster, "hlth-a") == {"Healthy"}, 60, "Healthy in the pod's status",
             cluster.logs)
    faults = cgpud.state_dir / "sim-faults"
    faults.write_text(f"event {gpu} xid 79\nlost {gpu}\n")
    wait_for(lambda: taints(cluster, gpu), 60, "the GPU's devices tainted", cluster.logs)
    assert all(t["key"] == "cgpu.aliyun.com/gpu-lost" and t["effect"] == "NoSchedule" for t in taints(cluster, gpu))
    assert not taints(cluster, 1 - gpu)
    wait_for(lambda: resource_health(cluster, "hlth-a") == {"Unhealthy"}, 90, "Unhealthy in the pod's status",
             cluster.logs)
    # (the pod's status says why: what `kubectl get pod -o yaml` shows; kubectl 1.37's describe does not print it)
    msgs = [r.get("message", "") for a in cluster.get("pod", "hlth-a")["status"]["containerStatuses"][0]
            ["allocatedResourcesStatus"] for r in a["resources"]]
    assert any("out of service" in m for m in msgs), msgs
    _, other, _ = run_with_claim(cluster, "hlth-b", "3Gi")
    assert other == 1 - gpu
    faults.write_text(f"event {gpu} xid 79\n")
    wait_for(lambda: not taints(cluster, gpu), 60, "the taints gone", cluster.logs)
    wait_for(lambda: resource_health(cluster, "hlth-a") == {"Healthy"}, 90, "Healthy again", cluster.logs)
    delete(cluster, "hlth-a", "hlth-b")
