"""bench/crash: kill -9 the daemon many times under churn (issue 6, part 3).

The scenario of tests/test_crash_churn.py, for longer: tree writes (policy,
max_inst, weights, inst_ctl create/destroy), control-socket churn (register
on two GPUs / deregister), and two `cgpu run` workloads in cgroups that the
scheduler freezes and thaws; the daemon is killed with SIGKILL at a random
moment, ROUNDS times, and started again.

Printed: kills survived (the daemon came back with a consistent tree),
acknowledged writes lost (goal 0) out of how many, instances lost or
duplicated (goal 0), instances left frozen (goal 0: after each kill, once
the guard has had 5 s; and after the final clean stop), how soon the guard
thawed the workloads after a kill (p50/p99), and the restart time against a
clean first start measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import pct  # noqa: E402
from conftest import Daemon, _make_base  # noqa: E402
from test_crash import Writer, allowed_values, read_state  # noqa: E402
from test_crash_churn import (  # noqa: E402
    NAMES, SOCKET_NAME, VALUES, MIB, SocketChurn, frozen, groups_of, instance_table, start_workload,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    d = Daemon(_make_base(), "sim:2xT4")
    t = time.monotonic()
    d.start()
    first_start = time.monotonic() - t
    workloads = {}
    survived = lost = acked_total = inst_bad = left_frozen = 0
    thaw_times: list[float] = []
    restarts: list[float] = []
    try:
        d.write("default_memsize", str(256 * MIB))
        d.write("0/max_inst", "16")
        for n in NAMES:
            d.create(0, n)
        suffix = f"{os.getpid() % 1000000:06d}"
        for i in range(2):
            name = f"benchwl{i}{suffix}"[:12]
            workloads[name] = start_workload(d, name)
        groups = list(groups_of(d).values())
        state = read_state(d, VALUES)
        sock_state = "exists" if SOCKET_NAME in d.instances(0) else "absent"
        for rnd in range(args.rounds):
            w = Writer(d, random.Random(rng.random()), state["inst_ctl"] == "exists", VALUES)
            s = SocketChurn(str(d.socket), sock_state == "exists")
            w.start()
            s.start()
            time.sleep(rng.uniform(0.05, 0.4))
            was_frozen = [g for g in groups if frozen(g)]
            k = time.monotonic()
            d.kill9()
            while any(frozen(g) for g in was_frozen) and time.monotonic() - k < 5:
                time.sleep(0.001)
            if was_frozen:
                thaw_times.append(time.monotonic() - k)
            left_frozen += sum(frozen(g) for g in groups)
            w.join(10)
            s.join(10)
            t = time.monotonic()
            d.start()
            restarts.append(time.monotonic() - t)
            now = read_state(d, VALUES)
            acked_total += sum(len(v) for v in w.acked.values()) + len(s.acked)
            lost += sum(now[f] not in allowed_values(w, state, f)[1] for f in now)
            on = {g: SOCKET_NAME in d.instances(g) for g in (0, 1)}
            got = "exists" if on[0] else "absent"
            lost += got not in ({s.acked[-1] if s.acked else sock_state} | ({s.inflight} if s.inflight else set()))
            table = instance_table(d)
            inst_bad += on[0] != on[1]
            inst_bad += sum(len(set(table[g].values())) != len(table[g]) for g in (0, 1))
            inst_bad += len((set(NAMES) | set(workloads)) - set(table[0]))
            weights = sum(int(d.value(f"0/{n}/weight")) for n in d.instances(0))
            consistent = int(d.value("0/free_weight")) == int(now["0/max_inst"]) - weights >= 0
            survived += consistent and all(p.poll() is None for p in workloads.values())
            state, sock_state = now, got
        d.stop()
        left_frozen += sum(frozen(g) for g in groups)
    finally:
        for p in workloads.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workloads.values():
            p.wait(20)
        d.cleanup()
        shutil.rmtree(d.base, ignore_errors=True)
    print(f"seed {seed}: {args.rounds} kill -9 under writes, inst_ctl and socket churn, 2 workloads scheduled")
    print(f"kills survived: {survived}/{args.rounds}")
    print(f"acknowledged writes lost: {lost} of {acked_total} acknowledged (goal 0)")
    print(f"instances lost or duplicated: {inst_bad} (goal 0)")
    print(f"instances left frozen: {left_frozen} (goal 0; checked 5 s after each kill and after the final stop)")
    if thaw_times:
        print(f"guard thawed the workloads, from the SIGKILL: p50 {pct(thaw_times, 50) * 1000:.1f} ms, "
              f"p99 {pct(thaw_times, 99) * 1000:.1f} ms ({len(thaw_times)} kills with a workload frozen)")
    print(f"restart after kill -9 (dead mount cleared, state loaded, serving): p50 {pct(restarts, 50):.2f} s, "
          f"{pct(restarts, 50) / first_start:.2f}x the clean first start ({first_start:.2f} s)")


if __name__ == "__main__":
    main()
