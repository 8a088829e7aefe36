"""`cgpu node install` (issue 21): run as the DaemonSet's init container runs it —
in a real container (podman, a Debian bookworm root file system as the image's
base) against a directory standing for the host's root, mounted at /host.

The host has containerd's own default settings (its paths moved into the
test's directory), a comment of the node's own, and a stand-in `systemctl`
(the one program here that cannot be real: no systemd runs this test) that
notes how it was called. Then the real containerd (Debian's 1.6) runs on the
config the installer wrote: `containerd config dump` shows the runtime cgpu as
the CRI plugin's default, and a container started through the installed
runtime (containerd's runc shim with that BinaryName) joins cgpud with the
installed hook. A second install writes nothing and restarts nothing; the
uninstall leaves the host exactly as it was.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from test_docker import BUSY, Containerd, wait_for
from test_podman import Podman
from test_runc import _tool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
HOOK, WRAPPER, LIB = "/usr/local/libexec/cgpu-hook", "/usr/local/bin/cgpu-runtime", "/usr/local/lib/cgpu/libcgpu.so"


def snapshot(root: Path) -> dict[str, object]:
    """Every path under root: a file's bytes and mode, a link's target, a directory."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = os.fspath(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = (p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


@pytest.fixture(scope="module")
def rootfs() -> str:
    r = subprocess.run([os.fspath(ROOT / "scripts" / "rootfs.sh"), "bookworm"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def source(tmp_path) -> Path:
    """What the image holds at the installer's source paths (the Containerfile's make steps)."""
    src = tmp_path / "image"
    for args in ([f"BIN={src}/usr/local/libexec"], ["libcgpu", f"LIB={src}/usr/local/lib/cgpu"]):
        subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), *args], check=True, capture_output=True)
    return src


@pytest.fixture
def host(tmp_path) -> Path:
    """A host's root: containerd's default config (its paths in here), a stand-in systemctl."""
    host = tmp_path / "host"
    base = tmp_path / "ct"
    conf = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True).stdout
    for old, new in (("/var/lib/containerd", f"{base}/root"), ("/run/containerd", f"{base}/state"),
                     ("/opt/containerd", f"{base}/opt")):
        conf = conf.replace(f'"{old}', f'"{new}')
    # (the pause container asks for oom_score_adj -998; where the test runs it may not go below its own)
    conf = conf.replace("restrict_oom_score_adj = false", "restrict_oom_score_adj = true")
    (host / "etc" / "containerd").mkdir(parents=True)
    (host / "etc" / "containerd" / "config.toml").write_text("# this node's own settings: kept as they are\n" + conf)
    (host / "bin").mkdir()
    shutil.copy(_tool("busybox"), host / "bin" / "busybox")
    (host / "bin" / "sh").symlink_to("busybox")
    (host / "usr" / "bin").mkdir(parents=True)
    systemctl = host / "usr" / "bin" / "systemctl"
    systemctl.write_text('#!/bin/sh\necho "$@" >> /var/log/systemctl.calls\n')
    systemctl.chmod(0o755)
    (host / "var" / "log").mkdir(parents=True)
    (host / "var" / "log" / "systemctl.calls").write_text("")
    return host


@pytest.fixture
def podman(make_daemon):
    pm = Podman(make_daemon(start=False))
    yield pm
    pm.cleanup()


def in_container(pm: Podman, rootfs: str, host: Path, source: Path, *args: str) -> subprocess.CompletedProcess:
    """`cgpu ARGS` in a podman container of the bookworm root file system (an overlay over it), the
    host at /host and the image's programs at /image (this checkout's cgpu and its Python mounted
    where they are)."""
    python_home = Path(os.path.realpath(sys.executable)).parent.parent
    return pm("run", "--rm", "--network", "none", "--cgroup-parent", pm.cgroup_parent, "-v", f"{host}:/host",
              "-v", f"{source}:/image:ro", "-v", f"{ROOT}:{ROOT}:ro", "-v", f"{python_home}:{python_home}:ro",
              "--rootfs", f"{rootfs}:O", os.fspath(VENV_BIN / "cgpu"), *args, hooks=False, timeout=180)


def test_install_in_a_container_then_containerd_runs_a_container_that_joins(rootfs, host, source, make_daemon,
                                                                           podman):
    before = snapshot(host)
    r = in_container(podman, rootfs, host, source, "node", "install", "--host-root", "/host", "--from", "/image", "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert sorted(first["written"]) == sorted([HOOK, WRAPPER, LIB, "/etc/containers/oci/hooks.d/cgpu-hook.json",
                                               "/etc/containerd/config.toml"])
    assert first["engines"] == {"containerd": "cgpu runtime added (the default runtime)"}
    assert first["restarted"] == ["containerd"]
    assert (host / "var/log/systemctl.calls").read_text() == "restart containerd.service\n"
    for path, built in ((HOOK, "usr/local/libexec/cgpu-hook"), (WRAPPER, "usr/local/libexec/cgpu-runtime"),
                        (LIB, "usr/local/lib/cgpu/libcgpu.so")):
        assert (host / path.lstrip("/")).read_bytes() == (source / built).read_bytes()
    assert os.access(host / HOOK.lstrip("/"), os.X_OK) and os.access(host / WRAPPER.lstrip("/"), os.X_OK)
    hooks_d = json.loads((host / "etc/containers/oci/hooks.d/cgpu-hook.json").read_text())
    assert hooks_d == json.loads((ROOT / "deploy/hooks.d/cgpu-hook.json").read_text())
    text = (host / "etc/containerd/config.toml").read_text()
    assert text.startswith("# this node's own settings: kept as they are\n")
    old, new = tomllib.loads(before["etc/containerd/config.toml"][0].decode()), tomllib.loads(text)
    cri_new = new["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    cgpu = cri_new["runtimes"].pop("cgpu")
    assert cgpu["runtime_type"] == "io.containerd.runc.v2" and cgpu["options"]["BinaryName"] == WRAPPER
    assert cgpu["options"]["SystemdCgroup"] == old["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"][
        "runc"]["options"]["SystemdCgroup"]  # (the default runtime's options)
    assert cri_new.pop("default_runtime_name") == "cgpu"
    old["plugins"]["io.containerd.grpc.v1.cri"]["containerd"].pop("default_runtime_name")
    assert new == old  # nothing else changed

    # a second run: nothing written, nothing restarted (the figure: 0 files rewritten)
    r = in_container(podman, rootfs, host, source, "node", "install", "--host-root", "/host", "--from", "/image", "--json")
    assert r.returncode == 0, r.stderr
    second = json.loads(r.stdout)
    assert second["written"] == [] and second["restarted"] == [] and second["engines"] == {"containerd": "cgpu runtime set already"}
    assert len(second["kept"]) == 4
    assert (host / "var/log/systemctl.calls").read_text() == "restart containerd.service\n"

    # the real containerd reads the config as meant
    dump = subprocess.run(["containerd", "--config", os.fspath(host / "etc/containerd/config.toml"), "config", "dump"],
                          capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    cri = tomllib.loads(dump.stdout)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["default_runtime_name"] == "cgpu"
    assert cri["runtimes"]["cgpu"]["options"]["BinaryName"] == WRAPPER

    # ... and runs a container through the installed runtime, which joins cgpud with the installed hook
    daemon = make_daemon(extra_args=["--hook-path", os.fspath(host / HOOK.lstrip("/")),
                                     "--libcgpu", os.fspath(host / LIB.lstrip("/"))])
    address = Path(new["grpc"]["address"])
    ct = Containerd(daemon, config=host / "etc/containerd/config.toml", address=address)
    try:
        cid = "cgpuinst" + os.urandom(4).hex()
        p = ct("run", "-d", "--runc-binary", os.fspath(host / WRAPPER.lstrip("/")),
               "--cgroup", f"/cgpud-test-{ct.tmp.name}/{cid}",
               "--env", "ALIYUN_COM_GPU_MEM_CONTAINER=6", "--env", "ALIYUN_COM_GPU_MEM_DEV=15",
               "--mount", f"type=bind,src={daemon.dev_dir / 'simgpu0'},dst=/dev/simgpu0,options=rbind:ro",
               "docker.io/library/cgpud-busybox:test", cid, *BUSY)
        assert p.returncode == 0, p.stderr + ct.log_text()
        assert daemon.instances(0) == [cid[:12]]
        assert daemon.value(f"0/{cid[:12]}/memsize") == "6337173913"
        ct("task", "kill", "-s", "SIGKILL", cid)
        wait_for(lambda: "STOPPED" in ct("task", "ls").stdout, 10, "the task to stop")
        assert ct("task", "delete", cid).returncode == 0
        wait_for(lambda: daemon.instances(0) == [], 10, "the instance to go with the task (poststop)")
    finally:
        ct.cleanup()
        state = address.parent.parent  # (the host's containerd root and state: the test's)
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            if line.split()[4].startswith(f"{state}/"):
                subprocess.run(["umount", "-l", line.split()[4]], capture_output=True)
        shutil.rmtree(state, ignore_errors=True)

    # uninstall: the host exactly as before, containerd restarted once more
    r = in_container(podman, rootfs, host, source, "node", "uninstall", "--host-root", "/host", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["restarted"] == ["containerd"]
    calls = (host / "var/log/systemctl.calls").read_text()
    (host / "var/log/systemctl.calls").write_text("")
    assert calls == "restart containerd.service\n" * 2
    assert snapshot(host) == before


def test_a_library_in_use_is_replaced_not_rewritten(tmp_path, source):
    """A running container keeps the library it mapped: the new one is a new file renamed over it."""
    from cgpud.containers.nodeinstall import install

    host = tmp_path / "host"
    host.mkdir()
    lib = host / LIB.lstrip("/")
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF an older libcgpu")
    with open(lib, "rb") as held:  # (as a container's process has it mapped)
        inode = os.fstat(held.fileno()).st_ino
        report = install(os.fspath(host), os.fspath(source), engines=("none",), restart="none")
        assert LIB in report.written
        held.seek(0)
        assert held.read() == b"\x7fELF an older libcgpu"  # the old file is untouched
        assert lib.stat().st_ino != inode and lib.read_bytes() == (source / "usr/local/lib/cgpu/libcgpu.so").read_bytes()
    assert not [p for p in lib.parent.iterdir() if p.name != "libcgpu.so"]  # no temporary left
    from cgpud.containers.nodeinstall import uninstall

    uninstall(os.fspath(host), restart="none")
    assert lib.read_bytes() == b"\x7fELF an older libcgpu"  # what was there before is back


def test_refusals_are_one_line_and_change_nothing(tmp_path, source):
    cgpu = os.fspath(VENV_BIN / "cgpu")
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text("this is = not [toml\n")
    before = snapshot(host)
    cases = [(["install", "--host-root", os.fspath(host), "--from", os.fspath(source), "--engine", "containerd"],
              "not TOML"),
             (["install", "--host-root", os.fspath(tmp_path / "nowhere")], "is not a directory"),
             (["install", "--host-root", os.fspath(host), "--from", os.fspath(tmp_path / "empty")], "make install-hooks"),
             (["uninstall", "--host-root", os.fspath(host)], "did not run there")]
    for args, words in cases:
        r = subprocess.run([cgpu, "node", *args, "--restart", "none"], capture_output=True, text=True)
        assert r.returncode == 1 and words in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert "Traceback" not in r.stderr
    # (a config that is not TOML is found before anything is written)
    assert snapshot(host) == before


# ---- the kubelet's path: containerd's CRI plugin, a pod that names no runtime ------------------


def crictl() -> str:
    """crictl (cri-tools, built by scripts/setup.sh from the Go module proxy)."""
    path = ROOT / ".venv" / "bin" / "crictl"
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: run scripts/setup.sh (it builds crictl from sigs.k8s.io/cri-tools)")
    return os.fspath(path)


def oci_archive(path: Path, tag: str, cmd: list[str]) -> None:
    """A docker-archive image of the busybox root file system, `cmd` its command."""
    import hashlib
    import io
    import tarfile

    from test_docker import busybox_tar

    layer = busybox_tar()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}
                         }).encode()
    cname = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cname, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in ((cname, config), ("layer.tar", layer), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_pod_that_names_no_runtime_goes_through_cgpu_and_joins(host, source, make_daemon, tmp_path):
    """What the kubelet does, through containerd's CRI plugin on the config the installer wrote: a pod
    sandbox and a container with the device plugin's environment and no runtime handler (no
    runtimeClassName) run through the default runtime, cgpu, and the container joins cgpud."""
    from cgpud.containers import allotted
    from cgpud.containers.nodeinstall import install

    tool = crictl()
    install(os.fspath(host), os.fspath(source), restart="none")
    conf = host / "etc/containerd/config.toml"
    doc = tomllib.loads(conf.read_text())
    # the installed paths as the host's /: here below the host directory
    conf.write_text(conf.read_text().replace(f'BinaryName = "{WRAPPER}"',
                                             f'BinaryName = "{host / WRAPPER.lstrip("/")}"'))
    sandbox_image = doc["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"]
    address = Path(doc["grpc"]["address"])
    daemon = make_daemon(extra_args=["--hook-path", os.fspath(host / HOOK.lstrip("/")),
                                     "--libcgpu", os.fspath(host / LIB.lstrip("/"))])
    ct = Containerd(daemon, config=conf, address=address)
    (tmp_path / "crictl.yaml").write_text("")  # (none of /etc/crictl.yaml's)
    cri = [tool, "--config", os.fspath(tmp_path / "crictl.yaml"), "--runtime-endpoint", f"unix://{address}",
           "--image-endpoint", f"unix://{address}", "--timeout", "60s"]

    def run(*args: str) -> str:
        r = subprocess.run([*cri, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"crictl {' '.join(args)}: {r.stderr}\n{ct.log_text()}"
        return r.stdout.strip()

    pod = None
    try:
        for tag, cmd in ((sandbox_image, ["sleep", "86400"]), ("docker.io/library/cgpud-busybox:test", ["sh"])):
            archive = tmp_path / f"{abs(hash(tag))}.tar"
            oci_archive(archive, tag, cmd)
            r = subprocess.run(["ctr", "--address", os.fspath(address), "--namespace", "k8s.io", "image", "import",
                                os.fspath(archive)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
        parent = f"/cgpud-test-{ct.tmp.name}"
        pod_json = tmp_path / "pod.json"
        pod_json.write_text(json.dumps({
            "metadata": {"name": "binpack-1", "namespace": "default", "uid": os.urandom(8).hex(), "attempt": 0},
            "log_directory": os.fspath(tmp_path / "logs"),
            "linux": {"cgroup_parent": parent, "security_context": {"namespace_options": {"network": 2}}}}))
        ctr_json = tmp_path / "container.json"
        given = {"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}
        ctr_json.write_text(json.dumps({
            "metadata": {"name": "app"}, "image": {"image": "docker.io/library/cgpud-busybox:test"},
            "command": BUSY, "log_path": "app.log",
            "envs": [{"key": k, "value": v} for k, v in given.items()],  # (what Allocate gives)
            # ... and its annotations, which the kubelet passes on and the installed runtime handler into the
            # OCI spec (container_annotations): the allocation the hook believes on Kubernetes
            "annotations": allotted.annotations("aliyun.com/gpu-mem", given),
            "mounts": [{"container_path": "/dev/simgpu0", "host_path": os.fspath(daemon.dev_dir / "simgpu0"),
                        "readonly": True}]}))
        pod = run("runp", os.fspath(pod_json))  # (no --runtime: the default runtime handler)
        assert daemon.instances(0) == []  # the sandbox asks for nothing: passed straight through
        cid = run("create", pod, os.fspath(ctr_json), os.fspath(pod_json))
        run("start", cid)
        assert daemon.instances(0) == [cid[:12]]
        assert daemon.value(f"0/{cid[:12]}/memsize") == "6337173913"
        run("stop", "--timeout", "0", cid)
        run("rm", cid)
        wait_for(lambda: daemon.instances(0) == [], 10, "the instance to go with the container")
    finally:
        if pod is not None:
            subprocess.run([*cri, "stopp", pod], capture_output=True, timeout=60)
            subprocess.run([*cri, "rmp", "-f", pod], capture_output=True, timeout=60)
        ct.cleanup()
        state = address.parent.parent
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            if line.split()[4].startswith(f"{state}/"):
                subprocess.run(["umount", "-l", line.split()[4]], capture_output=True)
        shutil.rmtree(state, ignore_errors=True)
        for hierarchy in [Path("/sys/fs/cgroup"), *Path("/sys/fs/cgroup").iterdir()]:
            group = hierarchy / f"cgpud-test-{ct.tmp.name}"
            for d in [*sorted((g for g in group.rglob("*") if g.is_dir()), reverse=True), group] \
                    if group.is_dir() else ():
                try:
                    d.rmdir()
                except OSError:
                    pass


def test_a_failed_restart_is_tried_again_by_the_next_run(tmp_path, source):
    """A restart that failed (the init container fails, the kubelet runs it again) is not forgotten
    because the settings are already written: the next run restarts containerd though it writes nothing."""
    from cgpud.containers.nodeinstall import InstallError, install

    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text("version = 2\n")
    calls = []

    def systemctl(rc: int, err: str = ""):
        def run(cmd):
            calls.append(cmd)
            return subprocess.CompletedProcess(cmd, rc, "", err)
        return run

    with pytest.raises(InstallError, match=r"`systemctl restart containerd.service` failed \(Job for containerd"):
        install(os.fspath(host), os.fspath(source), runner=systemctl(1, "Job for containerd.service failed.\n"))
    again = install(os.fspath(host), os.fspath(source), runner=systemctl(0))
    assert again.written == [] and again.restarted == ["containerd"]
    third = install(os.fspath(host), os.fspath(source), runner=systemctl(0))
    assert third.written == [] and third.restarted == []
    assert calls == [["chroot", os.fspath(host), "systemctl", "restart", "containerd.service"]] * 2


def test_docker_gets_the_runtime_and_is_told_not_restarted(tmp_path, source):
    """A host with Docker: daemon.json gets the runtime cgpu, everything else kept; Docker is never
    restarted by the installer (without live-restore that stops its containers): the report says to.
    Uninstall gives back the file's very bytes."""
    from cgpud.containers.nodeinstall import install, uninstall

    host = tmp_path / "host"
    (host / "etc/docker").mkdir(parents=True)
    original = '{"log-level": "warn",\n "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}'
    (host / "etc/docker/daemon.json").write_text(original)
    calls = []
    report = install(os.fspath(host), os.fspath(source), runner=lambda cmd: calls.append(cmd))
    assert report.engines == {"docker": "cgpu runtime added"} and report.restarted == [] and calls == []
    assert report.todo == ["systemctl restart docker.service on the node (not done here: without live-restore it "
                           "stops Docker's containers)"]
    assert json.loads((host / "etc/docker/daemon.json").read_text()) == {
        "log-level": "warn", "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}, "cgpu": {"path": WRAPPER}}}
    assert install(os.fspath(host), os.fspath(source), runner=lambda cmd: calls.append(cmd)).written == []
    uninstall(os.fspath(host), runner=lambda cmd: calls.append(cmd))
    assert (host / "etc/docker/daemon.json").read_text() == original and calls == []
    assert sorted(os.fspath(p.relative_to(host)) for p in host.rglob("*")) == ["etc", "etc/docker",
                                                                              "etc/docker/daemon.json"]


def test_an_uninstall_that_keeps_the_runtime_leaves_only_it_and_a_later_one_takes_it(tmp_path, source):
    """`cgpu node keep` at the DaemonSet's deletion (helm uninstall): every container started while
    cgpu was containerd's runtime has a shim that calls cgpu-runtime to be killed and deleted, so it
    stays (with what the record needs to remove it) while all else is as before and containerd is
    restarted; a later uninstall leaves the host exactly as before the install; an install between
    goes on from it."""
    from cgpud.containers.nodeinstall import RUNTIME_KEPT, install, uninstall

    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                                                    '  default_runtime_name = "crun"\n')
    before = snapshot(host)
    calls = []

    def ok(cmd):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    install(os.fspath(host), os.fspath(source), runner=ok)
    installed = snapshot(host)
    r = uninstall(os.fspath(host), runner=ok, keep=RUNTIME_KEPT)
    assert r.restarted == ["containerd"] and len(calls) == 2
    now = snapshot(host)
    assert now["etc/containerd/config.toml"] == before["etc/containerd/config.toml"]
    assert now["usr/local/bin/cgpu-runtime"] == installed["usr/local/bin/cgpu-runtime"]
    assert now.get("etc/cgpud/runtime.conf") == installed.get("etc/cgpud/runtime.conf")
    assert "usr/local/libexec/cgpu-hook" not in now and "usr/local/lib/cgpu/libcgpu.so" not in now
    assert "etc/containers/oci/hooks.d/cgpu-hook.json" not in now
    assert any("cgpu-runtime kept while containers started through the runtime cgpu may run" in t for t in r.todo)
    again = install(os.fspath(host), os.fspath(source), runner=ok)  # (the DaemonSet back: installed as before)
    record = "etc/cgpud/node-install.json"  # (the same record; its files in another order)
    now, was = snapshot(host), dict(installed)
    assert json.loads(now.pop(record)[0]) == json.loads(was.pop(record)[0])
    assert now == was and "/usr/local/bin/cgpu-runtime" in again.kept
    uninstall(os.fspath(host), runner=ok, keep=RUNTIME_KEPT)
    uninstall(os.fspath(host), runner=ok)
    assert snapshot(host) == before
