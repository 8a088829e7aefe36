"""The DaemonSet's image builds here and its containers run from it (issue 21).

`scripts/build-image.sh` builds deploy/kubernetes/Containerfile with podman from
a Debian 12 base made here by debootstrap (imported under the Containerfile's
base name; podman's own storage keeps it and the build's layers, so a second
run takes seconds). Then the DaemonSet's containers, with the commands and
environment the rendered kustomization gives them:

- the init container (`cgpu node install --host-root /host`) against a
  directory standing for a containerd 2.x host: the programs it copies are
  static (any host's libc), containerd's version 3 config gets the runtime,
  the host's `systemctl` (a stand-in: no systemd runs here) restarts
  containerd; its second run writes nothing;
- the node daemon on a host with no driver: one line in its log;
- the node daemon on a host whose driver (the NVML stand-in) is below the
  mounted root, privileged as the DaemonSet runs it: it serves the tree;
- the device plugin's and the extender's programs answer --help.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import cgpud
from nvml_stub import T4_TOTAL, NvmlStub, StubGpu
from test_manifests import RENDERED, containers
from test_runc import _tool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TAG = f"localhost/cgpud:{cgpud.__version__}-test"


def node_pod() -> dict[str, dict]:
    ds = next(d for d in RENDERED if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpud")
    return {c["name"]: c for c in containers(ds)}


def extender_pod() -> dict:
    ds = next(d for d in RENDERED if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpu-scheduler-extender")
    return containers(ds)[0]


@pytest.fixture(scope="module")
def image() -> str:
    _tool("podman")
    r = subprocess.run([os.fspath(ROOT / "scripts" / "build-image.sh"), TAG], capture_output=True, text=True,
                       timeout=1200, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return TAG


def podman_run(image: str, container: dict, *extra: str, env: dict | None = None, detach: bool = False,
               timeout: float = 120, command: list[str] | None = None) -> subprocess.CompletedProcess:
    """One of the DaemonSet's containers: its command and environment, as podman runs them here."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    args = ["podman", "run", "--network", "none", "--ulimit", f"nofile={nofile}:{nofile}",
            "--ulimit", "nproc=32768:32768", *(["-d"] if detach else ["--rm"])]
    if (container.get("securityContext") or {}).get("privileged"):
        args.append("--privileged")
    for e in container.get("env", []):
        if "value" in e:
            args += ["-e", f"{e['name']}={e['value']}"]
    for k, v in (env or {}).items():
        args += ["-e", f"{k}={v}"]
    return subprocess.run([*args, *extra, image, *(command or container["command"])], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def is_static(elf: bytes) -> bool:
    """An x86-64 ELF executable with no program interpreter (PT_INTERP): it needs no libc of the host's."""
    import struct

    assert elf[:5] == b"\x7fELF\x02"  # (64-bit)
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    return all(struct.unpack_from("<I", elf, phoff + i * phentsize)[0] != 3 for i in range(phnum))


def host_with_containerd_2(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(
        "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd]\n  default_runtime_name = 'runc'\n"
        "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  runtime_type = 'io.containerd.runc.v2'\n"
        "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n  SystemdCgroup = true\n")
    (host / "bin").mkdir()
    shutil.copy(_tool("busybox"), host / "bin" / "busybox")
    (host / "bin" / "sh").symlink_to("busybox")
    (host / "usr/bin").mkdir(parents=True)
    (host / "usr/bin/systemctl").write_text('#!/bin/sh\necho "$@" >> /systemctl.calls\n')
    (host / "usr/bin/systemctl").chmod(0o755)
    return host


def test_the_init_container_sets_a_containerd_2_host_up_from_the_image(image, tmp_path):
    import tomllib

    host = host_with_containerd_2(tmp_path)
    init = node_pod()["node-install"]
    mount = ["-v", f"{host}:{init['volumeMounts'][0]['mountPath']}"]
    r = podman_run(image, init, *mount)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "cgpu node install: 5 files written, 0 already in place", r.stdout
    assert (host / "systemctl.calls").read_text() == "restart containerd.service\n"
    for program in ("usr/local/bin/cgpu-runtime", "usr/local/libexec/cgpu-hook"):
        assert is_static((host / program).read_bytes()), f"{program} is not static"
    assert (host / "usr/local/lib/cgpu/libcgpu.so").read_bytes()[:4] == b"\x7fELF"
    cri = tomllib.loads((host / "etc/containerd/config.toml").read_text())["plugins"]["io.containerd.cri.v1.runtime"]
    assert cri["containerd"]["default_runtime_name"] == "cgpu"
    assert cri["containerd"]["runtimes"]["cgpu"]["options"] == {"SystemdCgroup": True,
                                                                "BinaryName": "/usr/local/bin/cgpu-runtime"}
    again = podman_run(image, init, *mount)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == ["containerd: cgpu runtime set already",
                                         "cgpu node install: 0 files written, 4 already in place"]
    assert (host / "systemctl.calls").read_text() == "restart containerd.service\n"


def test_the_daemon_container_on_a_node_with_no_driver_says_so_in_one_line(image, tmp_path):
    (tmp_path / "host/usr/lib").mkdir(parents=True)
    r = podman_run(image, node_pod()["cgpud"], "-v", f"{tmp_path / 'host'}:/host:ro")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: NVML not available: "), r.stderr
    assert "nor below --driver-root /host" in r.stderr


def test_the_daemon_container_serves_the_gpus_of_the_hosts_driver(image, tmp_path):
    host = tmp_path / "host"
    stub = NvmlStub.build(tmp_path)
    stub.config = host / "nvml-stub.conf"
    (host / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    shutil.copy(stub.libdir / "libnvidia-ml.so.1", host / "usr/lib/x86_64-linux-gnu" / "libnvidia-ml.so.550.54.15")
    (host / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")
    stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab", "Tesla T4", T4_TOTAL)]
    stub.write()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia0").write_text("")  # (the GPU's device file; the container's /dev is the host's)
    daemon = node_pod()["cgpud"]
    command = [*daemon["command"], "--dev-dir", "/gpudev", "--metrics-addr", "off"]
    r = podman_run(image, daemon, "-v", f"{host}:/host:ro", "-v", f"{tmp_path / 'dev'}:/gpudev", detach=True,
                   env={"CGPU_NVML_STUB": "/host/nvml-stub.conf"}, command=command)
    assert r.returncode == 0, r.stderr
    cid = r.stdout.strip()
    try:
        deadline, out = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            out = subprocess.run(["podman", "exec", cid, "cat", "/run/cgpu_km/0/major"], capture_output=True, text=True)
            if out.returncode == 0:
                break
            time.sleep(0.5)
        logs = subprocess.run(["podman", "logs", cid], capture_output=True, text=True).stderr
        assert out is not None and out.returncode == 0, logs
        assert f"serving /run/cgpu_km (GPUs 0: Tesla T4 {T4_TOTAL >> 20} MiB" in logs, logs
        probe = daemon["readinessProbe"]["exec"]["command"]
        assert subprocess.run(["podman", "exec", cid, *probe], capture_output=True).returncode == 0
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "5", cid], capture_output=True, timeout=60)


def test_the_plugin_and_the_extender_run_from_the_image(image):
    for container in (node_pod()["device-plugin"], extender_pod()):
        r = podman_run(image, container, command=[*container["command"], "--help"])
        assert r.returncode == 0 and "Usage:" in r.stdout, r.stderr
