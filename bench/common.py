"""Shared by the benchmarks: a daemon on a temporary mount, and percentiles."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cgpud_cmd() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "cgpud")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "cgpud.cli.daemon"]


class Running:
    def __init__(self, base: str, proc: subprocess.Popen) -> None:
        self.base, self.proc = base, proc
        self.mount = os.path.join(base, "mnt")
        self.socket = os.path.join(base, "cgpud.sock")

    def env(self) -> dict:
        return dict(os.environ, CGPUD_SOCKET=self.socket)


@contextmanager
def daemon(gpus: str = "sim:T4", extra: list[str] | None = None, handle: bool = False,
           devices: tuple[str, ...] = ()):
    """Yield the mount point (or, with handle=True, a Running) of a running
    daemon on temporary paths; stop it afterwards. `devices`: empty files made
    in its device directory first (what stands for /dev/nvidiaN)."""
    groups_before = _our_groups()
    tmp = tempfile.mkdtemp(prefix="cgpud-bench-")
    for dev in devices:
        os.makedirs(os.path.join(tmp, "dev"), exist_ok=True)
        open(os.path.join(tmp, "dev", dev), "w").close()
    mnt, state = os.path.join(tmp, "mnt"), os.path.join(tmp, "state")
    log = open(os.path.join(tmp, "daemon.log"), "w+")
    proc = subprocess.Popen(
        cgpud_cmd() + ["serve", "--gpus", gpus, "--mount", mnt, "--state-dir", state, "--log-level", "warning",
                       "--socket", os.path.join(tmp, "cgpud.sock"), "--dev-dir", os.path.join(tmp, "dev")]
        + (extra or []),
        stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, CGPUD_METRICS_ADDR=os.environ.get("CGPUD_METRICS_ADDR", "127.0.0.1:0")),
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with open(os.path.join(mnt, "version")) as f:
                    if f.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise SystemExit(f"daemon did not start:\n{log.read()}")
            time.sleep(0.05)
        yield Running(tmp, proc) if handle else mnt
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
        _remove_new_empty_groups(groups_before)


def _our_groups() -> set[str]:
    """The cgroups under the daemon's parent (<cgroup2>/cgpud/), by path."""
    from cgpud.containers.cgroups import PARENT, v2_root

    root = v2_root()
    if root is None:
        return set()
    parent = os.path.join(root, PARENT)
    try:
        return {e.path for e in os.scandir(parent) if e.is_dir()}
    except OSError:
        return set()


def _remove_new_empty_groups(before: set[str], patience: float = 3.0) -> None:
    """Remove the cgroups this run's daemon made for `cgpu run` and left
    behind when it stopped while their processes were still going (the
    groups of a stopped daemon are ours to clear; non-empty ones stay)."""
    from cgpud.containers.cgroups import remove_when_empty

    remove_when_empty(_our_groups() - before, patience, step=0.1)


def tool(name: str) -> str:
    """A console script of this venv (cgpu, cgpu-smi)."""
    return os.path.join(os.path.dirname(sys.executable), name)


def pct(samples: list[float], p: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def us(x: float) -> str:
    return f"{x * 1e6:8.1f} µs"


@contextmanager
def cluster_tier(gpus: str = "sim:2xT4", **cluster_kw):
    """cgpud on simulated `gpus` with the compiled hook, and the real cluster of tests/cluster.py on it
    (Cluster's keywords: bins, containerd_bins); both cleaned up after. Yields (daemon, cluster)."""
    import shutil

    from cluster import Cluster
    from conftest import Daemon, _make_base
    from test_runc import compiled_hook
    from test_runtime import wrapper

    d = Daemon(_make_base(), gpus, ["--hook-path", compiled_hook()])
    d.start()
    c = None
    try:
        c = Cluster(d, wrapper(), **cluster_kw).start()
        yield d, c
    finally:
        if c is not None:
            c.cleanup()
        d.cleanup()
        shutil.rmtree(d.base, ignore_errors=True)
