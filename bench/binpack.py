"""bench/binpack: GPU pods across nodes (issue 46), one run, on the cluster tier's real control plane
(tests/cluster.py: etcd, kube-apiserver, kube-scheduler with the shipped configuration) and `cgpu
scheduler-extender` (its own process, its own account) where that configuration calls it, timed by
itself (its GET /metrics: cgpu_extender_request_seconds, from a request read to its answer written).
Nodes are made through the API as KWOK makes them (no kubelets; tests/test_cluster.py's fake nodes),
each GPU 14 units (a T4).

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
   Where each burst's pods waited: kube-scheduler's attempts by result and its extension points' means,
   the extender's answers by verb and status, the API server's mean per write (etcd's and APF's part),
   the CPU seconds each component used. Each burst's pods are created by CREATORS threads and watched.
   Then (--dra 1) the same burst through claims on the same nodes: each given the ResourceSlices `cgpu
   dra-plugin` writes (2 GPUs of 14 GiB), pods with a ResourceClaimTemplate of 3 GiB (the resourceclaim
   controller makes their claims, kube-scheduler's DRA plugin allocates): GPUs touched and the rate
   against a plain burst just before.
2. --big (5,000) nodes x 8 GPUs (made anew): the same bursts and figures; then filter and prioritize
   asked directly, with all the nodes as candidates, --calls times each (the extender's informers fed
   the nodes through the real API server; kube-scheduler itself asks for 500 of them at this size,
   its percentageOfNodesToScore): p50/p99 against the empty filter (a pod asking nothing, the same
   nodes, the same transport). The extender's resident memory against itself before the nodes.

    .venv/bin/python bench/binpack.py [--nodes 1000] [--pods 400] [--big 5000] [--calls 100] [--dra 1]
                                      [--no-before] [--logs DIR] [--profile DIR]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import pct  # noqa: E402

from cgpud.k8s import view  # noqa: E402

UNITS = 14
CREATORS = 32  # threads creating a burst's pods: "at once" (8 made creating them most of a burst's time)
FAKE = "cgpud-test/fake-pod"


def ms(x: float) -> str:
    return f"{x * 1e3:7.1f} ms"


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(buckets: dict[float, float], q: float) -> float:
    """The q-quantile of a Prometheus histogram's cumulative buckets {upper bound: count}, linear
    within its bucket (as PromQL's histogram_quantile)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if not total:
        return float("nan")
    rank, below, lower = q * total, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-9)
        below, lower = buckets[le], le
    return lower


def counters(text: str, name: str, **match: str) -> dict[str, float]:
    """The samples of one metric in Prometheus text whose labels include `match`, by their label text."""
    out = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in match.items()):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Watched:
    """The bench's pods whose names start with `prefix`, as a WATCH brings them (LIST, then its events;
    LIST and WATCH again when the API server ends the watch, as it does a watcher slower than its
    events): waiting for a burst costs the API server nothing in proportion to the burst's length,
    as reading every pod four times a second did (that LIST was most of the API server's CPU in a
    long burst, and slowed the burst it measured)."""

    def __init__(self, api, prefix: str) -> None:
        self.api, self.prefix, self.pods, self.cond = api, prefix, {}, threading.Condition()
        self.problem, self.resp, self.stopped = "", None, False
        self._watch()  # (the first LIST and WATCH before the pods are created)
        threading.Thread(target=self._run, daemon=True).start()

    def _watch(self) -> None:
        listed = json.loads(self.api.list_namespaced_pod("default", label_selector=f"{FAKE}=true",
                                                         _preload_content=False).data)
        with self.cond:
            for pod in listed["items"]:
                self._seen(pod)
            self.cond.notify_all()
        self.resp = self.api.list_namespaced_pod("default", label_selector=f"{FAKE}=true", watch=True,
                                                 resource_version=listed["metadata"]["resourceVersion"],
                                                 timeout_seconds=900, _preload_content=False)

    def _seen(self, pod: dict) -> None:
        if pod["metadata"]["name"].startswith(self.prefix):
            self.pods[pod["metadata"]["name"]] = pod

    def _run(self) -> None:
        while not self.stopped:
            buf = b""
            try:
                for chunk in self.resp.stream(1 << 16):
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    with self.cond:
                        for line in filter(None, lines):
                            ev = json.loads(line)
                            if ev["type"] in ("ADDED", "MODIFIED"):
                                self._seen(ev["object"])
                        self.cond.notify_all()
                if not self.stopped:
                    self._watch()  # (ended by the API server: LIST and WATCH again)
            except Exception as exc:  # noqa: BLE001 - said by until_bound
                with self.cond:
                    self.problem = "" if self.stopped else repr(exc)
                    self.cond.notify_all()
                return

    def until_bound(self, n: int, timeout: float) -> list[dict]:
        def bound() -> int:
            return sum(bool(p["spec"].get("nodeName")) for p in self.pods.values())

        with self.cond:
            if not self.cond.wait_for(lambda: bound() >= n or self.problem, timeout) or bound() < n:
                raise SystemExit(f"{self.prefix}*: {bound()} of {n} bound ({self.problem or f'in {timeout:.0f} s'})")
            return list(self.pods.values())

    def stop(self) -> None:
        self.stopped = True
        try:
            self.resp.shutdown()  # (the reading thread's read ends; its connection is not reused)
        except RuntimeError:  # (already ended)
            pass


class Run:
    def __init__(self, c, addr: tuple[str, int]) -> None:
        self.c, self.api, self.addr = c, c.api(), addr
        # a burst's pods are created by CREATORS threads at once, each on a connection of its own
        self.api.api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = CREATORS
        self.seen: tuple[str, str, str, dict] = ("", "", "", {})
        self.calls = ""  # the extender's /metrics after the last burst
        self.profile: tuple[str, str] | None = None  # (py-spy, directory): each burst's extender sampled

    def cpu(self) -> dict[str, float]:
        got = {name: cpu_s(p.proc.pid) for name, p in self.c.procs.items()
               if name in ("etcd", "kube-apiserver", "kube-scheduler", "extender") and p.alive()}
        return {**got, "bench": sum(os.times()[:2])}

    def get(self, path: str, body=None) -> tuple[float, bytes]:
        conn = http.client.HTTPConnection(*self.addr, timeout=120)
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
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
                if ln.startswith("cgpu_extender") and not ln.startswith(("cgpu_extender_request", "# "))}

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

    def burst(self, prefix: str, n: int, units: int, spread: bool = False, make=None) -> tuple[float, list[dict]]:
        """n pods created at once (CREATORS threads); seconds from the first create to the last bound. `make`:
        what makes each pod's body from its name (else a pod asking `units`)."""
        bodies = [make(f"{prefix}-{i:04d}") if make else self.pod(f"{prefix}-{i:04d}", units, spread=spread)
                  for i in range(n)]
        self.seen = (self.c.scheduler_metrics(), self.c.apiserver_metrics(), self.get("/metrics")[1].decode(),
                     self.cpu())
        watched = Watched(self.api, prefix + "-")
        spy = self.spy(prefix)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CREATORS) as pool:
            list(pool.map(lambda b: self.api.create_namespaced_pod("default", b, _preload_content=False)
                          .drain_conn(), bodies))
        self.created = time.monotonic() - t0
        try:
            items = watched.until_bound(n, 600)
        finally:
            watched.stop()
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # (py-spy writes its samples and ends)
                spy.wait(60)
        took = time.monotonic() - t0
        self.calls = self.get("/metrics")[1].decode()
        if self.profile is not None:  # (kube-scheduler's metrics after the burst, whole)
            Path(self.profile[1], f"{prefix}.kube-scheduler.metrics").write_text(self.c.scheduler_metrics())
        self.used = {k: v - self.seen[3].get(k, 0.0) for k, v in self.cpu().items()}
        return took, items

    def spy(self, prefix: str):
        """py-spy sampling the extender (the thread holding the GIL, each sample's thread named) through
        the burst, its samples in collapsed stacks (--profile; bench/spyshare.py reads them); and
        kube-scheduler's own CPU profile."""
        if self.profile is None:
            return None
        import subprocess

        py_spy, out = self.profile
        threading.Thread(target=self.sched_profile, args=(os.path.join(out, f"{prefix}.kube-scheduler.pprof"),),
                         daemon=True).start()
        return subprocess.Popen([py_spy, "record", "--pid", str(self.c.procs["extender"].proc.pid), "--rate", "200",
                                 "--gil", "--threads", "--nonblocking", "--format", "raw",
                                 "-o", os.path.join(out, f"{prefix}.txt")],
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(out, f"{prefix}.log"), "wb"))

    def sched_profile(self, path: str, seconds: int = 6) -> None:
        """kube-scheduler's CPU profile for the first `seconds` of a burst (its /debug/pprof, asked as the
        cluster's administrator; `go tool pprof -top` reads it)."""
        import ssl
        import urllib.request

        req = urllib.request.Request(f"https://127.0.0.1:{self.c.scheduler_port}/debug/pprof/profile?seconds={seconds}",
                                     headers={"Authorization": f"Bearer {self.c.tokens['admin']}"})
        try:
            with urllib.request.urlopen(req, context=ssl._create_unverified_context(), timeout=seconds + 30) as r:
                Path(path).write_bytes(r.read())
        except OSError as exc:
            Path(path + ".error").write_text(f"{exc}\n")

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
        time.sleep(view.NOMINATED_SECONDS + 1)  # (prioritize's nominations of the last burst end)

    def waits(self) -> str:
        """Where the last burst's pods waited: kube-scheduler's attempts by result and their mean
        time, the extender's answers by status, the API server's conflicts on Nodes."""
        sched, api = self.c.scheduler_metrics(), self.c.apiserver_metrics()
        attempts = delta(counters(sched, "scheduler_schedule_attempts_total"),
                         counters(self.seen[0], "scheduler_schedule_attempts_total"))
        def mean(name: str, **match: str) -> float:
            s_, n_ = (sum(delta(counters(sched, f"{name}_{k}", **match), counters(self.seen[0], f"{name}_{k}", **match))
                          .values()) for k in ("sum", "count"))
            return s_ / max(n_, 1)

        took = [mean("scheduler_scheduling_attempt_duration_seconds"), 1]
        cycle = ", ".join(f"{point} {ms(mean('scheduler_framework_extension_point_duration_seconds', extension_point=point))}"
                          for point in ("PreFilter", "Filter", "PreScore", "Score", "Reserve", "Permit"))
        # the serial part of a pod's scheduling (plugins' filters and scores and the extender's answers)
        cycle += f"; algorithm {ms(mean('scheduler_scheduling_algorithm_duration_seconds')).strip()} a pod"
        conflicts = sum(delta(counters(api, "apiserver_request_total", resource="nodes", verb="PATCH", code="409"),
                              counters(self.seen[1], "apiserver_request_total", resource="nodes", verb="PATCH",
                                       code="409")).values())
        def api_mean(verb: str, resource: str) -> str:
            s_, n_ = (sum(delta(counters(api, f"apiserver_request_duration_seconds_{k}", verb=verb, resource=resource),
                                counters(self.seen[1], f"apiserver_request_duration_seconds_{k}", verb=verb,
                                         resource=resource)).values()) for k in ("sum", "count"))
            return f"{verb} {resource} {ms(s_ / n_).strip()} ({n_:.0f})" if n_ else f"{verb} {resource}: none"

        writes = ", ".join(api_mean(v, r) for v, r in (("POST", "pods"), ("PATCH", "nodes"), ("POST", "bindings"),
                                                       ("POST", "events")))
        def sum_mean(name: str, **match: str) -> str:
            s_, n_ = (sum(delta(counters(api, f"{name}_{k}", **match), counters(self.seen[1], f"{name}_{k}", **match))
                          .values()) for k in ("sum", "count"))
            return f"{ms(s_ / n_).strip()} ({n_:.0f})" if n_ else "none"

        inside = (f"etcd create {sum_mean('etcd_request_duration_seconds', operation='create')}, etcd update "
                  f"{sum_mean('etcd_request_duration_seconds', operation='update')}, APF wait "
                  f"{sum_mean('apiserver_flowcontrol_request_wait_duration_seconds', execute='true')}, admission "
                  f"{sum_mean('apiserver_admission_step_admission_duration_seconds', operation='CREATE')}")
        results = ", ".join(f"{k.split('result=')[1].split(chr(34))[1]} {v:.0f}" for k, v in attempts.items())
        answers = delta(counters(self.calls, "cgpu_extender_requests_total"),
                        counters(self.seen[2], "cgpu_extender_requests_total"))
        answers_text = ", ".join(f"{k.split('verb=')[1].split(chr(34))[1]} {k.split('code=')[1].split(chr(34))[1]}: "
                                 f"{v:.0f}" for k, v in sorted(answers.items()))
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.used.items(), key=lambda kv: -kv[1]))
        return (f"kube-scheduler attempts: {results or 'none'} (mean from the pod's pop to its bind "
                f"{ms(took[0] / max(took[1], 1))}); extender answers: {answers_text or 'none'}; Node PATCH "
                f"conflicts (409): {conflicts:.0f}\n  the pods created in {self.created:.1f} s; kube-scheduler's "
                f"means: {cycle}"
                f"\n  the API server's mean per write: {writes}; within it: {inside}"
                f"\n  CPU seconds in the burst: {cpu}")

    def lat(self, verb: str) -> str:
        """The extender's own time for `verb` in the last burst (its histogram: from the request read to the
        answer written), p50 and p99 as PromQL's histogram_quantile would say, and the share over 50 ms."""
        def buckets(text: str) -> dict[float, float]:
            got = counters(text, "cgpu_extender_request_seconds_bucket", verb=verb)
            return {float(k.split('le="')[1].split('"')[0]): v for k, v in got.items()}

        after, before = buckets(self.calls), buckets(self.seen[2])
        now = {le: after[le] - before.get(le, 0.0) for le in after}
        n = now.get(float("inf"), 0)
        if not n:
            return f"{verb}: not asked"
        over = n - now.get(0.05, 0)
        total = sum(counters(self.calls, "cgpu_extender_request_seconds_sum", verb=verb).values()) - sum(
            counters(self.seen[2], "cgpu_extender_request_seconds_sum", verb=verb).values())
        return (f"{verb} p50 {ms(quantile(now, 0.5))} p99 {ms(quantile(now, 0.99))} mean {ms(total / n).strip()} "
                f"({n:.0f}, {over / n:.1%} over 50 ms)")


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

    def reference(tag: str) -> float:
        plain_s, _ = run.burst(f"plain{gpus}{tag}", pods, 0)
        print(f"reference: {pods} pods asking no GPU: all bound in {plain_s:5.1f} s ({pods / plain_s:5.1f} pods/s; "
              f"load average {os.getloadavg()[0]:.1f})")
        print(f"  {run.waits()}")
        run.clear()
        return plain_s

    first = reference("")
    need = math.ceil(pods / (UNITS // 3))
    ways = [("binpack (default)", False), ("spread (pod annotation)", True)]
    if before:
        ways.append(("before issue 46 (kube-scheduler's own scoring: the extender asked filter and bind only)", None))
    for k, (how, spread) in enumerate(ways):
        # (the machine's other load changes within a run: each burst against a plain one just before it too)
        plain_s = reference("abc"[k]) if k else first
        if spread is None:
            scheduler(run.c, prioritize=False)
        took, items = run.burst(f"{'s' if spread else 'b' if spread is False else 'o'}{gpus}", pods, 3,
                                spread=bool(spread))
        lat = f"{run.lat('filter')}, {run.lat('prioritize')}, {run.lat('bind')}"
        touched = {(p["spec"]["nodeName"], p["metadata"]["annotations"].get("ALIYUN_COM_GPU_MEM_IDX")) for p in items}
        on = {n for n, _ in touched}
        print(f"{how}: {pods} x 3 units bound in {took:5.1f} s ({pods / took:5.1f} pods/s, "
              f"{plain_s / took:4.2f} of the plain burst's rate just before, {first / took:4.2f} of the first's); "
              f"GPUs touched {len(touched)} on {len(on)} nodes (packing needs {need}; load average "
              f"{os.getloadavg()[0]:.1f})")
        print(f"  extender under kube-scheduler: {lat}")
        print(f"  {run.waits()}")
        m = run.metrics()
        print("  fragmentation: " + ", ".join(f"{k[len('cgpu_extender_'):]} {v:.0f}" for k, v in m.items()))
        print(f"  then a pod asking a whole GPU ({UNITS}): {run.one(f'whole-gpu-{gpus}', UNITS, 1)}")
        print(f"  then a pod asking a whole node ({gpus} x {UNITS}): "
              f"{run.one(f'whole-node-{gpus}', gpus * UNITS, gpus)}")
        run.clear()
        if spread is None:
            scheduler(run.c, prioritize=True)


CLASS = "gpu.cgpu.aliyun.com"  # deploy/kubernetes/dra/deviceclass.yaml
GIB = 1 << 30


def dra_burst(run: Run, nodes: int, gpus: int, pods: int) -> None:
    """The same burst through claims: each fake node given the ResourceSlices `cgpu dra-plugin` writes
    for its GPUs (14 GiB each, at 1 GiB), pods with a ResourceClaimTemplate of 3 GiB (the resourceclaim
    controller makes each pod's claim; kube-scheduler's DRA plugin allocates; no extender is asked).
    GPUs touched from the claims' allocations; the rate against a plain burst in the same step."""
    from kubernetes import client

    from cgpud.k8s import dra

    c, api = run.c, run.api
    resource = client.ResourceV1Api(api.api_client)
    devices = [dra.Gpu(g, f"GPU-fake-{g}", "Fake T4", UNITS * GIB) for g in range(gpus)]
    c.kubectl("apply", "-f", os.fspath(HERE.parent / "deploy" / "kubernetes" / "dra" / "deviceclass.yaml"))
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: [resource.create_resource_slice(s, _preload_content=False).drain_conn()
                                 for s in dra.resource_slices(f"fake-{i:04d}", devices, GIB)], range(nodes)))
    print(f"\n== DRA: the {nodes} nodes' ResourceSlices ({gpus} GPUs of {UNITS} GiB) made in {time.monotonic() - t:.0f} s "
          f"(load average {os.getloadavg()[0]:.1f})")
    if "kube-controller-manager" not in c.procs:
        c.start_controller_manager("resourceclaim-controller,garbage-collector-controller")
    c.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
              "metadata": {"name": "bench-3gi", "namespace": "default"},
              "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                  "deviceClassName": CLASS, "count": 1, "allocationMode": "ExactCount",
                  "capacity": {"requests": {"memory": "3Gi"}}}}]}}}})

    def claim_pod(name: str) -> dict:
        pod = run.pod(name, 0)
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "bench-3gi"}]
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        return pod

    plain_s, _ = run.burst("dplain", pods, 0)
    run.clear()
    took, items = run.burst("dra", pods, 0, make=claim_pod)
    claims = json.loads(resource.list_namespaced_resource_claim("default", _preload_content=False).data)["items"]
    touched = {(r["pool"], r["device"]) for cl in claims
               for r in (((cl.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results", [])}
    per: dict[tuple[str, str], int] = {}
    for cl in claims:
        for r in cl["status"]["allocation"]["devices"]["results"]:
            per[(r["pool"], r["device"])] = per.get((r["pool"], r["device"]), 0) + dra.quantity(
                r["consumedCapacity"]["memory"]) // GIB
    print(f"reference: {pods} pods asking no GPU, the same step: {plain_s:5.1f} s ({pods / plain_s:5.1f} pods/s)")
    print(f"claims of 3 GiB (ResourceClaimTemplate): {pods} bound in {took:5.1f} s ({pods / took:5.1f} pods/s, "
          f"{plain_s / took:4.2f} of the plain burst's rate); GPUs touched {len(touched)} on "
          f"{len({n for n, _ in touched})} nodes (packing needs {math.ceil(pods / (UNITS // 3))}); the most on a "
          f"GPU {max(per.values())} GiB of {UNITS}")
    print(f"  {run.waits()}")
    run.clear()


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
    ap.add_argument("--dra", type=int, default=1, help="the burst through claims too (0: not)")
    ap.add_argument("--logs", help="copy the components' logs into this directory at the end")
    ap.add_argument("--profile", metavar="DIR", help="sample the extender with py-spy through each burst into DIR")
    ap.add_argument("--py-spy", default="py-spy", help="py-spy's path (--profile)")
    ap.add_argument("--no-before", action="store_true", help="leave out the burst with kube-scheduler's own scoring")
    args = ap.parse_args()

    from cluster import EXTENDER_SA, NAMESPACE, Cluster, extender_addr, k8s_bin, kubeconfig
    from test_cluster import delete_fake_nodes, make_fake_nodes

    c = Cluster(None, None, k8s_bin())
    try:
        c.start_control_plane()
        c._start_scheduler()  # (the shipped configuration: the extender's filter, prioritize and bind)
        c.kubectl("apply", *c.deploy_target())
        token = c.kubectl("create", "token", EXTENDER_SA, "-n", NAMESPACE, "--duration", "6h").stdout.strip()
        c.extender_kubeconfig = kubeconfig(c.path("extender-sa.kubeconfig"), c.server, c.path("pki", "ca.crt"),
                                           {"token": token})
        c.start_extender()  # (where the shipped configuration calls it; its own timings: GET /metrics)
        pid = c.procs["extender"].proc.pid
        rss0 = rss_mb(pid)
        run = Run(c, extender_addr())
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            run.profile = (args.py_spy, args.profile)
        t = time.monotonic()
        make_fake_nodes(c, args.nodes, 2)
        print(f"{args.nodes} nodes made through the API in {time.monotonic() - t:.0f} s")
        time.sleep(2)
        bursts(run, args.nodes, 2, args.pods, before=not args.no_before)
        if args.dra:
            dra_burst(run, args.nodes, 2, args.pods)
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
        if args.logs:
            import shutil

            os.makedirs(args.logs, exist_ok=True)
            for name, proc in c.procs.items():
                shutil.copy(proc.log_path, os.path.join(args.logs, f"{name}.log"))
        try:
            delete_fake_nodes(c)
        except Exception:  # noqa: BLE001 - the cluster goes anyway
            pass
        c.cleanup()


if __name__ == "__main__":
    main()
