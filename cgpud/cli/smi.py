"""`cgpu-smi`: per GPU and per instance, what is given and what is used."""
from __future__ import annotations

import json
import time

import click

from .. import __version__
from ..client import Client, DaemonUnavailable

POLICY_NAMES = {0: "fair", 1: "preemptive", 2: "weighted", 3: "fixed", 4: "weak", 5: "native"}
MIB = 1 << 20


def limit_text(g: dict, i: dict) -> str:
    """The configured compute limit of an instance under its GPU's policy."""
    policy, max_inst = g["policy"], g["max_inst"]
    if i["highprio"]:
        return f"<= {g['prio_ratio']}% (high)"
    if policy == 0:
        return f"{100 / max_inst:.1f}%"
    if policy == 3:
        return f"{100 * i['weight'] / max_inst:.1f}%"
    if policy == 2:
        total = sum(x["weight"] for x in g["instances"] if not x["highprio"]) or 1
        return f"{100 * i['weight'] / total:.1f}%"
    if policy == 5:
        return "none"
    return "shared"


def render(snap: dict, stats: list[dict] | None = None) -> str:
    """The node as a table; `stats` (the scheduler's telemetry) adds each
    instance's achieved share of its GPU over the last second."""
    util = {(st["gpu"], n): i["share_1s"] for st in stats or [] for n, i in st["instances"].items()}
    out = [f"cgpu-smi {__version__}   cgpud {snap['version']}   {time.strftime('%a %b %d %H:%M:%S %Y')}"]
    bar = "+" + "-" * 78 + "+"
    for g in snap["gpus"]:
        alloc = sum(i["memsize"] for i in g["instances"])
        used = sum(i["used"] for i in g["instances"])
        out.append(bar)
        out.append(f"| GPU {g['index']}  {g['name']:<28} {g['uuid']}".ljust(79)[:79] + "|")
        out.append(
            f"| policy {g['policy']} ({POLICY_NAMES[g['policy']]}) max_inst {g['max_inst']} free_weight "
            f"{g['free_weight']} prio_ratio {g['prio_ratio']}%".ljust(79) + "|"
        )
        out.append(
            f"| memory: {used // MIB} MiB used, {alloc // MIB} MiB allocated of {g['memory'] // MIB} MiB".ljust(79) + "|"
        )
        out.append(bar)
        out.append("| CONTAINER     ID  WEIGHT  LIMIT           UTIL  MEM USED  MEM ALLOCATED  PROCS |")
        for i in g["instances"]:
            u = util.get((g["index"], i["name"]))
            out.append(
                f"| {i['name']:<12} {i['id']:>3}  {i['weight']:>6}  {limit_text(g, i):<14} "
                f"{'-' if u is None else f'{u * 100:.0f}%':>4} {i['used'] // MIB:>6} MiB {i['memsize'] // MIB:>10} MiB "
                f"{len(i['procs']):>5} |"
            )
        if not g["instances"]:
            out.append("| (no instances)".ljust(79) + "|")
    out.append(bar)
    return "\n".join(out)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cgpu-smi")
@click.option("--socket", envvar="CGPUD_SOCKET", default=None, help="The daemon's control socket.")
@click.option("-l", "--loop", "interval", type=float, default=None, help="Refresh every SECONDS.")
@click.option("--json", "as_json", is_flag=True, help="Print the node as JSON.")
def main(socket: str | None, interval: float | None, as_json: bool) -> None:
    """Show the GPUs of this node and their instances."""
    while True:
        try:
            with Client(socket) as c:
                snap = c.call("query")
                stats = c.call("stats")
        except DaemonUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        if as_json:
            util = {(st["gpu"], n): i["share_1s"] for st in stats for n, i in st["instances"].items()}
            for g in snap["gpus"]:
                for i in g["instances"]:
                    i["util"] = util.get((g["index"], i["name"]))
        click.echo(json.dumps(snap, indent=2) if as_json else render(snap, stats))
        if interval is None:
            return
        time.sleep(interval)
