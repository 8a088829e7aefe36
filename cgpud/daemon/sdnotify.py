"""The systemd notify protocol: one datagram to $NOTIFY_SOCKET per message."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("cgpud")


def notify(message: str) -> bool:
    """Send e.g. "READY=1"; False when not run under a notify-aware manager."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.send(message.encode(), socket.MSG_DONTWAIT)  # never block the event loop on a full queue
    except OSError as exc:  # the manager went away: nothing to tell, nothing to stop for
        log.warning("cannot notify %s (%s): %s", addr.lstrip("\0"), message, exc.strerror or exc)
        return False
    return True
