"""Ctrl-C across hot upgrades (issue 15, docs/upgrade.md): a daemon started
in a terminal stays the process its Ctrl-C stops. Here the terminal is a
real pseudo-terminal: the daemon is its session's foreground process, two hot
upgrades hand the tree to new processes, and then ^C typed on the terminal
stops the daemon that serves, the mount goes, and the process the terminal
started ends (status 0): the shell's prompt comes back only then."""
from __future__ import annotations

import os
import pty
import sys
import threading
import time

from cgpud.client import Client, DaemonUnavailable
from conftest import mounted, shell


def hello_pid(d) -> int | None:
    try:
        with Client(str(d.socket), timeout=2) as c:
            return c.call("hello")["pid"]
    except (DaemonUnavailable, OSError):
        return None


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_ctrl_c_in_the_terminal_stops_the_daemon_after_hot_upgrades(make_daemon):
    d = make_daemon(start=False)
    cmd = d.command()
    pid, master = pty.fork()
    if pid == 0:  # the terminal's foreground process, as a shell starts it
        os.execv(cmd[0], cmd)
    out = bytearray()
    reader = threading.Thread(target=lambda: _drain(master, out), daemon=True)
    reader.start()
    try:
        wait_for(lambda: hello_pid(d) == pid and mounted(d.mount), 20, "the daemon")
        serving = pid
        for n in range(2):
            r = shell(f"echo 1 > {d.path('upgrade')}")
            assert r.returncode == 0, r.stderr + out.decode(errors="replace")
            wait_for(lambda: hello_pid(d) not in (None, serving), 30, f"upgrade {n + 1}")
            wait_for(lambda: d.value("upgrade").startswith("done"), 10, "done")
            serving = hello_pid(d)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the process the terminal started ended after the upgrades"
        os.write(master, b"\x03")  # ^C
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "^C did not stop it:\n" + out.decode(errors="replace")
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")
        wait_for(lambda: not mounted(d.mount), 10, "the mount to go")
        assert hello_pid(d) is None and not os.path.exists(f"/proc/{serving}"), "the serving daemon still runs"
    finally:
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            pass
        os.close(master)


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        into += data
