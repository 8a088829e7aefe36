"""bench/metrics_door: what the metrics door costs a scrape, and what a flood does, in one run.

Two daemons on one simulated T4 with 25 instances each: one as a plain host runs it
(`--metrics-auth none`, plain HTTP, a loopback scraper gets every series), one as the DaemonSet
does (`--metrics-auth kubernetes`: TLS with its self-signed certificate, a bearer token checked by
TokenReview and SubjectAccessReview against the API server stand-in, tests/apiserver_standin.py).
Scrapes alternate between the two, each on a new connection as Prometheus makes them here (the
server answers one request per connection): p50/p99 of each, and of a scrape whose token is not
cached yet (both reviews asked). Then a flood: 400 silent connections from this machine's
non-loopback address against the plain daemon: its thread count before and during, how fast the
excess is refused, and a loopback scrape's p50 during the flood against before it.

    .venv/bin/python bench/metrics_door.py [--scrapes 300]
"""
from __future__ import annotations

import argparse
import http.client
import os
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import daemon, pct  # noqa: E402

from apiserver_standin import ApiServer  # noqa: E402

CTX = ssl.create_default_context()
CTX.check_hostname, CTX.verify_mode = False, ssl.CERT_NONE


def port_of(d, scheme: str) -> int:
    log = Path(d.base) / "daemon.log"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if m := re.findall(rf"metrics on {scheme}://[^:]+:(\d+)/metrics", log.read_text()):
            return int(m[-1])
        time.sleep(0.05)
    raise SystemExit(f"no {scheme} metrics address in the daemon's log:\n{log.read_text()}")


def scrape(port: int, *, tls: bool, token: str | None = None, host: str = "127.0.0.1") -> float:
    t = time.perf_counter()
    conn = (http.client.HTTPSConnection(host, port, timeout=10, context=CTX) if tls
            else http.client.HTTPConnection(host, port, timeout=10))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    if r.status != 200 or b"cgpu_instance_weight{" not in body:
        raise SystemExit(f"scrape answered {r.status}: {body[:200]!r}")
    return time.perf_counter() - t


def instances(mount: str, n: int, tag: str) -> None:
    with open(os.path.join(mount, "0", "max_inst"), "w") as f:
        f.write(str(n))
    for i in range(n):
        with open(os.path.join(mount, "inst_ctl"), "w") as f:
            f.write(f"0bd{tag}{i:06d}")


def host_address() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    if not found:
        raise SystemExit("no non-loopback IPv4 address to flood from")
    return found[0]


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=300)
    args = ap.parse_args()
    tag = f"{os.getpid() % 10**5:05d}"[:4]
    tmp = Path(tempfile.mkdtemp(prefix="cgpud-bench-door-"))
    api = ApiServer(tmp)
    api.tokens.update({"prom": {"username": "system:serviceaccount:monitoring:prometheus", "uid": "p",
                                "groups": ["system:serviceaccounts"]}})
    api.grants.add(("user:system:serviceaccount:monitoring:prometheus", "get", "/metrics"))
    os.environ["KUBECONFIG"] = str(api.kubeconfig)
    try:
        with daemon("sim:T4", extra=["--metrics-addr", "0.0.0.0:0", "--metrics-auth", "none", "--log-level", "info"],
                    handle=True) as plain, \
             daemon("sim:T4", extra=["--metrics-addr", "0.0.0.0:0", "--metrics-auth", "kubernetes",
                                     "--log-level", "info"], handle=True) as door:
            instances(plain.mount, 25, tag)
            instances(door.mount, 25, tag)
            p_plain, p_door = port_of(plain, "http"), port_of(door, "https")
            scrape(p_plain, tls=False)
            first = []
            for i in range(20):  # a token not cached: TokenReview + SubjectAccessReview each
                api.tokens[f"fresh{i}"] = api.tokens["prom"]
                first.append(scrape(p_door, tls=True, token=f"fresh{i}"))
            none_s, auth_s = [], []
            for _ in range(args.scrapes):
                none_s.append(scrape(p_plain, tls=False))
                auth_s.append(scrape(p_door, tls=True, token="prom"))
            print(f"scrape of 25 instances, a new connection each ({args.scrapes} each, interleaved):")
            print(f"  no auth (plain HTTP, loopback)           p50 {ms(pct(none_s, 50))}  p99 {ms(pct(none_s, 99))}")
            print(f"  auth (TLS + bearer token, review cached)  p50 {ms(pct(auth_s, 50))}  p99 {ms(pct(auth_s, 99))}"
                  f"  ({pct(auth_s, 50) / pct(none_s, 50):.2f}x the reference's p50)")
            print(f"  auth, token not cached (both reviews)     p50 {ms(pct(first, 50))}  p99 {ms(pct(first, 99))}"
                  f"  (20 tokens)")
            # the flood
            pid = plain.proc.pid
            before_threads = len(os.listdir(f"/proc/{pid}/task"))
            quiet = [scrape(p_plain, tls=False) for _ in range(50)]
            src = host_address()
            flood = [socket.create_connection((src, p_plain), timeout=5, source_address=(src, 0)) for _ in range(400)]
            try:
                time.sleep(0.5)
                during_threads = len(os.listdir(f"/proc/{pid}/task"))
                refusal = []
                for s in flood[-50:]:
                    s.settimeout(2)
                    t = time.perf_counter()
                    data = s.recv(100)
                    if data.startswith(b"HTTP/1.1 503"):
                        refusal.append(time.perf_counter() - t)
                loud = [scrape(p_plain, tls=False) for _ in range(50)]
            finally:
                for s in flood:
                    s.close()
            print("a flood of 400 silent connections from one address (the port made a thread each before):")
            print(f"  daemon threads: {before_threads} before, {during_threads} during")
            print(f"  excess refused with 503: {len(refusal)}/50 looked at, answer waited for at most"
                  f" {ms(max(refusal) if refusal else float('nan'))} (already sent)")
            print(f"  loopback scrape p50 during the flood {ms(pct(loud, 50))} against {ms(pct(quiet, 50))} before")
    finally:
        api.close()


if __name__ == "__main__":
    main()
