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
2. core_mem (policy 3 at max_inst 20, weight = percentage / 5), daemons of their own, each figure
   against the same pair under policy 2 at weights 6 : 12 (max_inst 20, a weighted 1:2) in the same run:
   a. CPU workloads (`cgpu run --core`, cgroup freezer): the ratio of the CPU time the scheduler
      thawed the 60 % and the 30 % one for (goal 2.00 ± 0.04), and the 30 % one alone (goal 0.30
      of a CPU; policy 2 gives a lone instance all of it);
   b. the stand-in card, the instances gated by libcgpu (the switcher, charged their GPU time):
      the ratio of their kernel time from the card's log (goal 2.00 ± 0.04), and the 30 % one alone
      (goal 0.30 of the card; reference: the same job alone without cgpud).
   (`--no-cluster`: only these.)

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

from common import cluster_tier  # noqa: E402

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


def cpu_share_figures(seconds: float) -> None:
    """core_mem on CPU workloads (cgroup freezer): the CPU time the scheduler thawed each for."""
    from conftest import Daemon, _make_base
    from test_sched_real import Workloads, usage

    def run(args1: list[str], args2: list[str], policy: str | None) -> tuple[float, float, list[float]]:
        d = Daemon(_make_base(), "sim:T4", [])
        d.start()
        try:
            d.write("default_memsize", str(64 << 20))
            if policy:  # (max_inst 20 as core_mem's: at the default 16, weight 12 beside 6 is cut to 10)
                d.write("0/max_inst", "20")
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
                seen = [(usage("benchfirst01"), usage("benchsecnd02"))]
                for _ in range(round(seconds)):
                    time.sleep(1.0)
                    seen.append((usage("benchfirst01"), usage("benchsecnd02")))
                if any(p.poll() is not None for p in w.procs.values()):
                    raise SystemExit("bench/modes: a workload ended inside the window")
                ratio = (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])
                each = [(b1 - b0) / (a1 - a0) for (a0, b0), (a1, b1) in zip(seen, seen[1:])]
            finally:
                w.stop_all()
        finally:
            d.cleanup()
            shutil.rmtree(d.base, ignore_errors=True)
        return ratio, alone, each

    ratio, alone, each = run(["--core", "30"], ["--core", "60"], None)
    ref_ratio, ref_alone, ref_each = run(["--weight", "6"], ["--weight", "12"], "2")
    print(f"CPU workloads (cgroup freezer; the CPU time each was thawed for, {seconds:g} s):")
    print(f"  core_mem 30 % : 60 %: ratio {ratio:.3f} over the window (goal 2.00 ± 0.04; the median second "
          f"{statistics.median(each):.3f}, each {min(each):.2f}-{max(each):.2f}); policy 2 at 6 : 12, same run: "
          f"{ref_ratio:.3f} (median second {statistics.median(ref_each):.3f}, each {min(ref_each):.2f}-{max(ref_each):.2f})")
    print(f"  30 % alone: {alone:.3f} of a CPU (goal 0.30); policy 2's lone weight 6: {ref_alone:.3f} (weighted: all)")


def card_share_figures(seconds: float) -> None:
    """core_mem on the stand-in card (native/stubs: kernels time-sliced by one executor), the instances gated
    by libcgpu (`cgpud serve --compute gate`, the switcher): the kernel time of each from the card's log.
    Two jobs: one that keeps the card busy through its gate (launches queued ahead), and one that leaves it
    idle a third of its gate's time (host work between kernels: charged its GPU time, it is owed gate time)."""
    import tempfile
    import uuid

    from deep_queue import (BATCH, HOST_KERNEL_US, HOST_US, KERNEL_US, alone_bare, build_tools, busy, finish, gated,
                            host_bare, instance, window)

    def write(d, name: str, value: str) -> None:
        with open(os.path.join(d.mount, "0", name), "w") as f:
            f.write(value)

    def run(tmp: Path, tools: Path, lib: Path, tag: str, cmd: str, args: list[list[str]], policy: str | None):
        with gated(lib) as d:
            if policy:
                write(d, "max_inst", "20")
                write(d, "policy", policy)
            names = [f"cm{tag}{policy or 3}{k}" for k in range(len(args))]
            finish([instance(d, tools, tmp, n, a, cmd) for n, a in zip(names, args)])
        logs = [tmp / n for n in names]
        t0, t1 = window(logs)
        return [busy(lg, t0, t1) / (t1 - t0) for lg in logs]

    jobs = [(f"{BATCH} launches of {KERNEL_US / 1000:g} ms then a synchronize",
             f'exec "$Q" loop {seconds} {KERNEL_US} {BATCH}', lambda tools, tmp: alone_bare(tools, tmp, seconds)),
            (f"a {HOST_KERNEL_US / 1000:g} ms kernel, a synchronize, {HOST_US / 1000:g} ms of host work",
             f'exec "$Q" host {seconds} {HOST_KERNEL_US} {HOST_US}', lambda tools, tmp: host_bare(tools, tmp, seconds))]
    with tempfile.TemporaryDirectory(prefix="bench-modes-") as t:
        tmp = Path(t)
        tools, lib = build_tools(tmp, None)
        print("the stand-in card, gated by libcgpu (the switcher; each charged its GPU time): the kernel time of each "
              f"per second, {seconds:g} s a run", flush=True)
        for j, (what, cmd, bare_of) in enumerate(jobs):
            tag = uuid.uuid4().hex[:7] + str(j)
            bare = bare_of(tools, tmp)
            a, b = run(tmp, tools, lib, tag, cmd, [["--core", "30"], ["--core", "60"]], None)
            ra, rb = run(tmp, tools, lib, tag, cmd, [["--weight", "6"], ["--weight", "12"]], "2")
            (lone,) = run(tmp, tools, lib, tag[:7] + "l", cmd, [["--core", "30"]], None)
            print(f"  {what} (alone without cgpud it keeps the card busy {bare:.3f}):")
            print(f"    core_mem 30 % : 60 %: {a:.3f} : {b:.3f}, ratio {b / a:.3f} (goal 2.00 ± 0.04); policy 2 at "
                  f"6 : 12, same run: {ra:.3f} : {rb:.3f}, ratio {rb / ra:.3f}")
            print(f"    30 % alone: {lone:.3f} of the card (goal 0.30 where the job can use it: {0.3 * bare:.3f} is 30 % "
                  f"of what it does alone)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hold", type=float, default=5.0, help="seconds a relabel is watched with a GPU pod running")
    ap.add_argument("--seconds", type=float, default=6.0, help="the share measurement's window")
    ap.add_argument("--no-cluster", action="store_true")
    args = ap.parse_args()
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    cpu_share_figures(args.seconds)
    card_share_figures(args.seconds)
    if args.no_cluster:
        return
    with cluster_tier("sim:2xT4") as (d, c):
        c.deploy()
        wait(lambda: advertised(c)["aliyun.com/gpu-mem"] == 28, 60, "the device plugin's units")
        relabel_figures(c, d, args.hold)


if __name__ == "__main__":
    main()
