"""`cgpu doctor`: why a container did not join — every part of the path, one
line each with what to do (docs/monitoring.md).

Each check is a small function of the `Host` (where to look) returning
`Result(name, status, message)`; `status` is "ok", "skip" (not used on this
host: e.g. Docker is not installed) or "fail". `run` takes them in order; the
command exits 0 only when none failed.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Callable

from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.containers import hostconfig

OK, SKIP, FAIL = "ok", "skip", "fail"


@dataclass(frozen=True)
class Result:
    name: str
    status: str
    message: str


@dataclass
class Host:
    socket: str | None
    mount: str
    etc: str = "/etc"
    hooks_dirs: tuple[str, ...] = ("/etc/containers/oci/hooks.d", "/usr/share/containers/oci/hooks.d")
    hello: dict | None = field(default=None, repr=False)  # the daemon's answer, once asked


def _executable(path: str) -> str | None:
    """Why `path` cannot be run (None: it can)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode) or not os.access(path, os.X_OK):
        return f"{path} is not an executable file"
    return None


def check_daemon(h: Host) -> Result:
    try:
        with Client(h.socket, timeout=3) as c:
            h.hello = c.call("hello")
    except DaemonUnavailable as exc:
        return Result("daemon", FAIL, f"{exc}")
    except (ControlError, OSError, ValueError) as exc:
        return Result("daemon", FAIL, f"the daemon did not answer properly ({exc}): see its log")
    return Result("daemon", OK, f"cgpud {h.hello.get('version')} answers (pid {h.hello.get('pid')}, "
                                f"{h.hello.get('gpus')} GPUs)")


def check_tree(h: Host) -> Result:
    from fusefs import mount

    m = mount.find_mount(h.mount)
    if m is None:
        return Result("tree", FAIL, f"nothing is mounted at {h.mount}: start cgpud (its --mount), or give "
                                    "cgpu doctor --mount")
    if mount.is_dead(h.mount):
        return Result("tree", FAIL, f"{h.mount} is a dead mount (a daemon crashed): run `cgpud clear-mount`, "
                                    "then start cgpud")
    try:
        with open(os.path.join(h.mount, "version")) as f:
            version = f.read().strip()
    except OSError as exc:
        return Result("tree", FAIL, f"{h.mount}/version cannot be read ({exc.strerror}): is it cgpud's tree?")
    return Result("tree", OK, f"{h.mount} is served (version {version})")


def check_fuse(h: Host) -> Result:
    if not os.path.exists("/dev/fuse"):
        return Result("fuse", FAIL, "/dev/fuse is missing: load the fuse module (modprobe fuse)")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return Result("fuse", FAIL, "/dev/fuse is not readable and writable: run cgpud as root")
    if shutil.which("fusermount3") is None:
        return Result("fuse", FAIL, "fusermount3 is missing: install fuse3 (apt-get install fuse3)")
    return Result("fuse", OK, "/dev/fuse and fusermount3 are usable")


def check_cgroups(h: Host) -> Result:
    from cgpud.sched.cgroupfs import KIND_CGROUP2, KIND_FREEZER, hierarchies

    hs = hierarchies()
    have = []
    if KIND_CGROUP2 in hs and os.path.exists(os.path.join(hs[KIND_CGROUP2].mount, "cgroup.subtree_control")):
        have.append(f"cgroup2 at {hs[KIND_CGROUP2].mount}")
    if KIND_FREEZER in hs:
        have.append(f"the v1 freezer at {hs[KIND_FREEZER].mount}")
    if not have:
        return Result("cgroups", FAIL, "neither a cgroup2 hierarchy nor a v1 freezer is mounted: containers "
                                       "cannot be paused (mount cgroup2 at /sys/fs/cgroup)")
    return Result("cgroups", OK, "can pause containers through " + " and ".join(have))


def check_hooks_d(h: Host) -> Result:
    users = [t for t in ("podman", "crio") if shutil.which(t)]
    found, broken = [], []
    for d in h.hooks_dirs:
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
        except OSError:
            continue
        for n in names:
            path = os.path.join(d, n)
            try:
                hook = json.loads(open(path).read()).get("hook", {})
            except (OSError, ValueError, AttributeError):
                continue
            if "cgpu" not in json.dumps(hook):
                continue
            why = _executable(str(hook.get("path", "")))
            (broken if why else found).append(f"{path}" + (f" names {why}" if why else ""))
    if broken:
        return Result("hooks.d", FAIL, f"{broken[0]}: podman skips such a hook silently; run `make "
                                       "install-hooks` as root (or fix the path)")
    if found:
        return Result("hooks.d", OK, f"{found[0]} names an executable hook")
    if not users:
        return Result("hooks.d", SKIP, "podman and CRI-O are not installed")
    return Result("hooks.d", FAIL, f"no hooks.d file names cgpu-hook ({', '.join(h.hooks_dirs)}): copy "
                                   "deploy/hooks.d/cgpu-hook.json into /etc/containers/oci/hooks.d/, or use "
                                   "podman --hooks-dir")


def check_hook(h: Host) -> Result:
    """The OCI hook the daemon puts into the containers cgpu-runtime prepares (its --hook-path)."""
    if h.hello is None:
        return Result("hook", SKIP, "the daemon does not answer: which hook it names is not known")
    if "hook" not in h.hello:
        return Result("hook", SKIP, f"cgpud {h.hello.get('version')} does not say which hook it names")
    path = str(h.hello.get("hook") or "")
    why = _executable(path)
    if why:
        return Result("hook", FAIL, f"{why}: every container through cgpu-runtime fails to start "
                                    f"(fork/exec {path}); run `make install-hooks` as root (a Kubernetes node: "
                                    "`cgpu node install`), or start cgpud with --hook-path PATH")
    return Result("hook", OK, f"{path}: put into every container cgpu-runtime prepares")


def check_library(h: Host) -> Result:
    """The in-container library the daemon puts into containers (libcgpu, docs/isolation.md)."""
    if h.hello is None:
        return Result("libcgpu", SKIP, "the daemon does not answer: which library it gives is not known")
    if "library" not in h.hello:
        return Result("libcgpu", SKIP, f"cgpud {h.hello.get('version')} does not say which library it gives")
    path = h.hello.get("library") or ""
    fix = "run `make install-hooks` as root, or start cgpud with --libcgpu PATH"
    if not path:
        return Result("libcgpu", FAIL, f"cgpud gives containers no in-container library (--libcgpu is empty): "
                                       f"their memory is held only by the watchdog; {fix}")
    try:
        with open(path, "rb") as f:
            elf = f.read(4) == b"\x7fELF"
    except OSError as exc:
        return Result("libcgpu", FAIL, f"{path}: {exc.strerror}: containers start without in-container "
                                       f"isolation (allocations past memsize succeed until the watchdog acts); {fix}")
    if not elf:
        return Result("libcgpu", FAIL, f"{path} is not a shared library; {fix}")
    return Result("libcgpu", OK, f"{path}: put into every container that asks for GPU memory "
                                 f"(compute: {h.hello.get('compute', '?')})")


def check_docker(h: Host) -> Result:
    path = os.path.join(h.etc, "docker", "daemon.json")
    if shutil.which("dockerd") is None and not os.path.exists(path):
        return Result("docker", SKIP, "Docker is not installed")
    try:
        with open(path) as f:
            conf = json.load(f)
        wrapper = conf["runtimes"]["cgpu"]["path"]
    except FileNotFoundError:
        return Result("docker", FAIL, f"{path} does not exist: run `cgpu runtime-config docker`, restart dockerd")
    except (OSError, ValueError, KeyError, TypeError):
        return Result("docker", FAIL, f"{path} names no runtime `cgpu`: run `cgpu runtime-config docker`, "
                                      "restart dockerd")
    why = _executable(str(wrapper))
    if why:
        return Result("docker", FAIL, f"{path}'s runtime cgpu is {why}: run `make install-hooks`")
    return Result("docker", OK, f"{path}: --runtime=cgpu runs {wrapper}"
                  + (" (the default runtime)" if conf.get("default-runtime") == "cgpu" else ""))


def check_containerd(h: Host) -> Result:
    path = os.path.join(h.etc, "containerd", "config.toml")
    if shutil.which("containerd") is None and not os.path.exists(path):
        return Result("containerd", SKIP, "containerd is not installed")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        return Result("containerd", FAIL, f"{path} does not exist: run `cgpu runtime-config containerd`, "
                                          "restart containerd")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return Result("containerd", FAIL, f"{path} cannot be read ({exc}): fix it")
    where = hostconfig.cri_table(3 if doc.get("version") == 3 else 2)
    cri = doc
    for key in hostconfig.split_dotted(where):
        cri = cri.get(key, {}) if isinstance(cri, dict) else {}
    node = cri
    for key in ("runtimes", "cgpu", "options"):
        node = node.get(key, {}) if isinstance(node, dict) else {}
    wrapper = node.get("BinaryName") if isinstance(node, dict) else None
    if not wrapper:
        return Result("containerd", FAIL, f"{path} has no runtime `cgpu` with a BinaryName ([{where}.runtimes.cgpu]): "
                                          "run `cgpu runtime-config containerd`, restart containerd")
    why = _executable(str(wrapper))
    if why:
        return Result("containerd", FAIL, f"{path}'s runtime cgpu is {why}: run `make install-hooks`")
    default = isinstance(cri, dict) and cri.get("default_runtime_name") == "cgpu"
    return Result("containerd", OK, f"{path}: the runtime cgpu runs {wrapper}" +
                  (" (the default runtime)" if default else "; not the default runtime: a pod must name "
                   "runtimeClassName: cgpu, or it runs unisolated (`cgpu runtime-config containerd --default`)"))


def check_nvml(h: Host) -> Result:
    devices = (h.hello or {}).get("devices") or []
    if not any(os.path.basename(str(d)).startswith("nvidia") for d in devices):
        return Result("nvml", SKIP, "the daemon runs on simulated GPUs (or is not running)")
    missing = [d for d in devices if not os.path.exists(d)]
    if missing:
        return Result("nvml", FAIL, f"{', '.join(missing)} missing: is the NVIDIA driver loaded (nvidia-smi)?")
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:  # pynvml raises its own NVMLError kinds, and OSError when the library is missing
        return Result("nvml", FAIL, f"NVML does not answer ({exc}): check the driver with nvidia-smi")
    return Result("nvml", OK, f"NVML answers: {count} GPUs; {', '.join(devices)} exist")


def check_health(h: Host) -> Result:
    """The GPUs' health as the daemon watches it (docs/gpus.md, Health)."""
    if h.hello is None:
        return Result("gpu health", SKIP, "the daemon is not running")
    try:
        with Client(h.socket, timeout=3) as c:
            gpus = c.call("query").get("gpus", [])
    except (DaemonUnavailable, ControlError, OSError, ValueError) as exc:
        return Result("gpu health", FAIL, f"the daemon did not answer the query ({exc}): see its log")
    out = [g for g in gpus if not (g.get("health") or {}).get("healthy", True)]
    if not out:
        return Result("gpu health", OK, f"all {len(gpus)} GPUs in service")
    return Result("gpu health", FAIL, "; ".join(
        f"GPU {g['index']} ({g.get('uuid')}) is out of service: {g['health'].get('reason') or 'failed'}"
        + (", for good until cgpud restarts" if g["health"].get("retired") else ", back by itself once it answers "
           "healthily for the quiet time") + f"; {g['health'].get('advice') or 'see the daemon log'}" for g in out))


CHECKS: tuple[Callable[[Host], Result], ...] = (check_daemon, check_tree, check_fuse, check_cgroups,
                                                check_hooks_d, check_hook, check_library, check_docker,
                                                check_containerd,
                                                check_nvml, check_health)


def run(h: Host) -> list[Result]:
    return [check(h) for check in CHECKS]
