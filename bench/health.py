"""bench/health: a GPU that fails is taken out of service (docs/gpus.md, Health).

The daemon runs with `--gpus nvml` on the tests' stand-in libnvidia-ml.so.1 (8 GPUs, through the real
pynvml: the event set, nvmlEventSetWait_v2, GPU_IS_LOST), the device plugin as its own process
serving the kubelet stand-in (tests/kubelet_standin.py: the kubelet's v1beta1 gRPC, ListAndWatch)
and publishing to the API server stand-in; the scheduler extender's filter and bind in this process.

1. Xid 79 on GPU 3 (and the GPU lost) -> the daemon's query says so, and every unit of GPU 3 is
   Unhealthy in the kubelet: p50/p99 over --trials; against the bound: the watch's period (0.5 s)
   plus the plugin's poll of the daemon (1 s).
2. Pods placed on the failed GPU after the event: --pods one-unit pods bound by the extender while
   GPU 3 is out, against --pods/10 bound the same way before (reference); the node is labelled
   spread, so that before the event GPU 3 gets its share.
3. Recovery: from the GPU answering again to every unit Healthy in the kubelet, p50, against the
   configured quiet time (--quiet).
4. The watch's cost: the daemon's CPU, health watching on against --no-health, same GPUs, interleaved.

    .venv/bin/python bench/health.py [--trials 10] [--pods 200] [--quiet 1] [--window 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import daemon, pct  # noqa: E402
from memwatch import cpu_seconds  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402

from cgpud.client import Client  # noqa: E402

GPUS, FAILED = 8, 3
A100 = 81920 << 20  # 80 units of 1 GiB each


def wait(pred, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.002)


def health(socket: str) -> list[bool]:
    with Client(socket) as c:
        return [g["health"]["healthy"] for g in c.call("query")["gpus"]]


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="cgpud-bench-health-"))
    try:
        run(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(base: Path) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--quiet", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=5.0)
    args = ap.parse_args()
    stub = NvmlStub.build(base)
    stub.gpus = [StubGpu(f"GPU-bench-{i:04d}", "NVIDIA A100-SXM4-80GB", A100) for i in range(GPUS)]
    stub.write()
    os.environ.update(stub.env())
    devs = base / "nvml-dev"
    devs.mkdir()
    for i in range(GPUS):
        (devs / f"nvidia{i}").write_text("")
    extra = ["--log-level", "warning", "--dev-dir", str(devs), "--health-quiet", str(args.quiet),
             "--health-max-failures", "1000"]

    from apiserver_standin import ApiServer
    from kubelet_standin import Kubelet

    with daemon("nvml", extra, handle=True) as d:
        api = ApiServer(base, history=50, bookmark_every=0.2)
        api.add_node("gpu-node-1", labels={"ack.node.gpu.placement": "spread"})
        plugin_dir = base / "device-plugins"
        plugin_dir.mkdir()
        kubelet = Kubelet(os.fspath(plugin_dir))
        plog = open(base / "plugin.log", "wb")
        plugin = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "cgpu"), "--socket", d.socket,
                                   "device-plugin", "--plugin-dir", os.fspath(plugin_dir), "--node-refresh", "0.2"],
                                  stdout=plog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig), NODE_NAME="gpu-node-1"))
        try:
            units = A100 >> 30
            kubelet.wait_devices(lambda ds: len(ds) == GPUS * units and set(ds.values()) == {"Healthy"}, timeout=30)
            uuid = stub.gpus[FAILED].uuid

            def failed_units(ds) -> bool:
                return all(ds.get(f"{uuid}-_-{j}") == "Unhealthy" for j in range(units))

            from cgpud.k8s import dra, draplugin

            dra_node = draplugin.Node(d.socket)  # the DRA plugin's view of the daemon, polled as it polls
            stop_dra = threading.Event()
            threading.Thread(target=dra_node.run, args=(stop_dra,), daemon=True).start()

            def tainted() -> bool:
                gpus = dra_node.gpus or []
                slices = dra.resource_slices("gpu-node-1", gpus, 1 << 30) if gpus else []
                return any(dev.get("taints") for s in slices for dev in s["spec"].get("devices", [])
                           if dev["name"] == f"gpu-{FAILED}")

            daemon_t, kubelet_t, back_t, dra_t = [], [], [], []
            for _ in range(args.trials):
                stub.xid(FAILED, 79)
                stub.gpus[FAILED].lost = True
                t0 = time.monotonic()
                stub.write()
                seen: dict[str, float] = {}
                checks = {"daemon": lambda: not health(d.socket)[FAILED],
                          "kubelet": lambda: failed_units(dict(kubelet.devices)), "dra": tainted}
                while len(seen) < len(checks):  # (all three looked at in turn: none waits behind another)
                    for key, check in checks.items():
                        if key not in seen and check():
                            seen[key] = time.monotonic() - t0
                    if time.monotonic() - t0 > 30:
                        raise SystemExit(f"timed out: only {sorted(seen)} saw the failure")
                    time.sleep(0.002)
                daemon_t.append(seen["daemon"])
                kubelet_t.append(seen["kubelet"])
                dra_t.append(seen["dra"])
                stub.gpus[FAILED].lost = False
                t1 = time.monotonic()
                stub.write()
                kubelet.wait_devices(lambda ds: set(ds.values()) == {"Healthy"}, timeout=30)
                back_t.append(time.monotonic() - t1)
            print(f"Xid 79 on GPU {FAILED} of {GPUS} -> out of service in the daemon, {args.trials} trials: "
                  f"p50 {pct(daemon_t, 50) * 1e3:.0f} ms, p99 {pct(daemon_t, 99) * 1e3:.0f} ms")
            print(f"  -> all {units} of its units Unhealthy in the kubelet (stand-in, real gRPC): "
                  f"p50 {pct(kubelet_t, 50) * 1e3:.0f} ms, p99 {pct(kubelet_t, 99) * 1e3:.0f} ms "
                  f"(bound: watch period 500 ms + the plugin's poll 1000 ms = 1500 ms)")
            print(f"  -> its device tainted in the DRA plugin's ResourceSlices (the plugin's poll of the daemon, "
                  f"in process; the API server's write not included): p50 {pct(dra_t, 50) * 1e3:.0f} ms, "
                  f"p99 {pct(dra_t, 99) * 1e3:.0f} ms (bound: 500 ms + the plugin's 1000 ms poll)")
            stop_dra.set()
            print(f"recovery (answers again -> every unit Healthy): p50 {pct(back_t, 50) * 1e3:.0f} ms, "
                  f"p99 {pct(back_t, 99) * 1e3:.0f} ms (reference: the quiet time {args.quiet * 1e3:.0f} ms; "
                  f"+ up to 500 ms watch + 1000 ms poll)")
            pods(args, api, stub, d, kubelet, failed_units)
        finally:
            plugin.terminate()
            plugin.wait(10)
            kubelet.stop()
            api.close()
            plog.close()

    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(2):
        for mode in ("on", "off"):
            with daemon("nvml", extra + ([] if mode == "on" else ["--no-health"]), handle=True) as dd:
                time.sleep(1.0)
                c0, t0 = cpu_seconds(dd.proc.pid), time.monotonic()
                time.sleep(args.window)
                cpu[mode].append((cpu_seconds(dd.proc.pid) - c0) / (time.monotonic() - t0))
    on, off = min(cpu["on"]), min(cpu["off"])
    print(f"daemon CPU on {GPUS} GPUs (stand-in NVML), best of 2 windows of {args.window:g} s: health watch on "
          f"{on * 100:.2f} % of a core, off (reference) {off * 100:.2f} %: the watch's own ~{(on - off) * 100:.2f} %")


def pods(args, api, stub, d, kubelet, failed_units) -> None:
    """Extender binds of one-unit pods before (reference) and while GPU FAILED is out."""
    from cgpud.k8s import extender
    from cgpud.k8s.api import connect

    os.environ["KUBECONFIG"] = os.fspath(api.kubeconfig)
    try:
        state = extender.State(*connect()).start()
    finally:
        del os.environ["KUBECONFIG"]
    try:
        wait(lambda: "gpu-node-1" in state.nodes and len(state.nodes["gpu-node-1"].units) == GPUS, what="the node")

        def bind_all(prefix: str, n: int) -> list[int]:
            where = []
            for k in range(n):
                name = f"{prefix}{k}"
                api.add_pod(name, [1])
                res = extender.bind(state, {"PodName": name, "PodNamespace": "default", "Node": "gpu-node-1"})
                if res.get("Error"):
                    where.append(-1)
                    continue
                where.append(int(api.pods[("default", name)]["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"]))
            return where

        # reference: a tenth of the pods before the failure, spread (the node's label) over the 8 GPUs
        ref = bind_all("ref", max(1, args.pods // 10))
        stub.xid(FAILED, 79)
        stub.gpus[FAILED].lost = True
        stub.write()
        kubelet.wait_devices(failed_units, timeout=30)
        wait(lambda: state.nodes["gpu-node-1"].unhealthy == {FAILED}, what="the extender to see it")
        after = bind_all("after", args.pods)
        print(f"pods placed on the failed GPU after the event: {after.count(FAILED)} of {len(after)} created "
              f"({after.count(-1)} refused); reference before the event: {ref.count(FAILED)} of {len(ref)} "
              f"on GPU {FAILED} (spread over GPUs {sorted(set(ref))})")
        stub.gpus[FAILED].lost = False
        stub.write()
    finally:
        state.stop()


if __name__ == "__main__":
    main()
