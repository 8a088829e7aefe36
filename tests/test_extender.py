"""The scheduler extender (cgpud/k8s/extender.py) with kube-scheduler's
extender v1 JSON, against the API server stand-in through the official
client: filter keeps the nodes where a GPU has the pod's units free, bind
chooses the GPU by the node's placement, writes gpushare's annotations and
creates the Binding; bad input is a clear error that changes nothing."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from apiserver_standin import ApiServer
from cgpud.k8s import extender
from cgpud.k8s.api import connect


class Extender:
    """An extender (its own State, its own client) serving on 127.0.0.1 against `api`."""

    def __init__(self, api: ApiServer, connections: int | None = None) -> None:
        self.api = api
        self.state = extender.State(*connect(connections=connections)).start()
        self.server = extender.make_server(self.state, "127.0.0.1", 0)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/gpushare-scheduler"

    def caught_up(self, timeout: float = 10) -> None:
        """Wait until the watches have brought every change the API server made (the stand-in's
        resourceVersions are numbers; the extender never compares them)."""
        deadline = time.monotonic() + timeout
        for name, inf in self.state.informers.items():
            res = self.api.res[name]
            while res.rvs and int(inf.version or 0) < res.rvs[-1]:
                assert time.monotonic() < deadline, f"the {name} watch did not catch up"
                time.sleep(0.005)

    def call(self, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        self.caught_up()
        out = call(self.url, path, body, raw)
        self.state.events.flush()  # (a bind's event is written after its answer)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.state.stop()


@pytest.fixture
def ext(tmp_path, monkeypatch):
    api = ApiServer(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    e = Extender(api)
    yield e
    e.close()
    api.close()


def call(url: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def nodes(api: ApiServer) -> None:
    api.add_node("t4", gpus=1, units=15, per_device="15")
    api.add_node("mixed", gpus=2, units=37, per_device="15,22")
    api.add_node("spread", gpus=2, units=30, labels={"ack.node.gpu.placement": "spread"})
    api.add_pod("holder", [9], node="t4", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "0"})


def test_filter_keeps_nodes_with_a_gpu_that_has_room(ext):
    api = ext.api
    nodes(api)
    pod = api.add_pod("asks8", [8])
    code, res = ext.call("/filter", {"Pod": pod, "NodeNames": ["t4", "mixed", "ghost"]})
    assert code == 200 and res["Error"] == ""
    assert res["NodeNames"] == ["mixed"]
    assert "GPU0 6/15" in res["FailedNodes"]["t4"] and "not known" in res["FailedNodes"]["ghost"]
    # the Nodes form (a scheduler not node-cache-capable)
    code, res = ext.call("/filter", {"Pod": pod, "Nodes": {"items": [api.nodes["t4"], api.nodes["mixed"]]}})
    assert [n["metadata"]["name"] for n in res["Nodes"]["items"]] == ["mixed"]


def test_bind_binpacks_writes_gpushares_annotations_and_binds(ext):
    api = ext.api
    nodes(api)
    for name in ("a", "b"):
        api.add_pod(name, [5])
        code, res = ext.call("/bind", {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-default-{name}",
                                        "Node": "mixed"})
        assert code == 200 and res == {"Error": ""}, res
    ann = api.pods[("default", "a")]["metadata"]["annotations"]
    assert ann["ALIYUN_COM_GPU_MEM_IDX"] == "0" and ann["ALIYUN_COM_GPU_MEM_POD"] == "5"
    assert ann["ALIYUN_COM_GPU_MEM_DEV"] == "15" and ann["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    assert int(ann["ALIYUN_COM_GPU_MEM_ASSUME_TIME"]) > 0
    # binpack: the second 5 goes to the same, fuller GPU (10 of 15), GPU 1 stays whole
    assert api.pods[("default", "b")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert api.bindings == [("default", "a", "mixed"), ("default", "b", "mixed")]
    assert [(e["involvedObject"]["name"], e["reason"], e["message"]) for e in api.events] == [
        (p, "CgpuAssumed", "5 aliyun.com/gpu-mem on GPU 0 of node mixed (binpack)") for p in ("a", "b")]
    code, res = ext.call("/inspect/mixed")
    assert res["nodes"][0]["gpus"] == [{"index": 0, "allocated": 10, "total": 15},
                                       {"index": 1, "allocated": 0, "total": 22}]


def test_spread_by_the_nodes_label(ext):
    api = ext.api
    nodes(api)
    for name in ("s1", "s2"):
        api.add_pod(name, [3])
        assert ext.call("/bind", {"PodName": name, "PodNamespace": "default", "Node": "spread"})[0] == 200
    idx = [api.pods[("default", n)]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] for n in ("s1", "s2")]
    assert idx == ["0", "1"]


@pytest.mark.parametrize("path, body, raw, words", [
    ("/filter", None, b"not json", "not a JSON object"),
    ("/filter", None, b"[1, 2]", "not a JSON object"),
    ("/filter", {"NodeNames": ["t4"]}, None, "no Pod"),
    ("/bind", {"PodName": "p", "PodNamespace": "default", "Node": "ghost"}, None, "node ghost is not known"),
    ("/bind", {"PodName": "ghost", "PodNamespace": "default", "Node": "t4"}, None, "pod default/ghost is not known"),
    ("/bind", {"PodName": "p"}, None, "needs PodName, PodNamespace and Node"),
])
def test_bad_input_is_a_clear_error_and_changes_nothing(ext, path, body, raw, words):
    api = ext.api
    nodes(api)
    api.add_pod("p", [4])
    code, res = ext.call(path, body, raw)
    assert code == 400 and words in res["Error"], res
    assert api.bindings == [] and api.events == []
    assert "ALIYUN_COM_GPU_MEM_IDX" not in api.pods[("default", "p")]["metadata"]["annotations"]


def test_a_pod_that_no_longer_fits_is_not_bound(ext):
    api = ext.api
    nodes(api)
    api.add_pod("big", [7])
    code, res = ext.call("/bind", {"PodName": "big", "PodNamespace": "default", "Node": "t4"})
    assert code == 400 and "no GPU with 7 free" in res["Error"]
    assert api.bindings == []


def test_concurrent_binds_never_overfill_a_gpu(ext):
    """kube-scheduler binds concurrently: 16 binds at once for 7 pods' worth of room bind exactly 7."""
    from concurrent.futures import ThreadPoolExecutor

    api = ext.api
    nodes(api)
    names = [f"c{k:02d}" for k in range(16)]
    for name in names:
        api.add_pod(name, [5])

    def bind(name):
        return ext.call("/bind", {"PodName": name, "PodNamespace": "default", "Node": "mixed"})[0]

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(bind, names))
    assert sorted(codes) == [200] * 7 + [400] * 9, codes  # GPU 0: 3 × 5 of 15; GPU 1: 4 × 5 of 22
    on = {}
    for name in names:
        ann = api.pods[("default", name)]["metadata"]["annotations"]
        if "ALIYUN_COM_GPU_MEM_IDX" in ann:
            on[ann["ALIYUN_COM_GPU_MEM_IDX"]] = on.get(ann["ALIYUN_COM_GPU_MEM_IDX"], 0) + 5
    assert on == {"0": 15, "1": 20} and len(api.bindings) == 7


def test_a_binding_the_api_server_refuses_leaves_no_annotation(ext):
    api = ext.api
    nodes(api)
    api.add_pod("elsewhere", [2], node="spread")  # already bound: the Binding is a 409
    code, res = ext.call("/bind", {"PodName": "elsewhere", "PodNamespace": "default", "Node": "mixed"})
    assert code == 502 and "409" in res["Error"] and "already assigned to node spread" in res["Error"], res
    ann = api.pods[("default", "elsewhere")]["metadata"]["annotations"]
    assert not any(k.startswith("ALIYUN_COM_GPU_MEM") for k in ann), ann
    assert ext.call("/inspect/mixed")[1]["nodes"][0]["allocated"] == 0


def test_a_bound_pod_that_goes_gives_its_units_back_at_once(ext):
    """The choice a bind wrote on the node counts until the watch shows its pod, and not after the
    pod is gone: its units are free again at once, not when the choice ages out (60 s)."""
    api = ext.api
    nodes(api)
    asks6 = api.add_pod("asks6", [6])
    api.add_pod("takes6", [6])
    assert ext.call("/bind", {"PodName": "takes6", "PodNamespace": "default", "Node": "t4"}) == (200, {"Error": ""})
    assert "t4" in ext.call("/filter", {"Pod": asks6, "NodeNames": ["t4"]})[1]["FailedNodes"]
    api.delete_pod("default", "takes6")
    assert ext.call("/filter", {"Pod": asks6, "NodeNames": ["t4"]})[1]["NodeNames"] == ["t4"]


def test_bind_of_a_recreated_pod_is_refused(ext):
    api = ext.api
    nodes(api)
    api.add_pod("again", [2])
    code, res = ext.call("/bind", {"PodName": "again", "PodNamespace": "default", "PodUID": "an-older-uid",
                                    "Node": "mixed"})
    assert code == 400 and "recreated" in res["Error"] and api.bindings == []


def test_a_pod_asking_for_two_gpus_gets_half_on_each(ext):
    """aliyun.com/gpu-count 2 with 8 units: 4 free on each of two GPUs (SPEC §3), or the node fails."""
    api = ext.api
    nodes(api)
    pod = api.add_pod("two", [8], count=2)
    code, res = ext.call("/filter", {"Pod": pod, "NodeNames": ["t4", "mixed", "spread"]})
    assert res["NodeNames"] == ["mixed", "spread"] and "no 2 GPU(s) with 4 free" in res["FailedNodes"]["t4"], res
    assert ext.call("/bind", {"PodName": "two", "PodNamespace": "default", "Node": "mixed"}) == (200, {"Error": ""})
    ann = api.pods[("default", "two")]["metadata"]["annotations"]
    assert ann["ALIYUN_COM_GPU_MEM_IDX"] == "0,1" and ann["ALIYUN_COM_GPU_MEM_POD"] == "8"
    gpus = ext.call("/inspect/mixed")[1]["nodes"][0]["gpus"]
    assert [g["allocated"] for g in gpus] == [4, 4]
    odd = api.add_pod("odd", [5], count=2)
    code, res = ext.call("/filter", {"Pod": odd, "NodeNames": ["mixed"]})
    assert res["NodeNames"] == [] and "mixed" in res["FailedNodes"], "5 units do not split over 2 GPUs"


def test_seed_000s_pod_label_spreads_its_gpu_mem_over_two_gpus(ext):
    """Seed 000 asks for two GPUs with the pod *label* aliyun.com/gpu-count: "2" (not a limit):
    8 GiB is 4 on each of two GPUs, never 8 on one; a label that is not a number is refused."""
    api = ext.api
    nodes(api)
    pod = api.add_pod("seed", [8], labels={"aliyun.com/gpu-count": "2"})
    code, res = ext.call("/filter", {"Pod": pod, "NodeNames": ["t4", "mixed"]})
    assert res["NodeNames"] == ["mixed"] and "no 2 GPU(s) with 4 free" in res["FailedNodes"]["t4"], res
    assert ext.call("/bind", {"PodName": "seed", "PodNamespace": "default", "Node": "mixed"}) == (200, {"Error": ""})
    assert api.pods[("default", "seed")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"
    bad = api.add_pod("bad", [8], labels={"aliyun.com/gpu-count": "two"})
    code, res = ext.call("/filter", {"Pod": bad, "NodeNames": ["mixed"]})
    assert "not a whole number" in json.dumps(res) and res.get("NodeNames") in (None, []), (code, res)


# ---- at cluster scale: LIST once, then WATCH (issue 22) -----------------------------------------


class Process:
    """`cgpu scheduler-extender` as its own process (as deployed) against `api`."""

    def __init__(self, api: ApiServer, tmp_path) -> None:
        import os
        import socket
        import subprocess
        import sys
        from pathlib import Path

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.log = open(tmp_path / f"extender-{port}.log", "wb")
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "cgpu"), "scheduler-extender", "--addr",
                                      f"127.0.0.1:{port}"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, KUBECONFIG=str(api.kubeconfig)))
        self.url = f"http://127.0.0.1:{port}/gpushare-scheduler"
        deadline = time.monotonic() + 30
        while True:
            try:
                call(self.url, "/inspect")
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "the extender did not start"
                time.sleep(0.05)

    def passes(self, pod: dict, node: str) -> bool:
        code, res = call(self.url, "/filter", {"Pod": pod, "NodeNames": [node]})
        assert code == 200, res
        return res["NodeNames"] == [node]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def until(pred, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.01)


@pytest.fixture
def proc_api(tmp_path):
    api = ApiServer(tmp_path, bookmark_every=0.2)
    nodes(api)
    procs = []

    def start():
        procs.append(Process(api, tmp_path))
        return procs[-1]

    yield api, start
    for p in procs:
        p.close()
    api.close()


def test_a_steady_state_is_one_list_per_resource_then_watches_only(proc_api):
    """Pods come and go on a node for a few seconds: the extender's filter follows each change,
    and the API server sees one LIST of nodes and one of pods, then watches (no GET, no LIST)."""
    api, start = proc_api
    ext = start()
    asks = {"metadata": {"name": "asks", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "8"}}}]}}
    ends = time.monotonic() + 3
    k = 0
    while time.monotonic() < ends:
        k += 1  # GPU 1 of "mixed" (22) filled to 15 free: passes; to 7 free: fails; and back
        api.add_pod(f"churn{k}", [7], node="mixed", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"})
        api.add_pod(f"fill{k}", [15], node="mixed", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "0"})
        until(lambda: ext.passes(asks, "mixed"), "GPU 1 has 15 free")
        api.add_pod(f"more{k}", [8], node="mixed", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"})
        until(lambda: not ext.passes(asks, "mixed"), "GPU 1 has 7 free")
        api.set_phase("default", f"more{k}", "Succeeded")
        api.delete_pod("default", f"churn{k}")
        api.delete_pod("default", f"fill{k}")
        until(lambda: ext.passes(asks, "mixed"), "the pods are gone")
        api.delete_pod("default", f"more{k}")
    assert k >= 3
    assert (api.count("list", "nodes"), api.count("list", "pods")) == (1, 1), api.requests
    assert api.count("get", "nodes") == api.count("get", "pods") == 0, api.requests
    assert api.count("watch", "pods") >= 1 and api.count("watch", "nodes") >= 1


def test_a_version_gone_410_lists_again_once(proc_api):
    """The API server goes down, changes meanwhile, and forgets the history (compaction): the watch
    from the old version is 410 Gone, and the extender LISTs again — once — and sees the change."""
    api, start = proc_api
    ext = start()
    asks = {"metadata": {"name": "asks", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}}]}}
    assert ext.passes(asks, "t4")
    api.failing = True
    api.add_pod("meanwhile", [4], node="t4", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "0"})
    api.compact()
    time.sleep(0.5)
    api.failing = False
    until(lambda: not ext.passes(asks, "t4"), "the extender sees the pod made while it could not watch")
    until(lambda: api.count("list", "nodes") == 2, "the nodes' watch is 410 too: LIST again")
    time.sleep(1)  # and then watches only again
    assert (api.count("list", "nodes"), api.count("list", "pods")) == (2, 2), api.requests


def test_two_replicas_binding_at_once_never_give_the_same_units(proc_api):
    """Two extender processes, 24 binds at once spread over both, 7 pods' room on the node: exactly 7
    bind, and no GPU is given more than it has; the rest are refused (the node is full) or told to
    try again, and none is bound."""
    from concurrent.futures import ThreadPoolExecutor

    api, start = proc_api
    a, b = start(), start()
    names = [f"r{k:02d}" for k in range(24)]
    for name in names:
        api.add_pod(name, [5])

    def bind(k_name):
        k, name = k_name
        return call((a, b)[k % 2].url, "/bind", {"PodName": name, "PodNamespace": "default", "Node": "mixed"})[0]

    with ThreadPoolExecutor(24) as pool:
        codes = list(pool.map(bind, enumerate(names)))
    assert codes.count(200) == 7 and set(codes) <= {200, 400, 503}, codes
    on = {}
    for name in names:
        ann = api.pods[("default", name)]["metadata"]["annotations"]
        if "ALIYUN_COM_GPU_MEM_IDX" in ann:
            on[ann["ALIYUN_COM_GPU_MEM_IDX"]] = on.get(ann["ALIYUN_COM_GPU_MEM_IDX"], 0) + 5
    assert on == {"0": 15, "1": 20} and len(api.bindings) == 7, (on, api.bindings)


def test_no_request_waits_for_a_list(proc_api):
    """While the extender LISTs again after 410 (a LIST that takes 3 s here), filter is answered
    from what it had, not after the LIST; then from the new view."""
    api, start = proc_api
    ext = start()
    asks = {"metadata": {"name": "asks", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}}]}}
    assert ext.passes(asks, "t4")
    api.list_delay = 3.0
    api.failing = True
    api.add_pod("meanwhile", [4], node="t4", phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": "0"})
    api.compact()
    api.failing = False
    until(lambda: api.lists_in_flight["pods"] > 0, "the extender lists the pods again")
    during = 0
    while api.lists_in_flight["pods"]:
        answer = ext.passes(asks, "t4")
        if api.lists_in_flight["pods"]:  # answered while the pods' LIST was still being answered
            during += 1
            assert answer, "the view it had: t4 had room"
    assert during >= 3, during
    until(lambda: not ext.passes(asks, "t4"), "then the new view")


# ---- placement across nodes: prioritize (issue 46) ----------------------------------------------


def placed(api: ApiServer, name: str, units: int, node: str, gpu: str, core: int = 0) -> None:
    """A pod already running on `gpu` of `node` (as the device plugin leaves it)."""
    api.add_pod(name, [units], node=node, phase="Running", annotations={"ALIYUN_COM_GPU_MEM_IDX": gpu})
    if core:
        with_core(api, name, core)


def with_core(api: ApiServer, name: str, core: int) -> dict:
    return api.edit_pod("default", name, lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
        {"aliyun.com/gpu-core.percentage": str(core)}))


def scores(ext, pod: dict, names: list[str]) -> dict[str, int]:
    code, res = ext.call("/prioritize", {"Pod": pod, "NodeNames": names})
    assert code == 200 and isinstance(res, list), (code, res)
    return {h["Host"]: h["Score"] for h in res}


def packing_nodes(api: ApiServer) -> None:
    for name, gpus in (("a", 2), ("b", 2), ("c", 2), ("d", 2), ("e", 1)):
        api.add_node(name, gpus=gpus, units=14 * gpus)
    placed(api, "b0", 12, "b", "0")  # b: GPU 0 has 2 left (no room for 3), GPU 1 whole
    placed(api, "c0", 3, "c", "0")  # c: GPU 0 would keep 8
    placed(api, "d0", 9, "d", "0")  # d: GPU 0 would keep 2


def test_prioritize_binpacks_across_nodes_keeping_whole_gpus_and_nodes_free(ext):
    """The fullest GPU that fits wins (d), then the emptier one in use (c); then a whole GPU of a node
    already in use (b), before a node wholly free, the smallest first (e, then a)."""
    api = ext.api
    packing_nodes(api)
    pod = api.add_pod("p", [3])
    got = scores(ext, pod, ["a", "b", "c", "d", "e", "ghost"])
    assert got == {"d": 10, "c": 8, "b": 5, "e": 3, "a": 1, "ghost": 0}, got
    # a pod asking nothing of ours: no preference
    assert set(scores(ext, api.add_pod("cpu", [0]), ["a", "d"]).values()) == {0}


def test_spread_on_request_by_the_pods_annotation_or_the_extenders_placement(ext):
    api = ext.api
    packing_nodes(api)
    pod = api.add_pod("s", [3], annotations={"cgpu.aliyun.com/placement": "spread"})
    # the emptiest node after the pod first (a: 25 of 28 free), b last (13 of 28)
    assert scores(ext, pod, ["a", "b", "c", "d", "e"]) == {"a": 10, "c": 8, "e": 8, "d": 4, "b": 1}
    ext.state.placement = "spread"  # (--placement spread): pods without the annotation spread ...
    assert max(scores(ext, api.add_pod("plain", [3]), ["a", "d"]).items(), key=lambda kv: kv[1])[0] == "a"
    packer = api.add_pod("k", [3], annotations={"cgpu.aliyun.com/placement": "binpack"})
    assert scores(ext, packer, ["a", "d"]) == {"d": 10, "a": 1}  # ... and a pod's own binpack still packs


def test_a_placement_that_is_neither_is_refused_with_the_reason(ext):
    api = ext.api
    packing_nodes(api)
    pod = api.add_pod("odd", [3], annotations={"cgpu.aliyun.com/placement": "pack"})
    for path in ("/filter", "/prioritize"):
        code, res = ext.call(path, {"Pod": pod, "NodeNames": ["a"]})
        assert code == 400 and "cgpu.aliyun.com/placement is 'pack': binpack or spread" in res["Error"], res
    assert api.bindings == []


def test_the_pods_spread_chooses_its_gpu_on_the_node_too(ext):
    api = ext.api
    nodes(api)
    api.add_pod("apart", [5], annotations={"cgpu.aliyun.com/placement": "spread"})
    assert ext.call("/bind", {"PodName": "apart", "PodNamespace": "default", "Node": "mixed"})[0] == 200
    assert api.pods[("default", "apart")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "1"  # 22 free
    assert api.events[-1]["message"] == "5 aliyun.com/gpu-mem on GPU 1 of node mixed (spread)"


def test_core_mem_percentages_are_packed_the_same_way(ext):
    """A pod asking a compute percentage goes where the GPU's percentage is fullest, across nodes and on
    the node (its memory second): whole GPUs keep their 100 %."""
    api = ext.api
    for name in ("x", "y", "z"):
        api.add_node(name, gpus=2, units=28)
    placed(api, "x0", 3, "x", "0", core=50)  # x: GPU 0 at 50 %, memory 11 free
    placed(api, "y0", 9, "y", "0", core=20)  # y: GPU 0 at 20 %, memory 5 free (fuller in memory)
    placed(api, "z0", 3, "z", "0", core=60)  # z: GPU 0 at 60 %, GPU 1 at 20 % with memory 5 free
    placed(api, "z1", 9, "z", "1", core=20)
    api.add_pod("q", [3])
    pod = with_core(api, "q", 30)
    got = scores(ext, pod, ["x", "y", "z"])
    assert got["z"] == 10 and got["x"] > got["y"], got
    assert ext.call("/bind", {"PodName": "q", "PodNamespace": "default", "Node": "z"})[0] == 200
    assert api.pods[("default", "q")]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] == "0"


def schedule(ext, pods: list[dict], names: list[str]) -> None:
    """What kube-scheduler does with the shipped configuration, one pod at a time: filter, prioritize,
    the best score (a tie to the first), bind."""
    for pod in pods:
        ok = ext.call("/filter", {"Pod": pod, "NodeNames": names})[1]["NodeNames"]
        got = scores(ext, pod, ok)
        best = max(ok, key=lambda n: got[n])
        meta = pod["metadata"]
        assert ext.call("/bind", {"PodName": meta["name"], "PodNamespace": "default", "Node": best})[0] == 200


def touched(api: ApiServer) -> set[tuple[str, str]]:
    return {(p["spec"]["nodeName"], p["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
            for p in api.pods.values() if "ALIYUN_COM_GPU_MEM_IDX" in p["metadata"]["annotations"]}


def test_a_burst_fills_gpus_before_it_opens_new_ones_and_a_whole_node_stays(ext):
    """40 pods of 3 units on 30 nodes of 2 × 14: four to a GPU, 10 GPUs on 5 nodes; then a pod asking
    both GPUs of a node (2 × 14) still finds one; spread on request touches a GPU per pod."""
    api = ext.api
    names = [f"n{i:02d}" for i in range(30)]
    for n in names:
        api.add_node(n, gpus=2, units=28)
    schedule(ext, [api.add_pod(f"b{k:02d}", [3]) for k in range(40)], names)
    assert len(touched(api)) == 10 and len({n for n, _ in touched(api)}) == 5, sorted(touched(api))
    whole = api.add_pod("whole", [28], count=2)
    assert len(ext.call("/filter", {"Pod": whole, "NodeNames": names})[1]["NodeNames"]) == 25
    spread = [api.add_pod(f"s{k:02d}", [3], annotations={"cgpu.aliyun.com/placement": "spread"}) for k in range(20)]
    schedule(ext, spread, names)
    assert len(touched(api)) == 10 + 20, sorted(touched(api))


def test_the_extender_exports_the_clusters_whole_gpu_fragmentation(ext):
    api = ext.api
    packing_nodes(api)
    api.edit_node("a", lambda n: n["metadata"]["annotations"].update({"cgpu.aliyun.com/gpu-unhealthy": "1"}))
    ext.caught_up()
    with urllib.request.urlopen(ext.url.rsplit("/", 1)[0] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
           if line.startswith("cgpu_") and not line.startswith("cgpu_extender_events_")}  # (not fragmentation)
    assert got == {"cgpu_extender_gpus": 8, "cgpu_extender_gpus_whole": 5, "cgpu_extender_gpus_partly_used": 3,
                   "cgpu_extender_partly_used_free_units": 2 + 11 + 5, "cgpu_extender_nodes": 5,
                   "cgpu_extender_nodes_whole": 1}, text


def test_the_next_pod_sees_where_the_last_was_nominated_before_its_bind(ext, monkeypatch):
    """kube-scheduler scores the next pod of a burst before it binds the last: the last counts on the
    node prioritize ranked first until its bind, or for NOMINATED_SECONDS."""
    from cgpud.k8s import view

    api = ext.api
    api.add_node("n0", gpus=2, units=28)
    api.add_node("n1", gpus=1, units=14)
    first = api.add_pod("first", [12])
    assert scores(ext, first, ["n0", "n1"]) == {"n1": 10, "n0": 1}  # the smaller node wholly free
    second = api.add_pod("second", [3])
    assert ext.call("/filter", {"Pod": second, "NodeNames": ["n0", "n1"]})[1]["NodeNames"] == ["n0"]
    assert scores(ext, second, ["n0", "n1"]) == {"n0": 10, "n1": 0}
    assert ext.call("/bind", {"PodName": "first", "PodNamespace": "default", "Node": "n1"})[0] == 200
    assert ext.call("/bind", {"PodName": "second", "PodNamespace": "default", "Node": "n0"})[0] == 200
    # a nomination whose pod went elsewhere (or nowhere) stops counting after NOMINATED_SECONDS
    monkeypatch.setattr(view, "NOMINATED_SECONDS", 0.3)
    third = api.add_pod("third", [14])
    assert scores(ext, third, ["n0"]) == {"n0": 10}  # GPU 1 of n0, nominated
    fourth = api.add_pod("fourth", [14])
    assert ext.call("/filter", {"Pod": fourth, "NodeNames": ["n0"]})[1]["NodeNames"] == []
    time.sleep(0.4)
    assert ext.call("/filter", {"Pod": fourth, "NodeNames": ["n0"]})[1]["NodeNames"] == ["n0"]


def test_a_nomination_counts_while_its_bind_may_still_come(ext, monkeypatch):
    """A bind comes after the pod's binding cycle starts and may take up to kube-scheduler's extender
    timeout: 10 s after prioritize nominated a pod, its bind not come yet, the next pod still sees it. (A
    5 s nomination lapsed under load: the full suite's burst of 16 pods went to 5 GPUs of 3 nodes.)"""
    from cgpud.k8s import score

    api = ext.api
    api.add_node("n0", gpus=2, units=28)
    api.add_node("n1", gpus=1, units=14)
    first = api.add_pod("first", [12])
    assert scores(ext, first, ["n0", "n1"]) == {"n1": 10, "n0": 1}

    class Later:  # (the time module, 10 s on)
        def __getattr__(self, name):
            return getattr(time, name)

        def time(self) -> float:
            return time.time() + 10

    monkeypatch.setattr(score, "time", Later())
    second = api.add_pod("second", [3])
    assert scores(ext, second, ["n0", "n1"]) == {"n0": 10, "n1": 0}  # (first's 12 of n1's 14 still count)


def test_a_pod_counts_on_its_node_while_its_choice_is_written(ext):
    """Between prioritize's nomination and the choice written on the Node (the bind's patch, in flight),
    the pod counts: a spread pod scored meanwhile goes elsewhere."""
    from cgpud.k8s import score

    api = ext.api
    api.add_node("n0", gpus=2, units=28)
    api.add_node("n1", gpus=2, units=28)
    spread = {"cgpu.aliyun.com/placement": "spread"}
    first = api.add_pod("first", [3], annotations=spread)
    assert scores(ext, first, ["n0", "n1"]) == {"n0": 10, "n1": 9}
    second = api.add_pod("second", [3], annotations=spread)
    seen = []
    patch = ext.state.api.patch_node

    def meanwhile(*args, **kw):  # (kube-scheduler scores the next pod while this bind's patch is in flight)
        seen.append({h["Host"]: h["Score"] for h in score.prioritize(ext.state, {"Pod": second,
                                                                                  "NodeNames": ["n0", "n1"]})})
        return patch(*args, **kw)

    ext.state.api.patch_node = meanwhile
    assert ext.call("/bind", {"PodName": "first", "PodNamespace": "default", "Node": "n0"})[0] == 200
    assert seen == [{"n0": 1, "n1": 10}], seen


def one_node_of_pods(api: ApiServer, prefix: str, n: int) -> list[str]:
    """Node n0 (2 GPUs of 14 units) and n pods asking 3 units each: their names."""
    api.add_node("n0", gpus=2, units=28)
    names = [f"{prefix}{k:02d}" for k in range(n)]
    for name in names:
        api.add_pod(name, [3])
    return names


def units_on_gpus(api: ApiServer, names: list[str], units: int = 3) -> dict[str, int]:
    """Units the pods were given on each GPU index, from their gpushare annotations."""
    on: dict[str, int] = {}
    for name in names:
        idx = api.pods[("default", name)]["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_IDX")
        if idx is not None:
            on[idx] = on.get(idx, 0) + units
    return on


def test_binds_give_their_connections_back_to_the_clients_pool(ext, monkeypatch):
    """Each answer a bind asks for (the Node's patch, the Binding, the event) is read and its connection
    given back: a burst's binds reuse the client's connections, not one new connection (a TLS handshake
    on both sides) per Binding and per event."""
    import urllib3

    api = ext.api
    names = one_node_of_pods(api, "r", 8)
    ext.caught_up()
    opened = []
    connect = urllib3.connection.HTTPConnection.connect

    def counting(self):
        opened.append(self)
        return connect(self)

    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", counting)
    for name in names:
        assert ext.call("/bind", {"PodName": name, "PodNamespace": "default", "Node": "n0"})[0] == 200
    assert len(api.bindings) == 8 and len(api.events) == 8
    assert len(opened) <= 2, f"{len(opened)} connections opened for 8 binds"  # (the binds' and the events')


def test_a_kubeconfig_tokens_hook_runs_once_a_while_not_before_each_request(tmp_path, monkeypatch):
    """kubernetes.config's hook for a kubeconfig's token runs before every request and reads every
    proxy variable of the environment again: it runs once per REFRESH_SECONDS."""
    from kubernetes.config import kube_config

    from cgpud.k8s import api as k8sapi

    server = ApiServer(tmp_path)
    try:
        config = json.loads(server.kubeconfig.read_text())
        config["users"][0]["user"] = {"token": "t0"}
        path = tmp_path / "token.kubeconfig"
        path.write_text(json.dumps(config))
        monkeypatch.setenv("KUBECONFIG", str(path))
        core, _ = connect("test")
        runs = []
        set_config = kube_config.KubeConfigLoader._set_config
        monkeypatch.setattr(kube_config.KubeConfigLoader, "_set_config",
                            lambda self, conf: runs.append(1) or set_config(self, conf))
        for _ in range(5):
            core.list_node(_preload_content=False).data
        assert len(runs) == 1
        monkeypatch.setattr(k8sapi.time, "monotonic", lambda: time.time() + 1e6)  # (REFRESH_SECONDS later)
        core.list_node(_preload_content=False).data
        assert len(runs) == 2
    finally:
        server.close()


def test_the_servers_answers_are_not_held_for_the_callers_ack():
    """The extender's (and the webhook's) server sends each answer as it is written: TCP_NODELAY on
    every connection it accepts (else its body waits for the caller's delayed ACK of its headers)."""
    import socket
    from http.server import BaseHTTPRequestHandler

    from cgpud.k8s.httpjson import Server

    server = Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    try:
        with socket.create_connection(server.server_address[:2], timeout=5):
            accepted, _ = server.get_request()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        server.server_close()


def test_a_burst_of_binds_shares_a_bounded_pool_of_connections(tmp_path, monkeypatch):
    """With connections=N (the extender's API_CONNECTIONS) the client keeps N connections and a bind past
    them waits for one: 16 binds at once for 8 pods' room bind exactly 8, over at most N connections in
    all (the two watches' among them), not a new connection for each bind past the pool."""
    import urllib3
    from concurrent.futures import ThreadPoolExecutor

    opened = []
    connect_ = urllib3.connection.HTTPConnection.connect
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect",
                        lambda self: opened.append(self) or connect_(self))
    api = ApiServer(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    ext = Extender(api, connections=4)
    try:
        names = one_node_of_pods(api, "q", 16)
        ext.caught_up()
        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda n: call(ext.url, "/bind", {"PodName": n, "PodNamespace": "default",
                                                                    "Node": "n0"})[0], names))
        assert sorted(codes) == [200] * 8 + [400] * 8, codes  # (4 pods of 3 on each GPU of 14)
        assert units_on_gpus(api, names) == {"0": 12, "1": 12}
        assert len(opened) <= 4, f"{len(opened)} connections"
    finally:
        ext.close()
        api.close()


def test_binds_waiting_for_one_node_are_written_together(ext):
    """Binds to one node take turns; the bind whose turn it is writes the choices of every bind waiting
    for that node in one patch: 8 binds at once, the first one's patch held until the other 7 wait,
    are 2 patches of the Node (not 8, one after another), each pod on its own units, no GPU over-filled."""
    from concurrent.futures import ThreadPoolExecutor

    api = ext.api
    names = one_node_of_pods(api, "w", 8)
    ext.caught_up()
    held, patches = threading.Event(), []
    patch = ext.state.api.patch_node

    def counted(*args, **kw):
        patches.append(args[0])
        if len(patches) == 1:
            held.wait(10)  # (the first bind's write in flight while the others come)
        return patch(*args, **kw)

    ext.state.api.patch_node = counted
    with ThreadPoolExecutor(8) as pool:
        codes = pool.map(lambda n: call(ext.url, "/bind", {"PodName": n, "PodNamespace": "default", "Node": "n0"})[0],
                         names)
        until(lambda: patches and len(ext.state.waiting.get("n0", ())) == 7, "7 binds waiting for the node")
        held.set()
        assert list(codes) == [200] * 8
    assert patches == ["n0", "n0"]
    assert units_on_gpus(api, names) == {"0": 12, "1": 12}  # (4 pods of 3 on each GPU of 14)


def test_calls_on_one_kept_connection_are_counted_and_timed_by_verb_and_status(ext):
    """kube-scheduler keeps its connections: two filters on one connection are both answered on it, and
    GET /metrics counts them by verb and HTTP status, and times them (cgpu_extender_request_seconds)."""
    import http.client

    api = ext.api
    nodes(api)
    pod = api.add_pod("asks8", [8])
    ext.caught_up()
    host, port = ext.server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    answers, socks = [], []
    for body in ({"Pod": pod, "NodeNames": ["t4", "mixed"]}, {"NodeNames": ["t4"]}):
        conn.request("POST", "/gpushare-scheduler/filter", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answers.append((resp.status, json.loads(resp.read())))
        socks.append(conn.sock)
    conn.close()
    assert answers[0] == (200, {"NodeNames": ["mixed"], "FailedNodes": answers[0][1]["FailedNodes"], "Error": ""})
    assert answers[1][0] == 400 and "no Pod" in answers[1][1]["Error"]
    assert socks[0] is socks[1] is not None  # (the same connection: not closed after the first answer)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line.startswith("cgpu_extender_request")}
    assert got['cgpu_extender_requests_total{code="200",verb="filter"}'] == 1
    assert got['cgpu_extender_requests_total{code="400",verb="filter"}'] == 1
    assert got['cgpu_extender_request_seconds_count{verb="filter"}'] == 2
    assert got['cgpu_extender_request_seconds_bucket{le="+Inf",verb="filter"}'] == 2


def test_a_call_is_counted_before_its_answer_reaches_the_client(ext, monkeypatch):
    """A client that has its answer and then scrapes /metrics sees its call counted: the count is made
    before the answer is sent (it was made after, so a scrape that came between the answer and the
    handler's next step missed it: the full suite once read no 400 for a filter already answered 400).
    Here the handler stalls after each answer until the scrape is done."""
    scraped = threading.Event()
    send = extender.send_json

    def send_then_stall(handler, code, obj):
        send(handler, code, obj)
        scraped.wait(10)

    monkeypatch.setattr(extender, "send_json", send_then_stall)
    ext.caught_up()
    assert call(ext.url, "/filter", {"NodeNames": ["t4"]})[0] == 400
    host, port = ext.server.server_address[:2]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    scraped.set()
    assert 'cgpu_extender_requests_total{code="400",verb="filter"} 1.0' in text, \
        [line for line in text.splitlines() if line.startswith("cgpu_extender_request")]


def test_a_watch_behind_a_binds_own_write_does_not_undo_it(ext):
    """A bind's patch of the Node counts at once (its answer is cached); a watch event older than it,
    which a watch behind the binds still brings, does not undo it: the next bind's patch is made from
    the latest write and does not conflict (no read of the node again)."""
    api = ext.api
    names = one_node_of_pods(api, "s", 3)

    def bind(name: str) -> int:
        return call(ext.url, "/bind", {"PodName": name, "PodNamespace": "default", "Node": "n0"})[0]

    ext.caught_up()
    assert bind(names[0]) == 200
    ext.caught_up()
    behind = api.nodes["n0"]  # the node with the first choice only
    ext.state.informers["nodes"].event = lambda kind, obj: None  # (the watch falls behind the next write)
    assert bind(names[1]) == 200
    ext.state._node_event("MODIFIED", behind)  # (and then brings the older change)
    reads = api.count("get", "nodes")
    assert bind(names[2]) == 200
    assert api.count("get", "nodes") == reads
    assert units_on_gpus(api, names) == {"0": 9}


def metric(ext, name: str) -> float:
    """One sample of the extender's GET /metrics."""
    with urllib.request.urlopen(ext.url.rsplit("/", 1)[0] + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_burst_of_binds_writes_a_bounded_number_of_events_and_counts_the_rest(ext):
    """A pod event is a write to etcd like the Binding: a burst of binds writes EVENTS_BURST of them at
    once, then EVENTS_PER_SECOND; the others are dropped and counted in GET /metrics. Each pod is bound
    with its annotations either way. (The clock stands still through the burst, then moves on.)"""
    api = ext.api
    api.add_node("n1", gpus=2, units=28)
    names = one_node_of_pods(api, "e", 8) + [f"f{k:02d}" for k in range(extender.EVENTS_BURST)]
    for name in names[8:]:
        api.add_pod(name, [1])
    now = [1000.0]
    ext.state.events.clock = lambda: now[0]
    for name in names:
        assert ext.call("/bind", {"PodName": name, "PodNamespace": "default",
                                  "Node": "n0" if name < "f" else "n1"})[0] == 200
    assert len(api.bindings) == len(names)
    assert all("ALIYUN_COM_GPU_MEM_IDX" in api.pods[("default", n)]["metadata"]["annotations"] for n in names)
    assert len(api.events) == extender.EVENTS_BURST
    assert metric(ext, "cgpu_extender_events_dropped_total") == len(names) - extender.EVENTS_BURST
    now[0] += 1 / extender.EVENTS_PER_SECOND  # (a token back)
    api.add_pod("later", [1])
    assert ext.call("/bind", {"PodName": "later", "PodNamespace": "default", "Node": "n1"})[0] == 200
    assert api.events[-1]["involvedObject"]["name"] == "later"


def test_the_watchs_event_for_a_binds_own_write_is_not_read_again(ext):
    """A bind's patch answers with the Node it wrote, which the extender holds at once (its free units
    worked out by the next filter); the watch then brings that same version: it is not read again
    (nor its free units worked out again), only a version the extender does not hold is."""
    api = ext.api
    names = one_node_of_pods(api, "v", 2)
    ext.caught_up()
    brought = []
    nodes_watch = ext.state.informers["nodes"]
    apply, nodes_watch.event = nodes_watch.event, lambda kind, obj: brought.append((kind, obj))
    assert call(ext.url, "/bind", {"PodName": names[0], "PodNamespace": "default", "Node": "n0"})[0] == 200
    until(lambda: brought, "the watch bringing the bind's write")
    held = ext.state.nodes["n0"]
    pod = api.add_pod("asks3", [3])
    assert call(ext.url, "/filter", {"Pod": pod, "NodeNames": ["n0"]})[1]["NodeNames"] == ["n0"]
    worked_out = held.free
    assert worked_out == [11, 14]
    for kind, obj in brought:
        apply(kind, obj)
    assert ext.state.nodes["n0"] is held and held.free is worked_out
    changed = json.loads(json.dumps(brought[-1][1]))  # (a change of the node's own, a version not held)
    changed["metadata"]["labels"] = {"ack.node.gpu.placement": "spread"}
    changed["metadata"]["resourceVersion"] = "999999"
    apply("MODIFIED", changed)
    assert ext.state.nodes["n0"] is not held and ext.state.nodes["n0"].strategy == "spread"


def exchange(ext, head: list[bytes], body: bytes = b"") -> tuple[int, bytes]:
    """One request written as `head` (its request line and header lines) and `body` on a socket of its
    own, read until the extender closes the connection: its status and body. (No http.client: its
    answer's headers go through the email parser.)"""
    import socket

    with socket.create_connection(ext.server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split()[1]), answer.partition(b"\r\n\r\n")[2]


def test_the_scheduling_cycles_calls_cost_no_email_parsing_nor_a_json_dict_per_node(ext, monkeypatch):
    """filter and prioritize are on kube-scheduler's scheduling cycle, one pod at a time: a request's
    headers are read without the email package's parser (the standard library's way), and
    prioritize's HostPriorityList is written out, not json.dumps'd a dict per candidate node; the
    answers are what they were. Names no API server would allow still come back as JSON."""
    import email.parser

    from cgpud.k8s import score

    api = ext.api
    packing_nodes(api)
    pod = api.add_pod("asks3", [3])
    ext.caught_up()
    names = ["a", "b", "c", "d", "e"]
    want = scores(ext, pod, names)
    body = json.dumps({"Pod": pod, "NodeNames": names}).encode()
    monkeypatch.setattr(email.parser.Parser, "parsestr", lambda *a, **kw: pytest.fail("the email parser was asked"))
    dumped = []
    dumps = json.dumps
    monkeypatch.setattr(json, "dumps", lambda obj, *a, **kw: dumped.append(obj) or dumps(obj, *a, **kw))
    code, answer = exchange(ext, [b"POST /gpushare-scheduler/prioritize HTTP/1.1", b"Host: x", b"Connection: close",
                                  b"content-type: application/json", b"Content-Length: %d" % len(body)], body)
    assert code == 200 and {h["Host"]: h["Score"] for h in json.loads(answer)} == want
    assert not [d for d in dumped if isinstance(d, list)]  # (no HostPriorityList through json.dumps)
    odd = [{"Host": 'n"1\\', "Score": 3}, {"Host": "\u00dcn\u00ef", "Score": 0}]
    assert json.loads(score.encode(odd)) == odd


@pytest.mark.parametrize("lines, code", [
    ([b"Content-Length: 2"], 404),
    ([b"content-length: 2"], 404),  # (a name in any case)
    ([b"Content-Length 2"], 400),  # (no colon)
    ([b" Content-Length: 2"], 400),  # (a folded line: refused, as RFC 9112 lets a server)
    ([b"X-%d: 1" % k for k in range(101)] + [b"Content-Length: 2"], 431),
    ([b"X-Long: " + b"x" * 70000, b"Content-Length: 2"], 431),
])
def test_a_requests_headers_are_read_by_the_rules(ext, lines, code):
    """The extender's own header reading: names in any case, Connection: close honoured (the answer
    read to the connection's end), a line without a colon or folded 400, over 100 headers or a line
    over 64 KiB 431."""
    got, _ = exchange(ext, [b"POST /gpushare-scheduler/nothing HTTP/1.1", b"Host: x", b"Connection: close", *lines],
                      b"{}")
    assert got == code


def test_an_answer_is_one_write_and_a_filters_request_few_reads(ext, monkeypatch):
    """Each read and write of the extender's server lets go of the GIL, and getting it back waits behind
    a burst's binds: a filter's answer, headers and body, is one write on its socket, and its request
    (a pod and 500 names) is read in few reads, not 8 KiB at a time."""
    import socket

    api = ext.api
    nodes(api)
    pod = api.add_pod("asks8", [8])
    ext.caught_up()
    body = json.dumps({"Pod": pod, "NodeNames": ["t4", "mixed"] + [f"ghost-node-with-a-long-name-{k:03d}" for k in range(500)]}).encode()
    assert len(body) > 16 << 10  # (two 8 KiB reads and more)
    port = ext.server.server_address[1]
    writes, reads = [], []  # (on the server's end of the connection only)
    for name, into in (("send", writes), ("sendall", writes), ("recv_into", reads)):
        real = getattr(socket.socket, name)

        def counted(self, *a, _real=real, _into=into, _name=name, **kw):
            if self.getsockname()[1] == port:
                _into.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(socket.socket, name, counted)
    code, answer = exchange(ext, [b"POST /gpushare-scheduler/filter HTTP/1.1", b"Host: x", b"Connection: close",
                                  b"Content-Length: %d" % len(body)], body)
    assert code == 200 and json.loads(answer)["NodeNames"] == ["mixed"]
    assert len(writes) == 1, f"{len(writes)} writes for one answer"
    assert len(reads) <= 4, f"{len(reads)} reads for a request of {len(body)} bytes"
