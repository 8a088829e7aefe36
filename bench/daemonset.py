"""bench/daemonset: the DaemonSet's start on a node, DRA mode beside device-plugin mode (issue
29), one run each, on the real components of tests/cluster.py with the node of
tests/test_cluster_daemonset.py (a host directory, the image of scripts/build-image.sh imported
into containerd, kube-controller-manager's DaemonSet controller; two T4s of the NVML stand-in).
Both modes on containerd 2 (scripts/containerd-build.sh), so that only the mode differs.

From `kubectl apply -k` of the overlay (the node labelled right after it) to:
- the DaemonSet's pod made (kube-controller-manager's DaemonSet controller) and its init step
  done (cgpu-runtime installed, containerd restarted);
- the DaemonSet's pod Ready (its node daemon's readiness probe, every 10 s);
- the node's GPUs published: DRA, the driver's ResourceSlice in the API; device plugin, the
  node's allocatable aliyun.com/gpu-mem;
- the first pod Running, made right after the apply: DRA, a pod with a ResourceClaim of 3 GiB;
  device plugin, a pod asking `aliyun.com/gpu-mem: 3` (through the extender).
The reference is the device-plugin DaemonSet's same times, measured in the same run; with
--runs N the modes take turns, N nodes each, and each time is printed as its median (min–max).
The init step's part that is containerd's restart (the fixture's, standing for systemd's) is
printed too, and the times from the init step's end (the part each mode does its own way).

    .venv/bin/python bench/daemonset.py [--runs 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(HERE)]  # (tests/cluster.py, not bench/cluster.py)


def build_image() -> str:
    from test_image import TAG

    p = subprocess.run([ROOT / "scripts" / "build-image.sh", TAG], capture_output=True, text=True, cwd=ROOT,
                       stdin=subprocess.DEVNULL, timeout=1200)
    if p.returncode != 0:
        raise SystemExit(f"scripts/build-image.sh failed:\n{p.stderr[-3000:]}")
    return TAG


def one(image: str, dra: bool) -> dict[str, float]:
    """Seconds from the apply to each step, for one mode on a node of its own."""
    from cluster import NODE
    from test_cluster import running
    from test_cluster_daemonset import Node
    from test_cluster_dra import DRIVER, claim_pod, make_claim

    with tempfile.TemporaryDirectory(prefix="cgpud-bench-ds-") as tmp, \
            Node(image, Path(tmp), dra=dra, containerd2=True) as node:
        c = node.cluster
        applied = node.apply()
        if dra:
            make_claim(c, "claim-first", "3Gi")
            c.create(claim_pod("first", "claim-first"))
        else:
            c.create(c.pod("first", 3, runtime_class=None))

        def published() -> bool:
            if dra:
                return any(s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == NODE
                           for s in c.get("resourceslices")["items"])
            return c.allocatable("aliyun.com/gpu-mem") > 0

        def installed() -> bool:
            init = node.ds_pod().get("status", {}).get("initContainerStatuses", [{}])[0]
            return "terminated" in init.get("state", {})

        def ready() -> bool:
            pod = node.ds_pod()
            return bool(pod) and all(x.get("ready") for x in pod.get("status", {}).get("containerStatuses", [{}]))

        steps = {"made": lambda: bool(node.ds_pod()), "installed": installed, "ready": ready,
                 "published": published, "running": lambda: running(c.get("pod", "first"))}
        got: dict[str, float] = {}
        deadline = applied + 300
        while len(got) < len(steps):
            for name, done in steps.items():
                if name not in got and done():
                    got[name] = time.monotonic() - applied
            if time.monotonic() > deadline:
                raise SystemExit(f"{'DRA' if dra else 'device plugin'}: not within 300 s: "
                                 f"{sorted(set(steps) - set(got))}\n{c.events('first')}\n{c.logs()}")
            time.sleep(0.05)
        got["restart"] = sum(node.systemd.took)
        got["published-after"], got["running-after"] = (got[k] - got["installed"] for k in ("published", "running"))
        c.delete_pod("first")
        return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    image = build_image()
    dra, dp = [], []
    for _ in range(args.runs):
        dra.append(one(image, True))
        dp.append(one(image, False))
    print(f"kubectl apply -k -> ..., one node, containerd 2, {args.runs} run(s) each (median), "
          f"load average {os.getloadavg()[0]:.1f}:")
    print(f"  {'':52} {'DRA (min–max)':>20}   device plugin + extender (reference)")
    for label, key in (("the DaemonSet's pod made", "made"), ("its init step done", "installed"),
                       ("  of which containerd's restart (stand-in systemd)", "restart"),
                       ("GPUs published (ResourceSlice / allocatable)", "published"),
                       ("first pod Running (claim 3 GiB / gpu-mem 3)", "running"),
                       ("GPUs published, from the init step's end", "published-after"),
                       ("first pod Running, from the init step's end", "running-after"),
                       ("the DaemonSet's pod Ready (its probe: every 10 s)", "ready")):
        a, b = ((statistics.median(x := [r[key] for r in runs]), min(x), max(x)) for runs in (dra, dp))
        print(f"  {label:52} {a[0]:6.1f} s ({a[1]:.1f}–{a[2]:.1f})   {b[0]:.1f} s ({b[1]:.1f}–{b[2]:.1f})")


if __name__ == "__main__":
    main()
