"""bench/k8s: the Kubernetes parts' figures (issues 14 and 22), one run.

1. Re-registration after a kubelet restart (the kubelet stand-in re-creates its
   socket): p50/p99 of restart -> Register received, over `--restarts`.
   Goal p99 <= 1 s. Reference: one gRPC Register round trip measured alone.
2. Allocate p99 with 100 pods' worth of instances on the node (the daemon's
   query grows with them), against GetDevicePluginOptions (no work) in the
   same run; and again with the API server (stand-in; 100 pods on the node),
   each Allocate following an extender's choice that its pod watch brought.
   Goal p99 <= 10 ms.
3. At cluster scale (issue 22; --nodes 5000 x 8 GPUs, --pods 40000 in the
   API server stand-in), `cgpu scheduler-extender` and `cgpu device-plugin`
   as their own processes: filter p99 for 500 candidate nodes (goal 20 ms)
   and all 5,000 (goal 50 ms) against the empty filter (a pod asking no
   gpu-mem, same nodes); the extender's resident memory (goal 300 MB)
   against the same extender with an empty cluster; over --steady seconds
   (the issue's 10 minutes by default) of pods created, bound by the
   extender, allocated by the plugin and deleted, the requests each made to
   the API server (goal: 1 LIST per resource at start, then watches only);
   and a pod created -> visible to filter, p99 (goal 1 s).
4. Placement over 1,000 random pod sequences: no GPU is ever over-filled by
   binpack; on nodes of one GPU size binpack leaves at least as many whole
   GPUs free as gpushare's best-fit on the same sequence; on nodes of mixed
   sizes, how many GPUs gpushare's best-fit over-fills (it counts every GPU as
   large as GPU 0).

    .venv/bin/python bench/k8s.py [--restarts 20] [--calls 300] [--nodes 5000] [--pods 40000]
                                  [--steady 600] [--only plugin|scale|placement]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import daemon, pct, tool  # noqa: E402


def ms(x: float) -> str:
    return f"{x * 1e3:7.2f} ms"


def start_plugin(socket: str, plugin_dir: Path, env: dict | None = None):
    """A kubelet stand-in on `plugin_dir` and `cgpu device-plugin` registered with it and listing units."""
    from kubelet_standin import Kubelet

    kubelet = Kubelet(os.fspath(plugin_dir))
    proc = subprocess.Popen([tool("cgpu"), "--socket", socket, "device-plugin", "--plugin-dir", os.fspath(plugin_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 20
    while not kubelet.registrations:
        if time.monotonic() > deadline:
            proc.kill()
            kubelet.stop()
            raise SystemExit("the plugin did not register")
        time.sleep(0.01)
    kubelet.wait_devices(lambda ds: len(ds) > 0)
    return kubelet, proc


def plugin_figures(restarts: int, calls: int) -> None:
    from cgpud.client import Client
    from cgpud.k8s.proto import api_pb2 as pb

    with daemon(gpus="sim:8xA10", handle=True) as run:
        with Client(run.socket) as c:  # 100 pods' instances: 12-13 per GPU
            for k in range(100):
                c.call("register", name=f"pod{k:09d}", gpus=[k % 8], memsize=1 << 30)
        kubelet, proc = start_plugin(run.socket, Path(tempfile.mkdtemp(prefix="cgpud-bench-k8s-")))
        try:
            waits = []
            for n in range(restarts):
                back = kubelet.restart()
                while len(kubelet.registrations) < n + 2:
                    time.sleep(0.002)
                waits.append(kubelet.registrations[-1][0] - back)
            devs = sorted(kubelet.wait_devices(lambda ds: len(ds) > 0))
            by_gpu: dict[str, list[str]] = {}
            for d in devs:
                by_gpu.setdefault(d.rpartition("-_-")[0], []).append(d)
            ids = list(by_gpu.values())[0][:2]
            alloc, opts = [], []
            for _ in range(calls):
                t = time.perf_counter()
                kubelet.allocate(ids)
                alloc.append(time.perf_counter() - t)
                t = time.perf_counter()
                kubelet.plugin.GetDevicePluginOptions(pb.Empty(), timeout=5)
                opts.append(time.perf_counter() - t)
            print(f"re-registration after a kubelet restart ({restarts}): p50 {ms(pct(waits, 50))}  "
                  f"p99 {ms(pct(waits, 99))}  (goal p99 <= 1 s)")
            print(f"Allocate with 100 pods' instances on the node ({calls}): p50 {ms(pct(alloc, 50))}  "
                  f"p99 {ms(pct(alloc, 99))}; GetDevicePluginOptions p50 {ms(pct(opts, 50))} "
                  f"({pct(alloc, 99) / pct(opts, 50):.1f}x; goal p99 <= 10 ms)")
        finally:
            proc.terminate()
            proc.wait(10)
            kubelet.stop()
        allocate_with_api(run.socket, ids, calls, pct(opts, 50))


def allocate_with_api(socket: str, ids: list[str], calls: int, reference: float) -> None:
    """Allocate again, the plugin now with the API server (stand-in), 100 running pods on the node:
    before each call a pod the extender placed comes to the node (as its Binding does), and Allocate
    follows that choice from the plugin's watch of the node's pods."""
    from apiserver_standin import ApiServer

    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-k8s-api-"))
    api = ApiServer(tmp, bookmark_every=5.0)
    api.add_node("bench-node", gpus=8, units=8 * 22)
    for k in range(100):
        api.add_pod(f"run{k}", [1], node="bench-node", phase="Running",
                    annotations={"ALIYUN_COM_GPU_MEM_IDX": str(k % 8), "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"})
    plugins = tmp / "device-plugins"
    plugins.mkdir()
    kubelet, proc = start_plugin(socket, plugins, dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig),
                                                       NODE_NAME="bench-node"))
    try:
        times, wrong = [], 0
        for k in range(calls):
            api.add_pod(f"chosen{k}", [len(ids)], node="bench-node", annotations={
                "ALIYUN_COM_GPU_MEM_IDX": str(k % 8), "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
                "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(k + 1)})
            t = time.perf_counter()
            (env,) = kubelet.allocate(ids)
            times.append(time.perf_counter() - t)
            wrong += env["ALIYUN_COM_GPU_MEM_IDX"] != str(k % 8)
            api.set_phase("default", f"chosen{k}", "Running")
        reads = sum(n for (a, v, _), n in api.by_agent.items() if a == "cgpu-device-plugin" and v in ("list", "get"))
        print(f"Allocate with the API server, each following the extender's choice from the watch, 100 pods on the "
              f"node ({calls}): p50 {ms(pct(times, 50))}  p99 {ms(pct(times, 99))} "
              f"({pct(times, 99) / reference:.1f}x GetDevicePluginOptions; goal p99 <= 10 ms); "
              f"choices not followed: {wrong}; the plugin's LISTs and GETs: {reads} (its first LIST of pods and node)")
    finally:
        proc.terminate()
        proc.wait(10)
        kubelet.stop()
        api.close()


class Extender:
    """`cgpu scheduler-extender` as its own process (so its memory is its own) against a stand-in."""

    def __init__(self, kubeconfig: Path) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        began = time.monotonic()
        self.proc = subprocess.Popen([tool("cgpu"), "scheduler-extender", "--addr", f"127.0.0.1:{port}",
                                      "--log-level", "warning"], env=dict(os.environ, KUBECONFIG=os.fspath(kubeconfig)))
        self.url = f"http://127.0.0.1:{port}/gpushare-scheduler"
        while True:
            try:
                self.post("/filter", {"Pod": {}, "NodeNames": []})
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() - began > 120:
                    raise SystemExit("the extender did not start") from None
                time.sleep(0.05)
        self.started = time.monotonic() - began

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def pod_asking(units: int, count: int = 0) -> dict:
    limits = {"aliyun.com/gpu-mem": str(units)}
    if count:
        limits["aliyun.com/gpu-count"] = str(count)
    return {"metadata": {"name": "asks", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": limits}}]}}


def scale_figures(socket: str, n_nodes: int, n_pods: int, calls: int, steady: float, probes: int) -> None:
    """The extender and a device plugin against a stand-in holding `n_nodes` nodes of 8 A10s (22 units)
    and `n_pods` running pods; then `steady` seconds of pods coming and going (bound by the extender,
    some on the plugin's node and allocated there) with the API server's requests counted per client."""
    from apiserver_standin import ApiServer

    rng = random.Random(5)
    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-scale-"))
    (tmp / "empty").mkdir()
    empty_api = ApiServer(tmp / "empty")
    empty = Extender(empty_api.kubeconfig)  # the reference: the same extender with an empty cluster
    empty_rss = empty.rss()
    empty.close()
    empty_api.close()
    api = ApiServer(tmp, history=20000, bookmark_every=5.0)
    names = [f"node-{n:05d}" for n in range(n_nodes)]
    for name in names:
        api.add_node(name, gpus=8, units=8 * 22, per_device=",".join(["22"] * 8))
    probe_nodes = names[-max(1, min(probes, n_nodes // 10)):]  # kept empty: probes fill them
    busy = names[:n_nodes - len(probe_nodes)]
    for k in range(n_pods):
        api.add_pod(f"p{k}", [rng.randint(1, 4)], node=busy[k % len(busy)], phase="Running",
                    annotations={"ALIYUN_COM_GPU_MEM_IDX": str(rng.randrange(8)), "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"})
    ext = Extender(api.kubeconfig)
    plugin_node = busy[0]
    plugins = tmp / "device-plugins"
    plugins.mkdir()
    kubelet, plugin = start_plugin(socket, plugins, dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig),
                                                         NODE_NAME=plugin_node))
    try:
        print(f"at scale: {n_nodes} nodes x 8 GPUs, {n_pods} pods; the extender started (its LISTs) in "
              f"{ext.started:.1f} s, resident {ext.rss() >> 20} MB (with an empty cluster: {empty_rss >> 20} MB; "
              f"goal <= 300 MB)")
        for label, cands in ((f"{min(500, n_nodes)} candidate nodes", rng.sample(names, min(500, n_nodes))),
                             (f"all {n_nodes} nodes", names)):
            real, none = [], []
            for k in range(calls):
                for pod, out in ((pod_asking(rng.choice([4, 12, 22])), real), (pod_asking(0), none)):
                    t = time.perf_counter()
                    code, res = ext.post("/filter", {"Pod": pod, "NodeNames": cands})
                    out.append(time.perf_counter() - t)
                    assert code == 200, res
            goal = 20 if len(cands) <= 500 else 50
            print(f"  filter, {label} ({calls}): p50 {ms(pct(real, 50))}  p99 {ms(pct(real, 99))}; the empty filter "
                  f"(a pod asking nothing, same nodes) p50 {ms(pct(none, 50))}  p99 {ms(pct(none, 99))} "
                  f"(goal p99 <= {goal} ms)")
        before = dict(api.by_agent)
        visible, bound, allocated, refused = steady_state(api, ext, kubelet, plugin_node, busy, probe_nodes, steady,
                                                           rng)
        after = dict(api.by_agent)
        print(f"  steady state, {steady:.0f} s (pods coming and going: {bound} bound by the extender, {allocated} of "
              f"them allocated by the plugin on {plugin_node}; {refused} binds refused: node full):")
        for agent in ("cgpu-scheduler-extender", "cgpu-device-plugin"):
            at_start = {k[1:]: n for k, n in before.items() if k[0] == agent and k[1] in ("list", "get", "watch")}
            then = {k[1:]: n - before.get(k, 0) for k, n in after.items() if k[0] == agent and n - before.get(k, 0)}
            print(f"    {agent}: at start {_counts(at_start)}; then {_counts(then) or 'nothing'} "
                  f"(goal: 1 LIST per resource, then watches only)")
        print(f"  a pod created -> visible to the extender's filter ({len(visible)}): p50 {ms(pct(visible, 50))}  "
              f"p99 {ms(pct(visible, 99))} (goal p99 <= 1 s); the extender is then resident {ext.rss() >> 20} MB")
    finally:
        plugin.terminate()
        plugin.wait(10)
        kubelet.stop()
        ext.close()
        api.close()


def _counts(counts: dict) -> str:
    return ", ".join(f"{verb.upper()} {res} {n}" for (verb, res), n in sorted(counts.items()))


def steady_state(api, ext: Extender, kubelet, plugin_node: str, busy: list[str], probe_nodes: list[str],
                 seconds: float, rng: random.Random) -> tuple[list[float], int, int, int]:
    """Pods come and go for `seconds`: each tick a new pod (1-4 units) is created, the one created the tick
    before is bound by the extender (every 4th to the plugin's node, whose kubelet stand-in then asks
    for its units), and the oldest goes; and a probe pod fills an empty node: the time until the
    filter sees it is measured."""
    made, waiting = [], None
    visible, bound, allocated, refused, k = [], 0, 0, 0, 0
    full = {"ALIYUN_COM_GPU_MEM_IDX": ",".join(map(str, range(8))), "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}
    one = pod_asking(1)
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        k += 1
        if waiting is not None:
            node = plugin_node if k % 4 == 0 else rng.choice(busy)
            code, res = ext.post("/bind", {"PodName": waiting[0], "PodNamespace": "default", "Node": node})
            if code == 200:
                bound += 1
                if node == plugin_node:
                    kubelet.allocate(kubelet.preferred(sorted(kubelet.devices), waiting[1]))
                    allocated += 1
                api.set_phase("default", waiting[0], "Running")
                made.append(waiting[0])
            else:
                refused += 1
                api.delete_pod("default", waiting[0])
        units = rng.randint(1, 4)
        api.add_pod(f"churn{k}", [units])
        waiting = (f"churn{k}", units)
        if len(made) > 50:
            api.delete_pod("default", made.pop(0))
        probe = rng.choice(probe_nodes)
        t = time.perf_counter()
        api.add_pod(f"probe{k}", [8 * 22], node=probe, phase="Running", count=8, annotations=full)
        while ext.post("/filter", {"Pod": one, "NodeNames": [probe]})[1]["NodeNames"]:
            if time.perf_counter() - t > 10:
                raise SystemExit("the extender did not see a pod in 10 s")
        visible.append(time.perf_counter() - t)
        api.delete_pod("default", f"probe{k}")
        time.sleep(0.05)
    return visible, bound, allocated, refused


def _gpushare_best_fit(assumed: list[int], used: list[int], need: int) -> int | None:
    """gpushare's choice: the GPU with the least free memory that fits, by its own view of sizes."""
    fit = [i for i in range(len(assumed)) if assumed[i] - used[i] >= need]
    return min(fit, key=lambda i: (assumed[i] - used[i], i)) if fit else None


def placement_figures(sequences: int) -> None:
    """Each sequence twice: nodes of one GPU size (gpushare's view is right there: compare whole GPUs left),
    and of mixed sizes (gpushare counts each GPU as large as GPU 0: count what it over-fills)."""
    from cgpud.k8s import cluster

    rng = random.Random(11)
    sizes = [15, 22, 40, 80]
    ours_over = ours_over_mixed = theirs_over = worse = ours_whole = theirs_whole = 0
    for _ in range(sequences):
        n = rng.randint(2, 8)
        pods = [rng.randint(1, 16) for _ in range(rng.randint(5, 30))]
        for units in ([rng.choice(sizes)] * n, [rng.choice(sizes) for _ in range(n)]):
            ours, theirs = [0] * n, [0] * n
            assumed = [units[0]] * n
            for need in pods:
                g = cluster.choose(units, ours, need)
                if g is not None:
                    ours[g[0]] += need
                i = _gpushare_best_fit(assumed, theirs, need)
                if i is not None:
                    theirs[i] += need
            ours_over += sum(o > u for o, u in zip(ours, units))
            if len(set(units)) == 1:
                a, b = sum(o == 0 for o in ours), sum(t == 0 for t in theirs)
                ours_whole, theirs_whole, worse = ours_whole + a, theirs_whole + b, worse + (a < b)
            else:
                theirs_over += sum(t > u for t, u in zip(theirs, units))
                ours_over_mixed += sum(o > u for o, u in zip(ours, units))
    print(f"placement, {sequences} random pod sequences: GPUs over-filled by binpack: {ours_over} (goal 0)")
    print(f"  nodes of one size: whole GPUs left free: binpack {ours_whole}, gpushare's best-fit {theirs_whole}; "
          f"sequences where binpack left fewer: {worse} (goal 0)")
    print(f"  nodes of mixed sizes: GPUs gpushare's best-fit over-fills (it takes every GPU for GPU 0's size): "
          f"{theirs_over}; binpack: {ours_over_mixed}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--sequences", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=5000, help="nodes (8 GPUs each) the API server holds")
    ap.add_argument("--pods", type=int, default=40000, help="running pods the API server holds")
    ap.add_argument("--filters", type=int, default=200, help="filter calls per figure at scale")
    ap.add_argument("--steady", type=float, default=600, help="seconds of steady state (pods coming and going)")
    ap.add_argument("--only", choices=["plugin", "scale", "placement"], help="one part only")
    args = ap.parse_args()
    if args.only in (None, "plugin"):
        plugin_figures(args.restarts, args.calls)
    if args.only in (None, "scale"):
        with daemon(gpus="sim:8xA10", handle=True) as run:
            scale_figures(run.socket, args.nodes, args.pods, args.filters, args.steady, probes=100)
    if args.only in (None, "placement"):
        placement_figures(args.sequences)


if __name__ == "__main__":
    main()
