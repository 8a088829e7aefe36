"""A one-node Kubernetes cluster of the real components, for the cluster tier
(tests/test_cluster.py, bench/cluster.py; docs/cluster-tests.md).

Everything is Kubernetes' own code or Debian's, started here with its own
files under one temporary directory:

- etcd (Debian's etcd-server) on loopback ports of its own;
- kube-apiserver, kube-scheduler, kubelet and kubectl of the release
  tests/cluster/go.mod pins, built once per machine by scripts/k8s-build.sh;
  the API server serves TLS with certificates made at start (openssl), takes
  bearer tokens made at start, and authorizes with Node,RBAC;
- kube-scheduler reads the project's KubeSchedulerConfiguration
  (deploy/kubernetes/scheduler/), its extender stanza as shipped;
- containerd (Debian's) with its CRI plugin, its own root, state and socket,
  the project's `cgpu` runtime (deploy/kubernetes/containerd-cgpu.toml) with
  BinaryName = the cgpu-runtime built into the venv, pod networking by the
  CNI bridge plugin of containernetworking-plugins, and a pause image built
  here from a tiny static C program;
- the kubelet against containerd's CRI, with the settings that let a kubelet
  run inside a container (KUBELET_SETTINGS below, explained in
  docs/cluster-tests.md);
- our parts: cgpud serving simulated GPUs (tests/conftest.py's Daemon), the
  device plugin and the scheduler extender as host processes, each with the
  token of the ServiceAccount deploy/kubernetes gives it.

    c = Cluster(daemon)
    c.start()            # etcd, API server, containerd, kubelet, scheduler
    c.deploy()           # kubectl apply of deploy/kubernetes, then extender + device plugin
    c.kubectl("get", "nodes")
    c.cleanup()          # everything stopped and removed; host settings restored

Teardown leaves no process, mount, cgroup, network device or sysctl change
behind.
"""
from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "kubernetes"
NODE = "cgpu-node"
NAMESPACE = "kube-system"
SA = "cgpu"  # the ServiceAccount deploy/kubernetes/rbac.yaml gives the node's DaemonSet (the device plugin)
EXTENDER_SA = "cgpu-scheduler-extender"  # ... and the extender
DRA_SA = "cgpu-dra-plugin"  # deploy/kubernetes/dra/rbac.yaml's, the DaemonSet's in DRA mode
PAUSE_IMAGE = "localhost/cgpud-pause:test"
BUSYBOX_IMAGE = "localhost/cgpud-busybox:test"
# one cluster at a time on a host (Cluster._take_the_node): its fixed paths and ports are host-wide
TIER_LOCK = "/run/lock/cgpud-cluster-tier.lock"
TIER_WAIT_S = 1800
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # the kubelet's, fixed in its code (pluginapi.DevicePluginPath)
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")  # what the kubelet sets (restored at cleanup)


def shipped_scheduler_config() -> dict:
    return yaml.safe_load((DEPLOY / "scheduler" / "kube-scheduler-config.yaml").read_text())


def extender_addr() -> tuple[str, int]:
    """Where the shipped scheduler configuration calls our extender (its urlPrefix's host and port)."""
    from urllib.parse import urlsplit

    url = urlsplit(shipped_scheduler_config()["extenders"][0]["urlPrefix"])
    return url.hostname or "127.0.0.1", url.port or 80


def k8s_bin() -> Path:
    """The directory of the built binaries: scripts/k8s-build.sh builds them the first time
    (long: see the README) and says where they are."""
    p = subprocess.run([REPO / "scripts" / "k8s-build.sh"], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, env=dict(os.environ, PATH=f"{os.environ.get('PATH', '')}:/usr/local/go/bin"))
    if p.returncode != 0:
        pytest.fail(f"scripts/k8s-build.sh failed:\n{p.stderr[-4000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def k8s_release(bins: Path) -> tuple[int, int, int]:
    """The release of the built components (`kube-apiserver --version`: `Kubernetes v1.36.3`)."""
    out = subprocess.run([os.fspath(bins / "kube-apiserver"), "--version"], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL).stdout
    m = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    if m is None:
        pytest.fail(f"kube-apiserver --version said {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def feature_gates(release: tuple[int, int, int]) -> dict[str, bool]:
    """The feature gates the tier sets on every component of `release` (K8S_FEATURE_GATES, as
    `A=true,B=false`, names them instead): what cgpud's DRA layout needs that the release has off by
    default (docs/kubernetes.md, DRA versions): DRAConsumableCapacity before 1.36, and ResourceHealthStatus
    (KEP-4680, alpha until 1.36: without it the kubelet puts no device health in a pod's status, which
    test_cluster_dra_health checks; 1.34.4's tier failed there). Nothing on 1.36 and later."""
    given = os.environ.get("K8S_FEATURE_GATES")
    if given is not None:
        pairs = [kv.split("=", 1) for kv in given.split(",") if kv.strip()]
        return {k.strip(): v.strip().lower() == "true" for k, v in pairs}
    return {"DRAConsumableCapacity": True, "ResourceHealthStatus": True} if release[:2] in ((1, 34), (1, 35)) else {}


def gates_flag(gates: dict[str, bool]) -> list[str]:
    return [f"--feature-gates={','.join(f'{k}={str(v).lower()}' for k, v in sorted(gates.items()))}"] if gates else []


def _netns() -> list[str]:
    try:
        return os.listdir("/run/netns")
    except OSError:
        return []


def _cgroup_mounts() -> list[Path]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] in ("cgroup", "cgroup2"):
            out.append(Path(fields[4]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This machine's address on its default route (the kubelet refuses a loopback node IP)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the route's source address
        return s.getsockname()[0]


def wait_for(pred: Callable[[], object], timeout: float, what: str, why: Callable[[], str] = lambda: "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s\n{why()}")
        time.sleep(0.05)


class Proc:
    """One long-running program with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None) -> None:
        self.name, self.argv, self.log_path = name, [os.fspath(a) for a in argv], log
        self.env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        with open(self.log_path, "ab") as log:
            log.write(f"---- {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log(self, tail: int = 6000) -> str:
        try:
            return f"---- {self.name} ({self.log_path}):\n" + self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return f"(no log of {self.name})"


# ---- certificates and tokens ------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    p = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        pytest.fail(f"openssl {' '.join(args)}: {p.stderr}")


def make_pki(d: Path, ip: str) -> None:
    """A CA, the API server's serving certificate, client certificates (the node's, the API
    server's to the kubelet), the service account signing key: all made now, EC P-256."""
    d.mkdir(parents=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=cgpud-test-ca",
             cwd=d)

    def leaf(name: str, subj: str, ext: str) -> None:
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj, cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)

    serving = "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment"
    client = "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment"
    leaf("apiserver", "/CN=kube-apiserver",
         serving + f"\nsubjectAltName=IP:127.0.0.1,IP:{ip},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
                   "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    leaf("kubelet", f"/CN={NODE}", serving + f"\nsubjectAltName=IP:127.0.0.1,IP:{ip},DNS:{NODE}")
    leaf("node", f"/O=system:nodes/CN=system:node:{NODE}", client)  # the Node authorizer's identity of the kubelet
    leaf("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", client)
    leaf("controller-manager", "/CN=system:kube-controller-manager", client)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=d)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig(path: Path, server: str, ca: Path, user: dict) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": os.fspath(ca)}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }, indent=1))
    return path


# ---- images -----------------------------------------------------------------------------

PAUSE_C = r"""
/* the pod sandbox's process: waits for a signal to end, reaps what is reparented to it */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, quit); signal(SIGTERM, quit); signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


def image_archive(path: Path, tag: str, files: dict[str, tuple[bytes | None, int, str | None]],
                  cmd: list[str]) -> None:
    """A docker-archive image (what `ctr images import` reads) of one layer: `files` maps a path
    to (content, mode, symlink target); content None and no target is a directory."""
    import hashlib

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for name, (data, mode, link) in files.items():
            info = tarfile.TarInfo(name)
            info.mode = mode
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": cmd},
                         "rootfs": {"type": "layers", "diff_ids": [diff]}}).encode()
    cname = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cname, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in ((cname, config), ("layer.tar", layer_bytes), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def pause_image(d: Path) -> Path:
    (d / "pause.c").write_text(PAUSE_C)
    p = subprocess.run(["gcc", "-static", "-Os", "-s", "-o", "pause", "pause.c"], cwd=d, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"building the pause program: {p.stderr}")
    out = d / "pause.tar"
    image_archive(out, PAUSE_IMAGE, {"pause": ((d / "pause").read_bytes(), 0o755, None)}, ["/pause"])
    return out


def busybox_image(d: Path) -> Path:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.fail("busybox is not installed: run scripts/setup.sh (it installs busybox-static)")
    files: dict[str, tuple[bytes | None, int, str | None]] = {
        x: (None, 0o755, None) for x in ("bin", "proc", "sys", "dev", "etc", "tmp", "run")}
    files["bin/busybox"] = (Path(busybox).read_bytes(), 0o755, None)
    for applet in ("sh", "sleep", "cat", "env", "echo", "true", "ls"):
        files[f"bin/{applet}"] = (None, 0o777, "busybox")
    out = d / "busybox.tar"
    image_archive(out, BUSYBOX_IMAGE, files, ["sh"])
    return out


# ---- the cluster ------------------------------------------------------------------------


def clear_stale_socket(path: Path) -> bool:
    """True when nothing listens on the Unix socket `path` (a kubelet killed without its clean-up left it,
    e.g. a tier run ended by a signal): it is removed then. False while something answers there, or
    when it is not a socket (nothing is removed then)."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return False
    except FileNotFoundError:
        return True
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(os.fspath(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            print(f"cluster tier: {path} was left by a kubelet that is gone: removed", file=sys.stderr)
            return True
        except OSError:
            return False
    return False


def clear_dead_kubelet_state(plugin_dir: Path) -> None:
    """What a kubelet that is gone left in its device plugin directory (a tier run whose clean-up never
    ran, when the directory was there before it and so is not removed): its checkpoint, which a new
    kubelet reads back (a DRA-mode node then showed the last cluster's aliyun.com/gpu-mem at 0), and
    sockets nobody listens on. A socket something serves is left."""
    if not plugin_dir.is_dir():
        return
    (plugin_dir / "kubelet_internal_checkpoint").unlink(missing_ok=True)
    for entry in plugin_dir.iterdir():
        if entry.is_socket():
            clear_stale_socket(entry)


class Cluster:
    def __init__(self, daemon, runtime_binary: str | None, bins: Path | None = None,
                 host_root: Path | None = None, containerd_bins: Path | None = None, dra: bool = False) -> None:
        """host_root: a directory standing for the node's root (the DaemonSet test): containerd's config is
        its etc/containerd/config.toml (written without cgpu, as a node before `cgpu node install`), and
        containerd runs in a mount namespace of its own where that directory's run/ and usr/local/ are
        /run and /usr/local, so the host paths the installer writes (BinaryName, the hook, libcgpu.so) and
        the node daemon's socket and tree resolve inside it; nothing of the real host's is touched.
        containerd_bins: containerd 2.x's programs (scripts/containerd-build.sh) instead of Debian's 1.6,
        on a version 3 config with CDI on (specs in the run's cdi/), `cgpu` put in as the default
        runtime by the node installer's own edit; with host_root, the node's version 3 file without
        cgpu (the DaemonSet's installer puts it in) and CDI's default directories (/var/run/cdi is the
        host directory's run/cdi in containerd's namespace). dra: kube-scheduler without the extender."""
        self.daemon = daemon
        self.host_root = host_root
        self.containerd_bins, self.dra = containerd_bins, dra
        self.runtime_binary = runtime_binary
        self.bins = bins or k8s_bin()
        self.release = k8s_release(self.bins)
        self.gates = feature_gates(self.release)
        self.base = Path(tempfile.mkdtemp(prefix="cgpud-k8s-", dir="/tmp"))
        self.base.chmod(0o755)
        self.ip = node_ip()
        self.procs: dict[str, Proc] = {}
        # the pods' cgroups: with cgroupsPerQOS false the kubelet gives no parent, and containerd's CRI puts
        # them under /k8s.io (its namespace) in each hierarchy; that one is removed at cleanup if made here
        self.cgroup_parents = [p for p in _cgroup_mounts() if not (p / "k8s.io").exists()]
        self.bridge = "cgpu" + os.urandom(3).hex()  # the CNI bridge device (at most 15 characters)
        self.sysctls: dict[str, str] = {}
        self.made_dirs: list[Path] = []  # host directories that were not there before (removed at cleanup)
        self.sa_kubeconfig: Path | None = None
        self.deploy_output = ""
        self.netns_before = set(_netns())
        self.base_shared = False

    # ---- helpers ----

    def path(self, *parts: str) -> Path:
        return self.base.joinpath(*parts)

    def logs(self) -> str:
        return "\n".join(p.log(3000) for p in self.procs.values())

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run([os.fspath(self.bins / "kubectl"), "--kubeconfig", os.fspath(kubeconfig or self.admin),
                            *args], capture_output=True, text=True, timeout=timeout, input=stdin,
                           stdin=None if stdin is not None else subprocess.DEVNULL)
        if check and p.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def api(self):
        """The official client (CoreV1Api) as the cluster's administrator."""
        from kubernetes import client, config

        c = client.Configuration()
        config.load_kube_config(config_file=os.fspath(self.admin), client_configuration=c)
        return client.CoreV1Api(client.ApiClient(c))

    def https_get(self, url: str, token: str | None = None, cert: tuple[Path, Path] | None = None) -> str:
        ctx = ssl.create_default_context(cafile=os.fspath(self.path("pki", "ca.crt")))
        if cert:
            ctx.load_cert_chain(*map(os.fspath, cert))
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            return r.read().decode()

    def apiserver_metrics(self) -> str:
        return self.https_get(f"{self.server}/metrics", token=self.tokens["admin"])

    def kubelet_metrics(self) -> str:
        pki = self.path("pki")
        ctx_cert = (pki / "apiserver-kubelet-client.crt", pki / "apiserver-kubelet-client.key")
        return self.https_get(f"https://{self.ip}:{self.kubelet_port}/metrics", cert=ctx_cert)

    def _mkdir_host(self, path: Path) -> None:
        """Make a host directory the kubelet or the CNI plugins write to by fixed path; remember
        the topmost one that was not there, to remove it at cleanup."""
        missing = None
        for p in [path, *path.parents]:
            if p.exists():
                break
            missing = p
        if missing is not None:
            self.made_dirs.append(missing)
        path.mkdir(parents=True, exist_ok=True)

    # ---- start ----

    def start(self) -> "Cluster":
        end_shared()  # (this process's shared cluster, if another is held: one cluster a host)
        try:
            self._start()
        except BaseException:
            print(self.logs(), file=sys.stderr)
            self.cleanup()
            raise
        return self

    def _take_the_node(self) -> None:
        """Wait for any other run's cluster on this host to end (TIER_LOCK, held until cleanup): the
        kubelet's device plugin directory and the extender's address are fixed, so two runs' clusters
        would collide; a second run waits its turn (saying so once) instead of failing."""
        fd = os.open(TIER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"cluster tier: another run's cluster holds {TIER_LOCK}; waiting for it to end", file=sys.stderr)
            deadline = time.monotonic() + TIER_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        os.close(fd)
                        pytest.fail(f"another run's cluster held {TIER_LOCK} for over {TIER_WAIT_S} s")
                    time.sleep(0.5)
        self.tier_lock = fd

    def start_control_plane(self) -> "Cluster":
        """etcd and kube-apiserver only (no node, containerd or scheduler): for tests of what the API
        server allows (RBAC, admission policies, webhooks), which need no node to run on."""
        end_shared()
        try:
            self._take_the_node()
            make_pki(self.path("pki"), self.ip)
            self._start_etcd()
            self._start_apiserver()
            self.kubectl("create", "serviceaccount", "default", "-n", "default")  # (as _start: pods name one)
            self.kubectl("patch", "serviceaccount", "default", "-n", "default", "-p",
                         '{"automountServiceAccountToken": false}')
        except BaseException:
            print(self.logs(), file=sys.stderr)
            self.cleanup()
            raise
        return self

    def node_token(self, account: str, node: str = NODE, namespace: str = NAMESPACE) -> str:
        """A token of ServiceAccount `account` bound to a pod on `node`, as the kubelet gives a
        DaemonSet's pod (the API server then puts the node's name in the token's
        userInfo.extra authentication.kubernetes.io/node-name, which the shipped policies read).
        The pod (it only sleeps) is made here when missing; the token lives while it does."""
        name = f"{account}-on-{node}"[:63]
        if self.kubectl("get", "pod", name, "-n", namespace, check=False).returncode != 0:
            self.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
                         "spec": {"nodeName": node, "serviceAccountName": account,
                                  "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 1,
                                  "containers": [{"name": "hold", "image": BUSYBOX_IMAGE,
                                                  "imagePullPolicy": "Never", "command": ["sleep", "86400"]}]}})
        return self.kubectl("create", "token", account, "-n", namespace, "--duration", "6h", "--bound-object-kind",
                            "Pod", "--bound-object-name", name).stdout.strip()

    def _start(self) -> None:
        for tool in ("etcd", "containerd", "ctr", "containerd-shim-runc-v2", "runc", "openssl", "gcc"):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} is not installed: run scripts/setup.sh")
        self._take_the_node()
        for sock in (PLUGIN_DIR.parent / "kubelet.sock", PLUGIN_DIR / "kubelet.sock"):
            if sock.exists() and not clear_stale_socket(sock):
                pytest.fail(f"{sock} is served: another kubelet runs on this machine (the cluster tier needs the "
                            "kubelet's fixed device plugin directory for itself)")
        clear_dead_kubelet_state(PLUGIN_DIR)
        with socket.socket() as s:
            if s.connect_ex(extender_addr()) == 0:
                pytest.fail(f"{extender_addr()} is taken: the shipped scheduler configuration calls the extender "
                            "there")
        make_pki(self.path("pki"), self.ip)
        self._start_etcd()
        self._start_apiserver()
        self._start_containerd()
        self._start_kubelet()
        self._start_scheduler()
        # What kube-controller-manager's service account controller would make: pods name a ServiceAccount.
        self.kubectl("create", "serviceaccount", "default", "-n", "default")
        self.kubectl("patch", "serviceaccount", "default", "-n", "default", "-p",
                     '{"automountServiceAccountToken": false}')
        wait_for(lambda: self._node_ready(), 90, "the node to be Ready", self.logs)
        # What kube-controller-manager's node lifecycle controller does once a node is Ready: take off the
        # taint the API server's TaintNodesByCondition admission put on at registration. (That controller
        # is not run: it would also taint the kubelet-less nodes of the 1,000-node test unreachable.)
        self.kubectl("taint", "node", NODE, "node.kubernetes.io/not-ready:NoSchedule-", check=False)
        wait_for(lambda: not self.get("node", NODE)["spec"].get("taints"), 30, "the node without taints")

    def _start_etcd(self) -> None:
        client_port, peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        self.procs["etcd"] = Proc("etcd", [
            "etcd", "--name", "cgpud-test", "--data-dir", self.path("etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"cgpud-test=http://127.0.0.1:{peer_port}",
            "--log-level", "warn"], self.path("etcd.log")).start()

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                    return json.loads(r.read()).get("health") == "true"
            except OSError:
                return False

        wait_for(lambda: healthy() or not self.procs["etcd"].alive(), 30, "etcd to be healthy", self.logs)
        if not self.procs["etcd"].alive():
            pytest.fail("etcd exited:\n" + self.procs["etcd"].log())

    def _admission_config(self) -> Path:
        """kube-apiserver's AdmissionConfiguration: toward every webhook (`*`) it presents the client
        certificate kubeadm gives it (CN kube-apiserver-kubelet-client, of the cluster's CA), which
        the DRA webhook requires of a caller (docs/kubernetes.md)."""
        pki = self.path("pki")
        kc = self.path("webhook-client.kubeconfig")
        kc.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [],
            "users": [{"name": "*", "user": {"client-certificate": os.fspath(pki / "apiserver-kubelet-client.crt"),
                                             "client-key": os.fspath(pki / "apiserver-kubelet-client.key")}}]}))
        webhook = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration",
                   "kubeConfigFile": os.fspath(kc)}
        cfg = self.path("admission.yaml")
        cfg.write_text(yaml.safe_dump({
            "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
            "plugins": [{"name": "MutatingAdmissionWebhook", "configuration": webhook},
                        {"name": "ValidatingAdmissionWebhook", "configuration": webhook}]}))
        return cfg

    def _start_apiserver(self) -> None:
        pki = self.path("pki")
        self.tokens = {name: base64.b32encode(os.urandom(20)).decode().lower() for name in ("admin", "scheduler")}
        self.path("tokens.csv").write_text(
            f'{self.tokens["admin"]},cgpud-test-admin,1,"system:masters"\n'
            f'{self.tokens["scheduler"]},system:kube-scheduler,2\n')
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self.procs["kube-apiserver"] = Proc("kube-apiserver", [
            self.bins / "kube-apiserver",
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", f"--advertise-address={self.ip}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            # (the CA kube-scheduler's delegated authentication looks for; no aggregated API server uses it)
            f"--requestheader-client-ca-file={pki / 'ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--token-auth-file={self.path('tokens.csv')}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--admission-control-config-file={self._admission_config()}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--endpoint-reconciler-type=none",  # no kube-proxy: the `kubernetes` Service's endpoints serve nobody
            "--profiling=false",
            f"--cert-dir={self.path('apiserver-certs')}", *gates_flag(self.gates),
        ], self.path("kube-apiserver.log")).start()
        self.admin = kubeconfig(self.path("admin.kubeconfig"), self.server, pki / "ca.crt",
                                {"token": self.tokens["admin"]})

        def ready() -> bool:
            try:
                return self.https_get(f"{self.server}/readyz", token=self.tokens["admin"]).strip() == "ok"
            except OSError:
                return False

        wait_for(lambda: ready() or not self.procs["kube-apiserver"].alive(), 120, "kube-apiserver /readyz",
                 self.logs)
        if not self.procs["kube-apiserver"].alive():
            pytest.fail("kube-apiserver exited:\n" + self.procs["kube-apiserver"].log())

    def _runtimes_toml(self, cri: str, runtimes: dict) -> str:
        """The CRI plugin's runtimes (the shipped file's) as TOML under `cri`, BinaryName the venv's
        cgpu-runtime."""
        out = ""
        for name, rt in runtimes.items():
            opts = dict(rt.get("options", {}))
            if "BinaryName" in opts:
                opts["BinaryName"] = self.runtime_binary
            out += f'\n[{cri}.containerd.runtimes.{name}]\n  runtime_type = "{rt["runtime_type"]}"\n'
            out += "".join(f"  {k} = {json.dumps(v)}\n" for k, v in rt.items() if k not in ("runtime_type", "options"))
            out += f'[{cri}.containerd.runtimes.{name}.options]\n'
            out += "".join(f"  {k} = {json.dumps(v)}\n" for k, v in opts.items())
        return out

    def _containerd_head(self, version: int) -> str:
        c = self.path("containerd")
        return f"""version = {version}
root = "{c}/root"
state = "{c}/state"
[grpc]
  address = "{self.containerd_sock}"
[ttrpc]
  address = "{self.containerd_sock}.ttrpc\""""

    def containerd_config(self, cgpu: bool = True) -> str:
        """containerd's configuration: its own root, state and socket; the CRI plugin with our pause
        image, the CNI bridge, and the runtimes of deploy/kubernetes/containerd-cgpu.toml with
        BinaryName pointed at the cgpu-runtime the venv has."""
        import tomllib

        shipped = tomllib.loads((DEPLOY / "containerd-cgpu.toml").read_text())["plugins"]["io.containerd.grpc.v1.cri"]
        runtimes = self._runtimes_toml('plugins."io.containerd.grpc.v1.cri"',
                                       shipped["containerd"]["runtimes"] if cgpu else {})
        # the shipped file's default runtime (cgpu): a pod without runtimeClassName (the seeds' manifests) runs
        # through cgpu-runtime, as on a node the installer set up
        default = shipped["containerd"]["default_runtime_name"] if cgpu else "runc"
        c = self.path("containerd")
        return f"""{self._containerd_head(2)}
[plugins."io.containerd.internal.v1.opt"]
  path = "{c}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # This machine is a container: its processes may not lower their oom_score_adj (the kubelet asks -998
  # for the pause process, and runc fails the sandbox). Clamped to containerd's own, as for kind's rootless.
  restrict_oom_score_adj = true
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{c}/net.d"
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "{default}"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
{runtimes}"""

    def containerd_config_v3(self, cgpu: bool = True) -> str:
        """containerd 2.x's configuration (version 3): the same as containerd_config's, with the CRI
        plugin's settings where 2.x keeps them and CDI on (the DRA plugin's specs in the run's cdi/,
        or CDI's default directories under host_root); the runtime `cgpu` put in, as containerd's
        default, by what `cgpu node install` runs on a node's version 3 file
        (hostconfig.containerd_edit), BinaryName the venv's cgpu-runtime (cgpu False: a node's file
        before the installer ran)."""
        from cgpud.containers import hostconfig

        rt = 'plugins."io.containerd.cri.v1.runtime"'
        c = self.path("containerd")
        cdi_dirs = "" if self.host_root is not None else f'\n  cdi_spec_dirs = ["{self.path("cdi")}"]'

        node = f"""{self._containerd_head(3)}
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{PAUSE_IMAGE}"
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[{rt}]
  enable_selinux = false
  restrict_oom_score_adj = true  # (this machine is a container: containerd_config says why)
  enable_cdi = true{cdi_dirs}
[{rt}.cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "{c}/net.d"
[{rt}.containerd]
  default_runtime_name = "runc"
[{rt}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
"""
        return hostconfig.containerd_edit(node, self.runtime_binary, default=True)[0] if cgpu else node

    def _start_containerd(self) -> None:
        c = self.path("containerd")
        (c / "net.d").mkdir(parents=True)
        self.containerd_sock = c / "containerd.sock"
        config = c / "config.toml"
        if self.host_root is not None:
            config = self.host_root / "etc" / "containerd" / "config.toml"
            config.parent.mkdir(parents=True, exist_ok=True)
            v3 = self.containerd_bins is not None
            config.write_text(self.containerd_config_v3(cgpu=False) if v3 else self.containerd_config(cgpu=False))
            self._start_host_namespace()
            argv = ["nsenter", f"--mount=/proc/{self.procs['host-namespace'].proc.pid}/ns/mnt",
                    os.fspath(self.containerd_bins / "containerd") if v3 else "containerd", "--config", config]
            # (2.x's shim first on PATH)
            env = {"PATH": f"{self.containerd_bins}:{os.environ.get('PATH', '/usr/bin:/bin')}"} if v3 else {}
        elif self.containerd_bins is not None:
            self.path("cdi").mkdir()
            config.write_text(self.containerd_config_v3())
            # (its shim is found on PATH: 2.x's own first)
            argv = [self.containerd_bins / "containerd", "--config", config]
            env = {"CGPUD_SOCKET": os.fspath(self.daemon.socket),
                   "PATH": f"{self.containerd_bins}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        else:
            config.write_text(self.containerd_config())
            argv, env = ["containerd", "--config", config], {"CGPUD_SOCKET": os.fspath(self.daemon.socket)}
        (c / "net.d" / "10-cgpu-test.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "cgpu-test",
            "plugins": [{"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                         "ipam": {"type": "host-local", "dataDir": os.fspath(c / "ipam"),
                                  "ranges": [[{"subnet": "10.244.77.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
                        {"type": "portmap", "capabilities": {"portMappings": True}}]}))
        self.procs["containerd"] = Proc("containerd", argv, self.path("containerd.log"), env=env)
        if self.host_root is not None:  # (the runtime finds the node daemon's socket at the host path)
            self.procs["containerd"].env.pop("CGPUD_SOCKET", None)
        self.procs["containerd"].start()
        self._wait_containerd()
        images = self.path("images")
        images.mkdir()
        for archive in (pause_image(images), busybox_image(images)):
            self.import_image(archive)

    def _wait_containerd(self) -> None:
        wait_for(lambda: self.ctr("version").returncode == 0 or not self.procs["containerd"].alive(), 60,
                 "containerd", self.logs)
        if not self.procs["containerd"].alive():
            pytest.fail("containerd exited:\n" + self.procs["containerd"].log())

    def restart_containerd(self) -> None:
        """What `systemctl restart containerd` does on a node: containerd stopped and started on the same
        config (its containers keep running under their shims)."""
        self.procs["containerd"].stop()
        self.procs["containerd"].start()
        self._wait_containerd()

    def _start_host_namespace(self) -> None:
        """The mount namespace containerd runs in (host_root): held by a sleeping process so that it
        outlives containerd's restarts. The run's directory is made a shared mount first, so that the
        kubelet's volume mounts (service account tokens) reach it; the host root is a shared mount in
        it, so that the node daemon's tree (Bidirectional propagation) reaches its /run too."""
        h, base = os.fspath(self.host_root), os.fspath(self.base)
        for d in ("run", "usr/local"):
            (self.host_root / d).mkdir(parents=True, exist_ok=True)
        for cmd in (["mount", "--bind", base, base], ["mount", "--make-shared", base]):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                pytest.fail(f"{' '.join(cmd)}: {p.stderr}")
            self.base_shared = True
        ready = self.path("host-namespace.ready")
        script = (f"set -e; mount --bind {h} {h}; mount --make-rshared {h}; mount --bind {h}/run /run; "
                  f"mount --bind {h}/usr/local /usr/local; : > {ready}; exec sleep infinity")
        self.procs["host-namespace"] = Proc("host-namespace", ["unshare", "--mount", "--propagation", "slave",
                                                               "sh", "-c", script],
                                            self.path("host-namespace.log")).start()
        wait_for(lambda: ready.exists() or not self.procs["host-namespace"].alive(), 10, "the mount namespace")
        if not self.procs["host-namespace"].alive():
            pytest.fail("the mount namespace:\n" + self.procs["host-namespace"].log())

    def host_view(self, path: str) -> Path:
        """A path as containerd (and the containers' hooks) see it: through its namespace's root."""
        return Path(f"/proc/{self.procs['host-namespace'].proc.pid}/root") / path.lstrip("/")

    def import_image(self, archive: Path) -> None:
        """An image archive (docker-archive or OCI, e.g. `podman save` of the cgpud image for the
        DaemonSet) into containerd's CRI namespace, for pods with imagePullPolicy Never/IfNotPresent."""
        p = self.ctr("images", "import", "--no-unpack", os.fspath(archive), timeout=300)
        if p.returncode != 0:
            pytest.fail(f"ctr images import {archive}: {p.stderr}")

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        ctr = os.fspath(self.containerd_bins / "ctr") if self.containerd_bins else "ctr"
        return subprocess.run([ctr, "--address", os.fspath(self.containerd_sock), "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)

    KUBELET_SETTINGS = {
        # This machine is a container on cgroup v1 (a cgroup2 tree beside it at /sys/fs/cgroup/unified),
        # as kind's nodes can be: the supported settings that let a kubelet run there.
        "failCgroupV1": False,          # 1.35+ refuses cgroup v1 unless told
        "cgroupDriver": "cgroupfs",     # no systemd here
        "cgroupsPerQOS": False,         # no kubepods hierarchy (nor node allocatable enforcement): containerd puts the pods under /k8s.io
        "enforceNodeAllocatable": [],   # (needs cgroupsPerQOS)
        "failSwapOn": False,
        "localStorageCapacityIsolation": False,  # no ephemeral-storage accounting of the container's root fs
        "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                         "imagefs.available": "0%", "imagefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100,
        "protectKernelDefaults": False,  # it sets six sysctls; the fixture restores them (SYSCTLS)
        "healthzPort": 0,
        "readOnlyPort": 0,
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
        "nodeStatusUpdateFrequency": "2s",
    }

    def _kubelet_config(self) -> dict:
        pki = self.path("pki")
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            **self.KUBELET_SETTINGS,
            "address": self.ip, "port": self.kubelet_port,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "podLogsDir": os.fspath(self.path("kubelet", "pod-logs")),
            "tlsCertFile": os.fspath(pki / "kubelet.crt"), "tlsPrivateKeyFile": os.fspath(pki / "kubelet.key"),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": os.fspath(pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},  # only the API server holds a certificate of our CA's
            "clusterDomain": "cluster.local",
            "resolvConf": os.fspath(self.path("resolv.conf")),
            "registerNode": True,
            **({"featureGates": self.gates} if self.gates else {}),
        }

    def _start_kubelet(self) -> None:
        pki = self.path("pki")
        self.kubelet_port = free_port()
        self.path("resolv.conf").write_text("nameserver 127.0.0.1\n")
        (self.path("kubelet")).mkdir()
        self.path("kubelet.yaml").write_text(yaml.safe_dump(self._kubelet_config()))
        self.node_kubeconfig = kubeconfig(self.path("node.kubeconfig"), self.server, pki / "ca.crt",
                                          {"client-certificate": os.fspath(pki / "node.crt"),
                                           "client-key": os.fspath(pki / "node.key")})
        for name in SYSCTLS:
            self.sysctls[name] = Path("/proc/sys", name).read_text().strip()
        self._mkdir_host(PLUGIN_DIR)
        self._mkdir_host(Path("/var/log/containers"))  # the kubelet's fixed log links directory
        self.procs["kubelet"] = Proc("kubelet", [
            self.bins / "kubelet", "--config", self.path("kubelet.yaml"),
            "--kubeconfig", self.node_kubeconfig, "--root-dir", self.path("kubelet", "root"),
            "--hostname-override", NODE, "--node-ip", self.ip, "--v", "2",
        ], self.path("kubelet.log"))
        self.start_kubelet()

    def start_kubelet(self) -> float:
        """Start the kubelet (again); returns when it was started (monotonic)."""
        at = time.monotonic()
        self.procs["kubelet"].start()
        return at

    def stop_kubelet(self) -> None:
        self.procs["kubelet"].stop()

    def _node_ready(self) -> bool:
        if not self.procs["kubelet"].alive():
            pytest.fail("the kubelet exited:\n" + self.procs["kubelet"].log())
        p = self.kubectl("get", "node", NODE, "-o", "json", check=False)
        if p.returncode != 0:
            return False
        conds = json.loads(p.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def scheduler_config(self) -> dict:
        """The shipped KubeSchedulerConfiguration (deploy/kubernetes/scheduler/), with only its
        clientConnection.kubeconfig pointed at this cluster's (the shipped path is a node's)."""
        cfg = shipped_scheduler_config()
        cfg.setdefault("clientConnection", {})["kubeconfig"] = os.fspath(self.scheduler_kubeconfig)
        if self.dra:  # DRA mode: kube-scheduler's own DRA plugin, no extender (docs/kubernetes.md)
            cfg.pop("extenders", None)
        return cfg

    def _start_scheduler(self) -> None:
        self.scheduler_kubeconfig = kubeconfig(self.path("scheduler.kubeconfig"), self.server,
                                               self.path("pki", "ca.crt"), {"token": self.tokens["scheduler"]})
        self.path("kube-scheduler.yaml").write_text(yaml.safe_dump(self.scheduler_config()))
        self.scheduler_port = free_port()
        self.procs["kube-scheduler"] = Proc("kube-scheduler", [
            self.bins / "kube-scheduler", "--config", self.path("kube-scheduler.yaml"),
            f"--secure-port={self.scheduler_port}", "--bind-address=127.0.0.1",
            f"--authentication-kubeconfig={self.scheduler_kubeconfig}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics", "--v", "2", *gates_flag(self.gates),
        ], self.path("kube-scheduler.log")).start()

        def ready() -> bool:
            if not self.procs["kube-scheduler"].alive():
                pytest.fail("kube-scheduler exited:\n" + self.procs["kube-scheduler"].log())
            try:
                ctx = ssl._create_unverified_context()  # its own self-signed serving certificate
                with urllib.request.urlopen(f"https://127.0.0.1:{self.scheduler_port}/readyz", context=ctx,
                                            timeout=2) as r:
                    return r.read().strip() == b"ok"
            except OSError:
                return False

        wait_for(ready, 60, "kube-scheduler /readyz", self.logs)

    def scheduler_metrics(self) -> str:
        ctx = ssl._create_unverified_context()
        with urllib.request.urlopen(f"https://127.0.0.1:{self.scheduler_port}/metrics", context=ctx, timeout=10) as r:
            return r.read().decode()

    # ---- our parts ----

    def start_controller_manager(self, controllers: str = "daemonset-controller,serviceaccount-controller,"
                                                         "serviceaccount-token-controller,"
                                                         "root-ca-certificate-publisher-controller,"
                                                         "garbage-collector-controller") -> None:
        """kube-controller-manager with only the controllers named (the DaemonSet test needs the
        daemonset controller; the node lifecycle controller is left out: it would taint the
        kubelet-less nodes of the 1,000-node test unreachable)."""
        pki = self.path("pki")
        cm = kubeconfig(self.path("controller-manager.kubeconfig"), self.server, pki / "ca.crt",
                        {"client-certificate": os.fspath(pki / "controller-manager.crt"),
                         "client-key": os.fspath(pki / "controller-manager.key")})
        self.procs["kube-controller-manager"] = Proc("kube-controller-manager", [
            self.bins / "kube-controller-manager", f"--kubeconfig={cm}", f"--controllers={controllers}",
            "--use-service-account-credentials=true", f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}", "--leader-elect=false", "--secure-port=0", "--v=2",
            *gates_flag(self.gates),
        ], self.path("kube-controller-manager.log")).start()

    def deploy(self, target: list[str] | None = None, device_plugin: bool = True, extender: bool = True) -> None:
        """deploy/kubernetes (or `target`, kubectl apply's arguments) applied with kubectl as the
        administrator; then the extender and the device plugin started with the token of the
        ServiceAccount it gives them (the device plugin unless the DaemonSet runs it)."""
        target = target or self.deploy_target()
        p = self.kubectl("apply", *target, check=False)
        self.deploy_output = p.stdout + p.stderr
        if p.returncode != 0:
            pytest.fail(f"kubectl apply {' '.join(target)} exited {p.returncode}:\n{self.deploy_output}")
        self.kubectl("label", "node", NODE, "cgpu.aliyun.com/node=true", "--overwrite")
        # the device plugin's: its account's token bound to a pod on the node, as the DaemonSet's pod has
        # (the shipped policy lets it change only the node its token names); the extender's: its own account
        token = self.node_token(SA) if device_plugin else \
            self.kubectl("create", "token", SA, "-n", NAMESPACE, "--duration", "6h").stdout.strip()
        self.sa_kubeconfig = kubeconfig(self.path("cgpu-sa.kubeconfig"), self.server, self.path("pki", "ca.crt"),
                                        {"token": token})
        if extender:  # (DRA mode has no extender, nor its account)
            token = self.kubectl("create", "token", EXTENDER_SA, "-n", NAMESPACE, "--duration", "6h").stdout.strip()
            self.extender_kubeconfig = kubeconfig(self.path("extender-sa.kubeconfig"), self.server,
                                                  self.path("pki", "ca.crt"), {"token": token})
            self.start_extender()
        if device_plugin:
            self.start_device_plugin()

    @staticmethod
    def deploy_target() -> list[str]:
        """kubectl's arguments for deploy/kubernetes: -k with a kustomization, else -f."""
        return ["-k", os.fspath(DEPLOY)] if (DEPLOY / "kustomization.yaml").exists() else ["-f", os.fspath(DEPLOY)]

    def _cgpu(self) -> str:
        return os.fspath(Path(sys.executable).parent / "cgpu")

    def start_extender(self, addr: tuple[str, int] | None = None) -> None:
        """The extender where the shipped configuration calls it (bench/cluster.py puts a timing
        proxy there and the extender behind it)."""
        host, port = addr or extender_addr()
        self.procs["extender"] = Proc("extender", [self._cgpu(), "scheduler-extender", "--addr", f"{host}:{port}"],
                                      self.path("extender.log"),
                                      env={"KUBECONFIG": os.fspath(self.extender_kubeconfig)}).start()

        def up() -> bool:
            if not self.procs["extender"].alive():
                pytest.fail("the extender exited:\n" + self.procs["extender"].log())
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/gpushare-scheduler/inspect", timeout=2):
                    return True
            except OSError:
                return False

        wait_for(up, 30, "the extender", self.logs)

    def start_device_plugin(self) -> None:
        self.procs["device-plugin"] = Proc("device-plugin", [
            self._cgpu(), "--socket", self.daemon.socket, "device-plugin", "--plugin-dir", PLUGIN_DIR,
            "--node-name", NODE, "--node-refresh", "1"], self.path("device-plugin.log"),
            env={"KUBECONFIG": os.fspath(self.sa_kubeconfig)}).start()

    def allocatable(self, resource: str, node: str = NODE) -> int:
        n = self.get("node", node)
        return int(n["status"].get("allocatable", {}).get(resource, "0"))

    # ---- pods ----

    def pod(self, name: str, gpu_mem: int, labels: dict | None = None, runtime_class: str | None = "cgpu",
            tolerate_fake: bool = False, command: str | None = None) -> dict:
        spec = {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["sh", "-c", command or "env; trap 'exit 0' TERM; while :; do sleep 1; done"],
                "resources": {"limits": {"aliyun.com/gpu-mem": str(gpu_mem)}},
            }],
        }
        if runtime_class:
            spec["runtimeClassName"] = runtime_class
        if tolerate_fake:
            spec["tolerations"] = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}

    def create(self, obj: dict) -> None:
        self.kubectl("create", "-f", "-", stdin=json.dumps(obj))

    def wait_pod(self, name: str, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
        got: dict = {}

        def check() -> bool:
            nonlocal got
            p = self.kubectl("get", "pod", name, "-o", "json", check=False)
            got = json.loads(p.stdout) if p.returncode == 0 else {}
            return bool(got) and pred(got)

        wait_for(check, timeout, f"pod {name}: {what}",
                 lambda: json.dumps(got.get("status", {}), indent=1)[-3000:] + "\n" + self.events(name) + "\n"
                 + self.logs())
        return got

    def events(self, pod: str) -> str:
        p = self.kubectl("get", "events", "--field-selector", f"involvedObject.name={pod}", "-o",
                         "custom-columns=REASON:.reason,FROM:.source.component,MESSAGE:.message", check=False)
        return p.stdout

    def delete_pod(self, name: str, wait: bool = True) -> None:
        self.kubectl("delete", "pod", name, f"--wait={'true' if wait else 'false'}", "--timeout=60s",
                     "--ignore-not-found", timeout=90)

    # ---- cleanup ----

    def cleanup(self) -> None:
        """Stop everything started here, in order, and remove what it left on the host."""
        if getattr(self, "tier_lock", None) is None:
            # Never took the node (another run's cluster held it past the wait), or cleaned up already:
            # nothing here is ours but the run's directory. The rest would be the other run's (its pods'
            # network namespaces and /k8s.io cgroups made since this one's snapshot).
            shutil.rmtree(self.base, ignore_errors=True)
            return
        if "kube-controller-manager" in self.procs:  # (its DaemonSet controller would make the pods again)
            self.procs["kube-controller-manager"].stop()
        kubelet = self.procs.get("kubelet")
        apiserver = self.procs.get("kube-apiserver")
        if kubelet and kubelet.alive() and apiserver and apiserver.alive():
            # pods on the node stopped by the kubelet, as a drain would (their instances go with them)
            self.kubectl("delete", "pods", "--all", "-A", "--wait=false", "--grace-period=1", check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                p = self.kubectl("get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE}", "-o", "name",
                                 check=False)
                if p.returncode != 0 or not p.stdout.strip():
                    break
                time.sleep(0.5)
        for name in ("device-plugin", "dra-plugin", "dra-webhook", "extender", "extender-proxy",
                     "kube-controller-manager", "kube-scheduler", "kubelet"):
            if name in self.procs:
                self.procs[name].stop()
        for name, proc in self.procs.items():  # (any other part a test started: a second webhook replica…)
            if name not in ("containerd", "host-namespace", "kube-apiserver", "etcd"):
                proc.stop()
        if "containerd" in self.procs and self.procs["containerd"].alive():
            for cid in self.ctr("containers", "list", "-q").stdout.split():
                self.ctr("task", "kill", "-s", "SIGKILL", cid)
                time.sleep(0.1)
                self.ctr("task", "delete", "-f", cid)
                self.ctr("containers", "delete", cid)
        for name in ("containerd", "host-namespace", "kube-apiserver", "etcd"):
            if name in self.procs:
                self.procs[name].stop()
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            where = line.split()[4]
            if where.startswith(f"{self.base}/"):
                subprocess.run(["umount", "-l", where], capture_output=True)
        if self.base_shared:
            subprocess.run(["umount", "-l", os.fspath(self.base)], capture_output=True)
        for ns in set(_netns()) - self.netns_before:  # the pods' network namespaces containerd made
            subprocess.run(["umount", "-l", f"/run/netns/{ns}"], capture_output=True)
            Path("/run/netns", ns).unlink(missing_ok=True)
        self._remove_cgroups()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        for name, value in self.sysctls.items():
            try:
                Path("/proc/sys", name).write_text(value)
            except OSError:
                pass
        for d in self.made_dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(self.base, ignore_errors=True)
        if getattr(self, "tier_lock", None) is not None:  # (the next run's cluster may start)
            os.close(self.tier_lock)
            self.tier_lock = None

    def _remove_cgroups(self) -> None:
        """The pods' parent cgroup (/k8s.io) in each hierarchy where it was made here, once empty (runc
        removes the containers' own; what is left of them, too)."""
        for mount in self.cgroup_parents:
            top = mount / "k8s.io"
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    d.rmdir()
                except OSError:
                    pass
            try:
                top.rmdir()
            except OSError:
                pass


# ---- one cluster for the modules that share it --------------------------------------------


class Shared:
    """The cluster kept from one test module to the next that asks for the same key (a module's
    SHARED_CLUSTER; tests/conftest.py runs such modules one after another and ends it after the
    last): a cluster's start is a minute or more of the suite. One at a time, as TIER_LOCK says:
    asked for another key, or a Cluster of this process starting (a DaemonSet's own node), it
    ends first. Each module leaves it as it found it (its pods, claims and labels removed)."""

    key: str | None = None
    value: object = None
    close: Callable[[], list[str]] | None = None


def shared(key: str, make: Callable[[], tuple[object, Callable[[], list[str]]]]) -> object:
    """What make() made for `key` (made now if another key's or nothing is held): make returns the
    value (e.g. (daemon, cluster)) and what ends it (returning what went wrong on the way)."""
    if Shared.key != key:
        end_shared()
        value, close = make()
        Shared.key, Shared.value, Shared.close = key, value, close
    return Shared.value


def end_shared() -> None:
    """End the shared cluster, if one is held; fails with what its end found wrong."""
    close, Shared.key, Shared.value, Shared.close = Shared.close, None, None, None
    problems = close() if close is not None else []
    assert not problems, problems


def node_daemon(gpus: str, *args: str):
    """cgpud for a cluster's node (tests/conftest.py's Daemon): `gpus` simulated, the hook that
    cgpu-runtime puts in, `args`; started. (daemon, what stops and removes it: its problems)."""
    from conftest import Daemon, _make_base
    from test_runc import compiled_hook

    d = Daemon(_make_base(), gpus, ["--hook-path", compiled_hook(), *args])

    def end() -> list[str]:
        problems = d.cleanup()
        shutil.rmtree(d.base, ignore_errors=True)
        return [f"cgpud on {d.mount} {p}" for p in problems]

    try:
        d.start()
    except BaseException:
        end()
        raise
    return d, end


def node(gpus: str, daemon_args: tuple[str, ...], setup: Callable[["Cluster"], None],
         **cluster_args) -> tuple[tuple[object, "Cluster"], Callable[[], list[str]]]:
    """A cluster on a node daemon of `gpus` (node_daemon), started, then `setup(cluster)`: for
    shared(). ((daemon, cluster), what ends both)."""
    from test_runtime import wrapper

    d, end = node_daemon(gpus, *daemon_args)
    try:
        c = Cluster(d, wrapper(), **cluster_args).start()
    except BaseException:
        end()
        raise

    def close() -> list[str]:
        c.cleanup()
        return end()

    try:
        setup(c)
    except BaseException:
        close()
        raise
    return (d, c), close


def node_fixtures(key: str, make: Callable[[], tuple[tuple[object, "Cluster"], Callable[[], list[str]]]]):
    """A module's fixtures node, cgpud and cluster (module scope) for the cluster shared under `key`
    (shared(), make: e.g. node()):  node, cgpud, cluster = node_fixtures(SHARED_CLUSTER, ...)."""

    @pytest.fixture(scope="module")
    def node():
        return shared(key, make)

    @pytest.fixture(scope="module")
    def cgpud(node):
        return node[0]

    @pytest.fixture(scope="module")
    def cluster(node):
        return node[1]

    return node, cgpud, cluster
