"""metrics.jsonl in the run folder: one JSON object per log_metrics call.

Another process (``lmforge runs logs``, a plotting script) may tail the file,
so every record is flushed at once. After a resume the file is appended to;
steps between the checkpoint and the crash then appear twice, and readers
should keep the last record of a step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lmforge.tracking.base import Tracker, finite_or_none, scalar_metrics

METRICS_FILE = "metrics.jsonl"
GENERATIONS_FILE = "generations.jsonl"


class JsonlTracker(Tracker):
    """Appends metrics to run_dir/metrics.jsonl and texts to run_dir/generations.jsonl."""

    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike, resume: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.text_path = self.run_dir / GENERATIONS_FILE
        # A fresh run in a reused folder starts a new history; a resumed one keeps it.
        mode = "a" if resume else "w"
        self._file = open(self.path, mode, encoding="utf-8")
        if not resume and self.text_path.exists():
            self.text_path.unlink()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        record: dict = {"step": int(step), "time": round(time.time(), 3)}
        for key, value in scalar_metrics(metrics).items():
            record[key] = finite_or_none(value)  # keep the file strict JSON
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_text(self, key: str, text: str, step: int) -> None:
        record = {"step": int(step), "time": round(time.time(), 3), "key": key, "text": text}
        with open(self.text_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        if not self._file.closed:
            self._file.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a metrics.jsonl, ignoring a half-written last line (the writer may be live)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
