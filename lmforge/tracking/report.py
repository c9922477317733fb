"""The report back-end: keeps ``<save_folder>/report.html`` current while a run trains.

It has the report rewritten whenever eval (or ICL/gauntlet) metrics arrive and once more at the
end, from the files the other back-ends write (it comes after the JSONL tracker, so the
records of this eval are already on disk). The page itself is drawn by the renderer the
operations give it (`report.write_run_report`): tracking knows nothing of HTML. It also leaves in the folder what only the
training process knows, so that a report made later from the folder alone is complete:

- ``plan.json``: the run's own plan as ``lmforge estimate`` shows it (model, tokens, devices, speed
  and where it comes from, price), saved by the run when it starts — the "plan" the report holds
  against what happened;
- ``events.jsonl``: ``started`` / ``resumed`` / ``finished`` (with the status), next to the
  elastic restarts the trainer already records there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from lmforge.tracking.base import Tracker

# (run folder, run name, status, report path): writes the page (`report.write_run_report`).
Render = Callable[[str, str, str, str], None]

PLAN_FILE = "plan.json"
EVENTS_FILE = "events.jsonl"
REPORT_FILE = "report.html"
# Metric families whose arrival means "an eval happened": time to refresh the report.
_EVAL_PREFIXES = ("eval/", "eval", "icl/", "gauntlet/")


class ReportTracker(Tracker):
    name = "report"

    def __init__(self, run_dir: str | os.PathLike, run_name: str, resume: bool = False,
                 render: Render | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.render = render  # None: plan.json and events.jsonl only
        self.path = self.run_dir / REPORT_FILE
        events = self.run_dir / EVENTS_FILE
        if not resume and events.exists():
            _start_events_anew(events, self.run_dir / "run.json")
        self._event({"event": "resumed" if resume else "started"})

    def _event(self, record: dict) -> None:
        import time

        with open(self.run_dir / EVENTS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 3)} | record) + "\n")

    def log_params(self, params: dict) -> None:
        plan = run_plan(params)
        tmp = self.run_dir / (PLAN_FILE + ".tmp")
        tmp.write_text(json.dumps(plan, indent=1, default=str) + "\n")
        os.replace(tmp, self.run_dir / PLAN_FILE)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if any(k.startswith(_EVAL_PREFIXES) for k in metrics):
            self.write()

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        self._event({"event": "finished", "status": status} | ({"error": error} if error else {}))
        self.write(status.upper())

    def write(self, status: str = "RUNNING") -> None:
        if self.render is not None:
            self.render(str(self.run_dir), self.run_name, status, str(self.path))


def _start_events_anew(events: Path, run_file: Path) -> None:
    """A fresh run in a reused folder: drop the old run's events, but keep what this start
    already recorded (an elastic restart is written after run.json, before the trackers)."""
    try:
        since = run_file.stat().st_mtime
    except OSError:
        since = float("inf")
    kept = []
    for line in events.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("time", 0) >= since:
                kept.append(line)
        except (json.JSONDecodeError, AttributeError):
            continue
    events.write_text("".join(k + "\n" for k in kept), encoding="utf-8")


def run_plan(params: dict) -> dict:
    """plan.json: what the run planned, as its plan saved it (``plan.report``: `plan.estimate.run_record`,
    the estimate a view of the run's own plan). Read as it is, never recomputed; a caller that gives
    only steps and devices gets those, and no estimate."""
    plan = params.get("plan") or {}
    if plan.get("report"):
        return plan["report"]
    p = params.get("parameters") or {}
    ctx, gbs, total_steps = p.get("context_length"), p.get("global_batch_size"), plan.get("total_steps")
    tokens_per_step = ctx * gbs if isinstance(ctx, int) and isinstance(gbs, int) else None
    return {"devices": int(plan.get("world_size") or 1), "total_steps": total_steps,
            "total_tokens": total_steps * tokens_per_step if total_steps and tokens_per_step else None,
            "tokens_per_step": tokens_per_step, "price_per_gpu_hour": (params.get("compute") or {}).get("price_per_gpu_hour"),
            "training_duration": params.get("training_duration"), "estimate": None}
