"""bench/scrape: what Prometheus metrics cost, measured in one run.

1. Scrape time: a real daemon with 8 simulated GPUs x 25 instances (200
   instances, every per-instance series), scraped over HTTP again and again;
   p50/p99 against the same HTTP scrape, in this process, of prometheus_client's
   default registry (process, platform and GC collectors: what any Python
   exporter serves) -- samples interleaved so that noise falls on both alike.
   While scraped, the daemon renders each snapshot in its trio thread when it
   is built, so a scrape mostly sends ready bytes; the rendering's cost is
   measured in-process, no HTTP: a 200-instance snapshot with full scheduler
   telemetry, every instance anew and as the daemon does (instances unchanged
   since the last snapshot reuse their lines), and the
   same through our collector and prometheus_client's generate_latest, against
   generate_latest of the default registry.
2. Share error while scraped: the same daemon keeps its 200 instances
   (weight 0 on GPU 0, so they hold no slice there) while two and three
   workloads share GPU 0 under policy 2 (see bench/shares.py for how achieved
   shares are measured); once with nothing scraping, once with a real
   Prometheus scraping every second, once with a tight loop scraping back to
   back (the worst case: the HTTP thread always wants the GIL).

Goals (issue 5): scrape p99 <= 20 ms at 8 x 25; share error while
Prometheus scrapes every second within the scheduler's goal, <= 0.5 pp at
10 ms slices.
"""
from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import MappingProxyType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import daemon, pct  # noqa: E402
from shares import share_run, stats  # noqa: E402

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest  # noqa: E402

from cgpud.observe.exposition import MetricsServer, Renderer, registry_for, render  # noqa: E402
from cgpud.observe.metrics import Publisher  # noqa: E402
from cgpud.core.model import GpuInfo, Node  # noqa: E402
from cgpud.sched.telemetry import GpuStats, InstanceStats  # noqa: E402

GPUS, PER_GPU = 8, 25
PROMETHEUS = "/usr/bin/prometheus"


def ms(x: float) -> str:
    return f"{x * 1e3:7.2f} ms"


def scrape(port: int) -> tuple[float, int]:
    t = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    body = c.getresponse().read()
    c.close()
    return time.perf_counter() - t, len(body)


def metrics_port(base: str) -> int:
    with open(os.path.join(base, "daemon.log")) as f:
        for line in f:
            if "metrics on http://" in line:
                return int(line.rsplit(":", 1)[1].split("/")[0])
    raise SystemExit("the daemon did not log its metrics address (run with --log-level info)")


def fill(mnt: str, tag: str) -> None:
    """25 instances on each GPU; those on GPU 0 at weight 0 (they hold no slice)."""
    with open(os.path.join(mnt, "default_memsize"), "w") as f:
        f.write(str(64 << 20))
    for g in range(GPUS):
        with open(os.path.join(mnt, str(g), "max_inst"), "w") as f:
            f.write(str(PER_GPU))
    for g in range(GPUS):
        n = PER_GPU - 3 if g == 0 else PER_GPU  # room for the workloads on GPU 0
        for i in range(n):
            name = f"{tag}{g}{i:02d}".ljust(12, "x")[:12]
            with open(os.path.join(mnt, "inst_ctl"), "w") as f:
                f.write(f"{g}{name}")
            if g == 0:
                with open(os.path.join(mnt, "0", name, "weight"), "w") as f:
                    f.write("0")


def in_process(n: int) -> tuple[list[float], list[float], list[float], list[float], int]:
    """Collector + exposition of a full 8 x 25 snapshot vs the default registry, no HTTP."""
    node = Node([GpuInfo(g, f"GPU-{g:08x}-0000-0000-0000-000000000000", "Tesla T4", 15109 << 20)
                 for g in range(GPUS)])
    scheds = []
    for g in range(GPUS):
        node.gpus[g].max_inst = PER_GPU
        names = [f"inst{g}{i:02d}".ljust(12, "x") for i in range(PER_GPU)]
        for nm in names:
            node.create_instance(g, nm, memsize=64 << 20)
        insts = {nm: InstanceStats(nm, 123.4, 0.04, 0.04) for nm in names}
        st = GpuStats(gpu=g, time=1.0, started=0.0, slices=10**6, switches=10**6, freezes=1, thaws=1,
                      enforce_errors=0, lateness=tuple(i * 1e-6 for i in range(4096)), lateness_count=10**6,
                      lateness_sum=10.0, lateness_max=0.01, instances=MappingProxyType(insts), recent=())

        class S:
            pass
        s = S()
        s.gpu, s.published, s.frozen = g, st, frozenset(names[:3])
        scheds.append(s)
    pub = Publisher(node, schedulers=scheds)
    ours = registry_for(lambda: pub.current, CollectorRegistry())
    a, b, c, d = [], [], [], []
    size = len(render(pub.current))
    renderer = Renderer()
    for _ in range(n):
        pub.publish()  # a new snapshot each time, as after each 0.5 s (lateness quantiles recomputed)
        t = time.perf_counter()
        render(pub.current)  # a renderer of its own: every instance's lines made anew (the worst case)
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        renderer(pub.current)  # the daemon's: unchanged instances reuse their lines
        d.append(time.perf_counter() - t)
        t = time.perf_counter()
        generate_latest(ours)
        c.append(time.perf_counter() - t)
        t = time.perf_counter()
        generate_latest(REGISTRY)
        b.append(time.perf_counter() - t)
    return a, b, c, d, size


class Scraper:
    """Scrapes `port` in a thread: every `interval` s, or back to back (0)."""

    def __init__(self, port: int, interval: float) -> None:
        self.port, self.interval = port, interval
        self.times: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.times.append(scrape(self.port)[0])
            if self.interval:
                self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = tempfile.mkdtemp(prefix="cgpud-bench-prom-")
        cfg = os.path.join(self.base, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
                    f"  - job_name: cgpud\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
        with socket_free() as web:
            self.web = web
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={self.base}/data",
             f"--web.listen-address=127.0.0.1:{self.web}", "--log.level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)  # ready, and a few scrapes done

    def scrape_stats(self) -> str:
        import json
        import urllib.parse
        import urllib.request

        q = urllib.parse.urlencode({"query": 'scrape_duration_seconds{job="cgpud"}'})
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web}/api/v1/query?{q}", timeout=5) as r:
            res = json.load(r)["data"]["result"]
        return f"{float(res[0]['value'][1]) * 1e3:.2f} ms" if res else "?"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)


class socket_free:
    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()


def _stop(*_) -> None:
    """SIGTERM: end the running workloads' `cgpu run` first (they deregister
    while the daemon still runs, so their cgroups go), then the cleanups."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"run" in argv:
            os.kill(int(pid), signal.SIGTERM)
            kids.append(int(pid))
    deadline = time.monotonic() + 10
    while kids and time.monotonic() < deadline:
        kids = [k for k in kids if os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z"]
        time.sleep(0.1)
    sys.exit(143)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="scrapes per side")
    ap.add_argument("--window", type=float, default=10.0, help="share measuring window per case (s)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the three share conditions")
    ap.add_argument("--skip-shares", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _stop)

    a, b, c, d, size = in_process(min(args.n, 100))
    print(f"in process, {GPUS} GPUs x {PER_GPU} instances ({size} bytes): render p50 {ms(pct(a, 50))} "
          f"p99 {ms(pct(a, 99))} | default registry p50 {ms(pct(b, 50))} p99 {ms(pct(b, 99))} "
          f"| ratio p50 {pct(a, 50) / pct(b, 50):5.1f}x")
    print(f"  (unchanged instances reusing their lines, as in the daemon: p50 {ms(pct(d, 50))} p99 {ms(pct(d, 99))}, "
          f"ratio p50 {pct(d, 50) / pct(b, 50):5.1f}x)")
    print(f"  (the same through CgpuCollector + generate_latest: p50 {ms(pct(c, 50))} p99 {ms(pct(c, 99))})")

    ref = MetricsServer(REGISTRY)
    _, ref_port = ref.start("127.0.0.1", 0)
    with daemon(gpus=f"sim:{GPUS}xT4", extra=["--log-level", "info"], handle=True) as d:
        fill(d.mount, "s")
        port = metrics_port(d.base)
        time.sleep(1.0)  # telemetry of every GPU published
        ours, theirs, nbytes = [], [], 0
        for _ in range(args.n):
            t, nbytes = scrape(port)
            ours.append(t)
            theirs.append(scrape(ref_port)[0])
        print(f"HTTP scrape, daemon with {GPUS} x {PER_GPU} instances ({nbytes} bytes): p50 {ms(pct(ours, 50))} "
              f"p99 {ms(pct(ours, 99))} | default registry p50 {ms(pct(theirs, 50))} p99 {ms(pct(theirs, 99))} "
              f"| ratio p50 {pct(ours, 50) / pct(theirs, 50):5.1f}x  (goal p99 <= 20 ms: "
              f"{'met' if pct(ours, 99) <= 0.020 else 'missed'})")
        ref.stop()
        if args.skip_shares:
            return

        print(f"\nshare error at X = 10 ms, policy 2, {GPUS * PER_GPU - 3} other instances present, "
              f"window {args.window:g} s")
        print(f"{'scraping':<22} {'weights':<8} {'achieved (CPU)':<21} {'err pp':>6}  {'granted':<21} "
              f"{'err pp':>6}  {'cpu eff':>7}  lateness mean")
        worst: dict[str, float] = {}
        errs: dict[str, list[float]] = {}
        gerrs: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for cond in ("none", "Prometheus every 1 s", "tight loop"):
                prom = scraper = None
                if cond.startswith("Prometheus"):
                    prom = Prometheus(port)
                elif cond == "tight loop":
                    scraper = Scraper(port, 0)
                try:
                    for weights in ([1, 2], [1, 2, 3]):
                        l0 = stats(d)["lateness"]
                        conf, ach, given, eff = share_run(d, 2, weights, args.window)
                        l1 = stats(d)["lateness"]
                        err = max(abs(x - c) for x, c in zip(ach, conf)) * 100
                        gerr = max(abs(x - c) for x, c in zip(given, conf)) * 100
                        worst[cond] = max(worst.get(cond, 0.0), err)
                        errs.setdefault(cond, []).append(err)
                        gerrs.setdefault(cond, []).append(gerr)
                        # this case's boundaries only (the summary's quantiles span the last 4096)
                        lat = (l1["sum"] - l0["sum"]) / max(1, l1["count"] - l0["count"])
                        f = lambda xs: " ".join(f"{x:.4f}" for x in xs)  # noqa: E731
                        print(f"{cond:<22} {':'.join(map(str, weights)):<8} {f(ach):<21} {err:>6.2f}  "
                              f"{f(given):<21} {gerr:>6.2f}  {eff:>7.3f}  {lat * 1e3:.3f} ms")
                finally:
                    if prom is not None:
                        print(f"{'':<22} (Prometheus's own scrape_duration_seconds: {prom.scrape_stats()})")
                        prom.stop()
                    if scraper is not None:
                        scraper.stop()
                        print(f"{'':<22} ({len(scraper.times)} scrapes, p50 {ms(pct(scraper.times, 50))} "
                              f"p99 {ms(pct(scraper.times, 99))})")
        print()
        for cond, e in worst.items():
            print(f"scraping {cond:<22}: share error worst {e:.2f} pp, mean {sum(errs[cond]) / len(errs[cond]):.2f} pp "
                  f"(goal <= 0.5); granted error mean {sum(gerrs[cond]) / len(gerrs[cond]):.2f} pp")


if __name__ == "__main__":
    main()
