"""bench/resnet_shape: `make gpu-check`'s ResNet-50 rows on the stand-in card (native/stubs/cuda_exec.c),
for whatever library and daemon are in the tree (or older ones: --libcgpu, --cgpud-src), each figure
against the same job in the same run.

A ResNet-50 step is not the deep-queue job's uniform kernels: it is hundreds of launches of very
mixed lengths, each after the framework's host work, then host work of the step's own and a
synchronize (tests/queue_client.py, `shape`). The shapes, from the H100's `make gpu-check` tables
in docs/isolation.md (the first run, main's library, alone under the gate at 99.5 % of without
cgpud; 16 CPU cores, so the host side was not contended):

- training with AMP: 750 / 2233 / 2499 img/s at batch 16 / 64 / 128 = 21.3 / 28.7 / 51.2 ms a step.
  Batches 64 and 128 are GPU-bound: the GPU time of a step is 6.2 ms + 0.352 ms an image (the two
  points' line). Batch 16 would then take 11.8 ms of GPU but took 21.3 ms: it is host-bound, and
  the host's step is ~21 ms. A step launches ~640 kernels (forward ~220 with autocast's casts,
  backward ~400, SGD's and GradScaler's multi-tensor kernels ~20), so: 640 launches 32 µs of host
  apart (PyTorch's dispatch, autograd's and the driver's launch: 20.5 ms), 0.5 ms of host work at
  the step's end (zero_grad, scaler.update, the loop), then a synchronize. Kernel i lasts
  3 µs + (6.7 µs + 0.55 µs × batch) × m_i, m_i a fixed exponential mix of mean 1 cut at 8 (so a
  mean of 9.7 µs + 0.55 µs an image: tens of µs to ~0.6 ms at batch 128).
- inference in fp16: 226 / 1813 / 7866 img/s at batch 1 / 8 / 64 = 4.42 / 4.41 / 8.14 ms a step.
  Batches 1 and 8 take the same time: host-bound (launch-bound), ~4.4 ms of host a step; batch 64
  is GPU-bound. A step launches ~175 kernels (53 convolutions, 53 batch norms, 49 ReLUs, 16 adds,
  the pools and the classifier; eager mode fuses nothing), so: 175 launches 24 µs apart (4.2 ms),
  0.2 ms of host at the end, then a synchronize. A kernel lasts 3 µs + (2.1 µs + 0.65 µs × batch)
  × m_i: 5.1 µs at batch 1 (a step's GPU time 0.9 ms, 0.113 ms an image more: batch 64's 8.1 ms).
  Alone, batch 1 keeps the card ~21 % busy and batch 8 ~40 %: it does not fill it.

The host's time between launches is slept, not spun (a pair and the daemon share this 2-core
machine's CPUs with other work): woken tens of µs late, the client makes the launches that fell due
at once, so a step's rate holds but its launches come in small bunches. A real host also runs
slower for a while after its thread slept at a closed gate (a core woken from a deep idle state,
its caches empty, its clock low): --host-warmup-ms W makes the host twice as slow for W ms after
a launch that waited over 1 ms (0 by default).

Rows, for each shape:
1. alone, no cgpud: steps/s and the card's busy fraction (the reference);
2. alone under the gate (`cgpu run`, `cgpud serve --compute gate`, policy 2): steps/s against 1;
3. the pair at 1:2, policy 2, started together: each one's steps/s over the window where both ran,
   weight 2's over weight 1's (goal 2.00 ± 0.04), and their sum against 2 (goal >= 97 %).
   Throughput is steps over the window (first and last TRIM left out), from each step's end.

    .venv/bin/python bench/resnet_shape.py [--seconds 6] [--shapes train16,...] [--libcgpu PATH]
                                           [--cgpud-src DIR --native DIR] [--switch WAY] [--host-warmup-ms W]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from common import daemon  # noqa: E402
from deep_queue import build_tools, busy, finish, instance, set_policy, stand_in_env  # noqa: E402

TRIM = 500_000_000
# kind: (launches a step, host µs between launches, host µs at the step's end, floor µs, µs, µs an image)
KINDS = {"train": (640, 32, 500, 3, 6.7, 0.55), "infer": (175, 24, 200, 3, 2.1, 0.65)}
SHAPES = ("train16", "train64", "train128", "infer1", "infer8", "infer64")


def client_args(shape: str, seconds: float, warm_ms: float = 0.0) -> list[str]:
    kind, b = shape.rstrip("0123456789"), int(shape.lstrip("trainfe"))
    n, host, gap, floor, fixed, per_image = KINDS[kind]
    return ["shape", f"{seconds:g}", str(n), f"{fixed + per_image * b:.2f}", str(floor), str(host), str(gap),
            "27", f"{warm_ms * 1000:g}"]


def steps(out: str) -> list[int]:
    lines = out.split()
    if not lines or lines[0] != "started":
        raise SystemExit(f"the client did not start: {out[:200]!r}")
    return [int(x) for x in lines[1:]]


def rate(ends: list[int], t0: int, t1: int) -> float:
    """Steps per second from the step ends within [t0, t1]."""
    e = [x for x in ends if t0 <= x <= t1]
    return (len(e) - 1) / ((e[-1] - e[0]) / 1e9) if len(e) > 2 else 0.0


def bare(tools: Path, tmp: Path, shape: str, seconds: float, warm_ms: float) -> tuple[float, float]:
    log = f"bare-{shape}"
    p = subprocess.run([str(tools / "queue-client"), *client_args(shape, seconds, warm_ms)], env=stand_in_env(tools, tmp, log),
                       capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise SystemExit(p.stderr)
    ends = steps(p.stdout)
    t0, t1 = ends[0] + TRIM, ends[-1] - TRIM
    return rate(ends, t0, t1), busy(tmp / log, t0, t1) / (t1 - t0)


def gated_runs(tools: Path, lib: Path, tmp: Path, shape: str, seconds: float, tag: str, weights: tuple[int, ...],
               switch: str | None, warm_ms: float) -> tuple[list[float], float]:
    """Instances at `weights` (policy 2) started together: each one's steps/s where all ran, and the card's
    busy fraction there."""
    cmd = 'exec "$Q" ' + " ".join(client_args(shape, seconds, warm_ms))
    extra = ["--libcgpu", str(lib), "--compute", "gate"] + (["--switch", switch] if switch else [])
    with daemon(extra=extra, handle=True) as d:
        set_policy(d, 2)
        names = [f"rs{tag}{shape[0]}{len(weights)}{w}" for w in weights]
        outs = finish([instance(d, tools, tmp, n, ["--weight", str(w)], cmd) for n, w in zip(names, weights)])
    ends = [steps(o) for o in outs]
    t0, t1 = max(e[0] for e in ends) + TRIM, min(e[-1] for e in ends) - TRIM
    if t1 - t0 < 1e9:
        raise SystemExit(f"{shape}: the runs did not overlap long enough")
    return [rate(e, t0, t1) for e in ends], sum(busy(tmp / n, t0, t1) for n in names) / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="each run's length")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"which of {', '.join(SHAPES)}")
    ap.add_argument("--libcgpu", help="a libcgpu.so built elsewhere (default: built here from the tree)")
    ap.add_argument("--cgpud-src", help="run the daemon and cgpu from this source tree (an older commit's)")
    ap.add_argument("--native", help="the directory of that tree's libcgpu-switch.so")
    ap.add_argument("--host-warmup-ms", type=float, default=0.0,
                    help="after a launch that waited over 1 ms, the host takes twice as long for this long")
    ap.add_argument("--switch", help="the daemon's --switch (default: its own, drain; older daemons have none)")
    a = ap.parse_args()
    shapes = [s.strip() for s in a.shapes.split(",")]
    if bad := [s for s in shapes if s not in SHAPES]:
        raise SystemExit(f"no shape {', '.join(bad)} (the shapes: {', '.join(SHAPES)})")
    if a.cgpud_src:
        os.environ["PYTHONPATH"] = os.path.abspath(a.cgpud_src)
        if a.native:
            os.environ["CGPUD_NATIVE"] = os.path.join(os.path.abspath(a.native), "libcgpu-switch.so")
    with tempfile.TemporaryDirectory(prefix="bench-resnet-") as t:
        tmp = Path(t)
        tools, lib = build_tools(tmp, a.libcgpu)
        print(f"libcgpu {lib if a.libcgpu else 'built from the tree'}; daemon from {a.cgpud_src or 'the tree'} "
              f"(--switch {a.switch or 'its default'}); {a.seconds:g} s a run; stand-in timeslice "
              f"{os.environ.get('CGPU_STUB_TIMESLICE_US', '1024')} µs, switch {os.environ.get('CGPU_STUB_SWITCH_US', '100')} µs; "
              f"host warm-up after a wait {a.host_warmup_ms:g} ms",
              flush=True)
        for shape in shapes:
            tag = uuid.uuid4().hex[:7]  # (names of 12 characters)
            run = tmp / shape
            run.mkdir()
            ref, ref_busy = bare(tools, run, shape, a.seconds, a.host_warmup_ms)
            (alone,), _ = gated_runs(tools, lib, run, shape, a.seconds, tag, (1,), a.switch, a.host_warmup_ms)
            (one, two), pair_busy = gated_runs(tools, lib, run, shape, a.seconds, tag, (1, 2), a.switch,
                                               a.host_warmup_ms)
            parts = [f"alone without cgpud {ref:.1f} steps/s (card busy {ref_busy:.2f})",
                     f"alone under the gate {alone:.1f} ({alone / ref * 100:.1f} %)",
                     f"pair 1:2 {one:.1f} : {two:.1f} = {two / one if one else 0:.2f} (goal 2.00 ± 0.04)",
                     f"sum {(one + two) / alone * 100:.1f} % of alone under the gate (goal >= 97 %), "
                     f"{(one + two) / ref * 100:.1f} % of without cgpud; card busy {pair_busy:.2f}"]
            print(f"{shape}: " + "; ".join(parts), flush=True)

if __name__ == "__main__":
    main()
