"""The dashboard's picture, drawn from a real run (docs/monitoring.md, docs/dashboard-sample.svg).

    .venv/bin/python scripts/dashboard_svg.py [--seconds 90] [-o docs/dashboard-sample.svg]

Starts a daemon on two simulated T4s (bench/common.py), tenants on them (two workloads at weights
1 and 3 on GPU 0 under policy 2, then a third at weight 2 joining halfway; one holding memory on
GPU 1), and Debian's Prometheus scraping it every second; then asks Prometheus (query_range, one
point a second) every query of every panel of deploy/monitoring/cgpud-dashboard.json and draws
the panels where the dashboard puts them: time series as lines, stats and bar gauges as their last
values. Nothing of Grafana is used (it is AGPL): this draws Prometheus's answers itself.

`queries(instance)` (each panel's queries with `$instance` filled in) is what tests/test_dashboard.py
asks a live Prometheus too.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "monitoring" / "cgpud-dashboard.json"
PROMETHEUS = "/usr/bin/prometheus"
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def panels() -> list[dict]:
    """The dashboard's panels (rows included), in order."""
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def fill(expr: str, instance: str) -> str:
    return expr.replace("$instance", instance)


def queries(instance: str = ".*") -> dict[str, list[str]]:
    """Each panel's title -> its queries, `$instance` as given (a regular expression)."""
    return {p["title"]: [fill(t["expr"], instance) for t in p["targets"]] for p in panels() if p["type"] != "row"}


# ---- drawing ------------------------------------------------------------------------------

UNIT = {"bytes": 1, "percentunit": 1, "s": 1, "ops": 1, "short": 1}


def human(v: float, unit: str) -> str:
    if unit == "bytes":
        for suffix, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(v) >= size:
                return f"{v / size:.3g} {suffix}"
        return f"{v:.0f} B"
    if unit == "percentunit":
        return f"{100 * v:.3g}%"
    if unit == "s":
        return f"{v * 1000:.3g} ms" if abs(v) < 1 else f"{v:.3g} s"
    if unit == "ops":
        return f"{v:.3g}/s"
    return f"{v:.4g}"


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt) or "value"


def draw(answers: dict[int, list[tuple[str, list[tuple[float, float]]]]], start: float, end: float,
         title: str) -> str:
    """The SVG: `answers[panel id]` = [(legend, [(t, value)…])…] for each series of its queries."""
    cell_w, cell_h, pad = 40, 26, 8
    rows_y: dict[int, int] = {}
    parts: list[str] = []
    width = 24 * cell_w + 2 * pad
    bottom = 0
    for p in panels():
        g = p["gridPos"]
        x0, y0 = pad + g["x"] * cell_w, 40 + g["y"] * cell_h
        w, h = g["w"] * cell_w - 6, g["h"] * cell_h - 6
        bottom = max(bottom, y0 + h)
        if p["type"] == "row":
            parts.append(f'<text x="{x0}" y="{y0 + 18}" class="row">{html.escape(p["title"])}</text>')
            rows_y[p["id"]] = y0
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        series = answers.get(p["id"], [])
        parts.append(f'<g data-panel="{html.escape(p["title"])}" data-series="{len(series)}">')
        parts.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" class="panel"/>')
        parts.append(f'<text x="{x0 + 8}" y="{y0 + 17}" class="title">{html.escape(p["title"])}</text>')
        if p["type"] == "timeseries":
            parts += _lines(series, x0 + 56, y0 + 28, w - 64, h - 36 - 14 * min(4, len(series)), unit, start, end)
            for i, (name, pts) in enumerate(series[:4]):
                last = human(pts[-1][1], unit) if pts else "—"
                parts.append(f'<text x="{x0 + 8}" y="{y0 + h - 8 - 14 * (min(4, len(series)) - 1 - i)}" class="legend" '
                             f'fill="{COLOURS[i % len(COLOURS)]}">■ {html.escape(name)}: {last}</text>')
            if len(series) > 4:
                parts.append(f'<text x="{x0 + w - 8}" y="{y0 + 17}" class="legend" text-anchor="end">'
                             f'+{len(series) - 4} more</text>')
        else:
            for i, (name, pts) in enumerate(series[:6]):
                last = human(pts[-1][1], unit) if pts else "—"
                yy = y0 + 44 + i * 22
                parts.append(f'<text x="{x0 + 8}" y="{yy}" class="stat">{html.escape(last)}</text>'
                             f'<text x="{x0 + 120}" y="{yy}" class="legend">{html.escape(name)}</text>')
                if p["type"] == "bargauge" and pts:
                    frac = max(0.0, min(1.0, pts[-1][1]))
                    parts.append(f'<rect x="{x0 + 8}" y="{yy + 4}" width="{(w - 16) * frac:.1f}" height="5" fill="#2ca02c"/>')
        parts.append("</g>")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(end))
    style = ("text{font-family:sans-serif;font-size:11px;fill:#222}.row{font-size:14px;font-weight:bold}"
             ".title{font-weight:bold}.panel{fill:#fafafa;stroke:#ccc}.stat{font-size:15px;font-weight:bold}"
             ".axis{stroke:#bbb}.tick{font-size:9px;fill:#666}")
    head = (f'<text x="{pad}" y="24" class="row">{html.escape(title)} — {int(end - start)} s to {stamp}, '
            f'from Prometheus\'s answers</text>')
    h = bottom + pad
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" viewBox="0 0 {width} {h}">\n'
            f"<style>{style}</style>\n{head}\n" + "\n".join(parts) + "\n</svg>\n")


def _lines(series, x0, y0, w, h, unit, start, end) -> list[str]:
    values = [v for _, pts in series for _, v in pts]
    if not values or h < 20:
        return [f'<text x="{x0}" y="{y0 + 20}" class="legend">no data</text>']
    lo, hi = min(0.0, min(values)), max(values)
    hi = hi if hi > lo else lo + 1
    out = [f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" class="axis"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + h}" class="axis"/>',
           f'<text x="{x0 - 4}" y="{y0 + 8}" class="tick" text-anchor="end">{html.escape(human(hi, unit))}</text>',
           f'<text x="{x0 - 4}" y="{y0 + h}" class="tick" text-anchor="end">{html.escape(human(lo, unit))}</text>',
           f'<text x="{x0 + w}" y="{y0 + h + 10}" class="tick" text-anchor="end">now</text>',
           f'<text x="{x0}" y="{y0 + h + 10}" class="tick">−{int(end - start)} s</text>']
    for i, (_, pts) in enumerate(series):
        xy = " ".join(f"{x0 + w * (t - start) / (end - start):.1f},{y0 + h - h * (v - lo) / (hi - lo):.1f}"
                      for t, v in pts)
        out.append(f'<polyline points="{xy}" fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.5"/>')
    return out


# ---- a real run ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}{path}?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"prometheus: {body}")
    return body["data"]


def answers_for(port: int, instance: str, start: float, end: float) -> dict:
    out = {}
    for p in panels():
        if p["type"] == "row":
            continue
        got = []
        for t in p["targets"]:
            data = ask(port, "/api/v1/query_range", query=fill(t["expr"], instance), start=start, end=end, step=1)
            for r in data["result"]:
                got.append((legend(t.get("legendFormat", ""), r["metric"]),
                            [(float(ts), float(v)) for ts, v in r["values"]]))
        out[p["id"]] = got
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("-o", "--output", default=str(ROOT / "docs" / "dashboard-sample.svg"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from common import daemon

    cgpu = str(Path(sys.executable).parent / "cgpu")
    base = tempfile.mkdtemp(prefix="cgpud-dash-")
    tag = f"{os.getpid() % 10**6:06d}"  # (names: 12 characters)
    procs: list[subprocess.Popen] = []
    prom = None
    try:
        with daemon("sim:2xT4", extra=["--log-level", "info"], handle=True) as d:
            log = Path(d.base) / "daemon.log"
            deadline = time.monotonic() + 10
            while not (m := re.findall(r"metrics on http://([0-9.]+:\d+)/metrics", log.read_text())):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the daemon logged no metrics address:\n{log.read_text()}")
                time.sleep(0.1)
            target = m[-1]
            port = free_port()
            cfg = Path(base) / "prometheus.yml"
            cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
                           f"  - job_name: cgpud\n    static_configs:\n      - targets: ['{target}']\n")
            prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={base}/data",
                                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            with open(os.path.join(d.mount, "0", "policy"), "w") as f:
                f.write("2")
            env = d.env()
            secs = str(int(args.seconds) + 30)

            def run(name: str, *argv: str) -> None:
                procs.append(subprocess.Popen([cgpu, "run", "--name", f"{name}{tag}", *argv], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

            start = time.time()
            run("trainA", "--gpu", "0", "--weight", "1", "--mem", "4G", "--", cgpu, "workload", "--seconds", secs,
                "--mem", "1G")
            run("trainB", "--gpu", "0", "--weight", "3", "--mem", "6G", "--", cgpu, "workload", "--seconds", secs,
                "--mem", "3G")
            run("serveC", "--gpu", "1", "--mem", "8G", "--", cgpu, "mem", "hold", "5G", "--seconds", secs)
            time.sleep(args.seconds / 2)
            run("trainD", "--gpu", "0", "--weight", "2", "--mem", "3G", "--", cgpu, "workload", "--seconds", secs)
            time.sleep(args.seconds / 2)
            end = time.time()
            if gone := [p.args[3] for p in procs if p.poll() is not None]:
                raise SystemExit(f"cgpu run ended early: {', '.join(gone)}")
            answers = answers_for(port, re.escape(target).replace("\\", "\\\\"), start, end)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
        if prom is not None:
            prom.terminate()
            prom.wait(20)
        shutil.rmtree(base, ignore_errors=True)
    empty = [p["title"] for p in panels() if p["type"] != "row" and not answers.get(p["id"])]
    Path(args.output).write_text(draw(answers, start, end, json.loads(DASHBOARD.read_text())["title"]))
    shown = sum(1 for p in panels() if p["type"] != "row") - len(empty)
    print(f"wrote {args.output}: panels with data {shown} / {shown + len(empty)}"
          + (f"; empty: {', '.join(empty)}" if empty else ""))
    return 0 if not empty else 1


if __name__ == "__main__":
    sys.exit(main())
