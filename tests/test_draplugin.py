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
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

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


def opaque(requests=None, **params) -> dict:
    return {"source": "FromClaim", "requests": requests or [],
            "opaque": {"driver": dra.DRIVER, "parameters": {"apiVersion": dra.CONFIG_API_VERSION,
                                                            "kind": dra.CONFIG_KIND, **params}}}


# ---- pure: the slice, the shares, the environment --------------------------------------------


def test_the_slices_have_each_gpu_sharing_its_memory_and_each_unit_drawing_on_the_same_counter():
    slices = dra.resource_slices(NODE, [T4, A10], 128 * MIB)
    # counters first (a slice holds counters or devices), then at most 64 devices a slice: 2 GPUs +
    # 118 + 179 units of 128 MiB are 299 devices in 5 slices, one pool
    assert [len(x["spec"].get("devices", [])) for x in slices] == [0, 64, 64, 64, 64, 43]
    for k, x in enumerate(slices):
        assert x["metadata"]["name"] == f"{NODE}-cgpu.aliyun.com-{k}" and x["spec"]["driver"] == dra.DRIVER
        assert x["spec"]["nodeName"] == NODE
        assert x["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 6}
    assert slices[0]["spec"]["sharedCounters"] == [
        {"name": "gpu-0", "counters": {"memory": {"value": str(118 * 128 * MIB)}}},
        {"name": "gpu-1", "counters": {"memory": {"value": str(179 * 128 * MIB)}}}]
    devs = [d for x in slices for d in x["spec"].get("devices", [])]
    t4, a10 = devs[:2]
    assert t4["name"] == "gpu-0" and t4["allowMultipleAllocations"] is True
    assert t4["attributes"] == {"uuid": {"string": "GPU-t4"}, "model": {"string": "Tesla T4"}, "index": {"int": 0},
                                "memoryUnit": {"int": 128 * MIB}, "kind": {"string": "gpu"}}
    # 15109 MiB is 118 whole units of 128 MiB (15104 MiB): never more than the units the hook can give
    assert t4["capacity"]["memory"] == {"value": str(118 * 128 * MIB), "requestPolicy": {
        "default": str(128 * MIB), "validRange": {"min": str(128 * MIB), "step": str(128 * MIB)}}}
    assert t4["consumesCounters"] == [{"counterSet": "gpu-0", "counters": {"memory": {"value": str(118 * 128 * MIB)}}}]
    units = [d for d in devs if d["attributes"]["kind"] == {"string": "memory-unit"}]
    assert [d["name"] for d in units[:2]] == ["gpu-0-unit-0", "gpu-0-unit-1"] and len(units) == 118 + 179
    assert units[-1]["name"] == "gpu-1-unit-178" and "allowMultipleAllocations" not in units[-1]
    assert units[-1]["consumesCounters"] == [{"counterSet": "gpu-1", "counters": {"memory": {"value": str(128 * MIB)}}}]
    assert dra.resource_slices(NODE, [T4], GIB)[1]["spec"]["devices"][0]["capacity"]["memory"]["value"] == \
        str(14 * GIB)


def test_the_slices_are_valid_objects_of_the_official_clients_model():
    from kubernetes import client

    from test_manifests import unknown

    for body in dra.resource_slices(NODE, [T4, A10], GIB):
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
    assert spec["containerEdits"]["mounts"] == [{"hostPath": "/run/cgpud", "containerPath": "/run/cgpud",
                                                 "options": ["rbind", "rw"]}]


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

    def info(self, timeout: float = 15):
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
            return (stub.NodePrepareResources if method == "prepare" else stub.NodeUnprepareResources)(req, timeout=10)


@pytest.fixture
def plugin(make_daemon, tmp_path, request):
    from apiserver_standin import ApiServer

    gpus, extra = getattr(request, "param", ("sim:1xT4,1xA10", ()))  # (indirect parametrization)
    d = make_daemon(gpus=gpus, extra_args=extra)
    api = ApiServer(tmp_path)
    dirs = {k: tmp_path / k for k in ("registry", "plugin", "cdi", "state")}
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


def wait_for(what, timeout: float = 15, why: str = ""):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    return got


def test_registers_through_the_plugin_watcher_and_publishes_the_nodes_slice(plugin):
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
        ("DRAPlugin", dra.DRIVER, os.fspath(dirs["plugin"] / "dra.sock"), ["v1.DRAPlugin", "v1.DRAResourceHealth"])
    s = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 1)), why="no ResourceSlice published")
    assert [x["name"] for x in s["spec"]["devices"][:3]] == ["gpu-0", "gpu-1", "gpu-0-unit-0"]
    assert s["spec"]["devices"][0]["attributes"]["model"] == {"string": "Tesla T4"}
    assert s["spec"]["devices"][1]["capacity"]["memory"]["value"] == str(22 * GIB)
    assert api.slices[dra.slice_name(NODE, 0)]["spec"]["sharedCounters"][1]["name"] == "gpu-1"
    assert len(api.slices) == 2 and api.count("create", "resourceslices") == 2


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
    wait_for(lambda: api.slices.get(dra.slice_name(NODE, 1)), why="no ResourceSlice published once registered")


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
    first = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 1)), why="no ResourceSlice published")
    with api.lock:
        for k in (0, 1):
            api.delete("resourceslices", dra.slice_name(NODE, k))
    again = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 1)), 5, "the deleted slices not written again")
    assert again["spec"]["devices"] == first["spec"]["devices"] and dra.slice_name(NODE, 0) in api.slices
    assert api.count("get", "resourceslices") == 0 and api.count("list", "resourceslices") == 1


def test_a_changed_node_is_published_again_with_the_next_generation(plugin, make_daemon):
    d, api, dirs, kubelet, start, stop = plugin
    kubelet.info()
    wait_for(lambda: api.slices.get(dra.slice_name(NODE, 1)), why="no ResourceSlice published")
    stop()
    d.stop()
    d.gpus = "sim:1xT4"  # the node's GPUs changed while the plugin was away (its state is of the old ones)
    (Path(d.state_dir) / "state.json").unlink()
    d.start()
    start()
    kubelet.info()  # (the kubelet's plugin watcher registers the new process)
    s = wait_for(lambda: (x := api.slices[dra.slice_name(NODE, 1)]) and x["spec"]["pool"]["generation"] == 2 and x,
                 why="the slices not written again")
    assert [x["name"] for x in s["spec"]["devices"]][:2] == ["gpu-0", "gpu-0-unit-0"]
    assert s["spec"]["pool"]["resourceSliceCount"] == 2
    time.sleep(1)  # (the plugin looks every 0.2 s: nothing more is written for a node that did not change)
    assert api.count("update", "resourceslices") == 2 and api.slices[dra.slice_name(NODE, 1)] == s
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
    with api.lock:
        api.delete("resourceclaims", ("default", "keep"))  # the restarted plugin cannot read it again
    start()
    again = kubelet.call(kubelet.info().endpoint, "prepare", ("default", "keep", uid)).claims[uid]
    assert not again.error and again == first
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
    assert binds[0]["source"] == os.fspath(d.socket.parent)
    runc = Runc(tmp_path, template, d.socket)
    cid = runc.start(runc.bundle(env, ["sleep", "60"], mounts=binds))
    try:
        assert d.instances(0) == [cid[:12]]
        assert d.value(f"0/{cid[:12]}/memsize") == str(3 * GIB)
    finally:
        runc.cleanup()
    assert d.instances(0) == []


@pytest.mark.parametrize("plugin", [("sim:1xT4", ("--mode", "share"))], indirect=True)
def test_seed_004_a_share_node_publishes_128_mib_units_and_16_of_them_are_2_gib(plugin, template, tmp_path):  # noqa: F811
    """Seed 004: on a node in `share` mode the unit is 128 MiB (the daemon's, not a flag of the plugin's):
    the T4's 118 units in the slices, and `aliyun.com/gpu-mem: 16` (16 unit devices) is a container of 2 GiB."""
    d, api, dirs, kubelet, _, _ = plugin
    info = kubelet.info()
    s = wait_for(lambda: api.slices.get(dra.slice_name(NODE, 1)), why="no ResourceSlice published")
    gpu = s["spec"]["devices"][0]
    assert gpu["attributes"]["memoryUnit"] == {"int": 128 * MIB}
    assert gpu["capacity"]["memory"]["value"] == str(118 * 128 * MIB)
    assert gpu["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == str(128 * MIB)
    uid = api.add_claim("default", "seed-004", [result(f"gpu-0-unit-{j}", request="container-0-request-0",
                                                       memory=None) for j in range(16)])["metadata"]["uid"]
    (dev, *rest) = kubelet.call(info.endpoint, "prepare", ("default", "seed-004", uid)).claims[uid].devices
    assert len(rest) == 15 and all(not r.cdi_device_ids for r in rest)  # the request's CDI device once
    spec = json.loads((dirs["cdi"] / f"cgpu.aliyun.com-{uid}.json").read_text())
    env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
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
