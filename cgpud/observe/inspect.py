"""`cgpu inspect`: the node's GPU memory allocation in the shape of
`kubectl inspect cgpu` (SPEC §7, docs/monitoring.md).

GiB as the container environment counts them: a device's total rounded to
the nearest whole GiB (a T4's 15109 MiB is 15, as the seeds say), an
instance's memsize scaled by the same factor and rounded to the nearest (6 of
15 on a T4, memsize 6043 MiB, is 6). Percentages are truncated, as the
product prints them (6/15 is 40%, 1/15 is 6%).
"""
from __future__ import annotations

import socket
from typing import Mapping, Sequence

from cgpud.observe.monitor import instance_gib, user_gib

PAD = 2  # spaces between columns (kubectl inspect's tabwriter padding)


def primary_ipv4() -> str:
    """The address this host would use to reach the outside (the source of
    the default route; no packet is sent), else the hostname's address if it
    is not loopback, else "unknown" (what kubectl inspect prints then)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: only a route lookup
        ip = s.getsockname()[0]
        if ip and not ip.startswith("0."):
            return ip
    except OSError:  # no route: try the hostname
        pass
    finally:
        s.close()
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    return "unknown"


def allocation(snap: Mapping, name: str, ip: str) -> dict:
    """The node's allocation from a `query` answer:

    {"name", "ipaddress", "gpus": [{"index", "allocated", "total"}],
     "allocated", "total", "percent",
     "instances": [{"name", "gpus": {"<index>": GiB}, "allocated"}]}  (GiB, whole)"""
    gpus = []
    insts: dict[str, dict[str, int]] = {}
    for g in snap["gpus"]:
        total = user_gib(g["memory"])
        alloc = 0
        for i in g["instances"]:
            gib = instance_gib(i["memsize"], g["memory"])
            alloc += gib
            insts.setdefault(i["name"], {})[str(g["index"])] = gib
        gpus.append({"index": g["index"], "allocated": alloc, "total": total})
    allocated = sum(g["allocated"] for g in gpus)
    total = sum(g["total"] for g in gpus)
    return {
        "name": name,
        "ipaddress": ip,
        "gpus": gpus,
        "allocated": allocated,
        "total": total,
        "percent": _percent(allocated, total),
        "instances": [{"name": n, "gpus": per, "allocated": sum(per.values())} for n, per in insts.items()],
    }


def _percent(part: int, whole: int) -> int:
    return part * 100 // whole if whole > 0 else 0


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell plus PAD spaces (the last cell of
    a row is not padded)."""
    widths: dict[int, int] = {}
    for r in rows:
        for k, cell in enumerate(r[:-1]):
            widths[k] = max(widths.get(k, 0), len(cell))
    return ["".join(c.ljust(widths[k] + PAD) for k, c in enumerate(r[:-1])) + r[-1] for r in rows]


def summary(nodes: Sequence[dict]) -> str:
    """`kubectl inspect cgpu`: one row per node, then the cluster's total."""
    n_gpus = max((len(n["gpus"]) for n in nodes), default=0)
    rows = [["NAME", "IPADDRESS", *(f"GPU{k}(Allocated/Total)" for k in range(n_gpus)), "GPU Memory(GiB)"]]
    for n in nodes:
        per = {g["index"]: f"{g['allocated']}/{g['total']}" for g in n["gpus"]}
        rows.append([n["name"], n["ipaddress"], *(per.get(k, "0/0") for k in range(n_gpus)),
                     f"{n['allocated']}/{n['total']}"])
    lines = _table(rows)
    lines.append("-" * (max(len(x) for x in lines[1:] or lines) + 20))
    lines.append(_cluster(nodes))
    return "\n".join(lines)


def _cluster(nodes: Sequence[dict]) -> str:
    a, t = sum(n["allocated"] for n in nodes), sum(n["total"] for n in nodes)
    return f"Allocated/Total GPU Memory In Cluster: {a}/{t} ({_percent(a, t)}%)"


def detail(nodes: Sequence[dict]) -> str:
    """`kubectl inspect cgpu -d`: per node its instances (the product's pods)
    with their GiB on each GPU, the node's allocated and total."""
    out: list[str] = []
    for n in nodes:
        out += ["", *_table([["NAME:", n["name"]], ["IPADDRESS:", n["ipaddress"]]]), ""]
        idx = [g["index"] for g in n["gpus"]]
        # core_mem (docs/scheduler.md): each pod's compute percentage, on nodes where pods ask one
        core = [[f"{i['core']}%" if i.get("core") else "-"] for i in n["instances"]] \
            if any(i.get("core") for i in n["instances"]) else [[] for _ in n["instances"]]
        extra = ["CORE(%)"] if any(core) else []
        rows = [["NAME", "NAMESPACE", *(f"GPU{k}(Allocated)" for k in idx), *extra, ""]]
        for i, c in zip(n["instances"], core):
            rows.append([i["name"], i.get("namespace") or "-", *(str(i["gpus"].get(str(k), 0)) for k in idx), *c, ""])
        rows.append(["Allocated :", f"{n['allocated']} ({n['percent']}%)", *([""] * (len(idx) + len(extra))), ""])
        rows.append(["Total :", str(n["total"]), *([""] * (len(idx) + len(extra))), ""])
        table = [r.rstrip() for r in _table(rows)]
        out += table
        out.append("-" * (max(len(x) for x in table) + 10))
    out += ["", "", _cluster(nodes)]
    return "\n".join(out)
