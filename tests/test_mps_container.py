"""An MPS client in a real container (issue 37): a runc container given what the device plugin's
Allocate gives a container on an `mps` node (tests/test_modes.py checks that response: the
variables of resources.mps_environment, the pipe directory and the shm mounted at the paths
resources.MPS_PIPE_DIR and /dev/shm), the stand-in control daemon running on the host with its
pipe directory there. Inside, the stand-in libcuda connects through the mounted pipe directory and
is held to its pinned limit; a container without the pipe directory makes no context while the
server holds the card (NVIDIA: MPS clients and server share the pipe directory and the shm)."""
from __future__ import annotations

import os

import pytest

from cgpud.k8s import resources as res
from mps_standin import Mps, build
from test_runc import Runc, template  # noqa: F401  (fixture)

OOM, DEVICE_UNAVAILABLE = 2, 46


def bind(src, dst, ro=True) -> dict:
    return {"destination": os.fspath(dst), "type": "bind", "source": os.fspath(src),
            "options": ["rbind", "ro" if ro else "rw"]}


@pytest.fixture
def setting(tmp_path, template):  # noqa: F811
    libs = build(tmp_path / "libs")
    m = Mps(libs, tmp_path)
    m.start()
    r = Runc(tmp_path, template, tmp_path / "no-daemon.sock")
    (tmp_path / "shm").mkdir()
    yield m, r
    r.cleanup()
    m.stop()


def run(m: Mps, r: Runc, env: dict[str, str], mps_mounts: bool) -> dict[str, list[int]]:
    mounts = [bind("/lib", "/lib"), bind("/lib64", "/lib64"), bind(m.libs, "/share"),
              bind(m.tmp, m.tmp, ro=False)]  # (the stand-in card's state file, at the same path)
    if mps_mounts:  # Allocate's: the pipe directory, and the shm at /dev/shm
        mounts += [bind(m.pipe, res.MPS_PIPE_DIR, ro=False), bind(m.tmp / "shm", "/dev/shm", ro=False)]
    env = {"LD_LIBRARY_PATH": "/share", "CGPU_STUB_CUDA_STATE": m.env["CGPU_STUB_CUDA_STATE"], **env}
    b = r.bundle(env, ["/share/mps-client", "alloc", "48", "32"], mounts=mounts, hooks={})
    _, p = r.run(b, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    out: dict[str, list[int]] = {}
    for line in p.stdout.splitlines():
        what, _, value = line.partition(" ")
        out.setdefault(what, []).append(int(value))
    return out


def test_a_container_with_allocates_mounts_is_an_mps_client_held_to_its_limit(setting):
    m, r = setting
    # what Allocate gives a container of 64 MiB's share: its variables, the pipe directory at MPS_PIPE_DIR
    env = {"CUDA_MPS_PIPE_DIRECTORY": res.MPS_PIPE_DIR, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=64M",
           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert run(m, r, env, mps_mounts=True) == {"init": [0], "ctx": [0], "alloc": [0, OOM]}
    # the server runs now; a container without the pipe directory: no MPS, and no context beside the server
    assert run(m, r, env, mps_mounts=False) == {"init": [0], "ctx": [DEVICE_UNAVAILABLE]}
    # ... the client the host's daemon served was the container's (its log says a client came)
    assert "NEW CLIENT" in (m.logs / "control.log").read_text()
