"""A daemon started in a terminal stays the one its Ctrl-C stops, across hot
upgrades (docs/upgrade.md).

After a hot upgrade the daemon that served hands everything to a new process
and ends; under systemd, MAINPID tells the service manager which process is
the service now. In a terminal, the shell waits for the process it started:
if that one ended, the prompt would come back and Ctrl-C would no longer
reach the daemon. So a daemon started in a terminal (stdin a tty, no
NOTIFY_SOCKET), once it has handed over, stays as a thin relay:

- it is the child subreaper of what it started, so each later daemon (the
  next hot upgrade's, started by the one before, which then ends) becomes its
  child too: the chain never grows, one relay serves any number of upgrades;
- which daemon serves now is written in the state directory's lock file
  (cgpud.state.lock), and the relay follows it;
- SIGINT, SIGTERM and SIGHUP are passed to the serving daemon; when that one
  ends without handing over, the relay ends with its exit status (one that
  had handed over is followed to its successor however it ended: a Ctrl-C
  may kill it by SIGINT while it is ending).
The relay holds nothing of the daemon's (no mount, socket, lock or cgroup).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal

from cgpud.state.lock import LOCK_NAME

log = logging.getLogger("cgpud")
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def in_terminal() -> bool:
    return os.isatty(0) and not os.environ.get("NOTIFY_SOCKET")


def _serving(state_dir: str) -> int | None:
    try:
        with open(os.path.join(state_dir, LOCK_NAME)) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def relay(successor: int, state_dir: str) -> int:
    """Wait for the daemons that serve after this one, passing signals on; their
    last exit status."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    current = successor

    def forward(sig, _frame) -> None:
        try:
            os.kill(current, sig)
        except ProcessLookupError:
            pass

    for sig in SIGNALS:
        signal.signal(sig, forward)
    log.info("pid %d serves now; this process passes Ctrl-C on to it and ends with it", current)
    status = 0
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        if pid != current:
            continue  # something a daemon left behind, reaped
        status = os.waitstatus_to_exitcode(raw)
        after = _serving(state_dir)
        # It handed over in turn: its successor is our child now. Whatever its own end: a Ctrl-C
        # that reaches the whole process group while it is ending after a hand-over kills it by
        # SIGINT, and the daemon that serves now is the one the Ctrl-C is for.
        if after is not None and after != current and os.path.exists(f"/proc/{after}"):
            current = after
            log.info("pid %d serves now", current)
            continue
        return 128 - status if status < 0 else status
