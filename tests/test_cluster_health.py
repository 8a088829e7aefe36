"""GPU health on the cluster tier (issue 38; tests/cluster.py: real kube-apiserver, kube-scheduler
with the shipped extender configuration, kubelet on containerd): test_cluster.py's node, shared with
it (cgpud on two simulated T4s, 14 units each, GPU health's quiet time 2 s). Xid 79 on GPU 1 (and the
GPU lost) -> its 14 units leave the node's allocatable (the kubelet counts only Healthy devices), a
new pod is not placed on it; the GPU answers again -> after the quiet time (2 s) the node has its 28
units back and the pod that fitted nowhere is placed on GPU 1."""
from __future__ import annotations

import pytest

from cluster import NODE, wait_for
from test_cluster import SHARED_CLUSTER, cgpud, cluster, node, wait_events  # noqa: F401  (the shared node)

pytestmark = pytest.mark.slow

UNITS = 14


def test_xid_79_takes_the_gpus_units_out_of_the_node_and_nothing_is_placed_there_until_it_is_back(cluster, cgpud):
    wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == 2 * UNITS, 60, "the node's units", cluster.logs)
    faults = cgpud.state_dir / "sim-faults"
    faults.write_text("event 1 xid 79\nlost 1\n")
    wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == UNITS, 60, "GPU 1's units Unhealthy", cluster.logs)
    node = cluster.get("node", NODE)
    assert node["metadata"]["annotations"].get("cgpu.aliyun.com/gpu-unhealthy") == "1"
    # 10 units fit on GPU 0 only; a second 10 nowhere (GPU 0 has 4 left, GPU 1 is out of service)
    cluster.create(cluster.pod("health-a", 10, runtime_class=None))
    pod = cluster.wait_pod("health-a", lambda p: p["spec"].get("nodeName") == NODE, 60, "bound")
    assert pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    cluster.create(cluster.pod("health-b", 10, runtime_class=None))
    events = wait_events(cluster, "health-b", "FailedScheduling")
    # (the scheduler's own fit sees the node's 4 Healthy units left; the extender says GPU1 out of service)
    assert "GPU1 out of service" in events or "Insufficient aliyun.com/gpu-mem" in events, events
    assert not cluster.get("pod", "health-b")["spec"].get("nodeName")
    # reset: GPU 1 answers again; after the quiet time its units are back and health-b goes there
    faults.write_text("event 1 xid 79\n")
    wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == 2 * UNITS, 60, "GPU 1's units Healthy",
             cluster.logs)
    pod = cluster.wait_pod("health-b", lambda p: p["spec"].get("nodeName") == NODE, 120, "bound once GPU 1 is back")
    assert pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    # gone, with their instances, before the next test looks (since issue 47 a pod without runtimeClassName
    # runs through cgpu-runtime on this node, as on an installed one: these two have instances)
    for name in ("health-a", "health-b"):
        cluster.delete_pod(name)
    wait_for(lambda: not cgpud.instances(0) and not cgpud.instances(1), 30, "their instances to go", cluster.logs)
