"""One daemon per state directory: an exclusive lock (flock) on
`<state dir>/lock`, taken before the daemon does anything else and held for
its life (docs/state.md). A second daemon on the same directory is refused
before it mounts, starts a guard or touches a cgroup.

A hot upgrade hands the lock on: the old daemon passes its open lock file to
the new one (CGPUD_STATE_LOCK_FD), so the lock is never free between them; a
flock belongs to the open file, which both then share until the old one exits.
"""
from __future__ import annotations

import errno
import fcntl
import os

LOCK_ENV = "CGPUD_STATE_LOCK_FD"
LOCK_NAME = "lock"


class Locked(Exception):
    """Another daemon holds the state directory; str() is one line."""


class StateLock:
    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, directory: str) -> "StateLock":
        """Lock `directory` (made if missing), or Locked / OSError. A lock handed
        on by a hot upgrade (CGPUD_STATE_LOCK_FD) is taken as it is."""
        path = os.path.join(directory, LOCK_NAME)
        inherited = os.environ.pop(LOCK_ENV, None)
        if inherited is not None:
            try:
                fd = int(inherited)
                os.set_inheritable(fd, False)
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: the same open file
                    return cls._owned(fd, path)
            except (ValueError, OSError):
                pass  # not a usable lock: take it the ordinary way
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                who = f"pid {holder}" if holder else "another process"
                raise Locked(f"another cgpud ({who}) uses the state directory {directory}: stop it, "
                             f"or give this one its own --state-dir (and --mount, --socket)") from None
            raise
        return cls._owned(fd, path)

    @classmethod
    def _owned(cls, fd: int, path: str) -> "StateLock":
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None
