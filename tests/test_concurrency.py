"""Concurrency: 8 processes read and write the mounted tree at once for a few
seconds, creating and destroying instances and writing every setting.

Only the errors the rules allow may come back (EINVAL out of range, EBUSY,
ENOSPC, EEXIST, and ENOENT where a racing destroy took the instance away),
every value read is well formed, the daemon stays up, and at the end the
SPEC §4 invariants hold on what the tree shows — and on what a restart shows.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import random
import time
from collections import Counter

from conftest import SIM_T4_BYTES, Daemon

WORKERS = 8
DURATION = 4.0
GPUS = 2
GIB = 1 << 30
NAMES = [f"concurrent{i:02d}" for i in range(6)]
MAX_INST = range(2, 17)  # the values written to N/max_inst
WEIGHTS = range(0, 7)
MEMSIZES = [GIB // 2, GIB, 2 * GIB, 3 * GIB]

E = errno
# What each operation may answer besides success. A weight above the smallest
# max_inst written may meet a lower max_inst: out of range, EINVAL.
ALLOWED = {
    "create": {E.EEXIST, E.ENOSPC},
    "destroy": {E.ENOENT},
    "weight": {E.EBUSY, E.ENOENT},
    "weight>min": {E.EBUSY, E.ENOENT, E.EINVAL},
    "memsize": {E.EBUSY, E.ENOENT},
    "highprio": {E.ENOENT},
    "policy": set(),
    "max_inst": {E.EBUSY},
    "prio_ratio": set(),
    "default_memsize": set(),
    "list-root": set(),
    "list-gpu": set(),
    "list-instance": {E.ENOENT},
    "read": set(),
    "read-instance": {E.ENOENT},
}


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("ascii")


def _check_text(rel: str, text: str) -> str | None:
    """A value read: well formed? (None when it is)"""
    base = rel.rsplit("/", 1)[-1]
    if not text.endswith("\n"):
        return f"{rel}: {text!r} does not end in a newline"
    if base == "meminfo":
        return None if text.startswith("Free: ") else f"{rel}: {text!r}"
    if base in ("version", "upgrade"):
        return None if text.count("\n") == 1 else f"{rel}: {text!r}"
    if not text[:-1].isdigit():
        return f"{rel}: {text!r} is not an unsigned decimal"
    if base == "free_weight" and int(text) < 0:
        return f"{rel}: negative"
    return None


def worker(mount: str, seed: int, duration: float, out) -> None:
    rng = random.Random(seed)
    counts: Counter = Counter()
    unexpected: list[str] = []

    def attempt(op: str, fn, *args) -> None:
        try:
            fn(*args)
        except OSError as exc:
            counts[(op, errno.errorcode.get(exc.errno, str(exc.errno)))] += 1
            if exc.errno not in ALLOWED[op]:
                unexpected.append(f"{op} {args}: {exc!r}")
        else:
            counts[(op, "ok")] += 1

    def p(*parts) -> str:
        return os.path.join(mount, *map(str, parts))

    def read_some() -> None:
        """The top level and one GPU's directory, everything in them."""
        for name in os.listdir(mount):
            if not name.isdigit() and name != "inst_ctl":
                read_one(name, "read")
        g = rng.randrange(GPUS)
        attempt("list-gpu", os.listdir, p(g))
        for entry in os.listdir(p(g)):
            if entry in NAMES:
                attempt("list-instance", os.listdir, p(g, entry))
                for f in ("id", "memsize", "meminfo", "weight", "highprio"):
                    read_one(f"{g}/{entry}/{f}", "read-instance")
            else:
                read_one(f"{g}/{entry}", "read")

    def read_one(rel: str, op: str) -> None:
        try:
            text = _read(p(rel))
        except OSError as exc:
            counts[(op, errno.errorcode.get(exc.errno, str(exc.errno)))] += 1
            if exc.errno not in ALLOWED[op]:
                unexpected.append(f"{op} {rel}: {exc!r}")
            return
        counts[(op, "ok")] += 1
        bad = _check_text(rel, text)
        if bad:
            unexpected.append(bad)

    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        g, name = rng.randrange(GPUS), rng.choice(NAMES)
        r = rng.random()
        if r < 0.20:
            attempt("create", _write, p("inst_ctl"), f"{g}{name}")
        elif r < 0.30:
            attempt("destroy", _write, p("inst_ctl"), f"-{name}")
        elif r < 0.47:
            w = rng.choice(WEIGHTS)
            attempt("weight" if w <= MAX_INST[0] else "weight>min", _write, p(g, name, "weight"), str(w))
        elif r < 0.55:
            attempt("memsize", _write, p(g, name, "memsize"), str(rng.choice(MEMSIZES)))
        elif r < 0.62:
            attempt("highprio", _write, p(g, name, "highprio"), str(rng.randrange(2)))
        elif r < 0.68:
            attempt("policy", _write, p(g, "policy"), str(rng.randrange(6)))
        elif r < 0.76:
            attempt("max_inst", _write, p(g, "max_inst"), str(rng.choice(MAX_INST)))
        elif r < 0.79:
            attempt("prio_ratio", _write, p(g, "prio_ratio"), str(rng.randint(20, 99)))
        elif r < 0.81:
            attempt("default_memsize", _write, p("default_memsize"), str(rng.choice([GIB // 2, GIB])))
        else:
            try:
                attempt("list-root", os.listdir, mount)
                read_some()
            except OSError as exc:  # listing the root or a GPU directory itself failed
                unexpected.append(f"reading the tree: {exc!r}")
    out.put((counts, unexpected))


def tree_invariants(d: Daemon) -> list[str]:
    """SPEC §4 on what the tree shows; the violations found."""
    problems = []
    ids = []
    for g in range(GPUS):
        max_inst = int(d.value(f"{g}/max_inst"))
        free = int(d.value(f"{g}/free_weight"))
        insts = d.instances(g)
        weights = [int(d.value(f"{g}/{n}/weight")) for n in insts]
        memsizes = [int(d.value(f"{g}/{n}/memsize")) for n in insts]
        ids += [int(d.value(f"{g}/{n}/id")) for n in insts]
        for n in insts:
            assert d.value(f"{g}/{n}/highprio") in ("0", "1")
            assert d.value(f"{g}/{n}/meminfo") == f"Free: {memsizes[insts.index(n)]}"
        if not 1 <= max_inst <= 25:
            problems.append(f"GPU {g}: max_inst {max_inst}")
        if len(insts) > max_inst:
            problems.append(f"GPU {g}: {len(insts)} instances > max_inst {max_inst}")
        if sum(weights) > max_inst:
            problems.append(f"GPU {g}: Σ weight {sum(weights)} > max_inst {max_inst}")
        if free != max_inst - sum(weights) or free < 0:
            problems.append(f"GPU {g}: free_weight {free}, max_inst {max_inst}, weights {weights}")
        if sum(memsizes) > SIM_T4_BYTES:
            problems.append(f"GPU {g}: Σ memsize {sum(memsizes)} > {SIM_T4_BYTES}")
        if not set(insts) <= set(NAMES):
            problems.append(f"GPU {g}: unknown instances {insts}")
    if len(ids) != len(set(ids)):
        problems.append(f"instance ids not unique: {sorted(ids)}")
    return problems


def test_eight_processes_reading_and_writing(make_daemon):
    d = make_daemon(gpus=f"sim:{GPUS}xT4")
    d.write("default_memsize", str(GIB))
    seed = random.randrange(1 << 30)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(d.path(), seed + i, DURATION, out)) for i in range(WORKERS)]
    for pr in procs:
        pr.start()
    results = [out.get(timeout=DURATION + 60) for _ in procs]
    for pr in procs:
        pr.join(10)
        assert pr.exitcode == 0, f"a worker died (seed {seed})"
    counts: Counter = Counter()
    unexpected = []
    for c, u in results:
        counts.update(c)
        unexpected += u
    summary = ", ".join(f"{op}:{what}={n}" for (op, what), n in sorted(counts.items()))
    assert unexpected == [], f"seed {seed}; {len(unexpected)} unexpected, e.g. {unexpected[:10]}\n{summary}\n{d.log_text()[-3000:]}"
    # the run did what it says: every kind of write landed many times, and the
    # refusals the rules allow happened too
    for op in ("create", "destroy", "weight", "memsize", "highprio", "policy", "max_inst", "read-instance"):
        assert counts[(op, "ok")] >= 10, f"{op} succeeded only {counts[(op, 'ok')]} times: {summary}"
    for refusal in [("create", "EEXIST"), ("destroy", "ENOENT"), ("max_inst", "EBUSY"), ("read-instance", "ENOENT")]:
        assert counts[refusal] > 0, f"never saw {refusal}: {summary}"
    assert counts[("weight", "EBUSY")] + counts[("weight>min", "EBUSY")] > 0, f"never saw a weight EBUSY: {summary}"
    assert d.alive(), d.log_text()
    assert "Traceback" not in d.log_text() and "internal error" not in d.log_text(), d.log_text()[-3000:]
    assert tree_invariants(d) == []
    # what the tree shows is what was saved
    before = d.snapshot()
    d.restart()
    assert d.snapshot() == before
    assert tree_invariants(d) == []
