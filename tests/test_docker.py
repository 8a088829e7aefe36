"""Docker and containerd, for real (issue 13): Debian's dockerd and
containerd, each started by the test with its own root, state and socket,
with cgpu-runtime (native/runtime) as a runtime.

The seed's command line (seed 002), with --runtime=cgpu for --runtime=nvidia,
registers the container under `docker ps`'s short ID with 6 of 15 GiB,
schedules it through its own cgroup, and removes it at `docker rm -f`; a bad
value fails `docker run` with the reason; a container without the variables
is left alone; `default-runtime: cgpu` in daemon.json works the same. And
containerd's runc shim (io.containerd.runc.v2 with BinaryName = the wrapper),
driven by `ctr run`: the path a Kubernetes node takes.

The image is made offline: `docker import` (or `ctr image import`) of a
busybox-static root file system. dockerd runs with --bridge=none
--iptables=false --storage-driver=vfs and a cgroup parent of its own.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from conftest import SIM_T4_BYTES
from test_runc import _tool, compiled_hook
from test_runtime import wrapper

pytestmark = pytest.mark.slow

DOCKER_CLI = "/usr/bin/docker"  # Debian's, of the same release as dockerd (another may be first on PATH)
BUSY = ["sh", "-c", "exec 3< /dev/simgpu0; while :; do :; done"]  # a GPU job: holds the device, computes
SEED = ["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=6", "-e", "ALIYUN_COM_GPU_MEM_DEV=15", "-e", "NVIDIA_VISIBLE_DEVICES=0"]


def busybox_tar() -> bytes:
    """A root file system with a static busybox, as a tar stream."""
    busybox = _tool("busybox")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "proc", "sys", "dev", "etc", "tmp"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(busybox, "bin/busybox")
        for applet in ("sh", "sleep", "cat", "echo", "true", "hostname"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buf.getvalue()


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def frozen_once(cgroup_dirs: list[Path], seconds: float) -> bool:
    """Whether any of the container's freezable groups is seen frozen within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for d in cgroup_dirs:
            for f, word in (("cgroup.events", "frozen 1"), ("freezer.state", "FROZEN")):
                try:
                    if word in (d / f).read_text():
                        return True
                except OSError:
                    pass
        time.sleep(0.002)
    return False


def container_groups(pid: int) -> list[Path]:
    out = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0":
            out.append(Path("/sys/fs/cgroup/unified") / path.lstrip("/"))
        elif "freezer" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/freezer") / path.lstrip("/"))
    return out


class Dockerd:
    """One dockerd (and the containerd it starts) of the test's own."""

    def __init__(self, daemon, default_runtime: bool = False) -> None:
        for tool in ("dockerd", "containerd", "containerd-shim-runc-v2", "runc"):
            _tool(tool)
        if not os.access(DOCKER_CLI, os.X_OK):
            pytest.fail(f"{DOCKER_CLI} is missing: scripts/setup.sh installs docker.io")
        self.tmp = Path(tempfile.mkdtemp(prefix="cgdk-", dir="/tmp"))
        self.sock = self.tmp / "docker.sock"
        self.parent = f"cgpud-test-{self.tmp.name}"
        conf = {"runtimes": {"cgpu": {"path": wrapper()}}}
        if default_runtime:
            conf["default-runtime"] = "cgpu"
        (self.tmp / "daemon.json").write_text(json.dumps(conf))
        env = dict(os.environ, CGPUD_SOCKET=os.fspath(daemon.socket))
        self.log = open(self.tmp / "dockerd.log", "wb")
        self.proc = subprocess.Popen(
            ["dockerd", "--config-file", os.fspath(self.tmp / "daemon.json"), "--data-root", os.fspath(self.tmp / "root"),
             "--exec-root", os.fspath(self.tmp / "exec"), "--pidfile", os.fspath(self.tmp / "dockerd.pid"),
             "-H", f"unix://{self.sock}", "--bridge=none", "--iptables=false", "--ip-masq=false",
             "--storage-driver=vfs", "--cgroup-parent", f"/{self.parent}"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: self("version").returncode == 0 or self.proc.poll() is not None, 60, "dockerd to answer")
        if self.proc.poll() is not None:
            pytest.fail(f"dockerd exited:\n{self.log_text()}")
        p = subprocess.run([DOCKER_CLI, "-H", f"unix://{self.sock}", "import", "-", "cgpud-busybox:test"],
                           input=busybox_tar(), capture_output=True, timeout=120)
        assert p.returncode == 0, p.stderr

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([DOCKER_CLI, "-H", f"unix://{self.sock}", *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)

    def log_text(self) -> str:
        return (self.tmp / "dockerd.log").read_text(errors="replace")[-4000:]

    def cleanup(self) -> None:
        self("rm", "-f", *[c for c in self("ps", "-aq").stdout.split() if c])
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            where = line.split()[4]
            if where.startswith(f"{self.tmp}/"):
                subprocess.run(["umount", "-l", where], capture_output=True)
        for root in Path("/sys/fs/cgroup").iterdir():
            g = root / self.parent
            if g.is_dir():
                for sub in sorted((d for d in g.rglob("*") if d.is_dir()), reverse=True):
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
                try:
                    g.rmdir()
                except OSError:
                    pass
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def cgpud(make_daemon):
    """A daemon whose prepared containers call this venv's compiled hook; policy 3
    at max_inst 4 freezes a lone weight-1 container 3/4 of the time."""
    d = make_daemon(extra_args=["--hook-path", compiled_hook()])
    d.write("0/max_inst", "4")
    d.write("0/policy", "3")
    return d


@pytest.fixture
def docker(cgpud):
    dk = Dockerd(cgpud)
    yield dk
    dk.cleanup()


def test_the_seeds_docker_run_with_runtime_cgpu(cgpud, docker):
    # (the container holds the simulated GPU open, so it has work and is time-sliced)
    p = docker("run", "-d", "-t", "--runtime=cgpu", "--name", "gpu_test1", "--network", "none", *SEED,
               "-v", f"{cgpud.dev_dir / 'simgpu0'}:/dev/simgpu0", "cgpud-busybox:test", *BUSY)
    assert p.returncode == 0, p.stderr + docker.log_text()
    short = docker("ps", "--format", "{{.ID}}", "--filter", "name=gpu_test1").stdout.strip()
    assert len(short) == 12 and short == p.stdout.strip()[:12]
    assert cgpud.instances(0) == [short]
    assert cgpud.value(f"0/{short}/memsize") == str(SIM_T4_BYTES * 6 // 15) == "6337173913"
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", "gpu_test1").stdout)
    assert frozen_once(container_groups(pid), 5), "the container was never paused by the scheduler"
    assert docker("rm", "-f", "gpu_test1").returncode == 0
    wait_for(lambda: cgpud.instances(0) == [], 10, "the instance to go with the container")


def test_a_bad_value_fails_docker_run_with_the_reason(cgpud, docker):
    p = docker("run", "--rm", "--runtime=cgpu", "--network", "none", "-e", "ALIYUN_COM_GPU_MEM_CONTAINER=six",
               "cgpud-busybox:test", "true")
    assert p.returncode != 0
    assert "ALIYUN_COM_GPU_MEM_CONTAINER=six: " in p.stderr, p.stderr
    assert cgpud.instances(0) == []


def test_a_container_without_the_variables_is_left_alone(cgpud, docker):
    p = docker("run", "--rm", "--runtime=cgpu", "--network", "none", "cgpud-busybox:test", "echo", "plain")
    assert p.returncode == 0 and p.stdout.strip() == "plain", p.stderr
    assert cgpud.instances(0) == []


def test_default_runtime_cgpu(cgpud):
    dk = Dockerd(cgpud, default_runtime=True)
    try:
        p = dk("run", "-d", "--network", "none", *SEED, "cgpud-busybox:test", "sleep", "300")
        assert p.returncode == 0, p.stderr + dk.log_text()
        assert cgpud.instances(0) == [p.stdout.strip()[:12]]
        assert dk("rm", "-f", p.stdout.strip()).returncode == 0
        wait_for(lambda: cgpud.instances(0) == [], 10, "the instance to go")
    finally:
        dk.cleanup()


# ---- containerd and ctr ----------------------------------------------------------------


class Containerd:
    """One containerd of the test's own, with the wrapper as the runc shim's binary."""

    def __init__(self, daemon, config: Path | None = None, address: Path | None = None) -> None:
        """With `config` (and the `address` it names): containerd runs on that file instead of its own."""
        for tool in ("containerd", "ctr", "containerd-shim-runc-v2", "runc"):
            _tool(tool)
        self.tmp = Path(tempfile.mkdtemp(prefix="cgct-", dir="/tmp"))
        self.address = address or self.tmp / "containerd.sock"
        config = config or self.tmp / "config.toml"
        if config == self.tmp / "config.toml":
            config.write_text(f"""version = 2
root = "{self.tmp}/root"
state = "{self.tmp}/state"
[grpc]
  address = "{self.address}"
[ttrpc]
  address = "{self.address}.ttrpc"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
""")
        env = dict(os.environ, CGPUD_SOCKET=os.fspath(daemon.socket))
        self.log = open(self.tmp / "containerd.log", "wb")
        self.proc = subprocess.Popen(["containerd", "--config", os.fspath(config)], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        wait_for(lambda: self("version").returncode == 0 or self.proc.poll() is not None, 60, "containerd")
        if self.proc.poll() is not None:
            pytest.fail(f"containerd exited:\n{self.log_text()}")
        image = self.tmp / "image.tar"
        self._image(image)
        p = self("image", "import", "--base-name", "cgpud-busybox", os.fspath(image))
        assert p.returncode == 0, p.stderr

    def _image(self, path: Path) -> None:
        """A docker-archive image of the busybox root file system (what `ctr image import` reads)."""
        layer = busybox_tar()
        import hashlib
        diff = "sha256:" + hashlib.sha256(layer).hexdigest()
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["sh"]},
                             "rootfs": {"type": "layers", "diff_ids": [diff]}}).encode()
        cname = hashlib.sha256(config).hexdigest() + ".json"
        manifest = json.dumps([{"Config": cname, "RepoTags": ["cgpud-busybox:test"], "Layers": ["layer.tar"]}]).encode()
        with tarfile.open(path, "w") as tar:
            for name, data in ((cname, config), ("layer.tar", layer), ("manifest.json", manifest)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", os.fspath(self.address), "--namespace", "cgpud-test", *args],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)

    def log_text(self) -> str:
        return (self.tmp / "containerd.log").read_text(errors="replace")[-4000:]

    def cleanup(self) -> None:
        for cid in self("containers", "list", "-q").stdout.split():
            self("task", "kill", "-s", "SIGKILL", cid)
            time.sleep(0.2)
            self("task", "delete", "-f", cid)
            self("containers", "delete", cid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            where = line.split()[4]
            if where.startswith(f"{self.tmp}/"):
                subprocess.run(["umount", "-l", where], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def test_containerd_runc_shim_with_the_wrapper(cgpud):
    ct = Containerd(cgpud)
    try:
        cid = "cgpuctr" + os.urandom(4).hex()
        p = ct("run", "-d", "--runc-binary", wrapper(), "--cgroup", f"/cgpud-test-{ct.tmp.name}/{cid}",
               "--env", "ALIYUN_COM_GPU_MEM_CONTAINER=6", "--env", "ALIYUN_COM_GPU_MEM_DEV=15",
               "--mount", f"type=bind,src={cgpud.dev_dir / 'simgpu0'},dst=/dev/simgpu0,options=rbind:ro",
               "docker.io/library/cgpud-busybox:test", cid, *BUSY)
        assert p.returncode == 0, p.stderr + ct.log_text()
        name = cid[:12]
        assert cgpud.instances(0) == [name]
        assert cgpud.value(f"0/{name}/memsize") == "6337173913"
        pid = int(next(ln.split()[1] for ln in ct("task", "ls").stdout.splitlines() if ln.startswith(cid)))
        assert frozen_once(container_groups(pid), 5), "the container was never paused by the scheduler"
        ct("task", "kill", "-s", "SIGKILL", cid)
        wait_for(lambda: "STOPPED" in ct("task", "ls").stdout or ct("task", "ls").stdout.count("\n") <= 1, 10, "stop")
        assert ct("task", "delete", cid).returncode == 0
        wait_for(lambda: cgpud.instances(0) == [], 10, "the instance to go with the task")
        bad = ct("run", "--rm", "--runc-binary", wrapper(), "--env", "ALIYUN_COM_GPU_MEM_CONTAINER=six",
                 "docker.io/library/cgpud-busybox:test", cid + "b", "true")
        assert bad.returncode != 0 and "ALIYUN_COM_GPU_MEM_CONTAINER=six: " in bad.stderr, bad.stderr
        assert cgpud.instances(0) == []
    finally:
        ct.cleanup()
