"""`cgpu node install` / `cgpu node uninstall`: a GPU node's host parts, put
there from the image by the DaemonSet's init container (docs/kubernetes.md),
as NVIDIA's container toolkit and HAMi do: the host's root is mounted at
`host` (e.g. /host) and every path below is the host's.

install:
- copies the programs from `source` (the image's own root, "/") to the paths
  the configurations name: cgpu-hook (the daemon's --hook-path default),
  cgpu-runtime (containerd's BinaryName, Docker's runtimes.cgpu.path) and
  libcgpu.so (the daemon's --libcgpu default). Each file is written under a
  temporary name in its directory and renamed over the old one: a running
  container keeps the library it mapped, a starting one gets the whole new one.
  A file already equal (bytes and mode) is not written again.
- writes the hooks.d file (podman, CRI-O) naming the hook;
- puts the runtime `cgpu` into containerd's config.toml (version 2 or 3) and
  Docker's daemon.json where those engines are installed (hostconfig), every
  other setting kept; with `default_runtime` cgpu becomes containerd's default
  runtime, and when the runtime that was the default ran another program
  (nvidia-container-runtime), /etc/cgpud/runtime.conf names it, so cgpu-runtime
  hands containers to it (NVIDIA's hook still mounts the driver);
- gets containerd to load a changed config (again on a later run if that
  restart did not happen): `restart="systemd"` runs the
  host's `systemctl restart containerd` (chroot into the host's root; running
  containers survive a containerd restart); "none" leaves it to the caller.
  Docker is never restarted (without live-restore that stops its containers):
  the report says to.
- writes what it did to /etc/cgpud/node-install.json; a file it replaced is
  kept under /var/lib/cgpud/node-install/ so uninstall can put it back.

A second install on the same host writes nothing and restarts nothing.
uninstall undoes exactly that: a config file still as the install left it
gets its old bytes back; one changed since loses only what the install added.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable

from cgpud.containers import hostconfig
from cgpud.containers.spec import DEFAULT_HOOK_PATH, DEFAULT_LIBCGPU, HOOK_STAGES

RECORD = "/etc/cgpud/node-install.json"
BACKUP = "/var/lib/cgpud/node-install"
RUNTIME_CONF = "/etc/cgpud/runtime.conf"  # cgpu-runtime's `runtime = PATH` (native/runtime)
HOOKS_D = "/etc/containers/oci/hooks.d/cgpu-hook.json"
SOCKET = "/run/cgpud/cgpud.sock"
# (host path, path in the source root, mode): the programs the configurations name
PROGRAMS = (
    (DEFAULT_HOOK_PATH, "/usr/local/libexec/cgpu-hook", 0o755),
    (hostconfig.DEFAULT_WRAPPER, "/usr/local/libexec/cgpu-runtime", 0o755),
    (DEFAULT_LIBCGPU, "/usr/local/lib/cgpu/libcgpu.so", 0o644),
)
ENGINES = {  # engine: (its settings file, the programs that say it is installed, the unit that runs it)
    "containerd": ("/etc/containerd/config.toml", ("containerd",), "containerd.service"),
    "docker": ("/etc/docker/daemon.json", ("dockerd",), "docker.service"),
}
BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin", "/usr/local/sbin")


class InstallError(Exception):
    """The node cannot be set up (or undone) as asked; str() is one line saying what to do."""


def hooks_d_json() -> str:
    """deploy/hooks.d/cgpu-hook.json (a test checks they are the same)."""
    return json.dumps({
        "version": "1.0.0",
        "hook": {"path": DEFAULT_HOOK_PATH, "args": ["cgpu-hook", "auto"], "env": [f"CGPUD_SOCKET={SOCKET}"],
                 "timeout": 10},
        "when": {"always": True},
        "stages": list(HOOK_STAGES),
    }, indent=2) + "\n"


@dataclass
class Report:
    written: list[str] = field(default_factory=list)  # host paths (re)written
    kept: list[str] = field(default_factory=list)  # host paths already as they should be
    removed: list[str] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)  # engine: what happened to its settings
    restarted: list[str] = field(default_factory=list)
    todo: list[str] = field(default_factory=list)  # what the person still has to do

    def as_dict(self) -> dict:
        return {"written": self.written, "kept": self.kept, "removed": self.removed, "engines": self.engines,
                "restarted": self.restarted, "todo": self.todo}


class Host:
    """The host's root, mounted at `root`."""

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise InstallError(f"--host-root {root} is not a directory: mount the host's / there "
                               "(hostPath / at /host)")
        self.root = os.path.abspath(root)

    def path(self, p: str) -> str:
        return os.path.join(self.root, p.lstrip("/"))

    def read(self, p: str) -> bytes | None:
        try:
            with open(self.path(p), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise InstallError(f"cannot read {p} on the host: {exc.strerror}") from None

    def mode(self, p: str) -> int | None:
        try:
            return os.lstat(self.path(p)).st_mode & 0o7777
        except OSError:
            return None

    def makedirs(self, d: str, made: list[str]) -> None:
        """Make `d` and its missing parents, noting each made (host paths, outermost first)."""
        missing = []
        while d not in ("", "/") and not os.path.isdir(self.path(d)):
            missing.append(d)
            d = os.path.dirname(d)
        for m in reversed(missing):
            os.mkdir(self.path(m), 0o755)
            made.append(m)

    def write(self, p: str, data: bytes, mode: int, made: list[str]) -> None:
        """Atomically: a temporary file in the same directory, synced, then renamed over `p`."""
        try:
            self.makedirs(os.path.dirname(p), made)
            final = self.path(p)
            tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.cgpu-new-{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fchmod(f.fileno(), mode)
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                with _quiet():
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise InstallError(f"cannot write {p} on the host: {exc.strerror}") from None

    def has_program(self, names: tuple[str, ...]) -> bool:
        return any(os.path.exists(self.path(os.path.join(d, n))) for d in BIN_DIRS for n in names)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _load_record(host: Host) -> dict:
    data = host.read(RECORD)
    if data is None:
        return {"files": {}, "dirs": [], "engines": {}}
    try:
        rec = json.loads(data)
        rec.setdefault("files", {}), rec.setdefault("dirs", []), rec.setdefault("engines", {})
        return rec
    except (ValueError, AttributeError):
        raise InstallError(f"{RECORD} on the host is not what `cgpu node install` writes; move it away") from None


def _put(host: Host, rec: dict, report: Report, p: str, data: bytes, mode: int) -> None:
    """Write one host file unless it is that already; the first time, keep what was there."""
    if host.read(p) == data and host.mode(p) == mode and not os.path.islink(host.path(p)):
        report.kept.append(p)
        return
    entry = rec["files"].get(p)
    if entry is None:
        entry = {"before": None}
        old = host.read(p) if not os.path.islink(host.path(p)) else None
        if os.path.islink(host.path(p)):
            entry["before_link"] = os.readlink(host.path(p))
        elif old is not None:
            backup = os.path.join(BACKUP, p.lstrip("/"))
            host.write(backup, old, host.mode(p) or 0o644, rec["dirs"])
            entry["before"] = backup
            entry["before_mode"] = host.mode(p)
    host.write(p, data, mode, rec["dirs"])
    entry["sha256"] = _sha(data)
    rec["files"][p] = entry
    report.written.append(p)


def detect_engines(host: Host) -> list[str]:
    return [e for e, (conf, programs, _) in ENGINES.items()
            if os.path.exists(host.path(conf)) or host.has_program(programs)]


Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _restart(host: Host, engine: str, how: str, report: Report, runner: Runner) -> None:
    unit = ENGINES[engine][2]
    step = f"systemctl restart {unit} on the node"
    if engine == "docker":
        report.todo.append(f"{step} (not done here: without live-restore it stops Docker's containers)")
        return
    if how == "none":
        report.todo.append(step)
        return
    try:
        r = runner(["chroot", host.root, "systemctl", "restart", unit])
    except (OSError, subprocess.SubprocessError) as exc:
        raise InstallError(f"cannot run the host's systemctl ({exc}): {step}, or use --restart none") from None
    if r.returncode != 0:
        why = (r.stderr or r.stdout or "").strip().splitlines()
        raise InstallError(f"the host's `systemctl restart {unit}` failed ({why[-1] if why else r.returncode}): "
                           f"its settings are written; {step} by hand")
    report.restarted.append(engine)


def _engine(host: Host, rec: dict, report: Report, engine: str, default_runtime: bool, made: list[str]) -> bool:
    """Put the runtime into one engine's settings; whether they changed."""
    conf = ENGINES[engine][0]
    raw = host.read(conf)
    old = None if raw is None else raw.decode()
    previous = None
    try:
        if engine == "containerd":
            new, previous = hostconfig.containerd_edit(old, hostconfig.DEFAULT_WRAPPER, default_runtime)
        else:
            new = hostconfig.docker(old, hostconfig.DEFAULT_WRAPPER, False)
            previous = hostconfig.docker_settings(old).get("default-runtime")
    except hostconfig.ConfigError as exc:
        raise InstallError(f"{conf} on the host: {exc}") from None
    entry = rec["engines"].get(engine)
    if new == old:
        report.engines[engine] = "cgpu runtime set already"
        return False
    if entry is None:
        entry = {"before": old, "previous_default": previous if previous != "cgpu" else None}
    mode = host.mode(conf) or 0o644
    host.write(conf, new.encode(), mode, made)
    report.written.append(conf)
    entry["written"] = new
    entry["restart_pending"] = engine == "containerd"  # (Docker is never restarted by us)
    rec["engines"][engine] = entry
    report.engines[engine] = "cgpu runtime added" + (" (the default runtime)" if default_runtime and
                                                      engine == "containerd" else "")
    return True


def install(root: str, source: str = "/", engines: tuple[str, ...] = ("auto",), default_runtime: bool = True,
            restart: str = "systemd", runner: Runner = _run) -> Report:
    host = Host(root)
    rec = _load_record(host)
    report = Report()
    programs = []
    for dest, src, mode in PROGRAMS:
        try:
            with open(os.path.join(source, src.lstrip("/")), "rb") as f:
                programs.append((dest, f.read(), mode))
        except OSError as exc:
            raise InstallError(f"{os.path.join(source, src.lstrip('/'))}: {exc.strerror}: this image lacks the "
                               "node's programs (`make install-hooks` puts them there)") from None
    chosen = detect_engines(host) if "auto" in engines else [e for e in engines if e != "none"]
    for e in chosen:
        if e not in ENGINES:
            raise InstallError(f"--engine {e}: expected containerd, docker, auto or none")
    for e in chosen:  # every refusal before anything is written
        raw = host.read(ENGINES[e][0])
        try:
            (hostconfig.containerd_edit if e == "containerd" else hostconfig.docker)(None if raw is None else
                                                                                     raw.decode())
        except hostconfig.ConfigError as exc:
            raise InstallError(f"{ENGINES[e][0]} on the host: {exc}") from None
    changed = []
    before = json.dumps(rec, sort_keys=True)
    try:
        for dest, data, mode in programs:
            _put(host, rec, report, dest, data, mode)
        _put(host, rec, report, HOOKS_D, hooks_d_json().encode(), 0o644)
        for e in chosen:
            if _engine(host, rec, report, e, default_runtime, rec["dirs"]):
                changed.append(e)
            if e == "containerd":
                conf = host.read(ENGINES[e][0]).decode()
                chain = hostconfig.default_binary(conf, rec["engines"].get(e, {}).get("previous_default"))
                if default_runtime and chain and chain != hostconfig.DEFAULT_WRAPPER:
                    _put(host, rec, report, RUNTIME_CONF,
                         f"# written by cgpu node install\nruntime = {chain}\n".encode(), 0o644)
    finally:  # (also after a failure half-way: uninstall undoes what was done)
        if json.dumps(rec, sort_keys=True) != before:
            host.makedirs(os.path.dirname(RECORD), rec["dirs"])  # (noted before the record is written)
            host.write(RECORD, (json.dumps(rec, indent=2) + "\n").encode(), 0o644, rec["dirs"])
    # containerd is restarted when its settings changed, and again on a later run when a restart
    # has not happened since they were written (it failed, or --restart none): never left unloaded
    for e in chosen:
        entry = rec["engines"].get(e) or {}
        if e in changed or entry.get("restart_pending"):
            _restart(host, e, restart, report, runner)
            if e in report.restarted:
                entry["restart_pending"] = False
                host.write(RECORD, (json.dumps(rec, indent=2) + "\n").encode(), 0o644, rec["dirs"])
    return report


# What containers started through the runtime cgpu need for as long as they exist: their shim calls
# the runtime to kill and delete them (a node whose cgpu-runtime is gone cannot stop its pods).
RUNTIME_KEPT = (hostconfig.DEFAULT_WRAPPER, RUNTIME_CONF)


def uninstall(root: str, restart: str = "systemd", runner: Runner = _run, keep: tuple[str, ...] = ()) -> Report:
    """Undo the install. `keep`: files left in place (and in the record, so that a later uninstall
    removes them) — RUNTIME_KEPT while containers started through the runtime may still run."""
    host = Host(root)
    if host.read(RECORD) is None:
        raise InstallError(f"{RECORD} is not on the host: `cgpu node install` did not run there (nothing to undo)")
    rec = _load_record(host)
    report = Report()
    changed = []
    for engine, entry in rec["engines"].items():
        conf = ENGINES[engine][0]
        raw = host.read(conf)
        if raw is None:
            continue
        now = raw.decode()
        if now == entry.get("written"):
            before = entry.get("before")
        else:  # changed since: take out only what the install added
            try:
                before = (hostconfig.undo_containerd if engine == "containerd" else hostconfig.undo_docker)(
                    now, entry.get("previous_default"))
            except hostconfig.ConfigError as exc:
                raise InstallError(f"{conf} on the host: {exc}") from None
        if before is None:
            os.unlink(host.path(conf))
        else:
            host.write(conf, before.encode(), host.mode(conf) or 0o644, [])
        report.engines[engine] = "cgpu runtime removed"
        changed.append(engine)
    kept: dict[str, dict] = {}
    for p, entry in rec["files"].items():
        data = host.read(p)
        if p in keep and data is not None:
            kept[p] = entry
            report.todo.append(f"{p} kept while containers started through the runtime cgpu may run (their shim "
                               "calls it to stop them): `cgpu node uninstall` again once they are gone")
            continue
        if data is not None and _sha(data) != entry.get("sha256"):
            report.todo.append(f"{p} changed since it was installed: left as it is")
            continue
        if entry.get("before_link"):
            with _quiet():
                os.unlink(host.path(p))
            os.symlink(entry["before_link"], host.path(p))
        elif entry.get("before"):
            old = host.read(entry["before"])
            host.write(p, old, entry.get("before_mode") or 0o644, [])
        elif data is not None:
            os.unlink(host.path(p))
        report.removed.append(p)
    if kept:  # (the rest for a later uninstall; an install goes on from it)
        host.write(RECORD, (json.dumps({"files": kept, "dirs": rec["dirs"], "engines": {}}, indent=2) + "\n").encode(),
                   0o644, [])
        for e in changed:
            _restart(host, e, restart, report, runner)
        return report
    os.unlink(host.path(RECORD))
    if os.path.isdir(host.path(BACKUP)):
        shutil.rmtree(host.path(BACKUP))
    for d in reversed(rec["dirs"]):
        with _quiet():
            os.rmdir(host.path(d))
    for e in changed:
        _restart(host, e, restart, report, runner)
    return report
