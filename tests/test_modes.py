"""A node's mode from its `ack.node.gpu.schedule` label (SPEC §6, docs/kubernetes.md "A node's
mode"): the rule (cgpud.k8s.modes) against the table of the spec, and the device plugin — a real
process, the kubelet stand-in, the API server stand-in, a real daemon — advertising only the mode's
resources, keeping the old mode while a GPU pod runs (condition, event) and switching when it ends."""
from __future__ import annotations

import grpc
import pytest

from cgpud.k8s import modes
from cgpud.k8s import resources as res
from cgpud.k8s.view import Node
from kubelet_standin import plugin_node
from test_deviceplugin import A10_UNITS, T4_UNITS, registered, uuids, wait_for

NODE = "gpu-node-1"
MEM, WHOLE, CORE = "aliyun.com/gpu-mem", "nvidia.com/gpu", "aliyun.com/gpu-core.percentage"


# ---- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize("label,mode,advertised", [
    ("default", "exclusive", {WHOLE}), ("cgpu", "cgpu", {MEM}), ("core_mem", "core_mem", {MEM, CORE}),
    ("share", "share", {MEM}), ("mps", "mps", {MEM}), ("disabled", "disabled", set()),
])
def test_each_label_value_is_a_mode_that_advertises_only_its_resources(label, mode, advertised):
    got, warning = modes.wanted({"ack.node.gpu.schedule": label}, "cgpu")
    assert (got, warning) == (mode, None)
    assert {r for r in (MEM, WHOLE, CORE) if modes.advertises(got, r)} == advertised


def test_no_label_is_the_flag_and_a_bad_one_keeps_it_with_a_warning():
    assert modes.wanted({}, "share") == ("share", None)
    mode, warning = modes.wanted({"ack.node.gpu.schedule": "gpu-share"}, "cgpu")
    assert mode == "cgpu" and "'gpu-share' is not one of" in warning


def test_a_label_change_waits_for_the_nodes_gpu_users():
    assert modes.decide("cgpu", "mps", []) == modes.Decision("mps", "mps", ())
    d = modes.decide("cgpu", "mps", ["default/b", "default/a"])
    assert (d.mode, d.wanted, d.pending, d.holders) == ("cgpu", "mps", True, ("default/a", "default/b"))
    assert "stays in mode cgpu while 2 GPU user(s)" in d.message()
    assert modes.decide(None, "mps", ["default/a"]).mode == "mps", "nothing in force yet: the label's"


def test_which_pods_hold_a_gpu():
    def pod(limits, phase="Running"):
        return {"spec": {"containers": [{"resources": {"limits": limits}}]}, "status": {"phase": phase}}

    assert modes.gpu_pod(pod({MEM: "3"})) and modes.gpu_pod(pod({WHOLE: "1"})) and modes.gpu_pod(pod({CORE: "30"}))
    assert not modes.gpu_pod(pod({"cpu": "1"})) and not modes.gpu_pod(pod({MEM: "3"}, "Succeeded"))


def test_the_extender_places_no_gpu_mem_on_a_node_whose_mode_has_none():
    node = {"metadata": {"name": "n", "annotations": {"cgpu.aliyun.com/gpu-mem-per-device": "14,22"}},
            "status": {}}
    assert Node(node).units == (14, 22)
    node["metadata"]["annotations"][modes.MODE_IN_FORCE] = "exclusive"
    assert Node(node).units == ()


@pytest.mark.parametrize("p,ok", [(5, True), (30, True), (100, True), (0, False), (3, False), (33, False),
                                  (105, False)])
def test_a_compute_percentage_is_a_multiple_of_5_from_5_to_100(p, ok):
    if ok:
        assert res.check_percentage(p) == p
    else:
        with pytest.raises(res.AllocationError, match="multiple of 5 from 5 to 100"):
            res.check_percentage(p)


# ---- the device plugin -------------------------------------------------------------------------


@pytest.fixture
def labelled(make_daemon, tmp_path):
    d = make_daemon(gpus="sim:1xT4,1xA10")
    with plugin_node(d, tmp_path, NODE, {"ack.node.gpu.schedule": "cgpu"}) as (api, kubelet, _):
        yield d, api, kubelet


def relabel(api, value: str) -> None:
    api.edit_node(NODE, lambda n: n["metadata"]["labels"].__setitem__("ack.node.gpu.schedule", value))


def in_force(api) -> str | None:
    return api.nodes[NODE]["metadata"]["annotations"].get(modes.MODE_IN_FORCE)


def condition(api) -> dict:
    return next((c for c in api.nodes[NODE]["status"].get("conditions", []) if c["type"] == modes.CONDITION), {})


def test_relabelling_changes_what_the_node_advertises_but_not_while_a_gpu_pod_runs(labelled):
    d, api, kubelet = labelled
    # a GPU pod runs on the node from the start (its watch brings it long before the label changes)
    api.add_pod("trainer", [2], node=NODE, phase="Running")
    registered(kubelet)
    wait_for(lambda: WHOLE in kubelet.others and CORE in kubelet.others, "every resource registered")
    t4, a10 = uuids(d)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    wait_for(lambda: in_force(api) == "cgpu", "the mode in force written on the node")
    assert kubelet.others[WHOLE].devices == {} and kubelet.others[CORE].devices == {}

    # whole GPUs asked while the pod runs: nothing changes, the condition and an event say why
    relabel(api, "default")
    wait_for(lambda: condition(api).get("status") == "True", "the condition says the change waits")
    assert "default/trainer" in condition(api)["message"] and in_force(api) == "cgpu"
    wait_for(lambda: any(e.get("reason") == "GpuModeChangeWaiting" for e in api.events), "the event says why")
    assert len(kubelet.devices) == T4_UNITS + A10_UNITS and kubelet.others[WHOLE].devices == {}

    api.delete_pod("default", "trainer")  # its last GPU pod ended: whole GPUs now, gpu-mem 0
    kubelet.others[WHOLE].wait_devices(lambda ds: set(ds) == {t4, a10})
    kubelet.wait_devices(lambda ds: ds == {})
    wait_for(lambda: in_force(api) == "exclusive" and condition(api).get("status") == "False", "exclusive in force")
    wait_for(lambda: any(e.get("reason") == "GpuModeChanged" and "cgpu -> exclusive" in e.get("message", "")
                         for e in api.events), "the event says the mode changed")
    assert kubelet.others[WHOLE].allocate([a10]) == [{"NVIDIA_VISIBLE_DEVICES": a10}]
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate([f"{t4}-_-0"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "mode exclusive" in err.value.details()

    relabel(api, "core_mem")  # no GPU pod: at once
    kubelet.others[CORE].wait_devices(lambda ds: len(ds) == 200)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    kubelet.others[WHOLE].wait_devices(lambda ds: ds == {})
    wait_for(lambda: in_force(api) == "core_mem", "core_mem in force")
    cores = sorted(kubelet.others[CORE].devices)
    assert kubelet.others[CORE].allocate(cores[:30]) == [{"ALIYUN_COM_GPU_CORE_PERCENTAGE": "30"}]
    with pytest.raises(grpc.RpcError) as err:
        kubelet.others[CORE].allocate(cores[:33])
    assert "multiple of 5" in err.value.details()


def test_share_mode_gives_no_isolation(labelled):
    d, api, kubelet = labelled
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, _ = uuids(d)
    assert "CGPU_DISABLE" not in kubelet.allocate([f"{t4}-_-0"])[0]
    relabel(api, "share")
    wait_for(lambda: in_force(api) == "share", "share in force")
    assert kubelet.allocate([f"{t4}-_-0"])[0]["CGPU_DISABLE"] == "true"


def test_a_share_node_counts_128_mib_units_and_back_in_cgpu_whole_gib(labelled):
    """SPEC §3: the unit is 128 MiB where the node is in share mode (seed 004: `gpu-mem: 16` is 2 GiB
    there), and the mode is the label's (SPEC §6): the plugin without --unit lists, publishes and
    allocates in the share node's 128 MiB units, and in whole GiB again once the label says cgpu.
    (Before, the label left the plugin in GiB: seed 004's 16 fitted on no T4 of 14.)"""
    d, api, kubelet = labelled
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, _ = uuids(d)
    per_device = lambda: api.nodes[NODE]["metadata"]["annotations"].get("cgpu.aliyun.com/gpu-mem-per-device")  # noqa: E731
    relabel(api, "share")
    from cgpud.client import Client

    with Client(str(d.socket)) as c:  # (each GPU's whole 128 MiB units: a T4's 15109 MiB are 118)
        t4_128, a10_128 = (g.units(128 << 20) for g in res.gpus_from_query(c.call("query")))
    assert t4_128 == 118
    kubelet.wait_devices(lambda ds: len(ds) == t4_128 + a10_128)
    wait_for(lambda: per_device() == f"{t4_128},{a10_128}", "the 128 MiB units published on the node")
    (env,) = kubelet.allocate([f"{t4}-_-{j}" for j in range(16)])
    assert (env["ALIYUN_COM_GPU_MEM_CONTAINER"], env["ALIYUN_COM_GPU_MEM_DEV"], env["CGPU_DISABLE"]) == \
        ("16", str(t4_128), "true"), env
    relabel(api, "cgpu")
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    wait_for(lambda: per_device() == f"{T4_UNITS},{A10_UNITS}", "whole GiB units published again")


def test_mps_mode_gives_each_container_its_mps_limits_and_the_pipe_directory(labelled):
    d, api, kubelet = labelled
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, _ = uuids(d)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in kubelet.allocate([f"{t4}-_-0"])[0]
    relabel(api, "mps")
    wait_for(lambda: in_force(api) == "mps", "mps in force")
    (env,) = kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1", f"{t4}-_-2"])
    # 3 of the T4's 14 units: 3/14 of 15109 MiB (SPEC §2's rule), 22 % of its threads (21.4, rounded up)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={15109 * 3 // 14}M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "22"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/nvidia-gpu/nvidia-mps"
    assert ("/var/run/nvidia-gpu/nvidia-mps", "/var/run/nvidia-gpu/nvidia-mps", False) in kubelet.mounts[0]
    # ... and the MPS shared memory at /dev/shm: the control daemon's tmpfs (deploy/kubernetes/mps-control.yaml)
    assert ("/var/run/nvidia-gpu/nvidia-mps-shm", "/dev/shm", False) in kubelet.mounts[0]  # (host, container)


def test_the_extender_puts_percentage_pods_only_on_gpus_with_that_much_compute_left(tmp_path, monkeypatch):
    """core_mem: two GPUs of 15 units; a pod of 60 % is on GPU 0. A second 60 % pod fits no more on
    GPU 0 (120 %) though its memory would: it goes to GPU 1; a third (60 %) fits nowhere, said."""
    from apiserver_standin import ApiServer
    from test_extender import Extender

    def core_pod(name: str, pct: int, **kw) -> dict:
        pod = api.add_pod(name, [1], **kw)
        return api.edit_pod("default", name, lambda p: p["spec"]["containers"][0]["resources"]["limits"].__setitem__(
            CORE, str(pct)))

    api = ApiServer(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    e = Extender(api)
    try:
        api.add_node("cm", gpus=2, units=30, per_device="15,15")
        core_pod("first", 60, node="cm", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "0"})
        second = core_pod("second", 60)
        code, res = e.call("/filter", {"Pod": second, "NodeNames": ["cm"]})
        assert code == 200 and res["NodeNames"] == ["cm"], res
        assert e.call("/bind", {"PodName": "second", "PodNamespace": "default", "Node": "cm"})[0] == 200
        assert api.pods[("default", "second")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "1", \
            "binpack would have chosen GPU 0 (fuller), which has 40 % left"
        api.set_phase("default", "second", "Running")
        third = core_pod("third", 60)
        code, res = e.call("/filter", {"Pod": third, "NodeNames": ["cm"]})
        assert res["NodeNames"] == [] and "GPU0 40, GPU1 40" in res["FailedNodes"]["cm"], res
    finally:
        e.close()
        api.close()


def test_an_mps_pod_needs_no_host_ipc_its_shm_is_mounted(labelled):
    """Decision (docs/mps.md): the MPS shared memory is mounted at the container's /dev/shm, as NVIDIA's
    plugin does, so a pod needs no hostIPC (which would give a tenant the host's IPC namespace, SPEC §9);
    ACK's pods that set it still run. (Before: a pod without hostIPC was refused.)"""
    d, api, kubelet = labelled
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, _ = uuids(d)
    relabel(api, "mps")
    wait_for(lambda: in_force(api) == "mps", "mps in force")
    chosen = {"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_POD": "2", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
              "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"}
    for name, host_ipc in (("no-ipc", False), ("with-ipc", True)):
        api.add_pod(name, [2], annotations=chosen)
        api.edit_pod("default", name, lambda p, h=host_ipc: p["spec"].update(hostIPC=h, nodeName=NODE))
        envs: list[dict] = []

        def assigned() -> bool:  # Allocate used the extender's choice of this pod (the plugin's watch brought it)
            try:
                envs[:] = kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1"])
            except grpc.RpcError as exc:  # (the refusal main gave a pod without hostIPC)
                assert False, exc.details()
            return api.pods[("default", name)]["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_ASSIGNED") == "true"

        wait_for(assigned, f"the pod {name} allocated by the extender's choice")
        assert envs[0]["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/nvidia-gpu/nvidia-mps"
        assert ("/var/run/nvidia-gpu/nvidia-mps-shm", "/dev/shm", False) in kubelet.mounts[0]  # (host, container)
        assert ("/var/run/nvidia-gpu/nvidia-mps", "/var/run/nvidia-gpu/nvidia-mps", False) in kubelet.mounts[0]
        api.set_phase("default", name, "Succeeded")


def test_kubectl_inspect_cgpu_shows_each_pods_compute_percentage():
    from cgpud.k8s import cluster
    from cgpud.observe.inspect import detail

    node = {"metadata": {"name": "cm", "annotations": {"cgpu.aliyun.com/gpu-mem-per-device": "15,15"}},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}

    def pod(name, units, pct, gpu):
        limits = {MEM: str(units), **({CORE: str(pct)} if pct else {})}
        return {"metadata": {"name": name, "namespace": "default", "annotations": {"ALIYUN_COM_GPU_MEM_IDX": gpu}},
                "spec": {"nodeName": "cm", "containers": [{"resources": {"limits": limits}}]},
                "status": {"phase": "Running"}}

    out = detail([cluster.node_view(node, [pod("thirty", 4, 30, "0"), pod("sixty", 6, 60, "1")])])
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("NAME ", "thirty", "sixty"))}
    assert rows["NAME"][-1] == "CORE(%)" and rows["thirty"][-1] == "30%" and rows["sixty"][-1] == "60%", out
    assert "CORE" not in detail([cluster.node_view(node, [pod("memonly", 4, 0, "0")])])
