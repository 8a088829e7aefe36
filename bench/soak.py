"""bench/soak: fuzz and load figures of issue 6 (the crash/kill rounds are in
another script).

Fuzz: the fuzzer of tests/treefuzz.py (hypothesis) against one daemon
(sim:2xT4): random bytes at random offsets to every node of the tree, random
JSON, garbage, partial and overlong lines on the control socket; after every
case the daemon is alive, answered what the model answers, holds the model's
state and the SPEC §4 invariants hold. Figure: cases tried (goal >= 100,000),
failures (goal 0).

Load: 25 instances on one simulated T4 under policy 1: 24 workloads (cgpu run
+ cgpu workload, real processes frozen and thawed through their cgroups) and
one idle instance, and C client processes (default 32, tests/loadgen.py) for
S seconds (default 60), each pausing a random 20 ms on average between ops:
read a random node, write a setting (policy 1, a prio_ratio, the idle
instance's highprio 0, default_memsize: values that keep the shares as they
are), `query` on the socket. Figures, each against a reference measured in
the same run:
- op latency p99 under load / the same ops' p99 with one client and the same
  25 instances (goal <= 3);
- unexpected errors (goal 0);
- share error under load: each workload's achieved share (cgroup CPU time over
  the window, as a fraction of what the 24 got together) against the policy's
  1/24, mean and worst in percentage points (goal: the scheduler's, <= 0.5 pp
  at 10 ms), next to the same figure measured without the clients and to the
  scheduler's own count of granted time.

    .venv/bin/python bench/soak.py                      # both, full size
    .venv/bin/python bench/soak.py --fuzz-cases 5000 --load-seconds 10
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from common import daemon, pct  # noqa: E402

from cgpud.gpus import discover  # noqa: E402


# ---- fuzz --------------------------------------------------------------------------------------


def fuzz(cases: int, per_example: int = 50) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from treefuzz import Fuzzer, names_pool, strategies

    gpus = "sim:2xT4"
    with daemon(gpus, handle=True) as d:
        fz = Fuzzer(d.mount, d.socket, os.path.join(d.base, "state", "state.json"), discover(gpus),
                    alive=lambda: d.proc.poll() is None, full_every=200)
        names = fz.names = names_pool(f"z{os.getpid() % 100000:05d}")
        examples = math.ceil(cases / per_example)
        t0 = time.monotonic()
        last = [t0]

        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(strategies(names, 2), min_size=per_example, max_size=per_example))
        def run(batch):
            fz.reset()
            for case in batch:
                fz.run(case)
            fz.check(full=True, what="the end of the example")
            if time.monotonic() - last[0] > 30:
                last[0] = time.monotonic()
                print(f"  fuzz: {fz.cases} cases, {fz.cases / (last[0] - t0):.0f}/s", flush=True)

        failure = None
        try:
            run()
        except AssertionError as exc:  # (hypothesis has printed the shrunk case)
            failure = str(exc).splitlines()[0][:300]
        log = open(os.path.join(d.base, "daemon.log")).read()
        return {"outcomes": dict(fz.outcomes.most_common()), "cases": fz.cases, "accepted": fz.accepted, "refused": fz.refused, "seconds": time.monotonic() - t0,
                "failure": failure, "tracebacks": log.count("Traceback"), "alive": d.proc.poll() is None}


# ---- load --------------------------------------------------------------------------------------


def cpu_shares(names: list[str], seconds: float, during=None) -> list[float]:
    """Each workload's CPU time over a window, divided by the window (bench/shares's measure)."""
    from shares import usage_us

    u0 = {n: usage_us(n) for n in names}
    t0 = time.monotonic()
    result = during(seconds) if during is not None else time.sleep(seconds)
    wall = time.monotonic() - t0
    return [(usage_us(n) - u0[n]) / 1e6 / wall for n in names], result


def share_error(shares: list[float], target: float) -> tuple[float, float]:
    """Mean and worst |share − target| in percentage points, with each share
    taken as its fraction of what all of them got (so that CPU time the
    clients took from whichever workload ran, equally for all, is not
    counted as the scheduler's error)."""
    total = sum(shares) or 1.0
    errs = [abs(s / total * len(shares) * target - target) * 100 for s in shares]
    return sum(errs) / len(errs), max(errs)


def load(clients: int, seconds: float, instances: int, interval: float) -> dict:
    from loadgen import run_clients
    from shares import start_workloads, wait_present

    from cgpud.client import Client

    with daemon("sim:T4", handle=True) as d:
        for rel, value in (("0/max_inst", str(max(16, instances))), ("0/policy", "1")):
            fd = os.open(os.path.join(d.mount, rel), os.O_WRONLY)
            os.write(fd, value.encode())
            os.close(fd)
        # instances - 1 workloads and one idle instance: `instances` in all
        runs = start_workloads(d, 1, [1] * (instances - 1), seconds * 3 + 120, f"s{os.getpid() % 10000:04d}")
        names = [n for n, _ in runs]
        idle = f"i{os.getpid() % 10000:04d}".ljust(12, "i")  # never active: the clients write its highprio
        with Client(d.socket) as c:
            c.call("register", name=idle, gpus=[0], memsize=64 << 20)
        try:
            wait_present(d, names, timeout=180)  # (24 Python start-ups on a busy machine)
            time.sleep(2)  # every workload has opened its GPU
            window = seconds  # the same length for all three: the share error shrinks with the window
            quiet, _ = cpu_shares(names, window)
            _, ref = cpu_shares(names, window, lambda s: run_clients(d.mount, d.socket, names, idle, 1, s, interval))
            with Client(d.socket) as c:
                before = {i["name"]: i["granted_seconds"] for i in [c.call("stats")[0]["instances"][n] | {"name": n}
                                                                       for n in names]}
            loaded, busy = cpu_shares(names, seconds,
                                      lambda s: run_clients(d.mount, d.socket, names, idle, clients, s, interval))
            with Client(d.socket) as c:
                st = c.call("stats")[0]["instances"]
                q = c.call("query")
            granted = [st[n]["granted_seconds"] - before[n] for n in names]
        finally:
            for _, p in runs:
                p.terminate()
            for _, p in runs:
                try:
                    p.wait(20)
                except Exception:  # noqa: BLE001
                    p.kill()
        log = open(os.path.join(d.base, "daemon.log")).read()
    from treefuzz import invariants

    target = 1 / len(names)  # policy 1: the active ones share equally
    return {"clients": clients, "seconds": seconds, "instances": instances, "interval": interval,
            "ops": busy.ops, "ops_per_s": busy.ops / seconds, "ref_ops": ref.ops,
            "unexpected": (busy.unexpected + ref.unexpected)[:5],
            "unexpected_count": len(busy.unexpected) + len(ref.unexpected),
            "idle_p99": pct(ref.all(), 99), "load_p99": pct(busy.all(), 99),
            "idle_p50": pct(ref.all(), 50), "load_p50": pct(busy.all(), 50),
            "by_kind": {k: (pct(busy.lat[k], 99), pct(ref.lat[k], 99)) for k in busy.lat if busy.lat[k] and ref.lat[k]},
            "share_err_quiet": share_error(quiet, target), "share_err_load": share_error(loaded, target),
            "share_err_granted": share_error(granted, target), "raw_load_mean": sum(loaded) / len(loaded),
            "raw_quiet_mean": sum(quiet) / len(quiet),
            "invariants": invariants(q), "tracebacks": log.count("Traceback")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuzz-cases", type=int, default=100_000)
    ap.add_argument("--load-seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--instances", type=int, default=25)
    ap.add_argument("--interval", type=float, default=0.02, help="each client's mean pause between ops (s)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object too")
    args = ap.parse_args()
    out = {}
    if args.load_seconds > 0:
        r = out["load"] = load(args.clients, args.load_seconds, args.instances, args.interval)
        ratio = r["load_p99"] / r["idle_p99"]
        print(f"load: {r['clients']} client processes for {r['seconds']:.0f} s (a mean pause of "
              f"{r['interval'] * 1e3:.0f} ms between ops), {r['instances']} instances under policy 1: "
              f"{r['ops']} ops ({r['ops_per_s']:.0f}/s); reference: 1 client, {r['ref_ops']} ops")
        print(f"  unexpected errors          {r['unexpected_count']}   (goal 0) {r['unexpected']}")
        print(f"  op latency p99 load/idle   {ratio:5.2f}  ({r['load_p99'] * 1e3:.2f} ms vs {r['idle_p99'] * 1e3:.2f} ms "
              f"with 1 client; p50 {r['load_p50'] * 1e3:.2f} vs {r['idle_p50'] * 1e3:.2f} ms)  (goal <= 3)")
        for k, (lp, ip) in r["by_kind"].items():
            print(f"    {k:6s} p99 load/idle      {lp / ip:5.2f}  ({lp * 1e3:.2f} vs {ip * 1e3:.2f} ms)")
        q, lo, gr = r["share_err_quiet"], r["share_err_load"], r["share_err_granted"]
        print(f"  share error under load     mean {lo[0]:.2f} pp, worst {lo[1]:.2f} pp of 1/{r['instances'] - 1}  "
              f"(without clients: mean {q[0]:.2f}, worst {q[1]:.2f}; goal <= 0.5 pp)")
        print(f"    by the scheduler's count mean {gr[0]:.2f} pp, worst {gr[1]:.2f} pp; raw CPU time per workload "
              f"{r['raw_load_mean'] * 100:.2f} % of a core ({r['raw_quiet_mean'] * 100:.2f} % without clients)")
        print(f"  invariants after the load  {r['invariants'] or 'hold'}")
        print(f"  daemon tracebacks          {r['tracebacks']}")
    if args.fuzz_cases > 0:
        r = out["fuzz"] = fuzz(args.fuzz_cases)
        print(f"fuzz: {r['cases']} cases tried in {r['seconds']:.0f} s ({r['accepted']} accepted, {r['refused']} refused) "
              f"(goal >= 100,000)")
        print(f"  failures                   {0 if r['failure'] is None else 1}  {r['failure'] or ''}  (goal 0)")
        print(f"  daemon alive / tracebacks  {r['alive']} / {r['tracebacks']}")
        print("  answers                    " + ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()))
    if args.json:
        print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
