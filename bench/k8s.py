"""bench/k8s: the Kubernetes parts' figures (issue 14), one run.

1. Re-registration after a kubelet restart (the kubelet stand-in re-creates its
   socket): p50/p99 of restart -> Register received, over `--restarts`.
   Goal p99 <= 1 s. Reference: one gRPC Register round trip measured alone.
2. Allocate p99 with 100 pods' worth of instances on the node (the daemon's
   query grows with them), against GetDevicePluginOptions (no work) in the
   same run; and again with the API server (stand-in; 100 pods on the node),
   where each Allocate asks it for the extender's choice. Goal p99 <= 10 ms.
3. Extender filter p99 for 100 nodes x 8 GPUs (the API server stand-in holds
   them and 400 pods), against an empty filter (a pod asking no gpu-mem).
   Goal p99 <= 20 ms. The extender reads the cluster in the background, as
   `cgpu scheduler-extender` does.
4. Placement over 1,000 random pod sequences: no GPU is ever over-filled by
   binpack; on nodes of one GPU size binpack leaves at least as many whole
   GPUs free as gpushare's best-fit on the same sequence; on nodes of mixed
   sizes, how many GPUs gpushare's best-fit over-fills (it counts every GPU as
   large as GPU 0).

    .venv/bin/python bench/k8s.py [--restarts 20] [--calls 300]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
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
    """Allocate again, the plugin now with the API server (stand-in): each call lists the node's
    pending pods for the extender's choice; 100 running pods on the node, 5 pending ones of others."""
    from apiserver_standin import ApiServer

    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-k8s-api-"))
    api = ApiServer(tmp)
    api.add_node("bench-node", gpus=8, units=8 * 22)
    for k in range(100):
        api.add_pod(f"run{k}", [1], node="bench-node", phase="Running",
                    annotations={"ALIYUN_COM_GPU_MEM_IDX": str(k % 8), "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"})
    for k in range(5):
        api.add_pod(f"wait{k}", [7], node="bench-node", annotations={
            "ALIYUN_COM_GPU_MEM_IDX": "3", "ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1"})
    plugins = tmp / "device-plugins"
    plugins.mkdir()
    kubelet, proc = start_plugin(socket, plugins, dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig),
                                                       NODE_NAME="bench-node"))
    try:
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            kubelet.allocate(ids)
            times.append(time.perf_counter() - t)
        print(f"Allocate with the API server, 100 pods on the node ({calls}): p50 {ms(pct(times, 50))}  "
              f"p99 {ms(pct(times, 99))} ({pct(times, 99) / reference:.1f}x GetDevicePluginOptions; goal p99 <= 10 ms)")
    finally:
        proc.terminate()
        proc.wait(10)
        kubelet.stop()
        api.close()


def extender_figures(calls: int) -> None:
    from apiserver_standin import ApiServer
    from cgpud.k8s import extender
    from cgpud.k8s.api import connect

    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-ext-"))
    api = ApiServer(tmp)
    rng = random.Random(3)
    names = []
    for n in range(100):
        name = f"node-{n:03d}"
        names.append(name)
        api.add_node(name, gpus=8, units=8 * 22, per_device=",".join(["22"] * 8))
        for k in range(4):
            api.add_pod(f"p{n}-{k}", [rng.randint(1, 8)], node=name, phase="Running",
                        annotations={"ALIYUN_COM_GPU_MEM_IDX": str(rng.randrange(8))})
    os.environ["KUBECONFIG"] = os.fspath(api.kubeconfig)
    state = extender.State(*connect())
    server = extender.make_server(state, "127.0.0.1", 0)
    stop = threading.Event()
    threading.Thread(target=state.keep_fresh, args=(stop,), daemon=True).start()  # as cgpu scheduler-extender
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/gpushare-scheduler/filter"
    asks = api.add_pod("asks", [12])
    none = api.add_pod("none", [0])

    def once(pod) -> float:
        body = json.dumps({"Pod": pod, "NodeNames": names}).encode()
        t = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=10) as r:
            json.loads(r.read())
        return time.perf_counter() - t

    once(asks), once(none)
    real, empty = [], []
    for _ in range(calls):
        real.append(once(asks))
        empty.append(once(none))
    print(f"extender filter, 100 nodes x 8 GPUs, 400 pods ({calls}; the cluster read at most once a second): "
          f"p50 {ms(pct(real, 50))}  p99 {ms(pct(real, 99))}; a pod asking nothing p50 {ms(pct(empty, 50))} "
          f"(goal p99 <= 20 ms)")
    stop.set()
    server.shutdown()
    api.close()


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
    args = ap.parse_args()
    plugin_figures(args.restarts, args.calls)
    extender_figures(args.calls)
    placement_figures(args.sequences)


if __name__ == "__main__":
    main()
