"""The cluster tier in DRA mode (issue 29; docs/kubernetes.md, docs/cluster-tests.md): the real
kube-apiserver, kube-scheduler with its own DRA plugin and no extender, a kubelet with DRA on, and
containerd 2.x built from its Go module (scripts/containerd-build.sh) with CDI on and `cgpu` its
default runtime (put in by the node installer's own edit of a version 3 file); deploy/kubernetes with the DRA
component applied; `cgpu dra-plugin` as a host process with the ServiceAccount's token; cgpud
serving two simulated 80 GB H100s (79 GiB each in the slice: 81559 MiB in whole GiB).

Its own cluster (the kubelet's fixed device plugin directory is taken while test_cluster.py's
runs), shared with test_cluster_dra_health.py. The cluster starts once for both; the tests run in
order on it and each removes what it made.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster import DRA_SA, NAMESPACE, NODE, REPO, BUSYBOX_IMAGE, Cluster, Proc, free_port, kubeconfig, \
    node_fixtures, wait_for
from cluster import node as cluster_node
from test_cluster import container_name, running
from test_webhook import SEED_000

pytestmark = pytest.mark.slow

GIB = 1 << 30
GPU_UNITS = 81559 // 1024  # an H100's 81559 MiB in whole GiB
DRIVER = "cgpu.aliyun.com"
CLASS = "gpu.cgpu.aliyun.com"
SA_USER = f"system:serviceaccount:{NAMESPACE}:{DRA_SA}"


def containerd_bin() -> Path:
    p = subprocess.run([REPO / "scripts" / "containerd-build.sh"], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, env=dict(os.environ, PATH=f"{os.environ.get('PATH', '')}:/usr/local/go/bin"))
    if p.returncode != 0:
        pytest.fail(f"scripts/containerd-build.sh failed:\n{p.stderr[-4000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def overlay(d: Path) -> Path:
    """deploy/kubernetes with the DRA component, as a cluster administrator writes it."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(REPO / "deploy" / "kubernetes", d)],
        "components": [os.path.relpath(REPO / "deploy" / "kubernetes" / "dra", d)]}))
    return d


def start_plugin(c: Cluster) -> Proc:
    root = c.path("kubelet", "root")
    kc = c.path("dra-plugin.kubeconfig")  # (its account's token bound to a pod on the node, as the DaemonSet's)
    if not kc.exists():
        kubeconfig(kc, c.server, c.path("pki", "ca.crt"), {"token": c.node_token(DRA_SA)})
    c.procs["dra-plugin"] = Proc("dra-plugin", [
        c._cgpu(), "--socket", c.daemon.socket, "dra-plugin", "--node-name", NODE,
        "--registry-dir", root / "plugins_registry", "--plugin-dir", root / "plugins" / DRIVER,
        "--cdi-dir", c.path("cdi"), "--state-dir", c.path("dra-state"), "--refresh", "0.5"],
        c.path("dra-plugin.log"), env={"KUBECONFIG": os.fspath(kc)}).start()
    return c.procs["dra-plugin"]


# The node (its daemon and cluster) shared with test_cluster_dra_health.py (tests/cluster.py, shared()):
# cgpud on two simulated H100s (GPU health's quiet time 2 s), deploy/kubernetes with the DRA component
# applied, the controllers and the DRA plugin started.
SHARED_CLUSTER = "dra"


def dra_setup(c: Cluster) -> None:
    c.deploy(["-k", os.fspath(overlay(c.path("overlay")))], device_plugin=False, extender=False)
    # the resourceclaim controller takes a deleted pod off its claim's reservedFor (and frees it)
    c.start_controller_manager("resourceclaim-controller,statefulset-controller,job-controller,"
                               "serviceaccount-controller,"
                               "serviceaccount-token-controller,garbage-collector-controller")
    start_plugin(c)


node, cgpud, cluster = node_fixtures(SHARED_CLUSTER, lambda: cluster_node(
    "sim:2xH100", ("--health-quiet", "2"), dra_setup, containerd_bins=containerd_bin(), dra=True))


def not_found(c: Cluster, *args: str) -> None:
    """`kubectl get ARGS` says NotFound (not another error: a kubectl that cannot reach the API
    server must not pass for an object that is not there)."""
    p = c.kubectl("get", *args, check=False)
    assert p.returncode != 0 and "(NotFound)" in p.stderr, (args, p.returncode, p.stdout, p.stderr)


def gpu_config(**config) -> dict:
    return {"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "cgpu.aliyun.com/v1", "kind": "GpuConfig",
                                                        **config}}}


def make_class(c: Cluster, name: str, **config) -> None:
    """A DeviceClass of the shipped one's devices with a GpuConfig of the cluster admin's (weight,
    highPriority: SPEC §2, theirs to grant)."""
    shipped = yaml.safe_load((REPO / "deploy" / "kubernetes" / "dra" / "deviceclass.yaml").read_text())
    c.create({**shipped, "metadata": {"name": name}, "spec": {**shipped["spec"], "config": [gpu_config(**config)]}})


def claim_spec(memory: str, count: int = 1, config: dict | None = None, device_class: str = CLASS) -> dict:
    request = {"name": "gpu", "exactly": {"deviceClassName": device_class, "count": count,
                                          "allocationMode": "ExactCount",
                                          "capacity": {"requests": {"memory": memory}}}}
    spec = {"devices": {"requests": [request]}}
    if count > 1:  # (a GPU that claims share could be given twice to one request)
        spec["devices"]["constraints"] = [{"requests": ["gpu"], "distinctAttribute": f"{DRIVER}/uuid"}]
    if config:
        spec["devices"]["config"] = [{"requests": ["gpu"], **gpu_config(**config)}]
    return spec


def make_claim(c: Cluster, name: str, memory: str, **claim) -> None:
    c.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
              "spec": claim_spec(memory, **claim)})


def claim_pod(name: str, claim: str, entry: str = "gpu", template: bool = False) -> dict:
    """A pod of one container using the claim (its pod-level entry named `entry`; `template`: the
    claim is made from the ResourceClaimTemplate named `claim`); no runtimeClassName (cgpu is
    containerd's default)."""
    ref = {"resourceClaimTemplateName" if template else "resourceClaimName": claim}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": entry, **ref}],
        "containers": [{"name": "app", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "env; trap 'exit 0' TERM; while :; do sleep 1; done"],
                        "resources": {"claims": [{"name": entry}]}}]}}


def allocated_gpus(c: Cluster, claim: str) -> list[int]:
    got = c.get("resourceclaim", claim)
    return [int(r["device"].split("-")[1]) for r in got["status"]["allocation"]["devices"]["results"]]


def run_with_claim(c: Cluster, pod: str, memory: str, **claim) -> tuple[dict, int, str]:
    """A claim `claim-<pod>` of `memory` and a pod using it, Running: (the pod, its GPU, its
    instance's name)."""
    make_claim(c, f"claim-{pod}", memory, **claim)
    c.create(claim_pod(pod, f"claim-{pod}"))
    got = c.wait_pod(pod, running, 90, "Running")
    gpus = allocated_gpus(c, f"claim-{pod}")
    return got, gpus[0], container_name(got)


def delete(c: Cluster, *names: str) -> None:
    for n in names:
        c.delete_pod(n)
    for n in names:
        c.kubectl("delete", "resourceclaim", f"claim-{n}", "--ignore-not-found", "--wait=true", timeout=90)


def test_the_plugin_registers_and_publishes_the_nodes_resourceslice(cluster):
    def slice_() -> dict:
        p = cluster.kubectl("get", "resourceslice", f"{NODE}-{DRIVER}-0", "-o", "json", check=False)
        return json.loads(p.stdout) if p.returncode == 0 else {}

    s = wait_for(slice_, 60, "the node's ResourceSlice", cluster.logs)
    assert s["spec"]["driver"] == DRIVER and s["spec"]["nodeName"] == NODE
    # one device per GPU, its memory shared by claims (no device per memory unit)
    assert [(d["name"], d["capacity"]["memory"]["value"]) for d in s["spec"]["devices"]] == \
        [("gpu-0", str(GPU_UNITS * GIB)), ("gpu-1", str(GPU_UNITS * GIB))]
    assert s["spec"]["pool"]["resourceSliceCount"] == 1
    (owner,) = s["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", NODE, cluster.get("node", NODE)["metadata"]["uid"])
    wait_for(lambda: "registered with the kubelet" in cluster.procs["dra-plugin"].log_path.read_text(), 60,
             "the kubelet's plugin watcher to register the plugin", cluster.logs)
    # the component's objects are in, and the extender's DaemonSet is not (DRA mode has none)
    assert cluster.get("deviceclass", CLASS)["spec"]["selectors"]
    not_found(cluster, "deviceclass", "gpu-mem.cgpu.aliyun.com")
    not_found(cluster, "daemonset", "cgpu-scheduler-extender", "-n", NAMESPACE)
    for verb, res in (("create", "resourceslices.resource.k8s.io"), ("update", "resourceslices.resource.k8s.io"),
                      ("watch", "resourceslices.resource.k8s.io"), ("delete", "resourceslices.resource.k8s.io"),
                      ("get", "resourceclaims.resource.k8s.io"), ("get", "nodes")):
        p = cluster.kubectl("auth", "can-i", verb, res, f"--as={SA_USER}", check=False)
        assert p.stdout.strip() == "yes", (verb, res, p.stdout, p.stderr)
    for verb, res in (("delete", "resourceclaims.resource.k8s.io"), ("update", "resourceclaims.resource.k8s.io"),
                      ("create", "deviceclasses.resource.k8s.io")):
        assert cluster.kubectl("auth", "can-i", verb, res, f"--as={SA_USER}", check=False).stdout.strip() == "no"


def test_a_claim_of_3_gib_runs_isolated_at_3_gib_and_goes_with_its_pod(cluster, cgpud):
    make_class(cluster, "weight-2.gpu.cgpu.aliyun.com", weight=2)  # (the weight: the admin's DeviceClass)
    try:
        pod, gpu, name = run_with_claim(cluster, "run", "3Gi", device_class="weight-2.gpu.cgpu.aliyun.com")
        assert allocated_gpus(cluster, "claim-run") == [gpu]
        assert name in cgpud.instances(gpu), (name, cgpud.instances(gpu), cluster.logs())
        assert cgpud.value(f"{gpu}/{name}/memsize") == str(3 * GIB)
        assert cgpud.value(f"{gpu}/{name}/weight") == "2"
        assert name not in cgpud.instances(1 - gpu)
        env = dict(line.split("=", 1) for line in cluster.kubectl("logs", "run").stdout.splitlines() if "=" in line)
        assert (env.get("ALIYUN_COM_GPU_MEM_IDX"), env.get("ALIYUN_COM_GPU_MEM_CONTAINER")) == (str(gpu), "3"), env
        # kubectl inspect cgpu (its plugin on PATH) reads the node's slices and the claim
        p = subprocess.run([cluster.bins / "kubectl", "inspect", "cgpu", "-d"], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, KUBECONFIG=os.fspath(cluster.admin),
                                                PATH=f"{Path(cluster._cgpu()).parent}:{os.environ['PATH']}"))
        rows = [ln.split() for ln in p.stdout.splitlines()]
        assert ["run", "default", *("3" if g == gpu else "0" for g in (0, 1))] in rows, p.stdout + p.stderr
    finally:
        delete(cluster, "run")
        cluster.kubectl("delete", "deviceclass", "weight-2.gpu.cgpu.aliyun.com", "--ignore-not-found", check=False)
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go with the pod", cluster.logs)
    wait_for(lambda: not list(cluster.path("cdi").glob("*.json")), 30, "the claim unprepared (its CDI spec gone)")


def test_seed_000_a_claim_over_two_gpus_gets_4_gib_on_each(cluster, cgpud):
    make_claim(cluster, "claim-two", "4Gi", count=2)
    cluster.create(claim_pod("two", "claim-two"))
    try:
        pod = cluster.wait_pod("two", running, 90, "Running")
        assert sorted(allocated_gpus(cluster, "claim-two")) == [0, 1]
        name = container_name(pod)
        for gpu in (0, 1):
            assert name in cgpud.instances(gpu), (gpu, cgpud.instances(gpu))
            assert cgpud.value(f"{gpu}/{name}/memsize") == str(4 * GIB)
    finally:
        delete(cluster, "two")


def test_a_claim_that_does_not_fit_stays_pending_with_the_schedulers_reason(cluster, cgpud):
    make_claim(cluster, "claim-big", f"{GPU_UNITS + 1}Gi")  # each H100 has 79 GiB in the slice
    cluster.create(claim_pod("big", "claim-big"))
    try:
        def failed() -> str:
            e = cluster.events("big")
            return e if "FailedScheduling" in e else ""

        events = wait_for(failed, 60, "FailedScheduling on big", cluster.logs)
        assert "cannot allocate all claims" in events, events
        pod = cluster.get("pod", "big")
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
        assert not cluster.get("resourceclaim", "claim-big").get("status", {}).get("allocation")
    finally:
        delete(cluster, "big")


@pytest.mark.parametrize("config, why", [
    ({"weight": 0}, "weight 0 is not a whole number from 1 to 25"),
    # (issue 44: a tenant's claim cannot give itself weight or high priority, SPEC §2)
    ({"weight": 16}, "weight and highPriority are the cluster admin's to grant, in a DeviceClass's GpuConfig "
                     "(source FromClass), not the claim's (FromClaim)"),
])
def test_a_claim_with_a_bad_configuration_is_refused_on_the_pods_events_and_nothing_runs(cluster, cgpud, config,
                                                                                         why):
    """The scheduler passes opaque configuration through unread; Prepare refuses it with one line,
    which the kubelet puts on the pod: no container starts, no instance is made, no spec written."""
    make_claim(cluster, "claim-bad", "1Gi", config=config)
    cluster.create(claim_pod("bad", "claim-bad"))
    try:
        # each stage waits on its own event, with room for a loaded machine: bound by kube-scheduler,
        # refused by the plugin at the kubelet's first Prepare, the refusal on the pod's events (put
        # there by the kubelet with that answer, not at a retry)
        cluster.wait_pod("bad", lambda p: bool(p["spec"].get("nodeName")), 180, "bound")
        log = cluster.procs["dra-plugin"].log_path
        wait_for(lambda: f"prepare default/claim-bad refused: ResourceClaim default/claim-bad, config 0: {why}"
                 in log.read_text(), 180, "the kubelet's Prepare refused by the plugin", cluster.logs)

        def refused() -> str:
            e = cluster.events("bad")
            return e if why in e else ""

        wait_for(refused, 60, "the plugin's refusal on the pod's events", cluster.logs)
        pod = cluster.get("pod", "bad")
        assert pod["status"]["phase"] == "Pending" and pod["spec"]["nodeName"] == NODE, pod["status"]
        assert not cgpud.instances(0) and not cgpud.instances(1)
        assert not list(cluster.path("cdi").glob("*.json")) and not list(cluster.path("dra-state").glob("*.json"))
    finally:
        delete(cluster, "bad")


def test_a_plugin_restart_keeps_the_running_pods_instance_and_prepares_again(cluster, cgpud):
    try:
        pod, gpu, name = run_with_claim(cluster, "keep", "3Gi")
        cid = pod["status"]["containerStatuses"][0]["containerID"]
        registered = kubelet_registrations(cluster)
        cluster.procs["dra-plugin"].proc.kill()
        cluster.procs["dra-plugin"].proc.wait(10)
        start_plugin(cluster)
        wait_for(lambda: "1 claims prepared before" in cluster.procs["dra-plugin"].log_path.read_text(), 30,
                 "the plugin to read its prepared claims back", cluster.logs)
        # (the kubelet unregisters the old plugin at one pass of its plugin manager and registers the new one
        # at the next, a second later: a Prepare between fails, "DRA driver cgpu.aliyun.com is not registered",
        # and waits for the kubelet's next try, 80 s — docs/kubernetes.md)
        wait_for(lambda: kubelet_registrations(cluster) > registered, 30, "the kubelet to register the new plugin",
                 cluster.logs)
        assert name in cgpud.instances(gpu) and cgpud.value(f"{gpu}/{name}/memsize") == str(3 * GIB)
        status = cluster.wait_pod("keep", running, 30, "still Running")["status"]["containerStatuses"][0]
        assert status["containerID"] == cid and status["restartCount"] == 0, status
        # a pod after the restart is prepared by the new plugin
        _, g2, n2 = run_with_claim(cluster, "after", "2Gi")
        assert cgpud.value(f"{g2}/{n2}/memsize") == str(2 * GIB)
    finally:
        delete(cluster, "keep", "after")
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go")


def kubelet_registrations(c: Cluster) -> int:
    """How many registrations of the plugin the kubelet (all its processes) has finished: each
    `RegisterPlugin started` of its plugin manager followed by its DRA manager's connection to the
    plugin (not the connections gRPC makes on its own: one came right after a kill)."""
    log = c.procs["kubelet"].log_path.read_text(errors="replace")
    parts = re.split(rf'"OperationExecutor\.RegisterPlugin started"[^\n]*{re.escape(DRIVER)}-reg\.sock', log)[1:]
    return sum(bool(re.search(rf'"Connection changed".*driverName="{re.escape(DRIVER)}".*connected=true', p))
               for p in parts)


def test_a_kubelet_restart_registers_the_plugin_again_and_keeps_the_running_pods_instance(cluster, cgpud):
    try:
        pod, gpu, name = run_with_claim(cluster, "kr", "3Gi")
        cid = pod["status"]["containerStatuses"][0]["containerID"]
        log = cluster.procs["dra-plugin"].log_path
        before = log.read_text().count("registered with the kubelet")
        cluster.stop_kubelet()
        assert name in cgpud.instances(gpu)
        cluster.start_kubelet()
        wait_for(lambda: log.read_text().count("registered with the kubelet") > before, 60,
                 "the new kubelet's plugin watcher to register the plugin again", cluster.logs)
        wait_for(lambda: pod_syncs(cluster) >= 1, 60, "the new kubelet to sync its pods", cluster.logs)
        status = cluster.wait_pod("kr", running, 30, "still Running")["status"]["containerStatuses"][0]
        assert status["containerID"] == cid and status["restartCount"] == 0, status
        assert cgpud.value(f"{gpu}/{name}/memsize") == str(3 * GIB)
        _, g2, n2 = run_with_claim(cluster, "kr2", "1Gi")  # and the new kubelet prepares a claim through it
        assert cgpud.value(f"{g2}/{n2}/memsize") == str(GIB)
    finally:
        delete(cluster, "kr", "kr2")
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go")


def pod_syncs(c: Cluster) -> int:
    """How many pod syncs the kubelet (this process of it) has finished: its pod workers' count."""
    try:
        text = c.kubelet_metrics()
    except OSError:  # (not serving yet)
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith("kubelet_pod_worker_duration_seconds_count"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_a_node_restart_with_its_cdi_specs_gone_starts_the_claims_container_again(cluster, cgpud):
    """What a reboot leaves: /var/run/cdi emptied (tmpfs), the plugin, containerd and the kubelet
    started again, the pod's container gone. The plugin writes each prepared claim's spec again
    before it registers, so the kubelet's new container (no new Prepare: the claim is prepared in
    its checkpoint) starts with the claim's memory, not `unresolvable CDI devices`."""
    try:
        pod, gpu, name = run_with_claim(cluster, "boot", "3Gi")
        cid = pod["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
        cluster.stop_kubelet()
        plugin = cluster.procs["dra-plugin"]
        starts = plugin.log_path.read_text().count("claims prepared before")
        plugin.proc.kill()
        plugin.proc.wait(10)
        for spec in cluster.path("cdi").glob("*"):
            spec.unlink()
        assert cluster.ctr("tasks", "kill", "-s", "SIGKILL", cid).returncode == 0
        cluster.restart_containerd()
        log = start_plugin(cluster).log_path
        wait_for(lambda: log.read_text().count("claims prepared before") > starts, 60, "the plugin's start",
                 cluster.logs)
        assert list(cluster.path("cdi").glob("*.json"))  # (written again before it registers)
        cluster.start_kubelet()

        def again(p: dict) -> bool:
            s = (p["status"].get("containerStatuses") or [{}])[0]
            return s.get("restartCount", 0) >= 1 and "running" in s.get("state", {})

        got = cluster.wait_pod("boot", again, 180, "its container started again")
        new = container_name(got)
        assert new != name and new in cgpud.instances(gpu), (new, cgpud.instances(gpu))
        assert cgpud.value(f"{gpu}/{new}/memsize") == str(3 * GIB)
    finally:
        delete(cluster, "boot")


WEBHOOK = "cgpu-dra-webhook"  # the component's MutatingWebhookConfiguration and ServiceAccount


def start_webhook(c: Cluster) -> Proc:
    """`cgpu dra-webhook` as a host process with its ServiceAccount's token, called by the API server
    at https://127.0.0.1:PORT/mutate: the component's MutatingWebhookConfiguration gets that `url` in
    place of its Service (no kube-proxy here) as an administrator would patch it; the webhook makes
    its certificate for 127.0.0.1 and writes its CA into the caBundle itself."""
    port = free_port()
    c.kubectl("patch", "mutatingwebhookconfiguration", WEBHOOK, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/webhooks/0/clientConfig", "value": {"url": f"https://127.0.0.1:{port}/mutate"}}]))
    token = c.kubectl("create", "token", WEBHOOK, "-n", NAMESPACE, "--duration", "6h").stdout.strip()
    kc = kubeconfig(c.path("webhook.kubeconfig"), c.server, c.path("pki", "ca.crt"), {"token": token})
    c.procs["dra-webhook"] = Proc("dra-webhook", [
        c._cgpu(), "dra-webhook", "--addr", f"127.0.0.1:{port}", "--tls-san", "127.0.0.1", "--webhook-config", WEBHOOK,
        "--client-ca", c.path("pki", "ca.crt")],  # (the API server's client certificate toward webhooks: its CA)
        c.path("dra-webhook.log"), env={"KUBECONFIG": os.fspath(kc)}).start()
    return c.procs["dra-webhook"]


def labelled_pod(c: Cluster, name: str, gpu_mem: int, count: int = 2) -> dict:
    return c.pod(name, gpu_mem, labels={"aliyun.com/gpu-count": str(count)}, runtime_class=None)


def dry_run(c: Cluster, pod: dict) -> subprocess.CompletedProcess:
    return c.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", check=False, stdin=json.dumps(pod))


def admitted(c: Cluster, proc: Proc) -> dict | None:
    """A labelled pod as the webhook changed it (a server-side dry run: nothing stored, nothing made),
    once the API server calls it over TLS trusting the CA it wrote; None before."""
    if not proc.alive():
        pytest.fail("the webhook exited:\n" + proc.log())
    p = dry_run(c, labelled_pod(c, "dry", 2))
    return json.loads(p.stdout) if p.returncode == 0 else None


@pytest.fixture(scope="module")
def webhook(cluster):
    proc = start_webhook(cluster)

    pod = wait_for(lambda: admitted(cluster, proc), 60, "the API server to call the webhook", cluster.logs)
    assert pod["spec"]["resourceClaims"] == [{"name": "cgpu-gpu-mem", "resourceClaimTemplateName": "cgpu-gpu-mem-2x2"}]
    # sideEffects NoneOnDryRun: the dry run made no template
    not_found(cluster, "resourceclaimtemplate", "cgpu-gpu-mem-2x2")
    return proc




def sandboxed(manifest: str, command: str = "env; trap 'exit 0' TERM; while :; do sleep 1; done") -> dict:
    """A seed's workload (a Job's, a StatefulSet's YAML) as written, with only its image and command
    this sandbox's (no registry here: busybox, never pulled), and a grace period of 1 s."""
    obj = yaml.safe_load(manifest)
    spec = obj["spec"]["template"]["spec"]
    (app,) = spec["containers"]
    app["image"], app["imagePullPolicy"], app["command"] = BUSYBOX_IMAGE, "Never", ["sh", "-c", command]
    spec["terminationGracePeriodSeconds"] = 1
    return obj


def seed_000_job() -> dict:
    """Seed 000's Job as written (only its image and command are this sandbox's: no registry here)."""
    return sandboxed(SEED_000)


def job_pod(c: Cluster, job: str) -> dict:
    def one() -> dict:
        items = json.loads(c.kubectl("get", "pods", "-l", f"job-name={job}", "-o", "json").stdout)["items"]
        return items[0] if items and running(items[0]) else {}

    return wait_for(one, 90, f"job {job}'s pod Running", lambda: c.kubectl("describe", "job", job, check=False).stdout
                    + c.logs())


def pod_env(c: Cluster, pod: str) -> dict[str, str]:
    return wait_for(lambda: dict(line.split("=", 1) for line in c.kubectl("logs", pod).stdout.splitlines()
                                 if "=" in line), 30, f"pod {pod}'s environment in its log")


def pod_claim(c: Cluster, pod: dict) -> dict:
    """The claim the webhook gave the pod (made from its template by the resourceclaim controller)."""
    (st,) = [x for x in pod["status"]["resourceClaimStatuses"] if x["name"] == "cgpu-gpu-mem"]
    return c.get("resourceclaim", st["resourceClaimName"])


def test_gpu_mem_of_any_size_runs_on_one_gpu_and_beside_claims(cluster, cgpud, webhook):
    """A pod as the seeds write it (`aliyun.com/gpu-mem: N` in its limits, no claim, no
    runtimeClassName, no label): the webhook asks N GiB of one GPU as capacity. 40 (more than the 32
    devices one claim may hold) runs on one GPU; with a 20 GiB claim on each GPU, 3 runs beside them
    (a GPU holding claims still gives the rest of its memory)."""
    cluster.create(cluster.pod("mem-40", 40, runtime_class=None))
    try:
        pod = cluster.wait_pod("mem-40", running, 90, "Running")
        (r,) = pod_claim(cluster, pod)["status"]["allocation"]["devices"]["results"]
        assert r["consumedCapacity"]["memory"] in ("40Gi", str(40 * GIB)), r
        gpu, name = int(r["device"].split("-")[1]), container_name(pod)
        assert cgpud.value(f"{gpu}/{name}/memsize") == str(40 * GIB)
        assert name not in cgpud.instances(1 - gpu)
        assert cluster.get("node", NODE)["status"]["allocatable"].get("aliyun.com/gpu-mem") is None  # no device plugin
    finally:
        cluster.delete_pod("mem-40")
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go with the pod", cluster.logs)
    try:
        run_with_claim(cluster, "hold", "20Gi", count=2)
        assert sorted(allocated_gpus(cluster, "claim-hold")) == [0, 1]
        cluster.create(cluster.pod("mem-3", 3, runtime_class=None))
        pod = cluster.wait_pod("mem-3", running, 90, "Running beside the two claims")
        (r,) = pod_claim(cluster, pod)["status"]["allocation"]["devices"]["results"]
        gpu, name = int(r["device"].split("-")[1]), container_name(pod)
        assert cgpud.value(f"{gpu}/{name}/memsize") == str(3 * GIB)
    finally:
        cluster.delete_pod("mem-3")
        delete(cluster, "hold")


def test_seed_000_job_unchanged_runs_with_4_gib_on_each_of_two_gpus(cluster, cgpud, webhook):
    """Seed 000's Job as written (label aliyun.com/gpu-count: "2", limit aliyun.com/gpu-mem: 8), no
    extender: the webhook turns its pod's gpu-mem into a claim of 4 GiB on each of two GPUs."""
    cluster.create(seed_000_job())
    try:
        pod = job_pod(cluster, "tensorflow-mnist-multigpu")
        name = container_name(pod)
        for gpu in (0, 1):
            assert name in cgpud.instances(gpu), (gpu, cgpud.instances(gpu), cluster.logs())
            assert cgpud.value(f"{gpu}/{name}/memsize") == str(4 * GIB)
        env = pod_env(cluster, pod["metadata"]["name"])
        assert (env.get("ALIYUN_COM_GPU_MEM_IDX"), env.get("ALIYUN_COM_GPU_MEM_CONTAINER")) == ("0,1", "4"), env
        # how: a claim from the namespace's template, and no gpu-mem left on the container
        (pc,) = pod["spec"]["resourceClaims"]
        assert pc["resourceClaimTemplateName"] == "cgpu-gpu-mem-8x2", pod["spec"]
        limits = pod["spec"]["containers"][0]["resources"].get("limits") or {}
        assert "aliyun.com/gpu-mem" not in limits, pod["spec"]["containers"][0]
        claim = next(s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"] if s["name"] == pc["name"])
        assert sorted(allocated_gpus(cluster, claim)) == [0, 1]
        # kubectl inspect cgpu shows the pod with 4 on each GPU, as the extender's path shows it
        p = subprocess.run([cluster.bins / "kubectl", "inspect", "cgpu", "-d"], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, KUBECONFIG=os.fspath(cluster.admin),
                                                PATH=f"{Path(cluster._cgpu()).parent}:{os.environ['PATH']}"))
        assert [pod["metadata"]["name"], "default", "4", "4"] in [ln.split() for ln in p.stdout.splitlines()], \
            p.stdout + p.stderr
    finally:
        cluster.kubectl("delete", "job", "tensorflow-mnist-multigpu", "--cascade=foreground", "--wait=true",
                        "--timeout=60s", timeout=90)
    wait_for(lambda: name not in cgpud.instances(0) and name not in cgpud.instances(1), 30,
             "the instances to go with the Job", cluster.logs)


def test_a_pod_whose_gpu_mem_does_not_split_over_its_gpus_is_refused_with_the_reason(cluster, cgpud, webhook):
    p = cluster.kubectl("create", "-f", "-", check=False, stdin=json.dumps(labelled_pod(cluster, "odd", 7)))
    assert p.returncode != 0
    assert ('admission webhook "gpu-count.cgpu.aliyun.com" denied the request: container app: aliyun.com/gpu-mem 7 '
            "cannot be spread over aliyun.com/gpu-count 2: each GPU gives the same memory, so N/M must be a whole "
            "number of units (7/2 is not)") in p.stderr, p.stderr
    not_found(cluster, "pod", "odd")  # nothing made
    not_found(cluster, "resourceclaimtemplate", "cgpu-gpu-mem-7x2")


def test_the_webhook_may_make_templates_and_set_its_ca_and_nothing_else(cluster, webhook):
    user = f"system:serviceaccount:{NAMESPACE}:{WEBHOOK}"
    for verb, res, yes in (("create", "resourceclaimtemplates.resource.k8s.io", "yes"),
                           ("patch", f"mutatingwebhookconfigurations/{WEBHOOK}", "yes"),
                           ("patch", "mutatingwebhookconfigurations/other", "no"),
                           ("delete", "resourceclaimtemplates.resource.k8s.io", "no"),
                           ("create", "pods", "no"), ("update", "resourceclaims.resource.k8s.io", "no")):
        p = cluster.kubectl("auth", "can-i", verb, res, f"--as={user}", "-A", check=False)
        assert p.stdout.strip() == yes, (verb, res, p.stdout, p.stderr)
    log = webhook.log_path.read_text(errors="replace")
    assert "caBundle of MutatingWebhookConfiguration cgpu-dra-webhook (1 webhooks)" in log, log
    assert not re.search(r"Traceback|\b403\b", log), log


def test_while_the_webhook_is_down_labelled_pods_are_refused_and_others_never_wait_on_it(cluster, webhook):
    """failurePolicy Fail, scoped by the matchConditions: with the webhook gone a pod asking gpu-mem
    (or labelled) is refused (never run without its memory) and a pod asking none is admitted as
    ever; started again,
    the webhook makes a new CA, writes it into the caBundle, and labelled pods are admitted again."""
    def bundle() -> str:
        return cluster.get("mutatingwebhookconfiguration", WEBHOOK)["webhooks"][0]["clientConfig"].get("caBundle", "")

    before = bundle()
    cluster.procs["dra-webhook"].proc.kill()
    cluster.procs["dra-webhook"].proc.wait(10)
    p = dry_run(cluster, labelled_pod(cluster, "down", 2))
    assert p.returncode != 0 and 'failed calling webhook "gpu-count.cgpu.aliyun.com"' in p.stderr, p.stderr
    p = dry_run(cluster, cluster.pod("asks", 2, runtime_class=None))  # (asks gpu-mem, no label)
    assert p.returncode != 0 and 'failed calling webhook "gpu-count.cgpu.aliyun.com"' in p.stderr, p.stderr
    plain = cluster.pod("plain", 2, runtime_class=None)
    del plain["spec"]["containers"][0]["resources"]
    p = dry_run(cluster, plain)
    assert p.returncode == 0 and "resourceClaims" not in json.loads(p.stdout)["spec"], p.stderr
    proc = start_webhook(cluster)
    pod = wait_for(lambda: admitted(cluster, proc), 60, "the restarted webhook to be called", cluster.logs)
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "cgpu-gpu-mem-2x2"
    assert bundle() and bundle() != before


SEED_004 = """
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: binpack
  labels:
    app: binpack
spec:
  replicas: 1
  serviceName: "binpack-1"
  podManagementPolicy: "Parallel"
  selector: # define how the deployment finds the pods it manages
    matchLabels:
      app: binpack-1
  template: # The pod specifications.
    metadata:
      labels:
        app: binpack-1
    spec:
      containers:
      - name: binpack-1
        image: registry.cn-beijing.aliyuncs.com/ai-samples/gpushare-sample:tensorflow-1.5
        command:
        - bash
        - gpushare/run.sh
        resources:
          limits:
            # 128 MiB
            aliyun.com/gpu-mem: 16 # 16 * 128 MiB = 2 GiB
"""


CORE = "aliyun.com/gpu-core.percentage"


def core_pod(c: Cluster, name: str, gpu_mem: int, percentage: str) -> dict:
    pod = c.pod(name, gpu_mem, runtime_class=None)
    pod["spec"]["containers"][0]["resources"]["limits"][CORE] = percentage
    return pod


def set_mode(c: Cluster, mode: str | None) -> None:
    c.kubectl("label", "node", NODE, f"ack.node.gpu.schedule={mode}" if mode else "ack.node.gpu.schedule-",
              "--overwrite")


def slice_modes(c: Cluster) -> list[str]:
    s = c.get("resourceslice", f"{NODE}-{DRIVER}-0")
    return [d["attributes"].get("mode", {}).get("string") for d in s["spec"].get("devices") or ()]


def mode_pending(c: Cluster) -> dict | None:
    conds = c.get("node", NODE)["status"].get("conditions", [])
    return next((x for x in conds if x["type"] == "CgpuModePending" and x["status"] == "True"), None)


def test_the_node_label_sets_the_dra_mode_core_mem_runs_a_30_percent_pod_and_a_change_waits(cluster, cgpud, webhook):
    """Issue 37 in DRA mode, on the real scheduler: a bad compute percentage is refused at CREATE
    (by the webhook in DRA, by the policy cgpu-gpu-core-percentage where the webhook passes over the
    namespace); the node labelled core_mem publishes core_mem devices; a pod asking gpu-mem 2 and 30 %
    runs with ALIYUN_COM_GPU_CORE_PERCENTAGE=30 (its claim consumed 30 of `compute`) while a
    memory-only pod stays Pending; relabelled cgpu while the 30 % pod runs, the node keeps core_mem
    (CgpuModePending) and switches when the pod is deleted: then the memory-only pod runs."""
    p = dry_run(cluster, core_pod(cluster, "bad-core", 2, "33"))
    assert p.returncode != 0 and ("container app: limits aliyun.com/gpu-core.percentage 33 is not a percentage "
                                  "core_mem gives: give a whole multiple of 5 from 5 to 100") in p.stderr, p.stderr
    cluster.kubectl("create", "namespace", "no-dra-webhook")
    cluster.kubectl("label", "namespace", "no-dra-webhook", "cgpu.aliyun.com/dra-webhook=off")
    try:
        for bad in ("3", "105", "1k"):
            pod = core_pod(cluster, "bad-core", 2, bad)
            pod["metadata"]["namespace"] = "no-dra-webhook"
            p = dry_run(cluster, pod)
            assert p.returncode != 0 and "cgpu-gpu-core-percentage" in p.stderr and (
                f"container app: aliyun.com/gpu-core.percentage {bad} is not a percentage core_mem gives: give a "
                "whole multiple of 5 from 5 to 100") in p.stderr, p.stderr
        pod = core_pod(cluster, "good-core", 2, "30")
        pod["metadata"]["namespace"] = "no-dra-webhook"
        assert dry_run(cluster, pod).returncode == 0
    finally:
        cluster.kubectl("delete", "namespace", "no-dra-webhook", "--wait=false")

    set_mode(cluster, "core_mem")
    try:
        wait_for(lambda: slice_modes(cluster) == ["core_mem"] * 2, 60, "core_mem devices published", cluster.logs)
        cluster.create(core_pod(cluster, "core-30", 2, "30"))
        pod = cluster.wait_pod("core-30", running, 90, "Running")
        assert pod_env(cluster, "core-30")["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30"
        (r,) = pod_claim(cluster, pod)["status"]["allocation"]["devices"]["results"]
        assert str(r["consumedCapacity"]["compute"]) == "30", r
        cluster.create(cluster.pod("mem-only", 2, runtime_class=None))
        wait_for(lambda: any(x["type"] == "PodScheduled" and x["status"] == "False" for x in
                             cluster.get("pod", "mem-only").get("status", {}).get("conditions", [])), 60,
                 "the memory-only pod found unschedulable on the core_mem node", cluster.logs)

        set_mode(cluster, "cgpu")
        cond = wait_for(lambda: mode_pending(cluster), 30, "CgpuModePending", cluster.logs)
        assert "stays in mode core_mem" in cond["message"], cond
        assert slice_modes(cluster) == ["core_mem"] * 2
        assert cluster.get("pod", "mem-only")["status"].get("phase") == "Pending"
        cluster.delete_pod("core-30")
        wait_for(lambda: slice_modes(cluster) == ["cgpu"] * 2, 60, "cgpu devices once the pod is gone", cluster.logs)
        assert not mode_pending(cluster)
        cluster.wait_pod("mem-only", running, 120, "Running once the node is cgpu")
    finally:
        cluster.delete_pod("core-30")
        cluster.delete_pod("mem-only")
        set_mode(cluster, "cgpu")  # (the daemon back in cgpu; without the label the node keeps the daemon's mode)
        set_mode(cluster, None)
    wait_for(lambda: slice_modes(cluster) == ["cgpu"] * 2 and not cgpud.instances(0) and not cgpud.instances(1), 60,
             "the node back in cgpu with no instance", cluster.logs)


def share_mode(c: Cluster, cgpud) -> None:
    """The node's daemon in `share` mode (128 MiB units), and its slice in them (once: each test that
    needs it says so, whichever runs first)."""
    if "share" not in cgpud.extra_args:
        cgpud.stop()
        cgpud.extra_args += ["--mode", "share"]
        cgpud.start()
    wait_for(lambda: (s := c.kubectl("get", "resourceslice", f"{NODE}-{DRIVER}-0", "-o", "json", check=False))
             .returncode == 0 and json.loads(s.stdout)["spec"]["devices"][0]["attributes"]["memoryUnit"]["int"]
             == 128 << 20, 60, "the slice in 128 MiB units", c.logs)


def test_seed_004_statefulset_on_a_128_mib_node_runs_at_2_gib(cluster, cgpud, webhook):
    """Seed 004's StatefulSet as written (only its image and command are this sandbox's: no registry
    here), on the node once its daemon runs in `share` mode (128 MiB units): the plugin publishes the
    new unit by itself, the webhook asks gpu-mem 16 as a claim whose 128 MiB alternative the node
    has, the container has 2 GiB."""
    share_mode(cluster, cgpud)
    cluster.create(sandboxed(SEED_004))
    try:
        pod = cluster.wait_pod("binpack-0", running, 90, "Running")
        (r,) = pod_claim(cluster, pod)["status"]["allocation"]["devices"]["results"]
        assert r["consumedCapacity"]["memory"] in ("2Gi", str(2 * GIB)), r
        gpu = int(r["device"].split("-")[1])
        name = container_name(pod)
        assert cgpud.value(f"{gpu}/{name}/memsize") == str(2 * GIB)
        assert pod_env(cluster, "binpack-0")["ALIYUN_COM_GPU_MEM_CONTAINER"] == "16"
    finally:
        cluster.kubectl("delete", "statefulset", "binpack", "--wait=true", timeout=90)
        cluster.delete_pod("binpack-0")
    wait_for(lambda: name not in cgpud.instances(gpu), 30, "the instance to go with the pod", cluster.logs)


def test_on_a_128_mib_node_the_label_spreads_the_nodes_own_units(cluster, cgpud, webhook):
    """On a node in `share` mode (128 MiB units): gpu-mem 8 over two GPUs is 4 of its units, 512 MiB,
    on each (the template's second alternative, chosen by the slice's memoryUnit), as the extender
    counts a node's units."""
    share_mode(cluster, cgpud)
    cluster.create(labelled_pod(cluster, "share-8x2", 8))
    try:
        pod = cluster.wait_pod("share-8x2", running, 90, "Running")
        name = container_name(pod)
        for gpu in (0, 1):
            assert cgpud.value(f"{gpu}/{name}/memsize") == str(4 * 128 << 20), (gpu, cgpud.instances(gpu))
        assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "cgpu-gpu-mem-8x2"
    finally:
        cluster.delete_pod("share-8x2")
    wait_for(lambda: name not in cgpud.instances(0) and name not in cgpud.instances(1), 30, "the instances to go")


def test_nothing_the_dra_plugin_asked_was_refused(cluster):
    log = cluster.procs["dra-plugin"].log_path.read_text(errors="replace")
    assert not re.search(r"\b403\b|orbidden", log), log  # (a claim's UID may hold the digits 403)
    assert cluster.procs["dra-plugin"].alive(), log
