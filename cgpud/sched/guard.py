"""The guard: no container stays frozen after the daemon is gone (SPEC §7).

Three pieces:

- **The registry** (`Registry`): a small JSON file, a list of the targets the
  daemon may freeze, one object each, as `Freezer.spec()` gives them:

      [{"kind": "cgroup2", "path": "/sys/fs/cgroup/unified/cgpud/0-abc", "label": "0/abc"},
       {"kind": "freezer", "path": "/sys/fs/cgroup/freezer/docker/…"},
       {"kind": "signal", "pgid": 4242, "start": 123456},
       {"kind": "sim", "name": "0/def"}]

  The daemon rewrites it (write a temporary file, rename over) whenever the
  set changes: `add` before a target's first freeze, `discard` after its last
  thaw. No fsync: a frozen state does not outlive a reboot either, and the
  rename is atomic for every reader on this machine. Default place:
  `<state-dir>/enforced.json`.

- **thaw_all(path)**: thaws everything the registry names. The daemon calls it
  at start (before rewriting the registry: anything a crashed daemon left
  frozen) and at shutdown (after its own thaws, before removing the file).

- **The guard process**, `python -m cgpud.sched.guard --registry PATH --fd N
  --daemon-pid P`, started by `Guard.start(path)`. It waits for the daemon's
  end — EOF on the pipe whose write end only the daemon holds (kill -9
  included), or the daemon's pidfd becoming readable — then runs thaw_all on
  the registry as it is at that moment and exits. It lives in a session of
  its own (a terminal's SIGINT/SIGTERM/SIGHUP to the daemon's process group
  never reach it) and ignores those three signals anyway; it asks not to be
  chosen by the OOM killer. It thaws nothing the registry does not name, and
  validates every entry as the daemon does (cgroup paths inside a mounted
  hierarchy, never a root; a process group whose leader's start time no longer
  matches is left alone).

Only the standard library and cgpud.sched.enforce (itself standard library
only) are imported here, so the guard starts fast and depends on nothing the
daemon might have broken.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
import sys
from typing import Any, Iterable

from cgpud.sched.cgroupfs import protect_pid, unprotect_pid
from cgpud.sched.enforce import thaw_spec

log = logging.getLogger("cgpud.sched.guard")

REGISTRY_NAME = "enforced.json"
READY = b"ready\n"


class RegistryError(Exception):
    """The registry file cannot be read."""


class GuardError(RuntimeError):
    """The guard process could not be started."""


def registry_path(state_dir: str) -> str:
    return os.path.join(state_dir, REGISTRY_NAME)


def _entry(target: Any) -> dict[str, Any]:
    entry = target.spec() if hasattr(target, "spec") else target
    if not isinstance(entry, dict) or "kind" not in entry:
        raise TypeError(f"not a registry entry: {entry!r}")
    return dict(entry)


class Registry:
    """The daemon's side: the set of targets it may freeze, kept on disk.
    `add`/`discard` take a backend (anything with `spec()`) or an entry dict,
    and rewrite the file only when the set changes."""

    def __init__(self, path: str, entries: Iterable[Any] = ()) -> None:
        self.path = path
        self._entries: list[dict[str, Any]] = []
        try:
            self.replace(entries)
        except OSError as exc:
            # A full disk, say: no stale file may stay behind; nothing is frozen
            # until a target can be added (Enforcement.attach fails, and the
            # instance runs unscheduled).
            log.warning("cannot write %s (%s): instances run unscheduled until it can be written",
                        path, exc.strerror)
            self._entries = []
            self.remove_file()

    @property
    def entries(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self._entries]

    def add(self, target: Any) -> None:
        entry = _entry(target)
        if entry not in self._entries:
            self._entries.append(entry)
            self._write()

    def discard(self, target: Any) -> None:
        entry = _entry(target)
        if entry in self._entries:
            self._entries.remove(entry)
            self._write()

    def replace(self, targets: Iterable[Any]) -> None:
        entries: list[dict[str, Any]] = []
        for t in targets:
            e = _entry(t)
            if e not in entries:
                entries.append(e)
        self._entries = entries
        self._write()

    def remove_file(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _write(self) -> None:
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self._entries, f, indent=0)
            f.write("\n")
        os.replace(tmp, self.path)


def read_registry(path: str) -> list[Any]:
    """The entries of a registry file; [] if there is none. RegistryError if
    it is not a JSON list."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path}: {exc}") from None
    if not isinstance(data, list):
        raise RegistryError(f"{path}: not a JSON list")
    return data


def thaw_all(path: str) -> list[tuple[Any, str]]:
    """Thaw every target the registry at `path` names; [(entry, outcome)], the
    outcome one of "thawed", "gone", "nothing to do", "refused: …". Never
    raises for one bad entry; RegistryError if the file is unreadable."""
    results = []
    for entry in read_registry(path):
        outcome = thaw_spec(entry)
        (log.warning if outcome.startswith("refused") else log.info)("thaw %s: %s", entry, outcome)
        results.append((entry, outcome))
    return results


# ---- the daemon's handle on its guard ----------------------------------------------------


class Guard:
    """The running guard, seen from the daemon. `Guard.start(path)` returns
    once the guard is ready (its signals set up); `stop()` ends it in order
    (it thaws what the registry still names, then exits); `alive()` lets the
    daemon start a new one if this one was killed."""

    def __init__(self, proc: subprocess.Popen, wfd: int, registry: str) -> None:
        self.proc = proc
        self.registry = registry
        self._wfd = wfd

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, registry: str, *, timeout: float = 10.0) -> "Guard":
        rfd, wfd = os.pipe()  # both O_CLOEXEC: no child of the daemon keeps the write end
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cgpud.sched.guard", "--registry", os.path.abspath(registry),
                 "--fd", str(rfd), "--daemon-pid", str(os.getpid())],
                pass_fds=(rfd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                start_new_session=True, env=env,
            )
        except BaseException:
            os.close(wfd)
            raise
        finally:
            os.close(rfd)
        guard = cls(proc, wfd, registry)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line != READY:
            guard._close_pipe()
            proc.kill()
            proc.wait()
            raise GuardError(f"the guard did not get ready within {timeout} s (said {line!r})")
        protect_pid(proc.pid)
        return guard

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _close_pipe(self) -> None:
        if self._wfd >= 0:
            os.close(self._wfd)
            self._wfd = -1

    def stop(self, timeout: float = 5.0) -> int:
        """Close our end: the guard thaws what the registry names and exits.
        Returns its exit status."""
        self._close_pipe()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            unprotect_pid(self.proc.pid)


# ---- the guard process ----------------------------------------------------------------------


def _detach() -> None:
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader (Guard.start asks for a new session)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError as exc:
        log.debug("could not opt out of the OOM killer: %s", exc.strerror)  # no CAP_SYS_RESOURCE
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, b"cgpud-guard", 0, 0, 0)  # PR_SET_NAME, for ps
    except (OSError, AttributeError):
        pass


def _wait_for_daemon_end(fd: int, daemon_pid: int) -> str:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    pidfd = -1
    try:
        pidfd = os.pidfd_open(daemon_pid)
        poller.register(pidfd, select.POLLIN)
    except ProcessLookupError:
        return f"daemon {daemon_pid} already gone"
    except OSError as exc:
        log.warning("no pidfd for the daemon (%s): watching the pipe only", exc.strerror)
    try:
        while True:
            for ready, _ in poller.poll():
                if ready == pidfd:
                    return f"daemon {daemon_pid} exited"
                if not os.read(fd, 4096):
                    return "pipe closed"
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgpud.sched.guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", required=True, help="the daemon's registry file")
    parser.add_argument("--fd", type=int, required=True, help="read end of the daemon's pipe")
    parser.add_argument("--daemon-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="cgpud-guard[%(process)d]: %(message)s")
    _detach()
    os.write(1, READY)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the daemon reads one line only
    os.close(devnull)
    why = _wait_for_daemon_end(args.fd, args.daemon_pid)
    log.info("%s: thawing what %s names", why, args.registry)
    try:
        results = thaw_all(args.registry)
    except RegistryError as exc:
        log.error("%s", exc)
        return 1
    return 1 if any(outcome.startswith("refused") for _, outcome in results) else 0


if __name__ == "__main__":
    sys.exit(main())
