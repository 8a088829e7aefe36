"""bench/binpack: GPU pods across nodes (issue 46), one run, on the cluster tier's real control plane
(tests/cluster.py: etcd, kube-apiserver, kube-scheduler with the shipped configuration) and `cgpu
scheduler-extender` (its own process, its own account) behind a timing proxy where that configuration
calls it. Nodes are made through the API as KWOK makes them (no kubelets; tests/test_cluster.py's
fake nodes), each GPU 14 units (a T4).

1. --nodes (1,000) nodes x 2 GPUs. A burst of --pods (400) pods asking aliyun.com/gpu-mem 3, created
   at once, with the extender's binpack (the default); then the same burst asking spread (the pod
   annotation cgpu.aliyun.com/placement). For each: the GPUs the burst touched, against the
   ceil(pods / 4) that four to a GPU needs; a pod asking a whole GPU (14) and one asking a whole node
   (gpu-count = the node's GPUs, all their units), created after the burst: bound or Pending; the
   extender's fragmentation metrics (GET /metrics); its filter and prioritize p50/p99 under
   kube-scheduler. Reference: a burst of as many pods asking no GPU on the same nodes in the same
   run: the rate of each burst (pods bound per second from the first create) against it. And the
   same burst with kube-scheduler's own scoring (its configuration without prioritizeVerb: as
   shipped before issue 46), kube-scheduler started again for it.
2. --big (5,000) nodes x 8 GPUs (made anew): the same bursts and figures; then filter and prioritize
   asked directly, with all the nodes as candidates, --calls times each (the extender's informers fed
   the nodes through the real API server; kube-scheduler itself asks for 500 of them at this size,
   its percentageOfNodesToScore): p50/p99 against the empty filter (a pod asking nothing, the same
   nodes, the same transport). The extender's resident memory against itself before the nodes.

    .venv/bin/python bench/binpack.py [--nodes 1000] [--pods 400] [--big 5000] [--calls 100]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import pct  # noqa: E402

UNITS = 14
FAKE = "cgpud-test/fake-pod"


def ms(x: float) -> str:
    return f"{x * 1e3:7.1f} ms"


def timing_proxy():
    """bench/cluster.py's TimingProxy (that file's module name is taken by tests/cluster.py here)."""
    spec = importlib.util.spec_from_file_location("bench_cluster", HERE / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TimingProxy


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Run:
    def __init__(self, c, behind: tuple[str, int], proxy) -> None:
        self.c, self.api, self.behind, self.proxy = c, c.api(), behind, proxy

    def get(self, path: str, body=None) -> tuple[float, bytes]:
        conn = http.client.HTTPConnection(*self.behind, timeout=120)
        data = json.dumps(body).encode() if body is not None else None
        t = time.perf_counter()
        conn.request("POST" if data else "GET", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = resp.read()
        took = time.perf_counter() - t
        conn.close()
        if resp.status != 200:
            raise SystemExit(f"{path}: HTTP {resp.status} {out[:300]!r}")
        return took, out

    def metrics(self) -> dict[str, float]:
        text = self.get("/metrics")[1].decode()
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("cgpu_extender")}

    def pod(self, name: str, units: int, count: int = 0, spread: bool = False) -> dict:
        pod = self.c.pod(name, units, labels={FAKE: "true"}, tolerate_fake=True, runtime_class=None)
        pod["spec"]["nodeSelector"] = {"cgpud-test/fake": "true"}
        if not units:
            del pod["spec"]["containers"][0]["resources"]
        if count:
            pod["metadata"]["labels"]["aliyun.com/gpu-count"] = str(count)
        if spread:
            pod["metadata"]["annotations"] = {"cgpu.aliyun.com/placement": "spread"}
        return pod

    def pods(self) -> list[dict]:
        return json.loads(self.api.list_namespaced_pod("default", label_selector=f"{FAKE}=true",
                                                       _preload_content=False).data)["items"]

    def burst(self, prefix: str, n: int, units: int, spread: bool = False) -> tuple[float, list[dict]]:
        """n pods created at once (8 threads); seconds from the first create to the last bound."""
        bodies = [self.pod(f"{prefix}-{i:04d}", units, spread=spread) for i in range(n)]
        self.proxy.times.clear()
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda b: self.api.create_namespaced_pod("default", b, _preload_content=False)
                          .drain_conn(), bodies))
        while True:
            items = [p for p in self.pods() if p["metadata"]["name"].startswith(prefix + "-")]
            if len(items) == n and all(p["spec"].get("nodeName") for p in items):
                return time.monotonic() - t0, items
            if time.monotonic() - t0 > 600:
                raise SystemExit(f"{prefix}: {sum(bool(p['spec'].get('nodeName')) for p in items)} of {n} bound "
                                 "in 600 s")
            time.sleep(0.25)

    def one(self, name: str, units: int, count: int) -> str:
        """A pod created after a burst: where it went within 30 s, or why it is Pending."""
        self.api.create_namespaced_pod("default", self.pod(name, units, count), _preload_content=False).drain_conn()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pod = json.loads(self.api.read_namespaced_pod(name, "default", _preload_content=False).data)
            if pod["spec"].get("nodeName"):
                idx = pod["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_IDX")
                return f"bound to {pod['spec']['nodeName']} GPU {idx}"
            time.sleep(0.25)
        why = self.c.events(name).strip().splitlines()[-1:] or ["no event"]
        return f"Pending after 30 s ({why[0][:160]})"

    def clear(self) -> None:
        self.api.delete_collection_namespaced_pod("default", label_selector=f"{FAKE}=true", grace_period_seconds=0,
                                                  _preload_content=False).drain_conn()
        deadline = time.monotonic() + 120
        while self.pods() or (m := self.metrics())["cgpu_extender_gpus_whole"] != m["cgpu_extender_gpus"]:
            if time.monotonic() > deadline:
                raise SystemExit("the pods did not go within 120 s")
            time.sleep(0.25)
        time.sleep(6)  # (prioritize's nominations of the last burst end: NOMINATED_SECONDS)

    def lat(self, verb: str) -> str:
        t = self.proxy.times.get(verb, [])
        return f"{verb} p50 {ms(pct(t, 50))} p99 {ms(pct(t, 99))} ({len(t)})" if t else f"{verb}: not asked"


def scheduler(c, prioritize: bool) -> None:
    """kube-scheduler started again with the shipped configuration, or without its prioritizeVerb and
    weight (the extender's filter and bind only: as shipped before issue 46)."""
    shipped = type(c).scheduler_config

    def config(self) -> dict:
        cfg = shipped(self)
        for ext in cfg.get("extenders", []) if not prioritize else ():
            ext.pop("prioritizeVerb", None)
            ext.pop("weight", None)
        return cfg

    c.procs["kube-scheduler"].stop()
    c.scheduler_config = config.__get__(c)
    c._start_scheduler()


def bursts(run: Run, nodes: int, gpus: int, pods: int, before: bool = False) -> None:
    print(f"\n== {nodes} nodes x {gpus} GPUs of {UNITS} units, bursts of {pods} pods "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    plain_s, _ = run.burst(f"plain{gpus}", pods, 0)
    print(f"reference: {pods} pods asking no GPU: all bound in {plain_s:5.1f} s ({pods / plain_s:5.1f} pods/s)")
    run.clear()
    need = math.ceil(pods / (UNITS // 3))
    ways = [("binpack (default)", False), ("spread (pod annotation)", True)]
    if before:
        ways.append(("before issue 46 (kube-scheduler's own scoring: the extender asked filter and bind only)", None))
    for how, spread in ways:
        if spread is None:
            scheduler(run.c, prioritize=False)
        took, items = run.burst(f"{'s' if spread else 'b' if spread is False else 'o'}{gpus}", pods, 3,
                                spread=bool(spread))
        lat = f"{run.lat('filter')}, {run.lat('prioritize')}, {run.lat('bind')}"
        touched = {(p["spec"]["nodeName"], p["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_IDX")) for p in items}
        on = {n for n, _ in touched}
        print(f"{how}: {pods} x 3 units bound in {took:5.1f} s ({pods / took:5.1f} pods/s, "
              f"{plain_s / took:4.2f} of the plain burst's rate); GPUs touched {len(touched)} on {len(on)} nodes "
              f"(packing needs {need})")
        print(f"  extender under kube-scheduler: {lat}")
        m = run.metrics()
        print("  fragmentation: " + ", ".join(f"{k[len('cgpu_extender_'):]} {v:.0f}" for k, v in m.items()))
        print(f"  then a pod asking a whole GPU ({UNITS}): {run.one(f'whole-gpu-{gpus}', UNITS, 1)}")
        print(f"  then a pod asking a whole node ({gpus} x {UNITS}): "
              f"{run.one(f'whole-node-{gpus}', gpus * UNITS, gpus)}")
        run.clear()
        if spread is None:
            scheduler(run.c, prioritize=True)


def direct(run: Run, nodes: int, calls: int) -> None:
    names = [f"fake-{i:04d}" for i in range(nodes)]
    meta = {"name": "bench-direct", "namespace": "default", "uid": "bench-direct-uid"}
    ask = {"containers": [{"name": "a", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}
    gpu = {"Pod": {"metadata": meta, "spec": ask}, "NodeNames": names}
    empty = {"Pod": {"metadata": meta, "spec": {"containers": [{"name": "a"}]}}, "NodeNames": names}
    got = {"filter": [], "prioritize": [], "empty": []}
    for _ in range(calls):
        got["empty"].append(run.get("/gpushare-scheduler/filter", empty)[0])
        took, out = run.get("/gpushare-scheduler/filter", gpu)
        got["filter"].append(took)
        assert len(json.loads(out)["NodeNames"]) == nodes
        got["prioritize"].append(run.get("/gpushare-scheduler/prioritize", gpu)[0])
    print(f"asked directly, all {nodes} nodes as candidates ({calls} each): "
          + ", ".join(f"{k} p50 {ms(pct(v, 50))} p99 {ms(pct(v, 99))}" for k, v in got.items() if k != "empty"))
    print(f"  reference: the empty filter (a pod asking nothing): p50 {ms(pct(got['empty'], 50))} "
          f"p99 {ms(pct(got['empty'], 99))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=400)
    ap.add_argument("--big", type=int, default=5000, help="nodes x 8 GPUs of the second part (0: none)")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()

    from cluster import EXTENDER_SA, NAMESPACE, Cluster, extender_addr, free_port, k8s_bin, kubeconfig
    from test_cluster import delete_fake_nodes, make_fake_nodes

    c = Cluster(None, None, k8s_bin())
    proxy = None
    try:
        c.start_control_plane()
        c._start_scheduler()  # (the shipped configuration: the extender's filter, prioritize and bind)
        c.kubectl("apply", *c.deploy_target())
        token = c.kubectl("create", "token", EXTENDER_SA, "-n", NAMESPACE, "--duration", "6h").stdout.strip()
        c.extender_kubeconfig = kubeconfig(c.path("extender-sa.kubeconfig"), c.server, c.path("pki", "ca.crt"),
                                           {"token": token})
        behind = ("127.0.0.1", free_port())
        c.start_extender(behind)
        proxy = timing_proxy()(extender_addr(), behind)
        pid = c.procs["extender"].proc.pid
        rss0 = rss_mb(pid)
        run = Run(c, behind, proxy)
        t = time.monotonic()
        make_fake_nodes(c, args.nodes, 2)
        print(f"{args.nodes} nodes made through the API in {time.monotonic() - t:.0f} s")
        time.sleep(2)
        bursts(run, args.nodes, 2, args.pods, before=True)
        if args.big:
            delete_fake_nodes(c)
            t = time.monotonic()
            make_fake_nodes(c, args.big, 8)
            print(f"\n{args.big} nodes x 8 GPUs made through the API in {time.monotonic() - t:.0f} s")
            deadline = time.monotonic() + 120
            while run.metrics().get("cgpu_extender_nodes", 0) < args.big:
                assert time.monotonic() < deadline, "the extender did not see the nodes"
                time.sleep(0.5)
            bursts(run, args.big, 8, args.pods)
            direct(run, args.big, args.calls)
        print(f"\nthe extender's resident memory: {rss_mb(pid):.0f} MB (reference: {rss0:.0f} MB at its start, "
              "before the nodes)")
    finally:
        if proxy is not None:
            proxy.stop()
        try:
            delete_fake_nodes(c)
        except Exception:  # noqa: BLE001 - the cluster goes anyway
            pass
        c.cleanup()


if __name__ == "__main__":
    main()
