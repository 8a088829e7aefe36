"""bench/nvml_view: nvidia-smi's NVML calls inside a container -> how many values depend on a
neighbour's usage (issue 23, item 3), against the same calls without libcgpu in the same run.

A container (libcgpu and its pages, memsize 4 GiB) runs two CUDA processes holding 1 GiB and
512 MiB on the stand-in card; neighbours (another container's CUDA process without libcgpu, and
processes listed by the stand-in NVML as compute, graphics and MPS processes with utilisation
samples) use the rest, and the card's sensors (power, temperature, fan, clocks, performance
state, energy, video engines) follow their load. The reader (tests/smi_view.py: nvidia-smi's default screen, its
--query-gpu and --query-compute-apps, every process list and version, the per-process samples,
then cuMemGetInfo) reads; the neighbours change their memory, their processes and their
utilisation (and the card's rates and sensors); it reads again. Each round counts the values that changed,
inside the container and outside it (the reference: there they must change). Goal: 0 inside.

    .venv/bin/python bench/nvml_view.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from smi_view import GIB, MIB, Scene  # noqa: E402


def build(d: Path) -> Path:
    r = subprocess.run(["make", "-s", "-B", "-C", str(ROOT / "native"), "stubs", "libcgpu", f"STUBS={d}", f"LIB={d}"],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"building the stand-ins and libcgpu failed:\n{r.stderr}")
    return d


def neighbours(scene: Scene, k: int) -> None:
    """Round k's neighbours: k + 2 processes, each holding and doing more than the round before."""
    pids = [scene.idle() for _ in range(k + 2)]
    stub = scene.stub
    stub.procs = {(0, pid): (k + 1) * 256 * MIB for pid in pids[::2]}
    stub.graphics = {(0, pid): (k + 1) * 64 * MIB for pid in pids[1::2]}
    stub.mps = {(0, pids[-1]): (k + 1) * 32 * MIB}
    stub.putil = {(0, pid): (10 + 7 * k, 5 + 3 * k, k, k) for pid in pids}
    stub.gpus[0].util, stub.gpus[0].memutil, stub.gpus[0].used = 10 + 17 * k, 5 + 9 * k, k * 128 * MIB
    stub.gpus[0].sensors = (30000 + 8000 * k, 40 + 8 * k, 30 + 12 * k, max(0, 8 - 2 * k), 300 + 250 * k,
                            10**9 * (k + 1), 3 * k, 2 * k)  # power, temp, fan, pstate, clock, energy, enc, dec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="changes of the neighbours' usage (default 5)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgpu-nvml-view-") as tmp:
        tmp = Path(tmp)
        scene = Scene(build(tmp / "lib"), tmp)
        try:
            a, b = scene.holder(True), scene.holder(True)
            scene.alloc(a, GIB)
            scene.alloc(b, 512 * MIB)
            scene.stub.putil = {}
            other = scene.holder(False)
            neighbours(scene, 0)
            scene.stub.putil[(0, a.pid)] = (30, 10, 0, 0)
            scene.stub.write()
            inside, outside = scene.view(True), scene.view(False)
            changed_in, changed_out, keys_out = 0, 0, set()
            for k in range(1, args.rounds + 1):
                scene.alloc(other, 2 * GIB)  # the neighbour's CUDA process: 2 GiB more each round
                neighbours(scene, k)
                scene.stub.putil[(0, a.pid)] = (30, 10, 0, 0)
                scene.stub.write()
                i2, o2 = scene.view(True), scene.view(False)
                diff_in = [key for key in inside if inside[key] != i2[key]]
                diff_out = [key for key in outside if outside[key] != o2[key]]
                changed_in += len(diff_in)
                changed_out += len(diff_out)
                keys_out |= set(diff_out)
                if diff_in:
                    print(f"round {k}: changed inside the container: {', '.join(diff_in)}")
                inside, outside = i2, o2
        finally:
            scene.close()
    n = len(inside)
    print(f"| figure (bench/nvml_view.py, {args.rounds} changes of the neighbours' usage) | with libcgpu (the container) "
          f"| without (the same calls, the whole card) | goal |")
    print("|---|---|---|---|")
    print(f"| values of the {n} nvidia-smi reads that changed with a neighbour's usage, all rounds | {changed_in} "
          f"| {changed_out} ({len(keys_out)} of the {n} values) | 0 |")
    print(f"| the container's own view: --query-gpu memory.total, memory.used, utilization.gpu | "
          f"{inside['gpu0.memory.total'] // MIB} MiB, {inside['gpu0.memory.used'] // MIB} MiB, "
          f"{inside['gpu0.utilization.gpu']} % | {outside['gpu0.memory.total'] // MIB} MiB, "
          f"{outside['gpu0.memory.used'] // MIB} MiB, {outside['gpu0.utilization.gpu']} % | |")
    print(f"| --query-compute-apps rows | {len(inside['gpu0.nvmlDeviceGetComputeRunningProcesses_v3'])} "
          f"| {len(outside['gpu0.nvmlDeviceGetComputeRunningProcesses_v3'])} | |")
    sys.exit(1 if changed_in else 0)


if __name__ == "__main__":
    main()
