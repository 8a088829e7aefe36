"""`cgpu trace`: who had each GPU when, over the last seconds (docs/monitoring.md).

Two halves, both plain code:

- `encode` (in the daemon, the `trace` control op): the slices that
  `sched.telemetry.collect` took from each GPU's ring, as JSON text a chunk at a
  time — names by index, times on the daemon's clock, nothing clipped.
- `lanes` and `svg` (in the client): each instance's lane as intervals of one
  state, and the picture, drawn by hand (no plotting library).

A lane's states, from one slice record:
  run     allowed to run and had work: it had the GPU;
  held    allowed to run (its ring slot) but idle: the GPU's time went unused;
  frozen  had work but was not allowed: held frozen, waiting for its turn;
  (idle)  neither: no interval is drawn.
The GPU's own lane shows the time nobody used: `waste` (a slot nobody holds,
or a holder that was idle) and `idle` (nobody to run at all).
"""
from __future__ import annotations

import html
import json
import math
import time
from typing import Iterator, Sequence

from cgpud.sched.policies import POLICY_NAMES

STATES = ("run", "held", "frozen")


# ---- daemon side ---------------------------------------------------------------
#
# The daemon answers `trace` on the thread that also runs the schedulers, and
# 60 s of 10 ms slices are 6000 records: `sched.telemetry.collect` only takes a
# snapshot (a copy of the ring's tail: immutable records), and `encode` turns it into JSON
# text a chunk at a time, so the control socket can let the schedulers run
# between chunks (control.Streamed).


def encode(gpus: Sequence[dict], seconds: float, wall: float, chunk: int = 256) -> Iterator[str]:
    """The `trace` answer as JSON text, in pieces of about `chunk` slices:

    {"seconds", "wall", "gpus": [{...head, "names": [...], "slices": [[start,
    end, kind, running, active, waiting], ...]}]} — start and end in whole
    microseconds of the daemon's clock (integers: a tenth of the cost of
    floats to print), running/active/waiting as indices into names (the GPU's
    instances first, then any that are gone)."""
    yield f'{{"seconds": {json.dumps(seconds)}, "wall": {json.dumps(wall)}, "gpus": ['
    for n, g in enumerate(gpus):
        recs = g["records"]
        names = {i["name"]: k for k, i in enumerate(g["head"]["instances"])}
        for ns in {x for r in recs for x in (r.names, r.active, r.waiting)}:
            for name in sorted(ns):
                names.setdefault(name, len(names))
        sets: dict[frozenset, str] = {}

        def ix(ns: frozenset) -> str:
            text = sets.get(ns)
            if text is None:
                text = sets[ns] = "[" + ",".join(str(k) for k in sorted(names[x] for x in ns)) + "]"
            return text

        yield (", " if n else "") + json.dumps(g["head"])[:-1] + f', "names": {json.dumps(list(names))}, "slices": ['
        for k in range(0, len(recs), chunk):
            yield ("," if k else "") + ",".join(
                f'[{round(r.start * 1e6)},{round(r.end * 1e6)},"{r.kind}",{ix(r.names)},{ix(r.active)},{ix(r.waiting)}]'
                for r in recs[k:k + chunk])
        yield "]}"
    yield "]}"


# ---- client side -----------------------------------------------------------------


def lanes(g: dict, merge_gap: float = 1e-6) -> dict:
    """Per instance, its intervals `[start, end, state]` (times relative to
    the GPU's `now`, so negative), clipped to the window, neighbours of one
    state merged; and `gpu`: the unused intervals `[start, end, "waste"|"idle"]`."""
    names, now, since = g["names"], g["now"], g["since"]
    out: dict[str, list[list]] = {n: [] for n in names}
    gpu_lane: list[list] = []

    def add(lane: list[list], s: float, e: float, state: str) -> None:
        if lane and lane[-1][2] == state and s - lane[-1][1] <= merge_gap:
            lane[-1][1] = e
        else:
            lane.append([s, e, state])

    for start, end, kind, running, active, waiting in g["slices"]:
        s, e = max(start, since) - now, min(end, now) - now
        if e <= s:
            continue
        act = set(active)
        for k in running:
            if k in act:
                add(out[names[k]], s, e, "run")
            elif kind != "native":  # (policy 5 has no slots to hold: everyone may run)
                add(out[names[k]], s, e, "held")
        for k in waiting:
            add(out[names[k]], s, e, "frozen")
        if not act and kind != "native":
            add(gpu_lane, s, e, "idle" if kind == "idle" else "waste")
    return {"instances": out, "gpu": gpu_lane}


def totals(lane: Sequence[Sequence]) -> dict[str, float]:
    """Seconds per state of one lane."""
    t = {s: 0.0 for s in STATES}
    for s, e, state in lane:
        t[state] = t.get(state, 0.0) + (e - s)
    return t


def seconds_of(g: dict) -> dict:
    """A GPU of the `trace` answer with its slices' times in seconds."""
    return {**g, "slices": [[s / 1e6, e / 1e6, *rest] for s, e, *rest in g["slices"]]}


def summary(result: dict) -> dict:
    """What `cgpu trace --json` prints: per GPU the raw slices (as the daemon
    logged them, times in seconds), the lanes drawn from them and each lane's totals."""
    gpus = []
    for g in map(seconds_of, result["gpus"]):
        ln = lanes(g)
        gpus.append({
            **g,
            "lanes": ln["instances"],
            "unused": ln["gpu"],
            "totals": {n: totals(v) for n, v in ln["instances"].items()},
        })
    return {"seconds": result["seconds"], "wall": result["wall"], "gpus": gpus}


# ---- the picture ---------------------------------------------------------------------

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#d62728", "#7f7f7f")
FROZEN = "#f2b8b5"
UNUSED = {"waste": "#c7c7c7", "idle": "#e8e8e8"}

WIDTH = 1000
LEFT = 150  # lane labels
RIGHT = 20
LANE = 22
GAP = 6


def _ticks(seconds: float) -> tuple[float, list[float]]:
    """A round step giving 5 to 12 ticks over `seconds`, and the ticks (<= 0)."""
    raw = seconds / 8
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    n = int(math.floor(seconds / step + 1e-9))
    return step, [-k * step for k in range(n, -1, -1)]


def _fmt(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def svg(summ: dict) -> str:
    """The timeline as an SVG document: per GPU a panel with its policy, a time
    axis (seconds before the end), the GPU's unused time and one lane per
    instance. Every bar carries its interval (data-start/data-end, seconds
    relative to the end) so a reader can check it against the slices."""
    seconds = summ["seconds"]
    plot_w = WIDTH - LEFT - RIGHT
    pps = plot_w / seconds  # pixels per second
    x0 = LEFT + plot_w  # x of "now" (t = 0)
    end_wall = time.strftime("%H:%M:%S", time.localtime(summ["wall"]))
    parts: list[str] = []
    y = 10
    colour: dict[str, str] = {}
    for g in summ["gpus"]:
        insts = {i["name"]: i for i in g["instances"]}
        names = [n for n in g["names"] if n in insts or any(g["lanes"][n])]
        for n in names:
            colour.setdefault(n, PALETTE[len(colour) % len(PALETTE)])
        pol = g["policy"]
        title = (f"GPU {g['gpu']} \u2014 policy {pol} ({POLICY_NAMES[pol] if 0 <= pol < 6 else '?'}), "
                 f"max_inst {g['max_inst']}"
                 + (f", slice {g['slice'] * 1000:g} ms" if g.get("slice") else "")
                 + f" \u2014 the last {_fmt(seconds)} s up to {end_wall}")
        parts.append(f'<text x="10" y="{y + 14}" class="title">{html.escape(title)}</text>')
        y += 24
        top = y
        n_lanes = 1 + len(names)
        height = n_lanes * (LANE + GAP)
        parts.append(f'<g class="gpu" data-gpu="{g["gpu"]}" data-x0="{_fmt(x0)}" data-pps="{pps!r}">')
        parts.append(f'<rect x="{LEFT}" y="{top - 2}" width="{plot_w}" height="{height}" class="frame"/>')
        # the time axis: grid lines and labels
        step, ticks = _ticks(seconds)
        for t in ticks:
            x = x0 + t * pps
            parts.append(f'<line x1="{x:.2f}" y1="{top - 2}" x2="{x:.2f}" y2="{top + height}" class="grid"/>')
            parts.append(f'<text x="{x:.2f}" y="{top + height + 14}" class="tick">{_fmt(t)} s</text>')
        lane_y = top
        rows = [("GPU (unused)", None, g["unused"])] + [(n, n, g["lanes"][n]) for n in names]
        for label, name, ivals in rows:
            text = label
            if name is not None and name in insts:
                i = insts[name]
                text = f"{name} w{i['weight']}" + (" hp" if i["highprio"] else "")
            elif name is not None:
                text = f"{name} (gone)"
            parts.append(f'<text x="{LEFT - 6}" y="{lane_y + LANE - 7}" class="label">{html.escape(text)}</text>')
            for s, e, state in ivals:
                x, w = x0 + s * pps, (e - s) * pps
                if state == "run":
                    style = f'fill="{colour[name]}"'
                elif state == "held":
                    style = f'fill="none" stroke="{colour[name]}" stroke-dasharray="2,2"'
                elif state == "frozen":
                    style = f'fill="{FROZEN}"'
                else:
                    style = f'fill="{UNUSED[state]}"'
                who = f' data-instance="{html.escape(name)}"' if name is not None else ""
                parts.append(f'<rect x="{x:.3f}" y="{lane_y}" width="{w:.3f}" height="{LANE}" {style}'
                             f' class="{state}"{who} data-start="{s!r}" data-end="{e!r}"/>')
            lane_y += LANE + GAP
        parts.append("</g>")
        y = top + height + 30
    # legend
    lx = LEFT
    legend = [("run", "had the GPU", 'fill="#555"'), ("held", "its slot, but idle", 'fill="none" stroke="#555" stroke-dasharray="2,2"'),
              ("frozen", "had work, frozen", f'fill="{FROZEN}"'), ("waste", "GPU unused (slot idle or unheld)", f'fill="{UNUSED["waste"]}"'),
              ("idle", "nobody to run", f'fill="{UNUSED["idle"]}"')]
    for _, text, style in legend:
        parts.append(f'<rect x="{lx}" y="{y}" width="14" height="12" {style}/>')
        parts.append(f'<text x="{lx + 18}" y="{y + 10}" class="legend">{html.escape(text)}</text>')
        lx += 28 + 7 * len(text)
    y += 24
    style = ("text{font-family:sans-serif;font-size:11px;fill:#222}"
             ".title{font-size:13px;font-weight:bold}.label{text-anchor:end}.tick{text-anchor:middle;fill:#555}"
             ".frame{fill:none;stroke:#999}.grid{stroke:#ddd}")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" viewBox="0 0 {WIDTH} {y}">\n'
            f"<style>{style}</style>\n" + "\n".join(parts) + "\n</svg>\n")
