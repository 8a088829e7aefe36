"""bench/charge: a container that under-reports its GPU time in its usage page, with the daemon's
check of the page against NVML (cgpud/sched/gputime.py, ChargeCheck; docs/security.md, "The charge")
and without it (the reference: CGPUD_BENCH_NO_CHARGE_CHECK=1, the daemon as before), in the same run.

Each round, for each of the two daemons in turn (`cgpud serve`, stand-in card and NVML, libcgpu,
policy 2): a launcher of 1 ms kernels at weight 1 whose page counts a tenth of the wall time
(tests/test_attacks_charge.py's lie) beside an honest one at weight 2. Printed:
  - the liar's share of the card's kernel time over the last SECONDS - 3 s (goal: 1/3, its weight);
  - what the check costs: its time per window (NVML's answer and the pages' reads, from the daemon's
    log at its stop), and that over the switches the scheduler made meanwhile (stats' `switches`).

    .venv/bin/python bench/charge.py [--seconds 8] [--rounds 1]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE.parent / "tests"))
sys.path.insert(0, os.fspath(HERE.parent))

from cgpud.client import Client  # noqa: E402
from conftest import Daemon, _make_base  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402
from test_attacks_charge import _lie  # noqa: E402
from test_gate import LAUNCHER, busy, run_launcher  # noqa: E402
from test_libcgpu import build_libs  # noqa: E402


def launcher_libs(tmp: Path) -> Path:
    """libcgpu and the stand-ins built from this checkout into tmp/libs, with tests/test_gate.py's launcher."""
    libs = build_libs(tmp / "libs")
    (libs / "launcher.c").write_text(LAUNCHER)
    subprocess.run(["gcc", "-O2", "-o", os.fspath(libs / "launcher"), os.fspath(libs / "launcher.c"), "-ldl",
                    "-lpthread"], check=True)
    return libs


def end(procs: list, d: Daemon) -> None:
    """The launchers ended (their kernel logs whole), then the daemon."""
    for p in procs:
        p.terminate()
        p.communicate(timeout=30)
    if d.alive():
        d.signal_stop()
    d.cleanup()


def one(libs: Path, tmp: Path, checked: bool, seconds: float) -> dict:
    stub = NvmlStub(libs, tmp / "nvml.conf", gpus=[StubGpu(uuid="GPU-c4a2e0f1-0000-4000-8000-000000000033")],
                    cuda_state=tmp / "card")
    stub.write()
    os.environ.update(LD_LIBRARY_PATH=os.fspath(libs), CGPU_NVML_STUB=os.fspath(stub.config), CGPUD_CHARGE_NVML="1")
    os.environ.pop("CGPUD_BENCH_NO_CHARGE_CHECK", None)
    if not checked:
        os.environ["CGPUD_BENCH_NO_CHARGE_CHECK"] = "1"
    d = Daemon(_make_base(), "sim:T4", ["--libcgpu", os.fspath(libs / "libcgpu.so"), "--compute", "gate"])
    d.start()
    stop = threading.Event()
    tag = uuid.uuid4().hex[:8]
    liar, honest = f"liar{tag}", f"fair{tag}"
    procs = []
    try:
        d.write("0/policy", "2")
        procs = [run_launcher(d, libs, tmp, liar, 1, seconds + 2), run_launcher(d, libs, tmp, honest, 2, seconds + 2)]
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()
        threading.Thread(target=_lie, args=(d.base / "pages" / liar / "usage", stop), daemon=True).start()
        with Client(str(d.socket)) as c:
            s0 = c.call("stats")[0]["switches"]
        w0 = time.monotonic()
        time.sleep(3)
        t0 = time.monotonic_ns()
        time.sleep(seconds - 3)
        t1 = time.monotonic_ns()
        with Client(str(d.socket)) as c:
            switches = c.call("stats")[0]["switches"] - s0
        wall = time.monotonic() - w0
    finally:
        stop.set()
        end(procs, d)
    mine, theirs = busy(tmp / f"{liar}.kernels", t0, t1), busy(tmp / f"{honest}.kernels", t0, t1)
    log = d.log_text()
    m = re.search(r"checked (\d+) times, each ([\d.]+) ms \(median\), ([\d.]+) ms at most", log)
    return {"share": mine / max(mine + theirs, 1e-9), "caught": f"instance {liar}'s usage page under-reports" in log,
            "looks": int(m.group(1)) if m else 0, "ms": float(m.group(2)) if m else 0.0,
            "max_ms": float(m.group(3)) if m else 0.0, "switches_per_s": switches / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0, help="each daemon's run (the share over the last - 3 s)")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgpu-charge-") as t:
        tmp = Path(t)
        libs = launcher_libs(tmp)
        rows = {True: [], False: []}
        for r in range(a.rounds):
            for checked in (True, False):
                where = tmp / f"r{r}{'c' if checked else 'u'}"
                where.mkdir()
                rows[checked].append(one(libs, where, checked, a.seconds))
    print(f"{'':34} {'checked':>16} {'not checked (before)':>22}")
    for r in range(a.rounds):
        c, u = rows[True][r], rows[False][r]
        print(f"{'liar share (weight 1 of 1:2; 1/3)':34} {c['share']:>16.3f} {u['share']:>22.3f}")
        print(f"{'said in the log':34} {str(c['caught']):>16} {str(u['caught']):>22}")
        per_switch = c["ms"] * 1e3 / max(c["switches_per_s"], 1e-9)
        print(f"check: {c['looks']} windows of 1 s, {c['ms']:.3f} ms each (median), {c['max_ms']:.3f} ms at most; "
              f"{c['switches_per_s']:.0f} switches/s: {per_switch:.2f} µs per switch "
              f"(reference: {u['switches_per_s']:.0f} switches/s without)")


if __name__ == "__main__":
    main()
