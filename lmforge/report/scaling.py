"""A ladder's page: its runs, the fitted law and the prediction, as one self-contained HTML file.

Two charts: held-out loss against tokens (each size's runs and its fitted curve, the target's
curve and the prediction with its interval, the target's actual loss once it has run), and the
IsoFLOP view (loss against parameters per compute level, each level's parabola and its minimum).
Then the tables: the prediction, the law, the runs with their residuals, the warnings. plotly.js
is inlined as in the run report, so the file opens without a network.
"""

from __future__ import annotations

import html
import json
import math
import os
import time

from lmforge.report.html import CSS, MARK, PALETTE, _figure_html, _layout, _table
from lmforge.plan.auto import effective_tokens
from lmforge.scaling.fit import FLOPS_PER_PARAM_TOKEN, Law
from lmforge.config.counts import human
from lmforge.scaling.summary import ordered, prediction_facts, run_cells


def _law(pred: dict) -> Law:
    f = pred["fit"]
    return Law(E=f["E"], A=f["A"], alpha=f["alpha"], B=f["B"], beta=f["beta"])


def _geom(lo: float, hi: float, n: int = 60) -> list[float]:
    a, b = math.log(lo), math.log(hi)
    return [math.exp(a + (b - a) * i / (n - 1)) for i in range(n)]


def tokens_chart(pred: dict, actual: float | None) -> dict:
    """Held-out loss over training tokens: runs, fitted curves per size, the target's prediction."""
    law = _law(pred)
    runs = [r for r in pred["runs"] if r.get("loss") is not None]
    t = pred["target"]
    sizes = sorted({r["params"] for r in runs})
    d_lo = min(r["effective_tokens"] for r in runs) / 1.5
    d_hi = max(max(r["effective_tokens"] for r in runs), t["effective_tokens"]) * 1.5
    grid = _geom(d_lo, d_hi)
    traces = []
    for i, n in enumerate(sizes):
        color = PALETTE[i % len(PALETTE)]
        mine = [r for r in runs if r["params"] == n]
        traces.append({"type": "scatter", "mode": "markers", "x": [r["effective_tokens"] for r in mine],
                       "y": [r["loss"] for r in mine], "name": f"{human(n)} params (runs)",
                       "text": [r["label"] for r in mine], "marker": {"color": color, "size": 9},
                       "legendgroup": str(n)})
        traces.append({"type": "scatter", "mode": "lines", "x": grid, "y": [law.loss(n, d) for d in grid],
                       "name": f"{human(n)} fitted", "line": {"color": color, "width": 1.5},
                       "legendgroup": str(n), "showlegend": False, "hoverinfo": "skip"})
    traces.append({"type": "scatter", "mode": "lines", "x": grid, "y": [law.loss(t["params"], d) for d in grid],
                   "name": f"target {human(t['params'])} params (law)", "line": {"color": "#111", "dash": "dash"}})
    traces.append({"type": "scatter", "mode": "markers", "x": [t["effective_tokens"]], "y": [t["loss"]],
                   "name": f"prediction ({t['confidence']:.0%} interval)",
                   "marker": {"color": "#111", "size": 12, "symbol": "diamond"},
                   "error_y": {"type": "data", "symmetric": False, "array": [t["loss_high"] - t["loss"]],
                               "arrayminus": [t["loss"] - t["loss_low"]], "thickness": 2, "width": 8}})
    if actual is not None:
        traces.append({"type": "scatter", "mode": "markers", "x": [t["effective_tokens"]], "y": [actual],
                       "name": "target, trained", "marker": {"color": "#d62728", "size": 14, "symbol": "star"}})
    layout = _layout("Held-out loss against training tokens", "held-out loss (nats/token)", "tokens (effective)", 460)
    layout["xaxis"] |= {"type": "log", "tickformat": ".2s"}
    layout["hovermode"] = "closest"
    return {"data": traces, "layout": layout}


def isoflop_chart(pred: dict) -> dict:
    """Loss over parameters at each compute level: the runs, the law along the level, its minimum."""
    law = _law(pred)
    runs = [r for r in pred["runs"] if r.get("loss") is not None]
    traces = []
    levels = sorted({r["level"] for r in runs})
    grid = _geom(min(r["params"] for r in runs) / 2, max(r["params"] for r in runs) * 2)
    unique = (pred.get("ladder") or {}).get("unique_tokens")
    minima = [lv for lv in pred["isoflop"]["levels"] if lv.get("n_opt")]
    for i, level in enumerate(levels):
        color = PALETTE[i % len(PALETTE)]
        mine = sorted((r for r in runs if r["level"] == level), key=lambda r: r["params"])
        c = sorted(FLOPS_PER_PARAM_TOKEN * r["params"] * r["tokens"] for r in mine)[len(mine) // 2]
        traces.append({"type": "scatter", "mode": "markers", "x": [r["params"] for r in mine],
                       "y": [r["loss"] for r in mine], "name": f"{c:.2g} FLOPs (runs)",
                       "text": [r["label"] for r in mine], "marker": {"color": color, "size": 9},
                       "legendgroup": str(level)})
        traces.append({"type": "scatter", "mode": "lines", "x": grid,
                       "y": [law.loss(n, effective_tokens(c / (FLOPS_PER_PARAM_TOKEN * n), unique)) for n in grid],
                       "name": f"{c:.2g} FLOPs (law)", "line": {"color": color, "width": 1.5},
                       "legendgroup": str(level), "showlegend": False, "hoverinfo": "skip"})
        near = [lv for lv in minima if abs(math.log(lv["flops"] / c)) < 0.2]
        if near:
            traces.append({"type": "scatter", "mode": "markers", "x": [near[0]["n_opt"]], "y": [near[0]["loss_min"]],
                           "name": f"{c:.2g} FLOPs: parabola's minimum", "legendgroup": str(level),
                           "marker": {"color": color, "size": 12, "symbol": "x"}})
    layout = _layout("IsoFLOP: held-out loss against parameters, per compute level", "held-out loss (nats/token)",
                     "parameters", 460)
    layout["xaxis"] |= {"type": "log", "tickformat": ".2s"}
    layout["hovermode"] = "closest"
    return {"data": traces, "layout": layout}


def _prediction_rows(pred: dict, actual: float | None) -> list[list[str]]:
    """The terminal's facts (`scaling.summary.prediction_facts`) as table rows, the prediction in bold."""
    rows = []
    for label, text in prediction_facts(pred, actual):
        cell = html.escape(text)
        if label == "predicted held-out loss":
            number, rest = cell.split(" ", 1)
            cell = f"<b>{number}</b> {rest}"
        rows.append([html.escape(label), cell])
    return rows


def render(pred: dict, actual: float | None = None) -> str:
    import plotly.offline

    name = pred.get("ladder", {}).get("name", "ladder")
    run_rows = [[html.escape(c) for c in run_cells(r)] for r in ordered(pred["runs"])]
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in pred.get("warnings", []))
    sections = [
        f"<h1>lmforge scaling ladder: {html.escape(name)}</h1>",
        f"<div class='sub'>generated {time.strftime('%Y-%m-%d %H:%M:%S')} from "
        f"{html.escape(pred.get('ladder', {}).get('save_folder', ''))}</div>",
        "<h2>Prediction</h2>", _table(["", "from the ladder's runs"], _prediction_rows(pred, actual), numeric_from=2),
        "<h2>Warnings</h2>", f"<ul class='warnings'>{warnings}</ul>" if warnings else "<p>None.</p>",
        "<h2>Charts</h2>",
        f"<div class='chart'>{_figure_html(tokens_chart(pred, actual), 'chart-tokens')}</div>",
        f"<div class='chart'>{_figure_html(isoflop_chart(pred), 'chart-isoflop')}</div>",
        "<h2>Runs</h2>",
        _table(["run", "params", "tokens", "FLOPs", "status", "held-out loss", "law", "residual", "seconds"],
               run_rows, numeric_from=1),
    ]
    meta = html.escape(json.dumps({"ladder": name, "charts": 2}))
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"{MARK} content=\"{meta}\"><title>lmforge ladder: {html.escape(name)}</title><style>{CSS}</style>"
            f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head>"
            f"<body>{''.join(sections)}</body></html>\n")


def write_ladder_report(pred: dict, out: str, actual: float | None = None) -> str:
    page = render(pred, actual)
    tmp = f"{out}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out)
    return out
