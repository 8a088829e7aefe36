"""`cgpu dra-plugin` (DRA mode, docs/kubernetes.md): the ResourceSlice and the
claims' shares as pure functions; then the plugin as its own process against
a real node daemon, the API server stand-in (ResourceSlices and
ResourceClaims) and a gRPC client that does what the kubelet does — its
plugin watcher's GetInfo and NotifyRegistrationStatus on the registration
socket, NodePrepareResources and NodeUnprepareResources on the endpoint it
names — and end to end, a real runc container with exactly the CDI spec's
edits joins the tree with the claim's memsize."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from cgpud.containers import envspec
from cgpud.k8s import dra
from cgpud.k8s.proto import dra_pb2 as pb
from cgpud.k8s.proto import dra_pb2_grpc as rpc
from cgpud.k8s.proto import pluginregistration_pb2 as regpb
from cgpud.k8s.proto import pluginregistration_pb2_grpc as regrpc
from test_runc import Runc, template  # noqa: F401  (a fixture)

CGPU = str(Path(sys.executable).parent / "cgpu")
GIB = 1 << 30
MIB = 1 << 20
T4 = dra.Gpu(0, "GPU-t4", "Tesla T4", 15109 * MIB)
A10 = dra.Gpu(1, "GPU-a10", "NVIDIA A10", 23028 * MIB)
NODE = "gpu-node-1"


def result(device: str, request: str = "gpu", memory: str | None = "3Gi", pool: str = NODE, share: str = "s1") -> dict:
    r = {"driver": dra.DRIVER, "pool": pool, "device": device, "request": request, "shareID": share}
    if memory is not None:
        r["consumedCapacity"] = {"memory": memory}
    return r


def claim(results: list[dict], config: list[dict] | None = None) -> dict:
    return {"metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
            "status": {"allocation": {"devices": {"results": results, "config": config or []}}}}


def opaque(requests=None, source="FromClass", **params) -> dict:
    """A GpuConfig in an allocation's config: the DeviceClass's (FromClass) unless `source` says."""
    return {"source": source, "requests": requests or [],
            "opaque": {"driver": dra.DRIVER, "parameters": {"apiVersion": dra.CONFIG_API_VERSION,
                                                            "kind": dra.CONFIG_KIND, **params}}}


# ---- pure: the slice, the shares, the environment --------------------------------------------


def test_the_slice_has_each_gpu_as_one_device_whose_memory_claims_share():
    slices = dra.resource_slices(NODE, [T4, A10], 128 * MIB)
    (x,) = slices  # one slice for the node: a device per GPU, whatever the unit
    assert x["metadata"]["name"] == f"{NODE}-cgpu.aliyun.com-0" and x["spec"]["driver"] == dra.DRIVER
    assert x["spec"]["nodeName"] == NODE and "sharedCounters" not in x["spec"]
    assert x["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    t4, a10 = x["spec"]["devices"]
    assert t4["name"] == "gpu-0" and t4["allowMultipleAllocations"] is True and "consumesCounters" not in t4
    assert t4["attributes"] == {"uuid": {"string": "GPU-t4"}, "model": {"string": "Tesla T4"}, "index": {"int": 0},
                                "memoryUnit": {"int": 128 * MIB}, "kind": {"string": "gpu"}, "mode": {"string": "cgpu"}}
    # 15109 MiB is 118 whole units of 128 MiB (15104 MiB): never more than the units the hook can give
    assert t4["capacity"]["memory"] == {"value": str(118 * 128 * MIB), "requestPolicy": {
        "default": str(128 * MIB), "validRange": {"min": str(128 * MIB), "step": str(128 * MIB)}}}
    assert a10["name"] == "gpu-1" and a10["capacity"]["memory"]["value"] == str(179 * 128 * MIB)
    assert dra.resource_slices(NODE, [T4], GIB)[0]["spec"]["devices"][0]["capacity"]["memory"]["value"] == \
        str(14 * GIB)
    # eight 80 GiB GPUs at 128 MiB: still one slice of 8 devices
    h100 = [dra.Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559 * MIB) for i in range(8)]
    (big,) = dra.resource_slices(NODE, h100, 128 * MIB)
    assert len(big["spec"]["devices"]) == 8


def test_each_mode_publishes_what_it_gives():
    """The node's mode in force (docs/kubernetes.md, "A node's mode"): memory shared in cgpu, share
    and mps; memory and a compute percentage (capacity `compute`: 100, in steps of 5 from 5) in
    core_mem; whole GPUs in exclusive; nothing in disabled. Every device says its mode."""
    def gpu0(mode):
        (s,) = dra.resource_slices(NODE, [T4, A10], GIB, mode=mode)
        return s["spec"]["devices"][0] if s["spec"]["devices"] else None

    for mode in ("cgpu", "share", "mps"):
        d = gpu0(mode)
        assert d["allowMultipleAllocations"] is True and set(d["capacity"]) == {"memory"}
        assert d["attributes"]["mode"] == {"string": mode}
    d = gpu0("core_mem")
    assert d["allowMultipleAllocations"] is True and d["attributes"]["mode"] == {"string": "core_mem"}
    assert d["capacity"]["compute"] == {"value": "100", "requestPolicy": {
        "default": "100", "validRange": {"min": "5", "max": "100", "step": "5"}}}
    d = gpu0("exclusive")
    assert "allowMultipleAllocations" not in d and d["capacity"] == {"memory": {"value": str(14 * GIB)}}
    assert d["attributes"]["mode"] == {"string": "exclusive"}
    (s,) = dra.resource_slices(NODE, [T4, A10], GIB, mode="disabled")
    assert s["spec"]["devices"] == [] and s["spec"]["pool"]["resourceSliceCount"] == 1


def test_a_claims_compute_becomes_its_percentage_and_an_mps_claim_gets_its_mps_limits():
    shares = dra.plan(claim([{**result("gpu-1", memory="4Gi"), "consumedCapacity": {"memory": "4Gi",
                                                                                      "compute": "30"}}]),
                      NODE, [T4, A10], GIB)
    assert [(s.gpus, s.percentage) for s in shares] == [([(1, 4 * GIB)], 30)]
    env = dra.environment(shares[0], [T4, A10], GIB, "core_mem")
    assert env["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30" and "ALIYUN_COM_GPU_SCHD_WEIGHT" not in env
    assert dra.Share.from_dict(shares[0].as_dict()) == shares[0]
    with pytest.raises(dra.DraError, match="compute 33 of GPU 1 is not a multiple of 5 from 5 to 100 percent"):
        dra.plan(claim([{**result("gpu-1"), "consumedCapacity": {"memory": "3Gi", "compute": "33"}}]), NODE,
                 [T4, A10], GIB)
    with pytest.raises(dra.DraError, match="the percentage fixes its compute; give one of the two"):
        dra.plan(claim([{**result("gpu-1"), "consumedCapacity": {"memory": "3Gi", "compute": "30"}}],
                       [opaque(weight=3)]), NODE, [T4, A10], GIB)
    # mps: the client's pinned limit (3 GiB = 3072 MiB on its CUDA device 0), its thread percentage
    # (3 GiB of the A10's 23028 MiB: 13.3 %, up to 14) and the pipe directory, mounted read-write
    (share,) = dra.plan(claim([result("gpu-1", memory="3Gi")]), NODE, [T4, A10], GIB)
    spec = dra.cdi_spec("u1", [share], [T4, A10], GIB, ["/run/cgpud"], "mps")
    env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert (env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
            env["CUDA_MPS_PIPE_DIRECTORY"]) == ("0=3072M", "14", "/var/run/nvidia-gpu/nvidia-mps")
    assert {"hostPath": "/var/run/nvidia-gpu/nvidia-mps", "containerPath": "/var/run/nvidia-gpu/nvidia-mps",
            "options": ["rbind", "rw"]} in spec["containerEdits"]["mounts"]
    assert {"hostPath": "/var/run/nvidia-gpu/nvidia-mps-shm", "containerPath": "/dev/shm",
            "options": ["rbind", "rw"]} in spec["containerEdits"]["mounts"]
    assert not [e for e in dra.cdi_spec("u1", [share], [T4, A10], GIB, [], "cgpu")["devices"][0]["containerEdits"]
                ["env"] if e.startswith("CUDA_MPS")]


def test_the_slices_are_valid_objects_of_the_official_clients_model():
    from kubernetes import client

    from test_manifests import unknown

    for body in [x for mode in ("cgpu", "core_mem", "exclusive", "disabled")
                 for x in dra.resource_slices(NODE, [T4, A10], GIB, mode=mode)]:
        assert unknown(body, "V1ResourceSlice", "ResourceSlice") == []
        client.ApiClient()._ApiClient__deserialize(body, "V1ResourceSlice")


def test_units_of_gpu_mem_become_a_share_per_gpu():
    """aliyun.com/gpu-mem: 3 through the DeviceClass is 3 unit devices (KEP-5004): 3 units of their GPU;
    units the scheduler took from two GPUs give the container both, each with its own."""
    (share,) = dra.plan(claim([result(f"gpu-0-unit-{j}", request="container-0-request-0", memory=None)
                               for j in range(3)]), NODE, [T4, A10], GIB)
    assert share.gpus == [(0, 3 * GIB)]
    env = dra.environment(share, [T4, A10], GIB)
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("0", "3")
    (split,) = dra.plan(claim([result("gpu-0-unit-13", memory=None), result("gpu-1-unit-0", memory=None),
                               result("gpu-1-unit-1", memory=None)]), NODE, [T4, A10], 128 * MIB)
    env = dra.environment(split, [T4, A10], 128 * MIB)
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("0,1", "1,2")


def test_a_claim_of_3_gib_is_3_units_on_its_gpu():
    (share,) = dra.plan(claim([result("gpu-0")]), NODE, [T4, A10], GIB)
    assert share.gpus == [(0, 3 * GIB)] and (share.weight, share.highprio) == (1, False)
    assert dra.environment(share, [T4, A10], GIB) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-t4", "ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_CONTAINER": "3",
        "ALIYUN_COM_GPU_MEM_POD": "3"}


def test_seed_000_eight_gib_over_two_gpus_is_four_on_each():
    (share,) = dra.plan(claim([result("gpu-0", memory="4Gi"), result("gpu-1", memory="4Gi", share="s2")]),
                        NODE, [T4, A10], GIB)
    env = dra.environment(share, [T4, A10], GIB)
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"], env["ALIYUN_COM_GPU_MEM_POD"]) == \
        ("0,1", "4", "8")
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-t4,GPU-a10"


def test_seed_004_a_128_mib_unit_and_unequal_shares():
    (share,) = dra.plan(claim([result("gpu-1", memory="384Mi"), result("gpu-0", memory="1Gi", share="s2")]),
                        NODE, [T4, A10], 128 * MIB)
    env = dra.environment(share, [T4, A10], 128 * MIB)
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("1,0", "3,8")


def test_a_device_allocated_whole_gets_all_its_units():
    (share,) = dra.plan(claim([result("gpu-0", memory=None)]), NODE, [T4], GIB)
    assert share.gpus == [(0, 14 * GIB)]


def test_weight_and_high_priority_come_from_the_opaque_config_later_wins():
    c = claim([result("gpu-0"), result("gpu-1", request="other", share="s2")],
              [opaque(weight=2), opaque(["gpu"], weight=4, highPriority=True),
               {"opaque": {"driver": "someone.else", "parameters": {"weight": "x"}}}])
    first, other = dra.plan(c, NODE, [T4, A10], GIB)
    assert (first.request, first.weight, first.highprio) == ("gpu", 4, True)
    assert (other.request, other.weight, other.highprio) == ("other", 2, False)
    env = dra.environment(first, [T4, A10], GIB)
    assert env["ALIYUN_COM_GPU_SCHD_WEIGHT"] == "4" and env["ALIYUN_COM_GPU_HIGH_PRIO"] == "1"


@pytest.mark.parametrize("source", ["FromClaim", None])
def test_weight_and_high_priority_in_the_claims_own_config_are_refused(source):
    """SPEC §2: weight and high priority are the cluster admin's (a DeviceClass's config, FromClass);
    a tenant's claim naming them is refused with the reason, never obeyed (issue 44)."""
    for params in ({"weight": 16}, {"highPriority": True}):
        c = claim([result("gpu-0")], [opaque(weight=2), opaque(source=source, **params)])
        with pytest.raises(dra.DraError, match=r"config 1: weight and highPriority are the cluster admin's to grant, "
                                               r"in a DeviceClass's GpuConfig \(source FromClass\), not the claim's"):
            dra.plan(c, NODE, [T4, A10], GIB)
    (share,) = dra.plan(claim([result("gpu-0")], [opaque(weight=2), opaque(source=source)]), NODE, [T4, A10], GIB)
    assert (share.weight, share.highprio) == (2, False)  # (a claim's GpuConfig naming neither: the class's stand)


def test_a_cdi_device_names_every_contract_variable_so_a_pods_own_are_replaced():
    """A CDI edit replaces the pod's value of each variable it names (CDI's env edits): the claim's
    device names them all, empty where unused, and its claim (issue 44: CGPU_DISABLE, the weight)."""
    (share,) = dra.plan(claim([result("gpu-0", memory="3Gi")]), NODE, [T4, A10], GIB)
    env = dict(e.split("=", 1) for e in dra.cdi_spec("u1", [share], [T4, A10], GIB, [])["devices"][0]
               ["containerEdits"]["env"])
    assert set(envspec.VARIABLES) <= set(env)
    assert (env["CGPU_DISABLE"], env["ALIYUN_COM_GPU_SCHD_WEIGHT"], env["ALIYUN_COM_GPU_HIGH_PRIO"],
            env["ALIYUN_COM_GPU_MEM_CONTAINER"], env["CGPU_DRA_CLAIM"]) == ("", "", "", "3", "u1/gpu")


@pytest.mark.parametrize("c, why", [
    (claim([]), "has no device of cgpu.aliyun.com allocated"),
    (claim([result("gpu-0", pool="other-node")]), "of pool 'other-node', not this node's"),
    (claim([result("gpu-7")]), "'gpu-7' is not one of this node's GPUs"),
    (claim([result("gpu-0-unit-14", memory=None)]), "'gpu-0-unit-14' is not one of this node's GPUs or their units"),
    (claim([result("gpu-0-unit-1", memory=None), result("gpu-0-unit-1", memory=None)]), "unit gpu-0-unit-1 was given twice"),
    (claim([result("gpu-0", memory="1536Mi")]), "not a whole number of the node's"),
    (claim([result("gpu-0", memory="15Gi")]), "from 1 to 14"),
    (claim([result("gpu-0", memory="3.3")]), "not a whole number of bytes"),
    (claim([result("gpu-0")], [opaque(weight=0)]), "weight 0 is not a whole number from 1 to 25"),
    (claim([result("gpu-0")], [opaque(highPriority="yes")]), "highPriority 'yes' is not true or false"),
    (claim([result("gpu-0")], [opaque(wieght=2)]), "GpuConfig has no field 'wieght'"),
    (claim([result("gpu-0")], [{"opaque": {"driver": dra.DRIVER, "parameters": {"weight": 2}}}]),
     "must be apiVersion: cgpu.aliyun.com/v1, kind: GpuConfig"),
])
def test_a_claim_that_cannot_be_given_is_refused_with_the_reason(c, why):
    with pytest.raises(dra.DraError) as exc:
        dra.plan(c, NODE, [T4], GIB)
    assert why in str(exc.value) and "\n" not in str(exc.value)


def test_the_cdi_spec_has_a_device_per_request_with_its_environment():
    shares = dra.plan(claim([result("gpu-0"), result("gpu-0", request="b/sub", memory="1Gi", share="s2")]),
                      NODE, [T4], GIB)
    spec = dra.cdi_spec("u1", shares, [T4], GIB, ["/run/cgpud"])
    assert spec["cdiVersion"] == dra.CDI_VERSION and spec["kind"] == "cgpu.aliyun.com/gpu"
    assert [d["name"] for d in spec["devices"]] == ["u1-gpu", "u1-b.sub"]
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=3" in spec["devices"][0]["containerEdits"]["env"]
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=1" in spec["devices"][1]["containerEdits"]["env"]
    # the containers' socket directory only, read-only, where a container looks for the socket (SPEC §9)
    assert spec["containerEdits"]["mounts"] == [{"hostPath": "/run/cgpud/tenant", "containerPath": "/run/cgpud",
                                                 "options": ["rbind", "ro"]}]


def test_inspect_shows_a_claim_by_the_pods_it_is_reserved_for():
    slices = dra.resource_slices(NODE, [T4], GIB)
    c = claim([result("gpu-0", memory="3Gi")])
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "app-1", "uid": "p1"}]
    (view,) = dra.node_views(slices, [c])
    assert view["gpus"] == [{"index": 0, "allocated": 3, "total": 14}] and view["percent"] == 21
    assert view["instances"] == [{"name": "app-1", "namespace": "ns", "gpus": {"0": 3}, "allocated": 3}]


def test_the_committed_grpc_code_is_the_kubelets_protos_compiled(tmp_path):
    """cgpud/k8s/proto/{dra,pluginregistration}_pb2*.py are grpcio-tools' output for the kubelet's
    dra/v1 and pluginregistration/v1 api.proto, unchanged."""
    from grpc_tools import protoc

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "cgpud" / "k8s" / "proto", tmp_path / "cgpud" / "k8s" / "proto",
                    ignore=shutil.ignore_patterns("*_pb2*.py", "__pycache__"))
    for proto in ("dra", "pluginregistration"):
        assert protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                            os.fspath(tmp_path / f"cgpud/k8s/proto/{proto}.proto")]) == 0
        for name in (f"{proto}_pb2.py", f"{proto}_pb2_grpc.py"):
            fresh = (tmp_path / "cgpud/k8s/proto" / name).read_text().splitlines()
            committed = (root / "cgpud/k8s/proto" / name).read_text().splitlines()
            keep = [ln for ln in fresh if not ln.startswith("# Protobuf Python Version")]
            assert keep == [ln for ln in committed if not ln.startswith("# Protobuf Python Version")], name
    assert pb.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1" and "DRAPlugin" in pb.DESCRIPTOR.services_by_name
    assert regpb.DESCRIPTOR.package == "pluginregistration"


# ---- the plugin as its own process -----------------------------------------------------------


class Kubelet:
    """What the kubelet's plugin watcher and DRA manager do with a plugin's sockets."""

    def __init__(self, registry: Path) -> None:
        self.reg = registry / f"{dra.DRIVER}-reg.sock"

    def info(self, timeout: float = 60):  # (a plugin starting on a loaded machine: imports, the daemon, the API)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with grpc.insecure_channel(f"unix://{self.reg}") as ch:
                    stub = regrpc.RegistrationStub(ch)
                    info = stub.GetInfo(regpb.InfoRequest(), timeout=2)
                    stub.NotifyRegistrationStatus(regpb.RegistrationStatus(plugin_registered=True), timeout=2)
                    return info
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the plugin's registration socket does not answer"
                time.sleep(0.05)

    def call(self, endpoint: str, method: str, *claims: tuple[str, str, str]):
        req = (pb.NodePrepareResourcesRequest if method == "prepare" else pb.NodeUnprepareResourcesRequest)(
            claims=[pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims])
        with grpc.insecure_channel(f"unix://{endpoint}") as ch:
            stub = rpc.DRAPluginStub(ch)
            return (stub.NodePrepareResources if method == "prepare" else stub.NodeUnprepareResources)(req, timeout=30)


@pytest.fixture
def plugin(make_daemon, tmp_path, request):
    from apiserver_standin import ApiServer

    gpus, extra = getattr(request, "param", ("sim:1xT4,1xA10", ()))  # (indirect parametrization)
    d = make_daemon(gpus=gpus, extra_args=extra)
    api = ApiServer(tmp_path)
    api.add_node(NODE)  # (the slices' owner)
    # (the sockets' directories short, in /tmp: a socket's path has room for 107 bytes, and a test's
    # tmp_path under pytest-xdist's worker directory left too few for the registration socket)
    socks = Path(tempfile.mkdtemp(prefix="cgdra-"))
    dirs = {k: (socks if k in ("registry", "plugin") else tmp_path) / k for k in ("registry", "plugin", "cdi", "state")}
    dirs["registry"].mkdir()
    procs = []

    def start():
        log = open(tmp_path / "plugin.log", "ab")
        procs.append(subprocess.Popen(
            [CGPU, "--socket", os.fspath(d.socket), "dra-plugin", "--node-name", NODE,
             "--registry-dir", os.fspath(dirs["registry"]), "--plugin-dir", os.fspath(dirs["plugin"]),
             "--cdi-dir", os.fspath(dirs["cdi"]), "--state-dir", os.fspath(dirs["state"]), "--refresh", "0.2"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig))))
        log.close()
        return procs[-1]

    def stop():
        procs[-1].kill()
        procs[-1].wait(10)

    start()
    yield d, api, dirs, Kubelet(dirs["registry"]), start, stop
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(10)
    api.close()
    shutil.rmtree(socks, ignore_errors=True)


def wait_for(what, timeout: float = 60, why: str = ""):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    return got


def test_registers_through_the_plugin_watcher_and_publishes_the_nodes_slice(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
        ("DRAPlugin", dra.DRIVER, os.fspath(dirs["plugin"] / "dra.sock"), ["v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
    s = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    assert [x["name"] for x in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert s["spec"]["devices"][0]["attributes"]["model"] == {"string": "Tesla T4"}
    assert s["spec"]["devices"][1]["capacity"]["memory"]["value"] == str(22 * GIB)
    assert len(api.slices) == 1 and api.count("create", "resourceslices") == 1


def test_the_slices_are_published_only_once_the_kubelet_registered_the_plugin(plugin):
    """Before the kubelet's plugin watcher has registered the plugin, a pod placed on the node's
    slices would fail to prepare (`DRA driver cgpu.aliyun.com is not registered`, the kubelet trying
    again only much later): nothing is published while the plugin serves and knows its GPUs."""
    d, api, dirs, kubelet, _, _ = plugin
    wait_for(lambda: api.count("list", "resourceslices") == 1, why="the plugin's watch did not list")
    with grpc.insecure_channel(f"unix://{kubelet.reg}") as ch:  # (GetInfo alone: not registered yet)
        assert wait_for(lambda: _info(ch), why="no registration socket").name == dra.DRIVER
    time.sleep(1)  # (5 of the plugin's looks at the daemon, --refresh 0.2)
    assert not api.slices and api.count("create", "resourceslices") == 0
    kubelet.info()
    wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published once registered")


def _info(ch):
    try:
        return regrpc.RegistrationStub(ch).GetInfo(regpb.InfoRequest(), timeout=2)
    except grpc.RpcError:
        return None


def test_slices_deleted_by_someone_are_written_again_at_once(plugin):
    """The kubelet deletes its node's ResourceSlices when it starts (before its plugins register
    again): the plugin's watch sees them go and writes them again, with no read of its own."""
    d, api, dirs, kubelet, _, _ = plugin
    kubelet.info()
    first = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    with api.lock:
        api.delete("resourceslices", dra.slice_name(NODE, 0))
    again = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), 5, "the deleted slice not written again")
    assert again["spec"]["devices"] == first["spec"]["devices"]
    assert api.count("get", "resourceslices") == 0 and api.count("list", "resourceslices") == 1


def test_a_changed_node_is_published_again_in_one_update(plugin, make_daemon):
    """The node's GPUs changed while the plugin was away: its one slice is updated in place (one
    write: the pool is never half old, half new, so its generation stays), and nothing more."""
    d, api, dirs, kubelet, start, stop = plugin
    kubelet.info()
    wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    stop()
    d.stop()
    d.gpus = "sim:1xT4"  # the node's GPUs changed while the plugin was away (its state is of the old ones)
    (Path(d.state_dir) / "state.json").unlink()
    d.start()
    start()
    kubelet.info()  # (the kubelet's plugin watcher registers the new process)
    s = wait_for(lambda: (x := api.slices[dra.slice_name(NODE, 0)]) and len(x["spec"]["devices"]) == 1 and x,
                 why="the slice not written again")
    assert [x["name"] for x in s["spec"]["devices"]] == ["gpu-0"]
    assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    time.sleep(1)  # (the plugin looks every 0.2 s: nothing more is written for a node that did not change)
    assert api.count("update", "resourceslices") == 1 and api.slices[dra.slice_name(NODE, 0)] == s
    assert api.count("get", "resourceslices") == 0  # (what is there comes by the watch)


def test_prepare_writes_the_claims_cdi_spec_and_unprepare_removes_it(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    uid = api.add_claim("default", "three", [result("gpu-0", memory="3Gi")],
                        [opaque(weight=2)])["metadata"]["uid"]
    resp = kubelet.call(info.endpoint, "prepare", ("default", "three", uid)).claims[uid]
    assert not resp.error, resp.error
    (dev,) = resp.devices
    assert (list(dev.request_names), dev.pool_name, dev.device_name, list(dev.cdi_device_ids), dev.share_id) == \
        (["gpu"], NODE, "gpu-0", [f"cgpu.aliyun.com/gpu={uid}-gpu"], "s1")
    spec = json.loads((dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").read_text())
    env = spec["devices"][0]["containerEdits"]["env"]
    assert {"ALIYUN_COM_GPU_MEM_IDX=0", "ALIYUN_COM_GPU_MEM_CONTAINER=3", "ALIYUN_COM_GPU_SCHD_WEIGHT=2"} <= set(env)
    assert (dirs["state"] / f"{uid}.json").exists()
    r = kubelet.call(info.endpoint, "unprepare", ("default", "three", uid)).claims[uid]
    assert not r.error
    assert not (dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").exists() and not (dirs["state"] / f"{uid}.json").exists()


def test_a_claim_that_cannot_be_prepared_says_why_and_leaves_nothing(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    uid = api.add_claim("default", "bad", [result("gpu-0", memory="100Gi")])["metadata"]["uid"]
    resp = kubelet.call(info.endpoint, "prepare", ("default", "bad", uid), ("default", "gone", "uid-x")).claims
    assert "from 1 to 14" in resp[uid].error
    assert 'resourceclaims "gone" not found' in resp["uid-x"].error
    assert not list(dirs["cdi"].glob("*")) and not list(dirs["state"].glob("*.json"))


def test_a_cdi_directory_that_cannot_be_written_is_the_claims_error_not_the_calls(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    dirs["cdi"].write_text("not a directory")
    uid = api.add_claim("default", "nowhere", [result("gpu-0", memory="1Gi")])["metadata"]["uid"]
    resp = kubelet.call(info.endpoint, "prepare", ("default", "nowhere", uid)).claims[uid]
    assert resp.error.startswith(f"cannot write claim {uid}'s CDI spec or record") and not resp.devices, resp
    assert not (dirs["state"] / f"{uid}.json").exists()


def test_a_prepared_claim_survives_a_restart_of_the_plugin(plugin):
    d, api, dirs, kubelet, start, stop = plugin
    info = kubelet.info()
    uid = api.add_claim("default", "keep", [result("gpu-1", memory="4Gi")])["metadata"]["uid"]
    first = kubelet.call(info.endpoint, "prepare", ("default", "keep", uid)).claims[uid]
    stop()
    api.failing = True  # the restarted plugin cannot read it again: its record answers
    start()
    again = kubelet.call(kubelet.info().endpoint, "prepare", ("default", "keep", uid)).claims[uid]
    assert not again.error and again == first
    api.failing = False
    assert (dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").exists()
    kubelet.call(info.endpoint, "unprepare", ("default", "keep", uid))
    assert not (dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").exists()


def test_a_removed_registration_socket_is_served_again(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    kubelet.info()
    os.unlink(kubelet.reg)
    assert kubelet.info(timeout=5).name == dra.DRIVER


def test_a_container_with_the_cdi_edits_joins_with_the_claims_memsize(plugin, template, tmp_path):  # noqa: F811
    """End to end on this node: Prepare's CDI spec applied as a runtime applies it (its env and
    mounts), a real runc container with the hook, the tree: 3 GiB exactly."""
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    uid = api.add_claim("default", "run", [result("gpu-0", memory="3Gi")])["metadata"]["uid"]
    (dev,) = kubelet.call(info.endpoint, "prepare", ("default", "run", uid)).claims[uid].devices
    spec = json.loads((dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").read_text())
    (name,) = [c.split("=", 1)[1] for c in dev.cdi_device_ids]
    (device,) = [x for x in spec["devices"] if x["name"] == name]
    env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
    binds = [{"destination": m["containerPath"], "source": m["hostPath"], "type": "bind", "options": m["options"]}
             for m in spec["containerEdits"]["mounts"]]
    assert binds[0]["source"] == os.fspath(d.socket.parent / "tenant")
    assert binds[0]["destination"] == os.fspath(d.socket.parent)
    runc = Runc(tmp_path, template, d.socket)
    cid = runc.start(runc.bundle(env, ["sleep", "60"], mounts=binds))
    try:
        assert d.instances(0) == [cid[:12]]
        assert d.value(f"0/{cid[:12]}/memsize") == str(3 * GIB)
    finally:
        runc.cleanup()
    assert d.instances(0) == []


@pytest.mark.parametrize("plugin", [("sim:1xT4", ("--mode", "share"))], indirect=True)
def test_seed_004_a_share_node_publishes_128_mib_units_and_2_gib_is_16_of_them(plugin, template, tmp_path):  # noqa: F811
    """Seed 004: on a node in `share` mode the unit is 128 MiB (the daemon's, not a flag of the plugin's):
    the T4's 118 units in the slice, and `aliyun.com/gpu-mem: 16` (a claim of 2 GiB through the webhook)
    is a container of 2 GiB: 16 units in its environment."""
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    s = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    gpu = s["spec"]["devices"][0]
    assert gpu["attributes"]["memoryUnit"] == {"int": 128 * MIB}
    assert gpu["capacity"]["memory"]["value"] == str(118 * 128 * MIB)
    assert gpu["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == str(128 * MIB)
    uid = api.add_claim("default", "seed-004", [result("gpu-0", memory="2Gi")])["metadata"]["uid"]
    (dev,) = kubelet.call(info.endpoint, "prepare", ("default", "seed-004", uid)).claims[uid].devices
    assert list(dev.cdi_device_ids) == [f"cgpu.aliyun.com/gpu={uid}-gpu"]
    env = spec_env(dirs, uid)
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "16"
    runc = Runc(tmp_path, template, d.socket)
    cid = runc.start(runc.bundle(env, ["sleep", "60"]))
    try:
        assert d.value(f"0/{cid[:12]}/memsize") == str(2 * GIB)
    finally:
        runc.cleanup()


def test_a_plugin_started_wrong_says_why_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = os.fspath(tmp_path)  # (no ~/.kube/config)
    base = [CGPU, "dra-plugin", "--node-name", NODE, "--state-dir", os.fspath(tmp_path / "state"),
            "--cdi-dir", os.fspath(tmp_path / "cdi"), "--plugin-dir", os.fspath(tmp_path / "plugin")]
    for extra, why in ((["--registry-dir", os.fspath(tmp_path / "none")], f"--registry-dir: {tmp_path}/none does not "
                        "exist: is this a Kubernetes node (kubelet running)?"),
                       (["--registry-dir", os.fspath(tmp_path)], "no cluster to ask")):
        r = subprocess.run(base + extra, capture_output=True, text=True, env=env, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and why in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "cdi").exists() and not (tmp_path / "plugin").exists()  # nothing made


def spec_env(dirs, uid: str) -> dict[str, str]:
    spec = json.loads((dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").read_text())
    (device,) = spec["devices"]
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def test_at_start_every_prepared_claims_spec_is_written_again_and_the_gone_claims_collected(plugin):
    """A reboot empties /var/run/cdi (tmpfs) and the kubelet starts a prepared claim's containers
    again with no new Prepare: before the plugin registers, each record's spec is back; a record
    whose claim is gone (deleted while the node was down) is collected."""
    d, api, dirs, kubelet, start, stop = plugin
    info = kubelet.info()
    keep = api.add_claim("default", "keep", [result("gpu-1", memory="4Gi")])["metadata"]["uid"]
    gone = api.add_claim("default", "gone", [result("gpu-0", memory="2Gi")])["metadata"]["uid"]
    for name, uid in (("keep", keep), ("gone", gone)):
        assert not kubelet.call(info.endpoint, "prepare", ("default", name, uid)).claims[uid].error
    before = spec_env(dirs, keep)
    stop()
    shutil.rmtree(dirs["cdi"])  # the reboot
    with api.lock:
        api.delete("resourceclaims", ("default", "gone"))
    start()
    kubelet.info()  # (registered: the kubelet may call now)
    env = spec_env(dirs, keep)
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("1", "4") and env == before
    assert not (dirs["cdi"] / f"cgpu.aliyun.com-{gone}.json").exists() and not (dirs["state"] / f"{gone}.json").exists()
    assert (dirs["state"] / f"{keep}.json").exists()


def test_a_claim_allocated_anew_under_its_uid_is_prepared_for_its_new_allocation(plugin):
    """A record hit compares the claim's allocation: a claim deallocated and allocated again (the
    node was away when its pod went) gets its new GPU and memory, not the old record's."""
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    uid = api.add_claim("default", "again", [result("gpu-0", memory="3Gi")])["metadata"]["uid"]
    assert not kubelet.call(info.endpoint, "prepare", ("default", "again", uid)).claims[uid].error
    api._edit("resourceclaims", ("default", "again"), lambda c: c["status"]["allocation"]["devices"].update(
        results=[result("gpu-1", memory="5Gi", share="s9")]))
    (dev,) = kubelet.call(info.endpoint, "prepare", ("default", "again", uid)).claims[uid].devices
    assert (dev.device_name, dev.share_id) == ("gpu-1", "s9")
    env = spec_env(dirs, uid)
    assert (env["ALIYUN_COM_GPU_MEM_IDX"], env["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("1", "5")


def test_a_claim_whose_api_call_hangs_holds_up_no_other_claim(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    import threading

    info = kubelet.info()
    slow = api.add_claim("default", "slow", [result("gpu-0", memory="1Gi")])["metadata"]["uid"]
    fast = api.add_claim("default", "fast", [result("gpu-1", memory="2Gi", share="s2")])["metadata"]["uid"]
    api.hang.add(("default", "slow"))
    answers = {}
    t = threading.Thread(target=lambda: answers.update(
        slow=kubelet.call(info.endpoint, "prepare", ("default", "slow", slow)).claims[slow]))
    t.start()
    wait_for(lambda: api.hanging == 1, why="the slow claim never asked")
    resp = kubelet.call(info.endpoint, "prepare", ("default", "fast", fast)).claims[fast]  # (gRPC timeout 30 s)
    assert not resp.error and spec_env(dirs, fast)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert "slow" not in answers
    api.release.set()
    t.join(60)
    # the slow claim is answered: prepared once the server answers, or (a loaded machine past the
    # plugin's 10 s timeout on its call) refused with the reason, for the kubelet to try again
    slow_error = answers["slow"].error
    if slow_error:
        assert slow_error.startswith("cannot read ResourceClaim default/slow: ") and "\n" not in slow_error, slow_error
    else:
        assert spec_env(dirs, slow)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "1"


def test_a_unit_change_writes_the_prepared_claims_in_the_new_unit_or_is_refused(plugin):
    """The environment is in the node's units: 3 GiB prepared on a 1 GiB node is 24 units once the
    node's daemon runs in `share` mode (128 MiB); back in 1 GiB units a 384 MiB claim cannot be said,
    so the new unit is refused (new claims told why, the slices left in 128 MiB) until it is gone."""
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    three = api.add_claim("default", "three", [result("gpu-0", memory="3Gi")])["metadata"]["uid"]
    assert not kubelet.call(info.endpoint, "prepare", ("default", "three", three)).claims[three].error
    d.stop()
    d.extra_args += ["--mode", "share"]
    d.start()
    wait_for(lambda: spec_env(dirs, three)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "24", why="not in 128 MiB units")
    small = api.add_claim("default", "small", [result("gpu-1", memory="384Mi", share="s3")])["metadata"]["uid"]
    assert not kubelet.call(info.endpoint, "prepare", ("default", "small", small)).claims[small].error
    assert spec_env(dirs, small)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "3"
    d.stop()
    d.extra_args.remove("share")
    d.extra_args.remove("--mode")
    d.start()
    late = api.add_claim("default", "late", [result("gpu-0", memory="1Gi", share="s4")])["metadata"]["uid"]
    resp = wait_for(lambda: "unit changed" in (r := kubelet.call(info.endpoint, "prepare", ("default", "late", late))
                                                .claims[late]).error and r, why="the unit change not refused")
    assert "the node's unit changed to 1073741824 bytes while claims holding other sizes are prepared " \
           "(default/small)" in resp.error, resp.error
    assert spec_env(dirs, small)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "3"  # (its spec stays in its own unit)
    s = api.slices[dra.slice_name(NODE, 0)]["spec"]["devices"][0]
    assert s["attributes"]["memoryUnit"] == {"int": 128 * MIB}
    kubelet.call(info.endpoint, "unprepare", ("default", "small", small))
    wait_for(lambda: api.slices[dra.slice_name(NODE, 0)]["spec"]["devices"][0]["attributes"]["memoryUnit"]
             == {"int": GIB}, why="the new unit not published once the claim was gone")
    assert spec_env(dirs, three)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "3"
    assert not kubelet.call(info.endpoint, "prepare", ("default", "late", late)).claims[late].error


# ---- publishing as upstream's slice controller does ---------------------------------------------


def test_slice_names_stay_within_253_characters_and_apart():
    long_a, long_b = "a" * 250 + ".b", "a" * 250 + ".c"
    names = {dra.slice_name(n, k) for n in (long_a, long_b) for k in (0, 1)}
    assert len(names) == 4
    for n in names:
        assert len(n) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", n), n
    assert dra.slice_name(NODE, 3) == f"{NODE}-cgpu.aliyun.com-3"


def test_slices_carry_an_owner_reference_to_their_node(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    kubelet.info()
    s = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    assert s["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": NODE,
                                                 "uid": api.nodes[NODE]["metadata"]["uid"], "controller": True}]


def test_a_server_that_drops_or_rewrites_fields_gets_the_slices_once_not_for_ever(plugin):
    """An API server with DRAConsumableCapacity off drops allowMultipleAllocations and the
    requestPolicy, and any server writes a quantity its own way: what it stored is what it will
    keep storing, so the plugin does not write again at each watch event."""
    d, api, dirs, kubelet, _, _ = plugin

    def gate_off(body: dict) -> None:
        if body["metadata"]["name"].endswith("-probe"):
            return  # (the plugin's probe at start saw the gate on: a server whose gate went off after, a downgrade)
        for dev in body["spec"].get("devices") or ():
            dev.pop("allowMultipleAllocations", None)
            for cap in (dev.get("capacity") or {}).values():
                cap.pop("requestPolicy", None)
                cap["value"] = f"{int(cap['value']) >> 30}Gi"

    api.store_slice = gate_off
    kubelet.info()
    wait_for(lambda: api.slices.get(dra.slice_name(NODE, 0)), why="no ResourceSlice published")
    time.sleep(1.5)  # (the plugin looks every 0.2 s; each of its writes is a watch event it sees)
    assert api.count("create", "resourceslices") == 1 and api.count("update", "resourceslices") == 0
    assert "stored ResourceSlice" in (Path(dirs["state"]).parent / "plugin.log").read_text()


def test_one_changed_slice_is_updated_at_its_generation_and_obsolete_slices_are_deleted(tmp_path, monkeypatch):
    from apiserver_standin import ApiServer
    from cgpud.k8s import draplugin

    api = ApiServer(tmp_path)
    try:
        monkeypatch.setenv("KUBECONFIG", os.fspath(tmp_path / "kubeconfig"))
        client = draplugin.Api(NODE)
        many = [dra.Gpu(i, f"GPU-{i}", "T4", 16 * GIB) for i in range(130)]
        two = dra.resource_slices(NODE, many, GIB)  # 128 devices a slice: 2 slices
        assert len(two) == 2 and client.publish(two)
        assert not client.publish(two)  # (the same: nothing written)
        changed = json.loads(json.dumps(two))
        changed[1]["spec"]["devices"][0]["attributes"]["model"] = {"string": "T4 (changed)"}
        assert client.publish(changed)
        assert api.count("update", "resourceslices") == 1
        assert [api.slices[dra.slice_name(NODE, k)]["spec"]["pool"]["generation"] for k in range(2)] == [1, 1]
        one = dra.resource_slices(NODE, many[:100], GIB)  # fewer devices: 1 slice at the next generation
        assert client.publish(one)
        assert sorted(api.slices) == [dra.slice_name(NODE, 0)]
        assert api.slices[dra.slice_name(NODE, 0)]["spec"]["pool"] == {"name": NODE, "generation": 2,
                                                                       "resourceSliceCount": 1}
        assert api.count("delete", "resourceslices") == 1
    finally:
        api.close()


# ---- versions -------------------------------------------------------------------------------------


def _start_refused(tmp_path, api) -> subprocess.CompletedProcess:
    """`cgpu dra-plugin` against `api` until it exits (120 s at most)."""
    (tmp_path / "registry").mkdir(exist_ok=True)
    p = subprocess.Popen([CGPU, "--socket", os.fspath(tmp_path / "none.sock"), "dra-plugin", "--node-name", NODE,
                          "--registry-dir", os.fspath(tmp_path / "registry"),
                          "--plugin-dir", os.fspath(tmp_path / "plugin"), "--cdi-dir", os.fspath(tmp_path / "cdi"),
                          "--state-dir", os.fspath(tmp_path / "state")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                         env=dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig)))
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _drop_consumable(body: dict) -> None:  # (an API server with DRAConsumableCapacity off: 1.34-1.35's default)
    for dev in body["spec"].get("devices") or ():
        dev.pop("allowMultipleAllocations", None)
        for cap in (dev.get("capacity") or {}).values():
            cap.pop("requestPolicy", None)


@pytest.mark.parametrize("server, says", [
    ("no-dra", "Error: the API server does not serve resource.k8s.io/v1 (DRA, GA in Kubernetes 1.34): use the "
               "device plugin and extender"),
    ("consumable-off", "Error: the API server drops a ResourceSlice device's allowMultipleAllocations and request "
                       "policy: the feature gate DRAConsumableCapacity is off"),
])
def test_an_api_server_that_cannot_serve_the_layout_is_refused_at_start_in_one_line_naming_why(tmp_path, server,
                                                                                              says):
    """Issue 47: the plugin reads what the server serves, not its version string: a server without DRA's
    v1 API (1.33 and older), or one that drops the shared device's fields (DRAConsumableCapacity off), is
    refused in one line that names the way on; nothing is published and the kubelet is never told of a
    plugin."""
    from apiserver_standin import ApiServer

    api = ApiServer(tmp_path)
    api.version = "v1.37.2"  # (what it says of itself is not what decides)
    if server == "no-dra":
        api.serves_dra = False
    else:
        api.store_slice = _drop_consumable
    try:
        r = _start_refused(tmp_path, api)
        assert r.returncode == 1, r.stderr
        (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("Error")]
        assert line.startswith(says), r.stderr
        assert "Traceback" not in r.stderr and not list((tmp_path / "registry").iterdir())
        assert api.count("create", "resourceslices") == 0
    finally:
        api.close()


def test_a_server_of_an_older_release_that_serves_the_layout_is_served_and_its_probe_stores_nothing(tmp_path):
    """An API server that calls itself 1.34 but serves v1 with DRAConsumableCapacity on (the gate set, as
    docs/kubernetes.md says to) is served: the plugin publishes its slices; its probe was a dry run, so
    nothing but the node's own slices is stored."""
    from apiserver_standin import ApiServer

    from cgpud.k8s import draserved

    api = ApiServer(tmp_path)
    api.version = "v1.34.4"
    api.add_node(NODE)
    try:
        from kubernetes import config

        served = draserved.probe(config.new_client_from_config(os.fspath(api.kubeconfig)), NODE)
        assert served == draserved.Served(taints=True)
        assert api.count("create-dry-run", "resourceslices") == 1 and not api.slices
    finally:
        api.close()


def test_a_server_that_drops_device_taints_gets_a_gpu_out_of_service_left_out_not_untainted():
    """DRADeviceTaints off (alpha until 1.35): a tainted device would be stored untainted and claims
    allocated on a GPU out of service; the plugin leaves that GPU out of its slices instead."""
    from cgpud.k8s import draserved

    sent = draserved.probe_slice(NODE)
    stored = json.loads(json.dumps(sent))
    stored["spec"]["devices"][0].pop("taints")
    assert draserved.judge(sent, sent) == draserved.Served(taints=True)
    assert draserved.judge(sent, stored) == draserved.Served(taints=False)
    gpus = [dra.Gpu(0, "GPU-0", "T4", 16 * GIB), dra.Gpu(1, "GPU-1", "T4", 16 * GIB, (dra.TAINT_XID, "79"))]
    on = dra.resource_slices(NODE, draserved.publishable(gpus, draserved.Served(taints=True)), GIB)[0]["spec"]["devices"]
    off = dra.resource_slices(NODE, draserved.publishable(gpus, draserved.Served(taints=False)), GIB)[0]["spec"]["devices"]
    assert [d["name"] for d in on] == ["gpu-0", "gpu-1"] and on[1]["taints"][0]["key"] == dra.TAINT_XID
    assert [d["name"] for d in off] == ["gpu-0"]


def _mode_of(api) -> tuple[str | None, dict | None]:
    node = api.nodes[NODE]
    cond = next((c for c in node["status"].get("conditions", []) if c["type"] == "CgpuModePending"), None)
    return node["metadata"].get("annotations", {}).get("cgpu.aliyun.com/gpu-schedule"), cond


def test_the_slices_follow_the_nodes_label_and_a_change_waits_for_the_prepared_claims(plugin):
    """The node's label ack.node.gpu.schedule is the mode (issue 37): the slice changes to what the
    new mode publishes, the daemon is told it (share: its 128 MiB unit); while a claim is prepared a
    change waits — the slice as it was, the condition CgpuModePending True and an event saying why,
    as the device plugin does — and takes effect when the claim is unprepared."""
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()

    def daemon_mode():
        from cgpud.client import Client

        with Client(os.fspath(d.socket), timeout=5) as c:
            return c.call("query")["mode"]

    def devices():
        return api.slices.get(dra.slice_name(NODE, 0), {}).get("spec", {}).get("devices")

    def mode_is(mode):
        return lambda: (ds := devices()) is not None and [x["attributes"]["mode"]["string"] for x in ds] == [mode] * 2

    wait_for(mode_is("cgpu"), why="no cgpu slice published")
    api.edit_node(NODE, lambda n: n["metadata"]["labels"].update({"ack.node.gpu.schedule": "core_mem"}))
    wait_for(mode_is("core_mem"), 30, "the slice did not follow the label to core_mem")
    assert devices()[0]["capacity"]["compute"]["value"] == "100"
    wait_for(lambda: _mode_of(api)[0] == "core_mem", 10, "the mode in force not written on the Node")
    api.edit_node(NODE, lambda n: n["metadata"]["labels"].update({"ack.node.gpu.schedule": "share"}))
    wait_for(lambda: mode_is("share")() and devices()[0]["attributes"]["memoryUnit"]["int"] == 128 * MIB, 30,
             "the slice did not follow the label to share (128 MiB: the daemon told its mode)")
    assert daemon_mode() == "share"

    # a claim prepared: the next change waits for it
    uid = api.add_claim("default", "held", [result("gpu-0", memory="1Gi")])["metadata"]["uid"]
    assert not kubelet.call(info.endpoint, "prepare", ("default", "held", uid)).claims[uid].error
    api.edit_node(NODE, lambda n: n["metadata"]["labels"].update({"ack.node.gpu.schedule": "disabled"}))
    cond = wait_for(lambda: (c := _mode_of(api)[1]) and c["status"] == "True" and c, 10, "no CgpuModePending")
    assert "asks for mode disabled; the node stays in mode share while 1 GPU user(s) run on it (default/held)" \
        in cond["message"], cond
    assert any(e["reason"] == "GpuModeChangeWaiting" and "default/held" in e["message"] for e in api.events)
    assert mode_is("share")() and _mode_of(api)[0] == "share" and daemon_mode() == "share"
    assert not kubelet.call(info.endpoint, "unprepare", ("default", "held", uid)).claims[uid].error
    wait_for(lambda: devices() == [], 30, "the disabled node's slice still has devices")
    assert _mode_of(api)[0] == "disabled" and _mode_of(api)[1]["status"] == "False"
    assert any(e["reason"] == "GpuModeChanged" and e["message"].startswith("mode share -> disabled")
               for e in api.events)
    # a claim allocated before the node was disabled is refused with the reason
    uid = api.add_claim("default", "late", [result("gpu-0", memory="1Gi")])["metadata"]["uid"]
    err = kubelet.call(info.endpoint, "prepare", ("default", "late", uid)).claims[uid].error
    assert err.startswith("this node's mode is disabled (ack.node.gpu.schedule)"), err
