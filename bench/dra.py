"""bench/dra: DRA mode's figures (issue 29), one run, on the real components of tests/cluster.py
with containerd 2 (scripts/containerd-build.sh, CDI on) and cgpud serving two simulated T4s. The
node runs both paths at once — `cgpu device-plugin` with the scheduler extender, and `cgpu
dra-plugin` — so each DRA figure is printed beside the device plugin's, measured in the same run.

1. Pod created (the API call) -> its container's instance in the cgpu_km tree, p50 and p99
   over --pods pods each way, taken in turns: a pod asking `aliyun.com/gpu-mem: 1` (extender,
   device plugin, Allocate's environment) and a pod with a ResourceClaim of 1 GiB (kube-
   scheduler's DRA plugin, NodePrepareResources, the CDI spec applied by containerd). Each pod
   is deleted before the next (the two paths count the same GPUs in different books).
   Reference: a pod asking nothing, created -> Running as the kubelet reports it.
2. --fake-nodes nodes with no kubelet, made through the API as KWOK does, each with the
   ResourceSlices `cgpu dra-plugin` writes for 8 GPUs × 16 GiB (made by cgpud.k8s.dra) and,
   for the extender, 8 × 16 units of aliyun.com/gpu-mem: a pod with a claim of 1 GiB and a pod
   asking aliyun.com/gpu-mem 1 pinned to the fake nodes, created -> bound (spec.nodeName),
   p50 and p99 over --bind-pods each way.

3. --node-pods pods of 1 GiB made at once for one node of 8 GPUs × 16 GiB (made through the API as
   in 2), each way: claims through kube-scheduler's DRA plugin, gpu-mem 1 through the extender.
   How many were bound (128 fit), the most any GPU was given (16 GiB: none over-filled), how
   many GPUs the first 20 pods were put on (binpack: 2), and the binding rate in pods/s.

4. Seed 000's Job as written (label aliyun.com/gpu-count: "2", gpu-mem 8) created -> its
   container's instance in the tree on both GPUs, --jobs Jobs each way, taken in turns: through
   `cgpu dra-webhook` (the pod turned into a claim of 4 GiB × 2 GPUs, kube-scheduler's DRA plugin)
   and, in a namespace labelled cgpu.aliyun.com/dra-webhook=off, through the extender and the
   device plugin. Then the webhook's own cost: seed 000's pod created through the API server
   (server-side dry run: admitted, nothing stored) p50 and p99 over 100, against the same pod
   without the label, in turns.

    .venv/bin/python bench/dra.py [--pods 20] [--fake-nodes 1000] [--bind-pods 20] [--node-pods 200] [--jobs 10]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(HERE)]  # (tests/cluster.py, not bench/cluster.py)

from common import pct  # noqa: E402

GIB = 1 << 30


def ms(x: float) -> str:
    return f"{x * 1000:.0f} ms"


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout} s")
        time.sleep(0.005)
    return got


def instances(cgpud) -> set[str]:
    return set(cgpud.instances(0)) | set(cgpud.instances(1))


def pipeline_figures(c, cgpud, pods: int) -> None:
    from test_cluster_dra import claim_pod, make_claim

    api = c.api()
    dp, dra_, plain = [], [], []
    for i in range(pods):
        for way, samples in (("dp", dp), ("dra", dra_)):
            name = f"bench-{way}-{i}"
            before = instances(cgpud)
            if way == "dra":
                make_claim(c, f"claim-{name}", "1Gi")
                body = claim_pod(name, f"claim-{name}")
            else:
                body = c.pod(name, 1, runtime_class=None)
            t = time.monotonic()
            api.create_namespaced_pod("default", body)
            wait(lambda: instances(cgpud) - before, 120, f"pod {name}: its instance\n{c.events(name)}")
            samples.append(time.monotonic() - t)
            c.delete_pod(name)
            if way == "dra":
                c.kubectl("delete", "resourceclaim", f"claim-{name}", "--wait=true", timeout=90)
            wait(lambda: not (instances(cgpud) - before), 60, f"pod {name}: its instance gone")
    for i in range(pods):
        body = c.pod(f"bench-plain-{i}", 0, runtime_class=None)
        del body["spec"]["containers"][0]["resources"]
        t = time.monotonic()
        api.create_namespaced_pod("default", body)
        wait(lambda: api.read_namespaced_pod_status(f"bench-plain-{i}", "default").status.phase == "Running", 120,
             f"pod bench-plain-{i} Running")
        plain.append(time.monotonic() - t)
    print(f"pod created -> instance in the tree, {pods} pods each way (1 GiB), load average {os.getloadavg()[0]:.1f}:")
    print(f"  DRA (claim, dra-plugin, CDI):              p50 {ms(pct(dra_, 50))}  p99 {ms(pct(dra_, 99))}")
    print(f"  device plugin + extender (gpu-mem 1):      p50 {ms(pct(dp, 50))}  p99 {ms(pct(dp, 99))}")
    print(f"  reference: a pod asking nothing -> Running: p50 {ms(pct(plain, 50))}")
    c.kubectl("delete", "pods", "--all", "--wait=true", "--timeout=120s", timeout=180)


def job_figures(c, cgpud, jobs: int) -> None:
    """Seed 000's Job each way in turns: created -> its instance on both GPUs."""
    from test_cluster_dra import seed_000_job, start_webhook

    start_webhook(c)
    ns = "bench-extender"
    c.kubectl("create", "namespace", ns)
    c.kubectl("label", "namespace", ns, "cgpu.aliyun.com/dra-webhook=off")
    wait(lambda: c.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0, 60,
         f"the ServiceAccount default of {ns}")
    c.kubectl("patch", "serviceaccount", "default", "-n", ns, "-p", '{"automountServiceAccountToken": false}')
    wait(lambda: c.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", check=False,
                           stdin=json.dumps(seed_000_job()["spec"]["template"] | {
                               "apiVersion": "v1", "kind": "Pod", "metadata": {
                                   "name": "probe", "labels": {"aliyun.com/gpu-count": "2"}}})).returncode == 0,
         60, "the API server to call the webhook")
    took = {"webhook": [], "extender": []}
    for i in range(jobs):
        for way, namespace in (("webhook", "default"), ("extender", ns)):
            job = seed_000_job()
            job["metadata"]["name"] = name = f"seed000-{way}-{i}"
            have = instances(cgpud)
            t = time.monotonic()
            c.kubectl("create", "-n", namespace, "-f", "-", stdin=json.dumps(job))

            def both() -> bool:
                new = (set(cgpud.instances(0)) & set(cgpud.instances(1))) - have
                return bool(new)

            wait(both, 120, f"job {namespace}/{name}: its instance on both GPUs\n"
                 + c.kubectl("describe", "job", "-n", namespace, name, check=False).stdout)
            took[way].append(time.monotonic() - t)
            c.kubectl("delete", "job", "-n", namespace, name, "--cascade=foreground", "--wait=true",
                      "--timeout=90s", timeout=120)
            wait(lambda: not (instances(cgpud) - have), 60, f"job {name}: its instance gone")
    print(f"seed 000's Job created -> its instance on both GPUs (4 GiB each), {jobs} Jobs each way, "
          f"load average {os.getloadavg()[0]:.1f}:")
    print(f"  DRA through cgpu dra-webhook:            p50 {ms(pct(took['webhook'], 50))}  "
          f"p99 {ms(pct(took['webhook'], 99))}")
    print(f"  device plugin + extender:                p50 {ms(pct(took['extender'], 50))}  "
          f"p99 {ms(pct(took['extender'], 99))}")
    # the webhook's own cost: a pod create (server-side dry run: admitted, not stored, no template made)
    # with the label, against the same pod without it, in turns
    api = c.api()
    pod = seed_000_job()["spec"]["template"] | {"apiVersion": "v1", "kind": "Pod"}
    pod["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-mem"] = "8"  # (the client takes strings)
    plain = json.loads(json.dumps(pod))
    del plain["metadata"]["labels"]["aliyun.com/gpu-count"]
    admit = {"labelled": [], "plain": []}
    for i in range(100):
        for way, body in (("labelled", pod), ("plain", plain)):
            body["metadata"]["name"] = f"dry-{way}-{i}"
            t = time.monotonic()
            api.create_namespaced_pod("default", body, dry_run="All", _preload_content=False)
            admit[way].append(time.monotonic() - t)
    print("a pod create through the API server (server-side dry run), 100 each way in turns:")
    print(f"  seed 000's pod, through the webhook:     p50 {ms(pct(admit['labelled'], 50))}  "
          f"p99 {ms(pct(admit['labelled'], 99))}")
    print(f"  the same pod without the label:          p50 {ms(pct(admit['plain'], 50))}  "
          f"p99 {ms(pct(admit['plain'], 99))}")
    c.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def fake_node_body(i: int) -> dict:
    cap = {"cpu": "32", "memory": "128Gi", "pods": "110", "aliyun.com/gpu-mem": str(8 * 16),
           "aliyun.com/gpu-count": "8"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": f"fake-{i:04d}", "labels": {"cgpud-test/fake": "true", "kubernetes.io/os": "linux"},
                         "annotations": {"cgpu.aliyun.com/gpu-mem-per-device": ",".join(["16"] * 8)}},
            "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]},
            "status": {"capacity": cap, "allocatable": cap,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "a node without a kubelet (bench/dra)"}]}}


def make_fake_nodes(c, n: int) -> tuple[float, int]:
    """n nodes, each with its slices as the DRA plugin would write them: (seconds taken, slices)."""
    from kubernetes import client

    from cgpud.k8s import dra

    api = c.api()
    resource = client.ResourceV1Api(api.api_client)
    gpus = [dra.Gpu(g, f"GPU-fake-{g}", "Fake 16G", 16 * GIB) for g in range(8)]

    def one(i: int) -> None:
        body = fake_node_body(i)
        api.create_node(body)
        api.patch_node_status(body["metadata"]["name"], {"status": body["status"]})
        api.patch_node(body["metadata"]["name"], {"spec": {"taints": body["spec"]["taints"]}})
        for s in dra.resource_slices(body["metadata"]["name"], gpus, GIB):
            resource.create_resource_slice(s, _preload_content=False)

    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))
    return time.monotonic() - t, n * len(dra.resource_slices("x", gpus, GIB))


def bind_figures(c, n: int, pods: int) -> None:
    from test_cluster_dra import claim_pod, make_claim

    took, slices = make_fake_nodes(c, n)
    api = c.api()
    dp, dra_ = [], []
    for i in range(pods):
        for way, samples in (("dp", dp), ("dra", dra_)):
            name = f"bind-{way}-{i}"
            if way == "dra":
                make_claim(c, f"claim-{name}", "1Gi")
                body = claim_pod(name, f"claim-{name}")
            else:
                body = c.pod(name, 1, runtime_class=None)
            body["spec"]["nodeSelector"] = {"cgpud-test/fake": "true"}
            body["spec"]["tolerations"] = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            body["metadata"].setdefault("labels", {})["cgpud-test/fake-pod"] = "true"
            t = time.monotonic()
            api.create_namespaced_pod("default", body)
            wait(lambda: api.read_namespaced_pod(name, "default").spec.node_name, 120, f"pod {name} bound")
            samples.append(time.monotonic() - t)
    print(f"pod created -> bound, {n:,} nodes of 8 GPUs × 16 GiB made through the API with their "
          f"{slices:,} ResourceSlices ({took:.0f} s), {pods} pods each way, load average {os.getloadavg()[0]:.1f}:")
    print(f"  DRA (kube-scheduler's DRA plugin, claim of 1 GiB): p50 {ms(pct(dra_, 50))}  p99 {ms(pct(dra_, 99))}")
    print(f"  extender (aliyun.com/gpu-mem 1):                  p50 {ms(pct(dp, 50))}  p99 {ms(pct(dp, 99))}")


def fill_figures(c, pods: int) -> None:
    """One node of 8 × 16 GiB each way, `pods` pods of 1 GiB at once."""
    from kubernetes import client

    from cgpud.k8s import dra
    from test_cluster_dra import claim_pod, make_claim

    api = c.api()
    resource = client.ResourceV1Api(api.api_client)
    gpus = [dra.Gpu(g, f"GPU-big-{g}", "Fake 16G", 16 * GIB) for g in range(8)]
    for name, slices in (("big-ext", False), ("big-dra", True)):
        body = fake_node_body(0)
        body["metadata"]["name"] = name
        body["metadata"]["labels"] = {"cgpud-test/big": name, "kubernetes.io/os": "linux"}
        body["status"]["capacity"]["pods"] = str(pods + 10)  # (the kubelet's default 110 would cap it first)
        if slices:  # (no gpu-mem in its allocatable: the extender leaves it alone)
            for k in ("aliyun.com/gpu-mem", "aliyun.com/gpu-count"):
                del body["status"]["capacity"][k]
            body["metadata"]["annotations"] = {}
        api.create_node(body)
        api.patch_node_status(name, {"status": body["status"]})
        api.patch_node(name, {"spec": {"taints": body["spec"]["taints"]}})
        if slices:
            for s in dra.resource_slices(name, gpus, GIB):
                resource.create_resource_slice(s, _preload_content=False)
    for way, node in (("ext", "big-ext"), ("dra", "big-dra")):
        names = [f"fill-{way}-{i}" for i in range(pods)]
        if way == "dra":
            for n in names:
                make_claim(c, f"claim-{n}", "1Gi")
        bound: dict[str, float] = {}
        t = time.monotonic()
        for n in names:
            body = claim_pod(n, f"claim-{n}") if way == "dra" else c.pod(n, 1, runtime_class=None)
            body["spec"]["nodeSelector"] = {"cgpud-test/big": node}
            body["spec"]["tolerations"] = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            body["metadata"].setdefault("labels", {})["cgpud-test/fake-pod"] = "true"
            api.create_namespaced_pod("default", body)
        last_change = time.monotonic()
        while time.monotonic() - last_change < 15 and len(bound) < pods:
            for p in api.list_namespaced_pod("default", label_selector="cgpud-test/fake-pod=true").items:
                if p.metadata.name in names and p.spec.node_name and p.metadata.name not in bound:
                    bound[p.metadata.name] = time.monotonic()
                    last_change = time.monotonic()
            time.sleep(0.1)
        order = sorted(bound, key=lambda n: names.index(n))
        if way == "dra":
            per: dict[int, int] = {}
            first20: set[int] = set()
            for n in order:
                got = json.loads(resource.read_namespaced_resource_claim(f"claim-{n}", "default",
                                                                         _preload_content=False).data)
                for r in got["status"]["allocation"]["devices"]["results"]:
                    g = dra.parse_device(r["device"])[0]
                    per[g] = per.get(g, 0) + dra.quantity(r["consumedCapacity"]["memory"])
                    if n in order[:20]:
                        first20.add(g)
            most = max(per.values()) // GIB
        else:
            per, first20 = {}, set()
            for n in order:
                p = api.read_namespaced_pod(n, "default")
                g = int(p.metadata.annotations["ALIYUN_COM_GPU_MEM_IDX"])
                per[g] = per.get(g, 0) + 1
                if n in order[:20]:
                    first20.add(g)
            most = max(per.values())
        rate = len(bound) / (max(bound.values()) - t) if bound else 0.0
        label = "DRA (claims of 1 GiB)" if way == "dra" else "extender (gpu-mem 1)"
        print(f"  {label:24s} {len(bound)}/{pods} bound on {len(per)} GPUs, most on a GPU {most} GiB of 16, "
              f"the first 20 on {len(first20)} GPUs, {rate:.1f} pods/s")
        c.kubectl("delete", "pods", "-l", "cgpud-test/fake-pod=true", "--force", "--grace-period=0", check=False,
                  timeout=300)
        if way == "dra":
            c.kubectl("delete", "resourceclaims", *[f"claim-{n}" for n in names], "--wait=false", check=False,
                      timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=20)
    ap.add_argument("--fake-nodes", type=int, default=1000)
    ap.add_argument("--bind-pods", type=int, default=20)
    ap.add_argument("--node-pods", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=10)
    args = ap.parse_args()

    from cluster import Cluster
    from conftest import Daemon, _make_base
    from test_cluster_dra import containerd_bin, overlay, start_plugin
    from test_runc import compiled_hook
    from test_runtime import wrapper

    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    d = Daemon(_make_base(), "sim:2xT4", ["--hook-path", compiled_hook()])
    d.start()
    c = None
    try:
        c = Cluster(d, wrapper(), containerd_bins=containerd_bin()).start()
        c.deploy(["-k", os.fspath(overlay(c.path("overlay")))])  # the extender and the device plugin too
        c.start_controller_manager("resourceclaim-controller,job-controller,serviceaccount-controller,"
                                   "serviceaccount-token-controller,garbage-collector-controller")
        start_plugin(c)
        wait(lambda: c.allocatable("aliyun.com/gpu-mem") == 28, 60, "the device plugin's units")
        wait(lambda: json.loads(c.kubectl("get", "resourceslices", "-o", "json").stdout)["items"], 60,
             "the DRA plugin's slices")
        if args.pods:
            pipeline_figures(c, d, args.pods)
        if args.jobs:
            job_figures(c, d, args.jobs)
        if args.node_pods:
            print(f"{args.node_pods} pods of 1 GiB at once onto a node of 8 GPUs × 16 GiB (128 fit), each way, "
                  f"load average {os.getloadavg()[0]:.1f}:")
            fill_figures(c, args.node_pods)
        if args.fake_nodes:
            bind_figures(c, args.fake_nodes, args.bind_pods)
    finally:
        if c is not None:
            c.kubectl("delete", "pods", "-l", "cgpud-test/fake-pod=true", "--force", "--grace-period=0",
                      "--ignore-not-found", check=False, timeout=120)
            c.cleanup()
        d.cleanup()
        shutil.rmtree(d.base, ignore_errors=True)


if __name__ == "__main__":
    main()
