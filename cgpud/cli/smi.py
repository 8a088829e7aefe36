"""`cgpu-smi`: per GPU and per instance, what is given and what is used,
laid out like `nvidia-smi` (docs/monitoring.md)."""
from __future__ import annotations

import json
import sys
import time

import click

from cgpud import __version__
from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.observe.monitor import node_view

MIB = 1 << 20
W = 79  # the width of nvidia-smi's classic table
COLS = (31, 22, 22)  # the three cells of a GPU's box


def _mib(n: int) -> str:
    return f"{n // MIB}MiB"


def _pct(x: float | None, digits: int = 0) -> str:
    return "N/A" if x is None else f"{x * 100:.{digits}f}%"


def _line(text: str) -> str:
    """One full-width row: `| text |`, cut to fit."""
    return "| " + text[: W - 4].ljust(W - 4) + " |"


def _cells(*texts: str) -> str:
    """One row of the three-cell GPU box."""
    return "|" + "|".join(" " + t[: w - 2].ljust(w - 2) + " " for t, w in zip(texts, COLS)) + "|"


RULE = "+" + "-" * (W - 2) + "+"
CELL_RULE = "+" + "+".join("-" * w for w in COLS) + "+"
HEAVY = "|" + "=" * (W - 2) + "|"
CELL_HEAVY = "|" + "+".join("=" * w for w in COLS) + "|"

INST_HEAD = (f"{'GPU':>3}  {'Container':<12}  {'ID':>3}  {'Weight':>6}  {'Prio':>4}  {'Limit':>7}  {'Util':>5}"
             f"  {'Memory-Usage':>19}")
PROC_HEAD = f"{'GPU':>3}  {'Container':<12}  {'PID':>8}  {'Process name':<34}  {'GPU Memory':>10}"
NAME_W = 34


def render(view: dict) -> str:
    """The node view (`cgpud.observe.monitor.node_view`) as nvidia-smi-like tables:
    one box per GPU, then its instances, then their processes."""
    out = [time.strftime("%a %b %d %H:%M:%S %Y"), RULE,
           _line(f"CGPU-SMI {__version__:<10} cgpud {view['cgpud'] or '?':<10} "
                 f"Mode: {view['mode'] or '?':<9} Placement: {view['strategy'] or '?'}"),
           "|" + "+".join("-" * w for w in COLS) + "|",
           _cells("GPU  Name", "Memory-Usage", "GPU-Util   Inst/Max"),
           _cells("     Policy       Prio-Ratio", "Memory-Allocated", "Free-Weight"),
           CELL_HEAVY]
    for g in view["gpus"]:
        mem = g["memory"]
        total = _mib(mem["total"])
        out.append(_cells(f"{g['index']:>3}  {g['name']}",
                          f"{_mib(mem['used']):>9} / {total}",
                          f"{_pct(g['util']):>8}   {len(g['instances']):>3}/{g['max_inst']}"))
        out.append(_cells(f"     {g['policy']} ({g['policy_name']})".ljust(23) + f"{g['prio_ratio']:>3}%",
                          f"{_mib(mem['allocated']):>9} / {total}",
                          f"{g['free_weight']:>11}"))
        out.append(CELL_RULE)
    out += _health_lines(view)
    out += ["", RULE, _line("Instances:"), _line(INST_HEAD), HEAVY]
    any_inst = False
    for g in view["gpus"]:
        for i in g["instances"]:
            any_inst = True
            usage = f"{_mib(i['memory']['used'])} / {_mib(i['memory']['allocated'])}"
            limit = _pct(i["limit"], 1) if i["limit"] is not None else "none"
            out.append(_line(
                f"{g['index']:>3}  {i['container']:<12}  {i['id']:>3}  {i['weight']:>6}  "
                f"{'high' if i['highprio'] else '-':>4}  {limit:>7}  {_pct(i['util']):>5}  {usage:>19}"))
    if not any_inst:
        out.append(_line("No instances"))
    out += [RULE, "", RULE, _line("Processes:"), _line(PROC_HEAD), HEAVY]
    any_proc = False
    for g in view["gpus"]:
        for i in g["instances"]:
            for p in i["processes"]:
                any_proc = True
                name = p.get("name", "-")
                if len(name) > NAME_W:
                    name = "..." + name[3 - NAME_W:]
                out.append(_line(f"{g['index']:>3}  {i['container']:<12}  {p['pid']:>8}  {name:<{NAME_W}}  "
                                 f"{_mib(p['memory']):>10}"))
    if not any_proc:
        out.append(_line("No processes hold GPU memory"))
    out.append(RULE)
    return "\n".join(out)


def _health_lines(view: dict) -> list[str]:
    """A box for the GPUs out of service (none: nothing): what happened and what to do."""
    import textwrap

    out = []
    for g in view["gpus"]:
        h = g.get("health") or {}
        if h.get("healthy", True):
            continue
        out.append(_line(f"GPU {g['index']} OUT OF SERVICE: {h.get('reason') or 'failed'}"
                         + (" (stays out)" if h.get("retired") else "")))
        out += [_line("  " + t) for t in textwrap.wrap(h.get("advice") or "", W - 6)]
    return ["", RULE, _line("Health:"), HEAVY, *out, RULE] if out else []


def fetch(socket: str | None) -> dict:
    """The node view, from one connection (query, then the scheduler's stats)."""
    with Client(socket) as c:
        snap = c.call("query")
        stats = c.call("stats")
    return node_view(snap, stats)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cgpu-smi")
@click.option("--socket", envvar="CGPUD_SOCKET", default=None, help="The daemon's control socket.")
@click.option("-l", "--loop", "interval", type=click.FloatRange(min=0.1), default=None,
              help="Refresh every SECONDS (at least 0.1) until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="Print the node as JSON (docs/monitoring.md).")
def main(socket: str | None, interval: float | None, as_json: bool) -> None:
    """Show the GPUs of this node, their instances and the processes holding GPU memory."""
    try:
        while True:
            try:
                view = fetch(socket)
            except DaemonUnavailable as exc:
                raise click.ClickException(str(exc)) from None
            except ControlError as exc:
                raise click.ClickException(f"cgpud refused: {exc}") from None
            text = json.dumps(view, indent=2) if as_json else render(view)
            if interval is not None and not as_json and sys.stdout.isatty():
                click.echo("\033[H\033[2J", nl=False)  # clear the screen, as watch(1) does
            click.echo(text)
            if interval is None:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        sys.exit(130)
