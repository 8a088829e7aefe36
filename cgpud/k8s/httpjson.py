"""What the HTTP servers of the control plane's parts share (the scheduler extender, the DRA
webhook): a threading server with a backlog for an API server or kube-scheduler that asks in
parallel, a request handler that reads its headers without the email parser, and a JSON answer."""
from __future__ import annotations

import json
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_HEADERS = 100  # (as http.client's limit)
MAX_LINE = 65536


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # callers ask in parallel; the default backlog of 5 resets connections

    def get_request(self):
        sock, addr = super().get_request()
        # An answer goes out as it is written (TCP_NODELAY, as Go's net/http sets on its own): its
        # headers and its body are two writes, and Nagle's algorithm would hold the body until the
        # caller ACKs the headers, which Linux's delayed ACK puts off up to 40 ms: 40 ms on every
        # answer on a kept-alive connection (kube-scheduler's to the extender: filter, then prioritize,
        # in the scheduling cycle that schedules one pod at a time).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, addr


def send_json(handler: BaseHTTPRequestHandler, code: int, obj) -> None:
    """`obj` as JSON; bytes are sent as they are (JSON already)."""
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()  # (a buffered writer, as Handler's: the headers and the body go in one write)


class Headers(dict):
    """A request's headers, by name in any case (the last of a repeated name)."""

    def get(self, name: str, default=None):
        return super().get(name.lower(), default)

    def __getitem__(self, name: str):
        return super().__getitem__(name.lower())

    def __contains__(self, name) -> bool:
        return super().__contains__(name.lower())


class Handler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler whose parse_request reads the header lines itself: the standard library
    hands them to the email package's parser, which took as long as a filter's own work in a burst
    of kube-scheduler's calls (each a handful of headers). HTTP/1.0 and 1.1; the request line, the
    keep-alive rules, Expect: 100-continue and the limits on header lines are the standard library's.
    A request is read in 64 KiB reads (a filter's body, ~10 KiB at 1,000 nodes, in one) and an answer
    written in one (its headers and body: send_json flushes): each read or write lets go of the GIL,
    and getting it back waits behind the process's other threads (a burst's binds)."""

    rbufsize = wbufsize = 1 << 16

    def handle_expect_100(self) -> bool:
        ok = super().handle_expect_100()
        self.wfile.flush()  # (the interim answer goes now: the caller waits for it before its body)
        return ok

    def parse_request(self) -> bool:
        self.command = None
        self.request_version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if not words:
            return False
        if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request ({self.requestline[:100]!r}): HTTP/1.0 or 1.1 only")
            return False
        self.command, self.path, self.request_version = words
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        headers = self.headers = Headers()
        while True:
            line = self.rfile.readline(MAX_LINE + 1)
            if len(line) > MAX_LINE:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long")
                return False
            if line in (b"\r\n", b"\n", b""):
                break
            name, sep, value = str(line, "iso-8859-1").partition(":")
            if not sep or not name or name != name.strip():
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad header line ({line[:100]!r})")
                return False
            dict.__setitem__(headers, name.lower(), value.strip())
            if len(headers) > MAX_HEADERS:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
                return False
        conntype = headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif self.protocol_version >= "HTTP/1.1" and (self.request_version == "HTTP/1.1" or conntype == "keep-alive"):
            self.close_connection = False
        if (headers.get("Expect", "").lower() == "100-continue" and self.protocol_version >= "HTTP/1.1"
                and self.request_version == "HTTP/1.1"):
            return self.handle_expect_100()
        return True
