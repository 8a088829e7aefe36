"""A synchronous client of the control socket (docs/control.md)."""
from __future__ import annotations

import errno
import json
import os
import socket

from cgpud.state.paths import default_socket


class DaemonUnavailable(Exception):
    """No daemon answers on the socket."""


class ControlError(Exception):
    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error  # an errno name, e.g. "EBUSY"
        self.errno = getattr(errno, error, errno.EIO)


class Client:
    def __init__(self, path: str | None = None, timeout: float = 10.0) -> None:
        self.path = path or os.environ.get("CGPUD_SOCKET") or default_socket()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self.sock.close()
            raise DaemonUnavailable(f"cgpud is not running (nothing answers on {self.path}): start it with `cgpud serve`") from exc
        except PermissionError as exc:
            self.sock.close()
            raise DaemonUnavailable(f"no permission to reach cgpud on {self.path}") from exc
        self._rfile = self.sock.makefile("rb")

    def call(self, op: str, **args):
        try:
            self.sock.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            line = self._rfile.readline()
        except socket.timeout:
            raise DaemonUnavailable(f"cgpud did not answer on {self.path} in time") from None
        except OSError as exc:
            raise DaemonUnavailable(f"lost the connection to cgpud on {self.path}: {exc.strerror}") from None
        if not line:
            raise DaemonUnavailable(f"cgpud closed the connection on {self.path}")
        resp = json.loads(line)
        if not resp.get("ok"):
            raise ControlError(resp.get("error", "EIO"), resp.get("message", "refused"))
        return resp.get("result")

    def close(self) -> None:
        self._rfile.close()
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
