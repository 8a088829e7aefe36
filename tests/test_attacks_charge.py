"""The charge is checked (issue 33; SPEC §9: what a container writes into its pages is a hint the
daemon checks; docs/security.md, "The charge"): a container that writes into its usage page that its
processes used almost no GPU time, while they run kernels as anyone's, is charged by what the daemon
measures (NVML's per-process utilisation; here the stand-in NVML's, measured from what the stand-in
card ran for each process) and gets its weight's share, not about twice it.

A real daemon (`cgpud serve`, libcgpu in the instances' launchers, policy 2) with the stand-in NVML
loaded by the real nvidia-ml-py; two launchers of 1 ms kernels at weights 1 and 2; the weight-1
one's page is rewritten by the test (as a process of its container could: the pages' directory is
the container's, read-write) so that its count grows by a tenth of the wall time, a third of what it runs."""
from __future__ import annotations

import mmap
import os
import threading
import time
import uuid

from cgpud.gpus import pages
from nvml_stub import NvmlStub, StubGpu
from test_gate import busy, libs, run_launcher  # noqa: F401  (libs: the fixture)

SAID = "usage page under-reports its GPU time"


def _lie(usage, stop: threading.Event, part: float = 0.1) -> None:
    """Keep every counting slot's GPU time on GPU 0 at what it was plus `part` of the wall time since:
    a count well below what its processes run, that grows (libcgpu's additions between two writes
    are a ms or so: far less than a window's growth, so the daemon sees it go on, never back)."""
    with open(usage, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = [pages.BUSY_OFFSET + k * pages.BUSY.size + 8 for k in range(pages.MAX_PROCS)]
        base = {a: int.from_bytes(m[a:a + 8], "little") for a in at}
        t0 = time.monotonic_ns()
        while not stop.is_set():
            grown = int((time.monotonic_ns() - t0) * part)
            for a in at:
                if int.from_bytes(m[a - 8:a - 4], "little") == 1:  # (timed: a process that counts)
                    m[a:a + 8] = (base[a] + grown).to_bytes(8, "little")
            time.sleep(0.0005)


def nvml_daemon(make_daemon, libs, tmp_path, monkeypatch, gpu_uuid: str):  # noqa: F811
    """A daemon with libcgpu, the compute gate and policy 2, its GPU the stand-in NVML's (whose
    per-process utilisation is what the stand-in card at tmp_path/card ran for each process)."""
    stub = NvmlStub.build(tmp_path)
    stub.gpus = [StubGpu(uuid=gpu_uuid)]
    stub.cuda_state = tmp_path / "card"  # (run_launcher's card: the processes' kernels measured there)
    stub.write()
    monkeypatch.setenv("LD_LIBRARY_PATH", os.fspath(stub.libdir))
    monkeypatch.setenv("CGPU_NVML_STUB", os.fspath(stub.config))
    monkeypatch.setenv("CGPUD_CHARGE_NVML", "1")
    d = make_daemon(extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so"), "--compute", "gate"])
    d.write("0/policy", "2")
    return d


def test_a_container_that_under_reports_its_gpu_time_gets_its_weight_not_twice_it(make_daemon, libs, tmp_path,
                                                                                     monkeypatch):
    d = nvml_daemon(make_daemon, libs, tmp_path, monkeypatch, "GPU-c4a2e0f1-0000-4000-8000-000000000033")
    tag = uuid.uuid4().hex[:8]
    liar, honest = f"liar{tag}", f"fair{tag}"
    one = run_launcher(d, libs, tmp_path, liar, 1, 14)
    two = run_launcher(d, libs, tmp_path, honest, 2, 14)
    stop = threading.Event()
    try:
        for p in (one, two):
            assert p.stdout.readline().strip() == "started", p.stderr.read()
        lying = threading.Thread(target=_lie, args=(d.base / "pages" / liar / "usage", stop), daemon=True)
        lying.start()
        said = f"instance {liar}'s {SAID}"
        deadline = time.monotonic() + 6  # (a wait for the check's verdict, not a timed assertion: a few windows)
        while said not in d.log_text() and time.monotonic() < deadline and d.alive():
            time.sleep(0.05)
        time.sleep(0.3)  # (past the slice in force)
        t0 = time.monotonic_ns()
        time.sleep(4)
        t1 = time.monotonic_ns()
        assert one.poll() is None and two.poll() is None, "a launcher ended before the window did"
    finally:
        stop.set()
        for p in (one, two):
            p.terminate()
            p.communicate(timeout=30)
    mine, theirs = busy(tmp_path / f"{liar}.kernels", t0, t1), busy(tmp_path / f"{honest}.kernels", t0, t1)
    share = mine / (mine + theirs)
    # weights 1:2 give it 1/3 of the kernel time (0.33 read); believed (charged its page's count,
    # floored at half its slice) it gets more: 0.45 and 0.46 read with the check off, 0.447 with
    # main's stand-in (no per-process figure)
    assert 0.2 <= share <= 0.37, (share, mine, theirs, d.log_text()[-2000:])
    log = d.log_text()
    assert log.count(said) == 1, log[-3000:]
    assert "NVML measured" in log.split(said)[1].splitlines()[0], log[-3000:]  # (caught by NVML's figure)
    assert f"instance {honest}'s {SAID}" not in log, "the honest neighbour was not believed"
    assert d.alive()


def test_the_judge_believes_an_honest_count_and_no_lie():
    """gputime.judge, against figures worked out by hand: an honest page counts nearly all that NVML
    measures (libcgpu undercounts at most a tick per idle gap); a lie counts well below, or goes back."""
    from cgpud.sched.gputime import judge
    s = 1_000_000_000
    assert judge(int(0.62 * s), int(0.66 * s), s) is None          # a CPU-bound instance's, honest
    assert judge(int(0.30 * s), int(0.33 * s), s) is None
    assert judge(0, int(0.05 * s), s) is None                      # NVML's figure too small to tell (whole %)
    assert "NVML measured 330.0 ms" in judge(int(0.01 * s), int(0.33 * s), s)
    assert "went back" in judge(-5_000_000, int(0.33 * s), s)
    assert judge(int(0.2 * s), int(0.33 * s), s) is None           # above half: believed (its floor bounds it)


PROBE = r"""
import sys, time, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
def ask(since):
    try:
        return {s.pid: s.smUtil for s in pynvml.nvmlDeviceGetProcessUtilization(h, since)}
    except pynvml.NVMLError_NotFound:
        return None
first = ask(0)
a_wall, a = int(time.time() * 1e6), time.monotonic_ns()
time.sleep(float(sys.argv[1]))
got = ask(a_wall)
print(first, a, time.monotonic_ns(), got)
"""


def test_the_stand_in_nvml_answers_what_its_card_ran_for_each_process(libs, tmp_path):
    """nvmlDeviceGetProcessUtilization on the stand-in: before, the configured `putil` lines alone
    (NVML_ERROR_NOT_FOUND without them); now, with a `cuda` line, each process's kernel time since
    the answer the caller names, as the card's executor ran it — here against its kernel log."""
    import subprocess
    import sys

    import queue_client
    from test_gate import kernels

    client = queue_client.build(tmp_path)
    stub = NvmlStub(libs, tmp_path / "nvml.conf", gpus=[StubGpu(uuid="GPU-c4a2e0f1-0000-4000-8000-000000000034")],
                    cuda_state=tmp_path / "card")
    stub.write()
    env = dict(os.environ, LD_LIBRARY_PATH=os.fspath(libs), CGPU_STUB_CUDA_STATE=os.fspath(tmp_path / "card"),
               CGPU_STUB_CUDA_LOG=os.fspath(tmp_path / "k.log"))
    # a CPU-bound process: a 2 ms kernel, a synchronize, 2 ms of host work, again: about half the card
    run = subprocess.Popen([os.fspath(client), "host", "6", "2000", "2000"], env=env, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert run.stdout.readline().strip() == "started"
        (tmp_path / "probe.py").write_text(PROBE)
        out = subprocess.run([sys.executable, os.fspath(tmp_path / "probe.py"), "2"], env=stub.env(env),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    finally:
        run.communicate(timeout=60)  # (its exit writes its kernel log whole)
    first, a, b, got = out.stdout.split(" ", 3)
    assert first == "None"  # (nothing before its first answer)
    got = eval(got)  # noqa: S307  (a dict printed by the probe)
    assert set(got) == {run.pid}, got
    ran = sum(max(0, min(e, int(b)) - max(s, int(a))) for _, s, e in kernels(tmp_path / "k.log")) / (int(b) - int(a))
    assert 0.05 < ran < 0.95, ran  # (the process ran part of the time: not a figure any constant would pass)
    assert abs(got[run.pid] / 100 - ran) <= 0.05, (got, ran)
