"""cgpu-smi against a real daemon with known instances, weights, memsizes and
processes holding simulated GPU memory (docs/monitoring.md)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMI = str(Path(sys.executable).parent / "cgpu-smi")
CGPU = str(Path(sys.executable).parent / "cgpu")
MiB, GiB = 1 << 20, 1 << 30
TAG = f"{os.getpid() % 100000:05d}"
VIRT, HOLD, BUSY = f"virt...{TAG}", f"hold...{TAG}", f"busy...{TAG}"


def smi(daemon, *args, socket=None):
    env = dict(os.environ, CGPUD_SOCKET=str(socket or daemon.socket))
    return subprocess.run([SMI, *args], env=env, capture_output=True, text=True, timeout=30)


def start(daemon, *args) -> subprocess.Popen:
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    return subprocess.Popen([CGPU, "run", *args], env=env, stdout=subprocess.PIPE, text=True)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)  # cgpu run passes it on; the instance goes with it
    p.wait(30)


@pytest.fixture
def known(make_daemon):
    """GPU 0, policy 2: VIRT (weight 1, 1 GiB, no process) and HOLD (weight 2,
    3 GiB, one process holding 512 MiB). GPU 1, policy 3: BUSY (weight 4, 2 GiB)
    running a workload that holds 1 GiB."""
    d = make_daemon(gpus="sim:2xT4")
    d.write("default_memsize", str(GiB))
    d.write("0/policy", "2")
    d.write("1/policy", "3")
    d.create(0, VIRT)
    hold = start(d, "--name", HOLD, "--weight", "2", "--mem", "3G", "--", CGPU, "mem", "hold", "512M", "--seconds", "60")
    busy = start(d, "--name", BUSY, "--gpu", "1", "--weight", "4", "--mem", "2G", "--",
                 CGPU, "workload", "--seconds", "60", "--mem", "1G")
    try:
        line = hold.stdout.readline()
        m = re.search(r"as pid (\d+)", line)
        assert m, f"cgpu mem hold said {line!r}"
        t0 = time.monotonic()
        while True:  # the workload has its memory, then a full second of running to measure
            b = json.loads(smi(d, "--json").stdout)["gpus"][1]["instances"]
            if b and b[0]["memory"]["used"] == GiB:
                break
            assert time.monotonic() < t0 + 10, "the workload did not allocate its 1 GiB"
            time.sleep(0.1)
        time.sleep(2.0)
        yield d, int(m[1])
    finally:
        stop(hold)
        stop(busy)


def test_json_shows_limits_memory_processes_and_utilisation(known):
    d, pid = known
    r = smi(d, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["schema"] == 1 and j["mode"] == "cgpu" and len(j["gpus"]) == 2
    g0, g1 = j["gpus"]
    assert (g0["policy"], g0["policy_name"], g0["free_weight"]) == (2, "weighted", 13)
    assert g0["memory"] == {"total": 15109 * MiB, "allocated": 4 * GiB, "used": 512 * MiB}
    i0 = {i["container"]: i for i in g0["instances"]}
    assert i0[VIRT]["limit"] == pytest.approx(1 / 3) and i0[HOLD]["limit"] == pytest.approx(2 / 3)
    assert i0[VIRT]["memory"] == {"allocated": GiB, "used": 0} and i0[VIRT]["processes"] == []
    assert i0[HOLD]["memory"] == {"allocated": 3 * GiB, "used": 512 * MiB}
    [p] = i0[HOLD]["processes"]
    assert p["pid"] == pid and p["memory"] == 512 * MiB and "mem hold 512M" in p["name"]
    assert i0[VIRT]["util"] == 0.0  # idle: it holds its slices but never uses them
    [b] = g1["instances"]
    assert b["container"] == BUSY and b["weight"] == 4 and b["limit"] == pytest.approx(0.25)  # 4 of max_inst 16
    assert b["memory"] == {"allocated": 2 * GiB, "used": GiB} and len(b["processes"]) == 1
    assert 0.15 <= b["util"] <= 0.30  # it had about its 25 % over the last second


def test_table_like_nvidia_smi(known):
    d, pid = known
    r = smi(d)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(x) == 79 for x in lines[1:] if x), "every row of the boxes is 79 wide"
    box = "\n".join(lines[:16])
    assert "|   0  Tesla T4" in box and "|   1  Tesla T4" in box
    assert "   512MiB / 15109MiB" in box and "  4096MiB / 15109MiB" in box and "2 (weighted)" in box
    at = next(k for k, x in enumerate(lines) if "Instances:" in x)
    end = next(k for k, x in enumerate(lines) if "Processes:" in x)
    rows = {x.split()[2]: x.strip("| ").split() for x in lines[at + 3:end] if x.startswith("| ")}
    assert set(rows) == {VIRT, HOLD, BUSY}
    ids = {i["container"]: str(i["id"]) for g in json.loads(smi(d, "--json").stdout)["gpus"] for i in g["instances"]}
    assert rows[HOLD] == ["0", HOLD, ids[HOLD], "2", "-", "66.7%", rows[HOLD][6], "512MiB", "/", "3072MiB"]
    assert rows[VIRT] == ["0", VIRT, ids[VIRT], "1", "-", "33.3%", "0%", "0MiB", "/", "1024MiB"]
    assert rows[BUSY][:6] == ["1", BUSY, ids[BUSY], "4", "-", "25.0%"]
    assert rows[BUSY][7:] == ["1024MiB", "/", "2048MiB"]
    assert 15 <= int(rows[BUSY][6].rstrip("%")) <= 30
    procs = lines[lines.index(next(x for x in lines if "Processes:" in x)):]
    mine = [x for x in procs if f" {pid} " in x]
    assert len(mine) == 1 and mine[0].split()[1:3] == ["0", HOLD] and mine[0].split()[-2] == "512MiB"


def test_loop_refreshes_until_interrupted(known):
    d, _ = known
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    # (SIGINT at its default, as at a terminal: a run of the suite in the background of a shell without job
    # control, `make test &`, hands its children SIGINT ignored, and cgpu-smi rightly keeps that)
    p = subprocess.Popen([SMI, "-l", "0.2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = 0
    deadline = time.monotonic() + 30
    while seen < 3 and time.monotonic() < deadline:  # three tables, however slow the start under load
        line = p.stdout.readline()
        assert line, f"cgpu-smi -l stopped: {p.stderr.read()}"
        seen += "CGPU-SMI" in line
    assert seen == 3
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=10)
    assert p.returncode == 130 and "Traceback" not in err


def test_no_daemon_is_one_clear_line(tmp_path):
    for cmd in ([SMI], [SMI, "--json"], [CGPU, "inspect"], [CGPU, "trace", "--json"]):
        env = dict(os.environ, CGPUD_SOCKET=str(tmp_path / "nothing.sock"))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, cmd
        assert r.stdout == "" and r.stderr.startswith("Error: cgpud is not running") and r.stderr.count("\n") == 1, cmd


def test_bad_refresh_interval_is_refused(daemon):
    r = smi(daemon, "-l", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "-l" in r.stderr
