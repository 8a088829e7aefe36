"""bench/modes: a node's mode from its `ack.node.gpu.schedule` label (issue 37), one run.

1. On the real components of tests/cluster.py (kube-apiserver, kube-scheduler with the extender,
   a kubelet on containerd's CRI, the device plugin as a host process, cgpud serving two simulated
   T4s), the node relabelled cgpu -> core_mem -> mps -> default -> cgpu, each step twice:
   - without GPU pods: seconds from `kubectl label` to the new mode's resources in the node's
     allocatable (and the others 0);
   - with a GPU pod of the old mode running: for --hold seconds after the label, the node's
     allocatable must not change (samples that changed are counted), the pod's instance must keep
     its memsize (pods that lost isolation), and every GPU pod's instance must be in the daemon's
     tree on the GPU its annotation names (the ledger's disagreements); then the pod is deleted
     and the seconds from its deletion to the new resources are the figure.
   Reference, same run: the seconds from the device plugin's start to its units in the node's
   allocatable (the kubelet's own registration path), median of 3 restarts.
2. core_mem on the stand-in (a daemon of its own, `cgpu run --core`): two workloads at 30 % and
   60 % on one GPU, the ratio of the CPU time the scheduler thawed them (goal 2.00 ± 0.04); the
   30 % one alone (goal 0.30); reference: the same two under policy 2 with weights 6 and 12 (a
   weighted 1:2, which gives the lone one the whole GPU).

    .venv/bin/python bench/modes.py [--hold 5] [--seconds 6]

Not measured here (issue 37's figure 3): `helm install` -> first GPU pod Running beside
`kubectl apply -k` (needs the DaemonSet path with the image: tests/test_cluster_daemonset.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(HERE)]

STEPS = ["core_mem", "mps", "default", "cgpu"]
RESOURCES = {"cgpu": {"aliyun.com/gpu-mem"}, "core_mem": {"aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage"},
             "mps": {"aliyun.com/gpu-mem"}, "default": {"nvidia.com/gpu"}}
ALL = ("aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage", "nvidia.com/gpu")


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/modes: timed out: {what}")
        time.sleep(0.05)


def advertised(c) -> dict[str, int]:
    alloc = c.get("node", "cgpu-node")["status"].get("allocatable", {})
    return {r: int(alloc.get(r, "0")) for r in ALL}


def shows(c, mode: str) -> bool:
    a = advertised(c)
    return all((a[r] > 0) == (r in RESOURCES[mode]) for r in ALL)


def gpu_pod(c, name: str, mode: str) -> dict:
    limits = {"nvidia.com/gpu": "1"} if mode == "default" else {"aliyun.com/gpu-mem": "2"}
    if mode == "core_mem":
        limits["aliyun.com/gpu-core.percentage"] = "30"
    pod = c.pod(name, 0)
    pod["spec"]["containers"][0]["resources"]["limits"] = limits
    return pod


def instances(d) -> dict[str, tuple[int, int]]:
    """The daemon's instances: name -> (GPU, memsize)."""
    from cgpud.client import Client

    with Client(str(d.socket)) as cl:
        snap = cl.call("query")
    return {i["name"]: (g["index"], int(i["memsize"])) for g in snap["gpus"] for i in g["instances"]}


def relabel_figures(c, d, hold: float) -> None:
    from test_cluster import container_name, running

    def label(mode: str) -> float:
        at = time.monotonic()
        c.kubectl("label", "node", "cgpu-node", f"ack.node.gpu.schedule={mode}", "--overwrite")
        return at

    # reference: the device plugin restarted, its units in the allocatable again
    ref = []
    for _ in range(3):
        c.procs["device-plugin"].stop()
        wait(lambda: advertised(c)["aliyun.com/gpu-mem"] == 0, 60, "units gone with the plugin")
        at = time.monotonic()
        c.start_device_plugin()
        wait(lambda: advertised(c)["aliyun.com/gpu-mem"] > 0, 60, "units back")
        ref.append(time.monotonic() - at)
    print(f"reference: device plugin started -> its units in the node's allocatable: "
          f"median {statistics.median(ref):.2f} s of {len(ref)}")

    lost = disagree = changed = 0
    current = "cgpu"
    label(current)
    wait(lambda: shows(c, current), 60, "cgpu")
    for nxt in STEPS:
        # without GPU pods
        at = label(nxt)
        wait(lambda: shows(c, nxt), 120, f"{nxt} advertised")
        took = time.monotonic() - at
        print(f"  {current:>8} -> {nxt:<8} no GPU pods:   label -> new resources {took:6.2f} s")
        # back, then with a pod of the old mode
        label(current)
        wait(lambda: shows(c, current), 120, f"{current} again")
        name = f"mode-{current.replace('_', '-')}"
        c.create(gpu_pod(c, name, current))
        pod = c.wait_pod(name, running, 120, "Running")
        before = advertised(c)
        mine = instances(d).get(container_name(pod)) if current != "default" else None
        label(nxt)
        end = time.monotonic() + hold
        while time.monotonic() < end:
            if advertised(c) != before:
                changed += 1
            time.sleep(0.2)
        if mine is not None and instances(d).get(container_name(pod)) != mine:
            lost += 1
        ann = pod["metadata"].get("annotations", {}).get("ALIYUN_COM_GPU_MEM_IDX")
        if ann is not None and mine is not None and str(mine[0]) not in ann.split(","):
            disagree += 1
        cond = next((x for x in c.get("node", "cgpu-node")["status"].get("conditions", [])
                     if x["type"] == "CgpuModePending"), {})
        at = time.monotonic()
        c.delete_pod(name, wait=False)
        wait(lambda: shows(c, nxt), 180, f"{nxt} after the pod")
        took = time.monotonic() - at
        print(f"  {current:>8} -> {nxt:<8} with a GPU pod: condition {cond.get('status', '?')}, "
              f"pod deleted -> new resources {took:6.2f} s")
        current = nxt
    print(f"pods that lost isolation: {lost}; ledger disagreements: {disagree}; "
          f"allocatable samples that changed under a running GPU pod: {changed} (goal 0 each)")
    c.kubectl("label", "node", "cgpu-node", "ack.node.gpu.schedule-")


def share_figures(seconds: float) -> None:
    from conftest import Daemon, _make_base
    from test_sched_real import Workloads, usage

    def run(args1: list[str], args2: list[str], policy: str | None) -> tuple[float, float]:
        d = Daemon(_make_base(), "sim:T4", [])
        d.start()
        try:
            d.write("default_memsize", str(64 << 20))
            if policy:
                d.write("0/policy", policy)
            w = Workloads(d)
            try:
                w.start("benchfirst01", seconds * 2 + 4, *args1)
                time.sleep(0.5)
                u0, t0 = usage("benchfirst01"), time.monotonic()
                time.sleep(seconds / 2)
                alone = (usage("benchfirst01") - u0) / (time.monotonic() - t0)
                w.start("benchsecnd02", seconds + 2, *args2)
                time.sleep(0.5)
                a0, b0 = usage("benchfirst01"), usage("benchsecnd02")
                time.sleep(seconds)
                ratio = (usage("benchsecnd02") - b0) / (usage("benchfirst01") - a0)
            finally:
                w.stop_all()
        finally:
            d.cleanup()
            shutil.rmtree(d.base, ignore_errors=True)
        return ratio, alone

    ratio, alone = run(["--core", "30"], ["--core", "60"], None)
    ref_ratio, ref_alone = run(["--weight", "6"], ["--weight", "12"], "2")
    print(f"core_mem 30 % : 60 %: throughput ratio {ratio:.2f} (goal 2.00 ± 0.04), 30 % alone {alone:.2f} "
          f"of the GPU (goal 0.30)")
    print(f"reference, policy 2 weights 6 : 12: ratio {ref_ratio:.2f}, the lone one {ref_alone:.2f} of the GPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hold", type=float, default=5.0, help="seconds a relabel is watched with a GPU pod running")
    ap.add_argument("--seconds", type=float, default=6.0, help="the share measurement's window")
    ap.add_argument("--no-cluster", action="store_true")
    args = ap.parse_args()
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    share_figures(args.seconds)
    if args.no_cluster:
        return
    from cluster import Cluster
    from conftest import Daemon, _make_base
    from test_runc import compiled_hook
    from test_runtime import wrapper

    d = Daemon(_make_base(), "sim:2xT4", ["--hook-path", compiled_hook()])
    d.start()
    c = None
    try:
        c = Cluster(d, wrapper()).start()
        c.deploy()
        wait(lambda: advertised(c)["aliyun.com/gpu-mem"] == 28, 60, "the device plugin's units")
        relabel_figures(c, d, args.hold)
    finally:
        if c is not None:
            c.cleanup()
        d.cleanup()
        shutil.rmtree(d.base, ignore_errors=True)


if __name__ == "__main__":
    main()
