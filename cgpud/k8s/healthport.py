"""A health port: plain HTTP, `GET /healthz` only, for a probe that has no client certificate (the
kubelet's), beside a TLS port that takes only the API server's (cgpud.k8s.webhookserver).

What a caller can do to it costs the serving port nothing and the probe little: one thread, a
selector, no thread per connection; a request is answered once its head has come (or refused:
404 for another path, 400 for what is not a request head); a connection gets DEADLINE_S for that,
and at most MAX_OPEN wait at once (a new one pushes out the oldest, so a flood of silent
connections cannot keep the probe out: the probe sends its request as soon as it connects).
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time

log = logging.getLogger("cgpud.k8s")
DEADLINE_S = 2.0  # from accept to the request head's end
MAX_OPEN = 256  # connections waiting for their request head at once; a new one drops the oldest
MAX_HEAD = 4096  # bytes of a request head


def _answer(code: int, text: str) -> bytes:
    body = text.encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[code]
    return (f"HTTP/1.0 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def reply_to(head: bytes) -> bytes:
    """The answer to a request head (its first line decides)."""
    first = head.split(b"\r\n", 1)[0].split()
    if len(first) != 3 or not first[2].startswith(b"HTTP/"):
        return _answer(400, "not an HTTP request\n")
    if first[0] in (b"GET", b"HEAD") and first[1].split(b"?")[0] == b"/healthz":
        return _answer(200, "ok\n")
    return _answer(404, "only GET /healthz here\n")


class HealthPort:
    """Serves host:port on a thread of its own until `close`."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.sock.setblocking(False)
        self.server_address = self.sock.getsockname()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.open: dict[socket.socket, list] = {}  # connection -> [deadline, head so far]; insertion order: age
        self.dropped = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cgpu-health", daemon=True)
        self.thread.start()

    def _drop(self, conn: socket.socket, reply: bytes | None = None) -> None:
        self.open.pop(conn, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            if reply is not None:
                conn.send(reply)  # (small: it fits the empty send buffer, nothing waits)
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # (EMFILE and the like: the next turn tries again)
                log.debug("health port: accept: %s", exc)
                return
            conn.setblocking(False)
            if len(self.open) >= MAX_OPEN:
                self.dropped += 1
                self._drop(next(iter(self.open)))
            self.open[conn] = [time.monotonic() + DEADLINE_S, b""]
            self.sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        entry = self.open.get(conn)
        if entry is None:
            return
        try:
            data = conn.recv(MAX_HEAD)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            return self._drop(conn)
        entry[1] += data
        if b"\r\n\r\n" in entry[1] or b"\n\n" in entry[1]:
            self._drop(conn, reply_to(entry[1]))
        elif len(entry[1]) > MAX_HEAD:
            self._drop(conn, _answer(400, "request head too long\n"))

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(0.2):
                if key.fileobj is self.sock:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in self.open.items() if deadline < now]:
                self.dropped += 1
                self._drop(conn)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for conn in list(self.open):
            self._drop(conn)
        self.sel.close()
        self.sock.close()
