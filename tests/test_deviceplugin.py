"""`cgpu device-plugin` against a kubelet stand-in written from the kubelet's
own api.proto (tests/kubelet_standin.py) and a real node daemon: units per
GPU with gpushare's IDs, health from the daemon, re-registration when the
kubelet restarts, preferred allocation, Allocate's environment, refusals as
gRPC errors with the reason — and end to end, a real runc container started
with exactly Allocate's environment joins the tree with the right memsize."""
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

from cgpud.k8s import resources as res
from cgpud.k8s.proto import api_pb2 as pb
from kubelet_standin import Kubelet, plugin_node
from test_runc import Runc, template  # noqa: F401  (a fixture)

CGPU = str(Path(sys.executable).parent / "cgpu")
T4_UNITS = 14  # a 15109 MiB T4 has 14 whole GiB
A10_UNITS = 22  # 23028 MiB


@pytest.fixture
def node(make_daemon, tmp_path):
    """A daemon on a T4 and an A10, a kubelet stand-in, and the plugin as its own process."""
    d = make_daemon(gpus="sim:1xT4,1xA10")
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    kubelet = Kubelet(os.fspath(plugin_dir))
    log = open(tmp_path / "plugin.log", "wb")
    proc = subprocess.Popen([CGPU, "--socket", os.fspath(d.socket), "device-plugin", "--plugin-dir",
                             os.fspath(plugin_dir)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    yield d, kubelet, proc, tmp_path / "plugin.log"
    proc.terminate()
    proc.wait(10)
    kubelet.stop()
    log.close()


def registered(kubelet, n: int = 1, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while len(kubelet.registrations) < n:
        assert time.monotonic() < deadline, "the plugin did not register"
        time.sleep(0.01)


def uuids(d) -> list[str]:
    from cgpud.client import Client

    with Client(os.fspath(d.socket)) as c:
        return [g["uuid"] for g in c.call("query")["gpus"]]


def test_registers_and_lists_each_gpus_own_units(node):
    d, kubelet, _, log = node
    registered(kubelet)
    assert log.read_text().count("without the API server") == 1, "says once what it cannot do without it"
    req = kubelet.registrations[0][1]
    assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "cgpu.sock", "aliyun.com/gpu-mem")
    assert req.options.get_preferred_allocation_available and kubelet.options.get_preferred_allocation_available
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, a10 = uuids(d)
    assert {f"{t4}-_-{j}" for j in range(T4_UNITS)} | {f"{a10}-_-{j}" for j in range(A10_UNITS)} == set(devs)
    assert set(devs.values()) == {"Healthy"}


def test_units_go_unhealthy_when_the_daemon_goes_and_healthy_when_it_is_back(node):
    d, kubelet, _, _ = node
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    d.stop()
    devs = kubelet.wait_devices(lambda ds: ds and set(ds.values()) == {"Unhealthy"})
    assert len(devs) == T4_UNITS + A10_UNITS
    d.start()
    kubelet.wait_devices(lambda ds: ds and set(ds.values()) == {"Healthy"})


def test_registers_again_when_the_kubelet_restarts(node):
    _, kubelet, _, _ = node
    registered(kubelet)
    for n in (2, 3):
        back = kubelet.restart()
        registered(kubelet, n, timeout=5)
        assert kubelet.registrations[-1][0] - back < 1.0, "re-registration took a second or more"
        kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)


def test_preferred_allocation_binpacks_on_one_gpu(node):
    d, kubelet, _, _ = node
    registered(kubelet)
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, a10 = uuids(d)
    picked = kubelet.preferred(sorted(devs), 3)
    assert len(picked) == 3 and {p.rpartition("-_-")[0] for p in picked} == {t4}, "binpack: the smaller GPU that fits"
    picked = kubelet.preferred(sorted(devs), 20)
    assert {p.rpartition("-_-")[0] for p in picked} == {a10}, "only the A10 has 20 units"
    with pytest.raises(grpc.RpcError) as err:
        kubelet.preferred(sorted(devs), 30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no 1 GPU(s) with 30 free" in err.value.details()


def test_allocate_gives_the_hooks_environment_and_refuses_with_the_reason(node):
    d, kubelet, _, _ = node
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, a10 = uuids(d)
    (env,) = kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1", f"{t4}-_-2"])
    assert env == {"NVIDIA_VISIBLE_DEVICES": t4, "ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_CONTAINER": "3",
                   "ALIYUN_COM_GPU_MEM_DEV": str(T4_UNITS), "ALIYUN_COM_GPU_MEM_POD": "3"}
    # the same allocation as the container's annotation, the channel the hook believes (a pod cannot write it)
    assert kubelet.annotations == [{"cgpu.aliyun.com/allocation-gpu-mem": json.dumps(env, sort_keys=True,
                                                                                     separators=(",", ":"))}]
    for ids, words in (([f"{t4}-_-99"], "is not one of this node's"),
                       (["GPU-foreign-_-0"], "is not one of this node's"),
                       ([f"{t4}-_-0", f"{a10}-_-0", f"{a10}-_-1"], "unevenly"),
                       ([], "no aliyun.com/gpu-mem units")):
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(ids)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details(), err.value


def test_a_gpu_filled_outside_kubernetes_is_refused_not_overfilled(node):
    """Memory promised to a container started without Kubernetes counts: the plugin refuses."""
    d, kubelet, _, _ = node
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, _ = uuids(d)
    outside(d, "register", name="outside00001", gpus=[0], memsize=12 << 30)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate([f"{t4}-_-{j}" for j in range(3)])
    assert "GPU 0 has 2 aliyun.com/gpu-mem units not promised" in err.value.details()


def outside(d, op: str, **args) -> None:
    """A container outside Kubernetes comes or goes (`register`/`deregister`); the plugin has seen it."""
    from cgpud.client import Client

    with Client(os.fspath(d.socket)) as c:
        c.call(op, **args)
    time.sleep(1.5)  # the plugin asks the daemon every second


def test_a_pod_started_with_allocates_environment_joins_with_that_memsize(node, template, tmp_path):  # noqa: F811
    """End to end on this node: Allocate's environment, a real runc container with the hook, the tree."""
    d, kubelet, _, _ = node
    registered(kubelet)
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    (env,) = kubelet.allocate(kubelet.preferred(sorted(devs), 3))
    (mounts,) = kubelet.mounts
    assert mounts == [(os.fspath(d.socket.parent / "tenant"), os.fspath(d.socket.parent), True)], \
        "the containers' socket directory, read-only, where the daemon's is"
    runc = Runc(tmp_path, template, d.socket)
    binds = [{"destination": c, "source": h, "type": "bind", "options": ["rbind", "ro" if ro else "rw"]}
             for h, c, ro in mounts]
    cid = runc.start(runc.bundle(env, ["sleep", "60"], mounts=binds))  # exactly Allocate's env and mounts
    try:
        # 3 of the T4's 14 units: the hook gives 3/14 of its memory (gpushare's ALIYUN_COM_GPU_MEM_DEV rule)
        assert d.instances(0) == [cid[:12]]
        assert d.value(f"0/{cid[:12]}/memsize") == str((15109 << 20) * 3 // 14)
    finally:
        runc.cleanup()
    assert d.instances(0) == []


def test_resources_never_overfill_over_random_sequences():
    """Placement on mixed GPU sizes: whatever the sequence, no GPU gives more units than it has free."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        gpus = [res.Gpu(i, f"GPU-{i}", rng.choice([15109, 23028, 40960, 81920]) << 20, 0) for i in range(4)]
        used: dict[str, bool] = {}
        for _ in range(20):
            avail = [dev for dev, _ in res.devices(gpus, res.GIB) if dev not in used]
            size = rng.randint(1, 12)
            try:
                ids = res.preferred(avail, [], size, gpus, res.GIB, rng.choice(res.STRATEGIES))
            except res.AllocationError:
                continue
            env = res.allocation(ids, gpus, res.GIB)
            g = int(env["ALIYUN_COM_GPU_MEM_IDX"])
            gpus[g] = res.Gpu(g, gpus[g].uuid, gpus[g].memory, gpus[g].promised + size * res.GIB)
            used.update(dict.fromkeys(ids, True))
            assert all(x.promised <= x.memory for x in gpus)


def test_the_committed_grpc_code_is_the_proto_compiled(tmp_path):
    """cgpud/k8s/proto/api_pb2*.py are grpcio-tools' output for api.proto (the kubelet's, unchanged)."""
    from grpc_tools import protoc

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "cgpud" / "k8s" / "proto", tmp_path / "cgpud" / "k8s" / "proto",
                    ignore=shutil.ignore_patterns("*_pb2*.py", "__pycache__"))
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        os.fspath(tmp_path / "cgpud/k8s/proto/api.proto")]) == 0
    for name in ("api_pb2.py", "api_pb2_grpc.py"):
        fresh = (tmp_path / "cgpud/k8s/proto" / name).read_text().splitlines()
        committed = (root / "cgpud/k8s/proto" / name).read_text().splitlines()
        keep = [ln for ln in fresh if not ln.startswith("# Protobuf Python Version")]
        assert keep == [ln for ln in committed if not ln.startswith("# Protobuf Python Version")], name
    assert pb.DESCRIPTOR.package == "v1beta1" and "DevicePlugin" in pb.DESCRIPTOR.services_by_name


# ---- with the API server (stand-in) ----------------------------------------------------------


@pytest.fixture
def node_with_api(make_daemon, tmp_path):
    d = make_daemon(gpus="sim:1xT4,1xA10")
    with plugin_node(d, tmp_path, "gpu-node-1", {"cgpu.disable.isolation": "true"}) as (api, kubelet, proc):
        yield d, api, kubelet, proc


def test_publishes_the_node_and_follows_the_extenders_choice_per_container(node_with_api):
    d, api, kubelet, _ = node_with_api
    registered(kubelet)
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    deadline = time.monotonic() + 10
    while "cgpu.aliyun.com/gpu-mem-per-device" not in api.nodes["gpu-node-1"]["metadata"]["annotations"]:
        assert time.monotonic() < deadline, "the node was not published"
        time.sleep(0.05)
    node = api.nodes["gpu-node-1"]
    assert node["status"]["capacity"]["aliyun.com/gpu-count"] == "2"
    assert node["metadata"]["annotations"]["cgpu.aliyun.com/gpu-mem-per-device"] == f"{T4_UNITS},{A10_UNITS}"
    # the extender put a two-container pod (2 + 4 units) on GPU 1; the kubelet's fake IDs are on GPU 0
    api.add_pod("two", [2, 4], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "6", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    t4, a10 = uuids(d)
    (first,) = kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1"])
    assert first["ALIYUN_COM_GPU_MEM_IDX"] == "1" and first["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert first["CGPU_DISABLE"] == "true", "the node's cgpu.disable.isolation label"
    assert api.pods[("default", "two")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    (second,) = kubelet.allocate([f"{t4}-_-{j}" for j in range(2, 6)])
    assert second["ALIYUN_COM_GPU_MEM_IDX"] == "1" and second["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    assert api.pods[("default", "two")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"
    # no extender's choice left: the kubelet's own units decide
    (third,) = kubelet.allocate([f"{a10}-_-0"])
    assert third["ALIYUN_COM_GPU_MEM_IDX"] == "1" and third["ALIYUN_COM_GPU_MEM_CONTAINER"] == "1"
    assert sorted(devs) == sorted(kubelet.devices)


def test_the_whole_path_extender_plugin_container_tree_and_kubectl(node_with_api, template, tmp_path):  # noqa: F811
    """A pod asking 3 GiB: the extender binds it to the node and a GPU, the kubelet stand-in's
    Allocate gives its container env and mounts, a real runc container with exactly those joins
    the tree with its memsize, and the real `kubectl inspect cgpu` shows it on that GPU."""
    import json as _json
    import threading
    import urllib.request

    from cgpud.k8s import extender
    from cgpud.k8s.api import connect

    d, api, kubelet, _ = node_with_api
    registered(kubelet)
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    deadline = time.monotonic() + 10
    while "cgpu.aliyun.com/gpu-mem-per-device" not in api.nodes["gpu-node-1"]["metadata"]["annotations"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.environ["KUBECONFIG"] = os.fspath(api.kubeconfig)
    try:
        state = extender.State(*connect()).start()
        server = extender.make_server(state, "127.0.0.1", 0)
    finally:
        del os.environ["KUBECONFIG"]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api.add_pod("sees3", [3])
        url = f"http://127.0.0.1:{server.server_address[1]}/gpushare-scheduler/bind"
        body = _json.dumps({"PodName": "sees3", "PodNamespace": "default", "Node": "gpu-node-1"}).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=10) as r:
            assert _json.loads(r.read()) == {"Error": ""}
    finally:
        server.shutdown()
        state.stop()
    gpu = int(api.pods[("default", "sees3")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
    assert gpu == 0, "binpack: the T4 (fewer free units) before the A10"
    (env,) = kubelet.allocate(kubelet.preferred(sorted(devs), 3))
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert api.pods[("default", "sees3")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"
    env.pop("CGPU_DISABLE")  # (this node is labelled for no isolation; here the container is isolated)
    runc = Runc(tmp_path, template, d.socket)
    binds = [{"destination": c, "source": h, "type": "bind", "options": ["rbind", "ro" if ro else "rw"]}
             for h, c, ro in kubelet.mounts[0]]
    cid = runc.start(runc.bundle(env, ["sleep", "60"], mounts=binds))
    try:
        assert d.value(f"0/{cid[:12]}/memsize") == str((15109 << 20) * 3 // 14)
        api.set_phase("default", "sees3", "Running")
        r = subprocess.run([shutil.which("kubectl"), "inspect", "cgpu"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig),
                                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[1].split() == ["gpu-node-1", "192.168.0.1", f"3/{T4_UNITS}", f"0/{A10_UNITS}",
                                                    f"3/{T4_UNITS + A10_UNITS}"]
    finally:
        runc.cleanup()


def test_allocate_while_the_daemon_is_down_says_so(node):
    d, kubelet, _, _ = node
    registered(kubelet)
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    d.stop()
    kubelet.wait_devices(lambda ds: set(ds.values()) == {"Unhealthy"})
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(sorted(devs)[:1])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "cgpud does not answer" in err.value.details()


def wait_for(pred, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


def published(api) -> None:
    wait_for(lambda: "cgpu.aliyun.com/gpu-mem-per-device" in api.nodes["gpu-node-1"]["metadata"]["annotations"],
             "the node was not published")


def up(d, api, kubelet) -> tuple[dict[str, str], str, str]:
    """Registered, listing every unit, the node published: (devices, T4's UUID, A10's UUID)."""
    registered(kubelet)
    devs = kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    published(api)
    return devs, *uuids(d)


def test_a_gpu_the_daemon_loses_goes_unhealthy_alone_and_comes_back(node):
    """The daemon restarted with the A10 gone: only the A10's units are Unhealthy; back, all Healthy."""
    d, kubelet, _, _ = node
    registered(kubelet)
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
    t4, a10 = uuids(d)
    d.stop()
    d.gpus = "sim:1xT4"
    (d.state_dir / "state.json").unlink()  # (its state names both GPUs: the daemon would refuse it)
    d.start()
    devs = kubelet.wait_devices(lambda ds: ds.get(f"{a10}-_-0") == "Unhealthy" and ds.get(f"{t4}-_-0") == "Healthy")
    assert {dev for dev, h in devs.items() if h == "Unhealthy"} == {f"{a10}-_-{j}" for j in range(A10_UNITS)}
    with pytest.raises(grpc.RpcError) as err:  # the lost GPU's units are not allocated
        kubelet.allocate([f"{a10}-_-0"])
    assert "is not one of this node's" in err.value.details()
    d.stop()
    d.gpus = "sim:1xT4,1xA10"
    (d.state_dir / "state.json").unlink()
    d.start()
    kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS and set(ds.values()) == {"Healthy"})


def test_the_nodes_labels_are_followed_while_it_runs(node_with_api):
    d, api, kubelet, _ = node_with_api
    devs, t4, a10 = up(d, api, kubelet)
    assert kubelet.allocate([f"{t4}-_-0"])[0]["CGPU_DISABLE"] == "true"
    assert {p.rpartition("-_-")[0] for p in kubelet.preferred(sorted(devs), 3)} == {t4}, "binpack by default"
    def relabel(node):
        node["metadata"]["labels"]["ack.node.gpu.placement"] = "spread"
        del node["metadata"]["labels"]["cgpu.disable.isolation"]

    api.edit_node("gpu-node-1", relabel)
    wait_for(lambda: {p.rpartition("-_-")[0] for p in kubelet.preferred(sorted(devs), 3)} == {a10},
             "spread: the GPU with the most free units")
    assert "CGPU_DISABLE" not in kubelet.allocate([f"{t4}-_-0"])[0], "the label is gone: isolated again"


def test_allocate_when_the_api_server_is_down_refuses_and_gives_nothing_away(node_with_api, tmp_path):
    d, api, kubelet, _ = node_with_api
    _, t4, _ = up(d, api, kubelet)
    api.add_pod("waits", [2], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "2", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    log = tmp_path / "plugin.log"
    said = log.read_text().count("pods on gpu-node-1: cannot watch")
    api.failing = True  # (its watches end; watching again is a 503)
    # Until the plugin has seen its watch end it answers from what the watch brought, rightly (a loaded
    # full run's first Allocate came before that and was given the choice): ask once it has said so.
    wait_for(lambda: log.read_text().count("pods on gpu-node-1: cannot watch") > said,
             "the plugin to see the API server down")

    def refused() -> grpc.RpcError | None:
        try:
            kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1"])
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("Allocate succeeded while the API server was down")

    wait_for(lambda: "503" in (refused().details() or ""), "Allocate refused, saying why")
    err = refused()
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot ask the API server which GPU the scheduler extender chose (" in err.details()
    api.failing = False
    env = None

    def allocated() -> bool:
        nonlocal env
        try:
            (env,) = kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1"])
        except grpc.RpcError as exc:
            assert "cannot ask the API server" in exc.details()
            return False
        return True

    wait_for(allocated, "Allocate works again once the API server is back")
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1", "the extender's choice, still there"
    assert api.pods[("default", "waits")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"


def test_an_extenders_choice_that_cannot_be_met_is_refused_and_kept(node_with_api):
    """A choice that cannot be met now (the GPU filled outside Kubernetes, a GPU the node lacks) is a
    gRPC error with the reason; the pod is not marked assigned, and its choice is taken once it can be."""
    d, api, kubelet, _ = node_with_api
    _, t4, _ = up(d, api, kubelet)
    api.add_pod("nogpu7", [1], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "7", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate([f"{t4}-_-0"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no GPU 7 on this node" in err.value.details()
    api.delete_pod("default", "nogpu7")
    api.add_pod("full", [4], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "2"})
    outside(d, "register", name="outside00002", gpus=[0], memsize=12 << 30)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate([f"{t4}-_-{j}" for j in range(4)])
    assert "GPU 0 has 2 aliyun.com/gpu-mem units not promised" in err.value.details()
    assert api.pods[("default", "full")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    outside(d, "deregister", name="outside00002")
    (env,) = kubelet.allocate([f"{t4}-_-{j}" for j in range(4)])
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0" and env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    assert api.pods[("default", "full")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"


def test_preferred_allocation_takes_the_units_of_the_gpu_the_extender_chose(node_with_api):
    """So the kubelet's count of each GPU's units stays true: binpack alone would take the T4's."""
    d, api, kubelet, _ = node_with_api
    devs, t4, a10 = up(d, api, kubelet)
    assert {p.rpartition("-_-")[0] for p in kubelet.preferred(sorted(devs), 3)} == {t4}
    api.add_pod("ona10", [3], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    picked = kubelet.preferred(sorted(devs), 3)
    assert {p.rpartition("-_-")[0] for p in picked} == {a10}
    (env,) = kubelet.allocate(picked)
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1" and env["NVIDIA_VISIBLE_DEVICES"] == a10


def test_a_pod_the_extender_put_on_two_gpus_gets_both(node_with_api):
    d, api, kubelet, _ = node_with_api
    devs, t4, a10 = up(d, api, kubelet)
    api.add_pod("both", [8], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "0,1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    picked = kubelet.preferred(sorted(devs), 8)
    assert sorted(p.rpartition("-_-")[0] for p in picked) == sorted([t4] * 4 + [a10] * 4), "4 units of each"
    (env,) = kubelet.allocate(picked)
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0,1" and env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{t4},{a10}" and env["ALIYUN_COM_GPU_MEM_POD"] == "8"
    # what the node's hook makes of it: 4 units on each, never more than the units counted for it
    from cgpud.client import Client
    from cgpud.containers.envspec import parse_env
    from cgpud.core.model import GpuInfo

    with Client(os.fspath(d.socket)) as c:
        gpus = [GpuInfo(g["index"], g["uuid"], g["name"], g["memory"]) for g in c.call("query")["gpus"]]
    assert env.pop("CGPU_DISABLE") == "true"  # (this node is labelled for no isolation; here: with it)
    shares = parse_env(env, gpus).shares
    assert [(s.gpu, s.memsize) for s in shares] == [(0, 4 << 30), (1, 4 << 30)]
    assert all(s.memsize <= 4 * g.memory // u for s, g, u in zip(shares, gpus, (T4_UNITS, A10_UNITS)))


def test_a_restarted_plugin_goes_on_with_the_pods_next_container(node_with_api, tmp_path):
    """How many of a pod's containers have their units is on the pod: a plugin restarted between
    a pod's two containers gives the second its own size (4), not the first's again."""
    d, api, kubelet, first = node_with_api
    _, t4, _ = up(d, api, kubelet)
    api.add_pod("two", [2, 2, 4], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1"])
    assert api.pods[("default", "two")]["metadata"]["annotations"]["cgpu.aliyun.com/gpu-mem-containers-given"] == "1"
    n = len(kubelet.registrations)
    first.terminate()
    first.wait(10)
    again = subprocess.Popen([CGPU, "--socket", os.fspath(d.socket), "device-plugin", "--plugin-dir",
                              kubelet.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig), NODE_NAME="gpu-node-1"))
    try:
        registered(kubelet, n + 1)
        kubelet.wait_devices(lambda ds: len(ds) == T4_UNITS + A10_UNITS)
        (second,) = kubelet.allocate([f"{t4}-_-2", f"{t4}-_-3"])
        assert second["ALIYUN_COM_GPU_MEM_IDX"] == "1", "the second container (2 units) is the extender's too"
        assert api.pods[("default", "two")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
        (third,) = kubelet.allocate([f"{t4}-_-{j}" for j in range(4, 8)])
        assert third["ALIYUN_COM_GPU_MEM_IDX"] == "1" and third["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
        assert api.pods[("default", "two")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"
    finally:
        again.terminate()
        again.wait(10)


@pytest.mark.parametrize("idx", ["zero", "-1", "0,,1", ""])
def test_a_malformed_choice_is_not_followed_and_is_said(node_with_api, idx, tmp_path):
    d, api, kubelet, _ = node_with_api
    _, t4, a10 = up(d, api, kubelet)
    api.add_pod("odd", [2], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": idx, "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "soon",
        "cgpu.aliyun.com/gpu-mem-containers-given": "many"})
    (env,) = kubelet.allocate([f"{a10}-_-0", f"{a10}-_-1"])
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1" and env["NVIDIA_VISIBLE_DEVICES"] == a10, "the kubelet's own units"
    assert api.pods[("default", "odd")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    if idx:
        wait_for(lambda: "ALIYUN_COM_GPU_MEM_IDX=" in (tmp_path / "plugin.log").read_text(), "the log says so")
        assert (tmp_path / "plugin.log").read_text().count("is not a list of GPU indices") == 1


def test_the_plugin_implements_every_method_the_kubelet_calls():
    """api_pb2_grpc.py is grpcio-tools' output, kept as generated: its servicer base classes
    raise NotImplementedError. Every DevicePlugin method is ours (cgpud.k8s.deviceplugin.Plugin),
    and Registration.Register is the kubelet's side (tests/kubelet_standin.py)."""
    from cgpud.k8s.deviceplugin import Plugin
    from cgpud.k8s.proto import api_pb2_grpc as rpc

    for servicer, ours in ((rpc.DevicePluginServicer, Plugin), (rpc.RegistrationServicer, Kubelet)):
        methods = [m for m in vars(servicer) if not m.startswith("_")]
        assert methods and all(getattr(ours, m) is not getattr(servicer, m) for m in methods), (ours, methods)
    assert len([m for m in vars(rpc.DevicePluginServicer) if not m.startswith("_")]) == 5


def test_allocate_and_the_labels_come_from_watches_not_requests(node_with_api):
    """Over a few seconds of pods coming and going, Allocates following the extender's choices and a
    relabelled node: the plugin LISTed its pods and its node once and then only watched them (no
    LIST per Allocate, no GET of the node every --node-refresh); it writes only its marks."""
    d, api, kubelet, _ = node_with_api
    devs, t4, a10 = up(d, api, kubelet)
    ends, k = time.monotonic() + 3, 0
    while time.monotonic() < ends:
        k += 1
        api.add_pod(f"p{k}", [2], node="gpu-node-1", annotations={
            "ALIYUN_COM_GPU_MEM_IDX": str(k % 2), "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
            "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(k)})
        api.add_pod(f"elsewhere{k}", [2], node="gpu-node-2")
        (env,) = kubelet.allocate([f"{t4}-_-0", f"{t4}-_-1"])
        assert env["ALIYUN_COM_GPU_MEM_IDX"] == str(k % 2), "the extender's choice, from the watch"
        api.set_phase("default", f"p{k}", "Running")
        api.delete_pod("default", f"elsewhere{k}")
        if k > 2:
            api.delete_pod("default", f"p{k - 2}")
    api.edit_node("gpu-node-1", lambda n: n["metadata"]["labels"].update({"ack.node.gpu.placement": "spread"}))
    wait_for(lambda: {p.rpartition("-_-")[0] for p in kubelet.preferred(sorted(devs), 3)} == {a10},
             "the relabelled node's placement")
    assert k >= 3
    reads = {key: n for key, n in api.requests.items() if key[0] in ("list", "get")}
    assert reads == {("list", "pods"): 1, ("list", "nodes"): 1}, api.requests
    assert api.count("watch", "pods") >= 1 and api.count("watch", "nodes") >= 1
    assert api.count("patch", "pods") == k, "each Allocate marks its pod assigned"


def test_a_quiet_watch_kept_fresh_by_bookmarks_needs_no_list_after_a_break(node_with_api):
    """Pods come and go on other nodes, far more than the API server keeps history for (50 changes):
    the plugin's watch of its own node's pods sees none of them, but bookmarks move its version on,
    so when the API server is away for a moment the watch goes on from there — no 410, no LIST."""
    d, api, kubelet, _ = node_with_api
    _, t4, _ = up(d, api, kubelet)
    for k in range(150):
        api.add_pod(f"other{k}", [1], node="gpu-node-2")
    time.sleep(0.6)  # bookmarks (every 0.2 s here)
    api.failing = True
    time.sleep(0.3)
    api.failing = False
    api.add_pod("after", [3], node="gpu-node-1", annotations={
        "ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})

    def follows() -> bool:
        try:
            (env,) = kubelet.allocate([f"{t4}-_-{j}" for j in range(3)])
        except grpc.RpcError as exc:
            assert "cannot ask the API server" in exc.details()
            return False
        assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1"
        return True

    wait_for(follows, "the plugin watches again and follows the choice made after the break")
    assert api.count("list", "pods") == 1, api.requests
    assert api.count("watch", "pods") >= 2, "watched again after the break"
