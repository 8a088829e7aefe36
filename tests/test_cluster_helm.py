"""The cluster tier: the Helm chart deploy/helm/cgpud installed, upgraded and uninstalled with the
real `helm` (scripts/helm-build.sh) on the real control plane and node of
tests/test_cluster_daemonset.py (its Node: the host a directory, the image built by
scripts/build-image.sh). The chart's objects go through the same host-root patch as the
kustomize test's (a kustomize post-renderer: `helm install --post-renderer`), so what runs is
the chart's render with only the host's paths moved.

- `helm install`: the DaemonSet's pod Ready, the node's gpu-mem advertised, a GPU pod Running
  with its instance in the node daemon's tree;
- `helm upgrade` to another image tag: a hot upgrade — the DaemonSet's pod and the GPU pod are
  the same pods, no container restarted, the instance still there and not frozen;
- the DaemonSet's pod deleted (how a new image is rolled to a node): the node stays installed;
- `helm uninstall`: every object of the release gone (the DaemonSet's pod too) and nothing of the
  release left in the API server; the node as it was: its /etc and /usr byte for byte as before
  `helm install` (the container node-keeper undid `cgpu node install` as the DaemonSet went) but
  for cgpu-runtime (and its runtime.conf), which the containers started through it need to be
  stopped: left, in the install's record, for a later `cgpu node uninstall`.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from cluster import EXTENDER_SA, NAMESPACE, NODE, SA, kubeconfig, wait_for
from test_cluster import container_name, running
from test_cluster_daemonset import Node, instance_memsize, overlay
from test_helm import CHART, HELM
from test_image import image  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def helm(c, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([HELM, "--kubeconfig", os.fspath(c.admin), *args], capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL,
                       env={"PATH": "/usr/bin:/bin", "HOME": os.fspath(c.path("helm-home")),
                            "HELM_CACHE_HOME": os.fspath(c.path("helm-home", "cache")),
                            "HELM_CONFIG_HOME": os.fspath(c.path("helm-home", "config")),
                            "HELM_DATA_HOME": os.fspath(c.path("helm-home", "data"))})
    assert p.returncode == 0, f"helm {' '.join(args)}:\n{p.stdout}\n{p.stderr}"
    return p


def post_renderer(node: Node, daemonset: dict | None = None) -> str:
    """A helm post-renderer: the chart's render through the kustomize test's host-root patch (made for
    `daemonset`, the chart's own DaemonSet, when given: bench/helm.py's older chart)."""
    c = node.cluster
    # (its host-root.yaml; its kustomization is not used)
    base = overlay(node.tmp, c, node.host, node.image, daemonset=daemonset)
    d = node.tmp / "post-render"
    d.mkdir()
    (d / "host-root.yaml").write_text((base / "host-root.yaml").read_text())
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["helm.yaml"], "patches": [{"path": "host-root.yaml"}]}))
    script = d / "render.sh"
    script.write_text(f"#!/bin/sh\nset -e\ncat > {d}/helm.yaml\nexec {c.bins / 'kubectl'} kustomize {d}\n")
    script.chmod(0o755)
    return os.fspath(script)


def host_files(host) -> dict:
    """What `cgpu node install` may change on the node: its /etc and /usr, each file's bytes (a link
    its target), by path."""
    out = {}
    for top in ("etc", "usr"):
        for p in sorted((host / top).rglob("*")):
            if p.is_symlink():
                out[os.fspath(p.relative_to(host))] = ("link", os.readlink(p))
            elif p.is_file():
                out[os.fspath(p.relative_to(host))] = p.read_bytes()
    return out


def restarts(pod: dict) -> list[int]:
    st = pod.get("status", {})
    return [s.get("restartCount", 0) for s in st.get("containerStatuses", []) + st.get("initContainerStatuses", [])]


@pytest.mark.timeout(1500)  # (~3 min with the image cached; the rest is the wait for the host's one cluster)
def test_helm_install_upgrade_and_uninstall_on_the_real_node(image, tmp_path):  # noqa: F811
    name, tag = image.rsplit(":", 1)
    with Node(image, tmp_path) as node:
        c = node.cluster
        renderer = post_renderer(node)
        before = host_files(node.host)
        helm(c, "install", "cgpud", os.fspath(CHART), "--namespace", NAMESPACE, "--post-renderer", renderer,
             "--set", f"image.repository={name}", "--set", f"image.tag={tag}")
        c.kubectl("label", "node", NODE, "cgpu.aliyun.com/node=true", "--overwrite")
        token = c.kubectl("create", "token", SA, "-n", NAMESPACE, "--duration", "1h").stdout.strip()
        c.sa_kubeconfig = kubeconfig(c.path("cgpu-sa.kubeconfig"), c.server, c.path("pki", "ca.crt"), {"token": token})
        # the extender with its own account's token, as the chart gives it (issue 33: the node's binds nothing)
        token = c.kubectl("create", "token", EXTENDER_SA, "-n", NAMESPACE, "--duration", "1h").stdout.strip()
        c.extender_kubeconfig = kubeconfig(c.path("extender-sa.kubeconfig"), c.server, c.path("pki", "ca.crt"),
                                           {"token": token})
        c.start_extender()
        ds_pod = node.ready()
        installed = host_files(node.host)
        assert installed != before and "usr/local/bin/cgpu-runtime" in installed
        wait_for(lambda: c.allocatable("aliyun.com/gpu-mem") > 0, 60, "the node's aliyun.com/gpu-mem", c.logs)
        c.create(c.pod("helm-gpu-3", 3, runtime_class=None))
        app = c.wait_pod("helm-gpu-3", running, 90, "Running")
        memsize = instance_memsize(node, app)

        # upgrade to another tag of the image: the DaemonSet's template changes, no pod is replaced
        c.ctr("images", "tag", image, f"{name}:{tag}-next")
        helm(c, "upgrade", "cgpud", os.fspath(CHART), "--namespace", NAMESPACE, "--post-renderer", renderer,
             "--reuse-values", "--set", f"image.tag={tag}-next")
        ds = c.get("daemonset", "cgpud", "-n", NAMESPACE)
        assert {x["image"] for x in ds["spec"]["template"]["spec"]["containers"]} == {f"{name}:{tag}-next"}
        after = node.ds_pod()
        assert after["metadata"]["uid"] == ds_pod["metadata"]["uid"] and set(restarts(after)) == {0}
        app_after = c.get("pod", "helm-gpu-3")
        assert app_after["metadata"]["uid"] == app["metadata"]["uid"] and restarts(app_after) == [0]
        assert node.tree("0", container_name(app), "memsize").read_text().strip() == memsize
        c.delete_pod("helm-gpu-3")

        # the DaemonSet's pod deleted (to take the new image): its node-keeper leaves the node installed
        c.kubectl("delete", "pod", "-n", NAMESPACE, ds_pod["metadata"]["name"], "--wait=true", "--timeout=90s",
                  timeout=120)
        wait_for(lambda: node.ds_pod().get("metadata", {}).get("uid") not in (None, ds_pod["metadata"]["uid"]), 60,
                 "the DaemonSet's next pod", c.logs)
        keeper = node.ready()
        assert host_files(node.host) == installed
        wait_for(lambda: "listed again" in node.logs(keeper, "node-keeper"), 30, "node-keeper watching its DaemonSet",
                 lambda: node.logs(keeper, "node-keeper"))

        # (node-keeper's last words, to say why if the node is not as it was: its pod goes with its logs)
        follow = subprocess.Popen([os.fspath(c.bins / "kubectl"), "--kubeconfig", os.fspath(c.admin), "logs", "-f",
                                   "-n", NAMESPACE, keeper["metadata"]["name"], "-c", "node-keeper"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        helm(c, "uninstall", "cgpud", "--namespace", NAMESPACE, "--wait", "--timeout", "120s")
        wait_for(lambda: not node.ds_pod(), 120, "the DaemonSet's pod gone", c.logs)
        try:
            said = follow.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            follow.kill()
            said = follow.communicate()[0]
        # the node as it was before `helm install` (node-keeper saw its DaemonSet deleted), but for
        # cgpu-runtime and its runtime.conf: the shims of the containers started through it (this pod's
        # too: the kubelet could not stop them without it) call it; in the record for a later uninstall
        assert "the DaemonSet was deleted: undoing cgpu node install" in said, said
        now, record = host_files(node.host), "etc/cgpud/node-install.json"
        kept = {p: installed[p] for p in ("usr/local/bin/cgpu-runtime", "etc/cgpud/runtime.conf") if p in installed}
        assert json.loads(now.pop(record))["files"].keys() == {f"/{p}" for p in kept}
        assert now == {**before, **kept}, (said, sorted(set(now) ^ set(before)))
        assert 'BinaryName = "/usr/local/bin/cgpu-runtime"' not in (node.host / "etc/containerd/config.toml").read_text()
        left = c.kubectl("get", "daemonsets,serviceaccounts,clusterroles,clusterrolebindings,runtimeclasses",
                         "-A", "-o", "name").stdout.split()
        assert not [x for x in left if x.rsplit("/", 1)[1] in ("cgpud", "cgpu-scheduler-extender", "cgpu")], left
        assert not c.kubectl("get", "secrets", "-n", NAMESPACE, "-l", "owner=helm", "-o", "name").stdout.strip()
