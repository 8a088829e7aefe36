"""A refused start touches nothing (issue 15): with a daemon running and a
`cgpu run` workload that its scheduler keeps frozen most of the time, every
kind of refused second start — the same state directory, the same socket,
the same mount point, bad flags — fails with one line, leaves no mount of its
own behind, and leaves the first daemon's mount, its registry of what it
froze, and its scheduling exactly as they were."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import mounted

CGPU = str(Path(sys.executable).parent / "cgpu")


def frozen(path: str) -> bool:
    return "frozen 1" in (Path(path) / "cgroup.events").read_text()


def freezes_and_thaws(group: str, seconds: float = 3.0) -> set[bool]:
    seen, deadline = set(), time.monotonic() + seconds
    while time.monotonic() < deadline and len(seen) < 2:
        seen.add(frozen(group))
        time.sleep(0.002)
    return seen


@pytest.fixture
def busy(make_daemon):
    """The first daemon, policy 3 at max_inst 4: a lone weight-1 workload runs 1/4 of the time."""
    d = make_daemon(extra_args=["--slice-ms", "20"])
    d.write("0/max_inst", "4")
    d.write("0/policy", "3")
    name = f"refu{os.getpid() % 100000000:08d}"
    run = subprocess.Popen([CGPU, "run", "--name", name, "--", CGPU, "workload", "--seconds", "60"],
                           env=dict(os.environ, CGPUD_SOCKET=str(d.socket)), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 15
    while not os.path.isdir(d.path(f"0/{name}")):
        assert time.monotonic() < deadline and run.poll() is None, "the workload did not start"
        time.sleep(0.02)
    state = json.loads((d.state_dir / "state.json").read_text())["state"]
    group = next(i["target"]["path"] for g in state["gpus"] for i in g["instances"] if i["name"] == name)
    assert freezes_and_thaws(group, 10) == {True, False}, "the first daemon does not schedule the workload"
    yield d, group
    run.terminate()
    run.wait(20)


CASES = {
    "same state dir": lambda d, other: {"state_dir": d.state_dir},
    "same socket": lambda d, other: {"socket": d.socket},
    "same mount": lambda d, other: {"mount": d.mount},
    "bad --slice-ms": lambda d, other: {"extra": ["--slice-ms", "0"]},
    "bad --metrics-addr": lambda d, other: {"extra": ["--metrics-addr", "nowhere"]},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_second_start_changes_nothing(case, busy, make_daemon):
    d, group = busy
    other = make_daemon(start=False)
    over = CASES[case](d, other)
    extra = over.pop("extra", [])
    registry = d.state_dir / "enforced.json"
    before = registry.read_bytes()
    cmd = other.command(**over) + extra
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode != 0, f"the second daemon started ({case})"
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert {"same state dir": "state directory", "same socket": "answers on", "same mount": "already served",
            "bad --slice-ms": "--slice-ms", "bad --metrics-addr": "--metrics-addr"}[case] in lines[0], lines[0]
    # nothing of the second one is left: no mount, no socket taking over, no guard's thaw
    if case != "same mount":
        assert not mounted(over.get("mount", other.mount)), "the refused daemon left its mount"
    assert mounted(d.mount) and d.read("version").endswith("\n")
    assert registry.read_bytes() == before, "the first daemon's registry of what it froze was touched"
    assert "thaw" not in r.stderr
    assert freezes_and_thaws(group) == {True, False}, "the first daemon's scheduling changed"
    assert d.alive()


def test_a_metrics_port_in_use_refuses_the_start_and_leaves_no_mount(make_daemon):
    """Issue 21: the metrics port taken (`Address already in use`) was found after the tree was
    mounted, and the refused daemon left a dead mount ("Transport endpoint is not connected")."""
    import socket

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        d = make_daemon(start=False)
        r = subprocess.run(d.command() + ["--metrics-addr", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 1, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]
        assert lines == [f"Error: --metrics-addr 127.0.0.1:{port}: Address already in use; choose another "
                         "HOST:PORT, or `off`"], r.stderr
        assert not mounted(d.mount), "the refused daemon left its mount"
        assert not d.mount.exists() or os.listdir(d.mount) == []  # (a dead mount: ENOTCONN)
        assert not d.socket.exists() or not _answers(d.socket)
    finally:
        holder.close()
    d.start()  # the next start works at once (nothing to clear)
    assert d.read("version").endswith("\n")


def _answers(path) -> bool:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
