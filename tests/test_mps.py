"""MPS mode (`cgpud serve --mode mps`): the daemon drives a stand-in
nvidia-cuda-mps-control (tests/mps_stub/, which records every invocation),
and `cgpu run` gives CMD the instance's MPS limits."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cgpud.gpus.mps import client_env, default_commands, thread_percentage
from conftest import SIM_T4_BYTES, cgpud_script
from test_cgpu_run import cgpu, wait_for
from test_enforce import lab  # noqa: F401  (a fixture)

STUB = Path(__file__).parent / "mps_stub" / "nvidia-cuda-mps-control"
MIB = 1 << 20
A10_BYTES = 22731 * MIB


@pytest.fixture
def mps_log(tmp_path, monkeypatch) -> Path:
    log = tmp_path / "mps.log"
    monkeypatch.setenv("CGPU_MPS_STUB_LOG", str(log))
    return log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def commands(log: Path) -> list[str]:
    return [c["stdin"].strip() for c in calls(log) if not c["args"]]


def test_the_daemon_starts_mps_sets_the_defaults_follows_settings_and_quits(make_daemon, mps_log):
    d = make_daemon(gpus="sim:T4,A10", extra_args=["--mode", "mps", "--mps-control", str(STUB)])
    assert calls(mps_log)[0]["args"] == ["-d"]
    assert commands(mps_log) == [
        "set_default_device_pinned_mem_limit 0 15109M",  # default_memsize 0: the whole GPU
        "set_default_device_pinned_mem_limit 1 22731M",
        "set_default_active_thread_percentage 7",  # weight 1 of max_inst 16, rounded up
    ]
    d.write("default_memsize", str(4 << 30))
    d.write("1/max_inst", "4")  # GPU 0 still has 16: the percentage stays, nothing is sent for it
    wait_for(lambda: len(commands(mps_log)) >= 5, what="the new defaults")
    d.stop()
    assert commands(mps_log)[3:] == [
        "set_default_device_pinned_mem_limit 0 4096M",
        "set_default_device_pinned_mem_limit 1 4096M",
        "quit",
    ]
    assert not Path(str(mps_log) + ".running").exists(), "the control daemon was left running"
    assert "mps: control daemon stopped" in d.log_text()


def test_after_a_crash_the_next_daemon_takes_the_control_daemon_over(make_daemon, mps_log):
    d = make_daemon(gpus="sim:T4", extra_args=["--mode", "mps", "--mps-control", str(STUB)])
    d.kill9()  # no quit: the control daemon runs on
    assert Path(str(mps_log) + ".running").exists()
    d.start()
    assert "taking it over" in d.log_text()
    d.stop()
    assert [c["args"] or c["stdin"].strip() for c in calls(mps_log)] == [
        ["-d"], "set_default_device_pinned_mem_limit 0 15109M", "set_default_active_thread_percentage 7",
        ["-d"], "set_default_device_pinned_mem_limit 0 15109M", "set_default_active_thread_percentage 7",  # refused -d
        "quit"]
    assert not Path(str(mps_log) + ".running").exists()
    # an MPS daemon someone else started is not taken over (test_mps_start_failures_are_one_line)


def test_no_scheduler_in_mps_mode_but_what_a_previous_daemon_froze_runs_again(make_daemon, mps_log, lab):  # noqa: F811
    from cgpud.sched.guard import registry_path
    from cgpud.sched.enforce import KIND_CGROUP2, CgroupV2Freezer

    g = lab.group(KIND_CGROUP2)
    lab.spawn(g)
    f = CgroupV2Freezer(g)
    f.freeze()
    wait_for(lambda: "frozen 1" in Path(g, "cgroup.events").read_text(), what="the test group frozen")
    d = make_daemon(gpus="sim:T4", start=False, extra_args=["--mode", "mps", "--mps-control", str(STUB)])
    d.state_dir.mkdir()
    Path(registry_path(str(d.state_dir))).write_text(json.dumps([f.spec()]))
    d.start()
    assert "frozen 0" in Path(g, "cgroup.events").read_text()
    assert not os.path.exists(registry_path(str(d.state_dir)))


def test_cgpu_run_gives_cmd_its_limits(make_daemon, mps_log, tmp_path):
    pipe = tmp_path / "pipe"
    d = make_daemon(gpus="sim:T4,A10", extra_args=["--mode", "mps", "--mps-control", str(STUB),
                                                   "--mps-pipe-dir", str(pipe)])
    r = cgpu(d, "run", "--gpus", "0,1", "--mem", "3G", "--weight", "4", "--",
             "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; echo $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; "
                         "echo $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; echo $CUDA_MPS_PIPE_DIRECTORY")
    assert r.returncode == 0, r.stderr
    from cgpud.client import Client
    with Client(str(d.socket)) as c:
        uuids = [g["uuid"] for g in c.call("query")["gpus"]]
    assert r.stdout.split("\n")[:4] == [",".join(uuids), "0=3072M,1=3072M", "25", str(pipe)]
    assert {c["pipe_dir"] for c in calls(mps_log)} == {str(pipe)}
    # no time slices in mps mode: MPS shares the compute
    with Client(str(d.socket)) as c:
        assert c.call("stats") == []


def test_mps_start_failures_are_one_line(tmp_path, mps_log):
    def serve(*extra: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([cgpud_script(), "serve", "--gpus", "sim:T4", "--mode", "mps",
                               "--mount", str(tmp_path / "mnt"), "--state-dir", str(tmp_path / "state"),
                               "--socket", str(tmp_path / "s.sock"), "--dev-dir", str(tmp_path / "dev"), *extra],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                              env=dict(os.environ, PATH="/usr/bin:/bin", **env))
    r = serve()
    assert r.returncode == 1 and r.stderr.strip() == (
        "Error: --mode mps: nvidia-cuda-mps-control is not in PATH; install the NVIDIA driver's compute utilities "
        "or give --mps-control PATH")
    Path(str(mps_log) + ".running").touch()  # one runs already
    r = serve("--mps-control", str(STUB))
    assert r.returncode == 1 and r.stderr.strip() == (
        f"Error: cannot start the MPS control daemon: {STUB} -d: exit 1: An instance of this daemon is already "
        f"running; if one is running already, stop it (echo quit | nvidia-cuda-mps-control)")
    assert [c["args"] for c in calls(mps_log)] == [["-d"]], "it sent commands to a daemon it did not start"
    os.unlink(str(mps_log) + ".running")
    r = serve("--mps-control", str(STUB), CGPU_MPS_STUB_FAIL="set_default_active_thread_percentage")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"Error: {STUB} set_default_active_thread_percentage 7: exit 1: set_default_active_thread_percentage: refused")
    assert commands(mps_log)[-1] == "quit", "a control daemon it started was left running"


def test_limits_from_memsize_and_weight():
    from cgpud.core.model import GpuInfo, Node

    node = Node([GpuInfo(0, "GPU-a", "T4", SIM_T4_BYTES), GpuInfo(1, "GPU-b", "A10", A10_BYTES)])
    node.set_max_inst(1, 4)
    for g in (0, 1):
        node.create_instance(g, "mpsinstance1", memsize=(6 << 30) + 12345, weight=2)
    assert client_env(node, "mpsinstance1") == {
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6144M,1=6144M",  # floored to whole MiB
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "13",  # 2 of 16 on GPU 0 (2 of 4 on GPU 1 would be 50)
    }
    assert client_env(node, "nosuchthing1") == {}
    assert [thread_percentage(w, 16) for w in (0, 1, 8, 16)] == [1, 7, 50, 100]
    assert default_commands(node)[-1] == "set_default_active_thread_percentage 7"
