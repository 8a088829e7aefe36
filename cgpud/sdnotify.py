"""The systemd notify protocol: one datagram to $NOTIFY_SOCKET per message."""
from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send e.g. "READY=1"; False when not run under a notify-aware manager."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True
