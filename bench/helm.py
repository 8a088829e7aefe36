"""bench/helm: `helm install` → the first GPU pod Running, beside `kubectl apply -k` in the same run
(issue 37), on the real components of tests/cluster.py with the node of tests/test_cluster_daemonset.py
(a host directory, the image of scripts/build-image.sh imported into containerd, the DaemonSet
controller; the NVML stand-in's T4). The device-plugin path both times; each on a node of its own.

- reference: `kubectl apply -k` of deploy/kubernetes (the node's host paths patched in), the node
  labelled, the extender started with its account's token (as tests/cluster.py deploys);
- `helm install` of deploy/helm/cgpud (the real helm of scripts/helm-build.sh; the same host-path
  patch as a post-renderer, as tests/test_cluster_helm.py installs), then the same label and extender.

Each: seconds from the command's start to the command's return, and to a pod asking
`aliyun.com/gpu-mem: 3` (made right after) Running. With --runs N the two take turns and each time is
the median (min–max). With --old-ref REF (issue 48), `helm install` also of the image the tree at REF
builds (bench/image.py: its own build-image.sh), on a node of its own: the new image against the old.
The image is imported into the node's containerd before each install (tests/test_cluster_daemonset.py's
Node), so what a node's pull costs is bench/image.py's `podman save` figure, not in these.

    .venv/bin/python bench/helm.py [--runs 1] [--old-ref 555a060]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(HERE)]  # (tests/cluster.py, not bench/cluster.py)


def one(image: str, how: str, chart: Path | None = None) -> dict[str, float]:
    """`how` (helm or kustomize) on a node of its own with `image`; helm installs `chart` (default: this
    tree's)."""
    from cluster import EXTENDER_SA, NAMESPACE, NODE, SA, kubeconfig
    from test_cluster import running
    from test_cluster_daemonset import Node
    from test_cluster_helm import helm, post_renderer
    from test_helm import CHART

    with tempfile.TemporaryDirectory(prefix=f"cgpud-bench-{how}-") as tmp, Node(image, Path(tmp)) as node:
        c = node.cluster
        if how == "kustomize":
            at = node.apply()  # (kubectl apply -k, the label, the extender with its token: Cluster.deploy)
        else:
            name, tag = image.rsplit(":", 1)
            values = ["--set", f"image.repository={name}", "--set", f"image.tag={tag}"]
            daemonset = None
            if chart is not None:  # (the host-root patch made for its own DaemonSet: this tree's command has
                # flags an older cgpud refuses, --metrics-auth, and its containers may differ)
                out = helm(c, "template", "cgpud", os.fspath(chart), "--namespace", NAMESPACE, *values).stdout
                daemonset = next(d for d in yaml.safe_load_all(out)
                                 if d and d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpud")
            renderer = post_renderer(node, daemonset)
            at = time.monotonic()
            helm(c, "install", "cgpud", os.fspath(chart or CHART), "--namespace", NAMESPACE, "--post-renderer", renderer,
                 *values)
            c.kubectl("label", "node", NODE, "cgpu.aliyun.com/node=true", "--overwrite")
            token = c.kubectl("create", "token", SA, "-n", NAMESPACE, "--duration", "1h").stdout.strip()
            c.sa_kubeconfig = kubeconfig(c.path("cgpu-sa.kubeconfig"), c.server, c.path("pki", "ca.crt"),
                                         {"token": token})
            token = c.kubectl("create", "token", EXTENDER_SA, "-n", NAMESPACE, "--duration", "1h").stdout.strip()
            c.extender_kubeconfig = kubeconfig(c.path("extender-sa.kubeconfig"), c.server, c.path("pki", "ca.crt"),
                                               {"token": token})
            c.start_extender()
        got = {"returned": time.monotonic() - at}
        c.create(c.pod("first", 3, runtime_class=None))
        deadline = at + 300
        while not running(c.get("pod", "first")):
            if time.monotonic() > deadline:
                daemon = c.kubectl("logs", "-n", NAMESPACE, "ds/cgpud", "--all-containers", "--previous",
                                   "--tail", "40", check=False)
                raise SystemExit(f"{how} of {image}: the first pod not Running within 300 s\n{c.events('first')}\n"
                                 f"the DaemonSet's pod before its last restart:\n{daemon.stdout}{daemon.stderr}\n{c.logs()}")
            time.sleep(0.05)
        got["running"] = time.monotonic() - at
        c.delete_pod("first")
        if how == "helm":
            helm(c, "uninstall", "cgpud", "--namespace", NAMESPACE, "--wait", "--timeout", "120s")
        return got


def main() -> None:
    from daemonset import build_image
    from test_helm import CHART

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--old-ref", help="also helm install the image of the tree at this commit")
    args = ap.parse_args()
    image = build_image()
    runs: dict[str, list[dict]] = {"helm": [], "kustomize": []}
    old_image, old_chart, old_runs = None, None, []
    old_tree = tempfile.TemporaryDirectory(prefix="cgpud-bench-helm-old-")
    if args.old_ref:
        from image import build, remove, tree

        old_tag = f"localhost/cgpud-bench-helm-old:{os.getpid()}"  # (name:tag: the node's overlay splits it)
        at = tree(Path(old_tree.name), args.old_ref, cold=False)
        build(old_tag, "amd64", cwd=at)
        old_image = f"{old_tag}-amd64"
        old_chart = at / CHART.relative_to(ROOT)  # (its own chart: this tree's passes flags its cgpud lacks)
    try:
        for _ in range(args.runs):
            for how in runs:
                runs[how].append(one(image, how))
            if old_image:
                old_runs.append(one(old_image, "helm", old_chart))
    finally:
        if old_image:
            remove(old_tag, ["amd64"])
        old_tree.cleanup()
    print(f"the device-plugin path on one node, {args.runs} run(s) each (median), "
          f"load average {os.getloadavg()[0]:.1f}:")
    print(f"  {'':44} {'helm install (min–max)':>24}   kubectl apply -k (reference)")
    for label, key in (("the command returned", "returned"), ("first GPU pod Running (gpu-mem 3)", "running")):
        h, k = ((statistics.median(x := [r[key] for r in runs[how]]), min(x), max(x)) for how in ("helm", "kustomize"))
        print(f"  {label:44} {h[0]:9.1f} s ({h[1]:.1f}–{h[2]:.1f})   {k[0]:.1f} s ({k[1]:.1f}–{k[2]:.1f})")
    if old_runs:
        print(f"helm install of the image of {args.old_ref} (the reference), same run, median (min–max):")
        for label, key in (("the command returned", "returned"), ("first GPU pod Running (gpu-mem 3)", "running")):
            x = [r[key] for r in old_runs]
            print(f"  {label:44} {statistics.median(x):9.1f} s ({min(x):.1f}–{max(x):.1f})")


if __name__ == "__main__":
    main()
