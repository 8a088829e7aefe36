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

5. The layout (issue 36), --layout-nodes fake nodes of 8 × 80 GiB H100s at 128 MiB each way, in
   the same cluster: today's layout (a GPU device whose memory claims share and a device per
   memory unit, the GPUs' counters: what the driver published before), the new one (a device per
   GPU, nothing else) and the extender's (allocatable aliyun.com/gpu-mem, the per-GPU annotation).
   Rows: a pod of `aliyun.com/gpu-mem: 4` (new: through cgpu dra-webhook, a claim of 4 units of
   one GPU; today's: a claim of 4 unit devices, what KEP-5004 makes of the pod, there being no
   way to run KEP-5004 beside the extender in one scheduler; extender: the pod as written) and a
   claim of 20 GiB (extender: gpu-mem 160) — created -> bound p50/p99 over --layout-pods pods,
   one at a time, then pods/s for --layout-burst pods at once; kube-scheduler's own
   scheduler_plugin_execution_duration_seconds{plugin="DynamicResources"} (mean per call, per
   row); ResourceSlices and their bytes per node.
6. The real node, a reboot: --reboot-pods pods with a claim of 3 GiB Running, then what a reboot
   leaves (the kubelet and the plugin stopped, /var/run/cdi emptied, the containers killed,
   containerd restarted), the plugin and the kubelet started again: each pod Running again (its
   container restarted) from the kubelet's start, p50; reference: a pod asking nothing, the same.
   A kubelet restart: from its start to the node's slice written again (the kubelet deletes its
   node's slices when it starts), --kubelet-restarts times, p50; reference: to the plugin
   registered again.

    .venv/bin/python bench/dra.py [--pods 20] [--fake-nodes 1000] [--bind-pods 20] [--node-pods 200] [--jobs 10]
                                  [--layout-nodes 30] [--layout-pods 20] [--layout-burst 40] [--reboot-pods 4]
                                  [--kubelet-restarts 3]
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


def pipeline_figures(c, cgpud, pods: int, dra: bool = True) -> None:
    """With dra=False (a server without resource.k8s.io/v1: bench/versions.py), the device plugin's way only."""
    from test_cluster_dra import claim_pod, make_claim

    api = c.api()
    dp, dra_, plain = [], [], []
    for i in range(pods):
        for way, samples in (("dp", dp), ("dra", dra_))[:2 if dra else 1]:
            name = f"bench-{way}-{i}"
            before = instances(cgpud)
            if way == "dra":
                make_claim(c, f"claim-{name}", "1Gi")
                body, ns = claim_pod(name, f"claim-{name}"), "default"
            else:
                body, ns = c.pod(name, 1, runtime_class=None), EXT_NS  # (the webhook would make it a claim)
            t = time.monotonic()
            api.create_namespaced_pod(ns, body)
            wait(lambda: instances(cgpud) - before, 120, f"pod {name}: its instance\n{c.events(name)}")
            samples.append(time.monotonic() - t)
            c.kubectl("delete", "pod", "-n", ns, name, "--wait=true", timeout=120)
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
    if dra_:
        print(f"  DRA (claim, dra-plugin, CDI):              p50 {ms(pct(dra_, 50))}  p99 {ms(pct(dra_, 99))}")
    print(f"  device plugin + extender (gpu-mem 1):      p50 {ms(pct(dp, 50))}  p99 {ms(pct(dp, 99))}")
    print(f"  reference: a pod asking nothing -> Running: p50 {ms(pct(plain, 50))}")
    c.kubectl("delete", "pods", "--all", "--wait=true", "--timeout=120s", timeout=180)


def job_figures(c, cgpud, jobs: int) -> None:
    """Seed 000's Job each way in turns: created -> its instance on both GPUs."""
    from test_cluster_dra import seed_000_job, start_webhook

    start_webhook(c)
    ns = EXT_NS
    extender_namespace(c)
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
                body, ns = claim_pod(name, f"claim-{name}"), "default"
            else:
                body, ns = c.pod(name, 1, runtime_class=None), EXT_NS
            body["spec"]["nodeSelector"] = {"cgpud-test/fake": "true"}
            body["spec"]["tolerations"] = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            body["metadata"].setdefault("labels", {})["cgpud-test/fake-pod"] = "true"
            t = time.monotonic()
            api.create_namespaced_pod(ns, body)
            wait(lambda: api.read_namespaced_pod(name, ns).spec.node_name, 120, f"pod {name} bound")
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
        ns = "default" if way == "dra" else EXT_NS
        for n in names:
            body = claim_pod(n, f"claim-{n}") if way == "dra" else c.pod(n, 1, runtime_class=None)
            body["spec"]["nodeSelector"] = {"cgpud-test/big": node}
            body["spec"]["tolerations"] = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            body["metadata"].setdefault("labels", {})["cgpud-test/fake-pod"] = "true"
            api.create_namespaced_pod(ns, body)
        last_change = time.monotonic()
        while time.monotonic() - last_change < 15 and len(bound) < pods:
            for p in api.list_namespaced_pod(ns, label_selector="cgpud-test/fake-pod=true").items:
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
                p = api.read_namespaced_pod(n, ns)
                g = int(p.metadata.annotations["ALIYUN_COM_GPU_MEM_IDX"])
                per[g] = per.get(g, 0) + 1
                if n in order[:20]:
                    first20.add(g)
            most = max(per.values())
        rate = len(bound) / (max(bound.values()) - t) if bound else 0.0
        label = "DRA (claims of 1 GiB)" if way == "dra" else "extender (gpu-mem 1)"
        print(f"  {label:24s} {len(bound)}/{pods} bound on {len(per)} GPUs, most on a GPU {most} GiB of 16, "
              f"the first 20 on {len(first20)} GPUs, {rate:.1f} pods/s")
        c.kubectl("delete", "pods", "-n", ns, "-l", "cgpud-test/fake-pod=true", "--force", "--grace-period=0",
                  check=False, timeout=300)
        if way == "dra":
            c.kubectl("delete", "resourceclaims", *[f"claim-{n}" for n in names], "--wait=false", check=False,
                      timeout=300)


MIB = 1 << 20
H100 = 81559 * MIB
EXT_NS = "bench-extender"  # the extender's pods: a namespace the webhook passes over


def old_slices(node: str, gpus, unit: int) -> list[dict]:
    """The slices the driver published before issue 36 (cgpud/k8s/dra.py of 4bb5e69): a GPU device
    whose memory claims share, a device per memory unit, both drawing on the GPU's counter; counters
    in a slice of their own, at most 64 devices a slice."""
    from cgpud.k8s import dra

    out = []
    for g in gpus:
        whole = g.units(unit) * unit
        attrs = {"uuid": {"string": g.uuid}, "model": {"string": g.model}, "index": {"int": g.index},
                 "memoryUnit": {"int": unit}}
        out.append({"name": f"gpu-{g.index}", "allowMultipleAllocations": True,
                    "attributes": {**attrs, "kind": {"string": "gpu"}},
                    "capacity": {"memory": {"value": str(whole), "requestPolicy": {
                        "default": str(unit), "validRange": {"min": str(unit), "step": str(unit)}}}},
                    "consumesCounters": [{"counterSet": f"gpu-{g.index}", "counters": {"memory": {"value": str(whole)}}}]})
    for g in gpus:
        attrs = {"uuid": {"string": g.uuid}, "model": {"string": g.model}, "index": {"int": g.index},
                 "memoryUnit": {"int": unit}, "kind": {"string": "memory-unit"}}
        out += [{"name": f"gpu-{g.index}-unit-{j}", "attributes": attrs,
                 "consumesCounters": [{"counterSet": f"gpu-{g.index}", "counters": {"memory": {"value": str(unit)}}}]}
                for j in range(g.units(unit))]
    counters = [{"name": f"gpu-{g.index}", "counters": {"memory": {"value": str(g.units(unit) * unit)}}} for g in gpus]
    parts = [{"sharedCounters": counters[i:i + 8]} for i in range(0, len(counters), 8)]
    parts += [{"devices": out[i:i + 64]} for i in range(0, len(out), 64)]
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{node}-{dra.DRIVER}-{k}"},
             "spec": {"driver": dra.DRIVER, "nodeName": node,
                      "pool": {"name": node, "generation": 1, "resourceSliceCount": len(parts)}, **part}}
            for k, part in enumerate(parts)]


def dynamic_resources(c) -> tuple[float, int]:
    """kube-scheduler's DynamicResources plugin: (seconds, calls) so far, all extension points."""
    total, calls = 0.0, 0
    for line in c.scheduler_metrics().splitlines():
        if line.startswith("scheduler_plugin_execution_duration_seconds_") and 'plugin="DynamicResources"' in line:
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("scheduler_plugin_execution_duration_seconds_sum"):
                total += value
            elif line.startswith("scheduler_plugin_execution_duration_seconds_count"):
                calls += int(value)
    return total, calls


def extender_namespace(c) -> None:
    if c.kubectl("get", "namespace", EXT_NS, check=False).returncode == 0:
        return
    c.kubectl("create", "namespace", EXT_NS)
    c.kubectl("label", "namespace", EXT_NS, "cgpu.aliyun.com/dra-webhook=off")
    wait(lambda: c.kubectl("get", "serviceaccount", "default", "-n", EXT_NS, check=False).returncode == 0, 60,
         f"the ServiceAccount default of {EXT_NS}")
    c.kubectl("patch", "serviceaccount", "default", "-n", EXT_NS, "-p", '{"automountServiceAccountToken": false}')


def layout_figures(c, n: int, pods: int, burst: int) -> None:
    from kubernetes import client

    from cgpud.k8s import dra
    from test_cluster_dra import claim_pod, make_claim, start_webhook

    api = c.api()
    resource = client.ResourceV1Api(api.api_client)
    gpus = [dra.Gpu(g, f"GPU-h100-{g}", "NVIDIA H100 80GB HBM3", H100) for g in range(8)]
    unit = 128 * MIB
    layouts = {"old": old_slices("x", gpus, unit), "new": dra.resource_slices("x", gpus, unit)}
    print("the layout, a node of 8 × 80 GiB H100s at 128 MiB (and at 1 GiB):")
    for name, slices in layouts.items():
        at_gib = old_slices("x", gpus, GIB) if name == "old" else dra.resource_slices("x", gpus, GIB)
        devices = sum(len(x["spec"].get("devices", [])) for x in slices)
        print(f"  {name + ' layout':11s} {len(slices):3d} slices, {devices:5d} devices, "
              f"{len(json.dumps(slices)):9,d} bytes per node ({len(at_gib)} slices, {len(json.dumps(at_gib)):,d} bytes "
              f"at 1 GiB)")
    # the fake nodes: n of each kind
    start_webhook(c)
    extender_namespace(c)

    def node(kind: str, i: int) -> None:
        body = fake_node_body(i)
        name = body["metadata"]["name"] = f"lay-{kind}-{i:03d}"
        body["metadata"]["labels"] = {"cgpud-test/layout": kind, "kubernetes.io/os": "linux"}
        if kind == "ext":
            body["status"]["capacity"].update({"aliyun.com/gpu-mem": str(8 * (H100 // unit)), "aliyun.com/gpu-count": "8"})
            body["status"]["allocatable"] = body["status"]["capacity"]
            body["metadata"]["annotations"] = {"cgpu.aliyun.com/gpu-mem-per-device": ",".join([str(H100 // unit)] * 8),
                                               "cgpu.aliyun.com/gpu-mem-unit": "128Mi"}
        else:
            for k in ("aliyun.com/gpu-mem", "aliyun.com/gpu-count"):
                del body["status"]["capacity"][k]
            body["metadata"]["annotations"] = {}
        api.create_node(body)
        api.patch_node_status(name, {"status": body["status"]})
        api.patch_node(name, {"spec": {"taints": body["spec"]["taints"]}})
        if kind != "ext":
            for s_ in (old_slices if kind == "old" else dra.resource_slices)(name, gpus, unit):
                resource.create_resource_slice(s_, _preload_content=False)

    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda a: node(*a), [(k, i) for k in ("old", "new", "ext") for i in range(n)]))
    print(f"  ({3 * n} fake nodes made through the API, {n} of each layout, in {time.monotonic() - t:.0f} s)")
    c.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "bench-unit.cgpu.aliyun.com"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "cgpu.aliyun.com" && '
                                                    'device.attributes["cgpu.aliyun.com"].kind == "memory-unit"'}}]}}))

    def body_of(kind: str, what: str, name: str) -> tuple[str, dict]:
        if kind == "ext":
            units = 4 if what == "gpu-mem 4" else 20 * GIB // unit
            return EXT_NS, c.pod(name, units, runtime_class=None)
        if kind == "new" and what == "gpu-mem 4":
            return "default", c.pod(name, 4, runtime_class=None)  # (the webhook makes its claim)
        if kind == "old" and what == "gpu-mem 4":  # (what KEP-5004 makes of the pod: 4 unit devices)
            c.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": f"claim-{name}"},
                      "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                          "deviceClassName": "bench-unit.cgpu.aliyun.com", "allocationMode": "ExactCount", "count": 4}}]}}})
        else:
            make_claim(c, f"claim-{name}", "20Gi")
        return "default", claim_pod(name, f"claim-{name}")

    def pinned(body: dict, kind: str) -> dict:
        body["spec"]["nodeSelector"] = {"cgpud-test/layout": kind}
        body["spec"]["tolerations"] = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        body["metadata"].setdefault("labels", {})["cgpud-test/fake-pod"] = "true"
        return body

    print(f"pod created -> bound on {3 * n} fake nodes (8 × 80 GiB, 128 MiB units), {pods} pods one at a time, "
          f"then {burst} at once; load average {os.getloadavg()[0]:.1f}:")
    for what in ("gpu-mem 4", "claim 20 GiB"):
        for kind in ("old", "new", "ext"):
            tag = f"{'g4' if what == 'gpu-mem 4' else 'c20'}-{kind}"
            before = dynamic_resources(c)
            took = []
            for i in range(pods):
                name = f"lay-{tag}-{i}"
                ns, body = body_of(kind, what, name)
                t = time.monotonic()
                api.create_namespaced_pod(ns, pinned(body, kind))
                wait(lambda: api.read_namespaced_pod(name, ns).spec.node_name, 120,
                     f"pod {ns}/{name} bound\n{c.kubectl('describe', 'pod', '-n', ns, name, check=False).stdout}")
                took.append(time.monotonic() - t)
            names = []
            for i in range(burst):
                name = f"lay-{tag}-b{i}"
                names.append(body_of(kind, what, name) + (name,))
            t = time.monotonic()
            for ns, body, name in names:
                api.create_namespaced_pod(ns, pinned(body, kind))
            for ns, _, name in names:
                wait(lambda: api.read_namespaced_pod(name, ns).spec.node_name, 300, f"pod {ns}/{name} bound")
            rate = burst / (time.monotonic() - t)
            after = dynamic_resources(c)
            calls = after[1] - before[1]
            dr = f"{(after[0] - before[0]) / calls * 1000:.2f} ms a call ({calls} calls)" if calls else "not called"
            label = {"old": "today's layout", "new": "new layout", "ext": "extender"}[kind]
            print(f"  {what:12s} {label:15s} p50 {ms(pct(took, 50))}  p99 {ms(pct(took, 99))}  {rate:5.1f} pods/s  "
                  f"DynamicResources {dr}")
    c.kubectl("delete", "pods", "-A", "-l", "cgpud-test/fake-pod=true", "--force", "--grace-period=0", check=False,
              timeout=300)


def reboot_figures(c, cgpud, pods: int) -> None:
    from test_cluster import container_name
    from test_cluster_dra import claim_pod, make_claim, start_plugin

    api = c.api()
    names = [f"boot-{i}" for i in range(pods)]
    for n in names:
        make_claim(c, f"claim-{n}", "3Gi")
        c.create(claim_pod(n, f"claim-{n}"))
    plain = c.pod("boot-plain", 0, runtime_class=None)
    del plain["spec"]["containers"][0]["resources"]
    c.create(plain)
    every = names + ["boot-plain"]
    for n in every:
        c.wait_pod(n, lambda p: p.get("status", {}).get("phase") == "Running", 120, "Running")
    ids = {n: api.read_namespaced_pod(n, "default").status.container_statuses[0].container_id.split("//")[1] for n in every}
    c.stop_kubelet()
    plugin = c.procs["dra-plugin"]
    plugin.proc.kill()
    plugin.proc.wait(10)
    for spec in c.path("cdi").glob("*"):
        spec.unlink()
    for cid in ids.values():
        c.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    c.restart_containerd()
    start_plugin(c)
    t0 = c.start_kubelet()
    back: dict[str, float] = {}
    deadline = time.monotonic() + 300
    while len(back) < len(every) and time.monotonic() < deadline:
        for n in every:
            if n in back:
                continue
            st = (api.read_namespaced_pod(n, "default").status.container_statuses or [None])[0]
            if st is not None and st.restart_count >= 1 and st.state.running:
                back[n] = time.monotonic() - t0
        time.sleep(0.05)
    claims = [back[n] for n in names if n in back]
    stuck = [n for n in names if n not in back]
    memsize = []
    for n in names:
        if n in back:
            pod = json.loads(c.kubectl("get", "pod", n, "-o", "json").stdout)
            name = container_name(pod)
            memsize += [cgpud.value(f"{g}/{name}/memsize") for g in (0, 1) if name in cgpud.instances(g)]
    print(f"a reboot (CDI specs gone, containers killed, containerd, the plugin and the kubelet started again), "
          f"{pods} claim pods, load average {os.getloadavg()[0]:.1f}:")
    print(f"  claim pods Running again: {len(claims)}/{pods}, p50 {ms(pct(claims, 50)) if claims else '-'} from the "
          f"kubelet's start; memsize {sorted(set(memsize))} (3 GiB = {3 * GIB}); left not Running: {stuck or 'none'}")
    print(f"  reference, a pod asking nothing: {ms(back['boot-plain']) if 'boot-plain' in back else 'not Running'}")
    for n in every:
        c.delete_pod(n)
    for n in names:
        c.kubectl("delete", "resourceclaim", f"claim-{n}", "--ignore-not-found", "--wait=true", timeout=120)


def kubelet_restarts(c, restarts: int) -> None:
    """The kubelet deletes its node's slices when it starts; the plugin's watch writes them again.
    Each restart: from the kubelet's start to the slice written again, and how long the node had no
    slice (the deletion seen to the new slice seen, read every 10 ms through the client)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    resource = client.ResourceV1Api(c.api().api_client)
    name = f"{NODE_NAME}-cgpu.aliyun.com-0"
    took, gap, reg = [], [], []
    log = c.procs["dra-plugin"].log_path
    for _ in range(restarts):
        before = resource.read_resource_slice(name).metadata.uid
        registered = log.read_text().count("registered with the kubelet")
        c.stop_kubelet()
        t0 = c.start_kubelet()
        gone_at = got_reg = None
        while True:
            now = time.monotonic()
            try:
                uid = resource.read_resource_slice(name, _request_timeout=5).metadata.uid
            except ApiException as exc:
                if exc.status != 404:
                    raise
                uid = None
            if uid is None and gone_at is None:
                gone_at = now
            if got_reg is None and log.read_text().count("registered with the kubelet") > registered:
                got_reg = now - t0
            if uid is not None and uid != before:
                took.append(now - t0)
                gap.append(now - (gone_at if gone_at is not None else now))
                break
            if now - t0 > 120:
                raise SystemExit("the slice not written again after a kubelet restart")
            time.sleep(0.01)
        while got_reg is None:
            if log.read_text().count("registered with the kubelet") > registered:
                got_reg = time.monotonic() - t0
            time.sleep(0.01)
        reg.append(got_reg)
        wait(lambda: c._node_ready(), 60, "the node Ready")
    print(f"a kubelet restart, {restarts} times: the node had no slice (the kubelet's deletion seen -> the "
          f"plugin's new slice seen) p50 {ms(pct(gap, 50))} (max {ms(max(gap))}); the slice written again "
          f"p50 {ms(pct(took, 50))} from the kubelet's start; reference, the plugin registered again: p50 "
          f"{ms(pct(reg, 50))}")


NODE_NAME = "cgpu-node"


def layout_main(args) -> None:
    """Items 5 and 6: the cluster as tests/test_cluster_dra.py runs it plus the extender (in
    kube-scheduler's configuration, for its rows), on a node of two 80 GB H100s."""
    from cluster import Cluster
    from conftest import Daemon, _make_base
    from test_cluster_dra import containerd_bin, overlay, start_plugin
    from test_runc import compiled_hook
    from test_runtime import wrapper

    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    d = Daemon(_make_base(), "sim:2xH100", ["--hook-path", compiled_hook()])
    d.start()
    c = None
    try:
        c = Cluster(d, wrapper(), containerd_bins=containerd_bin()).start()  # (the extender in kube-scheduler's config)
        c.deploy(["-k", os.fspath(overlay(c.path("overlay")))], device_plugin=False)  # (the extender for its rows)
        c.start_controller_manager("resourceclaim-controller,serviceaccount-controller,"
                                   "serviceaccount-token-controller,garbage-collector-controller")
        start_plugin(c)
        wait(lambda: json.loads(c.kubectl("get", "resourceslices", "-o", "json").stdout)["items"], 60,
             "the DRA plugin's slices")
        if args.layout_nodes:
            layout_figures(c, args.layout_nodes, args.layout_pods, args.layout_burst)
        if args.reboot_pods:
            reboot_figures(c, d, args.reboot_pods)
        if args.kubelet_restarts:
            kubelet_restarts(c, args.kubelet_restarts)
    finally:
        if c is not None:
            c.kubectl("delete", "pods", "-A", "-l", "cgpud-test/fake-pod=true", "--force", "--grace-period=0",
                      "--ignore-not-found", check=False, timeout=120)
            c.cleanup()
        d.cleanup()
        shutil.rmtree(d.base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=20)
    ap.add_argument("--fake-nodes", type=int, default=1000)
    ap.add_argument("--bind-pods", type=int, default=20)
    ap.add_argument("--node-pods", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--layout-nodes", type=int, default=30)
    ap.add_argument("--layout-pods", type=int, default=20)
    ap.add_argument("--layout-burst", type=int, default=40)
    ap.add_argument("--reboot-pods", type=int, default=4)
    ap.add_argument("--kubelet-restarts", type=int, default=3)
    ap.add_argument("--only-layout", action="store_true", help="items 5 and 6 only (issue 36's figures)")
    args = ap.parse_args()
    if args.only_layout or not (args.pods or args.jobs or args.node_pods or args.fake_nodes):
        layout_main(args)
        return

    from cluster import Cluster
    from conftest import Daemon, _make_base
    from test_cluster_dra import containerd_bin, start_plugin
    from test_runc import compiled_hook
    from test_runtime import wrapper

    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    d = Daemon(_make_base(), "sim:2xT4", ["--hook-path", compiled_hook()])
    d.start()
    c = None
    try:
        c = Cluster(d, wrapper(), containerd_bins=containerd_bin()).start()
        # deploy/kubernetes (the extender and the device plugin), DRA's class, accounts and webhook beside it:
        # DRA mode's component (overlay) drops the extender, whose token deploy() then asks for
        c.deploy()
        c.kubectl("apply", *(a for f in ("deviceclass", "rbac", "webhook")
                             for a in ("-f", os.fspath(ROOT / "deploy" / "kubernetes" / "dra" / f"{f}.yaml"))))
        c.start_controller_manager("resourceclaim-controller,job-controller,serviceaccount-controller,"
                                   "serviceaccount-token-controller,garbage-collector-controller")
        start_plugin(c)
        extender_namespace(c)  # (a pod asking gpu-mem elsewhere goes to the webhook: DRA mode's way)
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
