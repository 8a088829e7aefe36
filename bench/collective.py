"""bench/collective: a two-rank job (a process per GPU, as torchrun starts them) sharing both GPUs at
1:1 with a neighbour on each (issue 34, item 1), against the stand-in's collectives by group
(CGPU_STUB_COLLECTIVE=<job>: each rank's n-th kernel is half of an all-reduce with the other rank's
n-th, and holds its card, spinning and never preempted, until its peer has started).

`cgpud serve --gpus sim:2xT4 --compute gate`, policy 2 on both GPUs, 10 ms slices. The job (weight 1,
GPUs 0 and 1) launches an all-reduce of KERNEL_US every 5 ms from each rank (tests/test_collectives.py's
rank); the neighbours (weight 1, one on each GPU) launch 1 ms kernels back to back (test_gate's launcher).
Figures, each against the same job alone in the same run (no neighbours, the same daemon and policy):

- the longest stall a closing causes: a half's time spinning for its peer (the card held, nothing
  done), p99 and max over the job's halves (goal: at most 2 slices, 20 ms; before issue 34, up to
  the daemon's 5 s drain cap when a closing fell between the two ranks' halves);
- the job's throughput (all-reduces per second) against its weight's share: it needs a fifth of
  each GPU and is entitled to half, so its share is all it asks for: the alone run's rate (goal
  at least 97 %).

The per-launch cost of the library's bookkeeping is bench/gate.py's (row 1). --ahead: ranks that do
not wait for their all-reduces (halves queued ahead on both cards): not held yet (docs/isolation.md,
"Gangs", left).

    .venv/bin/python bench/collective.py [--seconds S] [--kernel-us US]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from gang import Daemon  # noqa: E402  (bench/gang.py)
from test_collectives import RANK, halves  # noqa: E402
from test_gate import LAUNCHER  # noqa: E402

from cgpud.client import Client  # noqa: E402

CGPU = str(Path(sys.executable).parent / "cgpu")
PERIOD_US = 5000


def run(libs: Path, tmp: Path, seconds: float, kernel_us: int, neighbours: bool, wait: bool = True) -> dict:
    """The job (and its neighbours): its halves' spins (ns) and its all-reduces per second."""
    tmp.mkdir()
    d = Daemon(libs, tmp)
    procs = []
    try:
        d.write("0/policy", "2")
        d.write("1/policy", "2")
        with Client(str(d.socket)) as c:
            devices = c.call("hello")["devices"]
        env = dict(os.environ, CGPUD_SOCKET=str(d.socket), LD_LIBRARY_PATH=os.fspath(libs),
                   CGPU_STUB_CUDA_DEVICES="2", CGPU_STUB_CUDA_STATE=os.fspath(tmp / "card"))
        count = int(seconds * 1e6 / PERIOD_US)
        rank = (f"CGPU_STUB_COLLECTIVE=job-{tmp.name} CGPU_STUB_CUDA_DEVICE={devices[0]},{devices[1]} "
                f"CGPU_STUB_CUDA_LOG={tmp}/rank$R {libs / 'rank'} $R {count} {kernel_us} {PERIOD_US} {int(wait)}")
        job = f"t0=$(date +%s.%N); for R in 0 1; do R=$R sh -c '{rank}' & done; wait; echo $t0 $(date +%s.%N)"
        runs = [("job000000001", ["--gpus", "0,1"], job)]
        if neighbours:
            runs += [(f"neighbour{g:03}", ["--gpu", str(g)],
                      f"CGPU_STUB_CUDA_DEVICE={devices[g]} CGPU_STUB_CUDA_LOG={tmp}/n{g} "
                      f"exec {libs / 'launcher'} {seconds * 1.5 + 2} 1000 0 0") for g in (0, 1)]
        for name, gpus, cmd in reversed(runs):  # (the neighbours first: the job starts beside them)
            procs.append(subprocess.Popen([CGPU, "run", "--name", name, *gpus, "--mem", "64M", "--weight", "1",
                                           "--", "sh", "-c", cmd], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        if neighbours:
            for p in procs[:2]:
                assert p.stdout.readline().strip() == "started", p.stderr.read()
        out, err = procs[-1].communicate(timeout=seconds * 4 + 60)
        assert procs[-1].returncode == 0, err
        lines = [line for line in out.split("\n") if line and line not in ("started", "done")]
        t0, t1 = map(float, lines[-1].split())
        for p in procs[:-1]:
            p.communicate(timeout=seconds * 4 + 60)
        with Client(str(d.socket)) as c:
            stats = c.call("stats")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        d.stop()
    hs = [h for g in (0, 1) for h in halves(tmp / f"rank{g}")]
    assert len(hs) == 2 * count, (len(hs), count)
    spins = sorted(h[2] - h[1] - h[4] * 1000 for h in hs)
    return {"spins": spins, "rate": count / (t1 - t0), "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--kernel-us", type=int, default=1000)
    ap.add_argument("--ahead", action="store_true",
                    help="the ranks do not wait for their all-reduces: their halves queue ahead (not yet held)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        libs = Path(d) / "libs"
        subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), "stubs", "libcgpu", f"STUBS={libs}",
                        f"LIB={libs}"], check=True)
        for name, src in (("rank", RANK), ("launcher", LAUNCHER)):
            (libs / f"{name}.c").write_text(src)
            subprocess.run(["gcc", "-O2", "-o", os.fspath(libs / name), os.fspath(libs / f"{name}.c"), "-ldl",
                            "-lpthread"], check=True)
        alone = run(libs, Path(d) / "alone", a.seconds, a.kernel_us, False, not a.ahead)
        shared = run(libs, Path(d) / "shared", a.seconds, a.kernel_us, True, not a.ahead)

    def p99(xs: list[int]) -> float:
        return xs[int(0.99 * (len(xs) - 1))] / 1e6

    print(f"{'':36} {'spin p99 ms':>12} {'spin max ms':>12} {'all-reduces/s':>14}")
    for name, r in (("the job alone (reference)", alone), ("the job beside a neighbour per GPU", shared)):
        print(f"{name:36} {p99(r['spins']):12.2f} {r['spins'][-1] / 1e6:12.2f} {r['rate']:14.1f}")
    ratio = shared["rate"] / alone["rate"]
    print(f"figure: the longest stall a closing causes, a half spinning for its peer: p99 {p99(shared['spins']):.2f} ms, "
          f"max {shared['spins'][-1] / 1e6:.2f} ms (alone: {p99(alone['spins']):.2f}, {alone['spins'][-1] / 1e6:.2f} ms; "
          f"goal at most 2 slices, 20 ms)")
    print(f"figure: the job's throughput beside its neighbours {shared['rate']:.1f}/s against its share, the alone "
          f"run's {alone['rate']:.1f}/s: {ratio * 100:.1f} % (goal at least 97 %)")
    print(f"(daemon: drains {shared['stats'][0].get('drains')}, drain_seconds {shared['stats'][0].get('drain_seconds')})")


if __name__ == "__main__":
    main()
