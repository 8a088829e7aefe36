"""What the HTTP servers of the control plane's parts share (the scheduler extender, the DRA
webhook): a threading server with a backlog for an API server or kube-scheduler that asks in
parallel, and a JSON answer."""
from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # callers ask in parallel; the default backlog of 5 resets connections


def send_json(handler: BaseHTTPRequestHandler, code: int, obj) -> None:
    body = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
