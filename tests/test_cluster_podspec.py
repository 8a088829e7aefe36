"""Issue 44's first channel on the cluster tier: a tenant's pod spec does not set its own isolation
(SPEC §2 "who sets them", §9; docs/security.md "The pod's spec"; cgpud/containers/allotted.py).

On the real kubelet and containerd (tests/cluster.py) with the device plugin and the extender (the
node test_cluster.py shares): a pod asking `aliyun.com/gpu-mem: 1` whose own `env` names a
contract variable — 12 units, CGPU_DISABLE, high priority, a weight — is not started, and says why
in its status; its NVIDIA_VISIBLE_DEVICES=all is narrowed to the GPU the kubelet allotted, and a pod
with no GPU resource sees none; a pod asking cgpud's resources under another RuntimeClass is
refused by the API server (deploy/kubernetes/runtimeclass-policy.yaml). On today's main each of
these is obeyed.
"""
from __future__ import annotations

import json

import pytest

from cluster import Cluster, node as cluster_node, node_fixtures, wait_for
from test_allotted import uuid_of
from test_cluster import SHARED_CLUSTER, container_env, container_name, memsize, running

pytestmark = pytest.mark.slow

node, cgpud, cluster = node_fixtures(SHARED_CLUSTER, lambda: cluster_node("sim:2xT4", ("--health-quiet", "2"),
                                                                        Cluster.deploy))


def with_env(pod: dict, **env: str) -> dict:
    pod["spec"]["containers"][0]["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return pod


def names(cgpud) -> set[str]:
    return set(cgpud.instances(0)) | set(cgpud.instances(1))


def refused_start(pod: dict, line: str) -> bool:
    """The container did not run, and the runtime's one line is in the pod's status."""
    status = pod.get("status", {})
    states = [c.get("state") or {} for c in status.get("containerStatuses") or ()]
    # (the pod's phase stays Running while the kubelet retries a container that fails to start)
    return bool(states) and not any("running" in st for st in states) and line in json.dumps(status)


@pytest.mark.parametrize("variable, value", [
    ("ALIYUN_COM_GPU_MEM_CONTAINER", "12"),  # 12 units promised for 1 asked
    ("CGPU_DISABLE", "true"),  # no instance at all, the GPU still visible
    ("ALIYUN_COM_GPU_HIGH_PRIO", "1"),
    ("ALIYUN_COM_GPU_SCHD_WEIGHT", "16"),  # (and policy 2 on the GPU)
])
def test_a_contract_variable_in_the_pods_env_is_never_obeyed(cluster, cgpud, variable, value):
    name = f"forge-{variable.lower().replace('_', '-')}"
    before = names(cgpud)
    cluster.create(with_env(cluster.pod(name, 1), **{variable: value}))
    try:
        line = f"{variable}={value} is set by the pod's spec or image"
        pod = cluster.wait_pod(name, lambda p: refused_start(p, line), 90, f"not started, saying {line!r}")
        assert not pod["status"].get("containerStatuses", [{}])[0].get("state", {}).get("running"), pod["status"]
        assert names(cgpud) == before, "no instance made for it"
    finally:
        cluster.delete_pod(name)


def test_the_pods_nvidia_visible_devices_is_narrowed_to_what_the_kubelet_allotted(cluster, cgpud):
    cluster.create(with_env(cluster.pod("gpus-all", 1), NVIDIA_VISIBLE_DEVICES="all"))
    bare = with_env(cluster.pod("gpus-none", 1), NVIDIA_VISIBLE_DEVICES="all")  # (no GPU resource at all)
    del bare["spec"]["containers"][0]["resources"]
    cluster.create(bare)
    try:
        pod = cluster.wait_pod("gpus-all", running, 90, "Running")
        gpu = int(pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
        env = container_env(cluster, "gpus-all")
        assert env.get("NVIDIA_VISIBLE_DEVICES") == uuid_of(cgpud, gpu), env
        name = container_name(pod)
        assert cgpud.value(f"{gpu}/{name}/memsize") == memsize(1), "managed with the unit it was allotted"
        cluster.wait_pod("gpus-none", running, 90, "Running")
        assert container_env(cluster, "gpus-none").get("NVIDIA_VISIBLE_DEVICES") == "void"
    finally:
        cluster.delete_pod("gpus-all")
        cluster.delete_pod("gpus-none")


def test_an_honest_pod_still_gets_exactly_its_units(cluster, cgpud):
    """The control: the same pod without forged variables runs with the unit it asked."""
    cluster.create(cluster.pod("honest-1", 1))
    try:
        pod = cluster.wait_pod("honest-1", running, 90, "Running")
        gpu = int(pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
        assert cgpud.value(f"{gpu}/{container_name(pod)}/memsize") == memsize(1)
    finally:
        cluster.delete_pod("honest-1")


def test_a_pod_asking_cgpuds_resources_under_another_runtime_class_is_refused_at_admission(cluster):
    cluster.create({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                    "handler": "runc"})  # (what GPU nodes have: NVIDIA's runtime, no cgpu-runtime)
    try:
        p = cluster.kubectl("create", "-f", "-", check=False,
                            stdin=json.dumps(cluster.pod("other-rc", 1, runtime_class="nvidia")))
        assert p.returncode != 0, "admitted"
        assert ("the pod asks for aliyun.com/gpu-mem and names runtimeClassName nvidia: cgpud isolates GPUs only "
                "under the runtime cgpu; name cgpu or no runtimeClassName") in p.stderr, p.stderr
        assert "cgpu-runtime-class" in p.stderr, p.stderr
        # an init container's ask counts too
        pod = cluster.pod("other-rc-init", 0, runtime_class="nvidia")
        pod["spec"]["initContainers"] = [{**pod["spec"]["containers"][0], "name": "init",
                                          "resources": {"limits": {"aliyun.com/gpu-mem": "1"}}}]
        del pod["spec"]["containers"][0]["resources"]
        p = cluster.kubectl("create", "-f", "-", check=False, stdin=json.dumps(pod))
        assert p.returncode != 0 and "asks for aliyun.com/gpu-mem" in p.stderr, p.stderr
        # a pod that asks for none of them may name any RuntimeClass
        free = cluster.pod("other-rc-free", 0, runtime_class="nvidia", command="sleep 3600")
        del free["spec"]["containers"][0]["resources"]
        cluster.create(free)
        cluster.delete_pod("other-rc-free", wait=False)
    finally:
        cluster.kubectl("delete", "runtimeclass", "nvidia", "--ignore-not-found", check=False)
    wait_for(lambda: not cluster.kubectl("get", "pod", "other-rc-free", check=False).stdout, 60, "the free pod gone")
