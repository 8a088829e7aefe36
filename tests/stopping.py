"""Stopping a launching process (SIGSTOP) the way a test means it: stopped in its own code, not
inside the stand-in card's lock.

The stand-in card (native/stubs/cuda_exec.c) is advanced under an exclusive flock of its file by
whichever process calls into it; a process stopped while it holds that lock stalls the stand-in
card for every process. A real card runs on whatever its host processes do, so a test that stops a
launcher to see how cgpud treats a process that cannot answer retries until the stop fell outside
that lock (the stand-in's limit, written in docs/isolation.md, "The stand-in card")."""
from __future__ import annotations

import os
import select
import signal
import subprocess


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _holds_a_write_flock(pid: int) -> bool:
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields:  # (a waiter: "1: -> FLOCK ...")
                continue
            if len(fields) > 4 and fields[1] == "FLOCK" and fields[3] == "WRITE" and fields[4] == str(pid):
                return True
    return False


def stop_outside_card(p: subprocess.Popen | int, tries: int = 200) -> None:
    """SIGSTOP `p`, again and again until it is stopped holding no exclusive flock (the card's)."""
    pid = p if isinstance(p, int) else p.pid
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        while _state(pid) not in ("T", "t"):
            select.select([], [], [], 0.0005)
        if not _holds_a_write_flock(pid):
            return
        os.kill(pid, signal.SIGCONT)
        select.select([], [], [], 0.001)
    raise AssertionError(f"process {pid} was stopped inside the stand-in card's lock {tries} times in a row")
