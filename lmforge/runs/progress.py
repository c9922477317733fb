"""A run's latest metrics and progress, read from the ``metrics.jsonl`` the trainer writes.

The supervisor tails the file while the run trains and stores the summary in the registry;
``runs list`` shows it. Reading the file is enough: no channel from the trainer is needed.
"""

from __future__ import annotations

import json
import os

from lmforge.config.durations import parse_duration
from lmforge.plan.cost import eta_s
from lmforge.tracking.jsonl import read_metrics


def metrics_path(save_folder: str) -> str:
    return os.path.join(save_folder, "metrics.jsonl")


class MetricsTail:
    """Reads only what was appended since the last call (the file may be large)."""

    def __init__(self, path: str):
        self.path, self.offset, self.latest = path, 0, {}
        self.latest_eval: dict = {}  # the last held-out evaluation (of this run, over its resumptions)

    def poll(self) -> dict:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return self.latest
        if size < self.offset:  # a fresh run truncated the file
            self.offset, self.latest_eval = 0, {}
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # leave a half-written last line for next time
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "train/loss" in rec:
                self.latest = rec
            elif "eval/loss" in rec or "eval/reward" in rec:  # (reinforcement learning's held-out: a reward)
                self.latest_eval = rec
        return self.latest


def read_history(save_folder: str) -> list[dict]:
    path = metrics_path(save_folder)
    return read_metrics(path) if os.path.exists(path) else []


def summarize(record: dict, config: dict | None, eval_record: dict | None = None) -> dict:
    """step, tokens, loss, tokens/s, MFU, progress (0..1), ETA and training time in seconds from one
    record; with a price also the cost so far and the estimated cost to finish; a reinforcement learning
    run's reward and share of flat groups; a preference run's
    accuracy and margin; and ``eval``: the last held-out evaluation's metrics (``eval_record``)."""
    if not record:
        return {}
    out = {"step": record.get("step"), "tokens": record.get("train/tokens"), "loss": record.get("train/loss"),
           "tokens_per_s": record.get("throughput/tokens_per_s"), "mfu": record.get("throughput/mfu"),
           "time": record.get("time"), "elapsed_s": record.get("time/elapsed_s"),
           "done": record.get("train/progress")}
    frac, eta = _progress(out, config or {})
    out["progress"], out["eta_s"] = frac, eta
    del out["done"]
    for key in ("accuracy", "margin"):  # preference tuning: how often, and by how much, the chosen answer wins
        if record.get(f"train/rewards/{key}") is not None:
            out[key] = record[f"train/rewards/{key}"]
    for key in ("reward", "flat_groups"):  # reinforcement learning: the completions' reward, the groups without signal
        if record.get(f"train/{key}") is not None:
            out[key] = record[f"train/{key}"]
    if eval_record:
        out["eval"] = {"step": eval_record.get("step")} | {
            k.removeprefix("eval/"): v for k, v in eval_record.items() if k.startswith("eval/")}
    if record.get("cost/so_far") is not None:  # the run has a compute.price_per_gpu_hour
        from lmforge.plan.cost import cost_to_finish

        out["cost"] = record["cost/so_far"]
        out["cost_per_hour"] = record.get("cost/per_hour")
        out["cost_to_finish"] = cost_to_finish(record.get("cost/per_hour"), eta)
    return out


def _progress(m: dict, config: dict) -> tuple[float | None, float | None]:
    """(the share done, the ETA): the share the trainer logs (`train/progress`: it knows the run's steps,
    or its budget) — for a record of an older version without it, the share of a `ba` or `tok` duration
    — and the one ETA (`plan.cost.eta_s`)."""
    done = m.get("done")
    if done is None:
        try:
            d = parse_duration(config.get("training_duration"))
        except (ValueError, TypeError):
            return None, None
        if d.unit not in ("ba", "tok"):
            return None, None
        done = (m.get("step") or 0) / d.value if d.unit == "ba" else (m.get("tokens") or 0) / d.value
    return min(done, 1.0), eta_s(done, m.get("elapsed_s"))


def resolved_model_label(record: dict | None, auto: bool) -> str | None:
    """The shape a run trains, from the resolved config its save folder's run.json holds (``auto``:
    `model: auto` chose it — ``auto 4×128``); None where there is none yet."""
    m = ((record or {}).get("config") or {}).get("model")
    if not isinstance(m, dict) or not m.get("d_model"):
        return None
    label = m.get("preset") or f"{m['n_layers']}×{m['d_model']}" + (f" moe{m['n_experts']}" if m.get("n_experts") else "")
    return f"auto {label}" if auto else label if m.get("preset") else f"custom {label}"
