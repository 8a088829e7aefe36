"""cgpu inspect against a real daemon: the node's allocation in the shape of
`kubectl inspect cgpu` (SPEC §7), text, -d and JSON."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from cgpud.observe.inspect import primary_ipv4
from conftest import SIM_T4_BYTES

CGPU = str(Path(sys.executable).parent / "cgpu")
GiB = 1 << 30
TAG = f"{os.getpid() % 100000:05d}"
SIX, TWO = f"six....{TAG}", f"two....{TAG}"


def inspect(daemon, *args):
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    r = subprocess.run([CGPU, "inspect", *args], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_seeds_example_six_of_fifteen(daemon):
    """ALIYUN_COM_GPU_MEM_CONTAINER=6 with MEM_DEV=15 on a T4: memsize 6043 MiB shows as 6/15 (40%)."""
    host, ip = socket.gethostname(), primary_ipv4()
    empty = inspect(daemon).splitlines()
    assert empty[1].split() == [host, ip, "0/15", "0/15"]
    assert empty[-1] == "Allocated/Total GPU Memory In Cluster: 0/15 (0%)"

    daemon.write("default_memsize", str(GiB))
    daemon.create(0, SIX)
    daemon.write(f"0/{SIX}/memsize", str(SIM_T4_BYTES * 6 // 15))
    lines = inspect(daemon).splitlines()
    assert lines[0].split("  ") and [c.strip() for c in lines[0].split("  ") if c.strip()] == \
        ["NAME", "IPADDRESS", "GPU0(Allocated/Total)", "GPU Memory(GiB)"]
    assert lines[1].split() == [host, ip, "6/15", "6/15"]
    assert lines[0].index("GPU0(") == lines[1].index("6/15")  # columns line up
    assert set(lines[2]) == {"-"}
    assert lines[3] == "Allocated/Total GPU Memory In Cluster: 6/15 (40%)"
    assert len(lines) == 4


def test_detail_and_json_on_two_gpus(make_daemon):
    d = make_daemon(gpus="sim:2xT4")
    d.write("default_memsize", str(GiB))
    d.create(0, SIX)
    d.write(f"0/{SIX}/memsize", str(SIM_T4_BYTES * 6 // 15))
    d.create(1, SIX)  # the same container on GPU 1 too
    d.write(f"1/{SIX}/memsize", str(SIM_T4_BYTES * 6 // 15))
    d.create(1, TWO)
    d.write(f"1/{TWO}/memsize", str(2 * GiB))  # given in bytes (cgpu run --mem 2G): still 2

    lines = inspect(d).splitlines()
    assert lines[1].split()[2:] == ["6/15", "8/15", "14/30"]
    assert lines[-1] == "Allocated/Total GPU Memory In Cluster: 14/30 (46%)"  # truncated, as the product does

    det = inspect(d, "-d").splitlines()
    assert det[1].split() == ["NAME:", socket.gethostname()] and det[2].split() == ["IPADDRESS:", primary_ipv4()]
    table = det[4:9]
    assert table[0].split() == ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)"]
    rows = {r.split()[0]: r.split()[1:] for r in table[1:3]}
    assert rows == {SIX: ["-", "6", "6"], TWO: ["-", "0", "2"]}
    assert table[3].split() == ["Allocated", ":", "14", "(46%)"] and table[4].split() == ["Total", ":", "30"]
    assert det[-1] == "Allocated/Total GPU Memory In Cluster: 14/30 (46%)"

    j = json.loads(inspect(d, "--json"))
    assert j["gpus"] == [{"index": 0, "allocated": 6, "total": 15}, {"index": 1, "allocated": 8, "total": 15}]
    assert (j["allocated"], j["total"], j["percent"]) == (14, 30, 46)
    assert {i["name"]: i["gpus"] for i in j["instances"]} == {SIX: {"0": 6, "1": 6}, TWO: {"1": 2}}
    assert j["name"] == socket.gethostname() and j["ipaddress"] == primary_ipv4()
