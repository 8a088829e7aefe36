"""The cluster tier (issue 24): our device plugin, scheduler extender and
manifests on a one-node cluster of the real Kubernetes components
(tests/cluster.py: etcd, kube-apiserver with RBAC, kube-scheduler with the
shipped configuration, a kubelet on containerd's CRI), cgpud serving two
simulated T4s (14 units of aliyun.com/gpu-mem each).

The cluster starts once for this module and test_cluster_health.py (about a
minute once the binaries are built; scripts/k8s-build.sh builds them the first
time) and the tests run in order on it: what a test leaves (a pod, a label) is
its own to remove.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.request

import pytest
import yaml

from cluster import EXTENDER_SA, NAMESPACE, NODE, SA, Cluster, extender_addr, node as cluster_node, \
    node_fixtures, shipped_scheduler_config, wait_for
from conftest import SIM_T4_BYTES
from test_runc import compiled_hook  # noqa: F401  (test_cluster_dra's)

pytestmark = pytest.mark.slow

UNITS = 14  # a T4's 15109 MiB in GiB units
SA_USER = f"system:serviceaccount:{NAMESPACE}:{SA}"
EXTENDER_USER = f"system:serviceaccount:{NAMESPACE}:{EXTENDER_SA}"


# The node (its daemon and cluster) shared with test_cluster_health.py (tests/cluster.py, shared()):
# cgpud on two simulated T4s (GPU health's quiet time 2 s), deploy/kubernetes applied, the extender and
# the device plugin started.
SHARED_CLUSTER = "extender"


node, cgpud, cluster = node_fixtures(SHARED_CLUSTER, lambda: cluster_node("sim:2xT4", ("--health-quiet", "2"),
                                                                        Cluster.deploy))


def running(pod: dict) -> bool:
    return pod.get("status", {}).get("phase") == "Running"


def container_name(pod: dict) -> str:
    """The instance name cgpud gives the pod's container: its containerd ID's first 12 characters."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    assert cid.startswith("containerd://"), cid
    return cid[len("containerd://"):][:12]


def container_env(cluster, pod: str) -> dict[str, str]:
    """The environment the pod's container started with: it prints it first (`env`), read back
    through the API server and the kubelet (kubectl logs)."""
    got: dict[str, str] = {}

    def read() -> bool:
        p = cluster.kubectl("logs", pod, check=False)
        got.update(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
        return "PATH" in got

    wait_for(read, 20, f"kubectl logs {pod}", lambda: cluster.kubectl("logs", pod, check=False).stderr)
    return got


def memsize(units: int, dev: int = UNITS) -> str:
    """What cgpud makes of `units` of a T4 of `dev` units (gpushare's rule: units/dev of the GPU)."""
    return str(SIM_T4_BYTES * units // dev)


# ---- 1: the manifests, applied by kubectl, under RBAC -------------------------------------

NEEDED = [  # what the device plugin does (docs/kubernetes.md; its own node and pods only: docs/security.md)
    ("get", "nodes"), ("list", "nodes"), ("watch", "nodes"), ("patch", "nodes"), ("patch", "nodes/status"),
    ("get", "pods"), ("list", "pods"), ("watch", "pods"), ("patch", "pods"),
]
EXTENDER_NEEDS = [  # ... and the extender, with an account of its own
    ("get", "nodes"), ("list", "nodes"), ("watch", "nodes"), ("patch", "nodes"),
    ("get", "pods"), ("list", "pods"), ("watch", "pods"),
    ("create", "pods/binding"), ("create", "bindings"), ("create", "events"),
]
OUTSIDE = [  # what neither needs
    ("get", "secrets"), ("list", "secrets"), ("create", "pods"), ("delete", "pods"), ("delete", "nodes"),
    ("update", "clusterroles"), ("create", "deployments.apps"), ("patch", "daemonsets.apps"), ("create", "serviceaccounts/token"),
    ("update", "nodes/status"), ("update", "pods/status"), ("create", "pods/eviction"), ("get", "nodes/proxy"),
]
NODE_OUTSIDE = [("create", "pods/binding"), ("create", "bindings")]  # the extender's, not the node's
EXTENDER_OUTSIDE = [("patch", "pods"), ("patch", "nodes/status")]


def can_i(cluster, verb: str, resource: str, user: str = SA_USER):
    """`kubectl auth can-i` as the account (impersonated); "pods/binding" is the subresource (for
    kubectl, RESOURCE/NAME names an object)."""
    resource, _, sub = resource.partition("/")
    return cluster.kubectl("auth", "can-i", verb, resource, *([f"--subresource={sub}"] if sub else []),
                           f"--as={user}", "-A", check=False)


def test_deploy_applies_and_rbac_gives_our_parts_what_they_need_and_no_more(cluster):
    # every object of deploy/kubernetes is in the API server now, as applied (RBAC's and the workloads')
    p = cluster.kubectl("get", *cluster.deploy_target(), "-o", "name")
    objects = p.stdout.split()
    for expected in ("serviceaccount/cgpu", "clusterrole.rbac.authorization.k8s.io/cgpu",
                     "clusterrolebinding.rbac.authorization.k8s.io/cgpu", "daemonset.apps/cgpud",
                     "runtimeclass.node.k8s.io/cgpu"):
        assert expected in objects, (expected, objects, cluster.deploy_output)
    asks = [(user, verb, resource, allowed) for user, needed, outside in (
        (SA_USER, NEEDED, OUTSIDE + NODE_OUTSIDE), (EXTENDER_USER, EXTENDER_NEEDS, OUTSIDE + EXTENDER_OUTSIDE))
        for allowed, pairs in ((True, needed), (False, outside)) for verb, resource in pairs]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # (50 kubectl processes: a minute one by one, loaded)
        answers = list(pool.map(lambda a: can_i(cluster, a[1], a[2], a[0]), asks))
    for (user, verb, resource, allowed), p in zip(asks, answers):
        if allowed:
            assert p.stdout.strip() == "yes", f"{user} may not {verb} {resource}: {p.stdout}{p.stderr}"
        else:
            assert p.stdout.strip() == "no" and p.returncode == 1, f"{user} may {verb} {resource}"
    # and the API server refuses such a request made with the account's own token
    p = cluster.kubectl("get", "secrets", "-n", NAMESPACE, kubeconfig=cluster.sa_kubeconfig, check=False)
    assert p.returncode != 0 and "Forbidden" in p.stderr and SA_USER in p.stderr, p.stderr


# ---- 2: the real kube-scheduler through our extender --------------------------------------


def wait_events(cluster, pod: str, *reasons: str, timeout: float = 60) -> str:
    """The pod's events once each of `reasons` is among them."""
    def seen() -> str:
        e = cluster.events(pod)
        return e if all(r in e for r in reasons) else ""

    return wait_for(seen, timeout, f"events {reasons} on {pod}", lambda: cluster.events(pod) + cluster.logs())


def test_the_shipped_scheduler_configuration_names_its_kubeconfig(cluster):
    """Given --config, kube-scheduler ignores its --kubeconfig flag (it logs "Neither --kubeconfig nor
    --master was specified" and fails outside a pod): the file itself must name the kubeconfig. The
    fixture changed only that path (to this cluster's); the rest ran as shipped."""
    shipped = shipped_scheduler_config()
    assert shipped.get("clientConnection", {}).get("kubeconfig"), \
        "deploy/kubernetes/scheduler/kube-scheduler-config.yaml has no clientConnection.kubeconfig"
    ran = yaml.safe_load(cluster.path("kube-scheduler.yaml").read_text())
    ran["clientConnection"]["kubeconfig"] = shipped["clientConnection"]["kubeconfig"]
    assert ran == shipped


def test_the_scheduler_filters_and_binds_through_the_extender(cluster):
    cluster.create(cluster.pod("sched-3", 3))
    pod = cluster.wait_pod("sched-3", lambda p: p["spec"].get("nodeName") == NODE, 60, "bound to the node")
    ann = pod["metadata"].get("annotations", {})
    assert ann.get("ALIYUN_COM_GPU_MEM_POD") == "3", ann
    assert ann.get("ALIYUN_COM_GPU_MEM_IDX") in ("0", "1"), ann
    assert ann.get("ALIYUN_COM_GPU_MEM_DEV") == str(UNITS), ann
    assert ann.get("ALIYUN_COM_GPU_MEM_ASSUME_TIME", "").isdigit(), ann
    # the extender bound it (its event on the pod), the scheduler says it was scheduled
    events = wait_events(cluster, "sched-3", "CgpuAssumed", "Scheduled")
    assert f"3 aliyun.com/gpu-mem on GPU {ann['ALIYUN_COM_GPU_MEM_IDX']} of node {NODE}" in events, events
    cluster.delete_pod("sched-3")


def test_a_pod_that_fits_nowhere_stays_pending_with_the_extenders_reason(cluster):
    cluster.create(cluster.pod("too-big", UNITS + 1))  # the node has 28 units, but no one GPU has 15
    events = wait_events(cluster, "too-big", "FailedScheduling")
    assert f"no 1 GPU(s) with {UNITS + 1} free aliyun.com/gpu-mem" in events, events
    pod = cluster.get("pod", "too-big")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName"), pod["status"]
    assert "ALIYUN_COM_GPU_MEM_IDX" not in pod["metadata"].get("annotations", {})
    cluster.delete_pod("too-big")


# ---- 3: the real kubelet, containerd and cgpu-runtime --------------------------------------


def test_the_device_plugin_registers_and_the_node_shows_its_units(cluster):
    wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == 2 * UNITS, 60,
             "the node's aliyun.com/gpu-mem", cluster.logs)
    node = cluster.get("node", NODE)
    assert node["status"]["capacity"]["aliyun.com/gpu-mem"] == str(2 * UNITS)
    assert node["status"]["capacity"].get("aliyun.com/gpu-count") == "2"  # published by the plugin
    assert node["metadata"]["annotations"].get("cgpu.aliyun.com/gpu-mem-per-device") == f"{UNITS},{UNITS}"
    assert 'kubelet_device_plugin_registration_total{resource_name="aliyun.com/gpu-mem"} 1' in \
        cluster.kubelet_metrics()


def test_a_pod_runs_through_cgpu_runtime_with_its_units_in_the_tree(cluster, cgpud):
    cluster.create(cluster.pod("run-3", 3))
    pod = cluster.wait_pod("run-3", running, 90, "Running")
    gpu = int(pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
    name = container_name(pod)
    env = container_env(cluster, "run-3")
    assert env.get("ALIYUN_COM_GPU_MEM_CONTAINER") == "3", env
    assert env.get("ALIYUN_COM_GPU_MEM_DEV") == str(UNITS), env
    assert env.get("ALIYUN_COM_GPU_MEM_IDX") == str(gpu), env
    assert env.get("NVIDIA_VISIBLE_DEVICES", "").startswith("GPU-"), env
    assert name in cgpud.instances(gpu), (name, cgpud.instances(gpu))
    assert cgpud.value(f"{gpu}/{name}/memsize") == memsize(3)
    assert name not in cgpud.instances(1 - gpu)
    pod = cluster.wait_pod("run-3", lambda p: p["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_ASSIGNED") == "true",
                           30, "ASSIGNED=true")
    cluster.delete_pod("run-3")
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go with the pod", cluster.logs)


def test_seed_000_eight_gib_over_two_gpus(cluster, cgpud):
    """Seed 000 (ACK's multi-GPU sharing): aliyun.com/gpu-mem 8 with the pod *label* aliyun.com/gpu-count 2:
    4 GiB on each of two GPUs."""
    cluster.create(cluster.pod("seed-000", 8, labels={"aliyun.com/gpu-count": "2"}))
    try:
        pod = cluster.wait_pod("seed-000", running, 90, "Running")
        assert pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] in ("0,1", "1,0"), \
            pod["metadata"]["annotations"]
        name = container_name(pod)
        for gpu in (0, 1):
            assert name in cgpud.instances(gpu), (gpu, cgpud.instances(gpu))
            assert cgpud.value(f"{gpu}/{name}/memsize") == memsize(4)
    finally:
        cluster.delete_pod("seed-000")


def test_a_kubelet_restart_is_followed_by_re_registration_and_the_pod_keeps_its_instance(cluster, cgpud):
    cluster.create(cluster.pod("keep-3", 3))
    pod = cluster.wait_pod("keep-3", running, 90, "Running")
    gpu = int(pod["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"])
    name, cid = container_name(pod), pod["status"]["containerStatuses"][0]["containerID"]
    cluster.stop_kubelet()
    assert name in cgpud.instances(gpu)
    cluster.start_kubelet()
    from test_cluster_dra import pod_syncs

    wait_for(lambda: _registered(cluster), 60, "the device plugin registered with the new kubelet", cluster.logs)
    wait_for(lambda: pod_syncs(cluster) >= 1, 60, "the new kubelet to sync its pods", cluster.logs)
    pod = cluster.wait_pod("keep-3", running, 30, "still Running")
    status = pod["status"]["containerStatuses"][0]
    assert status["containerID"] == cid and status["restartCount"] == 0, status
    assert name in cgpud.instances(gpu)
    assert cgpud.value(f"{gpu}/{name}/memsize") == memsize(3)
    wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == 2 * UNITS, 30, "the node's units again")
    # and a pod started after the restart gets its units through the re-registered plugin
    cluster.create(cluster.pod("after-3", 3))
    after = cluster.wait_pod("after-3", running, 90, "Running")
    assert container_name(after) in cgpud.instances(int(after["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"]))
    for p in ("keep-3", "after-3"):
        cluster.delete_pod(p)
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go")


def _registered(cluster) -> bool:
    try:
        return 'kubelet_device_plugin_registration_total{resource_name="aliyun.com/gpu-mem"} 1' in \
            cluster.kubelet_metrics()
    except OSError:
        return False


# ---- 5: 1,000 nodes made through the API, as KWOK does -------------------------------------

FAKE_NODES = 1000


def fake_node(i: int, gpus: int = 2) -> dict:
    cap = {"cpu": "32", "memory": "128Gi", "pods": "110", "aliyun.com/gpu-mem": str(gpus * UNITS),
           "aliyun.com/gpu-count": str(gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": f"fake-{i:04d}", "labels": {"cgpud-test/fake": "true", "kubernetes.io/os": "linux"},
                     "annotations": {"cgpu.aliyun.com/gpu-mem-per-device": ",".join([str(UNITS)] * gpus)}},
        "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]},
        "status": {"capacity": cap, "allocatable": cap,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "message": "a node without a kubelet (cgpud's cluster tier)"}]},
    }


def make_fake_nodes(cluster, n: int = FAKE_NODES, gpus: int = 2, start: int = 0) -> None:
    api = cluster.api()

    # (each answer read and dropped, not made into the client's models: 3,000 of them were most of the
    # test's CPU; a refusal still raises)
    raw = {"_preload_content": False}

    def one(i: int) -> None:
        body = fake_node(i, gpus)
        api.create_node(body, **raw).drain_conn()
        api.patch_node_status(body["metadata"]["name"], {"status": body["status"]}, **raw).drain_conn()  # (create
        # keeps no status); the node lifecycle controller's part once a node is Ready: the API server's
        # admission tainted it not-ready at creation
        api.patch_node(body["metadata"]["name"], {"spec": {"taints": body["spec"]["taints"]}}, **raw).drain_conn()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(start, start + n)))


def delete_fake_nodes(cluster) -> None:
    cluster.kubectl("delete", "pods", "-l", "cgpud-test/fake-pod=true", "--force", "--grace-period=0",
                    "--ignore-not-found", check=False, timeout=120)
    # (one DELETE of the collection: kubectl deletes 1,000 nodes one request each)
    cluster.api().delete_collection_node(label_selector="cgpud-test/fake=true", _preload_content=False).drain_conn()


def request_counts(metrics: str) -> dict[tuple[str, str], int]:
    """apiserver_request_total summed by (verb, resource) over codes, scopes and the rest."""
    counts: dict[tuple[str, str], int] = {}
    for line in metrics.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
        key = (labels.get("verb", ""), labels.get("resource", "") + (f"/{labels['subresource']}"
                                                                     if labels.get("subresource") else ""))
        counts[key] = counts.get(key, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_a_thousand_nodes_through_the_extender_and_its_requests(cluster):
    try:
        make_fake_nodes(cluster)
        names = [f"fake-pod-{i}" for i in range(10)]
        for n in names:
            pod = cluster.pod(n, 3, labels={"cgpud-test/fake-pod": "true"}, tolerate_fake=True, runtime_class=None)
            pod["spec"]["nodeSelector"] = {"cgpud-test/fake": "true"}
            cluster.create(pod)
        for n in names:
            pod = cluster.wait_pod(n, lambda p: (p["spec"].get("nodeName") or "").startswith("fake-"), 90,
                                   "bound to a fake node")
            assert pod["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_POD") == "3"
        # the extender with the cluster read: what does it ask the API server for while idle?
        before = request_counts(cluster.apiserver_metrics())
        time.sleep(5)
        after = request_counts(cluster.apiserver_metrics())
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        print("API server requests in 5 s idle with 1,001 nodes:", json.dumps({f"{v} {r}": c for (v, r), c in
                                                                               sorted(delta.items())}))
        lists = delta.get(("LIST", "nodes"), 0) + delta.get(("LIST", "pods"), 0)
        assert lists <= 1, f"{lists} LISTs of nodes and pods in 5 s idle: the cluster is listed again and again " \
                           f"rather than watched ({delta})"
    finally:
        delete_fake_nodes(cluster)


def extender_gauge(name: str) -> float:
    """A gauge of the extender's /metrics (its view of the cluster: cgpud.k8s.score)."""
    host, port = extender_addr()
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def fake_pods(cluster, names: list[str], units: int, annotations: dict | None = None,
              labels: dict | None = None) -> None:
    """Pods for the fake nodes only, created at once (a burst)."""
    api = cluster.api()

    def one(name: str) -> None:
        pod = cluster.pod(name, units, labels={"cgpud-test/fake-pod": "true", **(labels or {})}, tolerate_fake=True,
                          runtime_class=None)
        pod["spec"]["nodeSelector"] = {"cgpud-test/fake": "true"}
        pod["metadata"]["annotations"] = annotations or {}
        api.create_namespaced_pod("default", pod, _preload_content=False).drain_conn()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, names))


def placed_on(cluster, names: list[str], timeout: float = 90) -> dict[str, tuple[str, str]]:
    """Each pod's (node, GPUs) once all are bound."""
    got: dict[str, tuple[str, str]] = {}

    def bound() -> bool:
        items = json.loads(cluster.api().list_namespaced_pod(
            "default", label_selector="cgpud-test/fake-pod=true", _preload_content=False).data)["items"]
        got.clear()
        got.update({p["metadata"]["name"]: (p["spec"].get("nodeName"), (p["metadata"].get("annotations") or {})
                                            .get("ALIYUN_COM_GPU_MEM_IDX")) for p in items})
        return all(got.get(n, (None,))[0] for n in names)

    wait_for(bound, timeout, f"{len(names)} pods bound", lambda: json.dumps(got) + cluster.logs())
    return {n: got[n] for n in names}


def test_a_burst_is_packed_onto_few_gpus_and_a_whole_node_pod_binds_after(cluster):
    """Issue 46 through the real kube-scheduler with the shipped configuration: 16 pods of 3 units at once
    on 12 fake nodes of 2 × 14 go four to a GPU, on 4 GPUs of 2 nodes (kube-scheduler's own scoring, least
    allocated, put one on each node); a pod asking both GPUs of a node (gpu-count 2, 28 units) binds
    after them; 5 pods asking spread (cgpu.aliyun.com/placement) go to 5 nodes of their own."""
    try:
        whole = extender_gauge("cgpu_extender_nodes_whole")
        make_fake_nodes(cluster, 12)
        # (the burst once the extender's watch has brought the 12 nodes with their units, as kube-scheduler's
        # has: on a loaded machine the pods came first, and the extender's score of a node it did not hold
        # yet was none)
        wait_for(lambda: extender_gauge("cgpu_extender_nodes_whole") >= whole + 12, 60,
                 "the extender's view of the 12 fake nodes", cluster.logs)
        burst = [f"burst-{i:02d}" for i in range(16)]
        fake_pods(cluster, burst, 3)
        on = placed_on(cluster, burst)
        gpus = set(on.values())
        assert len(gpus) == 4 and len({n for n, _ in gpus}) == 2, sorted(on.items())
        fake_pods(cluster, ["whole-node"], 28, labels={"aliyun.com/gpu-count": "2"})
        (node, idx), = placed_on(cluster, ["whole-node"]).values()
        assert idx == "0,1" and node not in {n for n, _ in gpus}, (node, idx)
        apart = [f"apart-{i}" for i in range(5)]
        fake_pods(cluster, apart, 3, annotations={"cgpu.aliyun.com/placement": "spread"})
        nodes = {n for n, _ in placed_on(cluster, apart).values()}
        assert len(nodes) == 5 and not nodes & ({n for n, _ in gpus} | {node}), nodes
    finally:
        delete_fake_nodes(cluster)


# ---- last: nothing our parts did was refused -------------------------------------------------


def node_mode(cluster) -> tuple[str | None, dict]:
    """The mode in force the device plugin wrote on the node, and its CgpuModePending condition."""
    node = cluster.get("node", NODE)
    cond = next((c for c in node["status"].get("conditions", []) if c["type"] == "CgpuModePending"), {})
    return node["metadata"].get("annotations", {}).get("cgpu.aliyun.com/gpu-schedule"), cond


def test_relabelling_the_node_changes_its_resources_but_not_while_a_gpu_pod_runs(cluster):
    """ack.node.gpu.schedule (docs/kubernetes.md, A node's mode) on the real kubelet and scheduler:
    default -> whole GPUs (nvidia.com/gpu 2, gpu-mem 0); back to cgpu while a pod holds a GPU ->
    nothing changes and the node's condition says why; the pod gone -> gpu-mem again."""
    def resources() -> tuple[int, int]:
        return cluster.allocatable("nvidia.com/gpu"), cluster.allocatable("aliyun.com/gpu-mem")

    try:
        wait_for(lambda: resources() == (0, 2 * UNITS), 60, "cgpu: gpu-mem only", cluster.logs)
        cluster.kubectl("label", "node", NODE, "ack.node.gpu.schedule=default", "--overwrite")
        wait_for(lambda: resources() == (2, 0), 60, "default: whole GPUs only", cluster.logs)
        assert node_mode(cluster)[0] == "exclusive"
        pod = cluster.pod("whole-1", 0)
        pod["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "1"}
        cluster.create(pod)
        cluster.wait_pod("whole-1", running, 90, "Running on a whole GPU")
        cluster.kubectl("label", "node", NODE, "ack.node.gpu.schedule=cgpu", "--overwrite")
        wait_for(lambda: node_mode(cluster)[1].get("status") == "True", 60, "the condition: the change waits",
                 cluster.logs)
        mode, cond = node_mode(cluster)
        assert mode == "exclusive" and "default/whole-1" in cond["message"], cond
        assert resources() == (2, 0), "nothing changed while the pod runs"
        assert "GpuModeChangeWaiting" in cluster.kubectl("get", "events", "-n", "default", "--field-selector",
                                                         f"involvedObject.name={NODE}").stdout
        cluster.delete_pod("whole-1")
        wait_for(lambda: resources() == (0, 2 * UNITS), 60, "cgpu once the pod is gone", cluster.logs)
        assert node_mode(cluster)[0] == "cgpu" and node_mode(cluster)[1]["status"] == "False"
    finally:
        cluster.delete_pod("whole-1")
        cluster.kubectl("label", "node", NODE, "ack.node.gpu.schedule-", check=False)
        wait_for(lambda: resources() == (0, 2 * UNITS), 60, "back to cgpu", cluster.logs)


def test_nothing_the_device_plugin_or_the_extender_asked_was_refused(cluster):
    for name in ("device-plugin", "extender"):
        log = cluster.procs[name].log_path.read_text(errors="replace")
        # (a status 403, not the digits: the fake nodes' names, fake-0403, hold them)
        assert not re.search(r"\b403\b|orbidden", log), cluster.procs[name].log()
        assert cluster.procs[name].alive(), cluster.procs[name].log()
