"""Concurrent clients of a running daemon, shared by tests/test_load.py (a few
seconds) and bench/soak.py (32 clients, 60 s).

Each client is a process (no GIL between them: a client's latency is the
daemon's and the kernel's, not its neighbours' Python) that loops until its
deadline: wait a random time (exponential, mean `interval`: an open load, as
the hook, cgpu-smi and scripts are; a closed loop without pauses only measures
the length of the queue in front of a single-threaded daemon), then one op:

- read: a random node of the tree (a GPU's, an instance's, a root file);
- write: a setting whose value keeps the schedule as it is (policy 1 on GPU 0,
  a random prio_ratio, highprio 0 of the idle instance, default_memsize);
- query: one `query` on the control socket, which must list every instance.

Anything else than the expected answer is an *unexpected error*, kept with
its text.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import random
import time
from dataclasses import dataclass, field

KINDS = ("read", "read", "write", "query")
ROOT_READS = ["version", "default_memsize", "0/policy", "0/max_inst", "0/free_weight", "0/prio_ratio", "0/major"]


@dataclass
class Result:
    lat: dict[str, list[float]] = field(default_factory=lambda: {"read": [], "write": [], "query": []})
    unexpected: list[str] = field(default_factory=list)

    @property
    def ops(self) -> int:
        return sum(len(v) for v in self.lat.values())

    def all(self) -> list[float]:
        return [x for v in self.lat.values() for x in v]

    def merge(self, other: "Result") -> None:
        for k, v in other.lat.items():
            self.lat[k] += v
        self.unexpected += other.unexpected


def _client(seed: int, mount: str, sock: str, names: list[str], idle: str, until: float, interval: float,
            out) -> None:
    from cgpud.client import Client

    rng = random.Random(seed)
    res = Result()
    files = ROOT_READS + [f"0/{n}/{f}" for n in names + [idle] for f in ("weight", "memsize", "meminfo", "highprio", "id")]
    writes = [("0/policy", "1"), ("0/prio_ratio", None), (f"0/{idle}/highprio", "0"), ("default_memsize", str(64 << 20))]
    try:
        with Client(sock, timeout=30) as c:
            while True:
                pause = rng.expovariate(1 / interval) if interval > 0 else 0
                if time.monotonic() + pause >= until:
                    break
                time.sleep(pause)
                kind = rng.choice(KINDS)
                t = time.perf_counter()
                try:
                    if kind == "read":
                        rel = rng.choice(files)
                        with open(os.path.join(mount, rel), "rb") as f:
                            text = f.read()
                        if not text.endswith(b"\n"):
                            res.unexpected.append(f"read {rel}: {text!r} without its newline")
                    elif kind == "write":
                        rel, value = rng.choice(writes)
                        value = value if value is not None else str(rng.randint(20, 99))
                        fd = os.open(os.path.join(mount, rel), os.O_WRONLY)
                        try:
                            n = os.write(fd, value.encode())
                        finally:
                            os.close(fd)
                        if n != len(value):
                            res.unexpected.append(f"write {rel}: {n} of {len(value)} bytes")
                    else:
                        got = {i["name"] for i in c.call("query")["gpus"][0]["instances"]}
                        if got != set(names) | {idle}:
                            res.unexpected.append(f"query: instances {sorted(got)}")
                except OSError as exc:
                    res.unexpected.append(f"{kind}: {errno.errorcode.get(exc.errno or 0, exc.errno)} {exc}")
                except Exception as exc:  # noqa: BLE001 - every failure is a finding
                    res.unexpected.append(f"{kind}: {exc!r}")
                res.lat[kind].append(time.perf_counter() - t)
    except Exception as exc:  # noqa: BLE001
        res.unexpected.append(f"client: {exc!r}")
    out.put(res)


def run_clients(mount: str, sock: str, names: list[str], idle: str, count: int, seconds: float,
                interval: float = 0.02) -> Result:
    """`count` client processes for `seconds`; their merged Result."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    until = time.monotonic() + seconds
    procs = [ctx.Process(target=_client, args=(i, mount, sock, names, idle, until, interval, q), daemon=True)
             for i in range(count)]
    for p in procs:
        p.start()
    total = Result()
    for _ in procs:
        total.merge(q.get(timeout=seconds + 120))
    for p in procs:
        p.join(30)
    return total
