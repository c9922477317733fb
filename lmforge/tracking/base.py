"""The tracker interface and the fan-out that keeps a run alive when a tracker breaks."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from lmforge.secrets import redact

# Statuses a run can finish with; each backend maps them to its own vocabulary.
FINISH_STATUSES = ("completed", "failed", "stopped")


class Tracker:
    """A sink for run parameters, metrics and texts. Every method is a no-op by default."""

    name = "tracker"

    def log_params(self, params: dict) -> None:
        """Record the run's (nested) configuration; nested keys become "a.b.c"."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar metrics at an optimizer step."""

    def log_text(self, key: str, text: str, step: int) -> None:
        """Record a text, e.g. the generations of an eval."""

    def log_model(self, final_dir: str) -> None:
        """Record the exported final model (weights + tokenizer folder), once, at the end of a run.

        A back-end that registers models must not raise: the run has already finished well,
        so a failure here is its own warning line, never the end of the tracker or the run.
        """

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        """Close the tracker; status is one of completed | failed | stopped (``error``: what ended a
        failed run, in one line)."""


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into {"a.b.c": value}; lists stay whole values."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep the numeric entries as Python floats (tensors and numpy scalars included)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):  # torch / numpy scalars
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key] = float(value)
    return out


def finite_or_none(value: float) -> float | None:
    """NaN/inf are not JSON; backends that need JSON get None instead."""
    return value if math.isfinite(value) else None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def warn_disabled(name: str, exc: BaseException, stream: TextIO | None = None) -> None:
    """The single warning line printed when a tracker is switched off."""
    # The error of a client often quotes its URI (http://user:PASSWORD@host/): printed, then kept in
    # the run's log.
    print(redact(f"warning: {name} tracking disabled ({one_line(exc)})"),
          file=stream or sys.stderr, flush=True)


class Trackers(Tracker):
    """Fans every call out to its trackers; one that raises is dropped with one warning.

    Tracking must never kill a training run, so exceptions from a tracker are
    swallowed (after the warning) and that tracker gets no further calls.
    Usable as a context manager: an exception finishes the trackers as failed
    (stopped for Ctrl-C) and propagates.
    """

    name = "trackers"

    def __init__(self, trackers: list[Tracker] | None = None,
                 warn_stream: TextIO | None = None) -> None:
        self.trackers: list[Tracker] = list(trackers or [])
        self.warn_stream = warn_stream
        self.finished = False

    def __len__(self) -> int:
        return len(self.trackers)

    def __iter__(self):
        return iter(self.trackers)

    def disable(self, tracker: Tracker, exc: BaseException) -> None:
        warn_disabled(tracker.name, exc, self.warn_stream)
        self.trackers = [t for t in self.trackers if t is not tracker]

    def _call(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker must never kill the run
                self.disable(tracker, exc)

    def log_params(self, params: dict) -> None:
        self._call("log_params", params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call("log_metrics", metrics, step)

    def log_text(self, key: str, text: str, step: int) -> None:
        self._call("log_text", key, text, step)

    def log_model(self, final_dir: str) -> None:
        self._call("log_model", final_dir)

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        if status not in FINISH_STATUSES:
            raise ValueError(f"finish status must be one of {FINISH_STATUSES}, got {status!r}")
        if self.finished:  # idempotent: the trainer and a context manager may both call it
            return
        self.finished = True
        if error:

            error = redact(error)  # it reaches files and servers (events.jsonl, an MLflow tag)
        self._call("finish", status, error)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            status = "completed"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "stopped"
        else:
            status = "failed"
        self.finish(status, one_line(exc) if status == "failed" else None)
