"""The DaemonSet's image builds here and its containers run from it (issue 21).

`scripts/build-image.sh` builds deploy/kubernetes/Containerfile with podman from
a Debian 12 base made here by debootstrap (imported, slimmed, as
localhost/cgpud-base:bookworm-slim-<arch>; podman's own storage keeps it and the
build's layers, so a second run takes seconds). Then the DaemonSet's containers, with the commands and
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
import yaml

import cgpud
from nvml_stub import T4_TOTAL, NvmlStub, StubGpu
from test_manifests import RENDERED, containers
from test_runc import _tool

# (the image fixture builds the image: a fresh machine's first build runs debootstrap and apt/pip: minutes)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

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
    # (the DaemonSet's --metrics-auth kubernetes asks for an API server's configuration first, which a
    # pod has from its service account: here a kubeconfig naming one, never reached)
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    r = podman_run(image, node_pod()["cgpud"], "-v", f"{tmp_path / 'host'}:/host:ro",
                   "-v", f"{tmp_path / 'kubeconfig'}:/kubeconfig:ro", "-e", "KUBECONFIG=/kubeconfig")
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


# ---- the image for both architectures (issue 34, item 8) -------------------------------------------

MULTI = f"localhost/cgpud:{cgpud.__version__}-multi-test"
EM_X86_64, EM_AARCH64 = 62, 183  # ELF e_machine (the System V gABI's numbers)
NATIVE = ["usr/local/lib/cgpu/libcgpu.so", "usr/local/libexec/libcgpu-switch.so", "usr/local/libexec/cgpu-hook",
          "usr/local/libexec/cgpu-runtime"]


@pytest.fixture(scope="module")
def multi() -> str:
    """`scripts/build-image.sh --arch amd64,arm64`: an image per architecture and the manifest list naming
    both. Only the arm64 one's apt step runs under qemu-user (binfmt): its wheels are downloaded and
    pyfuse3 cross-compiled on this host (a few minutes the first time); podman's layer cache keeps them
    (they depend on pyproject.toml and the base alone), and a change of the sources rebuilds only the
    native stage (on this host, by zig) and the last, short steps."""
    _tool("podman")
    r = subprocess.run([os.fspath(ROOT / "scripts" / "build-image.sh"), "--arch", "amd64,arm64", MULTI],
                       capture_output=True, text=True, timeout=3600, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return MULTI


def elf_machine(elf: bytes) -> int:
    assert elf[:4] == b"\x7fELF", "not an ELF file"
    import struct
    return struct.unpack_from("<H", elf, 18)[0]


@pytest.mark.timeout(3900)  # (the multi fixture: a fresh machine's first build of both, minutes)
def test_the_image_is_built_for_amd64_and_arm64_with_the_native_programs_of_each(multi):
    """The manifest list names an amd64 and an arm64 image; in each, libcgpu and the native programs
    are ELF files of that architecture (the hook and the runtime static); the arm64 one's static hook
    runs under qemu-aarch64-static itself (what runs in each image: the test below)."""
    import json

    listed = json.loads(subprocess.run(["podman", "manifest", "inspect", multi], capture_output=True, text=True,
                                       check=True).stdout)
    assert sorted(m["platform"]["architecture"] for m in listed["manifests"]) == ["amd64", "arm64"]
    for arch, machine in (("amd64", EM_X86_64), ("arm64", EM_AARCH64)):
        inspect = json.loads(subprocess.run(["podman", "image", "inspect", f"{multi}-{arch}"], capture_output=True,
                                            text=True, check=True).stdout)[0]
        assert inspect["Architecture"] == arch
        root = Path(subprocess.run(["podman", "image", "mount", f"{multi}-{arch}"], capture_output=True, text=True,
                                   check=True).stdout.strip())
        try:
            for path in NATIVE:
                elf = (root / path).read_bytes()
                assert elf_machine(elf) == machine, f"{arch}: {path} is for machine {elf_machine(elf)}"
            for path in NATIVE[2:]:
                assert is_static((root / path).read_bytes()), f"{arch}: {path} is not static"
            if arch == "arm64":
                hook = subprocess.run(["qemu-aarch64-static", root / "usr/local/libexec/cgpu-hook", "--bogus"],
                                      capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
                assert hook.returncode == 2 and "cgpu hook: unknown stage --bogus" in hook.stderr, hook
        finally:
            subprocess.run(["podman", "image", "unmount", f"{multi}-{arch}"], capture_output=True)


# ---- a small image with no compiler or headers in it (issue 48) ----------------------------------

MAX_SIZE = 300 * 10**6  # bytes, as podman counts an image's layers unpacked (the old image: 1.29 GB)
# what the final stage must not hold: a compiler, C and Python headers, pip, zig (a build tool of cgpud's)
BUILD_TOOLS = ["usr/bin/gcc", "usr/bin/cc", "usr/bin/x86_64-linux-gnu-gcc", "usr/bin/aarch64-linux-gnu-gcc",
               "usr/include/stdio.h", "usr/include/fuse3", "opt/cgpud/bin/pip"]


def in_image(image: str, arch: str, *command: str) -> subprocess.CompletedProcess:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return subprocess.run(["podman", "run", "--rm", "--network", "none", "--ulimit", f"nofile={nofile}:{nofile}",
                           "--ulimit", "nproc=32768:32768", "--platform", f"linux/{arch}", image, *command],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(3900)  # (the multi fixture's build: minutes the first time)
@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_the_image_is_small_has_no_build_tools_and_its_programs_run(multi, arch):
    """Each architecture's image: at most 300 MB; no compiler, headers, pip or zig in it; `cgpu --version`
    and `cgpud --help` answer, the programs cgpud runs are there, the venv's compiled modules (pyfuse3, built on the build host for the
    target; grpc) load, and a process loads libcgpu (its maps show it) and lives: under qemu-user for
    the architecture that is not this host's."""
    import json

    image = f"{multi}-{arch}"
    size = json.loads(subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True,
                                     check=True).stdout)[0]["Size"]
    assert size <= MAX_SIZE, f"{arch}: the image is {size / 1e6:.0f} MB, over {MAX_SIZE / 1e6:.0f} MB"
    root = Path(subprocess.run(["podman", "image", "mount", image], capture_output=True, text=True,
                               check=True).stdout.strip())
    try:
        kept = [p for p in BUILD_TOOLS if os.path.lexists(root / p)]
        kept += [os.fspath(p.relative_to(root)) for p in root.glob("usr/include/python3*/Python.h")]
        kept += [os.fspath(p.relative_to(root)) for p in root.glob("opt/cgpud/lib/python3*/site-packages/ziglang")]
        assert kept == [], f"{arch}: build tools in the image: {kept}"
        fuse, = root.glob("opt/cgpud/lib/python3*/site-packages/pyfuse3/__init__*.so")
        assert elf_machine(fuse.read_bytes()) == dict(amd64=EM_X86_64, arm64=EM_AARCH64)[arch], fuse
    finally:
        subprocess.run(["podman", "image", "unmount", image], capture_output=True)
    r = in_image(image, arch, "cgpu", "--version")
    assert r.returncode == 0 and cgpud.__version__ in r.stdout, r
    r = in_image(image, arch, "cgpud", "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout, r
    # (the programs cgpud runs: the DRA webhook's certificate, the node's namespaces, the FUSE mount's)
    r = in_image(image, arch, "sh", "-c", "for p in openssl nsenter fusermount3; do command -v $p || exit 1; done")
    assert r.returncode == 0 and len(r.stdout.split()) == 3, r
    r = in_image(image, arch, "/opt/cgpud/bin/python", "-c", "import pyfuse3, grpc, kubernetes, trio; "
                 "print(pyfuse3.__name__, grpc.__name__)")
    assert r.returncode == 0 and r.stdout.split() == ["pyfuse3", "grpc"], r
    r = in_image(image, arch, "env", "LD_PRELOAD=/usr/local/lib/cgpu/libcgpu.so", "python3", "-c",
                 "import platform; maps = open('/proc/self/maps').read(); "
                 "print(platform.machine(), '/usr/local/lib/cgpu/libcgpu.so' in maps)")
    assert r.returncode == 0 and r.stdout.split() == [dict(amd64="x86_64", arm64="aarch64")[arch], "True"], r
