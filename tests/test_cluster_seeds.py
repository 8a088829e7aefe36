"""The seeds' manifests as written, on the device-plugin path (issue 47: the path the seeds' users
run, and Kubernetes 1.32-1.33's only one): test_cluster.py's node (cgpud on two simulated T4s, 14
units of 1 GiB each; the real kube-apiserver, kube-scheduler through the extender, kubelet on
containerd), shared with it. Only each manifest's image and command are this sandbox's (no registry
here: busybox printing its environment), with imagePullPolicy Never and a grace period of 1 s.

- Seed 000 (multi-GPU sharing): its Job -> 4 units on each of two GPUs.
- Seed 001 (NVIDIA MPS with ACK's GPU sharing): the node labelled ack.node.gpu.schedule=mps, the Job
  `mps-sample` (hostIPC, hostPID, aliyun.com/gpu-mem: 7) -> its pod Running, an MPS client of 7 of
  the T4's 14 units (docs/mps.md "Pods on an mps node"), its instance in cgpud's tree.
- Seed 004 (the 128 MiB unit): the node labelled ack.node.gpu.schedule=share (the nodes the seed
  allows the unit on), the StatefulSet `binpack` asking aliyun.com/gpu-mem: 16 -> Running with 16 of
  the node's 128 MiB units, 2 GiB, and no isolation (SPEC §3, §6; docs/kubernetes.md "A node's mode").

Each test removes what it made and takes the label off: the node is back in cgpu, 28 units of 1 GiB.
kube-controller-manager (the job and statefulset controllers) runs for this module only.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import NODE, wait_for
from conftest import SIM_T4_BYTES
from test_cluster import SHARED_CLUSTER, UNITS, cgpud, cluster, container_env, container_name, node, node_mode, \
    running  # noqa: F401  (the shared node)
from test_cluster_dra import SEED_004, job_pod, sandboxed, seed_000_job

pytestmark = pytest.mark.slow

MIB = 1 << 20
SHARE_UNIT = 128 * MIB
LABEL = "ack.node.gpu.schedule"
MPS_PIPE_DIR = "/var/run/nvidia-gpu/nvidia-mps"  # deploy/kubernetes/mps-control.yaml's host directories
MPS_SHM_DIR = "/var/run/nvidia-gpu/nvidia-mps-shm"

# Seed 001's Job (docs: "Langkah 5: Terapkan aplikasi"), its YAML as the seed writes it (the seed's text
# lost its line breaks; its words, values and comments are these, in this order).
SEED_001 = """
apiVersion: batch/v1
kind: Job
metadata:
  name: mps-sample
spec:
  parallelism: 1
  template:
    metadata:
      labels:
        app: mps-sample
    spec:
      hostIPC: true # Parameter ini diperlukan. Jika Anda tidak menentukan parameter ini, pod gagal dimulai.
      hostPID: true # Parameter ini opsional. Dalam contoh ini, parameter ini memungkinkan Anda melihat efek MPS dengan cara yang nyaman.
      containers:
      - name: mps-sample
        image: registry.cn-hangzhou.aliyuncs.com/ai-samples/gpushare-sample:tensorflow-1.5
        command:
        - python
        - tensorflow-sample-code/tfjob/docker/mnist/main.py
        - --max_steps=100000
        - --data_dir=tensorflow-sample-code/data
        resources:
          limits:
            aliyun.com/gpu-mem: 7 # Pod ini mengajukan 7 GiB memori GPU.
        workingDir: /root
      restartPolicy: Never
"""


@pytest.fixture(scope="module")
def controllers(cluster):
    """kube-controller-manager with the controllers the seeds' workloads need (a Job's and a
    StatefulSet's pods; the garbage collector for a foreground delete), stopped after the module:
    the shared node is left as it was."""
    cluster.start_controller_manager("job-controller,statefulset-controller,serviceaccount-controller,"
                                     "serviceaccount-token-controller,garbage-collector-controller")
    yield
    cluster.procs.pop("kube-controller-manager").stop()


def set_mode(cluster, value: str | None) -> None:
    cluster.kubectl("label", "node", NODE, f"{LABEL}={value}" if value else f"{LABEL}-", "--overwrite")


def per_device(cluster) -> str | None:
    return cluster.get("node", NODE)["metadata"].get("annotations", {}).get("cgpu.aliyun.com/gpu-mem-per-device")


def in_mode(cluster, mode: str, units: int) -> None:
    """The node in `mode` (the mode in force on it) with `units` per GPU, allocatable and published."""
    wait_for(lambda: node_mode(cluster)[0] == mode and per_device(cluster) == f"{units},{units}"
             and cluster.allocatable("aliyun.com/gpu-mem") == 2 * units, 90,
             f"the node in mode {mode} with {units} units a GPU", cluster.logs)


def back_in_cgpu(cluster) -> None:
    set_mode(cluster, None)
    in_mode(cluster, "cgpu", UNITS)


def test_seed_000_job_as_written_runs_with_4_of_14_units_on_each_of_two_gpus(cluster, cgpud, controllers):
    """Seed 000's Job as written (the pod label aliyun.com/gpu-count: "2", aliyun.com/gpu-mem: 8; no
    runtimeClassName): the extender puts it on both GPUs, its container has an instance of 4 units
    on each (test_cluster.py's seed 000 test makes a pod of that shape; this is the Job itself)."""
    cluster.create(seed_000_job())
    name = None
    try:
        pod = job_pod(cluster, "tensorflow-mnist-multigpu")
        assert pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] in ("0,1", "1,0"), pod["metadata"]
        name = container_name(pod)
        for gpu in (0, 1):
            assert name in cgpud.instances(gpu), (gpu, cgpud.instances(gpu))
            assert cgpud.value(f"{gpu}/{name}/memsize") == str(SIM_T4_BYTES * 4 // UNITS)
    finally:
        cluster.kubectl("delete", "job", "tensorflow-mnist-multigpu", "--cascade=foreground", "--wait=true",
                        "--timeout=60s", "--ignore-not-found", timeout=90)
    wait_for(lambda: name not in cgpud.instances(0) and name not in cgpud.instances(1), 30,
             "the instances to go with the Job", cluster.logs)


def test_seed_001_mps_job_runs_as_an_mps_client_of_7_units(cluster, cgpud, controllers):
    """The node labelled for MPS as the seed says (ack.node.gpu.schedule=mps); the MPS control
    daemon's host directories made as its DaemonSet makes them (DirectoryOrCreate), a file in the shm
    one; the Job as written -> its pod Running with hostIPC and hostPID; Allocate gave it the MPS
    limits of 7 of the T4's 14 units (SPEC §2's rule: 7/14 of 15109 MiB, 50 % of the threads), the pipe
    directory, and the control daemon's shm at /dev/shm (the file is there); cgpud's tree has its
    instance at that memsize (mps mode: placed as cgpu, the watchdog's limit on real GPUs)."""
    for d in (MPS_PIPE_DIR, MPS_SHM_DIR):
        cluster._mkdir_host(Path(d))  # (removed with the cluster when it made them)
    marker = Path(MPS_SHM_DIR) / "cgpud-seeds-shm"
    marker.write_text("the MPS control daemon's shm\n")
    job = sandboxed(SEED_001, f"env; ls /dev/shm {MPS_PIPE_DIR}; trap 'exit 0' TERM; while :; do sleep 1; done")
    name = gpu = None
    try:
        set_mode(cluster, "mps")
        in_mode(cluster, "mps", UNITS)
        cluster.create(job)
        pod = job_pod(cluster, "mps-sample")
        assert pod["spec"].get("hostIPC") is True and pod["spec"].get("hostPID") is True, pod["spec"]
        env = container_env(cluster, pod["metadata"]["name"])
        gpu, name = int(env["ALIYUN_COM_GPU_MEM_IDX"]), container_name(pod)
        memsize = SIM_T4_BYTES * 7 // UNITS
        assert env.get("ALIYUN_COM_GPU_MEM_CONTAINER") == "7" and env.get("ALIYUN_COM_GPU_MEM_DEV") == str(UNITS), env
        assert env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == f"0={memsize // MIB}M", env
        assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "50", env
        assert env.get("CUDA_MPS_PIPE_DIRECTORY") == MPS_PIPE_DIR, env
        log = cluster.kubectl("logs", pod["metadata"]["name"]).stdout
        assert marker.name in log.split(), log  # the host's MPS shm is the container's /dev/shm
        assert name in cgpud.instances(gpu), (name, cgpud.instances(gpu))
        assert cgpud.value(f"{gpu}/{name}/memsize") == str(memsize)
        assert name not in cgpud.instances(1 - gpu)
    finally:
        cluster.kubectl("delete", "job", "mps-sample", "--cascade=foreground", "--wait=true", "--timeout=60s",
                        "--ignore-not-found", timeout=90)
        marker.unlink(missing_ok=True)
        back_in_cgpu(cluster)
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go with the Job", cluster.logs)


def test_seed_004_statefulset_on_a_share_node_runs_with_16_units_of_128_mib(cluster, cgpud, controllers):
    """The node labelled ack.node.gpu.schedule=share, the nodes the seed allows the 128 MiB unit on (SPEC
    §3: the unit is 128 MiB where the node is in share mode): the plugin lists, publishes and counts the
    T4s in 128 MiB units (118 each) by itself; the StatefulSet as written (aliyun.com/gpu-mem: 16)
    -> Running with 16 of its GPU's 118 units, 2 GiB, and no isolation (CGPU_DISABLE=true: no instance
    in the tree, the share in its environment, docs/kubernetes.md). Labelled off: 28 units of 1 GiB
    again. (Before, the label left the plugin in 1 GiB units and 16 fitted on no GPU of 14.)"""
    units_128 = SIM_T4_BYTES // SHARE_UNIT
    name = None
    try:
        set_mode(cluster, "share")
        in_mode(cluster, "share", units_128)
        cluster.create(sandboxed(SEED_004))
        pod = cluster.wait_pod("binpack-0", running, 120, "Running")
        env = container_env(cluster, "binpack-0")
        assert (env.get("ALIYUN_COM_GPU_MEM_CONTAINER"), env.get("ALIYUN_COM_GPU_MEM_DEV")) == \
            ("16", str(units_128)), env
        assert 16 * SHARE_UNIT == 2 << 30  # the seed's 16 x 128 MiB = 2 GiB
        assert env.get("CGPU_DISABLE") == "true", env
        assert env.get("ALIYUN_COM_GPU_MEM_IDX") == pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"], env
        name = container_name(pod)
        assert name not in cgpud.instances(0) and name not in cgpud.instances(1)
    finally:
        cluster.kubectl("delete", "statefulset", "binpack", "--wait=true", "--ignore-not-found", timeout=90)
        cluster.delete_pod("binpack-0")
        back_in_cgpu(cluster)
    # and a pod asking 3 after it gets 3 GiB units again, with its instance
    cluster.create(cluster.pod("after-share", 3))
    try:
        pod = cluster.wait_pod("after-share", running, 90, "Running")
        gpu = int(pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
        assert cgpud.value(f"{gpu}/{container_name(pod)}/memsize") == str(SIM_T4_BYTES * 3 // UNITS)
    finally:
        cluster.delete_pod("after-share")


def test_nothing_the_seeds_made_is_left(cluster):
    for kind in ("jobs", "statefulsets", "pods"):
        items = json.loads(cluster.kubectl("get", kind, "-o", "json").stdout)["items"]
        assert not items, [i["metadata"]["name"] for i in items]
    assert LABEL not in cluster.get("node", NODE)["metadata"].get("labels", {})
