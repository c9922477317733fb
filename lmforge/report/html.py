"""One self-contained HTML file for one or more runs: curves, evals, samples, timeline, plan, config.

Charts are plotly figures; plotly.js is inlined once in the page's head, so the file opens
without a network (about 5 MB, nearly all of it plotly.js) and keeps plotly's hover, zoom
and legend toggling — what comparing overlaid runs needs. Several runs share every chart's
axes, one colour per run.
"""

from __future__ import annotations

import contextlib
import functools
import html
import json
import time
from collections.abc import Callable

from lmforge.report.compare import config_differences, eval_prefixes, fmt, summary
from lmforge.report.load import RunData
from lmforge.run_files import ACTIVE  # a run still going (any other status has ended)

MAX_POINTS = 4000  # per curve; longer series are thinned evenly (the last point is kept)
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash"]

MARK = "<meta name='lmforge-report'"  # in every page's head: `lmforge report` may replace such a file


def _keys_matching(pred: Callable[[str], bool]) -> Callable[[RunData], list[str]]:
    return lambda run: sorted(k for k in run.keys() if pred(k))


def _exact(key: str) -> Callable[[RunData], list[str]]:
    return lambda run: [key] if key in run.keys() else []


# (title, y-axis title, the run's metric keys to draw, value scale)
CHARTS: list[tuple[str, str, Callable[[RunData], list[str]], float]] = [
    ("Training loss", "loss", _exact("train/loss"), 1.0),
    ("Held-out loss", "loss", lambda r: [f"{p}/loss" for p in eval_prefixes(r)], 1.0),
    ("Held-out bits per byte", "bits/byte", _keys_matching(lambda k: k.startswith("eval") and k.endswith("/bits_per_byte")), 1.0),
    # (a y-axis title longer than the plot is tall runs into the chart's title: keep them short)
    ("Preference accuracy", "accuracy (chosen wins)",
     _keys_matching(lambda k: k.endswith("rewards/accuracy")), 1.0),
    ("Preference rewards", "implicit reward",
     _keys_matching(lambda k: k.endswith(("rewards/chosen", "rewards/rejected", "rewards/margin"))), 1.0),
    # reinforcement learning: the sampled completions' reward, and the held-out greedy one
    ("Reward", "mean reward", lambda r: [k for k in ("train/reward", "eval/reward") if k in r.keys()], 1.0),
    ("Rollouts", "share of completions / groups",
     lambda r: [k for k in ("train/flat_groups", "train/truncated", "train/clip_fraction") if k in r.keys()], 1.0),
    ("Learning rate", "lr", _exact("train/lr"), 1.0),
    ("Gradient norm", "norm (before clipping)", _exact("train/grad_norm"), 1.0),
    ("Throughput", "tokens/s", _exact("throughput/tokens_per_s"), 1.0),
    ("MFU", "% of peak", _exact("throughput/mfu"), 100.0),
    ("Peak GPU memory", "GB", _exact("memory/max_allocated_gb"), 1.0),
    ("ICL accuracy", "accuracy", _keys_matching(lambda k: k.startswith("icl/")), 1.0),
    ("Gauntlet", "score", _keys_matching(lambda k: k.startswith("gauntlet/")), 1.0),
    ("MoE routing", "max expert share", _exact("train/moe_max_expert_share"), 1.0),
    ("Cost so far", "cost", _exact("cost/so_far"), 1.0),
]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5} td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px}
.chart{border:1px solid #eee;border-radius:4px;padding:4px}
pre{background:#f8f8f8;padding:8px;overflow-x:auto;font-size:12px;margin:4px 0;white-space:pre-wrap}
details{margin:6px 0} summary{cursor:pointer;font-weight:600}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
"""


def _thin(xs: list, ys: list) -> tuple[list, list]:
    if len(xs) <= MAX_POINTS:
        return xs, ys
    stride = -(-len(xs) // MAX_POINTS)
    idx = list(range(0, len(xs) - 1, stride)) + [len(xs) - 1]
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _figure_html(fig: dict, div_id: str) -> str:
    import plotly.io as pio

    # Plain dicts, serialised without plotly.py's per-property validation (seconds for long runs).
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, validate=False,
                       config={"displaylogo": False, "responsive": True})


@functools.lru_cache(maxsize=1)
def _template() -> dict:
    """plotly's "plotly_white" theme as JSON (named templates are resolved in Python, not in plotly.js)."""
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def _layout(title: str, ytitle: str, xtitle: str = "step", height: int = 330) -> dict:
    return {"title": {"text": title, "x": 0.02, "font": {"size": 15}}, "height": height, "template": _template(),
            "margin": {"l": 60, "r": 20, "t": 40, "b": 40}, "xaxis": {"title": {"text": xtitle}},
            "yaxis": {"title": {"text": ytitle}}, "hovermode": "x unified",
            "legend": {"orientation": "h", "y": -0.2, "font": {"size": 11}}}


def curve_names(keys: list[str]) -> dict[str, str]:
    """A legend name for each of one run's metric keys in a chart: what tells them apart — the
    keys without the part they all end with ("train" and "eval" for train/rewards/accuracy and
    eval/rewards/accuracy), or the whole keys when that leaves nothing."""
    parts = [k.split("/") for k in keys]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({tuple(p[len(p) - common - 1:]) for p in parts}) == 1:
        common += 1
    names = {k: "/".join(p[:len(p) - common]) for k, p in zip(keys, parts)}
    return names if len(set(names.values())) == len(keys) else {k: k for k in keys}


def metric_chart(runs: list[RunData], title: str, ytitle: str, pick, scale: float) -> dict | None:
    """A plotly figure (as a dict) with one curve per (run, metric key), or None when no run logged any."""
    traces = []
    for i, run in enumerate(runs):
        keys = pick(run)
        names = curve_names(keys)
        for j, key in enumerate(keys):
            steps, values = run.series(key)
            steps, values = _thin(steps, [v * scale for v in values])
            label = run.name if len(keys) == 1 else f"{run.name} · {names[key]}"
            traces.append({"type": "scatter", "x": steps, "y": values, "name": label,
                           "mode": "lines+markers" if len(steps) <= 30 else "lines",
                           "line": {"color": PALETTE[i % len(PALETTE)], "dash": DASHES[j % len(DASHES)]}})
    if not traces:
        return None
    return {"data": traces, "layout": _layout(title, ytitle)}


def timeline_chart(runs: list[RunData]) -> dict | None:
    """Resumptions as bars and events as markers, on the wall clock, one row per run."""
    import datetime as dt

    def when(t: float) -> str:
        return dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="milliseconds")

    traces = []
    colours = {"COMPLETED": "#2ca02c", "RUNNING": "#1f77b4", "FAILED": "#d62728", "STOPPED": "#ff7f0e"}
    for i, run in enumerate(runs):
        for r in run.resumptions:
            start = r.get("started_at")
            end = r.get("ended_at") or (time.time() if r.get("status") in ("RUNNING", "STARTING") else start)
            if start is None:
                continue
            text = f"resumption {r.get('idx')}: {r.get('status')}" + (f" — {r['reason']}" if r.get("reason") else "")
            traces.append({"type": "scatter", "x": [when(start), when(end)], "y": [run.name, run.name],
                           "mode": "lines", "line": {"width": 14, "color": colours.get(str(r.get("status")), "#7f7f7f")},
                           "name": f"{run.name} resumption {r.get('idx')}", "hovertext": [text, text],
                           "hoverinfo": "text+x"})
        if run.events:
            traces.append({
                "type": "scatter", "x": [when(e["time"]) for e in run.events], "y": [run.name] * len(run.events),
                "mode": "markers", "name": f"{run.name} events", "hoverinfo": "text+x",
                "marker": {"size": 11, "symbol": "diamond", "color": PALETTE[i % len(PALETTE)],
                           "line": {"width": 1, "color": "#333"}},
                "hovertext": [f"{e['type']}: {e['message'][:300]}" for e in run.events]})
    if not traces:
        return None
    layout = _layout("Resumptions and events", "", "time", height=140 + 50 * len(runs))
    layout.update(hovermode="closest", showlegend=False)
    layout["yaxis"]["type"] = "category"
    return {"data": traces, "layout": layout}


# --------------------------------------------------------------------------- tables

def _table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for k, cell in enumerate(row):
            cls = ' class="num"' if k >= numeric_from else ""
            cells.append(f"<td{cls}>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _run_header(runs: list[RunData]) -> list[str]:
    return [""] + [r.name for r in runs]


def summary_table(runs: list[RunData]) -> str:
    sums = [summary(r) for r in runs]
    keys = [k for k in dict.fromkeys(k for s in sums for k in s) if any(s.get(k) is not None for s in sums)]
    # The reason a run ended is shown whole: it is the line that says what went wrong.
    rows = [[html.escape(k)] + [html.escape(str(s[k]) if k == "reason" and s.get(k) else fmt(s.get(k), k))
                                for s in sums] for k in keys]
    swatches = "".join(f'<span style="margin-right:14px"><span class="swatch" style="background:'
                       f'{PALETTE[i % len(PALETTE)]}"></span>{html.escape(r.name)}</span>' for i, r in enumerate(runs))
    return f"<div>{swatches}</div>" + _table(_run_header(runs), rows)


def plan_rows(run: RunData) -> list[tuple[str, str, str]]:
    """(what, planned, actual) for the plan-vs-actual table."""
    from lmforge.plan.cost import cost_to_finish, eta_s, format_cost
    from lmforge.config.counts import human
    from lmforge.tracking.console import format_eta

    plan = run.plan or {}
    est = plan.get("estimate") or {}
    last = run.last_record()
    tokens = last.get("train/tokens")
    steps, _ = run.series("train/loss")
    elapsed = last.get("time/elapsed_s")
    headline = summary(run)
    tps, mfu = headline["tokens/s (median)"], headline["MFU (median)"]
    total_tokens = plan.get("total_tokens")
    remaining_s = None
    if run.status in ACTIVE:  # an ended run has nothing to finish
        remaining_s = eta_s(last.get("train/progress"), elapsed)
    rows = [
        ("devices", *[f"{plan.get('devices', '?')} × {plan.get('device', '?')}" if plan else "-"] * 2),
        ("steps", f"{plan['total_steps']:,}" if plan.get("total_steps") else "-", f"{steps[-1]:,}" if steps else "-"),
        ("tokens", human(total_tokens) if total_tokens else "-", human(tokens) if tokens is not None else "-"),
        ("MFU", f"{100 * est['mfu']:.0f}% ({est.get('rate_source') or 'assumed'})" if est.get("mfu") else "-",
         f"{100 * mfu:.1f}% (median)" if mfu is not None else "-"),
        ("tokens/s", human(est["tokens_per_second"]) if est.get("tokens_per_second") else "-",
         human(tps) + " (median)" if tps else "-"),
        ("training time", format_eta(est.get("seconds")) if est.get("seconds") else "-",
         (format_eta(elapsed) if elapsed is not None else "-")
         + (f" + ~{format_eta(remaining_s)} to finish" if remaining_s else "")),
    ]
    rows += goodput_rows((plan.get("view") or {}).get("goodput"), run.goodput)
    price = plan.get("price_per_gpu_hour", (run.config.get("compute") or {}).get("price_per_gpu_hour"))
    if price is not None:
        so_far = last.get("cost/so_far")
        to_finish = cost_to_finish(last.get("cost/per_hour"), remaining_s)
        actual = format_cost(so_far) + (f" + ~{format_cost(to_finish)} to finish" if to_finish else "")
        rows.append((f"cost (at {price:g} per device-hour)", format_cost(est.get("cost")), actual))
    return rows


def goodput_rows(planned: dict | None, measured: dict | None) -> list[tuple[str, str, str]]:
    """Goodput planned (`plan.goodput`) beside what the run's ledger measured, part by part."""
    if not planned:
        return []
    m = measured or {}
    wall = m.get("wall_s") or 0.0
    parts = m.get("parts") or {}

    def share(*keys) -> str:
        return f"{100 * sum(parts.get(k, 0.0) for k in keys) / wall:.1f}%" if wall else "-"

    p = planned["parts"]
    expected = f"{planned['interruptions']:.3g} interruption(s) expected" if planned["goodput"] > 0 else \
        "restarts alone outlast the time between failures"
    rows = [("goodput", f"{100 * planned['goodput']:.1f}% ({expected})",
             f"{100 * m['goodput']:.1f}% ({len(m['resumptions'])} resumption(s))" if m else "-"),
            ("start-up and restarts", f"{100 * (p['restart'] + p.get('startup', 0.0)):.1f}%",
             share("startup", "recovery")),
            ("lost work", f"{100 * p['lost']:.1f}%", share("lost") + (f" ({m['steps_lost']} steps)" if m else "")),
            ("checkpoints", f"{100 * p['checkpoint']:.1f}%", share("checkpoint"))]
    for tier in planned["tiers"]:
        chosen = (m.get("intervals") or {}).get(tier["tier"])
        rows.append((f"checkpoint interval ({tier['tier']})", tier["reason"],
                     f"{chosen['steps']} steps from step {chosen['step']}: {chosen['why']}" if chosen else "as planned"))
    return rows


def plan_table(runs: list[RunData]) -> str:
    parts = []
    for run in runs:
        rows = [[html.escape(a), html.escape(b), html.escape(c)] for a, b, c in plan_rows(run)]
        parts.append(f"<h3 style='font-size:14px;margin:10px 0 2px'>{html.escape(run.name)}</h3>"
                     + _table(["", "plan (the run's own, at its start)", "what happened"], rows))
    note = ("<p class='sub'>The plan is the one the run made at its start, as <code>lmforge estimate</code> shows "
            "it: its speed measured on this machine where it was, else assumed (the MFU row says which); time and "
            "cost count training wall time (carried over resumes).</p>")
    return note + "".join(parts)


def goodput_table(runs: list[RunData]) -> str:
    """Where each run's wall time went (the parts add up to it), and its resumptions with their cause."""
    from lmforge.goodput.ledger import PARTS

    shown = [r for r in runs if r.goodput]
    if not shown:
        return "<p>No goodput ledger (goodput.jsonl) in the save folder.</p>"
    rows = [[html.escape(r.name), f"{100 * r.goodput['goodput']:.1f}%", f"{r.goodput['wall_s']:.1f}"]
            + [f"{r.goodput['parts'][k]:.1f}" for k in PARTS] + [f"{r.goodput.get('idle_s', 0.0):.1f}"] for r in shown]
    # idle: waits after a completed run or a requested stop until the next start, outside the wall
    out = _table(["run", "goodput", "wall (s)", *[f"{k} (s)" for k in PARTS], "idle, not counted (s)"], rows)
    for r in shown:
        for res in r.goodput["resumptions"]:
            out += (f"<div class='sub'>{html.escape(r.name)}: resumed at step {res['step']} "
                    f"({res['steps_redone']} step(s) redone) after {html.escape(str(res['cause']))}</div>")
    return out


def differences_table(runs: list[RunData]) -> str:
    diffs = config_differences(runs)
    if not diffs:
        return "<p>The runs have the same resolved config (apart from name and save folder).</p>"
    rows = [[f"<code>{html.escape(k)}</code>"] + [html.escape(fmt(v)) for v in values] for k, values in diffs]
    return _table(["key"] + [r.name for r in runs], rows)


def generations_html(run: RunData) -> str:
    if not run.generations:
        if not (run.config.get("eval") or {}).get("prompts"):
            why = "eval.prompts is empty"
        elif run.status in ACTIVE:
            why = "no eval has run yet"
        else:
            why = "the run ended before its first eval"
        return f"<p>{html.escape(run.name)}: no generations logged ({why}).</p>"
    by_step: dict[int, list[dict]] = {}
    for g in run.generations:
        by_step.setdefault(int(g.get("step", 0)), []).append(g)
    parts = []
    for i, step in enumerate(sorted(by_step, reverse=True)):
        items = "".join(f"<div class='sub'>{html.escape(str(g.get('key', '')))}</div>"
                        f"<pre>{html.escape(str(g.get('text', '')))}</pre>" for g in by_step[step])
        parts.append(f"<details{' open' if i == 0 else ''}><summary>step {step}</summary>{items}</details>")
    return f"<h3 style='font-size:14px;margin:10px 0 2px'>{html.escape(run.name)}</h3>" + "".join(parts)


def config_html(run: RunData) -> str:
    import yaml

    text = yaml.safe_dump(run.config, sort_keys=False) if run.config else "(no run.json in the save folder)"
    return (f"<details><summary>{html.escape(run.name)} — {html.escape(run.folder)}</summary>"
            f"<pre>{html.escape(text)}</pre></details>")


# --------------------------------------------------------------------------- the page

def render(runs: list[RunData]) -> str:
    """The whole report page for ``runs`` (one or more)."""
    import plotly.offline

    charts = []
    for title, ytitle, pick, scale in CHARTS:
        fig = metric_chart(runs, title, ytitle, pick, scale)
        if fig is not None:
            charts.append(f"<div class='chart'>{_figure_html(fig, f'chart-{len(charts)}')}</div>")
    timeline = timeline_chart(runs)
    names = ", ".join(r.name for r in runs)
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    sections = [
        f"<h1>lmforge report: {html.escape(names)}</h1>",
        f"<div class='sub'>generated {generated} from {html.escape(', '.join(r.folder for r in runs))}</div>",
        "<h2>Summary</h2>", summary_table(runs),
        "<h2>Curves</h2>", f"<div class='charts'>{''.join(charts)}</div>",
        "<h2>Timeline</h2>",
        _figure_html(timeline, "timeline") if timeline is not None else "<p>No events recorded.</p>",
        "<h2>Plan against what happened</h2>", plan_table(runs),
        "<h2>Goodput</h2>", goodput_table(runs),
    ]
    if len(runs) > 1:
        sections += ["<h2>Config differences</h2>", differences_table(runs)]
    sections += ["<h2>Generations at each eval</h2>", *[generations_html(r) for r in runs],
                 "<h2>Resolved config</h2>", *[config_html(r) for r in runs]]
    meta = html.escape(json.dumps({"runs": [r.name for r in runs], "charts": len(charts)}))
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"{MARK} content=\"{meta}\">"
            f"<title>lmforge report: {html.escape(names)}</title><style>{CSS}</style>"
            f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head>"
            f"<body>{''.join(sections)}</body></html>\n")


def write_report(runs: list[RunData], out: str) -> str:
    """Render ``runs`` and write the page to ``out`` (a local path) atomically; returns ``out``."""
    import os

    page = render(runs)
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{out}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, out)  # a browser (or the uploader) never sees half a page
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: no half page left behind
            os.remove(tmp)
        raise
    return out
