"""cgpu trace against a real daemon: real workloads under policy 2 at weights
1:2 (and an idle instance holding its slices); the SVG's bars must be the
slices the scheduler logged, and the weight-2 instance's bars twice as wide."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cgpud.client import Client, ControlError
from cgpud.observe.trace import seconds_of
from conftest import as_nobody, nobody_python

CGPU = str(Path(sys.executable).parent / "cgpu")
GiB = 1 << 30
TAG = f"{os.getpid() % 100000:05d}"
ONE, TWO, IDLE = f"one....{TAG}", f"two....{TAG}", f"idle...{TAG}"
SVG = {"s": "http://www.w3.org/2000/svg"}


def _slices(g: dict) -> list[tuple]:
    """A GPU's raw slices with names instead of indices."""
    n = g["names"]
    return [(s, e, k, frozenset(n[i] for i in run), frozenset(n[i] for i in act), frozenset(n[i] for i in wait))
            for s, e, k, run, act, wait in g["slices"]]


def _ran(slices, name: str, lo: float, hi: float) -> float:
    """Seconds `name` had the GPU within [lo, hi], counted straight from the slices."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e, _, run, act, _ in slices if name in run and name in act)


def test_svg_matches_the_slices_and_shows_the_weights(daemon, tmp_path):
    daemon.write("default_memsize", str(GiB))
    daemon.write("0/policy", "2")
    daemon.create(0, IDLE)  # weight 1, no process: it holds its slice, the GPU's time goes unused
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    jobs = [subprocess.Popen([CGPU, "run", "--name", name, "--weight", w, "--", CGPU, "workload", "--seconds", "20"],
                             env=env, stdout=subprocess.DEVNULL) for name, w in ((ONE, "1"), (TWO, "2"))]
    try:
        with Client(str(daemon.socket)) as c:  # both running (start-up under load included) ...
            deadline = time.monotonic() + 20
            while not all(c.call("stats")[0]["instances"].get(n, {}).get("granted_seconds", 0) > 0 for n in (ONE, TWO)):
                assert time.monotonic() < deadline, "the workloads did not start"
                time.sleep(0.05)
        time.sleep(2.2)  # ... for the whole window
        out = tmp_path / "trace.svg"
        r = subprocess.run([CGPU, "trace", "--seconds", "2", "--gpu", "0", "-o", str(out), "--json"],
                           env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        with Client(str(daemon.socket)) as c:
            asked = time.monotonic()
            later = c.call("trace", seconds=10, gpu=0)
            answered = time.monotonic()
    finally:
        for j in jobs:
            j.terminate()  # cgpu run passes SIGTERM on to the workload
            j.wait(30)

    summ = json.loads(r.stdout)
    [g] = summ["gpus"]
    assert g["gpu"] == 0 and g["policy"] == 2 and summ["seconds"] == 2
    assert {i["name"]: i["weight"] for i in g["instances"]} == {IDLE: 1, ONE: 1, TWO: 2}
    slices = _slices(g)
    lo, hi = g["since"], g["now"]
    assert hi - lo == pytest.approx(2.0) and slices[0][0] <= lo + 0.05 and slices[-1][1] == pytest.approx(hi)

    # What the CLI drew from is the daemon's ring: asked again, the daemon
    # still has those slices, to the digit (the last one was in force and open).
    g2 = seconds_of(later["gpus"][0])  # (on the socket: whole microseconds)
    # the daemon's times are CLOCK_MONOTONIC's, as this process's (trio's own clock would add an offset)
    assert asked <= later["gpus"][0]["now"] <= answered
    again = {s[:4] for s in _slices(g2)}
    assert all(s[:4] in again for s in slices[:-1])
    assert any(s[0] == slices[-1][0] and s[1] >= slices[-1][1] for s in _slices(g2))

    # Every bar of the picture is an interval of its lane, at the place the axis says.
    doc = ET.parse(out).getroot()
    panel = doc.find("s:g", SVG)
    x0, pps = float(panel.get("data-x0")), float(panel.get("data-pps"))
    bars: dict[str, list[tuple[float, float, str]]] = {}
    width: dict[tuple[str, str], float] = {}
    for rect in panel.findall("s:rect", SVG):
        if rect.get("data-start") is None:
            continue
        s, e, cls = float(rect.get("data-start")), float(rect.get("data-end")), rect.get("class")
        assert float(rect.get("x")) == pytest.approx(x0 + s * pps, abs=2e-3)
        assert float(rect.get("width")) == pytest.approx((e - s) * pps, abs=2e-3)
        who = rect.get("data-instance", "gpu")
        bars.setdefault(who, []).append((s, e, cls))
        width[(who, cls)] = width.get((who, cls), 0.0) + float(rect.get("width"))
    for name in (ONE, TWO, IDLE):
        assert bars[name] == [tuple(x) for x in g["lanes"][name]]
    assert bars["gpu"] == [tuple(x) for x in g["unused"]]

    # ... and the bars add up to what the slices say each instance had.
    for name in (ONE, TWO):
        ran = [(s, e) for s, e, cls in bars[name] if cls == "run"]
        assert sum(e - s for s, e in ran) == pytest.approx(_ran(slices, name, lo, hi), abs=1e-6)
        assert width[(name, "run")] / pps == pytest.approx(_ran(slices, name, lo, hi), abs=len(ran) * 1e-3 / pps)
        assert width.get((name, "frozen"), 0) > 0  # it waited while the others held the GPU
    assert {cls for _, _, cls in bars[IDLE]} == {"held"}  # idle: it only ever held its slices
    assert width.get((IDLE, "run"), 0.0) == 0.0

    # The policy at work: weights 1:2 (and the idle holder's quarter unused).
    ratio = width[(TWO, "run")] / width[(ONE, "run")]
    assert 1.6 <= ratio <= 2.5, ratio
    unused = sum(e - s for s, e, _ in bars["gpu"]) / 2.0
    assert 0.1 <= unused <= 0.45, unused
    text = "".join(doc.itertext())
    assert "policy 2 (weighted)" in text and f"{TWO} w2" in text and f"{IDLE} w1" in text


def test_trace_op_is_open_to_everyone_and_refuses_bad_arguments(daemon):
    """What cgpu-smi, inspect and trace ask (query, stats, trace) a plain user may ask."""
    script = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile(); "
              "s.sendall(b'{\"op\": \"trace\", \"seconds\": 1}\\n{\"op\": \"stats\"}\\n{\"op\": \"query\"}\\n'); "
              "[print(f.readline(), end='') for _ in range(3)]")
    r = as_nobody([nobody_python(), "-c", script, str(daemon.socket)])
    trace, stats, query = (json.loads(x) for x in r.stdout.splitlines())
    assert trace["ok"] and trace["result"]["gpus"][0]["gpu"] == 0, r
    assert stats["ok"] and query["ok"] and query["result"]["gpus"][0]["name"] == "Tesla T4", r
    with Client(str(daemon.socket)) as c:
        for args in ({"seconds": 0}, {"seconds": 61}, {"seconds": "5"}, {"seconds": 1, "gpu": 3},
                     {"seconds": 1, "gpu": -1}):
            with pytest.raises(ControlError) as e:
                c.call("trace", **args)
            assert e.value.error == "EINVAL", args
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    r = subprocess.run([CGPU, "trace", "--seconds", "120", "--json"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "at most 60" in r.stderr
    r = subprocess.run([CGPU, "trace"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "-o FILE.svg" in r.stderr and "Traceback" not in r.stderr
