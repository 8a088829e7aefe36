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

And in DRA mode (issue 29; test 6 runs the plugin as a host process): the same
with the component deploy/kubernetes/dra, on a node whose runtime is containerd
2 built from its Go module (its version 3 file, which the installer edits):
the DaemonSet's dra-plugin registers through the kubelet's plugin watcher and
publishes the node's ResourceSlice; a pod with a ResourceClaim of 3 GiB and a
pod asking `aliyun.com/gpu-mem: 3` run isolated at 3 GiB.

The host is a temporary directory: a kustomize overlay written here points the
DaemonSet's hostPaths into it, containerd's config is the file inside it, and
containerd runs in a mount namespace where its run/ and usr/local/ are /run and
/usr/local (tests/cluster.py, host_root); its `systemctl` is a stand-in that has
the fixture restart containerd. Nothing of the real host's is written; the
test checks that, and that no process or mount is left, after cleanup.
docs/cluster-tests.md says what is real and what stands in.

Its own module: the DaemonSet's device plugin takes the kubelet's fixed plugin
directory, which test_cluster.py's cluster holds while its module runs. Each
test has a cluster of its own (Node); bench/daemonset.py times both.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from cluster import NAMESPACE, NODE, REPO, Cluster, free_port, wait_for
from nvml_stub import T4_TOTAL, NvmlStub, StubGpu
from test_image import image  # noqa: F401  (the fixture: scripts/build-image.sh, cached by podman)
from test_image import TAG
from test_cluster import container_name, running
from test_cluster_dra import (DRIVER, GIB, admitted, allocated_gpus, claim_pod, containerd_bin, make_claim, pod_claim,
                              start_webhook)
from test_runc import _tool

pytestmark = pytest.mark.slow

# What `cgpu node install` and the DaemonSet would write on a real host: none of it may appear here.
HOST_PATHS = ("/usr/local/bin/cgpu-runtime", "/usr/local/libexec/cgpu-hook", "/usr/local/lib/cgpu",
              "/etc/containers/oci/hooks.d/cgpu-hook.json", "/run/cgpu_km", "/run/cgpud", "/var/lib/cgpud",
              "/nvml-stub.conf", "/systemctl.calls",
              # ... and in DRA mode (the kubelet's directories are the run's: its --root-dir)
              "/run/cdi", "/var/lib/kubelet/plugins/cgpu.aliyun.com",
              "/var/lib/kubelet/plugins_registry/cgpu.aliyun.com-reg.sock")

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


def make_host(tmp: Path, gpus: int = 1) -> Path:
    """A directory standing for a GPU node's root: a shell and `systemctl` for the installer's
    `chroot /host systemctl restart containerd`, the driver's libnvidia-ml.so.1 (the NVML stand-in,
    `gpus` T4s) where the node daemon looks for it (CGPUD_DRIVER_ROOT=/host), the GPUs' device files.
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
    stub.gpus = [StubGpu(f"GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789a{i}", "Tesla T4", T4_TOTAL) for i in range(gpus)]
    stub.write()
    for i in range(gpus):
        (host / f"dev/nvidia{i}").write_text("")
    return host


def overlay(tmp: Path, cluster: Cluster, host: Path, image_tag: str, dra: bool = False,
            daemonset: dict | None = None) -> Path:
    """A kustomization over deploy/kubernetes (not a copy of it; with the component dra when `dra`):
    the image as built here; the DaemonSet's hostPaths in the host directory; its node daemon given
    the stand-in driver's config, the GPU device file's directory and a free metrics port; the pod
    on the node's network, its device plugin or DRA plugin pointed at the API server (no kube-proxy
    serves the `kubernetes` Service here). The DRA plugin's kubelet directories are the kubelet's
    (its --root-dir is the run's): the plugin directory mounted at its host path, as the shipped one
    is, since the plugin tells the kubelet its socket's path. `daemonset`: the DaemonSet
    the patch is made for (default: deploy/kubernetes' as rendered here; bench/helm.py gives an older
    chart's, whose cgpud lacks flags this tree's passes)."""
    from test_manifests import RENDERED, dra_rendered

    rendered = dra_rendered(tmp / "rendered") if dra else RENDERED
    ds = daemonset or next(d for d in rendered if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cgpud")
    containers = {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}
    command = list(containers["cgpud"]["command"])
    command[command.index("--metrics-addr") + 1] = f"127.0.0.1:{free_port()}"
    command += ["--dev-dir", "/host/dev"]
    api = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
           {"name": "KUBERNETES_SERVICE_PORT", "value": cluster.server.rsplit(":", 1)[1]}]
    host_paths = {"tree": host / "run/cgpu_km", "socket": host / "run/cgpud", "state": host / "var/lib/cgpud"}
    plugin = {"name": "device-plugin", "env": api}
    if dra:
        kubelet = cluster.path("kubelet", "root")
        plugin_dir = kubelet / "plugins" / DRIVER
        plugin_command = list(containers["dra-plugin"]["command"])
        plugin_command[plugin_command.index("--plugin-dir") + 1] = os.fspath(plugin_dir)
        plugin = {"name": "dra-plugin", "env": api, "command": plugin_command,
                  "volumeMounts": [{"name": "dra-plugin", "mountPath": os.fspath(plugin_dir)}]}
        # (CDI's default /var/run/cdi: in containerd's namespace /var/run is /run, the host's run/)
        host_paths |= {"plugins-registry": kubelet / "plugins_registry", "dra-plugin": plugin_dir,
                       "cdi": host / "run/cdi"}
    patch = {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "cgpud", "namespace": NAMESPACE},
        "spec": {"template": {"spec": {
            "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [
                # (the node's containerd runs in a mount namespace of its own here, the tier's "host":
                # its hooks call the daemon from there, which counts as the host by CGPUD_HOST_NS_PID)
                # (and the API server, which its metrics door asks to review scrapers' tokens)
                {"name": "cgpud", "command": command,
                 "env": [{"name": "CGPU_NVML_STUB", "value": "/host/nvml-stub.conf"},
                         {"name": "CGPUD_HOST_NS_PID", "value": str(cluster.procs["host-namespace"].proc.pid)}]
                 + api},
                plugin,
            ] + ([{"name": "node-keeper", "env": api}]  # (its DaemonSet watched: the API server here)
                 if "node-keeper" in containers else []),
            "volumes": [{"name": "host", "hostPath": {"path": os.fspath(host), "type": "Directory"}}]
            + [{"name": n, "hostPath": {"path": os.fspath(p), "type": "DirectoryOrCreate"}}
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
        **({"components": [os.path.relpath(REPO / "deploy" / "kubernetes" / "dra", d)]} if dra else {}),
        "images": [{"name": "cgpud", "newName": name, "newTag": tag}],
        "patches": [{"path": "host-root.yaml"}],
    }))
    return d


class SystemdStandIn:
    """Answers the stand-in systemctl's requests: containerd restarted by the fixture (`took`: the
    seconds each restart took, for bench/daemonset.py)."""

    def __init__(self, cluster: Cluster, host: Path) -> None:
        self.cluster, self.request, self.restarts = cluster, host / "systemctl.request", 0
        self.took: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            if self.request.exists():
                try:
                    at = time.monotonic()
                    self.cluster.restart_containerd()
                    self.took.append(time.monotonic() - at)
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


class Node:
    """A GPU node for the DaemonSet: the host directory, the cluster on it (kube-scheduler with no
    extender and two T4s when `dra`: claims and `aliyun.com/gpu-mem` pods (through the webhook) share them,
    docs/kubernetes.md; containerd 2 on a version 3 file when `containerd2`, by default in DRA
    mode, else Debian's 1.6 on a version 2 file), the stand-in systemd, the
    image imported into containerd, kube-controller-manager. On leaving: everything stopped and
    removed, and then nothing may be left: no process or mount of the run, nothing written to the
    real host's paths."""

    CONTROLLERS = ("daemonset-controller,serviceaccount-controller,serviceaccount-token-controller,"
                   "root-ca-certificate-publisher-controller,garbage-collector-controller")

    def __init__(self, image: str, tmp: Path, dra: bool = False, containerd2: bool | None = None) -> None:
        self.image, self.tmp, self.dra = image, tmp, dra
        self.containerd2 = dra if containerd2 is None else containerd2

    def __enter__(self) -> "Node":
        self.before = {p: os.path.lexists(p) for p in HOST_PATHS}
        self.host = make_host(self.tmp, gpus=2 if self.dra else 1)
        archive = self.tmp / "cgpud-image.tar"
        p = subprocess.run(["podman", "save", "--format", "docker-archive", "-o", archive, self.image],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        bins = containerd_bin() if self.containerd2 else None
        self.cluster = Cluster(None, None, host_root=self.host, containerd_bins=bins, dra=self.dra).start()
        self.systemd = SystemdStandIn(self.cluster, self.host)
        try:
            self.cluster.import_image(archive)
            archive.unlink()
            # (DRA: the resourceclaim controller takes a deleted pod off its claim and deletes the claims
            # kube-scheduler made for `aliyun.com/gpu-mem`)
            self.cluster.start_controller_manager(self.CONTROLLERS + (",resourceclaim-controller" if self.dra else ""))
        except BaseException:
            self.__exit__()
            raise
        return self

    def apply(self) -> float:
        """kubectl apply -k of the overlay (the node then labelled); returns when it started (monotonic)."""
        target = overlay(self.tmp, self.cluster, self.host, self.image, dra=self.dra)
        at = time.monotonic()
        self.cluster.deploy(["-k", os.fspath(target)], device_plugin=False, extender=not self.dra)
        return at

    def ds_pod(self) -> dict:
        pods = self.cluster.get("pods", "-n", NAMESPACE, "-l", "app=cgpud")["items"]
        return pods[0] if pods else {}

    def ready(self) -> dict:
        """The DaemonSet's pod, once the DaemonSet controller made it and its containers are Ready."""
        c = self.cluster

        def ready() -> bool:
            if not c.procs["kube-controller-manager"].alive():
                pytest.fail("kube-controller-manager exited:\n" + c.procs["kube-controller-manager"].log())
            pod = self.ds_pod()
            return bool(pod) and all(x.get("ready") for x in pod.get("status", {}).get("containerStatuses", [{}]))

        wait_for(ready, 150, "the DaemonSet's pod Ready",
                 lambda: json.dumps(self.ds_pod().get("status", {}), indent=1)[-3000:] + c.logs())
        pod = self.ds_pod()
        assert pod["spec"]["nodeName"] == NODE
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
        return pod

    def assert_installed(self, pod: dict) -> None:
        """The init step installed the node's parts and restarted containerd once."""
        init = pod["status"]["initContainerStatuses"][0]
        assert init["state"]["terminated"]["exitCode"] == 0, init
        log = self.logs(pod, "node-install")
        assert "containerd: cgpu runtime added (the default runtime), restarted" in log, log
        assert (self.host / "systemctl.calls").read_text() == "restart containerd.service\n"
        assert self.systemd.error is None and self.systemd.restarts == 1, self.systemd.error
        for program in ("usr/local/bin/cgpu-runtime", "usr/local/libexec/cgpu-hook", "usr/local/lib/cgpu/libcgpu.so"):
            assert (self.host / program).read_bytes()[:4] == b"\x7fELF", program
        assert 'BinaryName = "/usr/local/bin/cgpu-runtime"' in (self.host / "etc/containerd/config.toml").read_text()

    def logs(self, pod: dict, container: str) -> str:
        return self.cluster.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", container).stdout

    def tree(self, *parts: str) -> Path:
        """The node daemon's tree (its mount, as containerd's namespace sees the host)."""
        return self.cluster.host_view(os.fspath(self.host.joinpath("run/cgpu_km", *parts)))

    def __exit__(self, *exc) -> None:
        self.systemd.close()
        cluster = self.cluster
        base = os.fspath(cluster.base)
        pids = [int(line.split()[1]) for line in cluster.ctr("task", "ls").stdout.splitlines()[1:]]
        pids += [p.proc.pid for p in cluster.procs.values() if p.proc is not None]
        cluster.cleanup()
        if exc and exc[0] is not None:
            return
        # nothing left: no process or mount of the run, nothing written to the real host's paths
        assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], pids
        assert not processes_naming(base), processes_naming(base)
        assert not mounts_under(base, os.fspath(self.tmp)), mounts_under(base, os.fspath(self.tmp))
        assert {p: os.path.lexists(p) for p in HOST_PATHS} == self.before


def instance_memsize(node: Node, pod: dict, gpu: int = 0) -> str:
    """The pod's container's instance's memsize in the node daemon's tree, once it is there."""
    memsize = node.tree(str(gpu), container_name(pod), "memsize")
    wait_for(memsize.exists, 20, f"the instance of {pod['metadata']['name']} in the tree",
             lambda: "\n".join(os.listdir(node.tree(str(gpu)))) + node.cluster.logs())
    return memsize.read_text().strip()


@pytest.mark.timeout(600)  # (~2 min with the image and binaries cached; a changed tree rebuilds the image)
def test_the_daemonset_sets_the_node_up_and_a_pod_started_after_it_joins_cgpud(image, tmp_path):  # noqa: F811
    with Node(image, tmp_path) as node:
        cluster = node.cluster
        node.apply()
        # the DaemonSet controller made its pod for the node; its init step installed the node's parts
        node.assert_installed(node.ready())

        # the node daemon serves the stand-in driver's T4; the device plugin in the pod registered
        units = T4_TOTAL >> 30
        wait_for(lambda: cluster.allocatable("aliyun.com/gpu-mem") == units, 60, "the node's aliyun.com/gpu-mem",
                 cluster.logs)
        assert node.tree("0/major").exists()

        # a pod started after it: through containerd's default runtime, now the installed cgpu-runtime
        cluster.create(cluster.pod("after-ds-3", 3, runtime_class=None))
        app = cluster.wait_pod("after-ds-3", running, 90, "Running")
        assert instance_memsize(node, app) == str(T4_TOTAL * 3 // units)
        cluster.delete_pod("after-ds-3")
        memsize = node.tree("0", container_name(app), "memsize")
        wait_for(lambda: not memsize.exists(), 30, "the instance to go with the pod", cluster.logs)


@pytest.mark.timeout(600)
def test_the_daemonset_in_dra_mode_on_containerd_2_serves_a_claim_and_gpu_mem_unchanged(image, tmp_path):  # noqa: F811
    """deploy/kubernetes with the component dra, applied with kubectl -k, on a node whose runtime is
    containerd 2 (its version 3 file without cgpu until the DaemonSet's installer puts it in): the
    DaemonSet's dra-plugin registers through the kubelet's plugin watcher and publishes the node's
    ResourceSlice; a pod with a ResourceClaim of 3 GiB and a pod asking `aliyun.com/gpu-mem: 3` (its
    claim from the component's webhook), made right after the apply and the webhook's start, run
    isolated at 3 GiB; their instances and CDI specs go with them.
    Neither pod was placed before the kubelet could prepare its claim (the plugin publishes once
    registered)."""
    with Node(image, tmp_path, dra=True) as node:
        cluster = node.cluster
        node.apply()
        make_claim(cluster, "claim-ds", "3Gi")
        cluster.create(claim_pod("ds-claim", "claim-ds"))
        # A gpu-mem pod reaches DRA through the component's webhook (failurePolicy Fail: refused while it is
        # unreachable). No kube-proxy here: it runs as a host process at a url, as test_cluster_dra runs it.
        hook = start_webhook(cluster)
        wait_for(lambda: admitted(cluster, hook), 60, "the API server to call the webhook", cluster.logs)
        cluster.create(cluster.pod("ds-mem-3", 3, runtime_class=None))

        node.assert_installed(pod := node.ready())
        config = (node.host / "etc/containerd/config.toml").read_text()
        assert config.startswith("version = 3") and 'default_runtime_name = "cgpu"' in config, config

        def slice_() -> dict:
            got = cluster.get("resourceslices")["items"]
            return next((s for s in got if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == NODE
                         and s["spec"].get("devices")), {})

        published = wait_for(slice_, 60, "the node's ResourceSlice", cluster.logs)
        assert published["spec"]["devices"][0]["name"] == "gpu-0", published
        wait_for(lambda: "registered with the kubelet" in node.logs(pod, "dra-plugin"), 60,
                 "the kubelet's plugin watcher to register the DaemonSet's plugin", lambda: node.logs(pod, "dra-plugin"))

        app = cluster.wait_pod("ds-claim", running, 120, "Running")
        (gpu,) = allocated_gpus(cluster, "claim-ds")
        assert instance_memsize(node, app, gpu) == str(3 * GIB)
        env = dict(ln.split("=", 1) for ln in cluster.kubectl("logs", "ds-claim").stdout.splitlines() if "=" in ln)
        assert (env.get("ALIYUN_COM_GPU_MEM_IDX"), env.get("ALIYUN_COM_GPU_MEM_CONTAINER")) == (str(gpu), "3"), env
        mem = cluster.wait_pod("ds-mem-3", running, 120, "Running")
        (r,) = pod_claim(cluster, mem)["status"]["allocation"]["devices"]["results"]  # the claim the webhook gave it
        mem_gpu = int(r["device"].split("-")[1])
        assert instance_memsize(node, mem, mem_gpu) == str(3 * GIB)
        assert cluster.get("node", NODE)["status"]["allocatable"].get("aliyun.com/gpu-mem") is None  # no device plugin
        for name in ("ds-claim", "ds-mem-3"):
            assert "FailedPrepareDynamicResources" not in cluster.events(name), cluster.events(name)
        log = node.logs(pod, "dra-plugin")  # the component's RBAC let it do all it asked
        assert not re.search(r"\b403\b|orbidden", log), log

        specs = node.host / "run/cdi"
        assert len(list(specs.glob("*.json"))) == 2  # a claim's spec each (the pod's own and the claim)
        for name in ("ds-claim", "ds-mem-3"):
            cluster.delete_pod(name)
        cluster.kubectl("delete", "resourceclaim", "claim-ds", "--wait=true", timeout=90)
        for app, g in ((app, gpu), (mem, mem_gpu)):
            memsize = node.tree(str(g), container_name(app), "memsize")
            wait_for(lambda: not memsize.exists(), 30, "the instance to go with the pod", cluster.logs)
        wait_for(lambda: not list(specs.glob("*.json")) and not list((node.host / "var/lib/cgpud/dra").glob("*.json")),
                 30, "the claims unprepared (their CDI specs and records gone)")
