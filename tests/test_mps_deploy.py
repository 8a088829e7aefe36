"""The MPS control daemon as a DaemonSet on `mps` nodes only (issue 37): deploy/kubernetes/
mps-control.yaml as kustomize renders it, and the chart's template (deploy/helm/cgpud/templates/
mps-control.yaml) that the value mpsControl.enabled turns off. What it must be is ACK's (the
control daemon privileged, hostIPC, system-node-critical, on ack.node.gpu.schedule=mps nodes, the
pipe directory /var/run/nvidia-gpu/nvidia-mps of ack-mps-control 0.2.0) and what the device
plugin's Allocate gives each container (the same pipe directory and shared memory)."""
from __future__ import annotations

from cgpud.k8s import resources as res
from test_helm import by_key, helm, template
from test_manifests import RENDERED


def mps_control(docs):
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpu-mps-control"]
    return ds


def test_the_control_daemon_runs_on_mps_nodes_only_as_ack_runs_it():
    spec = mps_control(RENDERED)["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"ack.node.gpu.schedule": "mps"} and "affinity" not in spec
    assert spec["hostIPC"] is True and spec["priorityClassName"] == "system-node-critical"
    (c,) = spec["containers"]
    assert c["command"] == ["nvidia-cuda-mps-control", "-f"] and c["securityContext"]["privileged"] is True
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/nvidia-gpu/nvidia-mps" == res.MPS_PIPE_DIR
    assert "echo quit | nvidia-cuda-mps-control" in c["lifecycle"]["preStop"]["exec"]["command"][-1]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["mountPath"]: host[m["name"]] for m in c["volumeMounts"]}
    # the clients' pipe directory and shared memory are the ones Allocate mounts into each container
    assert mounts["/var/run/nvidia-gpu/nvidia-mps"] == res.MPS_PIPE_DIR
    assert mounts["/dev/shm"] == res.MPS_SHM_DIR
    # ... the shared memory a tmpfs, mounted on the host (propagated) by the init container
    (init,) = spec["initContainers"]
    (m,) = init["volumeMounts"]
    assert m["mountPropagation"] == "Bidirectional"
    assert f"{host[m['name']]}/{'nvidia-mps-shm'}" == res.MPS_SHM_DIR
    assert "mount -t tmpfs" in " ".join(init["command"]).replace("\n", " ")


def test_the_chart_renders_it_and_a_value_turns_it_off():
    assert by_key(template())[("DaemonSet", "kube-system", "cgpu-mps-control")] == mps_control(RENDERED)
    off = by_key(template("--set", "mpsControl.enabled=false"))
    assert ("DaemonSet", "kube-system", "cgpu-mps-control") not in off and ("DaemonSet", "kube-system", "cgpud") in off
    p = helm("template", "cgpud", str(__import__("test_helm").CHART), "--set", "mpsControl.enabled=yes")
    assert p.returncode != 0 and "mpsControl" in p.stderr
