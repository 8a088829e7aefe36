"""Crash: every write that returned success survives a `kill -9` of the daemon.

SPEC §1 and §7: "every accepted write is on disk before the write returns".
A writer thread in this process loops over `0/policy`, `0/max_inst`, three
instances' `weight`s and the creation/destruction of a fourth instance,
recording each write(2) that returned success, in order. The daemon is killed
with SIGKILL at a random moment and started again (clearing the dead mount it
left); then every file must show the last acknowledged value, or the value of
the one write that was in flight when the daemon died (it may or may not have
landed). Refused writes (EINVAL) are mixed in and must never land.
"""
from __future__ import annotations

import errno
import os
import random
import threading
import time

from conftest import Daemon

ROUNDS = 12  # (test_crash_churn kills 12 more times, under churn and workloads)
GIB = 1 << 30
NAMES = ["crashweight0", "crashweight1", "crashweight2"]
TOGGLED = "crashtoggled"
# Value ranges chosen so that no valid write is ever refused: Σ weight ≤ 3·3 + 1
# (the toggled instance) ≤ the smallest max_inst written.
VALUES = {
    "0/policy": [str(v) for v in range(6)],
    "0/max_inst": [str(v) for v in range(10, 26)],
    **{f"0/{n}/weight": [str(v) for v in range(4)] for n in NAMES},
}
BAD = ["x", "-1", "99", "1 1"]
DEATH = {errno.ENOTCONN, errno.ECONNABORTED}


class Writer(threading.Thread):
    """Writes until the daemon dies; `acked[file]` lists the values whose
    write(2) returned success, in order; `inflight` is (file, value, valid)
    of the write(2) that had not returned when the daemon died, if any."""

    def __init__(self, d: Daemon, rng: random.Random, toggled_exists: bool, values: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.d, self.rng = d, rng
        self.values = values or VALUES
        self.acked: dict[str, list[str]] = {f: [] for f in [*self.values, "inst_ctl"]}
        self.inflight: tuple[str, str, bool] | None = None
        self.exists = toggled_exists
        self.death: OSError | None = None
        self.unexpected: list[str] = []
        self.writes = 0

    def one(self) -> tuple[str, str, bool]:
        r = self.rng.random()
        if r < 0.1:
            return "inst_ctl", ("-" if self.exists else "0") + TOGGLED, True
        f = self.rng.choice(list(self.values))
        if r < 0.2:
            return f, self.rng.choice(BAD), False
        return f, self.rng.choice(self.values[f]), True

    def run(self) -> None:
        while True:
            f, v, valid = self.one()
            try:
                fd = os.open(self.d.path(f), os.O_WRONLY)
            except OSError as exc:
                self.death = exc
                return
            try:
                self.inflight = (f, v, valid)
                os.write(fd, v.encode())
            except OSError as exc:
                if exc.errno in DEATH:
                    self.death = exc
                    return
                self.inflight = None
                if valid or exc.errno != errno.EINVAL:
                    self.unexpected.append(f"{f} <- {v!r}: {exc}")
            else:
                self.inflight = None
                self.writes += 1
                if not valid:
                    self.unexpected.append(f"{f} <- {v!r} was accepted")
                self.acked[f].append(v)
                if f == "inst_ctl":
                    self.exists = not self.exists
            finally:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the daemon died after the write returned: it still counts


def read_state(d: Daemon, values: dict | None = None) -> dict[str, str]:
    state = {f: d.value(f) for f in values or VALUES}
    state["inst_ctl"] = "exists" if TOGGLED in d.instances(0) else "absent"
    return state


def check_acked(w: Writer, state: dict[str, str], now: dict[str, str], where: str) -> None:
    """Every file shows its last acknowledged value (`state`: before the
    round), or the value of the one valid write in flight."""
    for f, got in now.items():
        last, allowed = allowed_values(w, state, f)
        assert got in allowed, (
            f"{where}: {f} shows {got!r}; the last acknowledged write was {last!r}, in flight "
            f"{w.inflight!r} ({len(w.acked[f])} acknowledged writes to it, {w.writes} in all)"
        )


def allowed_values(w: Writer, state: dict[str, str], f: str) -> tuple[str, set[str]]:
    """The last acknowledged value of `f`, and the values it may show now."""
    acked = w.acked[f]
    if f == "inst_ctl":
        last = state[f] if not acked else ("exists" if acked[-1][0] == "0" else "absent")
    else:
        last = acked[-1] if acked else state[f]
    allowed = {last}
    if w.inflight is not None and w.inflight[0] == f and w.inflight[2]:
        v = w.inflight[1]
        allowed.add(("exists" if v[0] == "0" else "absent") if f == "inst_ctl" else v)
    return last, allowed


def test_acknowledged_writes_survive_kill_9(make_daemon):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d = make_daemon()
    d.write("default_memsize", str(GIB))
    d.write("0/max_inst", "10")
    for n in NAMES:
        d.create(0, n)
    state = read_state(d)
    inflight_rounds = 0
    for rnd in range(ROUNDS):
        w = Writer(d, random.Random(rng.random()), state["inst_ctl"] == "exists")
        w.start()
        time.sleep(rng.uniform(0.01, 0.3))
        d.kill9()
        w.join(10)
        where = f"round {rnd} (seed {seed})"
        assert not w.is_alive(), f"{where}: the writer hangs on the dead mount"
        assert w.unexpected == [], where
        assert w.death is not None and w.death.errno in DEATH, f"{where}: the writer stopped with {w.death!r}"
        d.start()
        now = read_state(d)
        check_acked(w, state, now, where)
        inflight_rounds += w.inflight is not None
        # the restarted tree is consistent (SPEC §4)
        weights = sum(int(d.value(f"0/{n}/weight")) for n in d.instances(0))
        assert int(d.value("0/free_weight")) == int(now["0/max_inst"]) - weights >= 0, where
        state = now
    # the interesting case happened: the daemon died with a write in its hands
    assert inflight_rounds >= ROUNDS // 4, f"only {inflight_rounds} of {ROUNDS} kills hit a write in flight"
