"""make test-load: the timing-sensitive test files run under a CPU load, N runs each, failures counted
per file, so that a test that decides by the machine's load rather than by the product is found
here and not in CI (issue 35). The load: HOGS processes spinning on the CPU at normal priority (what
a busy CI runner or a developer's build does), started before the first run and killed at the end.

    .venv/bin/python scripts/test_load.py [--runs N] [--hogs H] [FILE ...]
    make test-load RUNS=10 HOGS=4 FILES="tests/test_gate.py tests/test_deep_queue.py"

Each run is one pytest process on one file (-p no:randomly, its tests in their order); a run fails
when pytest says so. At the end: a line per file, its failures of its runs and the tests that failed
(each with how many times), and the exit status 1 if any run failed (2 on a bad argument)."""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the files whose tests time something on this machine (a share of the card, a latency, a queue's
# length in time, a CPU loop's stalls) through real processes: what a loaded machine can move
TIMED = ["test_deep_queue.py", "test_shared_pages.py", "test_gate.py", "test_switcher.py", "test_sched_real.py",
         "test_graphs.py", "test_policies.py", "test_cupy.py", "test_gang.py", "test_enforce.py",
         "test_activity.py", "test_stub_executor.py", "test_podman.py", "test_growth.py",
         # (one test of a file: its node ID; this one waits on the kubelet's retries)
         "test_cluster_dra.py::test_a_claim_with_a_bad_configuration_is_refused_on_the_pods_events_and_nothing_runs"]
HOG = "while True: pass"
KEEP = Path(os.environ.get("TMPDIR", "/tmp")) / f"test-load-{os.getpid()}"  # a failed run's output


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL, start_new_session=True)
            for _ in range(n)]


def stop_pytest(p: subprocess.Popen) -> None:
    """SIGINT, as ^C: pytest runs the teardowns (a daemon, a cluster left running otherwise); then SIGKILL."""
    p.send_signal(signal.SIGINT)
    try:
        p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()


def run_once(path: Path, timeout: float) -> tuple[bool, list[str], float]:
    """One pytest run of one file (or one test: FILE::NAME): passed, the tests that failed, seconds."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-rf", os.fspath(path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_pytest(p)
        return False, [f"{path.name} (timed out after {timeout:.0f} s)"], time.monotonic() - t0
    except KeyboardInterrupt:  # (the run under way ends as at ^C: its fixtures' teardown stops its daemons)
        stop_pytest(p)
        raise
    lines = re.findall(r"^(?:FAILED|ERROR) (.+)$", out, re.M)
    failed = [t.split(" - ")[0] for t in lines]
    for t in lines:  # (each failure's own line, for what the summary cannot say)
        print(f"test-load:   {t[:300]}", flush=True)
    ok = p.returncode == 0
    if not ok:  # the whole output kept, to read why
        KEEP.mkdir(parents=True, exist_ok=True)
        kept = KEEP / f"{path.name.replace('::', '-')[:120]}.{time.strftime('%H%M%S')}.log"
        kept.write_text(out + err)
        print(f"test-load:   its output: {kept}", flush=True)
    if not ok and not failed:
        failed = [f"{path.name} (pytest exit {p.returncode}: {out.strip().splitlines()[-1:] or err[-200:]})"]
    return ok, failed, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="test-load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs of each file (default 10)")
    ap.add_argument("--hogs", type=int, default=4, help="CPU hogs beside the runs (default 4)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    ap.add_argument("files", nargs="*", help=f"test files or FILE::TEST (default: {' '.join(TIMED)})")
    a = ap.parse_args(argv)
    files = [Path(f) if os.sep in f.split("::")[0] else ROOT / "tests" / f for f in (a.files or TIMED)]
    missing = [os.fspath(f) for f in files if not Path(os.fspath(f).split("::")[0]).is_file()]
    if missing or a.runs < 1 or a.hogs < 0:
        print(f"test-load: {'no such test file: ' + ', '.join(missing) if missing else 'runs >= 1, hogs >= 0'}",
              file=sys.stderr)
        return 2
    def interrupt(*_) -> None:  # (SIGTERM as ^C: a run in the background of a shell ignores SIGINT)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    load = hogs(a.hogs)
    results: dict[Path, list[tuple[bool, list[str], float]]] = {f: [] for f in files}
    loadavg: list[float] = []  # the 1-minute load average at the end of each run (other work on the host counts)
    interrupted = False
    try:
        for k in range(a.runs):  # (round robin: a spell of worse load falls on every file, not one)
            for f in files:
                ok, failed, secs = run_once(f, a.timeout)
                results[f].append((ok, failed, secs))
                loadavg.append(os.getloadavg()[0])
                print(f"test-load: run {k + 1}/{a.runs} {f.name}: {'passed' if ok else 'FAILED ' + ' '.join(failed)}"
                      f" ({secs:.0f} s, load {loadavg[-1]:.1f})", flush=True)
    except KeyboardInterrupt:  # (^C or SIGTERM: the runs so far are still counted, the run under way is not)
        interrupted = True
    finally:
        for p in load:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(f"\ntest-load: {'interrupted; ' if interrupted else ''}{a.hogs} CPU hogs, {a.runs} runs of each file, "
          f"on {os.cpu_count()} CPUs; the load average "
          f"(1 min) at the runs' ends: mean {sum(loadavg) / max(len(loadavg), 1):.1f}, "
          f"{min(loadavg, default=0):.1f} to {max(loadavg, default=0):.1f}")
    bad = 0
    for f, rs in results.items():
        fails = sum(not ok for ok, _, _ in rs)
        bad += fails
        which = collections.Counter(t for ok, failed, _ in rs for t in failed)
        mean = sum(s for *_, s in rs) / max(len(rs), 1)
        print(f"  {f.name:28} {fails} of {len(rs)} failed  ({mean:.0f} s a run)"
              + "".join(f"\n      {n}x {t}" for t, n in which.most_common()))
    return 1 if bad or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
