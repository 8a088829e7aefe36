"""The control socket's protocol, apart from what it serves (docs/control.md).

Unix stream socket, JSON lines: one request object per line, one response per
request, in order. A request is `{"op": NAME, ...arguments}`; a response is
`{"ok": true, "result": …}` or `{"ok": false, "error": "EINVAL", "message": "…"}`
(the error is an errno name, the message one line for a person).

Here: the framing (`decode_line`, `encoded`, `MAX_LINE`), who the peer is
(`peer_of`: SO_PEERCRED and SO_PEERGROUPS), a refusal (`Refused`), argument
checks (`arg`), and the one mapping of errors to responses (`error_response`,
with the model's errno table, core.model.ERRNOS).
"""
from __future__ import annotations

import errno
import json
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import trio

from cgpud.control.callers import HOST, Who
from cgpud.core.model import ModelError, errno_of

log = logging.getLogger("cgpud")

MAX_LINE = 64 * 1024  # the longest request line; a longer one is answered EINVAL and the connection closed
TOO_LONG = {"ok": False, "error": "EINVAL", "message": f"request line too long (over {MAX_LINE} bytes); connection closed"}


class Refused(Exception):
    """A request refused with an errno and one line of reason."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    conn: int = 0  # which connection: registrations made with cgroup=true belong to it
    # Supplementary groups as the kernel recorded them at connect (SO_PEERGROUPS);
    # None: unknown, read from /proc (racy: the pid may be another process by now).
    supplementary: frozenset[int] | None = None
    # Who the kernel says it is (control.callers): host or container; and which socket it came on
    # ("host": the daemon's own; "tenant": the one the containers are given, TENANT_DIR)
    who: Who = HOST
    socket: str = "host"

    def groups(self) -> set[int]:
        if self.supplementary is not None:
            return set(self.supplementary) | {self.gid}
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        return {int(g) for g in line.split()[1:]} | {self.gid}
        except OSError:
            pass
        return {self.gid}


class Streamed:
    """A result given as JSON text in pieces (a large answer: `trace`): the
    server sends it whole, but lets the schedulers run between pieces."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self.pieces = pieces

    def text(self) -> str:
        return "".join(self.pieces)


async def encoded(resp: dict) -> bytes:
    """A response as its line; a Streamed result a piece at a time, the
    schedulers running in between."""
    if not isinstance(resp.get("result"), Streamed):
        return json.dumps(resp).encode() + b"\n"
    parts = ['{"ok": true, "result": ']
    for piece in resp["result"].pieces:
        parts.append(piece)
        await trio.sleep(0)
    return ("".join(parts) + "}\n").encode()


def decode_line(line: bytes) -> Any:
    """One request line -> the request, or Refused: not UTF-8, not JSON,
    nested too deep for the parser (a line of 100,000 `[`), numbers too long."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return Refused(errno.EINVAL, "not a JSON line")


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def peer_of(sock: socket.socket) -> Peer:
    """The peer's credentials as of its connect(): pid, uid, gid and its
    supplementary groups, all recorded by the kernel then."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    supplementary = None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # (CPython allows 1024 bytes: 256 groups)
        supplementary = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass  # an older kernel, or more than 256 groups (ERANGE): groups() reads /proc
    return Peer(pid, uid, gid, supplementary=supplementary)


def arg(req: dict, name: str, kind: type | tuple, default: Any = ..., *, allow_none: bool = False) -> Any:
    if name not in req:
        if default is ...:
            raise Refused(errno.EINVAL, f"missing argument {name!r}")
        return default
    v = req[name]
    if v is None and allow_none:
        return None
    if isinstance(v, bool) and kind is not bool and (not isinstance(kind, tuple) or bool not in kind):
        raise Refused(errno.EINVAL, f"argument {name!r} has the wrong type")
    if not isinstance(v, kind):
        raise Refused(errno.EINVAL, f"argument {name!r} has the wrong type")
    return v


def error_response(exc: BaseException, req: Any = None) -> dict:
    """The response for a request that raised `exc`: its errno and one line."""
    if isinstance(exc, Refused):
        return {"ok": False, "error": errno.errorcode[exc.code], "message": str(exc)}
    if isinstance(exc, ModelError):
        return {"ok": False, "error": errno.errorcode[errno_of(exc)], "message": str(exc)}
    if isinstance(exc, OSError):
        code = exc.errno or errno.EIO
        return {"ok": False, "error": errno.errorcode.get(code, "EIO"), "message": exc.strerror or str(exc)}
    # a bug must cost one request, never the daemon
    log.error("control request %.200r failed", req, exc_info=exc)
    return {"ok": False, "error": "EIO", "message": "internal error; see the daemon's log"}


def gpu_arg(req: dict) -> int | None:
    """The optional `gpu` argument: a GPU index, or None."""
    gpu = arg(req, "gpu", int, None, allow_none=True)
    if gpu is not None and gpu < 0:
        raise Refused(errno.EINVAL, f"no GPU {gpu}")
    return gpu
