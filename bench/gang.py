"""bench/gang: a container on two GPUs running collectives beside a one-GPU instance (issue 23,
part 2), against the stand-in driver's collective (CGPU_STUB_COLLECTIVE=1: each kernel is half of
an all-reduce across cards 0 and 1 and holds its card, spinning, until its peer has started).

`cgpud serve --gpus sim:2xT4 --compute gate`, policy 2 on both GPUs, 10 ms slices. The container
on GPUs 0 and 1 (weight 1) launches 1 ms collectives from a thread per GPU (tests/test_gang.py's
COLLECTIVE); the instance on GPU 0 (weight 2) 1 ms kernels. Figures, over whole turns of GPU 0's
ring past the first and before the last 0.5 s:

- the time of each GPU spent spinning (a half started, its peer not yet), as a share of the
  collective's kernel time there (goal 0);
- GPU 0's kernel time split between the two, against policy 2's 1:2 (goal within 1 pp).

Reference in the same run: the same with CGPU_GANG=0 in the container (its gates per GPU, as
before the gang).

    .venv/bin/python bench/gang.py [--seconds S]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from gate import whole_cycles  # noqa: E402  (bench/gate.py)
from test_gang import COLLECTIVE, gang_beside_one  # noqa: E402
from test_gate import LAUNCHER  # noqa: E402

CGPUD = str(Path(sys.executable).parent / "cgpud")


class Daemon:
    """cgpud on two stand-in GPUs with libcgpu and the gate: what gang_beside_one drives."""

    def __init__(self, libs: Path, tmp: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="d", dir=tmp))
        (self.dir / "mnt").mkdir()
        self.socket = self.dir / "sock"
        self.proc = subprocess.Popen([CGPUD, "serve", "--gpus", "sim:2xT4", "--mount", str(self.dir / "mnt"),
                                      "--state-dir", str(self.dir / "state"), "--socket", str(self.socket),
                                      "--dev-dir", str(self.dir / "dev"), "--metrics-addr", "off",
                                      "--libcgpu", str(libs / "libcgpu.so"), "--compute", "gate"],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "log", "w"))
        deadline = time.monotonic() + 20
        while not (self.dir / "mnt" / "version").exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"cgpud did not start: {(self.dir / 'log').read_text()}")
            time.sleep(0.05)

    def write(self, rel: str, value: str) -> None:
        with open(self.dir / "mnt" / rel, "w") as f:
            f.write(value)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def measure(libs: Path, tmp: Path, seconds: float, gang: bool) -> tuple[float, float, float]:
    """(spin on GPU 0, spin on GPU 1, the collective's share of GPU 0's kernel time)."""
    run = tmp / ("gang" if gang else "pergpu")
    run.mkdir()
    d = Daemon(libs, run)
    try:
        r = gang_beside_one(d, libs, run, seconds, gang=gang)
    finally:
        d.stop()
    x, y = r["logs"]
    x0 = [(k[0], k[1], k[2]) for k in x if k[3] == 0]
    y0 = [(k[0], k[1], k[2]) for k in y]
    t0, t1 = whole_cycles([x0, y0], max(x0[0][1], y0[0][1]) + 500_000_000, min(x0[-1][2], y0[-1][2]) - 500_000_000)

    def inside(s: int, e: int) -> int:
        return max(0, min(e, t1) - max(s, t0))

    on = {g: sum(inside(k[1], k[2]) for k in x if k[3] == g) for g in (0, 1)}
    spin = {g: sum(inside(k[1], k[2] - k[4] * 1000) for k in x if k[3] == g) / max(on[g], 1) for g in (0, 1)}
    y_on = sum(inside(s, e) for _, s, e in y0)
    return spin[0], spin[1], on[0] / (on[0] + y_on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        libs = Path(d) / "libs"
        subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), "stubs", "libcgpu", f"STUBS={libs}",
                        f"LIB={libs}"], check=True)
        for name, src in (("collective", COLLECTIVE), ("launcher", LAUNCHER)):
            (libs / f"{name}.c").write_text(src)
            subprocess.run(["gcc", "-O2", "-o", os.fspath(libs / name), os.fspath(libs / f"{name}.c"), "-ldl",
                            "-lpthread"], check=True)
        rows = [("gang (default)", measure(libs, Path(d), a.seconds, True)),
                ("reference: gates per GPU (CGPU_GANG=0)", measure(libs, Path(d), a.seconds, False))]
    print(f"{'':40} {'spin GPU 0':>11} {'spin GPU 1':>11} {'GPU 0 split':>12} {'policy':>7} {'error':>8}")
    for name, (s0, s1, share) in rows:
        print(f"{name:40} {s0 * 100:10.2f}% {s1 * 100:10.2f}% {share:12.4f} {1 / 3:7.4f} {(share - 1 / 3) * 100:+7.2f}pp")
    s0, s1, share = rows[0][1]
    print(f"figure: the collective's time spent spinning: GPU 0 {s0 * 100:.2f} %, GPU 1 {s1 * 100:.2f} % "
          f"(reference, per GPU: {rows[1][1][0] * 100:.2f} %, {rows[1][1][1] * 100:.2f} %); GPU 0's kernel-time "
          f"split {share:.4f} against policy 2's 1/3: {(share - 1 / 3) * 100:+.2f} pp (goal within 1 pp)")


if __name__ == "__main__":
    main()
