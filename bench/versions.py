"""bench/versions: issue 47's figure for one Kubernetes release, one run: a pod's create -> Running
(its container's instance in the cgpu_km tree) p50/p99 through each path the release serves, against
a pod asking nothing, on the real components of tests/cluster.py built at K8S_VERSION
(scripts/k8s-build.sh; tests/cluster/versions/) with containerd 2 and cgpud serving two simulated T4s.

- the device plugin and the extender: a pod asking `aliyun.com/gpu-mem: 1`, every release;
- DRA: a pod with a ResourceClaim of 1 GiB, where the server serves resource.k8s.io/v1 (1.34+;
  1.34-1.35 with DRAConsumableCapacity, which tests/cluster.py sets unless K8S_FEATURE_GATES says
  otherwise); where the server lacks it, or lacks a gate the layout needs, what `cgpu dra-plugin`
  says when it starts there (it refuses in one line) is printed instead.

    K8S_VERSION=1.36.3 .venv/bin/python bench/versions.py [--pods 10]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(HERE)]  # (tests/cluster.py, not bench/cluster.py)

from common import cluster_tier  # noqa: E402
from dra import EXT_NS, extender_namespace, pipeline_figures, wait  # noqa: E402


DRA_DEPLOY = ROOT / "deploy" / "kubernetes" / "dra"


def serves_dra(c) -> bool:
    return c.kubectl("get", "--raw", "/apis/resource.k8s.io/v1", check=False).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=10)
    args = ap.parse_args()

    from cluster import NODE
    from test_cluster_dra import containerd_bin, start_plugin

    with cluster_tier("sim:2xT4", containerd_bins=containerd_bin()) as (d, c):
        version = ".".join(map(str, c.release))
        dra = serves_dra(c)
        print(f"Kubernetes {version} (feature gates set: {c.gates or 'none'}), resource.k8s.io/v1 "
              f"{'served' if dra else 'not served'}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        c.deploy()  # deploy/kubernetes: the extender and the device plugin (DRA mode's component drops the extender)
        if dra:  # ... and DRA's class and the plugin's account beside them, as bench/dra.py's node runs both
            c.kubectl("apply", "-f", os.fspath(DRA_DEPLOY / "deviceclass.yaml"), "-f", os.fspath(DRA_DEPLOY / "rbac.yaml"))
        c.start_controller_manager(("resourceclaim-controller," if dra else "") + "serviceaccount-controller,"
                                   "serviceaccount-token-controller,garbage-collector-controller")
        if dra:
            plugin = start_plugin(c)
            wait(lambda: not plugin.alive() or json.loads(c.kubectl("get", "resourceslices", "-o", "json").stdout)[
                "items"], 90, "the DRA plugin's slices")
            if not plugin.alive():  # (it read what the server serves and refused: its one line)
                dra = False
                said = [ln for ln in plugin.log_path.read_text().splitlines() if ln.strip()]
                print(f"cgpu dra-plugin on this server: exit {plugin.proc.returncode}: {said[-1] if said else ''}")
        else:
            root = c.path("kubelet", "root")
            p = subprocess.run([c._cgpu(), "--socket", c.daemon.socket, "dra-plugin", "--node-name", NODE,
                                "--registry-dir", root / "plugins_registry", "--plugin-dir", root / "plugins" / "x",
                                "--state-dir", c.path("dra-state"), "--cdi-dir", c.path("cdi")],
                               capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, KUBECONFIG=os.fspath(c.admin)))
            print(f"cgpu dra-plugin on this server: exit {p.returncode}: {p.stderr.strip()}")
        extender_namespace(c)
        wait(lambda: c.allocatable("aliyun.com/gpu-mem") == 28, 60, "the device plugin's units")
        pipeline_figures(c, d, args.pods, dra=dra)
        print(f"(the device plugin's pods in namespace {EXT_NS})")


if __name__ == "__main__":
    main()
