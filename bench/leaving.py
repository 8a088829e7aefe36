"""bench/leaving: a neighbour's share of the GPU beside a tenant that forges its usage page or leaves the
library, against the same pair honest, in the same run (issue 44; docs/security.md, "Pages and leaving
the library").

Each scene is a daemon of its own (`cgpud serve`, the stand-in card and NVML, libcgpu, the compute gate,
policy 2 at weights 1:1) and two `cgpu run` instances launching 1 ms kernels: `fair` through libcgpu,
and beside it
  - `honest`: the same, through libcgpu (the reference);
  - `forger (ofd)`: through libcgpu, and a process of it forging a slot of its page: gated, draining,
    `acked` one closing behind, held by an open file description's lock (tests/test_attacks_pages.py);
  - `forger (posix)`: the same slot held by a live process's POSIX lock;
  - `outside`: LD_PRELOAD unset, no library at all (tests/test_attacks_outside.py).
Printed per scene: fair's share of the card (its kernels' time over the wall time of the last
SECONDS - 3 s; goal: within 5 pp of the honest pair's), the other's, and whether the daemon said what
it found. An attack succeeds when fair's
share is more than 5 pp below the honest pair's.

    .venv/bin/python bench/leaving.py [--seconds 10]

Run with the interpreter of another checkout's .venv (its daemon, its libcgpu-switch.so) for its
figures: /work/main/.venv/bin/python bench/leaving.py gives main's (its libcgpu is built from this
checkout: the scenes above do not use what changed in it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE.parent / "tests"))
sys.path.insert(0, os.fspath(HERE.parent))

from charge import end, launcher_libs  # noqa: E402
from conftest import Daemon, _make_base  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402
from test_attacks_outside import launcher  # noqa: E402
from test_attacks_pages import forge  # noqa: E402
from test_gate import busy  # noqa: E402

SCENES = ("honest", "forger (ofd)", "forger (posix)", "outside")
SAID = {"forger (ofd)": "is forged", "forger (posix)": "past the drain bound", "outside": "outside the library"}


def scene(libs: Path, tmp: Path, which: str, seconds: float) -> dict:
    stub = NvmlStub(libs, tmp / "nvml.conf", gpus=[StubGpu(uuid="GPU-c4a2e0f1-0000-4000-8000-000000000044")],
                    cuda_state=tmp / "card")
    stub.write()
    os.environ.update(LD_LIBRARY_PATH=os.fspath(libs), CGPU_NVML_STUB=os.fspath(stub.config), CGPUD_CHARGE_NVML="1")
    d = Daemon(_make_base(), "sim:T4", ["--libcgpu", os.fspath(libs / "libcgpu.so"), "--compute", "gate"])
    d.start()
    tag = uuid.uuid4().hex[:8]
    fair, other = f"fair{tag}", f"them{tag}"
    procs = []
    try:
        d.write("0/policy", "2")
        procs = [launcher(d, libs, tmp, fair, seconds + 2, False),
                 launcher(d, libs, tmp, other, seconds + 2, which == "outside")]
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()
        if which.startswith("forger"):
            procs.append(forge(d.base / "pages" / other, 7, which.split("(")[1].rstrip(")")))
        time.sleep(3)
        t0 = time.monotonic_ns()
        time.sleep(seconds - 3)
        t1 = time.monotonic_ns()
    finally:
        end(procs, d)
    mine, theirs = busy(tmp / f"{fair}.kernels", t0, t1), busy(tmp / f"{other}.kernels", t0, t1)
    log = d.log_text()
    # (its part of the card's time, not of the kernel time run: a closing held for seconds idles both)
    return {"share": mine / ((t1 - t0) / 1e9), "theirs": theirs / ((t1 - t0) / 1e9),
            "said": which in SAID and SAID[which] in log}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0, help="each scene's run (the share over the last - 3 s)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgpu-leaving-") as t:
        tmp = Path(t)
        libs = launcher_libs(tmp)
        rows = {}
        for which in SCENES:
            where = tmp / which.replace(" ", "").replace("(", "-").replace(")", "")
            where.mkdir()
            rows[which] = scene(libs, where, which, a.seconds)
    ref = rows["honest"]["share"]
    print(f"daemon: {sys.executable}")
    print(f"{'fair beside':16} {'its share (1:1)':>16} {'vs honest':>10} {'the other':>10} {'said':>6} {'attack':>10}")
    tried = succeeded = 0
    for which in SCENES:
        r = rows[which]
        gap = (r["share"] - ref) * 100
        verdict = "-" if which == "honest" else ("SUCCEEDED" if gap < -5 else "held")
        if which != "honest":
            tried += 1
            succeeded += verdict == "SUCCEEDED"
        said = str(r["said"]) if which in SAID else "-"
        print(f"{which:16} {r['share']:>16.3f} {gap:>+9.1f}pp {r['theirs']:>10.3f} {said:>6} {verdict:>10}")
    print(f"attacks tried {tried}, succeeded {succeeded} (a neighbour's share more than 5 pp under the honest pair's)")


if __name__ == "__main__":
    main()
