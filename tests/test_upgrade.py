"""Hot and cold upgrade (SPEC §7, docs/upgrade.md) on a real daemon.

A reader process loops GNU `cat` over several nodes of the real mount while
`echo 1 > upgrade` hands the daemon to a freshly started one (the code on
disk): no read may fail, every value must be the one set before, instances
and settings stay, and a `cgpu run` workload keeps running, keeps its
connection (it deregisters through it at the end) and its simulated memory,
and is frozen again by the new daemon's scheduler.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.client import Client
from conftest import _holds_dev_fuse, mounted, shell

CGPU = str(Path(sys.executable).parent / "cgpu")
CGPUD = str(Path(sys.executable).parent / "cgpud")
PR_SET_CHILD_SUBREAPER = 36


class Adopted:
    """A daemon started by a hot upgrade: the child of the daemon before it.
    With this process a subreaper it becomes our child once that one exits,
    so we can wait for it and see its exit status (as Popen would)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return None if os.path.exists(f"/proc/{self.pid}") else 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@pytest.fixture
def subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def daemon_pid(d) -> int:
    with Client(str(d.socket)) as c:
        return c.call("hello")["pid"]


def upgrade(d, timeout: float = 30.0) -> str:
    """`echo 1 > upgrade` with bash, then follow the handover: the old daemon
    exits 0, the new one serves the mount and answers on the socket. The
    final `upgrade` text."""
    old = d.proc
    r = shell(f"echo 1 > {d.path('upgrade')}")
    assert r.returncode == 0, f"{r.stderr}\n{d.log_text()}"
    assert old.wait(timeout) == 0, d.log_text()  # the old daemon hands over, then ends cleanly
    new = Adopted(daemon_pid(d))
    assert new.pid != old.pid
    d.proc = new
    assert _holds_dev_fuse(new.pid) and mounted(d.mount)
    return d.value("upgrade")


class Reader:
    """A bash loop of GNU `cat` over `files` of the mount until stopped;
    every read's outcome is one line of its output."""

    def __init__(self, d, files: list[str]) -> None:
        self.stop_file = d.base / "reader.stop"
        self.out = d.base / "reader.out"
        # (a value of several lines, meminfo, is printed on one, joined by "|")
        cmds = "; ".join(f'v=$(cat {d.path(f)}) && echo "{f}=${{v//$\'\\n\'/|}}" || echo "FAILED {f}"' for f in files)
        self.proc = subprocess.Popen(
            ["bash", "-c", f"while [ ! -e {self.stop_file} ]; do {cmds}; done > {self.out} 2>&1"])

    def count(self) -> int:
        try:
            return len(self.out.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def finish(self) -> list[str]:
        self.stop_file.touch()
        self.proc.wait(20)
        return self.out.read_text().splitlines()


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def frozen(path: str) -> bool:
    with open(os.path.join(path, "cgroup.events")) as f:
        return "frozen 1" in f.read()


def test_hot_upgrade_keeps_everything_and_no_read_fails(make_daemon, subreaper):
    d = make_daemon(extra_args=["--slice-ms", "50"])
    run_name = f"upgr{os.getpid() % 100000000:08d}"
    static = f"upgs{os.getpid() % 100000000:08d}"
    d.write("default_memsize", str(1 << 30))
    d.write("0/max_inst", "4")
    d.write("0/prio_ratio", "70")
    d.create(0, static)
    d.write(f"0/{static}/weight", "2")
    d.write("0/policy", "3")  # fixed shares: a lone workload of weight 1 runs 1/4 of the time, frozen the rest
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    run = subprocess.Popen([CGPU, "run", "--name", run_name, "--mem", "256M", "--",
                            CGPU, "workload", "--seconds", "12", "--mem", "64M", "--json", "--interval", "0.01"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.isdir(d.path(f"0/{run_name}")), 15, "the cgpu run instance")
        meminfo = d.path(f"0/{run_name}/meminfo")
        wait_for(lambda: "PID:" in open(meminfo).read(), 15, "the workload's simulated memory")
        group = json.loads((d.state_dir / "state.json").read_text())["state"]
        group = next(i["target"]["path"] for g in group["gpus"] for i in g["instances"] if i["name"] == run_name)
        wait_for(lambda: frozen(group), 10, "the workload frozen by policy 3")
        before = d.snapshot()
        files = ["version", "default_memsize", "0/policy", "0/max_inst", "0/free_weight",
                 f"0/{static}/weight", f"0/{run_name}/memsize", f"0/{run_name}/meminfo"]
        reader = Reader(d, files)
        wait_for(lambda: reader.count() > 20, 10, "the reader to start")
        old_pid = d.proc.pid
        n0 = reader.count()
        first = upgrade(d)
        assert first.startswith("done "), first
        n1 = reader.count()
        second = upgrade(d)  # a second upgrade works too (the adopted daemon hands over in turn)
        assert second.startswith("done "), second

        def scheduled() -> bool:  # by the new daemon's own scheduler (its telemetry starts at 0)
            with Client(str(d.socket)) as c:
                st = c.call("stats")  # (empty until the scheduler publishes its first figures)
            return bool(st) and st[0]["freezes"] >= 2 and st[0]["thaws"] >= 2

        wait_for(scheduled, 10, "freezes and thaws by the newest daemon")
        wait_for(lambda: frozen(group), 10, "the workload frozen again")
        lines = reader.finish()
        after = d.snapshot()
    finally:
        out, err = run.communicate(timeout=60)
    assert n1 > n0, "the reader made no read during the first upgrade"
    failed = [line for line in lines if line.partition("=")[0] not in files]
    assert failed == [], f"{len(failed)} failed reads of {len(lines)}: {failed[:5]}\n{d.log_text()}"
    # every read showed the value set before (the workload's memory included)
    expect = {f: before[f].rstrip("\n").replace("\n", "|") for f in files}
    wrong = [line for line in lines if line.split("=", 1)[1] != expect[line.split("=", 1)[0]]]
    assert wrong == [], wrong[:5]
    assert {k: v for k, v in after.items() if k != "upgrade"} == {k: v for k, v in before.items() if k != "upgrade"}
    assert d.proc.pid != old_pid
    # the workload ran through both upgrades, was scheduled again (frozen by the new daemon),
    # and `cgpu run` deregistered through its handed-over connection
    assert run.returncode == 0, err
    assert "could not deregister" not in err, err
    samples = [json.loads(x) for x in out.splitlines() if x.strip()]
    assert samples[-1]["iterations"] > 0
    assert run_name not in d.instances(0)
    log = d.log_text()
    assert log.count("hot upgrade: taking over from pid") == 2, log


def test_failed_upgrade_changes_nothing_and_says_why(daemon, subreaper):
    """The new daemon cannot start (here: it cannot read the state file):
    the write fails with EIO, `upgrade` says why, the old daemon serves on."""
    d = daemon
    d.write("0/policy", "2")
    pid = d.proc.pid
    state = d.state_dir / "state.json"
    good = state.read_bytes()
    state.write_bytes(b"{not json")
    try:
        r = shell(f"echo 1 > {d.path('upgrade')}")
    finally:
        state.write_bytes(good)
    assert r.returncode != 0 and "Input/output error" in r.stderr, r
    status = d.value("upgrade")
    assert status.startswith("failed: the new daemon did not get ready"), status
    assert d.alive() and daemon_pid(d) == pid and d.value("0/policy") == "2"
    d.write("0/policy", "1")  # still serving writes
    assert d.value("0/policy") == "1"
    assert upgrade(d).startswith("done ")  # and a later upgrade works
    assert d.value("0/policy") == "1"


def test_cold_upgrade_refused_with_instances_done_without(daemon):
    d = daemon
    name = f"cold{os.getpid() % 100000000:08d}"
    d.create(0, name)
    r = subprocess.run([CGPUD, "upgrade", "--cold", "--socket", str(d.socket)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0] and name in lines[0] and "instance" in lines[0], r.stderr
    assert d.alive() and name in d.instances(0)
    d.destroy(name)
    r = subprocess.run([CGPUD, "upgrade", "--cold", "--socket", str(d.socket)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "stopping" in r.stdout
    assert d.proc.wait(15) == 75  # the service manager restarts it (Restart=on-failure)
    assert not mounted(d.mount)
    d.start()  # "the service manager": the code on disk, same state
    assert d.value("upgrade") == "none"


def test_writes_and_socket_clients_through_an_upgrade(daemon, subreaper):
    """Tree writes (settings and inst_ctl churn), a client registering and
    deregistering on one long-lived connection, clients on fresh
    connections, and directory listings, all during a hot upgrade: none sees
    an error, and every acknowledged change is there after. Files opened
    before the upgrade are read and written after it."""
    import threading

    d = daemon
    d.write("default_memsize", str(1 << 30))
    toggled = f"upgw{os.getpid() % 100000000:08d}"
    stop = threading.Event()
    errors: list[str] = []
    acked: dict[str, str] = {}
    counts = {"writes": 0, "queries": 0, "connects": 0, "lists": 0}

    def writer() -> None:
        exists, i = False, 0
        while not stop.is_set():
            i += 1
            try:
                d.write("0/prio_ratio", str(20 + i % 80))
                acked["0/prio_ratio"] = str(20 + i % 80)
                d.write("inst_ctl", ("-" if exists else "0") + toggled)
                exists = not exists
                acked["toggled"] = "exists" if exists else "absent"
                counts["writes"] += 2
            except OSError as exc:
                errors.append(f"write: {exc}")
                return

    registered = f"upgc{os.getpid() % 100000000:08d}"

    def long_client() -> None:  # registers and deregisters (instances vanish: dentries invalidated)
        try:
            with Client(str(d.socket)) as c:
                while not stop.is_set():
                    c.call("register", name=registered, gpus=[0], memsize=1 << 26)
                    acked["registered"] = "exists"
                    c.call("query")
                    c.call("deregister", name=registered)
                    acked["registered"] = "absent"
                    counts["queries"] += 1
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(f"socket: {exc!r}")

    def lister() -> None:  # lookups in the directory whose entries come and go
        while not stop.is_set():
            try:
                for n in os.listdir(d.path("0")):
                    try:
                        os.stat(d.path(f"0/{n}"))
                    except FileNotFoundError:
                        pass  # it went between the listing and the stat
                counts["lists"] += 1
            except OSError as exc:
                errors.append(f"list: {exc!r}")
                return

    def fresh_clients() -> None:
        while not stop.is_set():
            try:
                with Client(str(d.socket)) as c:
                    c.call("hello")
                counts["connects"] += 1
            except Exception as exc:  # noqa: BLE001
                errors.append(f"connect: {exc!r}")
                return

    threads = [threading.Thread(target=f, daemon=True) for f in (writer, long_client, fresh_clients, lister)]
    for t in threads:
        t.start()
    wait_for(lambda: min(counts.values()) > 5, 10, "the clients to get going")
    before = dict(counts)
    # files and a directory opened before the upgrade, used after it (the same handles)
    rfd = os.open(d.path("0/max_inst"), os.O_RDONLY)
    wfd = os.open(d.path("0/policy"), os.O_WRONLY)
    dfd = os.open(d.path("0"), os.O_RDONLY | os.O_DIRECTORY)
    assert upgrade(d).startswith("done ")
    try:
        assert os.pread(rfd, 100, 0) == b"16\n"
        assert os.write(wfd, b"3") == 1 and d.value("0/policy") == "3"
        assert "max_inst" in os.listdir(dfd)
    finally:
        for fd in (rfd, wfd, dfd):
            os.close(fd)
    wait_for(lambda: all(counts[k] > before[k] + 5 for k in counts), 10, "the clients to go on after the upgrade")
    stop.set()
    for t in threads:
        t.join(20)
    assert errors == [], "\n".join(l for l in d.log_text().splitlines() if "registered" not in l)
    assert d.value("0/prio_ratio") == acked["0/prio_ratio"]
    assert (toggled in d.instances(0)) == (acked["toggled"] == "exists")
    assert (registered in d.instances(0)) == (acked["registered"] == "exists")


def test_new_daemon_stuck_after_ready_rolls_back(daemon, subreaper):
    """The new daemon stops answering after `ready` (SIGSTOP): the old one
    gives up after its timeout, kills it, and serves again with its mount,
    socket, connections and scheduler; `upgrade` says why."""
    import re
    import threading

    d = daemon
    d.write("0/policy", "2")
    pid = d.proc.pid
    client = Client(str(d.socket))  # a connection held across the attempt
    client.call("hello")
    for attempt in range(3):
        seen = len(d.log_text())
        stopped: list[int] = []

        def stop_new() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                m = re.search(r"the new daemon \(pid (\d+), version [^)]*\) is ready", d.log_text()[seen:])
                if m:
                    os.kill(int(m.group(1)), signal.SIGSTOP)
                    stopped.append(int(m.group(1)))
                    return
                time.sleep(0.0005)

        t = threading.Thread(target=stop_new, daemon=True)
        t.start()
        r = shell(f"echo 1 > {d.path('upgrade')}")
        t.join(60)
        assert r.returncode == 0 and stopped, (r.stderr, d.log_text())
        wait_for(lambda: d.value("upgrade") != "in progress", 30, "the attempt to end")
        if d.value("upgrade").startswith("failed"):
            break
        # the new daemon was quicker than SIGSTOP: it serves; follow it and try again
        os.kill(stopped[0], signal.SIGCONT)
        d.proc.wait(10)
        d.proc = Adopted(daemon_pid(d))
        pid = d.proc.pid
        client.close()
        client = Client(str(d.socket))
    assert d.value("upgrade") == "failed: the new daemon did not answer in time", d.log_text()
    assert daemon_pid(d) == pid and d.alive()
    assert not os.path.exists(f"/proc/{stopped[0]}") or open(f"/proc/{stopped[0]}/stat").read().split()[2] == "Z"
    assert client.call("hello")["pid"] == pid  # the held connection works on
    client.close()
    assert d.value("0/policy") == "2"
    d.write("0/policy", "1")
    assert d.value("0/policy") == "1"
    with Client(str(d.socket)) as c:
        wait_for(lambda: bool(c.call("stats")), 10, "the scheduler to run again")


def test_systemd_learns_the_new_main_pid(make_daemon, subreaper, monkeypatch, tmp_path):
    """Under a notify-aware service manager: the old daemon (the main PID)
    names the new one with MAINPID= before it exits, and does not say
    STOPPING=1; the new one says READY=1."""
    import socket
    import struct

    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    d = make_daemon()
    old = d.proc.pid
    upgrade(d)
    new = d.proc.pid
    sock.setblocking(False)
    said: list[tuple[int, str]] = []
    while True:
        try:
            data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except BlockingIOError:
            break
        pid = next(struct.unpack("3i", c[2][:12])[0] for c in anc if c[1] == socket.SCM_CREDENTIALS)
        said.append((pid, data.decode()))
    sock.close()
    assert (old, "READY=1") in said and (old, f"MAINPID={new}") in said, said
    assert (new, "READY=1") in said, said
    assert not any(pid == old and text.startswith("STOPPING") for pid, text in said), said


def test_metrics_port_follows_a_hot_upgrade(make_daemon, subreaper):
    """A fixed --metrics-addr: the old daemon holds the port until it exits;
    the new one serves it afterwards, with the same instances."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon(extra_args=["--metrics-addr", f"127.0.0.1:{port}"])
    d.write("default_memsize", "1073741824")
    name = f"mu{os.getpid() % 100000:05d}upgra"
    d.create(0, name)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    assert f'container="{name}"' in scrape()
    upgrade(d)
    deadline = time.monotonic() + 15
    while True:
        try:
            text = scrape()
            break
        except OSError:
            assert time.monotonic() < deadline, f"no metrics on port {port} after the upgrade\n{d.log_text()}"
            time.sleep(0.1)
    assert f'container="{name}"' in text
    assert "metrics: cannot serve" not in d.log_text()
