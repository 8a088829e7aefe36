"""bench/podspec: a tenant's pod spec against the node (issue 44, its first channel; docs/security.md
"The pod's spec").

1. The container-start path's cost of reading the allocation from its new channel: `cgpu-runtime
   create` (the daemon's `prepare`: read config.json, read the allocation, check it, add the hooks,
   write config.json; the real runtime a no-op), rounds interleaved, p50/p99 of:
     env         a spec with the device plugin's environment and no Kubernetes mark: what every
                 container paid before (the environment was the allocation) — the reference;
     annotation  the same container as containerd's CRI makes it now: CRI annotations, the
                 allocation annotation, its environment checked against it;
     narrowed    a Kubernetes container with no allocation whose image says NVIDIA_VISIBLE_DEVICES=all
                 (config.json rewritten to void, no hooks).
   And contract_env alone (pure), per call.
2. `--cluster`: the attacks from a pod spec on the real kubelet and containerd (tests/cluster.py, the
   device plugin and the extender deployed; the cluster tier's lock): tried / succeeded, each
   judged by what the node did (an instance of 12 units, a pod running in no instance, high priority,
   weight 16, NVIDIA_VISIBLE_DEVICES=all seen inside, another RuntimeClass admitted). On main before
   issue 44 every one succeeds (tests/test_cluster_podspec.py fails there).

    .venv/bin/python bench/podspec.py [--rounds 200] [--cluster]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import daemon, pct, tool  # noqa: E402

from cgpud.containers import allotted  # noqa: E402

ENV = {"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_MEM_DEV": "14",
       "ALIYUN_COM_GPU_MEM_POD": "1"}
CRI = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "f" * 64,
       "io.kubernetes.cri.sandbox-namespace": "tenant", "io.kubernetes.cri.sandbox-name": "p",
       "io.kubernetes.cri.container-name": "app", "io.kubernetes.cri.image-name": "busybox"}


def spec(kind: str, uuid: str) -> dict:
    env = {**ENV, "NVIDIA_VISIBLE_DEVICES": uuid}
    lines = ["PATH=/usr/bin:/bin", "HOSTNAME=p"]
    if kind == "env":
        return {"ociVersion": "1.0.2", "process": {"env": lines + [f"{k}={v}" for k, v in env.items()]},
                "annotations": {}}
    if kind == "annotation":
        return {"ociVersion": "1.0.2", "process": {"env": lines + [f"{k}={v}" for k, v in env.items()]},
                "annotations": {**CRI, **allotted.annotations("aliyun.com/gpu-mem", env)}}
    return {"ociVersion": "1.0.2", "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all", *lines]}, "annotations": CRI}


def start_path(rounds: int) -> None:
    wrapper = tool("cgpu-runtime")
    with daemon("sim:T4", handle=True) as d:
        from cgpud.client import Client

        with Client(d.socket) as c:
            uuid = c.call("query")["gpus"][0]["uuid"]
        tmp = tempfile.mkdtemp(prefix="cgpud-bench-podspec-")
        env = dict(os.environ, CGPUD_SOCKET=d.socket, CGPU_RUNTIME_REAL=shutil.which("true"))
        times: dict[str, list[float]] = {"env": [], "annotation": [], "narrowed": []}
        try:
            for r in range(rounds + 3):
                for kind in times:
                    b = os.path.join(tmp, f"{kind}-{r}")
                    os.mkdir(b)
                    with open(os.path.join(b, "config.json"), "w") as f:
                        json.dump(spec(kind, uuid), f)
                    t = time.perf_counter()
                    p = subprocess.run([wrapper, "create", "--bundle", b, f"{r:06d}{kind[:6]:>6}".replace(" ", "x")],
                                       env=env, capture_output=True, text=True)
                    dt = time.perf_counter() - t
                    if p.returncode:
                        raise SystemExit(f"cgpu-runtime create ({kind}) failed: {p.stderr}")
                    seen = json.load(open(os.path.join(b, "config.json")))
                    if kind != "narrowed" and not seen.get("hooks"):
                        raise SystemExit(f"{kind}: no hooks added")
                    if kind == "narrowed" and "NVIDIA_VISIBLE_DEVICES=void" not in seen["process"]["env"]:
                        raise SystemExit("narrowed: NVIDIA_VISIBLE_DEVICES not narrowed")
                    if r >= 3:  # (three warm-up rounds)
                        times[kind].append(dt)
                    shutil.rmtree(b)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    ref = times["env"]
    print(f"container start, cgpu-runtime create through prepare, {rounds} rounds interleaved:")
    for kind, xs in times.items():
        print(f"  {kind:<10} p50 {pct(xs, 50) * 1e3:6.2f} ms  p99 {pct(xs, 99) * 1e3:6.2f} ms"
              + ("   (reference: the environment read as the allocation, before)" if kind == "env" else
                 f"   (p50 {pct(xs, 50) / pct(ref, 50):.2f}x, p99 {pct(xs, 99) / pct(ref, 99):.2f}x the reference)"))
    config = spec("annotation", "GPU-x")
    from cgpud.containers.hookd import env_of

    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        env_of(config)
    base = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        allotted.contract_env(env_of(config), config)
    print(f"  contract_env alone: {(time.perf_counter() - t) / n * 1e6:.1f} us per spec "
          f"(reference: env_of, the environment alone, {base * 1e6:.1f} us)")


def cluster_attacks() -> None:
    from cluster import Cluster, end_shared, node as cluster_node, shared, wait_for
    from test_cluster import memsize
    from test_cluster_podspec import names, with_env

    (d, c) = shared("podspec-bench", lambda: cluster_node("sim:2xT4", (), Cluster.deploy))
    results: list[tuple[str, bool]] = []

    def pod_state(name: str, timeout: float = 90) -> dict:
        got = {}

        def settled() -> bool:
            nonlocal got
            p = c.kubectl("get", "pod", name, "-o", "json", check=False)
            got = json.loads(p.stdout) if p.returncode == 0 else {}
            st = got.get("status", {})
            cs = (st.get("containerStatuses") or [{}])[0]
            return st.get("phase") == "Running" or bool(cs.get("lastState", {}).get("terminated")) or \
                "waiting" in cs.get("state", {}) and cs["state"]["waiting"].get("reason") not in (None, "ContainerCreating")

        wait_for(settled, timeout, f"pod {name} started or refused")
        return got

    def instance(pod: dict) -> tuple[int, str] | None:
        cs = (pod.get("status", {}).get("containerStatuses") or [{}])[0]
        if not cs.get("state", {}).get("running"):
            return None
        name = cs["containerID"].split("://")[1][:12]
        for g in (0, 1):
            if name in d.instances(g):
                return g, name
        return -1, name

    try:
        forged = {"ALIYUN_COM_GPU_MEM_CONTAINER=12 on gpu-mem 1": ("ALIYUN_COM_GPU_MEM_CONTAINER", "12"),
                  "CGPU_DISABLE=true (no instance, GPU visible)": ("CGPU_DISABLE", "true"),
                  "ALIYUN_COM_GPU_HIGH_PRIO=1": ("ALIYUN_COM_GPU_HIGH_PRIO", "1"),
                  "ALIYUN_COM_GPU_SCHD_WEIGHT=16": ("ALIYUN_COM_GPU_SCHD_WEIGHT", "16")}
        for n, (what, (k, v)) in enumerate(forged.items()):
            name = f"bench-forge-{n}"
            c.create(with_env(c.pod(name, 1), **{k: v}))
            got = instance(pod_state(name))
            if got is None:  # not running: refused
                ok = False
            elif k == "CGPU_DISABLE":
                ok = got[0] == -1  # running in no instance
            else:
                g, inst = got
                file, want = {"ALIYUN_COM_GPU_MEM_CONTAINER": ("memsize", memsize(12)),
                              "ALIYUN_COM_GPU_HIGH_PRIO": ("highprio", "1"),
                              "ALIYUN_COM_GPU_SCHD_WEIGHT": ("weight", "16")}[k]
                ok = g >= 0 and d.value(f"{g}/{inst}/{file}") == want
            results.append((what, ok))
            c.delete_pod(name, wait=False)
        for name, resources in (("bench-gpus-all", True), ("bench-gpus-none", False)):
            pod = with_env(c.pod(name, 1, command="env; sleep 3600"), NVIDIA_VISIBLE_DEVICES="all")
            if not resources:
                del pod["spec"]["containers"][0]["resources"]
            c.create(pod)
            pod_state(name)
            seen = {}

            def read() -> bool:
                p = c.kubectl("logs", name, check=False)
                seen.update(ln.split("=", 1) for ln in p.stdout.splitlines() if "=" in ln)
                return "PATH" in seen

            wait_for(read, 30, f"{name}'s env")
            results.append((f"NVIDIA_VISIBLE_DEVICES=all, {'gpu-mem 1' if resources else 'no GPU resource'}",
                            seen.get("NVIDIA_VISIBLE_DEVICES") == "all"))
            c.delete_pod(name, wait=False)
        c.create({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                  "handler": "runc"})
        p = c.kubectl("create", "-f", "-", check=False, stdin=json.dumps(c.pod("bench-rc", 1, runtime_class="nvidia")))
        results.append(("runtimeClassName nvidia with gpu-mem 1", p.returncode == 0))
        c.kubectl("delete", "pod", "bench-rc", "--ignore-not-found", "--wait=false", check=False)
        c.kubectl("delete", "runtimeclass", "nvidia", "--ignore-not-found", check=False)
        wait_for(lambda: not names(d), 90, "every instance gone")
    finally:
        end_shared()
    print(f"attacks from a pod spec on the real kubelet and containerd: {len(results)} tried / "
          f"{sum(ok for _, ok in results)} succeeded (before issue 44: {len(results)} / {len(results)}, "
          "tests/test_cluster_podspec.py fails on main)")
    for what, ok in results:
        print(f"  {'SUCCEEDED' if ok else 'refused  '}  {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--cluster", action="store_true", help="also the attacks on the cluster tier (minutes)")
    a = ap.parse_args()
    start_path(a.rounds)
    if a.cluster:
        cluster_attacks()


if __name__ == "__main__":
    main()
