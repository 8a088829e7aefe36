"""Shared fixtures for the tier that runs the real thing: `cgpud serve` in a
subprocess, its tree mounted over FUSE, and real programs against it.

`Daemon` owns one daemon and every place it uses (mount point, state
directory, control socket, device directory, log file) under one temporary
directory in /tmp that the unprivileged user can traverse. Nothing here skips:
a missing /dev/fuse, fusermount3 or `cgpud` script fails the test with the
reason (the daemon's own log included).

    def test_x(daemon):                    # one simulated T4, started
        assert daemon.read("0/policy") == "0\\n"
        daemon.write("0/policy", "2")
        daemon.restart()

    @pytest.mark.parametrize("daemon", ["sim:2xT4"], indirect=True)
    def test_y(daemon): ...

    def test_z(make_daemon):               # several, or not started yet
        d = make_daemon(gpus="sim:4xT4", start=False)
        d.start()

Teardown always leaves no process and no mount behind (SIGKILL and
`fusermount3 -uz` as the last resort) and fails the test if it had to.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from fusefs.mount import find_mount
from fusefs.node import Node as TreeNode, walk

# Daemons started by tests serve metrics on a free loopback port (several run
# at once; the default 127.0.0.1:9402 would clash). A test that wants a given
# address passes --metrics-addr.
os.environ.setdefault("CGPUD_METRICS_ADDR", "127.0.0.1:0")

SIM_T4_BYTES = 15109 << 20  # SPEC §8: a Tesla T4 has 15109 MiB

NOBODY = 65534
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


def cgpud_script() -> str:
    """The venv's `cgpud` console script, next to the running interpreter."""
    path = Path(sys.executable).parent / "cgpud"
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: install the package into this venv (pip install -e .)")
    return str(path)


def mounted(path: str | os.PathLike) -> bool:
    """Whether `path` is a mount point now, dead ones included (os.path.ismount
    says False for a dead FUSE mount; /proc/self/mountinfo does not lie)."""
    return find_mount(os.fspath(path)) is not None


def _holds_dev_fuse(pid: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
                return True
        except OSError:
            pass
    return False


def force_unmount(path: str | os.PathLike) -> None:
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        pytest.fail("fusermount3 is missing: apt-get install fuse3")
    subprocess.run([tool, "-uz", os.fspath(path)], capture_output=True)
    if mounted(path):
        subprocess.run(["umount", "-l", os.fspath(path)], capture_output=True)


def shell(cmd: str, *, cwd: str | os.PathLike | None = None, nobody: bool = False,
          timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command line with bash (its messages carry strerror, where dash
    says "I/O error" for every failed write), as root or as nobody."""
    kwargs = dict(capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)
    if nobody:
        kwargs.update(user=NOBODY, group=NOBODY, extra_groups=[])
        kwargs["cwd"] = cwd or "/"
    return subprocess.run(["bash", "-c", cmd], **kwargs)


def as_nobody(cmd: Sequence[str] | str, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` as the unprivileged user nobody (uid/gid 65534, no other
    groups), from /, capturing text output. A string is run by bash."""
    if isinstance(cmd, str):
        cmd = ["bash", "-c", cmd]
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("cwd", "/")
    kwargs.setdefault("timeout", 30)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(list(cmd), user=NOBODY, group=NOBODY, extra_groups=[], **kwargs)


def declared_tree() -> dict[str, TreeNode]:
    """The declared /proc/cgpu_km table (cgpud/tree.py), by display path
    (`N/<name>/weight`), depth first: what the tests expect to find mounted."""
    from cgpud.state.durable import Durable
    from cgpud.core.model import GpuInfo, Node
    from cgpud.state.store import Store
    from cgpud.tree import build

    root = build(Durable(Node([GpuInfo(0, "GPU-test", "test", 1)]), Store("/nonexistent")))
    return dict(walk(root.children))


def concrete(display: str, gpu: int | str = 0, name: str = "") -> str:
    """`N/<name>/weight` -> `0/abcdef012345/weight`."""
    parts = [str(gpu) if p == "N" else name if p == "<name>" else p for p in display.split("/")]
    return "/".join(parts)


_nobody_python: list[str] = []


def nobody_python() -> str:
    """A Python interpreter the unprivileged user can run (the venv's may sit
    under a directory nobody cannot traverse, e.g. /root/.pyenv); stdlib only."""
    if not _nobody_python:
        for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
            try:
                ok = as_nobody([candidate, "-c", "import json, os"]).returncode == 0
            except OSError:
                ok = False
            if ok:
                _nobody_python.append(candidate)
                break
        else:
            pytest.fail("no Python interpreter that uid 65534 can run (tried the venv's and /usr/bin/python3)")
    return _nobody_python[0]


class Daemon:
    """One `cgpud serve` in a subprocess, on its own temporary mount and state.

    Attributes: `mount`, `state_dir`, `socket`, `dev_dir` (Paths, all under
    `base`), `gpus` (the --gpus spec),
    `proc` (the Popen while one is running), `log` (its stdout+stderr file).
    """

    def __init__(self, base: Path, gpus: str = "sim:T4", extra_args: Sequence[str] = ()) -> None:
        self.base = base
        self.gpus = gpus
        self.extra_args = list(extra_args)
        self.mount = base / "mnt"
        self.state_dir = base / "state"
        self.log = base / "daemon.log"
        self.socket = base / "cgpud.sock"
        self.dev_dir = base / "dev"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.killed = False  # the last exit was kill9: a dead mount is expected
        self.served = False  # this object's daemon mounted `mount` at least once

    # ---- life cycle ----------------------------------------------------------

    def command(self, **override: str | os.PathLike) -> list[str]:
        """The `cgpud serve` command line; `override` replaces options by name
        (gpus=, mount=, state_dir=, socket=, dev_dir=)."""
        opts = {"gpus": self.gpus, "mount": self.mount, "state_dir": self.state_dir,
                "socket": self.socket, "dev_dir": self.dev_dir}
        unknown = set(override) - set(opts)
        assert not unknown, f"unknown options {unknown}"
        opts.update(override)
        cmd = [cgpud_script(), "serve"]
        for name, value in opts.items():
            cmd += ["--" + name.replace("_", "-"), os.fspath(value)]
        return cmd + ["--log-level", "info", *self.extra_args]

    def start(self, timeout: float = START_TIMEOUT) -> "Daemon":
        """Start the daemon and wait until the tree answers `version`."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"---- start #{self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.killed = False
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until `mount` is in /proc/self/mountinfo, served by this
        process (it holds /dev/fuse open: so another daemon's mount, or a dead
        one, is not taken for ours) and `version` reads."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last = "not mounted yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(f"cgpud exited with {rc} before serving {self.mount}:\n{self.log_text()}")
            if mounted(self.mount) and _holds_dev_fuse(self.proc.pid):
                self.served = True
                try:
                    with open(self.mount / "version") as f:
                        if f.read().endswith("\n"):
                            return
                except OSError as exc:
                    last = f"reading version: {exc}"
            time.sleep(0.01)
        pytest.fail(f"cgpud did not serve {self.mount} within {timeout} s ({last}):\n{self.log_text()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Send `sig`, wait for the exit, assert the mount is gone; the exit code."""
        assert self.proc is not None and self.alive(), "not running"
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"cgpud did not stop within {timeout} s of {signal.Signals(sig).name}:\n{self.log_text()}")
        assert not mounted(self.mount), f"{self.mount} still mounted after {signal.Signals(sig).name}:\n{self.log_text()}"
        return rc

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, wait, assert a clean exit (0) and no mount left."""
        rc = self.signal_stop(signal.SIGTERM, timeout)
        assert rc == 0, f"cgpud exited {rc} on SIGTERM:\n{self.log_text()}"

    def kill9(self) -> None:
        """SIGKILL: the daemon dies at once and leaves a dead mount behind."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(STOP_TIMEOUT)
        self.killed = True

    def restart(self, timeout: float = START_TIMEOUT) -> "Daemon":
        """Stop cleanly if running (a dead mount from kill9 is left for the
        daemon to clear, as after a crash), then start again."""
        if self.alive():
            self.stop()
        return self.start(timeout)

    def cleanup(self) -> list[str]:
        """Leave no process and no mount. Returns what went wrong on the way
        (a dead mount left by `kill9` is expected and cleared quietly)."""
        problems = []
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                problems.append("ignored SIGTERM (killed)")
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
            else:
                self.killed = False
        if self.served and mounted(self.mount):  # (a mount it never made is not its to clear)
            if not self.killed:
                problems.append("left its mount behind (fusermount3 -uz)")
            force_unmount(self.mount)
            if mounted(self.mount):
                problems.append("mount could not be removed")
        elif not self.served and self.base in Path(self.mount).parents and mounted(self.mount):
            # Its own mount point, mounted by a start that was killed before the
            # fixture saw it serve: clear it quietly (a later rmtree would miss it).
            force_unmount(self.mount)
        self._remove_own_cgroups()
        return problems

    def _remove_own_cgroups(self, timeout: float = 2.0) -> None:
        """A daemon killed with SIGKILL cannot remove the cgroups it made for
        `cgpu run` (<cgroup2>/cgpud/<name>): remove those its state names,
        once their processes are gone. Groups of others are never touched."""
        from cgpud.containers.cgroups import PARENT, remove_when_empty, v2_root

        try:
            state = json.loads((self.state_dir / "state.json").read_text())["state"]
        except (OSError, ValueError, KeyError):
            return
        root = v2_root()
        ours = os.path.join(root, PARENT) + os.sep if root else None
        paths = {i.get("target", {}).get("path", "") for g in state.get("gpus", []) for i in g.get("instances", [])}
        paths = [p for p in paths if ours and p.startswith(ours)]
        remove_when_empty(paths, timeout)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"

    # ---- the tree --------------------------------------------------------------

    def path(self, rel: str = "") -> str:
        return str(self.mount / rel) if rel else str(self.mount)

    def read(self, rel: str) -> str:
        with open(self.mount / rel, "rb") as f:
            return f.read().decode("ascii")

    def value(self, rel: str) -> str:
        """The file's text without its trailing newline (asserted present)."""
        text = self.read(rel)
        assert text.endswith("\n"), f"{rel}: {text!r} does not end in a newline"
        return text[:-1]

    def write(self, rel: str, data: str | bytes) -> int:
        """One open(O_WRONLY)/write/close, like a minimal `echo -n`: raises OSError."""
        if isinstance(data, str):
            data = data.encode()
        fd = os.open(self.mount / rel, os.O_WRONLY)
        try:
            return os.write(fd, data)
        finally:
            os.close(fd)

    def write_errno(self, rel: str, data: str | bytes) -> int:
        """The errno of a write expected to fail (0 if it succeeded)."""
        try:
            self.write(rel, data)
        except OSError as exc:
            return exc.errno
        return 0

    def create(self, gpu: int, name: str) -> None:
        self.write("inst_ctl", f"{gpu}{name}")

    def destroy(self, name: str) -> None:
        self.write("inst_ctl", f"-{name}")

    def gpu_count(self) -> int:
        return sum(1 for n in os.listdir(self.mount) if n.isdigit())

    def instances(self, gpu: int) -> list[str]:
        return sorted(n for n in os.listdir(self.mount / str(gpu)) if (self.mount / str(gpu) / n).is_dir())

    def snapshot(self) -> dict[str, str]:
        """Every readable file's text by relative path, and every directory
        as `path/` -> "" (the whole tree as a reader sees it)."""
        out: dict[str, str] = {}

        def visit(rel: str) -> None:
            for name in sorted(os.listdir(self.mount / rel) if rel else os.listdir(self.mount)):
                child = f"{rel}/{name}" if rel else name
                st = os.lstat(self.mount / child)
                if stat.S_ISDIR(st.st_mode):
                    out[child + "/"] = ""
                    visit(child)
                else:
                    try:
                        out[child] = self.read(child)
                    except OSError as exc:
                        out[child] = f"<{errno.errorcode[exc.errno]}>"

        visit("")
        return out


def _make_base() -> Path:
    base = Path(tempfile.mkdtemp(prefix="cgpud-test-", dir="/tmp"))
    base.chmod(0o755)  # nobody must reach the mount point
    return base


@pytest.fixture
def make_daemon() -> Iterator:
    """A factory: make_daemon(gpus="sim:T4", start=True, extra_args=(), mount=None) -> Daemon.
    Everything it made is stopped, unmounted and removed at teardown."""
    made: list[Daemon] = []

    def factory(gpus: str = "sim:T4", start: bool = True, extra_args: Sequence[str] = (),
                mount: Path | None = None) -> Daemon:
        d = Daemon(_make_base(), gpus, extra_args)
        if mount is not None:  # e.g. another daemon's, to see it refused
            d.mount = Path(mount)
        made.append(d)
        if start:
            d.start()
        return d

    yield factory
    problems = []
    for d in made:
        # A daemon still running at teardown is normal (the test left it up);
        # one that ignores SIGTERM or leaves its mount behind is not.
        problems += [f"cgpud on {d.mount} {p}:\n{d.log_text()}" for p in d.cleanup()]
        if not mounted(d.base / "mnt"):  # never rmtree through a live mount
            shutil.rmtree(d.base, ignore_errors=True)
    assert not problems, "\n".join(problems)


@pytest.fixture
def daemon(request, make_daemon) -> Daemon:
    """A started daemon; `--gpus` from indirect parametrisation (default sim:T4)."""
    return make_daemon(gpus=getattr(request, "param", "sim:T4"))


# CI runs are deterministic (the same examples every run); a developer's runs
# explore new ones.
from hypothesis import settings as _hsettings  # noqa: E402

_hsettings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    _hsettings.load_profile("ci")


# ---- the cluster tier's shared clusters (tests/cluster.py, shared()) ----------------------------


def _shared_cluster(item) -> str | None:
    return getattr(getattr(item, "module", None), "SHARED_CLUSTER", None)


def pytest_collection_modifyitems(items) -> None:
    """The modules that share a cluster (the same SHARED_CLUSTER) run one after another, where the
    first of them runs; every other test keeps its place."""
    first: dict[str, int] = {}
    rank = [(first.setdefault(k, i) if (k := _shared_cluster(it)) else i, i) for i, it in enumerate(items)]
    items[:] = [items[i] for _, i in sorted(rank)]


# ---- make test's two workers (pytest-xdist, -n 2) ------------------------------------------------
# A group runs whole on one worker, its modules one after another; the groups go to the two workers
# as each is free (the most tests first). (Our own scheduler: xdist 3.8's loadgroup marks the node IDs
# in a way pytest 9 no longer reads, and splits every group.) Two groups are more than a module each:
# - "cluster": the modules of the cluster tier (one cluster at a time on a host, TIER_LOCK; the
#   DaemonSet's and Helm's nodes and the image they import);
# - "timed": the modules that time something on this machine (a share, a latency, a stall) with
#   launchers or switchers at real-time priority: one of them at a time, so that no two sets of
#   real-time threads share the two CPUs. Beside them runs the other worker's work at normal
#   priority, as `make test-load`'s CPU hogs do (scripts/test_load.py: each of these files passes
#   there under four hogs).
CLUSTER_GROUP = {"test_cluster.py", "test_cluster_daemonset.py", "test_cluster_dra.py", "test_cluster_dra_health.py",
                 "test_cluster_health.py", "test_cluster_helm.py", "test_cluster_lock.py",
                 "test_cluster_security.py", "test_modes.py", "test_image.py"}
TIMED_GROUP = {"test_deep_queue.py", "test_shared_pages.py", "test_gate.py", "test_switcher.py", "test_sched_real.py",
               "test_graphs.py", "test_policies.py", "test_cupy.py", "test_gang.py", "test_enforce.py",
               "test_activity.py", "test_stub_executor.py", "test_podman.py", "test_growth.py", "test_collectives.py",
               "test_core_mem.py", "test_attacks_charge.py", "test_guard.py", "test_service.py",
               "test_drain_bound.py", "test_pools.py", "test_slots.py", "test_runc.py", "test_libcgpu.py",
               "test_mps_standin.py", "test_concurrency.py", "test_load.py"}


def worker_group(module: str) -> str:
    """The group a test module runs in: `cluster`, `timed`, or its own name."""
    return "cluster" if module in CLUSTER_GROUP else "timed" if module in TIMED_GROUP else module


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # (without pytest-xdist: one process, nothing to group)
    pass
else:
    class _ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])

    def pytest_xdist_make_scheduler(config, log):
        return _ByGroup(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of the modules that share a cluster: the cluster ended (the next test
    runs on a host without it)."""
    try:
        return (yield)
    finally:
        key = _shared_cluster(item)
        if key is not None and _shared_cluster(nextitem) != key:
            from cluster import end_shared

            end_shared()
