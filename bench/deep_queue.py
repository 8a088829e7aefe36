"""bench/deep_queue: the deep-queue figures of issue 27 on the stand-in card (native/stubs/cuda_exec.c:
launches queue deep per stream, one executor time-slices the card between processes, a switch
costs idle time), for whatever library and daemon are in the tree, each against the same job in
the same run.

The job is a PyTorch-like loop that runs ahead of the card: 8 launches of a 2.7 ms kernel (the
H100's 4096² fp32 matmul), then a synchronize, again and again (tests/queue_client.py, `loop`).
Work is the card's kernel time from its log (a kernel's time is its work: gridX µs).

1. alone, no cgpud: the job on the stand-in, nothing preloaded: the card's busy fraction.
2. alone under the gate: one `cgpu run` instance (`cgpud serve --compute gate`, policy 2): its busy
   fraction against 1 (goal >= 99 %).
3. the pair at 1:2, policy 2: weight 1's share of the kernel time while both run (goal 0.333 ± 0.02),
   and the pair's work per second against 1's (goal >= 97 %); with the daemon's `--switch drain` (the
   next gate opens once the stopped one's queue is done), `--switch ahead` (0.5 ms before the drain
   is expected to end) and `--switch overlap` (at the closing), for the long kernels and for short
   ones (64 of 50 µs, then a synchronize), each against its job alone.
4. high priority (`make gpu-check`'s row): a weight-1 instance runs 64 launches ahead, alone for a
   second; then a --highprio instance launches a 10 µs kernel every 20 ms and waits for it: launch ->
   completion, p50 and p99 (goal p99 <= 5 ms).
5. a CPU-bound instance beside a GPU-bound one, 1:2, policy 2 (small-batch inference beside
   training): weight 1 launches a 2 ms kernel, synchronizes, then does 1 ms of host work, again and
   again; weight 2 runs the job. Weight 1's share of the kernel time (goal 0.333 ± 0.02; charged the
   time its gate was open it got about a quarter), and its work against the same loop alone with no
   cgpud in the same run.

    .venv/bin/python bench/deep_queue.py [--seconds 6] [--libcgpu PATH] [--rows 1,2,3,4,5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from common import daemon  # noqa: E402
from queue_client import build, kernels  # noqa: E402

CGPU = str(Path(sys.executable).parent / "cgpu")
KERNEL_US, BATCH, TRIM = 2700, 8, 300_000_000
SHORT_US, SHORT_BATCH = 50, 64  # (short kernels: CuPy's elementwise ones)


def busy(log: Path, t0: int, t1: int) -> int:
    return sum(max(0, min(e, t1) - max(s, t0)) for _, s, e in kernels(log))


def window(logs: list[Path]) -> tuple[int, int]:
    """Where all ran, less TRIM at either end."""
    t0 = max(min(s for _, s, _ in kernels(lg)) for lg in logs) + TRIM
    t1 = min(max(e for _, _, e in kernels(lg)) for lg in logs) - TRIM
    if t1 <= t0:
        raise SystemExit(f"the runs did not overlap long enough: {[len(kernels(lg)) for lg in logs]} kernels")
    return t0, t1


def stand_in_env(tools: Path, tmp: Path, log: str) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=str(tools), CGPU_STUB_CUDA_STATE=str(tmp / "card"),
                CGPU_STUB_CUDA_LOG=str(tmp / log), Q=str(tools / "queue-client"))


def instance(d, tools: Path, tmp: Path, name: str, args: list[str], cmd: str) -> subprocess.Popen:
    env = dict(stand_in_env(tools, tmp, name), CGPUD_SOCKET=d.socket)
    return subprocess.Popen([CGPU, "run", "--name", name, "--mem", "64M", *args, "--", "sh", "-c",
                             f'export CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE"; {cmd}'],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode:
            raise SystemExit(f"an instance failed ({p.returncode}): {err.strip()}")
        outs.append(out)
    return outs


def gated(lib: Path, switch: str = "drain"):
    return daemon(extra=["--libcgpu", str(lib), "--compute", "gate", "--switch", switch], handle=True)


def set_policy(d, policy: int) -> None:
    with open(os.path.join(d.mount, "0", "policy"), "w") as f:
        f.write(str(policy))


def alone_bare(tools: Path, tmp: Path, seconds: float, kernel_us: int = KERNEL_US, batch: int = BATCH) -> float:
    log = f"bare{kernel_us}"
    p = subprocess.run([str(tools / "queue-client"), "loop", str(seconds), str(kernel_us), str(batch)],
                       env=stand_in_env(tools, tmp, log), capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise SystemExit(p.stderr)
    t0, t1 = window([tmp / log])
    return busy(tmp / log, t0, t1) / (t1 - t0)


def alone_gated(tools: Path, lib: Path, tmp: Path, seconds: float, tag: str) -> float:
    with gated(lib) as d:
        set_policy(d, 2)
        name = f"qa{tag}1"
        finish([instance(d, tools, tmp, name, ["--weight", "1"], f'exec "$Q" loop {seconds} {KERNEL_US} {BATCH}')])
    t0, t1 = window([tmp / name])
    return busy(tmp / name, t0, t1) / (t1 - t0)


def pair(tools: Path, lib: Path, tmp: Path, seconds: float, tag: str, switch: str = "drain",
         kernel_us: int = KERNEL_US, batch: int = BATCH) -> tuple[float, float, str]:
    with gated(lib, switch) as d:
        set_policy(d, 2)
        run = f"{switch[0]}{'l' if kernel_us == KERNEL_US else 's'}"
        names = [f"qp{tag[:7]}{run}1", f"qp{tag[:7]}{run}2"]
        loop = f'exec "$Q" loop {seconds} {kernel_us} {batch}'
        finish([instance(d, tools, tmp, n, ["--weight", str(w)], loop) for n, w in zip(names, (1, 2))])
        log = open(os.path.join(d.base, "daemon.log")).read()
    logs = [tmp / n for n in names]
    t0, t1 = window(logs)
    one, two = (busy(lg, t0, t1) for lg in logs)
    gave_up = "did not finish their queued GPU work" in log
    return one / (one + two), (one + two) / (t1 - t0), "the daemon stopped waiting for a drain" if gave_up else ""


def high_priority(tools: Path, lib: Path, tmp: Path, seconds: float, tag: str) -> list[float]:
    """gpu-check's row: the neighbour alone for a second, then one small kernel every 20 ms, each waited for."""
    with gated(lib) as d:
        set_policy(d, 2)
        ahead = instance(d, tools, tmp, f"qn{tag}1", ["--weight", "1"],
                         f'exec "$Q" loop {seconds + 2.5} {KERNEL_US} 64')
        ahead.stdout.readline()
        time.sleep(1.0)
        probe = instance(d, tools, tmp, f"qh{tag}2", ["--highprio"], f'exec "$Q" every {seconds} 10 20')
        out = finish([probe])[0]
        finish([ahead])
    return sorted(int(line.split()[-1]) / 1e6 for line in out.splitlines()[1:])  # (each: launch time, duration)


HOST_KERNEL_US, HOST_US = 2000, 1000  # (row 5's CPU-bound loop)


def cpu_bound_pair(tools: Path, lib: Path, tmp: Path, seconds: float, tag: str) -> tuple[float, float]:
    """Row 5: weight 1's share of the kernel time, and its kernel time per second."""
    with gated(lib) as d:
        set_policy(d, 2)
        names = [f"qc{tag}1", f"qg{tag}2"]
        cmds = (f'exec "$Q" host {seconds} {HOST_KERNEL_US} {HOST_US}', f'exec "$Q" loop {seconds} {KERNEL_US} {BATCH}')
        finish([instance(d, tools, tmp, n, ["--weight", str(w)], c) for n, w, c in zip(names, (1, 2), cmds)])
    logs = [tmp / n for n in names]
    t0, t1 = window(logs)
    one, two = (busy(lg, t0, t1) for lg in logs)
    return one / (one + two), one / (t1 - t0)


def host_bare(tools: Path, tmp: Path, seconds: float) -> float:
    """Row 5's reference: the CPU-bound loop alone, no cgpud: the card's busy fraction."""
    p = subprocess.run([str(tools / "queue-client"), "host", str(seconds), str(HOST_KERNEL_US), str(HOST_US)],
                       env=stand_in_env(tools, tmp, "barehost"), capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise SystemExit(p.stderr)
    t0, t1 = window([tmp / "barehost"])
    return busy(tmp / "barehost", t0, t1) / (t1 - t0)


def build_tools(tmp: Path, libcgpu: str | None) -> tuple[Path, Path]:
    """The stand-in driver, libcgpu (unless `libcgpu` names one built elsewhere) and the client, built into
    tmp/tools: that folder, and the libcgpu to preload."""
    tools = tmp / "tools"
    tools.mkdir()
    r = subprocess.run(["make", "-s", "-B", "-C", str(ROOT / "native"), "stubs", "libcgpu", f"STUBS={tools}",
                        f"LIB={tools}"], capture_output=True, text=True)
    if r.returncode and not libcgpu:
        raise SystemExit(r.stderr)
    build(tools)
    return tools, Path(libcgpu) if libcgpu else tools / "libcgpu.so"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="each run's length")
    ap.add_argument("--libcgpu", help="a libcgpu.so built elsewhere (default: built here from the tree)")
    ap.add_argument("--rows", default="1,2,3,4,5", help="which rows (1 is measured whenever 2 or 3 is)")
    a = ap.parse_args()
    rows = {r.strip() for r in a.rows.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-queue-") as t:
        tmp = Path(t)
        tools, lib = build_tools(tmp, a.libcgpu)
        tag = uuid.uuid4().hex[:9]
        runs = {n: tmp / n for n in ("bare", "alone", "pair", "prio", "host")}
        for p in runs.values():
            p.mkdir()
        print(f"the job: {BATCH} launches of {KERNEL_US / 1000} ms then a synchronize, {a.seconds:.0f} s a run; "
              f"stand-in timeslice {os.environ.get('CGPU_STUB_TIMESLICE_US', '1024')} µs, "
              f"switch {os.environ.get('CGPU_STUB_SWITCH_US', '100')} µs", flush=True)
        if rows & {"1", "2", "3"}:
            bare = alone_bare(tools, runs["bare"], a.seconds)
            print(f"1. alone, no cgpud: the card busy {bare:.3f} of the time (the reference)", flush=True)
        if "2" in rows:
            alone = alone_gated(tools, lib, runs["alone"], a.seconds, tag)
            print(f"2. alone under the gate: busy {alone:.3f}: {alone / bare * 100:.1f} % of 1 (goal >= 99 %)",
                  flush=True)
        # 3. the pair, with each way of switching (docs/scheduler.md, "Switches"), long kernels and short
        if "3" in rows:
            short = alone_bare(tools, runs["bare"], a.seconds, SHORT_US, SHORT_BATCH)
            print(f"1. alone, no cgpud, {SHORT_BATCH} x {SHORT_US / 1000:g} ms: the card busy {short:.3f} of the time "
                  f"(the short jobs' reference)", flush=True)
        for switch in ("drain", "ahead", "overlap") if "3" in rows else ():
            for kernel_us, batch, ref in ((KERNEL_US, BATCH, bare), (SHORT_US, SHORT_BATCH, short)):
                share, work, note = pair(tools, lib, runs["pair"], a.seconds, tag, switch, kernel_us, batch)
                print(f"3. the pair at 1:2, policy 2, --switch {switch}, {batch} x {kernel_us / 1000:g} ms: weight 1 got "
                      f"{share:.3f} of the kernel time (goal 0.333 ± 0.02); the pair's work {work / ref * 100:.1f} % "
                      f"of the job alone's (goal >= 97 %){'; ' + note if note else ''}", flush=True)
        waits = high_priority(tools, lib, runs["prio"], a.seconds, tag) if "4" in rows else None
        if waits is None:
            pass
        elif waits:
            print(f"4. high priority beside a weight-1 instance 64 launches ahead: launch -> completion "
                  f"p50 {statistics.median(waits):.2f} ms, p99 {waits[int(0.99 * len(waits))]:.2f} ms, "
                  f"max {waits[-1]:.2f} ms over {len(waits)} (goal p99 <= 5 ms)", flush=True)
        else:
            print("4. high priority: no probe kernel ran", flush=True)
        if "5" in rows:
            ref = host_bare(tools, runs["host"], a.seconds)
            share, work = cpu_bound_pair(tools, lib, runs["host"], a.seconds, tag)
            print(f"5. a CPU-bound instance ({HOST_KERNEL_US / 1000:g} ms kernel, sync, {HOST_US / 1000:g} ms host) at "
                  f"weight 1 beside the job at 2, policy 2: weight 1 got {share:.3f} of the kernel time (goal 0.333 "
                  f"± 0.02); its kernel time {work:.3f} of the wall against {ref:.3f} alone without cgpud "
                  f"({work / ref * 100:.1f} %)", flush=True)


if __name__ == "__main__":
    main()
