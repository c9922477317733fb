"""Experiment tracking: console, metrics.jsonl, report.html, MLflow and W&B behind one small interface.

:class:`TrackingCallback` builds the trackers once per run with :func:`build_trackers` and
calls ``log_params`` / ``log_metrics`` / ``log_text`` / ``log_model`` / ``finish`` on the
result. Backend run ids are kept in ``run_dir/trackers.json`` so a resumed run
continues the same MLflow and W&B runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TextIO

from lmforge.config.tracking import TrackerConfig
from lmforge.errors import UserError
from lmforge.plan.cost import live_cost
from lmforge.train.callbacks import Callback, RunInfo
from lmforge.tracking.base import Tracker, Trackers, flatten_params, warn_disabled
from lmforge.tracking.console import ConsoleTracker
from lmforge.tracking.jsonl import JsonlTracker, read_metrics
from lmforge.tracking.mlflow_tracker import default_tracking_uri, mlflow_ui_command
from lmforge.tracking.report import Render, ReportTracker
from lmforge.secrets import redact

STATE_FILE = "trackers.json"

__all__ = [
    "ConsoleTracker", "JsonlTracker", "Tracker", "Trackers", "TrackingCallback", "build_trackers",
    "default_tracking_uri", "flatten_params", "mlflow_ui_command", "read_metrics",
    "read_state",
]


def read_state(run_dir: str | os.PathLike) -> dict:
    """The backend run ids stored for run_dir ({} when none or unreadable)."""
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(run_dir: Path, state: dict) -> None:
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)  # never a half-written file


def build_trackers(cfg: TrackerConfig, *, run_name: str, run_dir: str,
                   resume: bool = False, total_steps: int | None = None,
                   total_tokens: int | None = None, is_main: bool = True,
                   stream: TextIO | None = None, render_report: Render | None = None) -> Trackers:
    """Start the trackers cfg asks for; one that fails to start is skipped with a warning.

    Non-main ranks get an empty Trackers. With ``resume`` the MLflow/W&B runs
    recorded in run_dir/trackers.json are continued. ``stream`` (default stdout)
    is where the console tracker writes; ``render_report`` draws report.html
    (`report.write_run_report`; None: the report tracker keeps only its files).
    """
    if not is_main:
        return Trackers([])
    out = stream or sys.stdout
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = read_state(directory) if resume else {}
    trackers: list[Tracker] = []

    if cfg.console:
        trackers.append(ConsoleTracker(total_steps=total_steps, total_tokens=total_tokens,
                                       stream=out, run_name=run_name))
    if cfg.jsonl:
        try:
            trackers.append(JsonlTracker(directory, resume=resume))
        except OSError as exc:
            warn_disabled("jsonl", exc)
        if cfg.report:  # reads what the JSONL tracker wrote, so it comes right after it
            try:
                trackers.append(ReportTracker(directory, run_name, resume=resume, render=render_report))
            except Exception as exc:  # noqa: BLE001 - a report never stops a run
                warn_disabled("report", exc)

    new_state: dict = {}
    if cfg.mlflow is not None:
        try:
            from lmforge.tracking.mlflow_tracker import MlflowTracker

            stored = state.get("mlflow", {})
            uri = redact(cfg.mlflow.tracking_uri or default_tracking_uri())  # kept in trackers.json: no password
            # A stored run id only means something in the store that holds it.
            run_id = stored.get("run_id") if stored.get("tracking_uri") == uri else None
            tracker = MlflowTracker(cfg.mlflow, run_name, run_id=run_id,
                                    tags={"lmforge.run_dir": str(directory.resolve())})
            trackers.append(tracker)
            new_state["mlflow"] = {"tracking_uri": redact(tracker.tracking_uri),
                                   "experiment_id": tracker.experiment_id,
                                   "run_id": tracker.run_id}
        except UserError:  # a model_registry_path the registry refuses: bad input, before training
            raise
        except Exception as exc:  # noqa: BLE001 - tracking never stops a run
            warn_disabled("mlflow", exc)
    if cfg.wandb is not None:
        try:
            from lmforge.tracking.wandb_tracker import WandbTracker

            stored = state.get("wandb", {})
            tracker = WandbTracker(cfg.wandb, run_name, directory, run_id=stored.get("id"))
            trackers.append(tracker)
            new_state["wandb"] = {"id": tracker.run_id, "project": cfg.wandb.project,
                                  "entity": cfg.wandb.entity, "mode": tracker.mode}
        except Exception as exc:  # noqa: BLE001
            warn_disabled("wandb", exc)

    if new_state:
        # Keep entries of backends that are off this time, so turning one back on resumes it.
        _write_state(directory, {**state, **new_state})
    return Trackers(trackers)


class TrackingCallback(Callback):
    """The trainer's metrics and texts, fanned out to the trackers the config asks for.

    The trackers start with the training (`on_start`), so a resumed training continues the
    MLflow / W&B runs recorded in the save folder. With ``compute.price_per_gpu_hour`` every
    training record that carries the trainer's ``time/elapsed_s`` also gets ``cost/so_far`` and
    ``cost/per_hour`` here, so that every back-end (and `runs describe`, the report) shows the
    same numbers while the trainer knows nothing of prices. A completed run's export goes to the
    model registries (`log_model`) before the trackers close.
    """

    def __init__(self, cfg: TrackerConfig, stream: TextIO | None = None, render_report: Render | None = None):
        self.cfg, self.stream, self.render_report = cfg, stream, render_report
        self.trackers = Trackers([])
        self.price: float | None = None
        self.devices = 1

    def on_start(self, info: RunInfo) -> None:
        self.price = (info.config.get("compute") or {}).get("price_per_gpu_hour")
        self.devices = int(info.plan.get("world_size") or 1)
        self.trackers = build_trackers(self.cfg, run_name=info.name, run_dir=info.save_folder, resume=info.resumed,
                                       total_steps=info.total_steps, total_tokens=info.total_tokens,
                                       stream=self.stream, render_report=self.render_report)
        self.trackers.log_params(info.config | {"plan": info.plan})

    def on_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.price is not None and "time/elapsed_s" in metrics:
            metrics = metrics | live_cost(metrics["time/elapsed_s"], self.devices, self.price)
        self.trackers.log_metrics(metrics, step)

    def on_text(self, key: str, text: str, step: int) -> None:
        self.trackers.log_text(key, text, step)

    def on_end(self, status: str, final_dir: str | None, error: str | None = None) -> None:
        if status == "completed" and final_dir:
            self.trackers.log_model(final_dir)  # model registries (MLflow, W&B); a failure there is only a warning
        self.trackers.finish(status, error)
