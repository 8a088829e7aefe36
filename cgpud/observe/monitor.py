"""What `cgpu-smi` and `cgpu inspect` show, as plain data (docs/monitoring.md).

Pure functions over the control socket's `query` and `stats` answers:

- `compute_limits`: the configured compute limit of each instance (one rule
  for every policy, below);
- `node_view`: the node as cgpu-smi's `--json` prints it (a stable shape);
- `user_gib`, `instance_gib`: GiB as the container environment counts them
  (ALIYUN_COM_GPU_MEM_DEV / _CONTAINER), for cgpu inspect.

The compute limit is the share of its GPU's time an instance is entitled to
when every instance of the GPU has work — what the policy promises, not what
it got (that is the utilisation). With H the high-priority instances of
weight > 0, N the others of weight > 0, r = prio_ratio / 100:

    H's group gets r (all of it when N is empty), N's group the rest;
    within N:  0 fair 1/max_inst, 1 preemptive 1/|N|, 2 weighted w/sum(w),
               3 fixed w/max_inst, 4 weak 1/|N|;
    within H (its active members, no wasted slots): by weight under
               policies 2 and 3, evenly under 0, 1 and 4;
    weight 0: 0;   policy 5 (native): none (nothing is controlled).
"""
from __future__ import annotations

import os
import time
from typing import Iterable, Mapping, Sequence

from cgpud.sched.policies import FAIR, FIXED, NATIVE, POLICY_NAMES, WEIGHTED

GiB = 1 << 30
SCHEMA = 1  # cgpu-smi --json: bumped only if a key changes meaning or goes away


def compute_limits(policy: int, max_inst: int, prio_ratio: int,
                   instances: Iterable[tuple[str, int, bool]]) -> dict[str, float | None]:
    """name -> configured compute limit (ratio 0..1, None under policy 5), by
    the rule in the module's docstring. `instances`: (name, weight, highprio)."""
    insts = list(instances)
    if policy == NATIVE:
        return {n: None for n, _, _ in insts}
    hp = [(n, w) for n, w, h in insts if h and w > 0]
    normal = [(n, w) for n, w, h in insts if not h and w > 0]
    f_hp = (prio_ratio / 100 if normal else 1.0) if hp else 0.0
    out: dict[str, float | None] = {n: 0.0 for n, _, _ in insts}
    total_n = sum(w for _, w in normal)
    for n, w in normal:
        if policy == FAIR:
            share = 1 / max_inst
        elif policy == FIXED:
            share = w / max_inst
        elif policy == WEIGHTED:
            share = w / total_n
        else:  # preemptive, weak
            share = 1 / len(normal)
        out[n] = (1 - f_hp) * min(1.0, share)
    total_h = sum(w for _, w in hp)
    for n, w in hp:
        share = w / total_h if policy in (WEIGHTED, FIXED) else 1 / len(hp)
        out[n] = f_hp * share
    return out


def user_gib(total: int) -> int:
    """A device's memory in whole GiB as the user counts it (ALIYUN_COM_GPU_MEM_DEV):
    rounded to the nearest, as the seeds do (a T4's 15109 MiB is 15)."""
    return (2 * total + GiB) // (2 * GiB)


def instance_gib(memsize: int, total: int) -> int:
    """An instance's memsize in the same GiB (ALIYUN_COM_GPU_MEM_CONTAINER):
    scaled by the device's rounding and rounded to the nearest, so that
    6 of 15 on a T4 (memsize 6043 MiB) is 6 again, and 6 GiB given in bytes is 6 too."""
    if total <= 0:
        return 0
    dev = user_gib(total)
    return (2 * memsize * dev + total) // (2 * total)


def proc_name(pid: int) -> str:
    """A process's command line as `ps` shows it (its name in brackets when
    it has none); "-" when it cannot be read (gone, or another pid namespace)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().rstrip(b"\0").split(b"\0")
        if args and args[0]:
            words = [a.decode(errors="replace") for a in args]
            if os.path.basename(words[0]).startswith("python") and len(words) > 1 and words[1].startswith("/"):
                words = words[1:]  # a script: its name says more than the interpreter's
            return " ".join([os.path.basename(words[0]), *words[1:]])
        with open(f"/proc/{pid}/comm") as f:
            return f"[{f.read().strip()}]"
    except OSError:
        return "-"


def node_view(snap: Mapping, stats: Sequence[Mapping] | None = None, *, names: bool = True,
              now: float | None = None) -> dict:
    """cgpu-smi's view of the node (its `--json`; docs/monitoring.md):

    {"schema", "time", "cgpud", "mode", "strategy", "gpus": [{"index", "uuid",
     "name", "policy", "policy_name", "max_inst", "free_weight", "prio_ratio",
     "memory": {"total", "allocated", "used"}, "util",
     "instances": [{"container", "id", "weight", "highprio", "limit", "util",
                    "memory": {"allocated", "used"}, "processes": [{"pid", "memory", "name"}]}]}]}

    Bytes are bytes; limit and util are ratios 0..1 (util: the share of the
    GPU's time the instance had over the last second; null when the scheduler
    does not report it; limit null under policy 5)."""
    util = {(st["gpu"], n): i.get("share_1s") for st in stats or [] for n, i in st["instances"].items()}
    scheduled = {st["gpu"] for st in stats or []}  # (an instance not yet granted any time there: 0)
    gpus = []
    for g in snap["gpus"]:
        lim = compute_limits(g["policy"], g["max_inst"], g["prio_ratio"],
                             ((i["name"], i["weight"], i["highprio"]) for i in g["instances"]))
        insts = []
        for i in g["instances"]:
            procs = sorted((int(p), n) for p, n in i.get("procs", {}).items())
            insts.append({
                "container": i["name"],
                "id": i["id"],
                "weight": i["weight"],
                "highprio": bool(i["highprio"]),
                "limit": lim[i["name"]],
                "util": util.get((g["index"], i["name"]), 0.0 if g["index"] in scheduled else None),
                "memory": {"allocated": i["memsize"], "used": i["used"]},
                "processes": [{"pid": p, "memory": n, **({"name": proc_name(p)} if names else {})}
                              for p, n in procs],
            })
        us = [x["util"] for x in insts if x["util"] is not None]
        gpus.append({
            "index": g["index"],
            "uuid": g["uuid"],
            "name": g["name"],
            "policy": g["policy"],
            "policy_name": POLICY_NAMES[g["policy"]] if 0 <= g["policy"] < len(POLICY_NAMES) else str(g["policy"]),
            "max_inst": g["max_inst"],
            "free_weight": g["free_weight"],
            "prio_ratio": g["prio_ratio"],
            "memory": {"total": g["memory"], "allocated": sum(x["memory"]["allocated"] for x in insts),
                       "used": sum(x["memory"]["used"] for x in insts)},
            "util": min(1.0, sum(us)) if us else (0.0 if not insts else None),
            "instances": insts,
            # (a daemon before health watching sends none: in service)
            "health": dict(g.get("health") or {"healthy": True}),
        })
    return {
        "schema": SCHEMA,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "cgpud": snap.get("version"),
        "mode": snap.get("mode"),
        "strategy": snap.get("strategy"),
        "gpus": gpus,
    }
