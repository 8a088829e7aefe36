"""bench/attacks: the control socket's attacks from a root container, and what the checks cost (issue 33).

Two daemons in the same run, each with tests/test_attacks.py's scene (an isolated podman; a victim, an
attacker and an outsider container, root in each, with the daemon's socket directory mounted as the
device plugin mounted it before, at /hostsock, and the containers' directory as it mounts it now):
  - `checked`: the daemon as it is (who calls is told by the kernel: control.callers);
  - `uid only` (the reference): the same code with CGPUD_BENCH_UID_ONLY=1, the rule of before
    (any uid 0 is privileged, nothing classified).
Printed:
  - attacks tried from a root container / succeeded, against each;
  - `register` from a host client (connect, register, timed; deregister untimed) and `gpu_alloc` from
    inside the attacker (tests/attack_client.c --time: connect, gpu_alloc, answer; each connection's
    classification included), p50/p99, rounds interleaved between the two daemons.

    .venv/bin/python bench/attacks.py [--rounds 200]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import pct  # noqa: E402

from cgpud.client import Client  # noqa: E402
from cgpud.control.server import MAX_CONTAINER_CONNS  # noqa: E402
from test_attacks import HOST_SOCK, TENANT_SOCK, Scene  # noqa: E402


def attacks(s: Scene) -> list[tuple[str, str, list, callable]]:
    """(name, socket, client arguments, whether its output means the attack worked)."""
    def ok(out: list[str]) -> bool:
        try:
            return bool(out) and all(json.loads(x).get("ok") for x in out)
        except ValueError:
            return False

    def names_victim(out: list[str]) -> bool:
        return any(s.victim_name in x for x in out)

    t = s.victim_target
    out = []
    for sock in (HOST_SOCK, TENANT_SOCK):
        out += [
            ("hello privileged", sock, [{"op": "hello"}], lambda o: ok(o) and json.loads(o[0])["result"].get("privileged") is True),
            ("query lists the neighbour", sock, [{"op": "query"}], names_victim),
            ("register 5 GiB promised", sock, [{"op": "register", "name": f"forged{len(out):06d}", "gpus": [0], "memsize": 5 << 30}], ok),
            ("register the neighbour's cgroup", sock, [{"op": "register", "name": f"forgedt{len(out):05d}", "gpus": [0], "target": t}], ok),
            ("register a symlinked cgroup path", sock, [{"op": "register", "name": f"forgeds{len(out):05d}", "gpus": [0],
                                                        "target": {"kind": t["kind"], "path": f"/proc/self/root{t['path']}"}}], ok),
            ("register the host's parent cgroup", sock, [{"op": "register", "name": f"forgedp{len(out):05d}", "gpus": [0],
                                                         "target": {"kind": t["kind"], "path": os.path.dirname(t["path"])}}], ok),
            ("hook with the neighbour's pid", sock, [{"op": "hook", "stage": "createRuntime", "state": {
                "ociVersion": "1.0.2", "id": "f" * 64, "status": "creating", "pid": s.victim_pid, "bundle": "/"}}],
             lambda o: bool(o) and '"error": "EACCES"' not in o[0] and "CONNECT" not in o[0]),
            ("prepare a bundle", sock, [{"op": "prepare", "bundle": "/", "id": "f" * 64}],
             lambda o: bool(o) and '"error": "EACCES"' not in o[0] and "CONNECT" not in o[0]),
            ("stats of the neighbour", sock, [{"op": "stats"}], names_victim),
            ("trace", sock, [{"op": "trace", "seconds": 5}], lambda o: bool(o) and '"EACCES"' not in o[0] and "CONNECT" not in o[0]),
            ("garbage, then query", sock, ["--raw", "\x01 not json\n[[[[\n", json.dumps({"op": "query"})], names_victim),
            ("query on a connection whose process is gone", sock, ["--orphan", json.dumps({"op": "query"})], names_victim),
        ]
    out += [
        ("connection flood", TENANT_SOCK, ["--flood", str(MAX_CONTAINER_CONNS + 36)],
         lambda o: bool(o) and o[0].startswith(f"answered {MAX_CONTAINER_CONNS + 36} ")),
        ("outsider's query on the containers' socket", TENANT_SOCK, [{"op": "query"}], names_victim),
        ("outsider's deregister on the host's socket", HOST_SOCK, [{"op": "deregister", "name": "nosuch000000"}],
         lambda o: bool(o) and '"ENOENT"' in o[0]),  # (allowed, only no such instance: it could have removed one)
        ("hook poststop of the neighbour", HOST_SOCK, [{"op": "hook", "stage": "poststop", "state": {
            "ociVersion": "1.0.2", "id": s.victim, "status": "stopped", "bundle": "/"}}], ok),
        ("deregister the neighbour", HOST_SOCK, [{"op": "deregister", "name": s.victim_name}], ok),
    ]
    return out


def run_attacks(s: Scene) -> tuple[int, int, list[str]]:
    tried = worked = 0
    names = []
    s.d.write("0/policy", "1")  # (a scheduler that runs: its telemetry names the victim, which holds its GPU)
    with Client(os.fspath(s.d.socket), timeout=10) as c:
        deadline = time.monotonic() + 10
        while not any(s.victim_name in st["instances"] for st in c.call("stats")) and time.monotonic() < deadline:
            time.sleep(0.05)
    for name, sock, args, worked_if in attacks(s):
        who = "outsider" if name.startswith("outsider") else "attacker"
        out = s.attack(who, sock, *args)
        tried += 1
        if worked_if(out):
            worked += 1
            names.append(f"{name} ({'the host’s' if sock == HOST_SOCK else 'the containers’'} socket)")
        restore(s)
    return tried, worked, names


def restore(s: Scene) -> None:
    """After an attack that worked: the node as it was (the victim back, anything forged gone)."""
    with Client(os.fspath(s.d.socket), timeout=10) as c:
        names = {i["name"] for g in c.call("query")["gpus"] for i in g["instances"]}
        for n in names - {s.victim_name, s.attacker_name}:
            c.call("deregister", name=n)
        if s.victim_name not in names:
            c.call("register", name=s.victim_name, gpus=[0], memsize=s.victim_memsize, target=s.victim_target)


def register_once(s: Scene, i: int) -> float:
    c = socket.socket(socket.AF_UNIX)
    f = c.makefile("rwb")
    name = f"bn{i:010d}"
    t0 = time.perf_counter()
    c.connect(os.fspath(s.d.socket))
    f.write(json.dumps({"op": "register", "name": name, "gpus": [0]}).encode() + b"\n")
    f.flush()
    r = json.loads(f.readline())
    t = time.perf_counter() - t0
    assert r["ok"], r
    f.write(json.dumps({"op": "deregister", "name": name}).encode() + b"\n")
    f.flush()
    assert json.loads(f.readline())["ok"]
    c.close()
    return t


def alloc_batch(s: Scene, sock: str, n: int) -> list[float]:
    out = s.attack("attacker", sock, "--time", str(n), json.dumps({"op": "gpu_alloc", "bytes": 1 << 20}))
    if not out or out[0].startswith("FAILED"):
        raise SystemExit(f"gpu_alloc from the container failed: {out[:1]}")
    return [int(x) / 1e9 for x in out]


def us(x: float) -> str:
    return f"{x * 1e6:7.0f} µs"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200, help="samples of each op per daemon")
    args = ap.parse_args()
    checked = Scene()
    os.environ["CGPUD_BENCH_UID_ONLY"] = "1"
    try:
        ref = Scene()
    finally:
        del os.environ["CGPUD_BENCH_UID_ONLY"]
    try:
        reg = {"checked": [], "uid only": []}
        alloc = {"checked host's socket": [], "checked containers' socket": [], "uid only": []}
        batch = max(10, args.rounds // 10)
        for r in range(0, args.rounds, batch):
            for i in range(r, min(args.rounds, r + batch)):
                reg["checked"].append(register_once(checked, i))
                reg["uid only"].append(register_once(ref, i))
            alloc["checked host's socket"] += alloc_batch(checked, HOST_SOCK, batch)
            alloc["checked containers' socket"] += alloc_batch(checked, TENANT_SOCK, batch)
            alloc["uid only"] += alloc_batch(ref, HOST_SOCK, batch)
        print(f"register from a host client (connect + register), {args.rounds} each, interleaved:")
        for k, v in reg.items():
            print(f"  {k:28s} p50 {us(pct(v, 50))}  p99 {us(pct(v, 99))}")
        print("gpu_alloc from inside a root container (connect + gpu_alloc), interleaved batches:")
        for k, v in alloc.items():
            print(f"  {k:28s} p50 {us(pct(v, 50))}  p99 {us(pct(v, 99))}  ({len(v)})")
        for label, s in (("checked", checked), ("uid only (before)", ref)):
            tried, worked, names = run_attacks(s)
            print(f"attacks from a root container against `{label}`: tried {tried}, succeeded {worked}")
            for n in names:
                print(f"    succeeded: {n}")
    finally:
        ref.close()
        checked.close()


if __name__ == "__main__":
    main()
