"""bench/extender_cpu: the scheduler extender's own CPU per pod of a burst, as kube-scheduler asks it
(issue 46), without a cluster: the API server stand-in (tests/apiserver_standin.py, in this process)
with --nodes nodes of 2 GPUs of 14 units and --pods pods asking 3, and `cgpu scheduler-extender` in a
process of its own, driven as kube-scheduler drives it: for each pod, one after another, filter and
prioritize over --candidates nodes (kube-scheduler's share at 1,000 nodes: 42 %), then its bind on
the best node, the binds in parallel (--binders connections, as kube-scheduler's binding goroutines).
The extender's CPU seconds (/proc) over the burst and AFTER seconds past it, per pod; filter and prioritize as the driver saw
them (mean, p99). --tree DIR (repeatable): the extender run from that source tree (PYTHONPATH), each
in turn, --rounds times alternating, so trees are compared in the same run on the same machine.

    .venv/bin/python bench/extender_cpu.py [--nodes 1000] [--pods 400] [--tree DIR ...] [--rounds 2]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from binpack import cpu_s  # noqa: E402
from common import pct  # noqa: E402


AFTER = 3.0  # s after the last bind's answer that still count (the extender's events are written after)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Conn:
    """One kept-alive connection to the extender (as kube-scheduler's client keeps its own)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, verb: str, body: dict) -> tuple[float, object]:
        data = json.dumps(body)
        t = time.perf_counter()
        self.conn.request("POST", f"/gpushare-scheduler/{verb}", data, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        out = json.loads(resp.read())
        took = time.perf_counter() - t
        if resp.status != 200:
            raise SystemExit(f"{verb}: HTTP {resp.status} {out}")
        return took, out


def one_tree(tree: str, nodes: int, pods: int, candidates: int, binders: int, round_: int) -> dict:
    from apiserver_standin import ApiServer

    tmp = Path(tempfile.mkdtemp(prefix="cgpud-extcpu-"))
    api = ApiServer(tmp)
    names = [f"n{i:04d}" for i in range(nodes)]
    for name in names:
        api.add_node(name, gpus=2, units=28)
    for k in range(pods):
        api.add_pod(f"p{round_}-{k:04d}", [3])
    port = free_port()
    env = dict(os.environ, PYTHONPATH=tree, KUBECONFIG=str(api.kubeconfig))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from cgpud.cli.cgpu import main; sys.exit(main())",
                             "scheduler-extender", "--addr", f"127.0.0.1:{port}"],
                            env=env, cwd=tree,  # (python -c puts its working directory first on the path)
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "extender.log", "wb"))
    try:
        deadline = time.monotonic() + 60
        while True:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                c.request("GET", "/metrics")
                if f"cgpu_extender_nodes {float(nodes)}" in c.getresponse().read().decode():
                    break
            except OSError:
                pass
            finally:
                c.close()
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the extender from {tree} did not come up: {(tmp / 'extender.log').read_text()[-2000:]}")
            time.sleep(0.2)
        cycle = Conn(port)
        local = threading.local()

        def bind(pod: dict, node: str) -> None:
            if not hasattr(local, "conn"):
                local.conn = Conn(port)
            local.conn.post("bind", {"PodName": pod["metadata"]["name"], "PodNamespace": "default",
                                     "PodUID": pod["metadata"]["uid"], "Node": node})

        took = {"filter": [], "prioritize": []}
        cpu0, t0 = cpu_s(proc.pid), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(binders) as pool:
            binds = []
            for k in range(pods):
                pod = api.pods[("default", f"p{round_}-{k:04d}")]
                start = (k * candidates) % nodes  # (kube-scheduler starts each pod's search where the last ended)
                cands = [names[(start + j) % nodes] for j in range(candidates)]
                t, res = cycle.post("filter", {"Pod": pod, "NodeNames": cands})
                took["filter"].append(t)
                t, scores = cycle.post("prioritize", {"Pod": pod, "NodeNames": res["NodeNames"]})
                took["prioritize"].append(t)
                best = max(scores, key=lambda s: s["Score"])["Host"]
                binds.append(pool.submit(bind, pod, best))
            for b in binds:
                b.result()
        wall = time.monotonic() - t0
        time.sleep(AFTER)  # (what the burst left to do after its binds answered, its events: counted too)
        used = cpu_s(proc.pid) - cpu0
        return {"cpu": used, "wall": wall, **{k: (sum(v) / len(v), pct(v, 99)) for k, v in took.items()},
                "bound": len(api.bindings), "events": len(api.events)}
    finally:
        proc.terminate()
        proc.wait(20)
        api.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=400)
    ap.add_argument("--candidates", type=int, default=420)
    ap.add_argument("--binders", type=int, default=16)
    ap.add_argument("--tree", action="append", help="a source tree to run the extender from (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    trees = args.tree or [str(HERE.parent)]
    print(f"{args.pods} pods asking 3 units, {args.nodes} nodes x 2 GPUs of 14, {args.candidates} candidates a pod "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for r in range(args.rounds):
        for tree in trees:
            got = one_tree(tree, args.nodes, args.pods, args.candidates, args.binders, r)
            print(f"  {tree}: the extender's CPU {got['cpu']:5.2f} s ({got['cpu'] / args.pods * 1e3:5.2f} ms a pod), "
                  f"burst {got['wall']:5.1f} s, filter mean {got['filter'][0] * 1e3:5.2f} ms p99 "
                  f"{got['filter'][1] * 1e3:5.1f}, prioritize mean {got['prioritize'][0] * 1e3:5.2f} ms p99 "
                  f"{got['prioritize'][1] * 1e3:5.1f}; {got['bound']} bound, {got['events']} events (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
