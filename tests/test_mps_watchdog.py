"""MPS mode on NVML GPUs (issue 37): the daemon drives the stand-in control daemon
(native/stubs/nvidia-cuda-mps-control, the one that follows NVIDIA's rules) and the memory
watchdog still holds each instance to its memsize: what MPS was told (a client can unset its own
limit) is not what isolates memory (docs/mps.md)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from nvml_stub import MIB
from test_cgpu_run import wait_for
from test_nvml import GIB, Run, libdir, runs, stub  # noqa: F401  (fixtures)

CONTROL = Path(__file__).resolve().parent.parent / "native" / "stubs" / "nvidia-cuda-mps-control"


def test_in_mps_mode_the_watchdog_kills_the_instance_past_its_memsize(make_daemon, stub, runs, tmp_path,  # noqa: F811
                                                                        monkeypatch):
    pipe, logs = tmp_path / "pipe", tmp_path / "mpslog"
    for k, v in {**stub.env(), "CUDA_MPS_LOG_DIRECTORY": os.fspath(logs)}.items():
        monkeypatch.setenv(k, v)
    d = make_daemon(gpus="nvml", start=False, extra_args=["--mode", "mps", "--mps-control", os.fspath(CONTROL),
                                                           "--mps-pipe-dir", os.fspath(pipe)])
    d.dev_dir.mkdir()
    for minor in (0, 3):
        (d.dev_dir / f"nvidia{minor}").write_text("")
    d.start()
    shell = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.fspath(pipe))
    # the node defaults reached the control daemon (docs/mps.md: a weight-1 share of max_inst 16: 7 %)
    r = subprocess.run([os.fspath(CONTROL)], input="get_default_active_thread_percentage\n", env=shell,
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, "7.0\n"), r
    tag = f"{os.getpid() % 100000:05d}"
    over, under = Run(d, f"mpso{tag}abc", "1G"), Run(d, f"mpsu{tag}abc", "1G")
    runs += [over, under]
    stub.procs = {(0, over.pid): GIB - MIB, (0, under.pid): 512 * MIB}
    stub.write()
    wait_for(lambda: f"PID: {under.pid} Mem: {512 * MIB}" in d.read(f"0/{under.name}/meminfo"), timeout=10,
             what="the watchdog's first look")
    assert over.alive() and under.alive(), "killed below memsize"
    stub.procs[(0, over.pid)] = GIB + MIB  # one MiB past memsize
    stub.write()
    assert over.proc.wait(10) == 128 + signal.SIGKILL
    assert (f"memory watchdog: {over.name} on GPU 0 uses {GIB + MIB} bytes, past its memsize {GIB}") in d.log_text()
    assert under.alive()
    d.stop()
    assert not (pipe / "control").exists(), "the daemon's stop left the control daemon running"
