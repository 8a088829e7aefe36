"""The cluster tier, test 4 (issue 24): deploy/kubernetes's DaemonSet, scheduled
by the real control plane (kube-controller-manager's DaemonSet controller) onto
the real node (kubelet, containerd's CRI), from the image scripts/build-image.sh
builds (`podman save`, `ctr images import`):

- its init container runs `cgpu node install --host-root /host` as shipped: it
  copies cgpu-runtime, cgpu-hook and libcgpu.so and puts the runtime cgpu into
  containerd's config, and restarts containerd through the host's `systemctl`;
- its node daemon (`cgpud serve --gpus nvml`, the NVML stand-in as the host's
  driver) and its device plugin start; the plugin registers with the kubelet;
- a pod asking `aliyun.com/gpu-mem: 3` started after it (no runtimeClassName:
  the installer made cgpu containerd's default runtime) runs through the
  installed cgpu-runtime and appears in the node daemon's tree with its memsize.

The host is a temporary directory: a kustomize overlay written here points the
DaemonSet's hostPaths into it, containerd's config is the file inside it, and
containerd runs in a mount namespace where its run/ and usr/local/ are /run and
/usr/local (tests/cluster.py, host_root); its `systemctl` is a stand-in that has
the fixture restart containerd. Nothing of the real host's is written; the
test checks that, and that no process or mount is left, after cleanup.
docs/cluster-tests.md says what is real and what stands in.

Its own module: the DaemonSet's device plugin takes the kubelet's fixed plugin
directory, which test_cluster.py's cluster holds while its module runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from cluster import NAMESPACE, NODE, REPO, Cluster, free_port, wait_for
from nvml_stub import T4_TOTAL, NvmlStub, StubGpu
from test_image import image  # noqa: F401  (the fixture: scripts/build-image.sh, cached by podman)
from test_image import TAG
from test_runc import _tool

pytestmark = pytest.mark.slow

# What `cgpu node install` and the DaemonSet would write on a real host: none of it may appear here.
HOST_PATHS = ("/usr/local/bin/cgpu-runtime", "/usr/local/libexec/cgpu-hook", "/usr/local/lib/cgpu",
              "/etc/containers/oci/hooks.d/cgpu-hook.json", "/run/cgpu_km", "/run/cgpud", "/var/lib/cgpud",
              "/nvml-stub.conf", "/systemctl.calls")

SYSTEMCTL = """#!/bin/sh
# The host's systemctl, standing in for systemd (none runs here): the test's fixture restarts containerd
# when asked, and this returns once it has, as `systemctl restart` does.
echo "$*" >> /systemctl.calls
case "$*" in
  "restart containerd.service"|"restart containerd")
    : > /systemctl.request
    while [ -e /systemctl.request ]; do sleep 0.1; done ;;
  *) echo "systemctl (stand-in): $*: not handled here" >&2; exit 1 ;;
esac
"""


def make_host(tmp: Path) -> Path:
    """A directory standing for a GPU node's root: a shell and `systemctl` for the installer's
    `chroot /host systemctl restart containerd`, the driver's libnvidia-ml.so.1 (the NVML stand-in,
    one T4) where the node daemon looks for it (CGPUD_DRIVER_ROOT=/host), the GPU's device file.
    containerd's config is written by the cluster fixture (etc/containerd/config.toml)."""
    host = tmp / "host"
    for d in ("bin", "usr/bin", "usr/lib/x86_64-linux-gnu", "dev", "run", "usr/local"):
        (host / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(_tool("busybox"), host / "bin" / "busybox")
    for applet in ("sh", "sleep", "echo"):
        (host / "bin" / applet).symlink_to("busybox")
    (host / "usr/bin/systemctl").write_text(SYSTEMCTL)
    (host / "usr/bin/systemctl").chmod(0o755)
    stub = NvmlStub.build(tmp)
    stub.config = host / "nvml-stub.conf"
    lib = host / "usr/lib/x86_64-linux-gnu"
    shutil.copy(stub.libdir / "libnvidia-ml.so.1", lib / "libnvidia-ml.so.550.54.15")
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")
    stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab", "Tesla T4", T4_TOTAL)]
    stub.write()
    (host / "dev/nvidia0").write_text("")
    return host


def overlay(tmp: Path, cluster: Cluster, host: Path, image_tag: str) -> Path:
    """A kustomization over deploy/kubernetes (not a copy of it): the image as built here; the
    DaemonSet's hostPaths in the host directory; its node daemon given the stand-in driver's
    config, the GPU device file's directory and a free metrics port; the pod on the node's network,
    its device plugin pointed at the API server (no kube-proxy serves the `kubernetes` Service here)."""
    from test_manifests import RENDERED

    ds = next(d for d in RENDERED if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpud")
    daemon = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "cgpud")
    command = list(daemon["command"])
    command[command.index("--metrics-addr") + 1] = f"127.0.0.1:{free_port()}"
    command += ["--dev-dir", "/host/dev"]
    port = cluster.server.rsplit(":", 1)[1]
    host_paths = {"tree": "run/cgpu_km", "socket": "run/cgpud", "state": "var/lib/cgpud"}
    patch = {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "cgpud", "namespace": NAMESPACE},
        "spec": {"template": {"spec": {
            "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [
                {"name": "cgpud", "command": command,
                 "env": [{"name": "CGPU_NVML_STUB", "value": "/host/nvml-stub.conf"}]},
                {"name": "device-plugin",
                 "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                         {"name": "KUBERNETES_SERVICE_PORT", "value": port}]},
            ],
            "volumes": [{"name": "host", "hostPath": {"path": os.fspath(host), "type": "Directory"}}]
            + [{"name": n, "hostPath": {"path": os.fspath(host / p), "type": "DirectoryOrCreate"}}
               for n, p in host_paths.items()],
        }}},
    }
    d = tmp / "overlay"
    d.mkdir()
    (d / "host-root.yaml").write_text(yaml.safe_dump(patch))
    name, tag = image_tag.rsplit(":", 1)
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "deploy" / "kubernetes", d)],
        "images": [{"name": "cgpud", "newName": name, "newTag": tag}],
        "patches": [{"path": "host-root.yaml"}],
    }))
    return d


class SystemdStandIn:
    """Answers the stand-in systemctl's requests: containerd restarted by the fixture."""

    def __init__(self, cluster: Cluster, host: Path) -> None:
        self.cluster, self.request, self.restarts = cluster, host / "systemctl.request", 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            if self.request.exists():
                try:
                    self.cluster.restart_containerd()
                    self.restarts += 1
                except BaseException as exc:  # (pytest.fail raises an Exception subclass of BaseException)
                    self.error = exc
                self.request.unlink()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def mounts_under(*paths: str) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        where = line.split()[4]
        if any(where == p or where.startswith(p + "/") for p in paths):
            out.append(where)
    return out


def processes_naming(text: str) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd}")
    return out


@pytest.mark.timeout(600)  # (~2 min with the image and binaries cached; a changed tree rebuilds the image)
def test_the_daemonset_sets_the_node_up_and_a_pod_started_after_it_joins_cgpud(image, tmp_path):  # noqa: F811
    before = {p: os.path.lexists(p) for p in HOST_PATHS}
    host = make_host(tmp_path)
    archive = tmp_path / "cgpud-image.tar"
    p = subprocess.run(["podman", "save", "--format", "docker-archive", "-o", archive, image],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    cluster = Cluster(None, None, host_root=host).start()
    systemd = SystemdStandIn(cluster, host)
    try:
        cluster.import_image(archive)
        archive.unlink()
        cluster.start_controller_manager()
        cluster.deploy(["-k", os.fspath(overlay(tmp_path, cluster, host, image))], device_plugin=False)

        # the DaemonSet controller made its pod for the node; its init step installed the node's parts
        def ds_pod() -> dict:
            pods = cluster.get("pods", "-n", NAMESPACE, "-l", "app=cgpud")["items"]
            return pods[0] if pods else {}

        def ready() -> bool:
            if not cluster.procs["kube-controller-manager"].alive():
                pytest.fail("kube-controller-manager exited:\n" + cluster.procs["kube-controller-manager"].log())
            pod = ds_pod()
            return bool(pod) and all(c.get("ready") for c in pod.get("status", {}).get("containerStatuses", [{}]))

        wait_for(ready, 150, "the DaemonSet's pod Ready",
                 lambda: json.dumps(ds_pod().get("status", {}), indent=1)[-3000:] + cluster.logs())
        pod = ds_pod()
        assert pod["spec"]["nodeName"] == NODE
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
        init = pod["status"]["initContainerStatuses"][0]
        assert init["state"]["terminated"]["exitCode"] == 0, init
        log = cluster.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "node-install").stdout
        assert "containerd: cgpu runtime added (the default runtime), restarted" in log, log
        assert (host / "systemctl.calls").read_text() == "restart containerd.service\n"
        assert systemd.error is None and systemd.restarts == 1, systemd.error
        for program in ("usr/local/bin/cgpu-runtime", "usr/local/libexec/cgpu-hook", "usr/local/lib/cgpu/libcgpu.so"):
            assert (host / program).read_bytes()[:4] == b"\x7fELF", program
        assert 'BinaryName = "/usr/local/bin/cgpu-runtime"' in (host / "etc/containerd/config.toml").read_text()

        # the node daemon serves the stand-in driver's T4; the device plugin in the pod registered
        units = T4_TOTAL >> 30
        wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == units, 60, "the node's aliyun.com/gpu-mem",
                 cluster.logs)
        tree = host / "run/cgpu_km"  # (the daemon's mount, as containerd's namespace sees the host)
        assert cluster.host_view(os.fspath(tree / "0/major")).exists()

        # a pod started after it: through containerd's default runtime, now the installed cgpu-runtime
        cluster.create(cluster.pod("after-ds-3", 3, runtime_class=None))
        app = cluster.wait_pod("after-ds-3", lambda p: p.get("status", {}).get("phase") == "Running", 90, "Running")
        cid = app["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
        name = cid[:12]
        memsize = cluster.host_view(os.fspath(tree / "0" / name / "memsize"))
        wait_for(memsize.exists, 20, f"the instance {name} in the tree",
                 lambda: "\n".join(os.listdir(cluster.host_view(os.fspath(tree / "0")))) + cluster.logs())
        assert memsize.read_text().strip() == str(T4_TOTAL * 3 // units)
        cluster.delete_pod("after-ds-3")
        wait_for(lambda: not memsize.exists(), 30, "the instance to go with the pod", cluster.logs)
    finally:
        systemd.close()
        base = os.fspath(cluster.base)
        pids = [int(line.split()[1]) for line in cluster.ctr("task", "ls").stdout.splitlines()[1:]]
        pids += [p.proc.pid for p in cluster.procs.values() if p.proc is not None]
        cluster.cleanup()
    # nothing left: no process or mount of the run, nothing written to the real host's paths
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], pids
    assert not processes_naming(base), processes_naming(base)
    assert not mounts_under(base, os.fspath(tmp_path)), mounts_under(base, os.fspath(tmp_path))
    assert {p: os.path.lexists(p) for p in HOST_PATHS} == before
