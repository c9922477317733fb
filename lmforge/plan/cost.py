"""What a run costs while it runs: device-hours × price, and what the rest will cost.

The trainer logs its training wall time (``time/elapsed_s``, carried over resumes) with every
training step it logs; the tracking layer adds ``live_cost(...)`` to those records before they
reach any back-end, so every reader (progress line, ``metrics.jsonl``, MLflow/W&B,
``lmforge runs describe``, the HTML report) shows the same numbers without knowing how many
devices the run used.
"""

from __future__ import annotations


def live_cost(elapsed_s: float, devices: int, price_per_device_hour: float | None) -> dict[str, float]:
    """With a price, ``cost/so_far`` after ``elapsed_s`` seconds of training and ``cost/per_hour``
    (the burn rate: devices × price); without one, nothing."""
    if price_per_device_hour is None:
        return {}
    rate = devices * float(price_per_device_hour)
    return {"cost/per_hour": rate, "cost/so_far": rate * float(elapsed_s) / 3600.0}


def eta_s(progress: float | None, elapsed_s: float | None) -> float | None:
    """The one ETA of a run, for the console, `runs list`/`describe` and the report: its training
    time so far (``elapsed_s``, the trainer's clock over every attempt: steps, evaluations and
    checkpoints alike) scaled by what is left of it (``progress``: the share done, `train/progress`,
    whatever the unit of its duration — steps, tokens, epochs or a wall-clock budget)."""
    if progress is None or elapsed_s is None or progress <= 0:
        return None
    elapsed = float(elapsed_s)
    return max(0.0, elapsed / min(float(progress), 1.0) - elapsed)


def cost_to_finish(per_hour: float | None, eta_s: float | None) -> float | None:
    """The estimated cost of the remaining ``eta_s`` seconds at the burn rate ``per_hour``."""
    if per_hour is None or eta_s is None:
        return None
    return per_hour * max(eta_s, 0.0) / 3600.0


def format_cost(value: float | None) -> str:
    """A price in the user's currency (no symbol: price_per_gpu_hour has no unit)."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.4f}"
