"""The node daemon finds the driver in the DaemonSet (issue 21): on a node without
NVIDIA's container toolkit the host's root is mounted and --driver-root names it;
libnvidia-ml.so.1 (here the NVML stand-in, laid out as drivers install it: a
versioned file and the soname's link, relative or absolute) is loaded from the
driver's directories below it. A node with no driver says so in one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from nvml_stub import T4_TOTAL, NvmlStub, StubGpu

UUID = "GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab"


@pytest.fixture
def stub(tmp_path) -> NvmlStub:
    s = NvmlStub.build(tmp_path)
    s.gpus = [StubGpu(UUID, "Tesla T4", T4_TOTAL)]
    s.write()
    return s


def env_without_loader_path(stub: NvmlStub, **extra) -> dict[str, str]:
    env = {k: v for k, v in stub.env().items() if k != "LD_LIBRARY_PATH"}
    return {**env, **extra}


def host_with_driver(tmp_path, stub, libdir: str, absolute: bool):
    host = tmp_path / "host"
    d = host / libdir
    d.mkdir(parents=True)
    shutil.copy(stub.libdir / "libnvidia-ml.so.1", d / "libnvidia-ml.so.550.54.15")
    (d / "libnvidia-ml.so.1").symlink_to(f"/{libdir}/libnvidia-ml.so.550.54.15" if absolute else
                                         "libnvidia-ml.so.550.54.15")
    return host


DISCOVER = ("import dataclasses, json; from cgpud.gpus import discover; "
            "print(json.dumps([g.uuid for g in discover('nvml')]))")


@pytest.mark.parametrize("libdir, absolute", [("usr/lib/x86_64-linux-gnu", False), ("usr/lib64", True),
                                              ("run/nvidia/driver/usr/lib/x86_64-linux-gnu", False)])
def test_the_hosts_library_is_found_below_the_driver_root(tmp_path, stub, libdir, absolute):
    import sys

    host = host_with_driver(tmp_path, stub, libdir, absolute)
    r = subprocess.run([sys.executable, "-c", DISCOVER], env=env_without_loader_path(stub), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "libnvidia-ml.so.1 is not on this machine" in r.stderr  # the loader alone: none
    r = subprocess.run([sys.executable, "-c", DISCOVER], capture_output=True, text=True, timeout=30,
                       env=env_without_loader_path(stub, CGPUD_DRIVER_ROOT=os.fspath(host)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [UUID]


def test_a_node_with_no_driver_says_so_in_one_line(tmp_path, stub, make_daemon):
    (tmp_path / "host" / "usr" / "lib").mkdir(parents=True)
    d = make_daemon(gpus="nvml", start=False)
    r = subprocess.run(d.command() + ["--driver-root", os.fspath(tmp_path / "host")], capture_output=True, text=True,
                       timeout=60, env=env_without_loader_path(stub), stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: NVML not available: "), r.stderr
    assert f"nor below --driver-root {tmp_path / 'host'}" in r.stderr
    assert not os.path.ismount(d.mount)


def test_the_daemon_serves_the_hosts_gpus_through_the_driver_root(tmp_path, stub, make_daemon, monkeypatch):
    host = host_with_driver(tmp_path, stub, "usr/lib/x86_64-linux-gnu", absolute=False)
    for k, v in env_without_loader_path(stub).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setenv("CGPUD_DRIVER_ROOT", os.fspath(host))  # (the DaemonSet's env)
    d = make_daemon(gpus="nvml", start=False)
    d.dev_dir.mkdir()
    (d.dev_dir / "nvidia0").write_text("")
    d.start()
    from cgpud.client import Client

    with Client(str(d.socket)) as c:
        hello = c.call("hello")
    assert hello["gpus"] == 1 and hello["devices"] == [os.fspath(d.dev_dir / "nvidia0")]
