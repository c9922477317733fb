"""What tells runs apart: their headline numbers and the config keys whose values differ.

Shared by the HTML report (its summary and differences tables) and ``lmforge runs compare``
(the same tables in the terminal).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from lmforge.report.load import RunData

# Keys that differ between any two runs without telling anything about them.
_NOISE = {"name", "save_folder"}


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(runs: list[RunData]) -> list[tuple[str, list[Any]]]:
    """(dotted key, value per run) for every config key whose values are not all equal."""
    flats = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flats) - _NOISE) if flats else []
    rows = []
    for key in keys:
        values = [f.get(key) for f in flats]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, values))
    return rows


def _median_of(run: RunData, key: str, skip_first: bool = True) -> float | None:
    _, values = run.series(key)
    if skip_first and len(values) > 1:
        values = values[1:]  # the first logged step includes start-up (compilation, data warm-up)
    return statistics.median(values) if values else None


def _best(run: RunData, key: str, highest: bool = False) -> float | None:
    """The best value of a series: the lowest (a loss), or the ``highest`` (a reward)."""
    _, values = run.series(key)
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return (max if highest else min)(finite) if finite else None


def eval_prefixes(run: RunData) -> list[str]:
    """"eval" and, for several eval datasets, "eval/<name>" — every prefix with a loss series."""
    return sorted({k[: -len("/loss")] for k in run.keys() if k.startswith("eval") and k.endswith("/loss")})


def summary(run: RunData) -> dict[str, float | str | None]:
    """The headline numbers of a run (None where the run did not log them)."""
    last = run.last_record()
    steps, _ = run.series("train/loss")
    out: dict[str, float | str | None] = {
        "status": run.status,
        "reason": run.reason,
        "steps": steps[-1] if steps else None,
        "tokens": last.get("train/tokens"),
        "train loss (last)": last.get("train/loss"),
        "eval loss (last)": run.last("eval/loss"),
        "eval loss (best)": _best(run, "eval/loss"),
        "eval bits/byte (last)": run.last("eval/bits_per_byte"),
        "eval bits/byte (best)": _best(run, "eval/bits_per_byte"),
        # preference tuning: how often the chosen answer wins, and by how much (implicit reward)
        "eval preference accuracy (last)": run.last("eval/rewards/accuracy"),
        "eval preference margin (last)": run.last("eval/rewards/margin"),
        "train preference accuracy (last)": last.get("train/rewards/accuracy"),
        # reinforcement learning: the completions' mean reward, and the held-out greedy completions'
        "train reward (last)": last.get("train/reward"),
        "eval reward (last)": run.last("eval/reward"),
        "eval reward (best)": _best(run, "eval/reward", highest=True),
        "tokens/s (median)": _median_of(run, "throughput/tokens_per_s"),
        "MFU (median)": _median_of(run, "throughput/mfu"),
        "peak memory GB": run.last("memory/max_allocated_gb"),
        "training time": last.get("time/elapsed_s"),
        "cost so far": last.get("cost/so_far"),
    }
    for key in sorted(k for k in run.keys() if k.startswith(("icl/", "gauntlet/"))):
        out[key] = run.last(key)
    return out


def fmt(value: Any, key: str = "") -> str:
    """A table cell: compact numbers, '-' for nothing."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."
    if "MFU" in key:
        return f"{100 * value:.1f}%"
    if key == "training time":
        from lmforge.tracking.console import format_eta

        return format_eta(value)
    if "cost" in key:
        from lmforge.plan.cost import format_cost

        return format_cost(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.4g}"


def _delta(a: Any, b: Any, key: str) -> str:
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return ""
    d = b - a
    if d == 0:
        return "="
    rel = f" ({100 * d / abs(a):+.1f}%)" if a else ""
    if "MFU" in key:  # percentage points, to the first digit that is not 0 below 0.1
        pts = 100 * d
        return f"{pts:+.1f} pts" if abs(pts) >= 0.1 else f"{pts:+.1g} pts"
    if key == "training time":  # h:mm:ss, as the values beside it
        from lmforge.tracking.console import format_eta

        return ("-" if d < 0 else "+") + format_eta(abs(d)) + rel
    if all(float(v).is_integer() for v in (a, b)) and abs(d) >= 1:  # counts (steps, tokens): every digit
        return f"{int(d):+,}{rel}"
    return f"{d:+.4g}{rel}"


def format_compare(a: RunData, b: RunData) -> str:
    """``lmforge runs compare``: the metric table (with B − A) and the config differences."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    sa, sb = summary(a), summary(b)
    metrics = Table(box=box.SIMPLE, title="metrics", title_justify="left")
    for col in ("", a.name, b.name, "B − A"):
        metrics.add_column(col, overflow="fold")
    for key in [k for k in sa | sb if sa.get(k) is not None or sb.get(k) is not None]:
        metrics.add_row(key, fmt(sa.get(key), key), fmt(sb.get(key), key), _delta(sa.get(key), sb.get(key), key))

    diffs = config_differences([a, b])
    config = Table(box=box.SIMPLE, title="config differences", title_justify="left")
    for col in ("key", a.name, b.name):
        config.add_column(col, overflow="fold")
    for key, (va, vb) in diffs:
        config.add_row(key, fmt(va), fmt(vb))

    import io

    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None, force_terminal=False, highlight=False)
    console.print(metrics)
    if diffs:
        console.print(config)
    else:
        console.print("config differences: none (same resolved config)")
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()).strip("\n") + "\n"
