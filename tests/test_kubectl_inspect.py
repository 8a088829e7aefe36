"""`kubectl inspect cgpu [-d]` through the real kubectl binary, which finds
the `kubectl-inspect-cgpu` plugin on PATH, against an API server stand-in
(tests/apiserver_standin.py) read with the official kubernetes client."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from apiserver_standin import ApiServer

BIN = Path(sys.executable).parent


@pytest.fixture
def api(tmp_path):
    a = ApiServer(tmp_path)
    yield a
    a.close()


def kubectl(api: ApiServer, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.fail("kubectl is missing: scripts/setup.sh installs kubernetes-client")
    env = dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig), PATH=f"{BIN}:{os.environ['PATH']}")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=60)


def cluster(api: ApiServer) -> None:
    """Seed 000's shape: a T4 node and a node with two GPUs of different sizes."""
    api.add_node("cn-beijing.192.168.0.4", gpus=1, units=15, ip="192.168.0.4")
    api.add_node("cn-beijing.192.168.0.5", gpus=2, units=37, per_device="15,22", ip="192.168.0.5")
    api.add_node("cpu-only", ip="192.168.0.6")
    api.add_pod("binpack-1", [6], node="cn-beijing.192.168.0.4", phase="Running",
                annotations={"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"})
    api.add_pod("binpack-2", [3, 2], node="cn-beijing.192.168.0.5", ns="ml", phase="Running",
                annotations={"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"})
    api.add_pod("finished", [4], node="cn-beijing.192.168.0.5", phase="Succeeded",
                annotations={"ALIYUN_COM_GPU_MEM_IDX": "0"})
    api.add_pod("unplaced", [4], phase="Pending")
    api.add_pod("malformed", [2], node="cn-beijing.192.168.0.4", phase="Running",  # a bad annotation is not counted
                annotations={"ALIYUN_COM_GPU_MEM_IDX": "one"})


def test_kubectl_inspect_cgpu_shows_each_node_and_gpu(api):
    cluster(api)
    r = kubectl(api, "inspect", "cgpu")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "IPADDRESS", "GPU0(Allocated/Total)", "GPU1(Allocated/Total)",
                                "GPU", "Memory(GiB)"]
    assert lines[1].split() == ["cn-beijing.192.168.0.4", "192.168.0.4", "6/15", "0/0", "6/15"]
    assert lines[2].split() == ["cn-beijing.192.168.0.5", "192.168.0.5", "0/15", "5/22", "5/37"]
    assert lines[-1] == "Allocated/Total GPU Memory In Cluster: 11/52 (21%)"


def test_kubectl_inspect_cgpu_details_per_pod(api):
    cluster(api)
    r = kubectl(api, "inspect", "cgpu", "-d")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()]
    assert ["binpack-1", "default", "6"] in rows
    assert ["binpack-2", "ml", "0", "5"] in rows
    assert not any("finished" in row or "unplaced" in row or "malformed" in row for row in rows)
    assert r.stdout.rstrip().endswith("Allocated/Total GPU Memory In Cluster: 11/52 (21%)")


def test_no_gpu_nodes_and_no_api_server_are_one_line(api, tmp_path):
    api.add_node("cpu-only")
    r = kubectl(api, "inspect", "cgpu")
    assert r.returncode == 1 and r.stderr.strip().endswith("is the cgpu device plugin (or dra-plugin) running?")
    api.close()
    r = kubectl(api, "inspect", "cgpu")
    assert r.returncode == 1 and "cannot reach the API server" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_kubectl_inspect_cgpu_shows_dra_nodes_from_their_slices_and_claims(api):
    """DRA mode: a node with no aliyun.com/gpu-mem but cgpud's ResourceSlices, and claims allocated on
    it (capacity on a GPU device, or unit devices), beside a device-plugin node."""
    from cgpud.k8s import dra

    cluster(api)
    api.add_node("dra-node", ip="192.168.0.7")
    gpus = [dra.Gpu(0, "GPU-a", "Tesla T4", 15109 << 20), dra.Gpu(1, "GPU-b", "Tesla T4", 15109 << 20)]
    with api.lock:
        for s in dra.resource_slices("dra-node", gpus, 1 << 30):
            api.create("resourceslices", s["metadata"]["name"], s)
    api.add_claim("default", "three", [{"driver": dra.DRIVER, "pool": "dra-node", "device": "gpu-1",
                                        "request": "gpu", "consumedCapacity": {"memory": "3Gi"}}])
    api.add_claim("ml", "mem-2-extended-resources-x", [
        {"driver": dra.DRIVER, "pool": "dra-node", "device": f"gpu-0-unit-{j}", "request": "container-0-request-0"}
        for j in range(2)])
    api.add_claim("default", "unallocated", [])
    r = kubectl(api, "inspect", "cgpu")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()]
    assert ["dra-node", "192.168.0.7", "2/14", "3/14", "5/28"] in rows, r.stdout
    assert r.stdout.rstrip().endswith("Allocated/Total GPU Memory In Cluster: 16/80 (20%)")
    r = kubectl(api, "inspect", "cgpu", "-d")
    rows = [ln.split() for ln in r.stdout.splitlines()]
    assert ["three", "default", "0", "3"] in rows and ["mem-2-extended-resources-x", "ml", "2", "0"] in rows, r.stdout
