"""Running under systemd: the unit file, the notify protocol against a real
listening NOTIFY_SOCKET, the watchdog's health check, and the unit's
ExecStartPre (`cgpud clear-mount`) and ExecStopPost (`cgpud thaw`) run
against a real dead mount and real frozen cgroups.

systemd itself is not PID 1 on the test machines: the unit is checked by
`systemd-analyze verify`, its capability set by running the daemon under
`setpriv` with exactly that bounding set and no_new_privs.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tomllib
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from cgpud.core.model import GpuInfo, Node
from cgpud.sched.loop import EventWaiter, GpuScheduler
from cgpud.sched.policies import Params
from cgpud.daemon.systemd import Watchdog, watchdog_interval
from conftest import mounted

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "cgpud.service"
BIN = Path(sys.executable).parent
CGPUD = str(BIN / "cgpud")
INSTALLED = "/usr/local/bin/"
CAP_NUMBERS = {"CAP_DAC_OVERRIDE": 1, "CAP_KILL": 5, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21,
               "CAP_SYS_NICE": 23, "CAP_SYS_RESOURCE": 24}  # linux/capability.h


def unit_lines(key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(key + "=")]


def uniq(tag: str) -> str:
    """A 12-character instance name unique to this test run."""
    return f"{tag}{os.getpid():010d}"[-12:] if len(tag) >= 2 else tag


# ---- the unit file -----------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(tmp_path):
    """The shipped unit names the installed paths (/usr/local/bin, where
    install-service.sh links them); verified with those paths pointing at
    this venv, which `systemd-analyze verify` requires to exist."""
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: apt-get install systemd (scripts/setup.sh)"
    text = UNIT.read_text()
    execs = unit_lines("ExecStartPre") + unit_lines("ExecStart") + unit_lines("ExecStopPost")
    assert execs and all(e.startswith(INSTALLED + "cgpud ") for e in execs), execs
    (tmp_path / "cgpud.service").write_text(text.replace(INSTALLED, str(BIN) + "/"))
    r = subprocess.run([tool, "verify", str(tmp_path / "cgpud.service")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr
    # and it would have said so: an unknown key is reported
    (tmp_path / "cgpud.service").write_text(text.replace(INSTALLED, str(BIN) + "/").replace("[Service]\n", "[Service]\nWatchDogSec=5\n"))
    r = subprocess.run([tool, "verify", str(tmp_path / "cgpud.service")], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in r.stderr


def test_unit_is_a_notify_service_with_watchdog_restart_pre_and_post():
    one = {k: unit_lines(k) for k in ("Type", "WatchdogSec", "Restart", "NoNewPrivileges", "NotifyAccess")}
    assert one == {"Type": ["notify"], "WatchdogSec": ["10s"], "Restart": ["on-failure"],
                   "NoNewPrivileges": ["yes"], "NotifyAccess": ["main"]}
    assert unit_lines("ExecStartPre")[0].split()[1] == "clear-mount"
    assert unit_lines("ExecStopPost")[0].split()[1] == "thaw"
    # The paths the three commands name are the same ones.
    serve = shlex.split(unit_lines("ExecStart")[0])
    assert serve[serve.index("--mount") + 1] in unit_lines("ExecStartPre")[0]
    assert serve[serve.index("--state-dir") + 1] in unit_lines("ExecStopPost")[0]
    # No option that would give the service its own mount namespace: the
    # FUSE mount must reach the host (docs/service.md).
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "ReadWritePaths", "ReadOnlyPaths",
                "ProtectKernelTunables", "ProtectControlGroups", "PrivateDevices", "MountFlags"):
        assert not unit_lines(key), key


def test_each_exec_line_runs_as_written(tmp_path):
    """ExecStartPre and ExecStopPost as the unit writes them (paths moved to
    this venv and a temporary directory) exit 0 on a fresh host."""
    for key in ("ExecStartPre", "ExecStopPost"):
        argv = shlex.split(unit_lines(key)[0].replace(INSTALLED, str(BIN) + "/"))
        argv = [str(tmp_path / a.lstrip("/")) if a.startswith(("/run/", "/var/")) else a for a in argv]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (argv, r.stderr)
        assert "Traceback" not in r.stderr


def test_install_script_stages_the_unit_links_and_hooks(tmp_path):
    (tmp_path / "etc/docker").mkdir(parents=True)  # a host with Docker set up its own way already
    (tmp_path / "etc/docker/daemon.json").write_text('{"log-level": "warn", "runtimes": {"nvidia": {"path": "/n"}}}')
    env = dict(os.environ, DESTDIR=str(tmp_path), CGPUD_BIN=str(BIN))
    r = subprocess.run([str(ROOT / "scripts" / "install-service.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "etc/systemd/system/cgpud.service").read_text() == UNIT.read_text()
    for tool in ("cgpud", "cgpu", "cgpu-smi"):
        link = tmp_path / "usr/local/bin" / tool
        assert os.readlink(link) == str(BIN / tool) and os.access(link, os.X_OK)
    hook = (tmp_path / "etc/containers/oci/hooks.d/cgpu-hook.json").read_text()
    assert '"/usr/local/libexec/cgpu-hook"' in hook
    forwarder = tmp_path / "usr/local/libexec/cgpu-hook"
    assert os.access(forwarder, os.X_OK)
    # the built forwarder works: a container without GPU variables is left alone at once
    state = '{"ociVersion": "1.0.2", "id": "x", "status": "creating", "pid": 1, "bundle": "%s"}' % tmp_path
    (tmp_path / "config.json").write_text('{"process": {"env": ["PATH=/bin"]}}')
    r = subprocess.run([str(forwarder), "createRuntime"], input=state, capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert "CGPUD_GPUS" in (tmp_path / "etc/default/cgpud").read_text()
    # the runtime wrapper, on PATH, and named by Docker's and containerd's settings (theirs kept)
    assert os.readlink(tmp_path / "usr/local/bin/cgpu-runtime") == "/usr/local/libexec/cgpu-runtime"
    assert os.access(tmp_path / "usr/local/libexec/cgpu-runtime", os.X_OK)
    # the in-container library where the daemon's --libcgpu looks by default (issue 21: it was missing)
    assert (tmp_path / "usr/local/lib/cgpu/libcgpu.so").read_bytes()[:4] == b"\x7fELF"
    docker = json.loads((tmp_path / "etc/docker/daemon.json").read_text())
    assert docker == {"log-level": "warn", "runtimes": {"nvidia": {"path": "/n"},
                                                        "cgpu": {"path": "/usr/local/bin/cgpu-runtime"}}}
    toml = tomllib.loads((tmp_path / "etc/containerd/config.toml").read_text())
    runtime = toml["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["cgpu"]
    assert runtime == {"runtime_type": "io.containerd.runc.v2", "container_annotations": ["cgpu.aliyun.com/allocation-*"],
                       "options": {"BinaryName": "/usr/local/bin/cgpu-runtime"}}
    again = subprocess.run([str(ROOT / "scripts" / "install-service.sh")], env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and "set already" in again.stdout, again.stderr


def test_the_unit_capabilities_are_enough(make_daemon):
    """The daemon under exactly the unit's CapabilityBoundingSet and
    no_new_privs: it mounts, runs real-time, freezes a real `cgpu run`
    process's cgroup, and unmounts on SIGTERM."""
    caps = unit_lines("CapabilityBoundingSet")[0].split()
    bounding = "-all," + ",".join("+" + c.lower().removeprefix("cap_") for c in caps)
    d = make_daemon(start=False, extra_args=["--rt-priority", "5"])
    prefix = ["setpriv", "--no-new-privs", f"--bounding-set={bounding}"]
    original = d.command
    d.command = lambda **kw: prefix + original(**kw)  # type: ignore[method-assign]
    d.start()
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    assert "NoNewPrivs:\t1" in status
    bnd = int(re.search(r"CapBnd:\t([0-9a-f]+)", status).group(1), 16)
    ours = int(re.search(r"CapBnd:\t([0-9a-f]+)", Path("/proc/self/status").read_text()).group(1), 16)
    assert bnd == sum(1 << CAP_NUMBERS[c] for c in caps) & ours  # (a container may lack some itself)
    assert os.sched_getscheduler(d.proc.pid) & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR
    assert "real-time SCHED_RR" in d.log_text()
    name = uniq("cp")
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    d.write("0/policy", "0")  # fair: 2 instances of 16 slots, mostly frozen
    d.write("default_memsize", str(64 << 20))
    runs = [subprocess.Popen([str(BIN / "cgpu"), "run", "--name", n, "--", str(BIN / "cgpu"), "workload",
                              "--seconds", "30"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for n in (name, name[:-1] + "x")]
    try:
        from test_sched_real import wait_frozen

        for n in (name, name[:-1] + "x"):
            deadline = time.monotonic() + 15
            while not os.path.isdir(d.path(f"0/{n}")):
                assert time.monotonic() < deadline, d.log_text()
                time.sleep(0.02)
            wait_frozen(n, timeout=10)
        assert "permission" not in d.log_text().lower(), d.log_text()
    finally:
        for p in runs:
            p.terminate()
        for p in runs:
            p.wait(15)
    d.stop()


# ---- the notify protocol -------------------------------------------------------------------


class NotifyListener:
    """A real AF_UNIX datagram socket standing where systemd's would; a
    thread reads it as systemd does, so senders never find it full."""

    def __init__(self, path: Path) -> None:
        import queue

        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                m = self.sock.recv(4096).decode()
            except OSError:
                return
            self.messages.append(m)
            self._queue.put(m)

    def next(self, timeout: float = 20.0) -> str:
        import queue

        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no notify message within {timeout} s")

    def wait_for(self, message: str, timeout: float = 20.0) -> list[str]:
        """Messages up to and including `message`."""
        seen = []
        deadline = time.monotonic() + timeout
        while True:
            m = self.next(max(0.1, deadline - time.monotonic()))
            seen.append(m)
            if m == message:
                return seen

    def count(self, message: str) -> int:
        return self.messages.count(message)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def test_ready_after_the_tree_answers_watchdog_pings_stopping_on_sigterm(make_daemon, monkeypatch):
    d = make_daemon(start=False)
    listener = NotifyListener(d.base / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a ping every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        with open(d.log, "ab") as log:
            d.proc = subprocess.Popen(d.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        d.served = True
        first = listener.next()
        assert first == "READY=1", d.log_text()
        # At READY=1, the tree is there and answers a real `cat` at once.
        assert mounted(d.mount)
        r = subprocess.run(["cat", d.path("version"), d.path("0/policy")], capture_output=True, text=True, timeout=5)
        assert r.returncode == 0 and r.stdout.endswith("\n"), r.stderr
        pings = [listener.next() for _ in range(5)]
        assert pings == ["WATCHDOG=1"] * 5
        d.proc.send_signal(signal.SIGTERM)
        rest = listener.wait_for("STOPPING=1")
        assert set(rest) <= {"WATCHDOG=1", "STOPPING=1"}
        assert d.proc.wait(15) == 0
        assert not mounted(d.mount)
        assert "READY=1" not in rest
    finally:
        listener.close()


def test_no_pings_without_watchdog_usec_or_for_another_pid():
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}, pid=7) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "7"}, pid=7) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "8"}, pid=7) is None


class StuckWaiter(EventWaiter):
    """A scheduler's sleep that stops waking up once `stuck` is set: what a
    wedged scheduler looks like from outside (its boundary passes, nothing
    happens)."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = False

    async def wait_until(self, deadline: float) -> None:
        if self.stuck:
            await trio.sleep_forever()
        await super().wait_until(deadline)


class Recorder:
    def __init__(self) -> None:
        self.frozen: set[str] = set()

    def freeze(self, gpu, name):
        self.frozen.add(name)

    def thaw(self, gpu, name):
        self.frozen.discard(name)

    def active(self, gpu, name):
        return True


def test_watchdog_stops_pinging_while_a_scheduler_or_the_tree_is_wedged(tmp_path):
    """Pings go to a real datagram socket; they stop while a scheduler misses
    its boundaries or the tree's probe hangs, and come back when the probe
    answers again."""
    listener = NotifyListener(tmp_path / "n.sock")
    node = Node([GpuInfo(0, "GPU-x", "Sim", 16 << 30)])
    node.set_default_memsize(1 << 30)
    node.set_policy(0, 1)
    for n in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        node.create_instance(0, n)
    waiter = StuckWaiter()
    rec = Recorder()
    sched = GpuScheduler(node, 0, rec, rec, params=Params(slice=0.02), waiter=waiter)
    release = threading.Event()
    hang = threading.Event()

    def probe() -> None:
        if hang.is_set():
            release.wait(30)

    def send(msg: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(msg.encode(), str(listener.path))

    dog = Watchdog(0.1, [sched], probe=probe, send=send)
    phases: dict[str, int] = {}

    def pings() -> int:  # as the listening socket saw them
        return listener.count("WATCHDOG=1")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            await nursery.start(dog.run)
            await trio.sleep(1.0)
            phases["healthy"] = pings()
            hang.set()  # the tree stops answering
            await trio.sleep(0.3)
            before = pings()
            await trio.sleep(1.0)
            phases["tree wedged"] = pings() - before
            hang.clear()
            release.set()
            await trio.sleep(0.5)
            before = pings()
            await trio.sleep(1.0)
            phases["tree back"] = pings() - before
            waiter.stuck = True  # the scheduler's next sleep never ends
            await trio.sleep(dog.grace + 0.5)
            before = pings()
            await trio.sleep(1.0)
            phases["scheduler wedged"] = pings() - before
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert phases["healthy"] >= 3, phases
        assert phases["tree wedged"] == 0, phases
        assert phases["tree back"] >= 3, phases
        assert phases["scheduler wedged"] == 0, phases
        deadline = time.monotonic() + 5
        while len(listener.messages) < dog.pings and time.monotonic() < deadline:
            time.sleep(0.01)  # (the reader thread may not have taken the last one yet)
        assert listener.messages == ["WATCHDOG=1"] * dog.pings
    finally:
        listener.close()


# ---- ExecStartPre / ExecStopPost -------------------------------------------------------------


def _guard_pids(daemon_pid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cgpud.sched.guard" in cmd and str(daemon_pid).encode() in cmd:
            out.append(int(pid))
    return out


def test_after_a_crash_that_took_the_guard_too_thaw_and_clear_mount_recover(make_daemon):
    """kill -9 of the guard and the daemon while they hold two `cgpu run`
    workloads frozen: `cgpud thaw` (ExecStopPost) thaws both; `cgpud
    clear-mount` (ExecStartPre) clears the dead mount and the next start
    serves the same instances."""
    from test_sched_real import frozen, wait_frozen

    d = make_daemon()
    d.write("0/policy", "0")
    d.write("default_memsize", str(64 << 20))
    names = [uniq("ta"), uniq("tb")]
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    runs = [subprocess.Popen([str(BIN / "cgpu"), "run", "--name", n, "--", str(BIN / "cgpu"), "workload",
                              "--seconds", "60"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for n in names]
    try:
        for n in names:
            deadline = time.monotonic() + 15
            while not os.path.isdir(d.path(f"0/{n}")):
                assert time.monotonic() < deadline, d.log_text()
                time.sleep(0.02)
        deadline = time.monotonic() + 15
        while not all(frozen(n) for n in names):  # fair policy, 16 slots: both are off most of the time
            assert time.monotonic() < deadline, "never saw both frozen at once"
            time.sleep(0.001)
        guards = _guard_pids(d.proc.pid)
        assert guards, "no guard process"
        os.kill(d.proc.pid, signal.SIGSTOP)  # no scheduling and no new guard from here on
        for g in guards:
            os.kill(g, signal.SIGKILL)
        d.kill9()
        assert all(frozen(n) for n in names)  # what the crash leaves behind
        assert mounted(d.mount)
        r = subprocess.run([CGPUD, "thaw", "--state-dir", str(d.state_dir)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert all(not frozen(n) for n in names)
        assert r.stdout.count(": thawed") == 2, r.stdout
        r = subprocess.run([CGPUD, "clear-mount", "--mount", str(d.mount)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "cleared the dead mount" in r.stdout, r.stdout + r.stderr
        assert not mounted(d.mount)
        d.start()
        assert sorted(n for n in names if os.path.isdir(d.path(f"0/{n}"))) == sorted(names)
        wait_frozen(names[0], timeout=10)  # and it schedules them again
    finally:
        for p in runs:
            p.terminate()
        for p in runs:
            p.wait(15)


def test_clear_mount_leaves_a_live_mount_and_a_foreign_one_alone(daemon, tmp_path):
    r = subprocess.run([CGPUD, "clear-mount", "--mount", daemon.path()], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "live daemon" in r.stdout
    assert daemon.read("version")
    r = subprocess.run([CGPUD, "clear-mount", "--mount", "/proc"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "not ours" in r.stdout
    r = subprocess.run([CGPUD, "clear-mount", "--mount", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "nothing to clear" in r.stdout


def test_thaw_with_an_unreadable_registry_is_one_line(tmp_path):
    (tmp_path / "enforced.json").write_text("{not json")
    r = subprocess.run([CGPUD, "thaw", "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "enforced.json" in r.stderr
