"""bench/mps: the stand-in's MPS (issue 37, docs/mps.md "The stand-in's MPS"), each figure against
a reference measured in the same run. Work is the card's kernel time from its log (the simulated
card's, not this machine's: the figures do not depend on the load).

1. two MPS clients at CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 25 and 50, both with N kernels of 2 ms
   queued at once: the 50 % client's kernels completed over the window both are busy, against the
   25 % client's (goal 2.00: NVIDIA's threads are a share of the SMs); reference: the same pair
   as plain processes (no control daemon), time-sliced by the card: 1.00.
2. a 25 % client alone: its kernels per second against the same job without MPS (goal 0.25);
3. a client pinned to 64 MiB: MiB it got before out-of-memory (goal 64) against the same client
   without a control daemon (its variable then means nothing: it gets all it asks, 256).

    .venv/bin/python bench/mps.py [--kernels 60]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent / "tests"))
from mps_standin import Mps, build  # noqa: E402
from queue_client import kernels  # noqa: E402


def pair(m: Mps, tmp: Path, n: int, pcts: tuple[str, str]) -> float:
    """The second process's kernels completed over the window both were busy, against the first's."""
    procs = []
    for i, pct in enumerate(pcts):
        env = {**m.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct, "CGPU_STUB_CUDA_LOG": os.fspath(tmp / f"k{i}")}
        procs.append(subprocess.Popen([os.fspath(m.libs / "mps-client"), "burst", str(n), "2000"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        if "done" not in out:
            raise SystemExit(f"bench/mps: a client failed: {out} {err}")
    a, b = kernels(tmp / "k0"), kernels(tmp / "k1")
    for f in ("k0", "k1"):
        (tmp / f).unlink()
    start, end = max(a[0][1], b[0][1]), min(a[-1][2], b[-1][2])
    na, nb = (sum(start <= e <= end for _, _, e in x) for x in (a, b))
    return nb / na


def alone(m: Mps, tmp: Path, n: int, pct: str | None) -> float:
    """Kernels per simulated second of one process."""
    env = {**m.env, "CGPU_STUB_CUDA_LOG": os.fspath(tmp / "alone")}
    if pct:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = pct
    subprocess.run([os.fspath(m.libs / "mps-client"), "burst", str(n), "2000"], env=env, check=True, timeout=600,
                   capture_output=True)
    ks = kernels(tmp / "alone")
    (tmp / "alone").unlink()
    return len(ks) / ((ks[-1][2] - ks[0][1]) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=60)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-mps-"))
    libs = build(tmp / "libs")
    plain = Mps(libs, tmp, name="plain")  # (never started: no control daemon in its pipe directory)
    ref_ratio = pair(plain, tmp, a.kernels, ("25", "50"))
    ref_rate = alone(plain, tmp, a.kernels // 2, None)
    ref_mib = 64 * sum(r == 0 for r in plain.client("alloc", "64", "64", "64", "64",
                                                    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=64M")["alloc"])
    m = Mps(libs, tmp)
    m.start()
    try:
        ratio = pair(m, tmp, a.kernels, ("25", "50"))
        rate = alone(m, tmp, a.kernels // 2, "25")
        out = m.client("alloc", *["16"] * 8, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=64M")["alloc"]
        got = 16 * sum(r == 0 for r in out)
    finally:
        m.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"MPS 25 % : 50 % throughput (50 % over 25 %):  {ratio:.2f}   (goal 2.00; plain processes, time-sliced: "
          f"{ref_ratio:.2f})")
    print(f"MPS 25 % alone, against the job without MPS:  {rate / ref_rate:.3f}   (goal 0.250; {rate:.1f} against "
          f"{ref_rate:.1f} kernels/s)")
    print(f"pinned 0=64M, MiB before out-of-memory:        {got}   (goal 64; without a control daemon: {ref_mib} of 256)")


if __name__ == "__main__":
    main()
