"""bench/memwatch: the memory watchdog on (stand-in) NVML GPUs.

The daemon runs with `--gpus nvml` on the tests' stand-in libnvidia-ml.so.1
(native/stubs/, built here by native/Makefile) through the real pynvml.

1. Reaction: an instance's process is made to pass its memsize (the stand-in's
   file rewritten); the time until the process is dead (SIGKILL), over
   --trials trials. Printed against the watchdog's period (0.5 s): the bound
   is one period plus a look, so the ratio should stay at or below ~1.
2. Cost: the daemon's CPU time over a --window with N instances (each one
   process that NVML lists, under its memsize) on `--gpus nvml`, against the
   same daemon and instances on `--gpus sim:T4` (no watchdog) measured in the
   same run, interleaved.

    .venv/bin/python bench/memwatch.py [--instances 25] [--trials 10] [--window 5]
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import daemon, pct  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402

from cgpud.client import Client  # noqa: E402

GIB = 1 << 30
PERIOD = 0.5


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Instances:
    """N instances registered with cgroup=true on one connection, each with a `sleep` inside."""

    def __init__(self, socket: str, n: int, memsize: int = GIB) -> None:
        self.memsize = memsize
        self.client = Client(socket)
        self.procs: dict[str, subprocess.Popen] = {}
        for _ in range(n):
            self.add()

    def add(self) -> tuple[str, subprocess.Popen]:
        name = "b" + secrets.token_hex(6)[:11]
        res = self.client.call("register", name=name, gpus=[0], memsize=self.memsize, cgroup=True)
        procs = os.path.join(res["target"]["path"], "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        p = subprocess.Popen(["sleep", "600"], preexec_fn=join)
        self.procs[name] = p
        return name, p

    def close(self) -> None:
        for name, p in self.procs.items():
            p.kill()
            p.wait()
            try:
                self.client.call("deregister", name=name)
            except Exception:
                pass
        self.client.close()


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="cgpud-bench-nvml-"))
    try:
        run(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(base: Path) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=25)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--window", type=float, default=5.0)
    args = ap.parse_args()
    stub = NvmlStub.build(base)
    stub.gpus = [StubGpu("GPU-bench-0000", "Tesla T4")]
    stub.write()
    os.environ.update(stub.env())
    devs = base / "nvml-dev"
    devs.mkdir()
    (devs / "nvidia0").write_text("")
    extra = ["--log-level", "warning"]

    # 1. reaction time
    with daemon("nvml", extra + ["--dev-dir", str(devs)], handle=True) as d:
        inst = Instances(d.socket, 0)
        times = []
        try:
            for _ in range(args.trials):
                name, p = inst.add()
                stub.procs = {(0, p.pid): GIB - 1}
                stub.write()
                time.sleep(PERIOD * 1.5)  # at least one look below the limit
                assert p.poll() is None, "killed below its memsize"
                stub.procs = {(0, p.pid): GIB + 1}
                t0 = time.monotonic()
                stub.write()
                p.wait(10)
                times.append(time.monotonic() - t0)
                inst.client.call("deregister", name=name)
                del inst.procs[name]
        finally:
            inst.close()
    print(f"reaction (excess -> process dead), {args.trials} trials: p50 {pct(times, 50) * 1e3:.0f} ms, "
          f"p99 {pct(times, 99) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms; "
          f"p50/period {pct(times, 50) / PERIOD:.2f}, max/period {max(times) / PERIOD:.2f}")

    # 2. daemon CPU with the watchdog (nvml) against without (sim), interleaved
    cpu: dict[str, list[float]] = {"nvml": [], "sim:T4": []}
    for _ in range(2):
        for spec in ("nvml", "sim:T4"):
            with daemon(spec, extra + (["--dev-dir", str(devs)] if spec == "nvml" else []), handle=True) as d:
                with open(os.path.join(d.mount, "0", "max_inst"), "w") as f:
                    f.write(str(max(16, args.instances)))
                inst = Instances(d.socket, args.instances, 256 << 20)
                try:
                    stub.procs = {(0, p.pid): 128 << 20 for p in inst.procs.values()}
                    stub.write()
                    time.sleep(1.0)
                    c0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
                    time.sleep(args.window)
                    cpu[spec].append((cpu_seconds(d.proc.pid) - c0) / (time.monotonic() - t0))
                finally:
                    inst.close()
    nv, sim = min(cpu["nvml"]), min(cpu["sim:T4"])
    print(f"daemon CPU with {args.instances} instances (one NVML-listed process each), best of 2 windows of "
          f"{args.window:g} s: nvml+watchdog {nv * 100:.2f} % of a core, sim (reference) {sim * 100:.2f} %; "
          f"ratio {nv / sim if sim else float('inf'):.2f}, watchdog's own ~{(nv - sim) * 100:.2f} % of a core")


if __name__ == "__main__":
    main()
