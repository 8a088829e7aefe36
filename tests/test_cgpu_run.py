"""`cgpu run` and `cgpu workload` against a real daemon and real cgroups."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.containers.cgroups import v2_root
from conftest import SIM_T4_BYTES

NAME = "runtest00001"


def cgpu(daemon, *args, **kwargs) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "cgpu"
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run([str(exe), *args], env=env, **kwargs)


def wait_for(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def test_registered_before_cmd_runs_in_its_own_cgroup_and_removed_after(daemon):
    tree = daemon.path()
    r = cgpu(daemon, "run", "--name", NAME, "--mem", "2G", "--weight", "3", "--",
             "sh", "-c", f'cat {tree}/0/$CGPU_INSTANCE/weight {tree}/0/$CGPU_INSTANCE/memsize; '
                         'grep "^0::" /proc/self/cgroup; echo "$CGPU_DEVICE"; exit 7')
    assert r.returncode == 7, r.stderr
    weight, memsize, cgroup, device = r.stdout.split("\n")[:4]
    assert (weight, memsize) == ("3", str(2 << 30))
    assert cgroup == f"0::/cgpud/{NAME}"
    assert device.endswith("simgpu0") and os.path.exists(device)
    assert NAME not in os.listdir(daemon.path("0"))
    assert not os.path.exists(os.path.join(v2_root(), "cgpud", NAME))


def test_removed_when_cmd_is_killed(daemon):
    r = cgpu(daemon, "run", "--name", NAME, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 128 + signal.SIGKILL
    assert NAME not in os.listdir(daemon.path("0"))


def test_removed_when_cgpu_run_itself_is_killed(daemon):
    """SIGKILL of `cgpu run`: its command runs on (it is in the instance's
    cgroup) and the instance stays while it does; once the command is gone the
    daemon removes the instance by itself."""
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    exe = Path(sys.executable).parent / "cgpu"
    p = subprocess.Popen([str(exe), "run", "--name", NAME, "--", "sleep", "1.5"], env=env)
    wait_for(lambda: os.path.exists(daemon.path(f"0/{NAME}")), what="the instance to appear")
    time.sleep(0.2)
    p.kill()
    p.wait()
    time.sleep(0.6)
    assert os.path.exists(daemon.path(f"0/{NAME}")), "removed while its command still ran"
    wait_for(lambda: not os.path.exists(daemon.path(f"0/{NAME}")), timeout=5, what="the daemon to reap it")
    assert not os.path.exists(os.path.join(v2_root(), "cgpud", NAME))


def test_bad_requests_fail_with_one_line(daemon):
    r = cgpu(daemon, "run", "--gpu", "5", "--", "true")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "no GPU 5" in r.stderr and "Traceback" not in r.stderr
    r = cgpu(daemon, "run", "--mem", "lots", "--", "true")
    assert r.returncode == 2 and "--mem" in r.stderr
    r = cgpu(daemon, "run", "--name", NAME, "--", "/nonexistent/program")
    assert r.returncode == 1 and "cannot run /nonexistent/program" in r.stderr
    assert NAME not in os.listdir(daemon.path("0"))


def test_no_daemon_is_one_clear_line(tmp_path, daemon):
    env = dict(os.environ, CGPUD_SOCKET=str(tmp_path / "none.sock"))
    exe = Path(sys.executable).parent / "cgpu"
    r = subprocess.run([str(exe), "run", "--", "true"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "cgpud is not running" in r.stderr and "Traceback" not in r.stderr


def test_workload_holds_the_gpu_open_and_reports_its_rate(daemon):
    exe = Path(sys.executable).parent / "cgpu"
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    p = subprocess.Popen([str(exe), "workload", "--seconds", "1.0", "--json"], env=env,
                         stdout=subprocess.PIPE, text=True)
    device = daemon.socket.parent / "dev" / "simgpu0"

    def holds_device() -> bool:
        try:
            return any(os.readlink(f"/proc/{p.pid}/fd/{fd}") == str(device) for fd in os.listdir(f"/proc/{p.pid}/fd"))
        except OSError:
            return False

    wait_for(holds_device, what="the workload to open the simulated GPU")
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0
    import json
    res = json.loads(out)
    assert res["iterations"] > 0 and 0.99 <= res["seconds"] < 1.5
    assert res["it_per_s"] == pytest.approx(res["iterations"] / res["seconds"])


def test_a_cgroup_still_in_use_at_exit_is_removed_once_its_last_process_is_gone(daemon):
    """CMD exits but leaves a background process in the instance's cgroup: the
    instance goes at once, the cgroup when that process is gone."""
    r = cgpu(daemon, "run", "--name", NAME, "--", "sh", "-c", "sleep 1.5 > /dev/null 2>&1 & exit 0")
    assert r.returncode == 0, r.stderr
    assert NAME not in os.listdir(daemon.path("0"))
    group = os.path.join(v2_root(), "cgpud", NAME)
    assert os.path.isdir(group)  # the sleep still runs in it
    wait_for(lambda: not os.path.isdir(group), timeout=5, what="the daemon to remove the emptied cgroup")


def test_runs_without_mem_promise_nothing_and_share_the_gpu(daemon):
    """SPEC §3: `cgpu run` without --mem gets default_memsize (0: the whole
    device) and promises nothing, so a second one runs beside it; one that
    asks for memory is admitted only within what is not promised yet."""
    first = subprocess.Popen([str(Path(sys.executable).parent / "cgpu"), "run", "--gpu", "0", "--name", "runfree00001",
                              "--", "sleep", "30"], env=dict(os.environ, CGPUD_SOCKET=str(daemon.socket)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "runfree00001" in os.listdir(daemon.path("0")), 10, "the first instance")
        r = cgpu(daemon, "run", "--gpu", "0", "--", "sh", "-c", f"cat {daemon.path()}/0/$CGPU_INSTANCE/memsize")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == daemon.value("0/runfree00001/memsize") == str(SIM_T4_BYTES)
        # promises: 10 GiB, then 6 GiB more does not fit a 14.75 GiB T4 (the unpromised instance counts for nothing)
        held = subprocess.Popen([str(Path(sys.executable).parent / "cgpu"), "run", "--gpu", "0", "--mem", "10G",
                                 "--name", "runmem000001", "--", "sleep", "30"],
                                env=dict(os.environ, CGPUD_SOCKET=str(daemon.socket)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: "runmem000001" in os.listdir(daemon.path("0")), 10, "the 10 GiB instance")
            r = cgpu(daemon, "run", "--gpu", "0", "--mem", "6G", "--", "true")
            assert r.returncode != 0 and "not promised" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
            r = cgpu(daemon, "run", "--gpu", "0", "--mem", "4G", "--", "true")
            assert r.returncode == 0, r.stderr
        finally:
            held.terminate()
            held.wait(20)
    finally:
        first.terminate()
        first.wait(20)


def test_a_weight_cut_to_the_free_weight_is_said(daemon):
    """SPEC §4: a new instance gets min(asked, free_weight). cgpu run says so when it got less, and
    that weight 0 means no compute under policies 2 and 3; the command runs as asked."""
    daemon.write("0/max_inst", "4")
    r = cgpu(daemon, "run", "--name", "cutweight001", "--weight", "3", "--", "sh", "-c",
             f"{Path(sys.executable).parent / 'cgpu'} run --name cutweight002 --weight 2 -- true; "
             f"{Path(sys.executable).parent / 'cgpu'} run --name cutweight003 --weight 1 -- "
             f"{Path(sys.executable).parent / 'cgpu'} run --name cutweight004 --weight 1 -- true")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "cgpu run: cutweight002 got weight 1 on GPU 0, not 2: the GPU's free_weight was 1" in lines, r.stderr
    assert ("cgpu run: cutweight004 got weight 0 on GPU 0, not 1: the GPU's free_weight was 0; with weight 0 it "
            "gets no compute under policies 2 and 3") in lines, r.stderr
    assert not [line for line in lines if "cutweight001" in line or "cutweight003" in line]
