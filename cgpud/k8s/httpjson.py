"""What the HTTP servers of the control plane's parts share (the scheduler extender, the DRA
webhook): a threading server with a backlog for an API server or kube-scheduler that asks in
parallel, and a JSON answer."""
from __future__ import annotations

import json
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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
    body = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
