"""cgpu-smi against a real daemon."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SMI = str(Path(sys.executable).parent / "cgpu-smi")
CGPU = str(Path(sys.executable).parent / "cgpu")


def smi(daemon, *args, socket=None):
    env = dict(os.environ, CGPUD_SOCKET=str(socket or daemon.socket))
    return subprocess.run([SMI, *args], env=env, capture_output=True, text=True, timeout=30)


def test_table_shows_each_instance_with_limit_memory_and_utilisation(daemon):
    daemon.write("default_memsize", str(2 << 30))
    daemon.write("0/policy", "3")
    daemon.create(0, "virtualinst1")
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    job = subprocess.Popen([CGPU, "run", "--name", "busyinstance", "--weight", "4", "--",
                            CGPU, "workload", "--seconds", "4"], env=env, stdout=subprocess.DEVNULL)
    try:
        time.sleep(2.5)
        r = smi(daemon)
        assert r.returncode == 0, r.stderr
        rows = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("| ") and
                line.split()[1] in ("virtualinst1", "busyinstance")}
        busy = rows["busyinstance"].split()
        assert busy[3] == "4" and busy[4] == "25.0%"   # weight 4 of max_inst 16 under policy 3
        util = int(busy[5].rstrip("%"))
        assert 15 <= util <= 30                          # it had about its 25 % over the last second
        assert "2048 MiB" in rows["virtualinst1"] and "6.2%" in rows["virtualinst1"]
        assert "Tesla T4" in r.stdout and "policy 3 (fixed)" in r.stdout
        j = json.loads(smi(daemon, "--json").stdout)
        insts = {i["name"]: i for i in j["gpus"][0]["instances"]}
        assert insts["busyinstance"]["weight"] == 4 and insts["virtualinst1"]["memsize"] == 2 << 30
        assert 0.15 <= insts["busyinstance"]["util"] <= 0.30
    finally:
        job.wait(30)


def test_no_daemon_is_one_clear_line(daemon, tmp_path):
    r = smi(daemon, socket=tmp_path / "nothing.sock")
    assert r.returncode == 1
    assert r.stderr.strip().startswith("Error: cgpud is not running") and r.stderr.count("\n") == 1
