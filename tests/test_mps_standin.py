"""The MPS rules in the stand-in (issue 37): the stand-in control daemon
(native/stubs/nvidia-cuda-mps-control) and the stand-in libcuda as its client
(native/stubs/cuda_mps.c, the lanes in cuda_exec.c). The rules are NVIDIA's
(nvidia-cuda-mps-control(1); the MPS guide's environment variables and control commands,
docs/mps.md cites them); every expected figure here comes from them, not from the stand-in."""
from __future__ import annotations

import os
import subprocess

import pytest

from mps_standin import Mps, build
from queue_client import kernels

OOM, DEVICE_UNAVAILABLE = 2, 46  # cuda.h: CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_DEVICE_UNAVAILABLE


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mps-standin"))


@pytest.fixture
def mps(libs, tmp_path):
    m = Mps(libs, tmp_path)
    m.start()
    yield m
    m.stop()


def test_the_control_daemon_its_pipe_directory_and_its_commands(libs, tmp_path):
    """-d in the background with its pid file and control.log; a second -d refused; the shell's
    commands (a default echoed back, a bad value refused); no daemon: the shell says so; quit
    ends the daemon and its server."""
    m = Mps(libs, tmp_path)
    r = m.control(stdin="get_server_list\n")
    assert r.returncode == 1 and "Cannot find MPS control daemon" in r.stderr
    m.start()
    try:
        assert int((m.pipe / "nvidia-cuda-mps-control.pid").read_text()) > 0
        assert "Control daemon started" in (m.logs / "control.log").read_text()
        r = m.control("-d")
        assert r.returncode == 1 and "already running" in r.stderr
        r = m.control(stdin="set_default_active_thread_percentage 25\nget_default_active_thread_percentage\n")
        assert (r.returncode, r.stdout) == (0, "25.0\n25.0\n"), r
        assert m.control(stdin="set_default_active_thread_percentage 0\n").returncode == 1
        assert m.control(stdin="set_default_device_pinned_mem_limit 0 2X\n").returncode == 1
        r = m.control(stdin="set_default_device_pinned_mem_limit 0 2G\nget_default_device_pinned_mem_limit 0\n")
        assert (r.returncode, r.stdout) == (0, "2048M\n"), r
        assert m.control(stdin="get_server_list\n").stdout == ""  # (no client yet: no server)
        assert m.client("alloc")["ctx"] == [0]
        servers = m.control(stdin="get_server_list\n").stdout.split()
        assert len(servers) == 1 and os.path.exists(f"/proc/{servers[0]}")
    finally:
        r = m.control(stdin="quit\n")
    assert r.returncode == 0
    assert not (m.pipe / "control").exists() and not os.path.exists(f"/proc/{servers[0]}")  # (quit returns once gone)


def test_a_clients_allocations_beyond_its_pinned_limit_fail_with_out_of_memory(mps):
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, per device ("0=64M") or one value ("64M"): 48 MiB fit,
    32 more do not (CUDA_ERROR_OUT_OF_MEMORY), 16 more do; freed memory is its own again."""
    for limit in ("0=64M", "64M", "0=64M,1=8M"):
        out = mps.client("alloc", "48", "32", "16", "-3", "32", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=limit)
        assert out["alloc"] == [0, OOM, 0, 0], (limit, out)


def test_the_clients_limit_only_tightens_the_servers_default(mps):
    """set_default_device_pinned_mem_limit 0 64M: a client asking 200M gets 64M; a default set
    once the server runs applies to the next server only (NVIDIA: "will only affect the next
    server")."""
    assert mps.control(stdin="set_default_device_pinned_mem_limit 0 64M\n").returncode == 0
    assert mps.client("alloc", "48", "32", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=200M")["alloc"] == [0, OOM]
    assert mps.control(stdin="set_default_device_pinned_mem_limit 0 1G\n").returncode == 0
    assert mps.client("alloc", "48", "32")["alloc"] == [0, OOM]  # (the running server keeps 64M)


def test_without_a_control_daemon_a_process_runs_without_mps(libs, tmp_path):
    """NVIDIA: if the connection to the control daemon fails, the program runs as it would
    without MPS: the limit in its environment means nothing then."""
    m = Mps(libs, tmp_path)
    out = m.client("alloc", "48", "32", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=64M")
    assert out["init"] == [0] and out["alloc"] == [0, 0]


def test_while_a_server_holds_the_card_a_process_outside_it_makes_no_context(mps, libs, tmp_path):
    """The server holds the cards (EXCLUSIVE_PROCESS, as MPS is set up): a process whose pipe
    directory has no daemon initializes, but its context is refused; after quit it is not."""
    assert mps.client("alloc")["ctx"] == [0]  # (the first client: the server starts)
    stray = {"CUDA_MPS_PIPE_DIRECTORY": os.fspath(tmp_path / "elsewhere")}
    out = mps.client("alloc", **stray)
    assert out["init"] == [0] and out["ctx"] == [DEVICE_UNAVAILABLE], out
    mps.stop()
    assert mps.client("alloc", **stray)["ctx"] == [0]


def test_thread_percentages_1_to_2_give_throughput_1_to_2_run_concurrently(mps, libs, tmp_path):
    """Two clients at 25 % and 50 % of the SMs, 60 kernels of 2 ms each queued at once: they run
    at the same time (MPS: one context, no time slices between clients), each kernel taking
    100/percentage as long (8 ms, 4 ms); while both are busy the 50 % client completes twice the
    kernels. Simulated times from the kernel log (the card's, not this machine's)."""
    procs = []
    for name, pct in (("a", "25"), ("b", "50")):
        env = {**mps.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct, "CGPU_STUB_CUDA_LOG": os.fspath(tmp_path / name)}
        procs.append(subprocess.Popen([os.fspath(libs / "mps-client"), "burst", "60", "2000"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert "done" in out, (out, err)
    a, b = kernels(tmp_path / "a"), kernels(tmp_path / "b")
    assert len(a) == len(b) == 60
    assert {e - s for _, s, e in a} == {8_000_000} and {e - s for _, s, e in b} == {4_000_000}
    start, end = max(a[0][1], b[0][1]), min(a[-1][2], b[-1][2])
    assert end - start > 100_000_000  # (both busy together for most of the run)
    done_a = sum(start <= e <= end for _, _, e in a)
    done_b = sum(start <= e <= end for _, _, e in b)
    assert abs(done_b / done_a - 2) <= 2 / done_a * 2, (done_a, done_b)


def test_the_clients_own_percentage_only_tightens_the_default(mps, tmp_path):
    """set_default_active_thread_percentage 20: a client asking 50 % runs at 20 % (a 1 ms
    kernel takes 5 ms)."""
    assert mps.control(stdin="set_default_active_thread_percentage 20\n").returncode == 0
    env = {**mps.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CGPU_STUB_CUDA_LOG": os.fspath(tmp_path / "k")}
    subprocess.run([os.fspath(mps.libs / "mps-client"), "burst", "3", "1000"], env=env, check=True, timeout=60)
    assert {e - s for _, s, e in kernels(tmp_path / "k")} == {5_000_000}


def test_a_client_its_daemon_cannot_serve_fails_at_init(mps, libs, tmp_path):
    """A second control daemon (its own pipe directory) on the same card: its server cannot take
    the card the first one's holds, so its client's cuInit fails
    (CUDA_ERROR_MPS_CONNECTION_FAILED, 805), again at a second cuInit; its log says why."""
    assert mps.client("alloc")["ctx"] == [0]  # (the first daemon's server holds the card)
    other = Mps(libs, tmp_path, name="other")
    other.start()
    try:
        assert other.client("alloc") == {"init": [805]}
        assert other.client("twice") == {"init": [805, 805]}
        assert "held by another MPS server" in (other.logs / "control.log").read_text()
        assert other.control(stdin="get_server_list\n").stdout == ""
    finally:
        other.stop()
