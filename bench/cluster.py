"""bench/cluster: the cluster tier's figures (issue 24), one run, on the real components of
tests/cluster.py (etcd, kube-apiserver, kube-scheduler, kubelet on containerd) with cgpud
serving two simulated T4s, each printed beside a reference measured in the same run.

1. Build of kube-apiserver, kube-scheduler, kubelet, kubectl and kube-controller-manager
   (scripts/k8s-build.sh): cold (empty module and build caches: with --cold, else the
   figure the first build on this machine recorded) and warm (the build cache full: every
   binary linked anew). Reference: a hello-world program built with an empty build cache.
2. Pod created (the API call) -> its container's instance in the cgpu_km tree, p50 over
   --pods pods asking aliyun.com/gpu-mem 1 (scheduler, extender, kubelet, device plugin,
   containerd, cgpu-runtime, the hook, the daemon). Reference: the same for pods without
   GPU memory and without cgpu-runtime, created -> Running as the kubelet reports it.
3. Extender filter p99 under the real kube-scheduler with --nodes nodes made through the
   API (no kubelets, as KWOK does): a timing proxy stands where the shipped configuration
   calls the extender (127.0.0.1:32766) and the extender behind it. Reference: the same
   proxy's round trip of GET /gpushare-scheduler/inspect/<node>. Also the API server's
   requests meanwhile (apiserver_request_total, by verb and resource).
4. Kubelet restart -> the device plugin registered again, p50/p99 over --restarts: from the
   new kubelet's socket appearing to its log saying it took the registration. Reference:
   kubelet started -> its socket made (the kubelet's own start).

    .venv/bin/python bench/cluster.py [--pods 20] [--nodes 1000] [--restarts 10] [--cold]
"""
from __future__ import annotations

import argparse
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
from common import cluster_tier, pct  # noqa: E402


def ms(x: float) -> str:
    return f"{x * 1e3:8.1f} ms"


def run_build(cache: Path | None, force: bool) -> float:
    env = dict(os.environ, PATH=f"{os.environ.get('PATH', '')}:/usr/local/go/bin")
    if cache is not None:
        env["CGPUD_K8S_CACHE"] = os.fspath(cache)
    if force:
        env["CGPUD_K8S_FORCE"] = "1"
    t = time.monotonic()
    p = subprocess.run(["nice", "-n", "10", ROOT / "scripts" / "k8s-build.sh"], env=env, capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"scripts/k8s-build.sh failed:\n{p.stderr}")
    return time.monotonic() - t


def go() -> str:
    return shutil.which("go") or "/usr/local/go/bin/go"


def build_figures(cold: bool) -> Path:
    from cluster import k8s_bin

    bins = k8s_bin()  # (built now if it never was)
    if cold:
        tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-k8s-cold-", dir="/var/tmp"))
        try:
            cold_s, how = run_build(tmp, False), "measured now, empty module and build caches"
        finally:
            subprocess.run(["chmod", "-R", "u+w", tmp], capture_output=True)  # (the module cache is read-only)
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        recorded = (bins.parent / "build-seconds").read_text().split() if (bins.parent / "build-seconds").exists() \
            else ["nan", "?"]
        cold_s = float(recorded[0])
        how = (f"recorded by this release's first build on this machine, {recorded[1]} build cache; --cold "
               "measures it again")
    warm_s = run_build(None, True)
    ref = Path(tempfile.mkdtemp(prefix="cgpud-bench-hello-"))
    try:
        (ref / "go.mod").write_text("module hello\n\ngo 1.26\n")
        (ref / "main.go").write_text('package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello") }\n')
        t = time.monotonic()
        subprocess.run([go(), "build", "-o", "hello", "."], cwd=ref, check=True, capture_output=True,
                       env=dict(os.environ, GOCACHE=os.fspath(ref / "gocache"), GOFLAGS="-buildvcs=false"))
        hello = time.monotonic() - t
    finally:
        shutil.rmtree(ref, ignore_errors=True)
    print(f"build, cold: {cold_s:7.0f} s ({how})")
    print(f"build, warm: {warm_s:7.1f} s (build cache full, the five binaries linked anew)")
    print(f"  reference: hello world with an empty build cache {hello:5.1f} s")
    return bins


class TimingProxy:
    """Forwards kube-scheduler's calls to the extender behind it and times each (the round trip
    through the proxy: what the scheduler waits for, less its own connection)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.times: dict[str, list[float]] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                t = time.perf_counter()
                conn = http.client.HTTPConnection(*target, timeout=60)
                conn.request(method, self.path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                proxy.times.setdefault(self.path.rsplit("/", 1)[-1] if "inspect" not in self.path else "inspect",
                                       []).append(time.perf_counter() - t)
                conn.close()
                self.send_response(resp.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                self._forward("POST")

            def do_GET(self) -> None:
                self._forward("GET")

        self.server = ThreadingHTTPServer(listen, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def new_instance(cgpud, before: set[str]) -> str | None:
    now = set(cgpud.instances(0)) | set(cgpud.instances(1))
    new = now - before
    return next(iter(new)) if new else None


def pipeline_figures(c, cgpud, pods: int) -> None:
    api = c.api()
    gpu, plain = [], []
    for i in range(pods):
        before = set(cgpud.instances(0)) | set(cgpud.instances(1))
        body = c.pod(f"bench-gpu-{i}", 1)
        t = time.monotonic()
        api.create_namespaced_pod("default", body)
        while new_instance(cgpud, before) is None:
            if time.monotonic() - t > 120:
                raise SystemExit(f"pod bench-gpu-{i}: no instance within 120 s\n{c.events(f'bench-gpu-{i}')}")
            time.sleep(0.005)
        gpu.append(time.monotonic() - t)
    for i in range(pods):
        body = c.pod(f"bench-plain-{i}", 0, runtime_class=None)
        del body["spec"]["containers"][0]["resources"]
        t = time.monotonic()
        api.create_namespaced_pod("default", body)
        while (api.read_namespaced_pod_status(f"bench-plain-{i}", "default").status.phase != "Running"):
            if time.monotonic() - t > 120:
                raise SystemExit(f"pod bench-plain-{i}: not Running within 120 s")
            time.sleep(0.005)
        plain.append(time.monotonic() - t)
    print(f"pod created -> instance in the tree ({pods} pods, gpu-mem 1): p50 {ms(pct(gpu, 50))}  "
          f"p99 {ms(pct(gpu, 99))}")
    print(f"  reference: a pod without GPU memory or cgpu-runtime, created -> Running: p50 {ms(pct(plain, 50))}")
    c.kubectl("delete", "pods", "--all", "--wait=true", "--timeout=120s", timeout=180)


def filter_figures(c, nodes: int) -> None:
    from cluster import extender_addr, free_port
    from test_cluster import delete_fake_nodes, make_fake_nodes, request_counts

    c.procs["extender"].stop()
    behind = ("127.0.0.1", free_port())
    c.start_extender(behind)
    proxy = TimingProxy(extender_addr(), behind)
    try:
        t = time.monotonic()
        make_fake_nodes(c, nodes)
        made = time.monotonic() - t
        time.sleep(2)  # the extender has read them
        before = request_counts(c.apiserver_metrics())
        t0 = time.monotonic()
        names = [f"bench-fake-{i}" for i in range(50)]
        for n in names:
            pod = c.pod(n, 3, labels={"cgpud-test/fake-pod": "true"}, tolerate_fake=True, runtime_class=None)
            pod["spec"]["nodeSelector"] = {"cgpud-test/fake": "true"}
            c.create(pod)
        api = c.api()
        for n in names:
            while not api.read_namespaced_pod(n, "default").spec.node_name:
                time.sleep(0.05)
        took = time.monotonic() - t0
        after = request_counts(c.apiserver_metrics())
        for _ in range(50):
            conn = http.client.HTTPConnection(*extender_addr(), timeout=30)
            conn.request("GET", "/gpushare-scheduler/inspect/fake-0001")
            conn.getresponse().read()
            conn.close()
        f, ref = proxy.times.get("filter", []), proxy.times.get("inspect", [])
        print(f"extender filter under kube-scheduler, {nodes} nodes made through the API in {made:.0f} s, "
              f"{len(names)} pods: p50 {ms(pct(f, 50))}  p99 {ms(pct(f, 99))} ({len(f)} filters)")
        print(f"  reference: GET inspect/<node> through the same proxy: p50 {ms(pct(ref, 50))}  "
              f"p99 {ms(pct(ref, 99))}")
        delta = {f"{v} {r}": after[(v, r)] - before.get((v, r), 0) for (v, r) in after
                 if after[(v, r)] - before.get((v, r), 0)}
        print(f"API server requests while the {len(names)} pods were scheduled ({took:.1f} s): "
              + ", ".join(f"{k} {n}" for k, n in sorted(delta.items(), key=lambda kv: -kv[1])))
    finally:
        proxy.stop()
        delete_fake_nodes(c)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def restart_figures(c, restarts: int) -> None:
    from cluster import PLUGIN_DIR

    sock = PLUGIN_DIR / "kubelet.sock"
    log = c.procs["kubelet"].log_path
    waits, starts = [], []
    for _ in range(restarts):
        old = _identity(sock)
        c.stop_kubelet()
        offset = log.stat().st_size
        started = c.start_kubelet()
        while _identity(sock) in (old, None):  # (a new socket may get the old one's inode number)
            if time.monotonic() - started > 60:
                raise SystemExit("the kubelet made no new socket within 60 s")
            time.sleep(0.002)
        made = time.monotonic()
        starts.append(made - started)
        while True:
            with open(log, "rb") as f:
                f.seek(offset)
                if b"Got registration request from device plugin" in f.read():
                    break
            if time.monotonic() - made > 30:
                raise SystemExit("the device plugin did not register within 30 s")
            time.sleep(0.005)
        waits.append(time.monotonic() - made)
        time.sleep(1)
    print(f"kubelet restart -> device plugin registered again ({restarts}): p50 {ms(pct(waits, 50))}  "
          f"p99 {ms(pct(waits, 99))}")
    print(f"  reference: kubelet started -> its socket made: p50 {ms(pct(starts, 50))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--restarts", type=int, default=10)
    ap.add_argument("--cold", action="store_true", help="measure the cold build again (long)")
    args = ap.parse_args()

    bins = build_figures(args.cold)
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    with cluster_tier("sim:2xT4", bins=bins) as (d, c):
        c.deploy()
        while c.allocatable("aliyun.com/gpu-mem") != 28:
            time.sleep(0.1)
        pipeline_figures(c, d, args.pods)
        restart_figures(c, args.restarts)
        filter_figures(c, args.nodes)


if __name__ == "__main__":
    main()
