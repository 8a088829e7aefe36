"""Fuzzing the mounted tree and the control socket (issue 6, part 5).

hypothesis draws sequences of cases (tests/treefuzz.py): random bytes,
lengths (0..64 KiB) and offsets (O_APPEND, O_TRUNC) written to every node,
random JSON, garbage, partial and overlong lines on the socket. After every
case the daemon is alive, answered what the model answers, holds the model's
state, and the SPEC §4 invariants hold; the whole tree is read back and
compared at the end of each example. bench/soak.py runs the same fuzzer for
>= 100,000 cases.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgpud.gpus import discover
from treefuzz import Fuzzer, TreeWrite, names_pool, strategies

GPUS = "sim:2xT4"
EXAMPLES = 40 if os.environ.get("CI") else 60


def make_fuzzer(d) -> Fuzzer:
    return Fuzzer(mount=str(d.mount), socket_path=str(d.socket), state_file=str(d.state_dir / "state.json"),
                  infos=discover(GPUS), alive=d.alive, full_every=25)


def test_random_input_never_breaks_the_daemon_or_the_invariants(make_daemon):
    d = make_daemon(gpus=GPUS)
    fz = make_fuzzer(d)
    names = fz.names = names_pool(f"f{os.getpid() % 100000:05d}")

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # (generation speed checks, not behaviour)
    @given(st.lists(strategies(names, 2), min_size=1, max_size=25))
    def run(cases):
        fz.reset()
        for case in cases:
            fz.run(case)
        fz.check(full=True, what="the end of the example")

    run()
    assert fz.cases >= EXAMPLES
    assert fz.accepted > 0 and fz.refused > 0  # both sides of the oracle were exercised
    assert d.alive()
    assert "Traceback" not in d.log_text() and "internal error" not in d.log_text(), d.log_text()


def test_the_edges_the_fuzzer_relies_on(daemon):
    """Hand-picked cases through the same oracle: an empty write, O_APPEND,
    a write at an offset, 64 KiB, NUL, non-ASCII, an instance file."""
    fz = Fuzzer(mount=str(daemon.mount), socket_path=str(daemon.socket),
                state_file=str(daemon.state_dir / "state.json"), infos=discover("sim:T4"), alive=daemon.alive)
    fz.reset()
    name = names_pool(f"e{os.getpid() % 100000:05d}")[0]
    for case in [TreeWrite("0/policy", b"", 0, 0), TreeWrite("0/policy", b"3", 0, os.O_APPEND),
                 TreeWrite("0/policy", b"2", 7, os.O_APPEND), TreeWrite("0/policy", b"2", 1, 0),
                 TreeWrite("0/policy", b"1" * 65536, 0, 0), TreeWrite("0/policy", b"1\0", 0, 0),
                 TreeWrite("0/policy", "٣".encode(), 0, 0), TreeWrite("default_memsize", b"1073741824\n", 0, os.O_TRUNC),
                 TreeWrite("inst_ctl", f"0{name}\n".encode(), 0, 0), TreeWrite(f"0/{name}/weight", b" 4 ", 0, 0),
                 TreeWrite(f"0/{name}/id", b"1", 0, 0), TreeWrite("0", b"1", 0, 0), TreeWrite("1/policy", b"1", 0, 0)]:
        fz.run(case)
    fz.check(full=True)
    assert daemon.value("0/policy") == "2" and daemon.value(f"0/{name}/weight") == "4"
