"""GPU health (issue 38, docs/gpus.md "Health"): the state machine on a mock clock; the NVML
stand-in's events through the real pynvml; the daemon end to end on the stand-in (Xid 79 takes a GPU
out of service: query, cgpu-smi, metrics and doctor say so, nothing of it stays frozen; it comes back
after the quiet time) and on simulated GPUs (the sim-faults file)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cgpud.client import Client
from cgpud.gpus.health import DEFAULT_IGNORED_XIDS, Health, Policy, parse_xids, disabled_by_env
from nvml_stub import T4_TOTAL, NvmlStub, StubGpu
from test_cgpu_run import wait_for

UUID0 = "GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab"
UUID1 = "GPU-2d6c7a1f-bbbb-4e4f-8b62-fedcba987654"
BIN = Path(sys.executable).parent


# ---- the state machine (pure, on a mock clock: plain numbers) ---------------------------------


def test_a_critical_xid_takes_the_gpu_out_and_the_applications_own_do_not():
    h = Health(2, Policy(quiet=10))
    for xid in sorted(DEFAULT_IGNORED_XIDS):  # NVIDIA's list: 13, 31, 43, 45, 68, 109
        assert h.observe(("xid", 0, xid), 0.0) == []
    assert h.healthy(0)
    assert h.observe(("xid", 0, 79), 1.0) == [0]
    assert not h.healthy(0) and h.healthy(1)
    g = h.gpus[0]
    assert g.last_xid == 79 and "fallen off the bus" in g.reason and "reset" in g.advice


def test_double_bit_ecc_and_a_lost_gpu_take_it_out():
    h = Health(3)
    assert h.observe(("ecc", 1, 0), 0.0) == [1]
    assert h.observe(("answers", 2, 0), 0.0) == [2]
    assert [g.healthy for g in h.gpus] == [True, False, False]
    assert "ECC" in h.gpus[1].reason and "GPU_IS_LOST" in h.gpus[2].reason


def test_back_after_the_quiet_time_counted_from_the_last_failure():
    h = Health(1, Policy(quiet=10))
    h.observe(("xid", 0, 48), 0.0)
    assert h.tick(9.9) == []
    h.observe(("xid", 0, 48), 5.0)  # a second event of the same incident: the quiet time starts again
    assert h.gpus[0].failures == 1
    assert h.tick(14.9) == [] and not h.healthy(0)
    assert h.tick(15.0) == [0] and h.healthy(0)
    assert h.gpus[0].last_xid == 48 and h.gpus[0].reason == ""


def test_a_lost_gpu_is_back_only_once_it_answers_for_the_quiet_time():
    h = Health(1, Policy(quiet=10))
    h.observe(("answers", 0, 0), 0.0)
    for t in (5.0, 20.0, 30.0):  # still lost
        h.observe(("answers", 0, 0), t)
        assert h.tick(t) == []
    h.observe(("answers", 0, 1), 31.0)  # reset: answers again
    assert h.tick(39.9) == []
    assert h.tick(40.0) == [0]


def test_a_gpu_that_keeps_failing_stays_out():
    h = Health(1, Policy(quiet=1, max_failures=3, window=100))
    for t in (0.0, 10.0):
        h.observe(("xid", 0, 79), t)
        assert h.tick(t + 1) == [0]
    h.observe(("xid", 0, 79), 20.0)  # the third failure within 100 s
    assert h.gpus[0].retired and "stays out" in h.gpus[0].advice
    assert h.tick(1000.0) == [] and not h.healthy(0)


def test_failures_outside_the_window_do_not_count():
    h = Health(1, Policy(quiet=1, max_failures=2, window=100))
    h.observe(("xid", 0, 79), 0.0)
    h.tick(1.0)
    h.observe(("xid", 0, 79), 150.0)  # the first one is past the window
    assert not h.gpus[0].retired
    assert h.tick(151.0) == [0]


def test_placement_puts_nothing_on_a_gpu_out_of_service():
    from cgpud.containers.placement import PlacementError, check_named, place, states_from_node
    from cgpud.core.model import GpuInfo, Node

    node = Node([GpuInfo(i, f"GPU-{i}", "T4", 16 << 30) for i in range(2)])
    node.gpu(0).health = {"healthy": False, "reason": "Xid 79"}
    assert place(states_from_node(node), 1 << 30, 1) == [(1, 1 << 30)]
    with pytest.raises(PlacementError, match=r"GPU 0 out of service \(Xid 79\)"):
        check_named(states_from_node(node), [(0, 1 << 30)])
    node.gpu(1).health = {"healthy": False, "reason": "GPU is lost"}
    with pytest.raises(PlacementError, match="out of service"):
        place(states_from_node(node), 1 << 30, 1)


def test_configuration_is_checked():
    assert parse_xids("13, 31,,79") == {13, 31, 79} and parse_xids("") == frozenset()
    with pytest.raises(ValueError, match="not an Xid"):
        parse_xids("13,x")
    assert disabled_by_env("all") == (True, frozenset())
    assert disabled_by_env("48") == (False, {48})
    with pytest.raises(ValueError):
        Policy(max_failures=0)
    h = Health(1, Policy(ignored_xids=frozenset({79})))
    assert h.observe(("xid", 0, 79), 0.0) == [] and h.healthy(0)


def test_serve_refuses_a_bad_xid_list_in_one_line(tmp_path):
    r = subprocess.run([str(BIN / "cgpud"), "serve", "--health-ignore-xids", "13,abc", "--mount",
                        str(tmp_path / "m"), "--state-dir", str(tmp_path / "s"), "--socket", str(tmp_path / "c.sock")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "not an Xid" in r.stderr and "Traceback" not in r.stderr


# ---- the stand-in's events through the real pynvml ----------------------------------------------


@pytest.fixture(scope="module")
def libdir(tmp_path_factory) -> Path:
    return NvmlStub.build(tmp_path_factory.mktemp("nvml")).libdir


@pytest.fixture
def stub(libdir, tmp_path) -> NvmlStub:
    s = NvmlStub(libdir, tmp_path / "nvml-stub.conf")
    s.gpus = [StubGpu(UUID0, "Tesla T4", T4_TOTAL), StubGpu(UUID1, "Tesla T4", T4_TOTAL)]
    s.write()
    return s


EVENTS = r"""
import ctypes, json, sys, pynvml as nv
addr = lambda x: ctypes.cast(x, ctypes.c_void_p).value
nv.nvmlInit()
h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
s = nv.nvmlEventSetCreate()
out = {"supported": [nv.nvmlDeviceGetSupportedEventTypes(x) for x in h]}
for x in h:
    try:
        nv.nvmlDeviceRegisterEvents(x, nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError, s)
    except nv.NVMLError as e:
        out.setdefault("register", []).append(e.value)
        nv.nvmlDeviceRegisterEvents(x, nv.nvmlEventTypeXidCriticalError, s)
print("ready", flush=True)
sys.stdin.readline()
got = []
while True:
    try:
        d = nv.nvmlEventSetWait_v2(s, 200)
    except nv.NVMLError as e:
        got.append(["error", e.value]); break
    got.append([[addr(x) for x in h].index(addr(d.device)), d.eventType, d.eventData])
try:
    nv.nvmlDeviceGetMemoryInfo(h[1])
except nv.NVMLError as e:
    out["memory1"] = e.value
nv.nvmlEventSetFree(s)
out["got"] = got
print(json.dumps(out))
"""


def test_the_stand_in_delivers_xid_and_ecc_events_and_loses_a_gpu(stub):
    stub.xid(0, 31)  # before registering: not delivered
    stub.write()
    p = subprocess.Popen([sys.executable, "-c", EVENTS], env=stub.env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    stub.xid(0, 79)
    stub.ecc(1)
    stub.write()
    p.stdin.write("go\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=30)
    res = json.loads(out.splitlines()[-1])
    assert res["supported"][0] & 0xB == 0xB  # single- and double-bit ECC, Xid
    assert res["got"] == [[0, 0x8, 79], [1, 0x2, 0], ["error", 10]]  # then NVML_ERROR_TIMEOUT


def test_a_lost_gpu_fails_every_call_and_the_wait_and_a_gpu_without_ecc_refuses_its_events(stub):
    stub.gpus[0].ecc = False
    stub.write()
    p = subprocess.Popen([sys.executable, "-c", EVENTS], env=stub.env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    stub.xid(1, 79)
    stub.gpus[1].lost = True
    stub.write()
    p.stdin.write("go\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=30)
    res = json.loads(out.splitlines()[-1])
    assert res["register"] == [3]  # NVML_ERROR_NOT_SUPPORTED: GPU 0 has no ECC
    assert res["supported"][0] & 0x3 == 0
    # the pending event comes out, then the wait says the GPU is lost (15); a call on it too
    assert res["got"] == [[1, 0x8, 79], ["error", 15]] and res["memory1"] == 15


# ---- the daemon end to end ------------------------------------------------------------------


def metric(daemon, name: str, gpu: int) -> float | None:
    addr = re.findall(r"metrics on http://([0-9.]+:\d+)/metrics", daemon.log_text())
    assert addr, daemon.log_text()
    text = urllib.request.urlopen(f"http://{addr[0]}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'gpu="{gpu}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def health(daemon) -> list[dict]:
    with Client(str(daemon.socket)) as c:
        return [g["health"] for g in c.call("query")["gpus"]]


@pytest.fixture
def nvml_daemon(make_daemon, stub, monkeypatch):
    def start(*extra: str):
        for k, v in stub.env().items():
            monkeypatch.setenv(k, v)
        d = make_daemon(gpus="nvml", start=False, extra_args=extra)
        d.dev_dir.mkdir()
        for minor in (0, 1):
            (d.dev_dir / f"nvidia{minor}").write_text("")
        return d.start()
    return start


def smi(daemon) -> str:
    r = subprocess.run([str(BIN / "cgpu-smi"), "--socket", str(daemon.socket)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_xid_79_takes_the_gpu_out_of_service_and_it_comes_back_after_the_quiet_time(nvml_daemon, stub):
    d = nvml_daemon("--health-quiet", "1")
    assert [h["healthy"] for h in health(d)] == [True, True]
    stub.xid(1, 79)
    stub.gpus[1].lost = True
    stub.write()
    wait_for(lambda: not health(d)[1]["healthy"], timeout=30, what="GPU 1 out of service")
    h = health(d)
    assert h[0]["healthy"] and h[1]["last_xid"] == 79 and "fallen off the bus" in h[1]["reason"]
    assert "GPU 1 (" + UUID1 + ") failed: Xid 79" in d.log_text()
    text = smi(d)
    assert "GPU 1 OUT OF SERVICE: Xid 79" in text and "GPU 0 OUT OF SERVICE" not in text
    r = subprocess.run([str(BIN / "cgpu"), "--socket", str(d.socket), "doctor", "--mount", str(d.mount), "--json"],
                       capture_output=True, text=True, timeout=60)
    check = {c["check"]: c for c in json.loads(r.stdout)}["gpu health"]
    assert check["status"] == "fail" and "GPU 1" in check["message"] and "nvidia-smi -r" in check["message"]
    assert metric(d, "cgpu_gpu_healthy", 1) == 0 and metric(d, "cgpu_gpu_healthy", 0) == 1
    assert metric(d, "cgpu_gpu_last_xid", 1) == 79
    # reset: it answers again, and after the quiet time (1 s) it is back
    stub.gpus[1].lost = False
    stub.write()
    wait_for(lambda: health(d)[1]["healthy"], timeout=30, what="GPU 1 back in service")
    assert "answers healthily again" in d.log_text()
    assert health(d)[1]["last_xid"] == 79 and health(d)[1]["failures"] == 1
    assert "OUT OF SERVICE" not in smi(d)
    assert metric(d, "cgpu_gpu_healthy", 1) == 1 and metric(d, "cgpu_gpu_last_xid", 1) == 79
    # after the reset its events are still watched: a double-bit ECC error takes it out again
    stub.ecc(1)
    stub.write()
    wait_for(lambda: not health(d)[1]["healthy"], timeout=30, what="GPU 1 out of service again")
    assert health(d)[1]["reason"] == "double-bit ECC error" and health(d)[1]["failures"] == 2


def test_a_failed_gpu_keeps_its_instances_isolated(make_daemon, tmp_path):
    """Simulated GPUs fail through the state directory's sim-faults file. An instance alone on
    GPU 0 with max_inst 4 gets one slot in four (policy 0), so the scheduler freezes its cgroup for
    the rest. GPU 0 goes out of service: its scheduler goes on, the instance is still frozen outside
    its slots (issue 44: the scheduler stopped and thawed everything, for the quiet time at least and
    for good after three failures — a neighbour held there ran unshared). Back, it goes on the same."""
    from test_nvml import Run

    d = make_daemon(gpus="sim:2xT4", extra_args=("--health-quiet", "4"))
    d.write("0/max_inst", "4")
    job = Run(d, f"hlth{os.getpid() % 100000:05d}abc", "1G",
              (str(BIN / "cgpu"), "workload", "--seconds", "60"))
    try:
        events = job.group / "cgroup.events"
        wait_for(lambda: "frozen 1" in events.read_text(), timeout=30, what="the scheduler to freeze the instance")
        (d.state_dir / "sim-faults").write_text("event 0 xid 94\n")
        wait_for(lambda: not health(d)[0]["healthy"], timeout=30, what="GPU 0 out of service")
        seen = set()  # (its cgroup.freeze over 2 s: frozen outside its slots, thawed in them)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and len(seen) < 2:
            seen.add((job.group / "cgroup.freeze").read_text().strip())
            time.sleep(0.002)
        assert not health(d)[0]["healthy"], "back in service before the check (quiet time 4 s)"
        assert seen == {"0", "1"}, f"its instance is no longer scheduled while its GPU is out of service: {seen}"
        assert "contained ECC error" in d.log_text()
        wait_for(lambda: health(d)[0]["healthy"], timeout=30, what="GPU 0 back in service")
        wait_for(lambda: "frozen 1" in events.read_text(), timeout=30, what="the instance scheduled still")
    finally:
        job.stop()


# ---- Kubernetes: the device plugin over real gRPC, the extender ----------------------------------


@pytest.fixture
def plugin_node(make_daemon, tmp_path):
    """A daemon on a T4 and an A10 (quiet time 1 s), the API server and kubelet stand-ins, the plugin."""
    from kubelet_standin import plugin_node

    d = make_daemon(gpus="sim:1xT4,1xA10", extra_args=("--health-quiet", "1"))
    with plugin_node(d, tmp_path, "gpu-node-1") as (api, kubelet, _):
        yield d, api, kubelet


def test_every_unit_of_a_failed_gpu_goes_unhealthy_at_once_and_the_extender_places_nothing_there(plugin_node):
    """NVIDIA/k8s-device-plugin#1929: on a shared GPU only one replica went Unhealthy. Here every
    unit of the failed A10 goes in the same ListAndWatch answer, the T4's stay Healthy; the node's
    annotation tells the extender, which finds no room on the A10; back, all Healthy again."""
    from cgpud.k8s import extender
    from cgpud.k8s.api import connect

    d, api, kubelet = plugin_node
    t4_units, a10_units = 14, 22
    kubelet.wait_devices(lambda ds: len(ds) == t4_units + a10_units and set(ds.values()) == {"Healthy"}, timeout=30)
    with Client(str(d.socket)) as c:
        t4, a10 = [g["uuid"] for g in c.call("query")["gpus"]]
    seen: list[dict] = []

    def a10_out(ds):
        seen.append(dict(ds))
        return ds.get(f"{a10}-_-0") == "Unhealthy"

    faults = d.state_dir / "sim-faults"
    faults.write_text("event 1 xid 79\nlost 1\n")  # fallen off the bus: out until it answers again
    devs = kubelet.wait_devices(a10_out, timeout=30)
    assert {k for k, v in devs.items() if v == "Unhealthy"} == {f"{a10}-_-{j}" for j in range(a10_units)}
    for ds in seen:  # no answer had some of the A10's units Unhealthy and others not
        assert len({v for k, v in ds.items() if k.startswith(a10)}) <= 1, ds
    wait_for(lambda: api.nodes["gpu-node-1"]["metadata"]["annotations"].get("cgpu.aliyun.com/gpu-unhealthy") == "1",
             timeout=30, what="the node annotated")
    os.environ["KUBECONFIG"] = os.fspath(api.kubeconfig)
    try:
        state = extender.State(*connect()).start()
    finally:
        del os.environ["KUBECONFIG"]
    try:
        wait_for(lambda: "gpu-node-1" in state.nodes and state.nodes["gpu-node-1"].unhealthy == {1}, timeout=30,
                 what="the extender to see it")
        pod = api.add_pod("big20", [20])  # only the A10 has 20 units
        res = extender.filter_nodes(state, {"Pod": pod, "NodeNames": ["gpu-node-1"]})
        assert res["NodeNames"] == [] and "GPU1 out of service" in res["FailedNodes"]["gpu-node-1"]
        small = api.add_pod("small3", [3])
        assert extender.filter_nodes(state, {"Pod": small, "NodeNames": ["gpu-node-1"]})["NodeNames"] == ["gpu-node-1"]
        # reset: it answers again; after the quiet time (1 s) every unit is Healthy, the annotation gone
        faults.write_text("event 1 xid 79\n")
        kubelet.wait_devices(lambda ds: set(ds.values()) == {"Healthy"}, timeout=30)
        wait_for(lambda: not state.nodes["gpu-node-1"].unhealthy, timeout=30, what="the extender to see it back")
        res = extender.filter_nodes(state, {"Pod": pod, "NodeNames": ["gpu-node-1"]})
        assert res["NodeNames"] == ["gpu-node-1"]
    finally:
        state.stop()


def test_dra_taints_every_device_of_a_failed_gpu_noschedule():
    """NVIDIA's DRA driver's way: the failed GPU's device carries a NoSchedule taint saying why; the
    healthy GPU's carries none."""
    from cgpud.k8s import dra

    snap = {"gpus": [
        {"index": 0, "uuid": "GPU-a", "name": "T4", "memory": 4 << 30, "health": {"healthy": True}},
        {"index": 1, "uuid": "GPU-b", "name": "T4", "memory": 4 << 30,
         "health": {"healthy": False, "reason": "Xid 79 (GPU has fallen off the bus)", "last_xid": 79}}]}
    gpus = dra.gpus_from_query(snap)
    devs = [d for s in dra.resource_slices("n1", gpus, 1 << 30) for d in s["spec"].get("devices", [])]
    tainted = {d["name"]: d["taints"] for d in devs if "taints" in d}
    assert set(tainted) == {"gpu-1"}
    assert all(t == [{"key": "cgpu.aliyun.com/xid", "value": "79", "effect": "NoSchedule"}] for t in tainted.values())
    lost = {"healthy": False, "reason": "GPU is lost (NVML_ERROR_GPU_IS_LOST)", "lost": True, "last_xid": 0}
    assert dra.health_taint(lost) == ("cgpu.aliyun.com/gpu-lost", "true")
    assert dra.health_taint({"healthy": False, "reason": "double-bit ECC error"}) == ("cgpu.aliyun.com/ecc", "double-bit")
    # back in service: the slices change (the plugin publishes them again), untainted
    snap["gpus"][1]["health"] = {"healthy": True, "last_xid": 79}
    assert dra.gpus_from_query(snap) != gpus
    assert not any("taints" in d for s in dra.resource_slices("n1", dra.gpus_from_query(snap), 1 << 30)
                   for d in s["spec"].get("devices", []))


@pytest.mark.parametrize("service", ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
def test_dra_reports_device_health_to_the_kubelet_over_nodewatchresources(tmp_path, service):
    """KEP-4680: the DRA plugin serves v1.DRAResourceHealth (the kubelet's own proto, dra-health/v1)
    and v1alpha1's (the only one the kubelets of 1.34-1.36 call: 1.36.3's cluster tier found the
    health stream Unimplemented and no health in the pod's status), and advertises both; over real
    gRPC, every device of the failed GPU is UNHEALTHY with the reason, the other GPU's HEALTHY; back
    in service, HEALTHY again in the next answer."""
    import threading
    from concurrent import futures

    import grpc

    from cgpud.k8s import dra, drahealth, draplugin
    from cgpud.k8s.proto import drahealth_pb2 as hpb

    class Node:  # what the plugin keeps of the daemon's answer (draplugin.Node)
        gpus = [dra.Gpu(0, "GPU-a", "T4", 2 << 30), dra.Gpu(1, "GPU-b", "T4", 2 << 30)]
        unit = 1 << 30

    stop = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    drahealth.add_to_server(drahealth.Health(Node, "node-1", stop), server)
    sock = tmp_path / "dra.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        assert service in draplugin.Registration("x").GetInfo(None, None).supported_versions
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            call = ch.unary_stream(f"/{service}/NodeWatchResources",
                                   request_serializer=hpb.NodeWatchResourcesRequest.SerializeToString,
                                   response_deserializer=hpb.NodeWatchResourcesResponse.FromString)
            stream = call(hpb.NodeWatchResourcesRequest(), timeout=20)
            first = next(stream)
            assert {(d.device.pool_name, d.device.device_name, d.health) for d in first.devices} == {
                ("node-1", n, hpb.HEALTHY) for n in ("gpu-0", "gpu-1")}
            Node.gpus = [Node.gpus[0], dra.Gpu(1, "GPU-b", "T4", 2 << 30, (dra.TAINT_XID, "79"))]
            second = next(stream)
            bad = {d.device.device_name: d.message for d in second.devices if d.health == hpb.UNHEALTHY}
            assert set(bad) == {"gpu-1"} and all("Xid 79" in m for m in bad.values())
            Node.gpus = [Node.gpus[0], dra.Gpu(1, "GPU-b", "T4", 2 << 30)]
            assert {d.health for d in next(stream).devices} == {hpb.HEALTHY}
            stream.cancel()
    finally:
        stop.set()
        server.stop(0)


RACE = r"""
import threading, pynvml as nv
nv.nvmlInit()
h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
bad = []
def loop():
    for _ in range(2000):
        for x in h:
            try:
                nv.nvmlDeviceGetMemoryInfo(x).total == %d or bad.append("wrong total")
            except nv.NVMLError as e:
                bad.append(str(e))
ts = [threading.Thread(target=loop) for _ in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
print(len(bad), sorted(set(bad)))
"""


def test_the_stand_in_answers_right_from_two_threads_at_once(stub):
    """The daemon calls NVML from two threads (the memory watchdog, the health watch), as the real
    library allows; the stand-in re-reads its file at every call, into a copy per thread (a shared
    one answered Invalid Argument while the other thread was reading it)."""
    r = subprocess.run([sys.executable, "-c", RACE % T4_TOTAL], env=stub.env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "0", r.stdout
